"""The match rule of the semantic tier: a trained cross-encoder (the matcher) run on the nearest candidates.

Cosine similarity alone confuses "how do I learn Python" with "how do I learn Java"; the matcher reads
both questions together and scores "same question" in [0, 1]. A candidate is served only when its score
reaches the threshold chosen on held-out data for a false-hit rate of at most 1% (meta.json).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from router.batching import MicroBatcher

MATCHER_FORMAT = 1
# The shipped artifact; `sluice cache train-matcher` rebuilds it.
MATCHER_DIR = Path(__file__).resolve().parent / "matcher"
# Longer queries are exact-only without being tokenized (a long prompt would cost milliseconds to count):
# far beyond what fits the matcher's few dozen tokens whatever the text.
MAX_QUERY_CHARS = 4096


def pick_threshold(
    scores: np.ndarray, labels: np.ndarray, target_fhr: float, confidence: float | None = None
) -> tuple[float, float, float]:
    """The lowest threshold whose false-hit rate (false hits / negative pairs) is ≤ target.

    With `confidence` (e.g. 0.95) the bound applies to the one-sided Clopper-Pearson upper limit of the
    false-hit rate rather than to the rate observed on these pairs: an operating point chosen on a few
    thousand pairs then keeps its bound on pairs it never saw, instead of meeting it only on average.
    Returns (threshold, false_hit_rate, recall) on these pairs; a pair is a hit when score ≥ threshold.
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    negatives, positives = max(1, int((~labels).sum())), max(1, int(labels.sum()))
    order = np.argsort(-scores, kind="stable")
    s, y = scores[order], labels[order]
    fh = np.cumsum(~y)
    tp = np.cumsum(y)
    # Cut only between distinct scores: every pair scoring ≥ the threshold is a hit.
    last_of_run = np.r_[s[1:] != s[:-1], True]
    ok = last_of_run & (fhr_upper_bound(fh, negatives, confidence) <= target_fhr)
    if not ok.any():
        return float(np.nextafter(s[0], np.inf)) if len(s) else 1.0, 0.0, 0.0
    i = int(np.flatnonzero(ok)[-1])
    return float(s[i]), float(fh[i] / negatives), float(tp[i] / positives)


def fhr_upper_bound(false_hits: np.ndarray, negatives: int, confidence: float | None) -> np.ndarray:
    """The false-hit rate's one-sided upper confidence limit (exact binomial); the observed rate when
    `confidence` is None."""
    false_hits = np.asarray(false_hits, dtype=np.float64)
    if confidence is None:
        return false_hits / negatives
    from scipy.stats import beta

    bound = beta.ppf(confidence, false_hits + 1, np.maximum(negatives - false_hits, 1e-9))
    return np.where(false_hits >= negatives, 1.0, bound)


def rates_at(scores: np.ndarray, labels: np.ndarray, threshold: float) -> tuple[float, float]:
    """(false_hit_rate, recall) of the rule score ≥ threshold."""
    hit = np.asarray(scores) >= threshold
    labels = np.asarray(labels).astype(bool)
    return float((hit & ~labels).sum() / max(1, (~labels).sum())), float((hit & labels).sum() / max(1, labels.sum()))


_PAIR_RUNNERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="matcher")  # a lookup's ≤ 2 candidates at once


@dataclass
class Matcher:
    """ONNX cross-encoder + its tokenizer; `score` is synchronous (callers run it off the loop)."""

    session: object
    tokenizer: object
    threshold: float
    version: str
    meta: dict
    floor: float = 0.5  # cosine below which a candidate is not even shown to the matcher
    # The rule's score: a logistic regression over the cosine and the matcher's logit, fit on validation
    # (None: the matcher's probability alone).
    combine: dict[str, float] | None = None
    _batcher: MicroBatcher[tuple[str, str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._batcher = MicroBatcher(lambda pairs: self.score([q for q, _ in pairs], [c for _, c in pairs]))

    @classmethod
    def load(cls, directory: Path = MATCHER_DIR, threshold: float | None = None, threads: int = 1) -> Matcher:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        from router.embedding import open_bert_session

        meta_path = directory / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        tok.enable_truncation(max_length=int(meta.get("max_length", 64)))
        tok.enable_padding(pad_id=0, pad_token="[PAD]")
        session = open_bert_session(directory / "model.onnx", threads, _providers(ort))
        chosen = threshold if threshold is not None else float(meta["threshold"])
        version = str(meta.get("version", "unversioned"))
        floor = float(meta.get("cosine_floor", 0.5))
        return cls(session, tok, chosen, version, meta, floor, meta.get("combine"))

    @property
    def max_length(self) -> int:
        return int(self.tokenizer.truncation["max_length"])  # type: ignore[attr-defined]

    def reads_whole(self, query: str) -> bool:
        """Whether the matcher can read this query and a candidate of a token or more without cutting either:
        [CLS] query [SEP] candidate [SEP] within `max_length`. A longer query is never served semantically."""
        if len(query) > MAX_QUERY_CHARS:
            return False
        return len(self.tokenizer.encode(query, add_special_tokens=False).ids) + 4 <= self.max_length  # type: ignore[attr-defined]

    def rule_score(self, probabilities: np.ndarray, cosines: np.ndarray) -> np.ndarray:
        """What the threshold applies to, for candidates at or above the floor."""
        if not self.combine:
            return np.asarray(probabilities, dtype=np.float32)
        p = np.clip(np.asarray(probabilities, dtype=np.float64), 1e-7, 1 - 1e-7)
        z = self.combine["cosine"] * np.asarray(cosines) + self.combine["logit"] * np.log(p / (1 - p))
        return (1.0 / (1.0 + np.exp(-(z + self.combine["bias"])))).astype(np.float32)

    def score(self, queries: Sequence[str], candidates: Sequence[str]) -> np.ndarray:
        """P(same question) for each (query, candidate) pair, float32 of shape (n,).

        Each pair runs alone. The int8 graph quantises its activations with one scale per call (onnxruntime's
        dynamic quantisation), so a pair scored beside others — or padded to a longer neighbour — gets another
        probability, enough to cross the threshold (BENCHMARKS.md). Alone, a pair's score depends on the pair
        only, whatever a lookup's other candidates or the concurrent lookups are, and is the score its threshold
        was chosen on. A pair longer than the matcher reads scores 0: a verdict on cut texts would miss a
        difference after the cut (two long prompts that share their first few dozen tokens)."""
        encodings = [self.tokenizer.encode(query, candidate) for query, candidate in zip(queries, candidates,
                                                                                         strict=True)]
        # Pairs run side by side (onnxruntime releases the GIL; one intra-op thread each): a lookup's two
        # candidates then cost less than one batched call did (BENCHMARKS.md), where one after the other cost more.
        others = [_PAIR_RUNNERS.submit(self._logit, encoding) for encoding in encodings[1:]]
        first = [self._logit(encodings[0])] if encodings else []
        logits = np.array(first + [run.result() for run in others], dtype=np.float64)
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)

    def _logit(self, encoding: Any) -> float:
        if encoding.overflowing:
            return -np.inf
        feed = {
            "input_ids": np.array([encoding.ids], dtype=np.int64),
            "attention_mask": np.array([encoding.attention_mask], dtype=np.int64),
            "token_type_ids": np.array([encoding.type_ids], dtype=np.int64),
        }
        return float(self.session.run(None, feed)[0][0, 0])

    async def score_async(self, queries: Sequence[str], candidates: Sequence[str]) -> np.ndarray:
        """`score` off the event loop; concurrent callers share one hop off it (each pair still runs alone)."""
        return await self._batcher.submit(list(zip(queries, candidates, strict=True)))

    def score_many(self, queries: Sequence[str], candidates: Sequence[str], batch: int = 256) -> np.ndarray:
        parts = [self.score(queries[i : i + batch], candidates[i : i + batch]) for i in range(0, len(queries), batch)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def _providers(ort: object) -> list[str]:
    available = ort.get_available_providers()  # type: ignore[attr-defined]
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
