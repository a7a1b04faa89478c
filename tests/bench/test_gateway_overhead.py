"""The benchmark's load generator and its arithmetic, against the fake upstream (no timings asserted)."""

from __future__ import annotations

from pathlib import Path

import yaml

from bench import litellm_env
from bench.fake_upstream import FakeUpstream, Request, error_response, start_server
from bench.gateway_overhead import (
    Endpoint,
    Measurement,
    against_targets,
    hot_frames,
    measure,
    measure_rounds,
    summarise,
)


async def test_load_generator_sends_at_most_the_request_budget_and_checks_every_answer() -> None:
    upstream = FakeUpstream()
    server, url = await start_server(upstream=upstream)
    async with server:
        endpoint = Endpoint("direct", "127.0.0.1", int(url.rsplit(":", 1)[1]), "sk-any")
        plain = await measure(endpoint, stream=False, concurrency=4, max_requests=40, seconds=30)
        streamed = await measure(endpoint, stream=True, concurrency=2, max_requests=10, seconds=30)
    assert (len(plain.latencies_s), plain.errors) == (40, 0)
    assert (len(streamed.latencies_s), len(streamed.ttfts_s), streamed.errors) == (10, 10, 0)
    assert upstream.requests_served == 50


class RefusingUpstream(FakeUpstream):
    def respond(self, request: Request) -> bytes | list[bytes]:
        return error_response(401, "invalid api key", "authentication_error")


async def test_load_generator_counts_refused_requests_as_errors_not_latencies() -> None:
    server, url = await start_server(upstream=RefusingUpstream())
    async with server:
        endpoint = Endpoint("refusing", "127.0.0.1", int(url.rsplit(":", 1)[1]), "sk-wrong")
        result = await measure(endpoint, stream=False, concurrency=1, max_requests=3, seconds=30)
    assert (result.errors, result.latencies_s) == (3, [])
    assert result.figures()["first_error"].startswith("HTTP 401")


def _cell(latency_ms: float, count: int, elapsed_s: float, server_cpu_s: float | None = None) -> Measurement:
    return Measurement(latencies_s=[latency_ms / 1000] * count, elapsed_s=elapsed_s, server_cpu_s=server_cpu_s)


def test_summary_reports_added_latency_over_direct_and_the_throughput_ratio() -> None:
    results = {
        "direct": {"plain": {1: _cell(0.2, 100, 1.0), 8: _cell(1.0, 800, 1.0)}},
        "sluice": {"plain": {1: _cell(1.2, 100, 1.0), 8: _cell(2.0, 600, 1.0, server_cpu_s=0.6)}},
        "litellm": {"plain": {1: _cell(10.2, 100, 1.0), 8: _cell(20.0, 100, 1.0, server_cpu_s=1.0)}},
    }
    summary = summarise(results)
    assert round(summary["plain"]["1_clients"]["sluice"]["added_latency_p50_ms_over_direct"], 6) == 1.0
    assert summary["plain"]["8_clients"]["throughput_ratio_sluice_over_litellm"] == 6.0
    assert summary["plain"]["8_clients"]["sluice"]["server_cpu_ms_per_request"] == 1.0
    assert summary["plain"]["8_clients"]["cpu_per_request_ratio_litellm_over_sluice"] == 10.0
    checks = against_targets(summary)
    assert checks["sluice_added_p50_ms_at_1_client_plain"]["met"] is True
    assert checks["throughput_ratio_sluice_over_litellm_at_8_clients_plain"]["met"] is True


def test_litellm_config_routes_each_model_to_the_upstream(tmp_path: Path) -> None:
    path = litellm_env.write_config(tmp_path / "litellm.yaml", "http://127.0.0.1:9100", ["small", "large"])
    config = yaml.safe_load(path.read_text())
    assert [m["model_name"] for m in config["model_list"]] == ["small", "large"]
    assert {m["litellm_params"]["api_base"] for m in config["model_list"]} == {"http://127.0.0.1:9100/v1"}
    assert config["general_settings"]["master_key"] == litellm_env.MASTER_KEY


def test_profile_summary_ranks_sluice_frames_and_packages(tmp_path: Path) -> None:
    collapsed = tmp_path / "profile.txt"
    collapsed.write_text(
        "run (asyncio/runners.py:1);chat (gateway/pipeline.py:2);post (httpx/_client.py:3) 3\n"
        "run (asyncio/runners.py:1);write (gateway/accounting.py:4) 1\n"
    )
    frames = hot_frames(collapsed)
    assert frames["sluice_frames_by_inclusive_pct"][0] == {"frame": "chat (gateway/pipeline.py:2)", "pct": 75.0}
    assert frames["self_pct_by_package"] == [{"package": "httpx", "pct": 75.0}, {"package": "gateway", "pct": 25.0}]


async def test_a_cell_measured_in_rounds_keeps_each_rounds_p99() -> None:
    server, url = await start_server(upstream=FakeUpstream())
    async with server:
        endpoint = Endpoint("direct", "127.0.0.1", int(url.rsplit(":", 1)[1]), "sk-any")
        cell = await measure_rounds(endpoint, stream=False, concurrency=1, max_requests=10, seconds=30, rounds=3)
    assert (len(cell.latencies_s), len(cell.round_p99s_ms), cell.errors) == (30, 3, 0)
    assert cell.figures()["latency_p99_ms_by_round"] == cell.round_p99s_ms


def test_the_p99_target_is_judged_on_the_pooled_p99_with_the_median_of_rounds_beside_it() -> None:
    direct = Measurement(latencies_s=[0.0002] * 300, elapsed_s=1.0, round_p99s_ms=[0.2, 0.2, 0.2])
    # One round hit by a burst of slowness that has nothing to do with the gateway.
    sluice = Measurement(latencies_s=[0.0012] * 280 + [0.03] * 20, elapsed_s=1.0, round_p99s_ms=[4.0, 4.5, 30.0])
    checks = against_targets(summarise({"direct": {"plain": {1: direct}}, "sluice": {"plain": {1: sluice}}}))
    p99 = checks["sluice_added_p99_ms_at_1_client_plain"]
    assert p99["measured"] > 25 and p99["met"] is False
    assert round(p99["median_of_rounds_p99"], 6) == 4.3
