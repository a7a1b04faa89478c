"""AsyncLLMEngine: streams deltas to asyncio consumers; a consumer that goes away aborts its request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engines.llm_engine import AsyncLLMEngine, EngineStats
from engines.outputs import EngineOverloaded
from engines.sampling_params import SamplingParams
from tests.engine.conftest import TinyModel, generated_ids, make_engine

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11]


@pytest.fixture
async def async_engine(tiny_llama: TinyModel) -> AsyncIterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(make_engine(tiny_llama))
    yield engine
    await engine.shutdown()


async def assert_cut_short(engine: AsyncLLMEngine, before: EngineStats, aborted: int, max_tokens: int) -> None:
    """The requests were aborted, not run to their end: an abort that does nothing would still
    leave the engine idle once the requests finish on their own (and stale statistics look idle)."""
    for _ in range(500):
        if engine.stats().num_aborted_total - before.num_aborted_total >= aborted:
            break
        await asyncio.sleep(0.01)
    after = engine.stats()
    assert after.num_aborted_total - before.num_aborted_total == aborted
    assert after.num_generated_tokens_total - before.num_generated_tokens_total < aborted * max_tokens // 2


async def wait_until_idle(engine: AsyncLLMEngine) -> None:
    for _ in range(500):
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_used == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {engine.stats()}")


async def test_generate_streams_the_same_tokens_as_the_synchronous_engine(
        async_engine: AsyncLLMEngine, tiny_llama: TinyModel) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sync_engine = make_engine(tiny_llama)
    sync_engine.add_request("r", PROMPT, params)
    expected = []
    while sync_engine.has_unfinished_requests():
        expected += [t for o in sync_engine.step() for t in o.new_token_ids]

    outputs = [output async for output in async_engine.generate("r", PROMPT, params)]
    assert generated_ids(outputs) == expected
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"


async def test_concurrent_requests_each_get_their_own_stream(async_engine: AsyncLLMEngine) -> None:
    async def run(request_id: str, max_tokens: int) -> list:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [o async for o in async_engine.generate(request_id, PROMPT, params)]

    results = await asyncio.gather(*(run(f"r{i}", 3 + i) for i in range(5)))
    for i, outputs in enumerate(results):
        assert {o.request_id for o in outputs} == {f"r{i}"}
        assert len(generated_ids(outputs)) == 3 + i
    await wait_until_idle(async_engine)


async def test_a_consumer_that_stops_iterating_aborts_its_request(async_engine: AsyncLLMEngine) -> None:
    before = async_engine.stats()
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    stream = async_engine.generate("r", PROMPT, params)
    async for _ in stream:
        break
    await stream.aclose()
    await wait_until_idle(async_engine)
    await assert_cut_short(async_engine, before, aborted=1, max_tokens=200)


async def test_a_cancelled_consumer_aborts_its_request(async_engine: AsyncLLMEngine) -> None:
    before = async_engine.stats()
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in async_engine.generate("r", PROMPT, SamplingParams(temperature=0, max_tokens=200,
                                                                           ignore_eos=True)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until_idle(async_engine)
    await assert_cut_short(async_engine, before, aborted=1, max_tokens=200)


async def test_abort_ends_the_stream_with_an_abort_delta(async_engine: AsyncLLMEngine) -> None:
    before = async_engine.stats()
    outputs = []
    async for output in async_engine.generate("r", PROMPT, SamplingParams(temperature=0, max_tokens=200,
                                                                            ignore_eos=True)):
        outputs.append(output)
        if len(outputs) == 2:
            await async_engine.abort("r")
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert len(outputs) < 50  # cut short of its 200 tokens
    await wait_until_idle(async_engine)
    await assert_cut_short(async_engine, before, aborted=1, max_tokens=200)  # the engine stopped too


async def test_an_invalid_request_raises_value_error(async_engine: AsyncLLMEngine) -> None:
    with pytest.raises(ValueError, match="maximum context length"):
        async for _ in async_engine.generate("r", PROMPT, SamplingParams(max_tokens=10_000)):
            pass


async def test_streams_still_open_at_shutdown_end_with_an_abort_delta(tiny_llama: TinyModel) -> None:
    engine = AsyncLLMEngine(make_engine(tiny_llama))
    stream = engine.generate("r", PROMPT, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    first = await anext(stream)
    await engine.shutdown()
    rest = [output async for output in stream]
    assert not first.finished
    assert rest[-1].finish_reason == "abort"


async def test_a_full_queue_refuses_at_once_instead_of_queueing_without_bound(tiny_llama: TinyModel) -> None:
    engine = AsyncLLMEngine(make_engine(tiny_llama, max_num_seqs=1, max_num_waiting=1))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    try:
        running, waiting = engine.generate("a", PROMPT, params), engine.generate("b", PROMPT, params)
        await anext(running)
        pending = asyncio.ensure_future(anext(waiting))  # queued behind "a"
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloaded):
            await anext(engine.generate("c", PROMPT, params))
        await running.aclose()  # room again: "b" runs, and a new request is taken
        await pending
        await waiting.aclose()
        assert [o async for o in engine.generate("d", PROMPT, SamplingParams(max_tokens=2))][-1].finished
    finally:
        await engine.shutdown()
