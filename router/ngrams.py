"""The prompt's words: a logistic regression over TF-IDF word 1–2-grams, blended into the router's score.

A mean-pooled sentence embedding keeps a prompt's topic and blurs its wording; which words and word pairs a prompt
uses ("statement 1 |", "how many", "which of the following") tells task kinds apart that differ in how much the
large tier adds. Trained on the same label and weights as the embedding model, it raised held-out APGR on RouteLLM's
data in a blend with it (BENCHMARKS.md, router (a)).

Terms are kept as their CRC-32, not as text: the artifact holds no words of the training prompts (a router trained
on a tenant's own traffic ships none of it), and 32-bit hashes of the few hundred thousand terms of a training set
seldom collide. Fitted with scikit-learn; served here in numpy from each kept term's hash,
idf and coefficient, so that serving needs neither scikit-learn nor a string-typed ONNX graph (onnxruntime's
string normaliser needs an installed system locale). `score` reproduces `TfidfVectorizer(min_df=2,
sublinear_tf=True)` over those terms + `LogisticRegression.predict_proba` (tested).
"""

from __future__ import annotations

import io
import itertools
import math
import re
import zlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

FILE = "ngrams.npz"
C = 0.3  # inverse L2 strength, chosen on the RouteLLM validation split (BENCHMARKS.md)
_TOKEN = re.compile(r"(?u)\b\w\w+\b")  # scikit-learn's default token pattern
_UNKNOWN = -1  # the row of a term the model does not know
# The score runs on the gateway's event loop and its cost grows with the text: a long prompt is read up to here (in
# training too). Far more than the embedder's 256 tokens; longer than all but 0.03% of RouteLLM's prompts.
MAX_CHARS = 4096


def terms(prompt: str) -> list[str]:
    """Lower-cased word unigrams, then bigrams, as scikit-learn's word analyzer yields them, of the prompt's first
    `MAX_CHARS` characters."""
    tokens = _TOKEN.findall(prompt[:MAX_CHARS].lower())
    return tokens + [f"{a} {b}" for a, b in itertools.pairwise(tokens)]


def hashed_terms(prompt: str) -> list[int]:
    return list(map(zlib.crc32, map(str.encode, terms(prompt))))


class NgramModel:
    def __init__(self, hashes: np.ndarray, idf: np.ndarray, coef: np.ndarray, intercept: float) -> None:
        self.hashes = np.asarray(hashes, dtype=np.uint32)
        self._index = {int(h): i for i, h in enumerate(self.hashes)}
        self.idf = np.asarray(idf, dtype=np.float64)
        self.coef = np.asarray(coef, dtype=np.float64)
        self.intercept = float(intercept)

    @classmethod
    def fit(cls, prompts: Sequence[str], labels: np.ndarray, weights: np.ndarray, seed: int = 0) -> NgramModel:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression

        vectorizer = TfidfVectorizer(analyzer=hashed_terms, min_df=2, sublinear_tf=True)
        x = vectorizer.fit_transform(prompts)
        model = LogisticRegression(C=C, max_iter=3000, random_state=seed).fit(x, labels, sample_weight=weights)
        hashes = sorted(vectorizer.vocabulary_, key=vectorizer.vocabulary_.__getitem__)
        # Rounded as the artifact stores them: the validation scores are those a loaded artifact gives.
        idf, coef = vectorizer.idf_.astype(np.float32), model.coef_[0].astype(np.float32)
        return cls(np.array(hashes, dtype=np.uint32), idf, coef, float(model.intercept_[0]))

    def score(self, prompts: Sequence[str]) -> np.ndarray:
        """P(the large tier is needed) per prompt, float64."""
        return np.array([self._probability(prompt) for prompt in prompts], dtype=np.float64)

    def _probability(self, prompt: str) -> float:
        # Counter's C loop over a map of builtins: half the time of a filtering generator.
        counts = Counter(map(self._index.get, hashed_terms(prompt), itertools.repeat(_UNKNOWN)))
        counts.pop(_UNKNOWN, None)
        logit = self.intercept
        if counts:
            rows = np.fromiter(counts.keys(), dtype=np.intp, count=len(counts))
            tf = 1.0 + np.log(np.fromiter(counts.values(), dtype=np.float64, count=len(counts)))
            x = tf * self.idf[rows]
            logit += float(x @ self.coef[rows]) / float(np.sqrt(x @ x))
        return 1.0 / (1.0 + math.exp(-logit))

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez_compressed(buffer, hashes=self.hashes, idf=self.idf.astype(np.float32),
                            coef=self.coef.astype(np.float32), intercept=np.array(self.intercept))
        return buffer.getvalue()

    @classmethod
    def load(cls, directory: Path) -> NgramModel:
        with np.load(directory / FILE) as data:
            return cls(data["hashes"], data["idf"], data["coef"], float(data["intercept"]))
