"""The n-gram regression: scikit-learn's TF-IDF + logistic regression, served from hashed terms without the text."""

import io
from pathlib import Path

import numpy as np
import pytest
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from router.artifact import ArtifactError, RouterArtifact
from router.data import TrainingRow
from router.ngrams import FILE, MAX_CHARS, NgramModel, terms
from router.train import fit_ngrams, train_router

from . import synthetic

PROMPTS = [
    "Which of the following is a prime number?\nA. 4\nB. 6\nC. 7\nD. 9\nAnswer:",
    "Statement 1 | Every group of order 4 is cyclic. Statement 2 | Z_6 has 6 elements.",
    "Janet's ducks lay 16 eggs per day. How many does she sell at the market?",
    "Which of the following best describes the role of the Federal Reserve?",
    "Statement 1 | A ring is a group. Statement 2 | Every field is a ring.",
    "How many eggs does Janet have left after eating three for breakfast?",
    "Ünïcödé wörds, CAPITALS and digits 42 42 in the same prompt; which of these?",
    "",
]
LABELS = np.array([0, 1, 0, 0, 1, 0, 1, 0])
WEIGHTS = np.array([1.0, 1.0, 0.5, 1.0, 0.25, 1.0, 1.0, 1.0])


def test_terms_are_scikit_learns_word_unigrams_then_bigrams() -> None:
    analyzer = TfidfVectorizer(ngram_range=(1, 2)).build_analyzer()
    for prompt in PROMPTS:
        assert terms(prompt) == analyzer(prompt)


def test_only_the_start_of_a_long_prompt_is_read() -> None:
    start = "which of the following " * 200  # longer than MAX_CHARS
    assert terms(start[:MAX_CHARS] + " never read words") == terms(start[:MAX_CHARS])


def test_scores_are_scikit_learns_tfidf_logistic_regression() -> None:
    model = NgramModel.fit(PROMPTS, LABELS, WEIGHTS)
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    x = vectorizer.fit_transform(PROMPTS)
    reference = LogisticRegression(C=0.3, max_iter=3000, random_state=0).fit(x, LABELS, sample_weight=WEIGHTS)
    unseen = ["Which of the following is cyclic? Statement 1 |", "nothing in common here", "", "42"]
    expected = reference.predict_proba(vectorizer.transform(PROMPTS + unseen))[:, 1]
    assert len(model.hashes) == len(vectorizer.vocabulary_)
    np.testing.assert_allclose(model.score(PROMPTS + unseen), expected, atol=1e-5)


def test_the_stored_model_scores_the_same_and_holds_no_words(tmp_path: Path) -> None:
    model = NgramModel.fit(PROMPTS, LABELS, WEIGHTS)
    (tmp_path / FILE).write_bytes(model.to_bytes())
    again = NgramModel.load(tmp_path)
    np.testing.assert_array_equal(again.score(PROMPTS), model.score(PROMPTS))
    with np.load(io.BytesIO(model.to_bytes())) as stored:
        assert all(stored[name].dtype.kind in "uif" for name in stored.files)  # numbers only: no text


def test_rows_without_a_shared_word_get_no_ngram_model() -> None:
    rows = [TrainingRow(f"w{i}", float(i % 2), 1.0) for i in range(20)]
    assert fit_ngrams(rows) is None


def _wording_rows(n: int = 120) -> list[TrainingRow]:
    """The wording alone tells hard from easy; the embeddings below carry nothing."""
    return [TrainingRow(f"Prove the identity number {i} by induction", 0.0, 1.0) if i % 3 == 0
            else TrainingRow(f"What is the capital of country number {i}?", 1.0, 1.0) for i in range(n)]


def _noise(n: int) -> np.ndarray:
    vectors = np.random.default_rng(1).normal(size=(n, 384))
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def test_training_blends_in_the_ngrams_when_the_words_tell_more_than_the_embedding(tmp_path: Path) -> None:
    rows = _wording_rows()
    artifact = train_router(rows, tmp_path, embeddings=_noise(len(rows)))
    assert artifact.meta["score"]["ngram_weight"] > 0
    assert (artifact.path / FILE).exists()
    prompts = ["Prove the identity number 999 by induction", "What is the capital of country number 998?"]
    scores = artifact.score(_noise(2), prompts)
    assert scores[0] > scores[1] + 0.3


def test_an_artifact_whose_ngram_file_is_missing_is_refused(tmp_path: Path) -> None:
    rows = _wording_rows()
    artifact = train_router(rows, tmp_path, embeddings=_noise(len(rows)))
    (artifact.path / FILE).unlink()
    with pytest.raises(ArtifactError, match="ngram"):
        RouterArtifact.load(artifact.path)


def test_without_a_gain_from_the_words_no_ngram_file_is_written(tmp_path: Path) -> None:
    rows = synthetic.rows()  # the embedding alone separates these perfectly: the words cannot add to it
    artifact = train_router(rows, tmp_path, embeddings=synthetic.embed([r.prompt for r in rows]))
    assert artifact.meta["score"]["ngram_weight"] == 0.0
    assert not (artifact.path / FILE).exists()
