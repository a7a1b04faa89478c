"""The step thread: every in-process engine loads and steps on one thread (libgomp's worker pools stay
one), engines take turns on it, and an interactive request queued for it cuts a batch-only step short."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from engines import llm_engine
from engines.config import EngineConfig
from engines.llm_engine import AsyncLLMEngine
from engines.sampling_params import SamplingParams
from engines.step_thread import STEP_THREAD
from tests.engine.conftest import TinyModel, generated_ids, make_engine, run_to_completion

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_calls_run_on_the_step_thread_and_their_errors_are_raised_to_the_caller() -> None:
    assert STEP_THREAD.call(lambda: threading.current_thread().name) == "sluice-engine-step"
    with pytest.raises(ZeroDivisionError):
        STEP_THREAD.call(lambda: 1 / 0)
    assert STEP_THREAD.call(lambda: STEP_THREAD.call(lambda: 7)) == 7  # a call from the step thread runs inline


async def test_an_engine_is_built_on_the_step_thread(tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    built_on: list[str] = []

    def build(config: EngineConfig) -> llm_engine.LLMEngine:
        built_on.append(threading.current_thread().name)
        return make_engine(tiny_llama)

    monkeypatch.setattr(llm_engine, "LLMEngine", build)
    engine = await asyncio.to_thread(AsyncLLMEngine.build, EngineConfig(model="tiny"))
    try:
        assert built_on == ["sluice-engine-step"]
        # Constrained decoding's vocabulary index is built there too, not by the first request with a schema.
        assert engine.engine._grammars is not None
        assert [o async for o in engine.generate("r", PROMPT, GREEDY)][-1].finished
    finally:
        await engine.shutdown()


async def test_two_engines_take_turns_on_the_one_thread_and_each_streams_what_it_would_alone(
    tiny_llama: TinyModel,
) -> None:
    alone = make_engine(tiny_llama)
    alone.add_request("r", PROMPT, GREEDY)
    expected = generated_ids(run_to_completion(alone)["r"])
    first, second = AsyncLLMEngine(make_engine(tiny_llama)), AsyncLLMEngine(make_engine(tiny_llama))

    async def stream(engine: AsyncLLMEngine) -> list[int]:
        return generated_ids([output async for output in engine.generate("r", PROMPT, GREEDY)])

    try:
        results = await asyncio.gather(stream(first), stream(second))
    finally:
        await first.shutdown()
        await second.shutdown()
    assert results == [expected, expected]


async def test_an_interactive_request_queued_for_the_step_thread_is_seen_by_the_engine_between_layers(
    tiny_llama: TinyModel,
) -> None:
    engine, other = AsyncLLMEngine(make_engine(tiny_llama)), AsyncLLMEngine(make_engine(tiny_llama))
    waiting, other_waiting = engine.engine.interactive_waiting, other.engine.interactive_waiting
    assert waiting is not None and other_waiting is not None and not waiting()
    try:
        with STEP_THREAD.condition:  # the step thread cannot take the commands meanwhile
            batch_params = dataclasses.replace(GREEDY, priority="batch")
            batch = asyncio.ensure_future(anext(engine.generate("b", PROMPT, batch_params)))
            await asyncio.sleep(0)
            assert not waiting()  # a batch request cuts nothing short
            interactive = asyncio.ensure_future(anext(engine.generate("i", PROMPT, GREEDY)))
            await asyncio.sleep(0)
            assert waiting() and other_waiting()  # the other engine's batch steps yield too: same thread
        await asyncio.gather(batch, interactive)
        assert not waiting() and not other_waiting()  # the step thread took the commands
    finally:
        await engine.shutdown()
        await other.shutdown()


def test_a_forked_child_gets_a_step_thread_of_its_own() -> None:
    import multiprocessing

    STEP_THREAD.call(lambda: None)  # the parent's step thread is running
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        name = pool.apply_async(_step_thread_name).get(timeout=30)  # without a thread of its own: hangs
    assert name == "sluice-engine-step"


def _step_thread_name() -> str:
    return STEP_THREAD.call(lambda: threading.current_thread().name)
