"""The capacity simulator replays requests through fleets with exactly the step costs it is given."""

from __future__ import annotations

import pytest

from bench.capacity_sim import Request, StepCost, draw_requests, simulate, slo_report

# 10 ms per step, 0.1 ms per prefill token, 1 ms per decoding sequence, context free; 1 KB of KV per token.
COST = StepCost(base_s=0.010, per_prefill_token_s=0.0001, per_decode_seq_s=0.001, per_context_token_s=0.0,
                kv_bytes_per_token=1000)


def test_one_request_on_one_replica_takes_its_chunked_prefill_then_one_step_per_token() -> None:
    (done,) = simulate([Request(arrival=1.0, prompt=700, output=5)], COST, colocated=1, max_num_batched_tokens=512)
    prefill = (0.010 + 512 * 0.0001) + (0.010 + 188 * 0.0001)  # two chunks: 512 + 188 tokens
    assert done.first_token_at == pytest.approx(1.0 + prefill)
    assert done.finished_at == pytest.approx(1.0 + prefill + 4 * 0.011)  # four more tokens, one sequence each


def test_a_long_prompt_slows_the_decodes_beside_it_only_when_colocated() -> None:
    chat = Request(arrival=0.0, prompt=16, output=50)
    long_prompt = Request(arrival=0.05, prompt=4000, output=2)
    colocated, _ = simulate([chat, long_prompt], COST, colocated=1)
    split, _ = simulate([chat, long_prompt], COST, prefill=1, decode=1, link_gb_s=10.0)

    def tpot(request: Request) -> float:
        return (request.finished_at - request.first_token_at) / (request.output - 1)  # type: ignore[operator]

    assert tpot(split) == pytest.approx(0.011, rel=0.01)  # decode-only steps (one shared with the other)
    assert tpot(colocated) > 1.5 * tpot(split)  # its steps also carried 512-token prefill chunks


def test_disaggregated_first_token_comes_from_prefill_and_decoding_waits_for_the_kv_transfer() -> None:
    (done,) = simulate([Request(arrival=0.0, prompt=100, output=3)], COST, prefill=1, decode=1, link_gb_s=1e-3)
    transfer = 100 * 1000 / 1e6  # 100 tokens x 1 KB over 1 MB/s
    assert done.first_token_at == pytest.approx(0.010 + 100 * 0.0001)
    assert done.finished_at == pytest.approx(done.first_token_at + transfer + 2 * 0.011)


def test_every_drawn_request_is_served_and_counted_once() -> None:
    requests = draw_requests("chat", rate=3.0, duration_s=20.0, seed=1)
    report = slo_report(simulate(requests, COST, colocated=2), 20.0, ttft_slo_s=0.0, tpot_slo_s=0.0)
    assert report["requests"] == report["served"] == len(requests) > 30
    assert report["slo_attainment"] == 0.0  # nothing meets an impossible SLO
