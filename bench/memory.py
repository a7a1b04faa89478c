"""Resident memory of the engine tiers as `make run` loads them: each tier alone, then both in one process.

`python -m bench.memory [--tiers small,large] [--speculative-draft large=small]`

Each measurement runs in a fresh process that builds the tier's engine as `make run` does
(`engines.tiers.tier_spec`: the shipped spec in `engines/<tier>/spec.py`, precision `auto`, its KV-cache size)
and reports VmRSS after loading (what stays resident), VmHWM (the peak while loading), VmRSS again after each
engine served one request (512 prompt tokens, 64 generated: the runtime's step buffers and a little KV cache),
and the bytes of the model's weights, beside the seconds the engines took to load (from the checkpoint in the
models cache: dequantised, quantised and packed at every start). The KV cache is allocated zeroed and only
becomes resident as it fills, so a loaded engine's RSS is the weights plus the runtime; the cache's configured
size is listed beside it (RSS after loading plus that size bounds a full cache). Writes
bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import print_table, write_results

_CHILD = """
import json, sys, time
from engines.llm_engine import LLMEngine
from engines.speculative import weight_bytes
from engines.tiers import tier_spec
started = time.perf_counter()
drafts = json.loads(sys.argv[2])  # tier name -> its speculative drafter
engines = [LLMEngine(tier_spec(name, name, speculative_draft=drafts.get(name)).engine_config())
           for name in sys.argv[1].split(",")]
load_s = time.perf_counter() - started
def status():
    return dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
loaded = status()
from engines.sampling_params import SamplingParams
for i, engine in enumerate(engines):  # one 512-token prompt and 64 tokens each: runtime buffers, some KV
    engine.add_request(f"r{i}", list(range(1000, 1512)), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
served = status()
print(json.dumps({
    "load_s": load_s,
    "rss_gb": int(loaded["VmRSS"].split()[0]) / 1e6,
    "rss_after_request_gb": int(served["VmRSS"].split()[0]) / 1e6,
    "peak_rss_gb": int(loaded["VmHWM"].split()[0]) / 1e6,
    "weights_gb": sum(weight_bytes(engine.model) for engine in engines) / 1e9,
    "kv_cache_configured_gb": sum(engine.config.kv_cache_bytes for engine in engines) / 1e9,
    "precision": [engine.precision() for engine in engines],
}))
"""


def measure(tiers: str, drafts: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-c", _CHILD, tiers, json.dumps(drafts)], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default="small,large")
    parser.add_argument("--speculative-draft", metavar="TIER=DRAFTER", action="append", default=[],
                        help="speculative decoding on, as `[tiers.TIER] speculative_draft = DRAFTER` turns it on "
                             "(e.g. large=small)")
    args = parser.parse_args()
    names = args.tiers.split(",")
    drafts = dict(item.split("=", 1) for item in args.speculative_draft)
    configurations = [*names, ",".join(names)] if len(names) > 1 else names
    figures = {configuration: measure(configuration, drafts) for configuration in configurations}
    header = ["tiers", "RSS loaded", "RSS after a request", "peak while loading", "weights", "KV cache (configured)",
              "load s"]
    print_table("Resident memory (GB), and seconds to load", header,
                [[name, f["rss_gb"], f["rss_after_request_gb"], f["peak_rss_gb"], f["weights_gb"],
                  f["kv_cache_configured_gb"], f["load_s"]]
                 for name, f in figures.items()])
    write_results("memory", {"target_both_tiers_rss_gb": 6.0, "speculative_drafts": drafts, **figures})


if __name__ == "__main__":
    main()
