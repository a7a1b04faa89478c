"""AsyncLLMEngine: streams deltas to asyncio consumers; a consumer that goes away aborts its request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engines.llm_engine import AsyncLLMEngine
from engines.sampling_params import SamplingParams
from tests.engine.conftest import TinyModel, generated_ids, make_engine

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11]


@pytest.fixture
async def async_engine(tiny_llama: TinyModel) -> AsyncIterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(make_engine(tiny_llama))
    yield engine
    await engine.shutdown()


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
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    stream = async_engine.generate("r", PROMPT, params)
    async for _ in stream:
        break
    await stream.aclose()
    await wait_until_idle(async_engine)


async def test_a_cancelled_consumer_aborts_its_request(async_engine: AsyncLLMEngine) -> None:
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


async def test_abort_ends_the_stream_with_an_abort_delta(async_engine: AsyncLLMEngine) -> None:
    outputs = []
    async for output in async_engine.generate("r", PROMPT, SamplingParams(temperature=0, max_tokens=200,
                                                                            ignore_eos=True)):
        outputs.append(output)
        if len(outputs) == 2:
            await async_engine.abort("r")
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    await wait_until_idle(async_engine)


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
