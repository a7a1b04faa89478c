"""The spool: where records wait, in append-only JSONL segments on disk, while the store they go to
(the database; Redis, for spend settlements) is unreachable; replayed oldest first once it is back.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO, Generic, TypeVar

import msgspec

from gateway.accounting.record import RequestRecord

logger = logging.getLogger("gateway.accounting")

_encoder = msgspec.json.Encoder()
Item = TypeVar("Item", bound=msgspec.Struct)


class Spool(Generic[Item]):
    """Append-only JSONL segments of `item_type` entries under one directory, capped in total size.

    The segment being appended to is held under an exclusive flock, so that another process sharing
    the directory never replays (and deletes) a segment still being written.
    """

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int,
        segment_bytes: int,
        item_type: type[Item] = RequestRecord,  # type: ignore[assignment]
        what: str = "accounting rows",
    ) -> None:
        self.directory = directory
        self._decoder = msgspec.json.Decoder(item_type)
        self.what = what
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self._current: BinaryIO | None = None  # the segment being appended to
        self._sequence = 0
        self._full_logged = False
        self.size_bytes = sum(path.stat().st_size for path in self.segments())

    def segments(self) -> list[Path]:
        """Segment files, oldest first (names start with a zero-padded creation time)."""
        return sorted(self.directory.glob("*.jsonl"))

    def append(self, records: Sequence[Item]) -> int:
        """Write and fsync `records`; returns how many were written (fewer when the cap is hit)."""
        lines: list[bytes] = []
        room = self.max_bytes - self.size_bytes
        for record in records:
            line = _encoder.encode(record) + b"\n"
            if len(line) > room:
                break
            lines.append(line)
            room -= len(line)
        if len(lines) < len(records) and not self._full_logged:
            logger.error(
                "spool %s is full (%d of %d bytes); dropping %s until their store is reachable again",
                self.directory,
                self.size_bytes,
                self.max_bytes,
                self.what,
            )
            self._full_logged = True
        if not lines:
            return 0
        data = b"".join(lines)
        if self._current is None or self._current.tell() >= self.segment_bytes:
            self._current = self._open_segment()
        self._current.write(data)
        self._current.flush()
        os.fsync(self._current.fileno())
        self.size_bytes += len(data)
        return len(lines)

    def _open_segment(self) -> BinaryIO:
        self.seal()
        self._sequence += 1
        self.directory.mkdir(parents=True, exist_ok=True)  # made when first needed, not by every start
        path = self.directory / f"{time.time_ns():020d}-{os.getpid()}-{self._sequence:06d}.jsonl"
        segment = path.open("ab")
        fcntl.flock(segment.fileno(), fcntl.LOCK_EX)
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)  # the new directory entry must survive a crash too
        finally:
            os.close(directory)
        return segment

    def seal(self) -> None:
        """Stop appending to the current segment so that it can be replayed."""
        if self._current is not None:
            self._current.close()
            self._current = None

    def claim(self, path: Path) -> tuple[BinaryIO, list[Item]] | None:
        """Lock a segment for replay and read it; None when another process holds it or it is gone.
        Unreadable lines (a torn final write after a crash) are logged and skipped."""
        try:
            segment = path.open("rb")
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(segment.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            segment.close()
            return None
        records: list[Item] = []
        for number, line in enumerate(segment, start=1):
            if not line.strip():
                continue
            try:
                records.append(self._decoder.decode(line))
            except msgspec.DecodeError as exc:
                logger.warning("spool %s line %d is unreadable, skipped: %s", path, number, exc)
        return segment, records

    def release(self, path: Path, segment: BinaryIO, *, done: bool) -> None:
        """Delete a replayed segment (`done`) or give it back for a later attempt."""
        if done:
            with contextlib.suppress(FileNotFoundError):
                size = path.stat().st_size
                path.unlink()
                self.size_bytes = max(0, self.size_bytes - size)
            if not self.segments():
                self._full_logged = False
        segment.close()
