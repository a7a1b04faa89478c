"""`sluice router …` from the command line: help, clear errors on bad files, and train → tune → eval with the real
embedder, recording the version and the evaluation in the database."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.cli import main
from gateway.db.database import make_database
from router.artifact import RouterArtifact
from router.data import write_rows
from tests.router import synthetic


@pytest.mark.parametrize("action", ["train", "tune", "eval", "build-default", "export-routellm"])
def test_every_router_command_has_help(action: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["router", action, "--help"])
    assert exit_.value.code == 0
    assert "--" in capsys.readouterr().out


def test_a_missing_training_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "train", "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path), "--no-db"]) == 1
    assert "nope.jsonl: no such file" in capsys.readouterr().err


def test_a_malformed_row_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "rows.csv"
    data.write_text("prompt,small_score,large_score\nhello,1,1\nworld,yes,1\n")
    assert main(["router", "train", "--data", str(data), "--out", str(tmp_path / "out"), "--no-db"]) == 1
    assert "rows.csv:3: `small_score` must be a number, got 'yes'" in capsys.readouterr().err


def test_too_few_rows_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_rows(tmp_path / "rows.jsonl", synthetic.rows(6))
    assert main(["router", "train", "--data", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path), "--no-db"]) == 1
    assert "need at least 20 training rows, got 6" in capsys.readouterr().err


def test_an_artifact_path_that_holds_none_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_rows(tmp_path / "rows.jsonl", synthetic.rows(30))
    code = main(["router", "eval", "--data", str(tmp_path / "rows.jsonl"), "--artifact", str(tmp_path), "--no-db"])
    assert code == 1
    assert "not a router artifact" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_train_tune_eval_round_trip_records_in_the_database(
    tmp_path: Path, sqlite_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the embedding cache (var/embeddings) stays in the test's directory
    data = tmp_path / "rows.jsonl"
    write_rows(data, synthetic.rows(90))  # carries small_confidence, so tuning also picks τ
    out = tmp_path / "router"
    db = ["--database-url", sqlite_url]
    assert main(["router", "train", "--data", str(data), "--out", str(out), *db]) == 0
    assert main(["router", "tune", "--data", str(data), "--artifact", str(out), "--quality-target", "0.9"]) == 0
    assert RouterArtifact.load(out).meta["tuned_on"] == str(data)
    plot = tmp_path / "eval.png"
    assert main(["router", "eval", "--data", str(data), "--artifact", str(out), "--plot", str(plot), *db]) == 0
    printed = capsys.readouterr().out
    for key in ("apgr", "cpt50", "cpt80", "large_fraction_for_95", "escalation_rate", "routed_quality",
                "quality_delta", "cost_per_mtok_routed", "savings_vs_large_only"):
        assert key in printed
    assert plot.read_bytes()[:4] == b"\x89PNG"

    async def counts() -> tuple[int, int]:
        engine = make_database(sqlite_url)
        async with engine.connect() as conn:
            versions = (await conn.execute(sa.text("select count(*) from router_versions"))).scalar_one()
            runs = (await conn.execute(sa.text("select count(*) from eval_runs"))).scalar_one()
        await engine.dispose()
        return versions, runs

    assert asyncio.run(counts()) == (1, 1)


@pytest.mark.timeout(600)
def test_the_default_build_tunes_thresholds_and_taus_on_the_demo_tiers_labels_without_keeping_their_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from gateway.router_cli import tune_on_demo_tier_labels

    monkeypatch.chdir(tmp_path)
    routellm, labels = tmp_path / "routellm.jsonl", tmp_path / "gsm8k_train.jsonl"
    write_rows(routellm, synthetic.rows(60))
    write_rows(labels, synthetic.rows(40))  # they carry the small tier's confidences, as `router label` writes them
    out = tmp_path / "router"
    assert main(["router", "train", "--data", str(routellm), "--out", str(out), "--no-db"]) == 0
    artifact = RouterArtifact.load(out)
    tune_on_demo_tier_labels(artifact, labels, argparse.Namespace(config=None))
    tuned = RouterArtifact.load(out)
    assert tuned.meta["tuned_on"]["rows"] == 40 and tuned.meta["tuned_on"]["source"].startswith("gsm8k_train.jsonl")
    assert tuned.meta["confidence"]  # the definitions its τs were tuned on
    assert tuned.meta["operating_points"] != artifact.meta["operating_points"]
    assert synthetic.rows(40)[0].prompt not in (tuned.path / "meta.json").read_text()
