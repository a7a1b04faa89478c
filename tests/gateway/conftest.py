"""Gateway test helpers: settings built in code, scripted tiers, a gateway without HTTP."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
import uvicorn

from engines.api.protocol import ChatCompletionRequest, ChatMessage
from gateway.accounting import RequestRecord
from gateway.config import PolicyConfig, RedisConfig, Settings, load_settings
from gateway.counters import CounterStore, InProcessCounterStore
from gateway.metrics import Metrics
from gateway.pipeline import Gateway, RequestState
from tests.gateway.scripted_tier import ScriptedTier

ADMIN_KEY = "admin-test-secret"
EXPENSIVE = {"price_input_per_mtok": 0.0, "price_output_per_mtok": 1_000_000.0}  # $1 per completion token


def make_settings(
    *,
    database_url: str = "sqlite+aiosqlite:///:memory:",
    redis_url: str = "",
    allow_anonymous: bool = True,
    tier_prices: dict[str, float] | None = None,
    **policy: Any,
) -> Settings:
    base = load_settings(environ={})
    tiers = {name: msgspec.structs.replace(tier, **(tier_prices or {})) for name, tier in base.tiers.items()}
    return msgspec.structs.replace(
        base,
        # Anonymous callers here are test clients: only the policy under test limits them.
        server=msgspec.structs.replace(
            base.server,
            admin_key=ADMIN_KEY,
            allow_anonymous=allow_anonymous,
            anonymous_rpm=0,
            anonymous_tpm=0,
            anonymous_spend_per_day_usd=0.0,
        ),
        database=msgspec.structs.replace(base.database, url=database_url),
        redis=RedisConfig(url=redis_url),
        tiers=tiers,
        policies={"default": PolicyConfig(**policy)},
    )


def chat(text: str = "hello there", model: str = "sluice", **fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=model, messages=[ChatMessage(role="user", content=text)], **fields)


@pytest.fixture
def tiers() -> dict[str, ScriptedTier]:
    return {"small": ScriptedTier("small"), "large": ScriptedTier("large")}


@pytest.fixture
def records() -> list[RequestRecord]:
    return []


@pytest.fixture
def make_gateway(tiers: dict[str, ScriptedTier], records: list[RequestRecord]) -> Callable[..., Gateway]:
    def build(settings: Settings | None = None, counters: CounterStore | None = None, **policy: Any) -> Gateway:
        return Gateway(
            settings or make_settings(**policy),
            tiers,
            counters or InProcessCounterStore(),
            records.append,
            Metrics(),
        )

    return build


async def start(gateway: Gateway, endpoint: str = "chat") -> RequestState:
    """A request state for an anonymous caller, as the HTTP layer's guard makes it."""
    state = RequestState(request_id=f"req-test-{id(gateway)}-{endpoint}", endpoint=endpoint)
    state.principal = await gateway.authenticate(None)
    return state


def loopback_socket() -> socket.socket:
    """A socket bound to a free loopback port, for `served_on` (its address is known before the app is built)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def served_on(app: Any, sock: socket.socket, wait_s: float = 10.0) -> Iterator[str]:
    """Serve `app` with uvicorn in a thread on `sock`; yields its base URL, stops the server and closes the socket."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.01)
            assert thread.is_alive(), "uvicorn failed to start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(wait_s)
        sock.close()
