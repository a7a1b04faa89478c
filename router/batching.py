"""One blocking model call for a burst of concurrent callers: the embedder's and the cache matcher's batching."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

Item = TypeVar("Item")


class MicroBatcher(Generic[Item]):
    """`submit` queues a caller's items; one worker runs everything queued meanwhile through `run` in a thread
    (off the event loop) and hands each caller its own rows of the result."""

    def __init__(self, run: Callable[[list[Item]], np.ndarray]) -> None:
        self._run = run
        self._queue: list[tuple[list[Item], asyncio.Future[np.ndarray]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, items: list[Item]) -> np.ndarray:
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._queue.append((items, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                rows = await asyncio.to_thread(self._run, [item for items, _ in batch for item in items])
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            start = 0
            for items, future in batch:
                if not future.done():  # a caller that was cancelled meanwhile
                    future.set_result(rows[start : start + len(items)])
                start += len(items)
