"""The whole product once, as a user runs it: `sluice keys create`, `sluice serve` as its own process
on Postgres and Redis with real models in both tiers (SmolLM2-135M, the `tiny` demo model, as the
small tier; Qwen2.5-Coder-0.5B, the `small` demo model, as the large tier), the official `openai` SDK
as the client, and the accounting rows read back from Postgres."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from engines.registry import resolve_model

STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def demo_models() -> list[Path]:
    try:
        return [resolve_model("tiny"), resolve_model("small")]
    except FileNotFoundError as exc:
        pytest.skip(f"{exc} (make test fetches it)")


@pytest.fixture(scope="module")
def gateway_env(postgres_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    spool = tmp_path_factory.mktemp("spool")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(
        {
            "SLUICE_DATABASE__URL": postgres_url,
            "SLUICE_REDIS__URL": redis_url,
            "SLUICE_SERVER__PORT": str(free_port()),
            "SLUICE_SERVER__SPOOL_DIR": str(spool),
            "SLUICE_TIERS__SMALL__MODEL": "tiny",
            "SLUICE_TIERS__LARGE__MODEL": "small",
            "SLUICE_TIERS__SMALL__KV_CACHE_MB": "64",
            "SLUICE_TIERS__LARGE__KV_CACHE_MB": "64",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def sluice(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def gateway(
    demo_models: list[Path], gateway_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    log = (tmp_path_factory.mktemp("log") / "gateway.log").open("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--log-level", "warning"],
        env=gateway_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{gateway_env['SLUICE_SERVER__PORT']}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(f"sluice serve exited with {process.returncode}:\n{log.read()[-4000:]}")
            try:
                if httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("sluice serve did not become healthy in time")
            time.sleep(0.5)
        yield base_url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


# A tenant of this run alone: the response cache lives in the shared Redis and is scoped by tenant, so an
# earlier run's answers to the same temperature-0 questions would otherwise be served from it.
TENANT = f"acme-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def api_key(gateway_env: dict[str, str]) -> str:
    created = json.loads(sluice(gateway_env, "keys", "create", "--tenant", TENANT, "--feature", "e2e"))
    assert created["secret"].startswith("sk-")
    return created["secret"]


def count_rows(postgres_url: str, request_ids: list[str]) -> list[sa.Row]:
    import asyncio

    async def query() -> list[sa.Row]:
        engine = create_async_engine(postgres_url)
        try:
            async with engine.connect() as connection:
                result = await connection.execute(
                    sa.text(
                        "select request_id, tenant, feature, tier, stream, status, prompt_tokens, completion_tokens,"
                        " cost_usd, latency_ms from requests where request_id = any(:ids)"
                    ),
                    {"ids": request_ids},
                )
                return list(result)
        finally:
            await engine.dispose()

    return asyncio.run(query())


def test_openai_sdk_gets_real_answers_and_every_request_is_accounted(
    gateway: str, api_key: str, postgres_url: str
) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=api_key, max_retries=0, timeout=120)

    raw = client.chat.completions.with_raw_response.create(
        model="sluice-small",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    completion = raw.parse()
    answer = completion.choices[0].message.content
    assert answer and answer.strip()
    assert completion.usage.prompt_tokens > 0 and 0 < completion.usage.completion_tokens <= 24
    assert (raw.headers["x-sluice-tier"], raw.headers["x-sluice-cache"]) == ("small", "miss")
    plain_id = raw.headers["x-request-id"]
    again = client.chat.completions.with_raw_response.create(
        model="sluice-small",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert again.headers["x-sluice-cache"] == "exact"  # the same deterministic question, from the cache
    assert again.parse().choices[0].message.content == answer

    with client.chat.completions.with_streaming_response.create(
        model="sluice-large",
        messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ) as response:
        stream_id = response.headers["x-request-id"]
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    rows: list[sa.Row] = []
    deadline = time.monotonic() + 15
    while len(rows) < 2 and time.monotonic() < deadline:
        time.sleep(0.3)
        rows = count_rows(postgres_url, [plain_id, stream_id])
    by_id = {row.request_id: row for row in rows}
    assert set(by_id) == {plain_id, stream_id}, "accounting rows missing in Postgres"
    plain, streamed = by_id[plain_id], by_id[stream_id]
    assert (plain.tenant, plain.feature, plain.tier, plain.stream, plain.status) == (TENANT, "e2e", "small", False, 200)
    assert plain.prompt_tokens == completion.usage.prompt_tokens
    assert plain.completion_tokens == completion.usage.completion_tokens
    assert plain.cost_usd > 0 and plain.latency_ms > 0
    assert (streamed.tier, streamed.stream, streamed.status) == ("large", True, 200)
    assert streamed.completion_tokens == chunks[-1].usage.completion_tokens


def test_requests_without_a_valid_key_are_refused_openai_style(gateway: str) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-sluice-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as excinfo:
        client.chat.completions.create(model="sluice-small", messages=[{"role": "user", "content": "hi"}])
    assert excinfo.value.status_code == 401
