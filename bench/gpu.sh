#!/usr/bin/env bash
# The engine's GPU checks as one prepared run for a lent GPU machine (no internet; under 8 minutes):
#   1. the kernel tests and the CUDA engine tests, natively (no TRITON_INTERPRET);
#   2. `python -m bench.gpu`: each kernel against its reference and the bandwidth floor, both tiers' decode
#      tokens/s in bfloat16, int8 and fp8, with and without CUDA graphs, and speculative decoding.
# It runs under the machine's own python3 (PyTorch, Triton, transformers, tokenizers are there). Packages the
# engine imports that the machine lacks travel as wheels in .whl/ (e.g. llguidance: `make gpu-wheels` here).
# Logs and bench/results/gpu.json go to $OUT (default bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu-site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/gpu-site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu_smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
tests=0
if [ "${GPU_TESTS:-1}" = 1 ]; then  # GPU_TESTS=0: the benchmark alone (a rerun of tests that passed)
    timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -x \
        -k cuda tests/engine/test_kernels.py tests/engine/test_int8_matmul.py tests/engine/test_fused_kernels.py \
        tests/engine/test_cuda_engine.py \
        2>&1 | tee "$OUT/gpu_tests.log"
    tests=${PIPESTATUS[0]}
fi
timeout 300 python3 -m bench.gpu "$@" --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu_bench.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench"
exit $(( tests || bench ))
