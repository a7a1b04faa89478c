"""Engine faults (issue #14, item 6), on a real tiny model: a step that raises fails the requests in
flight cleanly, marks the engine unhealthy (health checks and fallback see it) and the step loop
carries on; an in-process request has a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import engines.llm_engine as llm_engine
from engines.api.client import EngineUnavailable
from engines.api.protocol import ChatCompletionRequest, ChatMessage
from engines.llm_engine import AsyncLLMEngine
from engines.outputs import EngineStepFailed
from engines.sampling_params import SamplingParams
from engines.serving import InProcessEngineClient, OpenAIServing
from tests.engine.conftest import TinyModel, _tiny_model, make_engine

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _tiny_model(Path(tmp_path_factory.mktemp("tiny")), "llama")


@pytest.fixture
async def engine(tiny: TinyModel) -> AsyncIterator[AsyncLLMEngine]:
    async_engine = AsyncLLMEngine(make_engine(tiny))
    yield async_engine
    await async_engine.shutdown()


def chat(max_tokens: int) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="tiny", messages=[ChatMessage(role="user", content="hello")], max_tokens=max_tokens
    )


async def test_a_step_that_raises_fails_the_requests_marks_unhealthy_and_the_loop_lives_on(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llm_engine, "UNHEALTHY_AFTER_FAILURE_S", 0.5)
    runner = engine.engine.runner
    execute = runner.execute

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("CUDA-like failure at /secret/path")

    runner.execute = broken
    client = InProcessEngineClient(OpenAIServing(engine, "tiny"))
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    with pytest.raises(EngineStepFailed) as failed:
        async with asyncio.timeout(10):
            async for _ in engine.generate("a", PROMPT, params):
                pass
    assert "secret" not in str(failed.value)
    assert not engine.healthy and not await client.ready()
    with pytest.raises(EngineUnavailable):  # the gateway falls back instead of queueing here
        await client.chat(chat(4))
    runner.execute = execute
    await asyncio.sleep(0.6)
    assert engine.healthy and await client.ready()
    outputs = [o async for o in engine.generate("b", PROMPT, params)]  # the same loop, still stepping
    assert outputs[-1].finish_reason == "length"
    for _ in range(500):  # statistics are as of the latest step
        if engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().kv_blocks_used == 0  # no blocks leaked by the failed request


async def test_an_in_process_request_has_a_deadline(engine: AsyncLLMEngine) -> None:
    client = InProcessEngineClient(OpenAIServing(engine, "tiny"), deadline_s=0.05)
    slow = chat(200)
    with pytest.raises(EngineUnavailable, match="within"):
        async with asyncio.timeout(10):
            await client.chat(slow)
    with pytest.raises(EngineUnavailable, match="past"):
        async with asyncio.timeout(10):
            async for _ in client.chat_stream(slow):
                pass
