"""File bytes on local disk under `batch.dir`, one file per id (the rows in `files` say whose and what)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from pathlib import Path


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    async def write(self, file_id: str, chunks: Iterable[bytes]) -> int:
        """Write a file whole or not at all (a temporary name, renamed when synced); its size."""
        return await asyncio.to_thread(self._write, file_id, chunks)

    async def delete(self, file_id: str) -> None:
        await asyncio.to_thread(self.path(file_id).unlink, missing_ok=True)

    async def read(self, file_id: str) -> bytes:
        return await asyncio.to_thread(self.path(file_id).read_bytes)

    def _write(self, file_id: str, chunks: Iterable[bytes]) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path(file_id)
        partial = final.with_name(final.name + ".partial")
        size = 0
        with partial.open("wb") as out:
            for chunk in chunks:
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, final)
        return size
