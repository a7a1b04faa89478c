"""One tiny random-weight engine per test session, its OpenAI layer, and its HTTP server on a free
loopback port, all on the session's event loop (the engine's step loop runs there too)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn

from engines.config import EngineConfig
from engines.metrics import EngineMetrics
from engines.server import create_engine_app
from engines.serving import OpenAIServing
from tests.tiny_models import write_tiny_checkpoint

MODEL_NAME = "tiny-test"
MAX_MODEL_LEN = 512
BLOCK_SIZE = 16


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("serving-tiny"), "qwen2")


@pytest.fixture(scope="session")
async def async_engine(tiny_checkpoint: Path) -> AsyncIterator[object]:
    from engines.llm_engine import AsyncLLMEngine, LLMEngine

    config = EngineConfig(
        model=str(tiny_checkpoint),
        dtype="float32",
        quantization=None,
        block_size=BLOCK_SIZE,
        num_kv_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=MAX_MODEL_LEN,
        num_threads=1,
    )
    engine = AsyncLLMEngine(LLMEngine(config))
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="session")
def metrics(async_engine: object) -> EngineMetrics:
    return EngineMetrics(MODEL_NAME, async_engine.stats, async_engine.engine.precision())  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def serving(async_engine: object, metrics: EngineMetrics) -> OpenAIServing:
    return OpenAIServing(async_engine, MODEL_NAME, metrics=metrics)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
async def server_url(serving: OpenAIServing, metrics: EngineMetrics) -> AsyncIterator[str]:
    """The engine server, run by uvicorn on this loop; call sync clients through a thread."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_engine_app(serving, metrics)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task
    sock.close()


async def eventually_running(engine: object, num_running: int) -> None:
    """Wait (bounded) until the engine's latest step statistics show `num_running` sequences."""
    for _ in range(500):
        if engine.stats().num_running == num_running:  # type: ignore[attr-defined]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine never had {num_running} running sequences: {engine.stats()}")  # type: ignore[attr-defined]


async def idle_kv_blocks_used(engine: object) -> int:
    """KV blocks held once the engine has no sequences (prefix-cached blocks are free, not used)."""
    await eventually_running(engine, 0)
    return engine.stats().kv_blocks_used  # type: ignore[attr-defined]


async def wait_until_idle(engine: object, kv_blocks_used: int) -> None:
    """Wait (bounded) for the engine to hold no sequences and `kv_blocks_used` blocks; fail otherwise."""
    for _ in range(500):
        stats = engine.stats()  # type: ignore[attr-defined]
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == kv_blocks_used:
            return
        await asyncio.sleep(0.01)
    stats = engine.stats()  # type: ignore[attr-defined]
    raise AssertionError(
        f"engine still busy: running={stats.num_running} waiting={stats.num_waiting} "
        f"kv_blocks_used={stats.kv_blocks_used} (expected {kv_blocks_used})"
    )
