"""The cascade over two real in-process engines (tiny random-weight checkpoints): the small tier's
logprobs come from the engine's sampler, and an escalated answer is exactly what the large tier says."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import numpy as np
import pytest

from engines.api.client import EngineClient
from engines.api.protocol import ChatCompletionRequest, ChatMessage
from engines.serving import build_in_process_client
from engines.tiers import TierSpec
from gateway.counters import InProcessCounterStore
from gateway.metrics import Metrics
from gateway.pipeline import Gateway
from gateway.routing import Router
from router.artifact import OperatingPoint
from tests.gateway.conftest import make_settings, start
from tests.tiny_models import write_tiny_checkpoint


class EasyPrompts:
    """A classifier artifact that finds every prompt easy (score 0): the small tier answers first."""

    version = "easy"

    def __init__(self, tau: float) -> None:
        self.point = OperatingPoint(0.5, tau, 0.95, 0.0, 0.0, tau_stream=tau)

    def score(self, embeddings: np.ndarray, prompts: list[str]) -> np.ndarray:
        return np.zeros(len(prompts))

    def operating_point(self, quality_target: float | None = None) -> OperatingPoint:
        return self.point


class Watcher:
    def __init__(self, artifact: EasyPrompts) -> None:
        self.current = artifact


class ConstantEmbedder:
    async def embed_async(self, texts: list[str]) -> np.ndarray:
        return np.ones((len(texts), 384), dtype=np.float32)


@pytest.fixture(scope="module")
async def engines(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, EngineClient]]:
    clients = {}
    for name, architecture in (("small", "llama"), ("large", "qwen2")):
        checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp(name), architecture)
        spec = TierSpec(name=name, model=str(checkpoint), quantization=None, kv_cache_dtype=None, kv_cache_mb=4,
                        max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256)
        clients[name] = await asyncio.to_thread(build_in_process_client, spec)
    yield clients
    for client in clients.values():
        await client.close()


def gateway_over(engines: dict[str, EngineClient], tau: float, records: list) -> Gateway:
    settings = make_settings()
    router = Router(settings, ConstantEmbedder(), Watcher(EasyPrompts(tau)))
    return Gateway(settings, engines, InProcessCounterStore(), records.append, Metrics(), router=router)


def request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="sluice", messages=[ChatMessage(role="user", content="hello there")], temperature=0, max_tokens=6,
        **fields,
    )


async def test_an_escalated_answer_is_the_large_engines_own(engines):
    records: list = []
    gateway = gateway_over(engines, tau=0.0, records=records)  # every logprob is < 0: always escalate
    reply = await gateway.chat(await start(gateway), request())
    direct = await engines["large"].chat(request())
    body = json.loads(reply.body)
    assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert body["choices"][0]["logprobs"] is None
    (record,) = records
    assert (record.route, record.tier, record.escalated) == ("small", "large", True)
    assert record.confidence is not None and record.confidence < 0


async def test_a_confident_small_engine_serves_with_the_confidence_of_its_tokens(engines):
    records: list = []
    gateway = gateway_over(engines, tau=-1e9, records=records)  # nothing is that unsure: never escalate
    reply = await gateway.chat(await start(gateway), request(logprobs=True))
    body = json.loads(reply.body)
    logprobs = [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]]
    assert reply.headers["x-sluice-tier"] == "small"
    assert float(reply.headers["x-sluice-confidence"]) == pytest.approx(min(logprobs), abs=1e-4)  # a complete answer


async def test_an_escalated_stream_carries_only_the_large_engines_tokens(engines):
    gateway = gateway_over(engines, tau=0.0, records=[])
    reply = await gateway.chat(await start(gateway), request(stream=True))
    events = [e async for e in reply.stream]
    text = "".join(
        choice["delta"].get("content") or ""
        for e in events
        if e != b"data: [DONE]\n\n"
        for choice in json.loads(e.removeprefix(b"data: "))["choices"]
    )
    direct = await engines["large"].chat(request())
    small = await engines["small"].chat(request())
    assert text == direct.choices[0].message.content
    assert text != small.choices[0].message.content  # two different tiny models
    assert reply.headers["x-sluice-escalated"] == "true"
    assert b'"logprobs":{' not in b"".join(events)
