"""The Batch API: the official `openai` SDK against a served gateway, lines run through the request path
(key attribution, batch priority, discount), cancellation, and exactly-once across restarts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
import sqlalchemy as sa
from litestar.testing import AsyncTestClient

from engines.api.protocol import ChatCompletion, ChatCompletionRequest
from gateway.accounting import RequestRecord
from gateway.app import create_app
from gateway.config import BatchConfig, Settings
from gateway.db.database import make_database
from gateway.db.migrate import upgrade_async
from gateway.db.schema import batch_lines
from gateway.keys import create_key
from tests.conftest import _new_postgres_database
from tests.gateway.conftest import EXPENSIVE, loopback_socket, make_settings, served_on
from tests.gateway.scripted_tier import ScriptedTier

WAIT_S = 20.0  # upper bound for a batch to finish; never reached when things work
CHAT_URL = "/v1/chat/completions"
ROOT = Path(__file__).resolve().parents[2]


def jsonl(*bodies: dict[str, Any], url: str = CHAT_URL) -> bytes:
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body} for i, body in enumerate(bodies)]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_body(text: str = "say something", max_tokens: int = 2) -> dict[str, Any]:
    return {"model": "sluice-small", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


def with_batch(settings: Settings, tmp_path: Path, **config: Any) -> Settings:
    return msgspec.structs.replace(settings, batch=BatchConfig(dir=str(tmp_path / "batches"), **config))


def results(data: bytes) -> dict[str, dict[str, Any]]:
    """custom_id → result line; fails on a custom_id answered twice."""
    lines = [json.loads(line) for line in data.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a line was answered twice"
    return by_id


@pytest.fixture(params=["sqlite", "postgres"])
async def database_url(request: pytest.FixtureRequest, empty_sqlite_url: str) -> AsyncIterator[str]:
    """A migrated database private to the test: batch workers take any unfinished batch they find."""
    if request.param == "sqlite":
        await upgrade_async(empty_sqlite_url)
        yield empty_sqlite_url
        return
    async with _new_postgres_database(migrated=True) as url:
        yield url


# -- the official SDK against a served gateway ------------------------------------------------------------


@pytest.fixture
def served(database_url: str, tmp_path: Path) -> Iterator[tuple[str, list[RequestRecord]]]:
    records: list[RequestRecord] = []
    settings = with_batch(make_settings(database_url=database_url, tier_prices=EXPENSIVE), tmp_path)
    app = create_app(settings, {"small": ScriptedTier("small"), "large": ScriptedTier("large")},
                     record_sink=records.append)  # fmt: skip
    with served_on(app, loopback_socket(), WAIT_S) as url:
        yield f"{url}/v1", records


def wait_done(sdk: openai.OpenAI, batch_id: str) -> Any:
    for _ in range(int(WAIT_S / 0.05)):
        batch = sdk.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        threading.Event().wait(0.05)
    raise AssertionError(f"batch {batch_id} did not finish: {batch.status}")


def test_the_sdk_uploads_creates_polls_lists_and_downloads_a_batch(served: tuple[str, list[RequestRecord]]):
    base_url, records = served
    sdk = openai.OpenAI(base_url=base_url, api_key="local-dev", max_retries=0)
    data = jsonl(chat_body("a b", 2), chat_body("c", 3), {**chat_body(), "max_tokens": "ten"}, chat_body("d", 1))
    uploaded = sdk.files.create(file=("input.jsonl", data), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(data), "input.jsonl")
    assert sdk.files.retrieve(uploaded.id).id == uploaded.id
    assert sdk.files.content(uploaded.id).content == data

    created = sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT_URL, completion_window="24h",
                                 metadata={"job": "nightly"})  # fmt: skip
    assert created.status in ("validating", "in_progress", "completed") and created.metadata == {"job": "nightly"}
    batch = wait_done(sdk, created.id)
    assert batch.status == "completed" and batch.completed_at is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)

    output = results(sdk.files.content(batch.output_file_id).content)
    assert sorted(output) == ["req-0", "req-1", "req-3"]
    answer = msgspec.convert(output["req-1"]["response"]["body"], ChatCompletion)
    assert output["req-1"]["response"]["status_code"] == 200 and answer.usage.completion_tokens == 3
    assert output["req-1"]["response"]["body"]["choices"][0]["message"]["content"] == "one two three"
    errors = results(sdk.files.content(batch.error_file_id).content)
    assert list(errors) == ["req-2"] and errors["req-2"]["response"]["status_code"] == 400
    assert errors["req-2"]["response"]["body"]["error"]["param"] == "max_tokens"

    assert [b.id for b in sdk.batches.list(limit=10)] == [created.id]
    # Each line went through the request path once, at batch priority and half price ($1 per output token).
    served_lines = sorted((r.completion_tokens, r.cost_usd, r.priority, r.status) for r in records)
    assert served_lines == [(0, 0.0, "batch", 400), (1, 0.5, "batch", 200), (2, 1.0, "batch", 200),
                            (3, 1.5, "batch", 200)]  # fmt: skip
    assert {r.request_id.rsplit(".", 2)[0] for r in records} == {created.id}


def test_a_batch_of_responses_api_requests_answers_response_objects(served: tuple[str, list[RequestRecord]]):
    base_url, records = served
    sdk = openai.OpenAI(base_url=base_url, api_key="local-dev", max_retries=0)
    bodies = [{"model": "sluice-small", "input": "say something", "max_output_tokens": 2},
              {"model": "sluice-small", "input": "hi", "previous_response_id": "resp_1"}]
    uploaded = sdk.files.create(file=("input.jsonl", jsonl(*bodies, url="/v1/responses")), purpose="batch")
    batch = wait_done(sdk, sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses",
                                              completion_window="24h").id)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 1, 1)
    answer = results(sdk.files.content(batch.output_file_id).content)["req-0"]["response"]["body"]
    assert (answer["object"], answer["output"][0]["content"][0]["text"]) == ("response", "one two")
    error = results(sdk.files.content(batch.error_file_id).content)["req-1"]["response"]
    assert (error["status_code"], error["body"]["error"]["param"]) == (400, "previous_response_id")
    assert sorted((r.endpoint, r.status) for r in records) == [("chat", 200), ("chat", 400)]


def test_a_batch_of_embeddings_answers_each_line_with_its_vectors(served: tuple[str, list[RequestRecord]]):
    base_url, records = served
    sdk = openai.OpenAI(base_url=base_url, api_key="local-dev", max_retries=0)
    bodies = [{"model": "sluice-embed", "input": ["a cat", "a dog"]}, {"model": "sluice-embed", "input": "x",
                                                                        "dimensions": 8}]
    uploaded = sdk.files.create(file=("input.jsonl", jsonl(*bodies, url="/v1/embeddings")), purpose="batch")
    batch = wait_done(sdk, sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                              completion_window="24h").id)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 1, 1)
    answer = results(sdk.files.content(batch.output_file_id).content)["req-0"]["response"]["body"]
    assert [len(item["embedding"]) for item in answer["data"]] == [384, 384] and answer["usage"]["prompt_tokens"] > 0
    error = results(sdk.files.content(batch.error_file_id).content)["req-1"]["response"]
    assert (error["status_code"], error["body"]["error"]["param"]) == (400, "dimensions")
    assert sorted((r.endpoint, r.status) for r in records) == [("embeddings", 200), ("embeddings", 400)]


def test_the_sdk_lists_and_deletes_files(served: tuple[str, list[RequestRecord]]):
    sdk = openai.OpenAI(base_url=served[0], api_key="local-dev", max_retries=0)
    first = sdk.files.create(file=("one.jsonl", jsonl(chat_body("a", 1))), purpose="batch")
    second = sdk.files.create(file=("two.jsonl", jsonl(chat_body("b", 1))), purpose="batch")
    newest = [f.id for f in sdk.files.list(purpose="batch")]
    assert newest.index(second.id) < newest.index(first.id)  # newest first
    page = sdk.files.list(purpose="batch", limit=1)
    assert [f.id for f in page.data] == [newest[0]] and page.has_more
    assert [f.id for f in sdk.files.list(purpose="batch", limit=1)] == newest  # the SDK pages on with `after`
    assert [f.id for f in sdk.files.list(purpose="batch", order="asc")] == newest[::-1]

    batch = wait_done(sdk, sdk.batches.create(input_file_id=first.id, endpoint=CHAT_URL, completion_window="24h").id)
    assert batch.output_file_id in [f.id for f in sdk.files.list(purpose="batch_output")]
    assert batch.output_file_id not in newest

    deleted = sdk.files.delete(first.id)
    assert (deleted.id, deleted.deleted) == (first.id, True)
    assert first.id not in [f.id for f in sdk.files.list()]
    for gone in (lambda: sdk.files.retrieve(first.id), lambda: sdk.files.content(first.id),
                 lambda: sdk.files.delete(first.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    # The batch made from it still reads, and so does its output.
    assert sdk.batches.retrieve(batch.id).status == "completed"
    assert results(sdk.files.content(batch.output_file_id).content)
    with pytest.raises(openai.BadRequestError) as bad_limit:
        sdk.files.list(limit=0)
    assert bad_limit.value.param == "limit"


def test_the_sdk_gets_openai_errors_for_bad_batches(served: tuple[str, list[RequestRecord]]):
    sdk = openai.OpenAI(base_url=served[0], api_key="local-dev", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        sdk.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        sdk.batches.create(input_file_id="file-nope", endpoint=CHAT_URL, completion_window="24h")
    with pytest.raises(openai.BadRequestError) as wrong_purpose:
        sdk.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    assert wrong_purpose.value.param == "purpose"
    uploaded = sdk.files.create(file=("x.jsonl", jsonl(chat_body())), purpose="batch")
    with pytest.raises(openai.BadRequestError) as wrong_endpoint:
        sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/moderations", completion_window="24h")
    assert wrong_endpoint.value.param == "endpoint"
    bad = sdk.files.create(file=("bad.jsonl", b'{"custom_id": "a"}\nnot json\n' + jsonl(chat_body())), purpose="batch")
    failed = sdk.batches.create(input_file_id=bad.id, endpoint=CHAT_URL, completion_window="24h")
    assert failed.status == "failed" and failed.output_file_id is None
    assert [(e.line, e.code) for e in failed.errors.data] == [(1, "invalid_request"), (2, "invalid_json_line")]


# -- in process: keys, cancellation, restarts -------------------------------------------------------------


class GatedTier(ScriptedTier):
    """Answers its first `free` calls at once, then holds every call until `gate` is opened. Thread-safe
    events: the test client serves the app on a loop in another thread."""

    def __init__(self, name: str, free: int) -> None:
        super().__init__(name)
        self.free = free
        self.calls = 0
        self.holding = threading.Event()
        self.gate = threading.Event()

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion:
        self.calls += 1
        if self.calls > self.free:
            self.holding.set()
            while not self.gate.is_set():
                await asyncio.sleep(0.005)
        return await super().chat(request)


async def until(condition: Any) -> None:
    for _ in range(int(WAIT_S / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


@asynccontextmanager
async def gateway(settings: Settings, tier: ScriptedTier, records: list[RequestRecord]) -> AsyncIterator[Any]:
    app = create_app(settings, {"small": tier, "large": ScriptedTier("large")}, record_sink=records.append)
    async with AsyncTestClient(app) as client:
        yield client


async def submit(client: Any, data: bytes, headers: dict[str, str] | None = None) -> str:
    uploaded = await client.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"},
                                 headers=headers)  # fmt: skip
    assert uploaded.status_code == 200, uploaded.text
    body = {"input_file_id": uploaded.json()["id"], "endpoint": CHAT_URL, "completion_window": "24h"}
    created = await client.post("/v1/batches", json=body, headers=headers)
    assert created.status_code == 200, created.text
    return created.json()["id"]


async def finished(client: Any, batch_id: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    for _ in range(int(WAIT_S / 0.02)):
        batch = (await client.get(f"/v1/batches/{batch_id}", headers=headers)).json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch {batch_id} did not finish: {batch}")


async def content(client: Any, file_id: str | None, headers: dict[str, str] | None = None) -> dict[str, Any]:
    if file_id is None:
        return {}
    response = await client.get(f"/v1/files/{file_id}/content", headers=headers)
    assert response.status_code == 200
    return results(response.content)


async def attempts(database_url: str, batch_id: str, state: str | None = None) -> list[int]:
    """Each line's attempts (those in `state` only, else 0), in input order."""
    db = make_database(database_url)
    try:
        async with db.connect() as connection:
            query = sa.select(batch_lines.c.attempts, batch_lines.c.state).where(batch_lines.c.batch_id == batch_id)
            rows = (await connection.execute(query.order_by(batch_lines.c.line))).all()
    finally:
        await db.dispose()
    return [a if state is None or s == state else 0 for a, s in rows]


async def test_a_batch_file_may_be_larger_than_a_request_body_up_to_its_own_bound(sqlite_url: str, tmp_path: Path):
    """OpenAI takes batch input files up to 200 MB; requests keep the server's far smaller body bound."""
    settings = with_batch(make_settings(database_url=sqlite_url), tmp_path, max_file_bytes=64 * 1024)
    settings = msgspec.structs.replace(settings, server=msgspec.structs.replace(settings.server, max_body_bytes=4096))
    lines = jsonl(*(chat_body(f"question {i}") for i in range(120)))
    assert 4096 < len(lines) < 64 * 1024
    async with gateway(settings, ScriptedTier("small"), []) as client:
        batch = await finished(client, await submit(client, lines))
        assert (batch["status"], batch["request_counts"]["completed"]) == ("completed", 120)
        too_large = await client.post("/v1/files", files={"file": ("in.jsonl", lines * 10)}, data={"purpose": "batch"})
        assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
        long_chat = await client.post(CHAT_URL, json=chat_body("x" * 5000))
        assert long_chat.status_code == 413


async def test_lines_run_as_the_key_that_created_the_batch_and_other_tenants_see_nothing(
    database_url: str, tmp_path: Path
):
    records: list[RequestRecord] = []
    settings = with_batch(make_settings(database_url=database_url, allow_anonymous=False), tmp_path)
    db = make_database(database_url)
    try:
        owner = await create_key(db, tenant="acme", feature="reports")
        stranger = await create_key(db, tenant="other", feature="chat")
    finally:
        await db.dispose()
    mine, theirs = ({"authorization": f"Bearer {k.secret}"} for k in (owner, stranger))
    async with gateway(settings, ScriptedTier("small"), records) as client:
        batch_id = await submit(client, jsonl(chat_body(), chat_body()), mine)
        batch = await finished(client, batch_id, mine)
        assert (await client.get(f"/v1/batches/{batch_id}", headers=theirs)).status_code == 404
        assert (await client.get(f"/v1/files/{batch['output_file_id']}/content", headers=theirs)).status_code == 404
        assert (await client.get("/v1/batches", headers=theirs)).json()["data"] == []
        assert (await client.get("/v1/batches")).status_code == 401
    attribution = {(r.tenant, r.feature, r.key_id, r.priority) for r in records}
    assert attribution == {("acme", "reports", owner.key.id, "batch")}


async def test_a_cancelled_batch_finishes_its_lines_in_flight_and_reports_the_rest(database_url: str, tmp_path: Path):
    records: list[RequestRecord] = []
    tier = GatedTier("small", free=1)
    settings = with_batch(make_settings(database_url=database_url), tmp_path, concurrency=2)
    async with gateway(settings, tier, records) as client:
        batch_id = await submit(client, jsonl(*(chat_body() for _ in range(6))))
        await until(tier.holding.is_set)
        cancelling = (await client.post(f"/v1/batches/{batch_id}/cancel")).json()
        assert cancelling["status"] == "cancelling"
        tier.gate.set()
        batch = await finished(client, batch_id)
        output, errors = await content(client, batch["output_file_id"]), await content(client, batch["error_file_id"])
    assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    # The first line was answered, the second and third were in flight (both answered), the rest never ran.
    assert sorted(output) == ["req-0", "req-1", "req-2"]
    assert sorted(errors) == ["req-3", "req-4", "req-5"]
    assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
    assert tier.calls == 3 and len(records) == 3


async def test_a_gateway_stopped_mid_batch_resumes_it_and_answers_every_line_exactly_once(
    database_url: str, tmp_path: Path
):
    records: list[RequestRecord] = []
    settings = with_batch(make_settings(database_url=database_url), tmp_path, concurrency=2)
    first = GatedTier("small", free=3)
    async with gateway(settings, first, records) as client:
        batch_id = await submit(client, jsonl(*(chat_body(f"line {i}") for i in range(8))))
        await until(first.holding.is_set)
        await until(lambda: first.calls == 5)  # three answered, two held in flight
    # Stopped: the two calls in flight were cancelled (recorded as 499) and their lines handed back.
    assert sorted(r.status for r in records) == [200, 200, 200, 499, 499]
    second = ScriptedTier("small")
    async with gateway(settings, second, records) as client:
        batch = await finished(client, batch_id)
        output = await content(client, batch["output_file_id"])
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 8
    assert sorted(output) == [f"req-{i}" for i in range(8)] and batch["error_file_id"] is None
    assert len(second.requests) == 5  # the three answered lines were not run again
    assert await attempts(database_url, batch_id) == [1, 1, 1, 2, 2, 1, 1, 1]
    assert sorted(r.status for r in records) == [200] * 8 + [499, 499]
    assert len({r.request_id for r in records}) == 10


# -- a gateway killed mid-batch (SIGKILL: no clean shutdown) ----------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def gateway_process(database_url: str, directory: Path, *free: int) -> Iterator[openai.OpenAI]:
    """A gateway process (`tests.gateway.batch_server`), killed (SIGKILL) when the block ends."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.gateway.batch_server", database_url, str(directory),
                                str(port), *map(str, free)], cwd=ROOT)  # fmt: skip
    try:
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local-dev", max_retries=0, timeout=5)
        for _ in range(int(WAIT_S * 3 / 0.05)):  # the process imports the gateway first (seconds)
            try:
                sdk.batches.list()
                break
            except openai.APIConnectionError:
                assert process.poll() is None, "the gateway process exited"
                threading.Event().wait(0.05)
        yield sdk
    finally:
        process.kill()
        process.wait(WAIT_S)


def test_a_gateway_killed_mid_batch_and_restarted_answers_every_line_exactly_once(database_url: str, tmp_path: Path):
    lines = 40
    with gateway_process(database_url, tmp_path, 10) as sdk:  # answers 10 calls, hangs the rest
        uploaded = sdk.files.create(file=("in.jsonl", jsonl(*(chat_body(f"n {i}") for i in range(lines)))),
                                    purpose="batch")  # fmt: skip
        batch_id = sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT_URL, completion_window="24h").id
        for _ in range(int(WAIT_S / 0.01)):  # one read of every line's state: 10 done and 2 hung is stable
            done, running = (asyncio.run(attempts(database_url, batch_id, state)) for state in ("done", "running"))
            if done.count(1) == 10 and running.count(1) == 2:
                break
            threading.Event().wait(0.01)
        # killed here, two lines in flight (the context's exit sends SIGKILL)
    claimed = asyncio.run(attempts(database_url, batch_id))
    in_flight = [i for i, a in enumerate(asyncio.run(attempts(database_url, batch_id, "running"))) if a]
    assert sum(1 for a in claimed if a) == 12 and len(in_flight) == 2
    with gateway_process(database_url, tmp_path) as sdk:  # takes the batch over once the lease runs out
        batch = wait_done(sdk, batch_id)
        output = results(sdk.files.content(batch.output_file_id).content)
    assert batch.status == "completed" and batch.request_counts.completed == lines
    assert sorted(output) == sorted(f"req-{i}" for i in range(lines))
    assert all(line["response"]["status_code"] == 200 for line in output.values())
    final = asyncio.run(attempts(database_url, batch_id))
    # Only the lines claimed and unanswered at the kill ran again.
    assert [i for i, a in enumerate(final) if a == 2] == in_flight and set(final) == {1, 2}


async def test_lines_refused_for_a_while_wait_and_run_again_instead_of_failing(sqlite_url: str, tmp_path: Path):
    records: list[RequestRecord] = []
    tier = ScriptedTier("small")
    tier.down = True  # 503 tier_unavailable, Retry-After 5 s (no fallback for this feature)
    settings = with_batch(make_settings(database_url=sqlite_url, fallback=False), tmp_path)
    async with gateway(settings, tier, records) as client:
        batch_id = await submit(client, jsonl(*(chat_body() for _ in range(3))))
        await until(lambda: len(records) >= 3)
        tier.down = False
        batch = await finished(client, batch_id)
        output = await content(client, batch["output_file_id"])
    assert batch["status"] == "completed" and sorted(output) == ["req-0", "req-1", "req-2"]
    assert all(line["response"]["status_code"] == 200 for line in output.values())
    statuses = sorted(r.status for r in records)
    assert statuses[:3] == [200, 200, 200] and set(statuses[3:]) == {503}
    assert sum(await attempts(sqlite_url, batch_id)) == len(records)  # one accounting row per attempt


async def test_batch_lines_wait_while_an_interactive_slo_is_at_risk(sqlite_url: str, tmp_path: Path):
    records: list[RequestRecord] = []
    tier = ScriptedTier("small")
    now = [1000.0]
    settings = with_batch(make_settings(database_url=sqlite_url), tmp_path)
    async with gateway(settings, tier, records) as client:
        slo = client.app.state.gateway.slo
        slo.clock = lambda: now[0]
        for _ in range(30):
            slo.observe("small", 1400.0, 20.0)  # p99 TTFT at 93% of the small tier's 1500 ms
        batch_id = await submit(client, jsonl(chat_body(), chat_body()))
        await asyncio.sleep(1.0)  # a heartbeat or two: nothing is claimed
        waiting = (await client.get(f"/v1/batches/{batch_id}")).json()
        now[0] += 60  # the slow samples age out of the window
        batch = await finished(client, batch_id)
    assert waiting["status"] == "in_progress" and waiting["request_counts"]["completed"] == 0
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 2 and len(tier.requests) == 2


# -- the store's exactly-once rules, directly --------------------------------------------------------------


async def test_claims_are_exclusive_and_a_worker_whose_lease_ran_out_can_record_nothing(database_url: str):
    from datetime import UTC, datetime, timedelta

    from gateway.batches import store
    from gateway.batches.wire import InputLine

    db = make_database(database_url)
    now = datetime.now(UTC)
    row = {"id": "batch_test", "created_at": now, "tenant": "t", "feature": "f", "key_id": None,
           "endpoint": CHAT_URL, "input_file_id": "file-x", "completion_window": "24h", "status": "validating",
           "expires_at": now + timedelta(hours=24)}  # fmt: skip
    try:
        await store.insert_batch(db, row, [InputLine(line=i, custom_id=f"c{i}", body="{}") for i in range(4)])
        assert (await store.take_batch(db, "A", now, 10.0)).status == "in_progress"
        assert await store.take_batch(db, "B", now, 10.0) is None  # held by A
        claims = await asyncio.gather(*(store.claim_line(db, "batch_test", "A") for _ in range(3)))
        assert sorted(c.line for c in claims) == [0, 1, 2]
        assert await store.record_line(db, "batch_test", 0, "A", "r0", 200, "{}")
        assert not await store.record_line(db, "batch_test", 0, "A", "r0", 200, "{}")  # recorded once
        later = now + timedelta(seconds=11)  # A stopped renewing: B takes over
        assert (await store.take_batch(db, "B", later, 10.0)).id == "batch_test"
        assert await store.renew(db, "batch_test", "A", later, 10.0) is None
        assert not await store.record_line(db, "batch_test", 1, "A", "r1", 200, "{}")  # A's claim is void
        again = [await store.claim_line(db, "batch_test", "B") for _ in range(4)]
        assert [(c.line, c.attempt) for c in again if c] == [(1, 2), (2, 2), (3, 1)]  # line 0 never again
    finally:
        await db.dispose()
