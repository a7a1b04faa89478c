"""Load held (issue #14, item 9): 300 concurrent streaming clients through a real `sluice serve`
against the fake upstream, bounded to 10 s here (`sluice bench load` runs the 60 s figure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.load import run_load


@pytest.mark.timeout(240)
def test_three_hundred_streams_for_ten_seconds_no_errors_no_rows_lost_no_growth(tmp_path: Path) -> None:
    figures = run_load(clients=300, seconds=10, workdir=tmp_path)
    served = figures["sluice"]
    assert served["errors"] == 0, served.get("first_error")
    assert served["requests_ok"] >= 300  # every client finished at least one stream
    assert figures["rows_lost"] == 0
    assert figures["accounting_rows_status_200"] >= served["requests_ok"]
    assert figures["fds_growth"] <= 16  # descriptors come back as streams end
    assert figures["rss_mib_growth"] < 64
