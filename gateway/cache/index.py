"""A replica's in-memory vector index of one scope: nearest cached questions to a query embedding.

Exact float32 dot products up to `EXACT_SCAN_MAX` entries. Beyond that, a scan over the embeddings'
sign bits (48 bytes an entry, Hamming distance via popcount) picks `PREFILTER` candidates and the float
dot product ranks only those: reading 100k × 384 floats per lookup would cost more than the rest of
the lookup together. Embeddings are unit length, so the dot product is the cosine similarity.
"""

from __future__ import annotations

import numpy as np

EXACT_SCAN_MAX = 8192
PREFILTER = 256


def sign_bits(vector: np.ndarray) -> np.ndarray:
    """(d,) float → (d/64,) uint64 of the signs."""
    return np.packbits(vector > 0).view(np.uint64)


def hamming(bits: np.ndarray, query_bits: np.ndarray) -> np.ndarray:
    """Distances of the columns of `bits` (words, n) to `query_bits` (words,): a word at a time over
    contiguous rows, which is several times faster than a row-major (n, words) reduction."""
    distance = np.bitwise_count(bits[0] ^ query_bits[0]).astype(np.uint16)
    for word in range(1, len(query_bits)):
        distance += np.bitwise_count(bits[word] ^ query_bits[word])
    return distance


class VectorIndex:
    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._vectors = np.zeros((0, dim), dtype=np.float32)
        self._bits = np.zeros((dim // 64, 0), dtype=np.uint64)  # word-major: see `hamming`
        self._expires = np.zeros(0, dtype=np.float64)
        self._keys: list[str | None] = []
        self.texts: dict[str, str] = {}
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._n = 0  # rows in use or freed (the high-water mark)

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: str) -> bool:
        return key in self._slot

    @property
    def rows_held(self) -> int:
        """Rows allocated, live or not: what the index costs in memory (~1.6 KB a row at 384 dimensions)."""
        return len(self._vectors)

    def add(self, key: str, vector: np.ndarray, expires_at: float, text: str = "") -> None:
        self.texts[key] = text
        row = self._slot.get(key)
        if row is None:
            row = self._free.pop() if self._free else self._append_row()
            self._slot[key] = row
            self._keys[row] = key
        self._vectors[row] = vector
        self._bits[:, row] = sign_bits(vector)
        self._expires[row] = expires_at

    def _append_row(self) -> int:
        if self._n == len(self._vectors):
            capacity = max(8, 2 * self._n)  # most scopes hold a few entries
            self._vectors = _grow(self._vectors, capacity)
            self._bits = _grow(self._bits.T, capacity).T.copy()
            self._expires = _grow(self._expires, capacity)
            self._keys.extend([None] * (capacity - len(self._keys)))
        self._n += 1
        return self._n - 1

    def remove(self, key: str) -> None:
        self.texts.pop(key, None)
        row = self._slot.pop(key, None)
        if row is not None:
            self._keys[row] = None
            self._expires[row] = -np.inf  # never a candidate again; the row is reused by the next add
            self._free.append(row)

    def clear(self) -> None:
        self.__init__(self.dim)  # type: ignore[misc]

    def search(self, query: np.ndarray, k: int, floor: float, now: float) -> list[tuple[str, float]]:
        """Up to k (key, cosine) with cosine ≥ floor among live entries, best first."""
        n = self._n
        if n == 0:
            return []
        if n <= EXACT_SCAN_MAX:
            rows = np.arange(n)
        else:
            rows = nearest_by_hamming(hamming(self._bits[:, :n], sign_bits(query)), self.dim)
        sims = self._vectors[rows] @ query
        sims[self._expires[rows] <= now] = -np.inf
        top = np.argsort(-sims)[:k] if len(sims) > k else np.argsort(-sims)
        return [(self._keys[rows[i]], float(sims[i])) for i in top if sims[i] >= floor]  # type: ignore[misc]


def nearest_by_hamming(distance: np.ndarray, dim: int) -> np.ndarray:
    """Rows within the distance that holds the `PREFILTER` nearest (ties at it included): a histogram of
    the few hundred possible distances is ~3x cheaper than an argpartition of every row. A tie bucket too
    large to rank exactly falls back to the argpartition."""
    reached = np.cumsum(np.bincount(distance, minlength=dim + 1))
    rows = np.flatnonzero(distance <= int(np.searchsorted(reached, PREFILTER)))
    return rows if len(rows) <= 4 * PREFILTER else np.argpartition(distance, PREFILTER)[:PREFILTER]


def _grow(array: np.ndarray, rows: int) -> np.ndarray:
    grown = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
    grown[: len(array)] = array
    return grown
