"""No request, however malformed, gets a 5xx from the gateway; bad bodies get OpenAI-style 4xx errors.

Schemathesis generates requests (valid and invalid) for every operation of the gateway's OpenAPI
schema. The gateway runs for real: Postgres accounting, Redis limits, and both tiers served over
HTTP by the fake upstream, so the whole request path is exercised.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import hypothesis
import pytest
import redis
import schemathesis
from litestar import Litestar
from litestar.testing import AsyncTestClient
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.python import asgi as schemathesis_asgi

from bench.fake_upstream import serving_in_thread
from gateway.app import create_app
from gateway.config import DatabaseConfig, PolicyConfig, RedisConfig, ServerConfig, Settings, TierConfig
from gateway.db.database import make_database
from gateway.keys import create_key

ADMIN_KEY = "sk-admin-fuzz"
OPENAPI_PATH = "/openapi/openapi.json"
MAX_EXAMPLES_PER_OPERATION = 25


@pytest.fixture(scope="module")
def upstream_url() -> Iterator[str]:
    with serving_in_thread() as url:
        yield url


@pytest.fixture(scope="module")
def module_redis_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"sluice-test:fuzz:{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        if keys := list(client.scan_iter(match=f"{prefix}*", count=1000)):
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="module")
def settings(
    postgres_url: str, redis_url: str, upstream_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Settings:
    return Settings(
        server=ServerConfig(admin_key=ADMIN_KEY, spool_dir=str(tmp_path_factory.mktemp("spool"))),
        database=DatabaseConfig(url=postgres_url, flush_interval_ms=50),
        redis=RedisConfig(url=redis_url),
        tiers={"small": TierConfig(url=upstream_url), "large": TierConfig(url=upstream_url)},
        policies={"default": PolicyConfig(rpm=1_000_000, tpm=1_000_000_000, cache="exact")},
    )


@pytest.fixture(scope="module")
async def api_key(postgres_url: str) -> str:
    engine = make_database(postgres_url)
    try:
        return (await create_key(engine, tenant="fuzz", feature="default", name="fuzz")).secret
    finally:
        await engine.dispose()


def make_app(settings: Settings, redis_prefix: str) -> Litestar:
    return create_app(settings, redis_prefix=redis_prefix, key_cache_ttl_s=0.0)


# --- generated requests ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzzed_app(settings: Settings, module_redis_prefix: str) -> Iterator[Litestar]:
    """The app schemathesis calls; its lifespan runs on schemathesis's own event loop thread."""
    yield make_app(settings, module_redis_prefix)
    schemathesis_asgi.shutdown_lifespans()


def fuzz_operation(operation: schemathesis.APIOperation, mode: GenerationMode, headers: dict[str, str]) -> None:
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(
        max_examples=MAX_EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(headers=headers, checks=[not_a_server_error])

    run()


def test_no_generated_request_gets_a_server_error(fuzzed_app: Litestar, api_key: str) -> None:
    """Valid and invalid requests for every operation; each operation and mode is reported apart.
    (Driven by hand rather than by `schemathesis.pytest`, whose fixture loader breaks on pytest 9.)"""
    schema = schemathesis.openapi.from_asgi(OPENAPI_PATH, fuzzed_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    failures = []
    for operation in operations:
        key = ADMIN_KEY if operation.path.startswith("/admin") else api_key
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzz_operation(operation, mode, {"Authorization": f"Bearer {key}"})
            except hypothesis.errors.Unsatisfiable:
                continue  # no invalid request exists for an operation without parameters or body
            except Exception as exc:
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)


# --- hand-written malformed bodies ------------------------------------------------------------------


@pytest.fixture(scope="module")
async def client(settings: Settings, module_redis_prefix: str, api_key: str) -> AsyncIterator[AsyncTestClient]:
    app = make_app(settings, module_redis_prefix + "manual:")
    async with AsyncTestClient(app, base_url="http://sluice.test") as test_client:
        test_client.headers["Authorization"] = f"Bearer {api_key}"
        yield test_client


VALID_MESSAGES = [{"role": "user", "content": "hi"}]

MALFORMED_CHAT_BODIES = {
    "invalid JSON": b'{"model": "sluice-small", "messages": [',
    "empty body": b"",
    "a JSON array": b"[]",
    "messages not a list": {"model": "sluice-small", "messages": "hi"},
    "messages missing": {"model": "sluice-small"},
    "model of the wrong type": {"model": 42, "messages": VALID_MESSAGES},
    "max_tokens of the wrong type": {"model": "sluice-small", "messages": VALID_MESSAGES, "max_tokens": "ten"},
    "negative max_tokens": {"model": "sluice-small", "messages": VALID_MESSAGES, "max_tokens": -5},
    "huge n": {"model": "sluice-small", "messages": VALID_MESSAGES, "n": 1_000_000},
    "a message without a role": {"model": "sluice-small", "messages": [{"content": "hi"}]},
    "temperature out of range": {"model": "sluice-small", "messages": VALID_MESSAGES, "temperature": 99},
    "an unknown model": {"model": "gpt-17", "messages": VALID_MESSAGES},
}


@pytest.mark.parametrize("body", MALFORMED_CHAT_BODIES.values(), ids=MALFORMED_CHAT_BODIES.keys())
async def test_a_malformed_chat_request_gets_an_openai_style_client_error(client: AsyncTestClient, body: Any) -> None:
    if isinstance(body, bytes):
        response = await client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    else:
        response = await client.post("/v1/chat/completions", json=body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert set(error) >= {"message", "type", "param", "code"}


async def test_a_malformed_text_completion_request_gets_an_openai_style_client_error(client: AsyncTestClient) -> None:
    response = await client.post("/v1/completions", json={"model": "sluice-small", "prompt": {"not": "a prompt"}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_a_well_formed_request_is_served_through_the_fake_upstream(client: AsyncTestClient) -> None:
    """The control case: the same client and app answer a valid request, so the errors above come
    from validation, not from a broken setup."""
    response = await client.post("/v1/chat/completions", json={"model": "sluice-small", "messages": VALID_MESSAGES})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "The quick brown fox jumps over the lazy dog."
