"""Shadow runs in the gateway: the large tier answers a sample of small-served requests in the background.

`maybe_submit` is called after a request's answer is complete (the accounting row already written)
and returns at once: it never awaits anything. A sampled request (the feature's
`policies.<feature>.shadow_rate`, served by the small tier, not escalated, not a fallback) starts a
task only while fewer than `router.shadow_concurrency` are running; otherwise it is dropped, so a
busy large tier is never queued up by shadows. Each outcome is counted on
`sluice_shadow_runs_total{outcome=recorded|dropped|failed}`, each agreement observed on
`sluice_shadow_agreement` (its mean is the online quality the small tier keeps), and each run written
to `shadow_runs` through the accounting database engine. `training_rows_from_db` turns the table
back into training rows (`sluice router train --from-db`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from engines.api.client import EngineClient
from engines.api.protocol import ChatCompletion, ChatCompletionRequest, CompletionRequest
from gateway.config import Settings
from gateway.cost import request_cost
from gateway.db.database import make_database
from gateway.db.schema import shadow_runs
from gateway.metrics import Metrics
from gateway.routing import LARGE, SMALL, PromptEmbedder, prompt_text
from router.data import TrainingRow
from router.shadow import agreement, needs_embeddings, training_rows

if TYPE_CHECKING:
    from gateway.pipeline import RequestState

Request = ChatCompletionRequest | CompletionRequest
log = logging.getLogger("sluice.shadow")


def served_text(response: Any) -> str:
    """The first choice's text of a chat or text completion."""
    if not response.choices:
        return ""
    if isinstance(response, ChatCompletion):
        return response.choices[0].message.content or ""
    return response.choices[0].text


class ShadowSampler:
    def __init__(
        self,
        settings: Settings,
        clients: Mapping[str, EngineClient],
        db: AsyncEngine,
        metrics: Metrics,
        embedder: PromptEmbedder | None = None,
        *,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self.clients = clients
        self.db = db
        self.metrics = metrics
        self.embedder = embedder
        self.rng = rng
        self.limit = settings.router.shadow_concurrency
        self.tasks: set[asyncio.Task[None]] = set()

    def maybe_submit(self, state: RequestState, request: Request, answer: Any) -> None:
        """Start a shadow run for this request if it is sampled and a slot is free; never waits."""
        principal = state.principal
        if principal is None or state.tier != SMALL or state.escalated or state.fallback or request.n != 1:
            return
        if LARGE not in self.clients or self.rng() >= principal.policy.shadow_rate:
            return
        if len(self.tasks) >= self.limit:
            self.metrics.shadow_runs.labels("dropped").inc()
            return
        small_answer = answer if isinstance(answer, str) else served_text(answer)
        task = asyncio.get_running_loop().create_task(self._run(state, request, small_answer))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, state: RequestState, request: Request, small_answer: str) -> None:
        try:
            shadow = msgspec.structs.replace(request, stream=False, stream_options=None)
            client = self.clients[LARGE]
            if isinstance(shadow, ChatCompletionRequest):
                response = await client.chat(msgspec.structs.replace(shadow, logprobs=False, top_logprobs=None))
            else:
                response = await client.complete(msgspec.structs.replace(shadow, logprobs=None))
            large_answer = served_text(response)
            agreed = await self._agreement(small_answer, large_answer)
            usage = response.usage
            tier = self.settings.tiers[LARGE]
            cost = request_cost(tier, usage.prompt_tokens, usage.completion_tokens, 0) if usage else 0.0
            await self._write(state, request, small_answer, large_answer, agreed.score, agreed.method, cost)
        except asyncio.CancelledError:
            self.metrics.shadow_runs.labels("failed").inc()
            raise
        except Exception:
            log.exception("shadow run for %s failed", state.request_id)
            self.metrics.shadow_runs.labels("failed").inc()
            return
        self.metrics.shadow_runs.labels("recorded").inc()
        self.metrics.shadow_agreement.observe(agreed.score)

    async def _agreement(self, small: str, large: str) -> Any:
        embeddings = None
        if needs_embeddings(small, large):
            if self.embedder is None:
                raise RuntimeError("answers without final numbers need the embedder to be compared")
            vectors = await self.embedder.embed_async([small, large])
            embeddings = (vectors[0], vectors[1])
        return agreement(small, large, embeddings)

    async def _write(self, state: RequestState, request: Request, small: str, large: str, score: float,
                     method: str, cost: float) -> None:
        principal = state.principal
        assert principal is not None
        row = {
            "id": str(uuid.uuid4()),
            "created_at": datetime.now(UTC),
            "request_id": state.request_id,
            "tenant": principal.tenant,
            "feature": principal.feature,
            "router_version": state.router_version,
            "route_score": state.route.score if state.route else None,
            "confidence": state.confidence,
            "prompt": prompt_text(request) or "",
            "small_answer": small,
            "large_answer": large,
            "agreement": score,
            "agreement_method": method,
            "large_cost_usd": cost,
        }
        async with self.db.begin() as connection:
            await connection.execute(shadow_runs.insert().values(**row))

    async def close(self) -> None:
        """Cancel runs still going (shutdown): a shadow is worth less than a prompt exit."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def training_rows_from_db(db_url: str, since: datetime | None = None) -> list[TrainingRow]:
    """Shadow runs (optionally those created at or after `since`) as training rows."""
    query = sa.select(shadow_runs.c.prompt, shadow_runs.c.agreement).where(shadow_runs.c.prompt != "")
    if since is not None:
        query = query.where(shadow_runs.c.created_at >= since)
    engine = make_database(db_url)
    try:
        async with engine.connect() as connection:
            result = await connection.execute(query.order_by(shadow_runs.c.created_at))
            return training_rows((prompt, score) for prompt, score in result)
    finally:
        await engine.dispose()
