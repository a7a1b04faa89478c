# One image for every Sluice process: the gateway (`sluice serve`), an engine tier
# (`sluice engine --tier small|large`), migrations (`sluice db upgrade`) and model fetching.
#
# torch comes from PyTorch's CPU wheel index first, so that resolving the project's pinned
# `torch==2.13.0` finds it installed and never pulls the CUDA build (gigabytes of unused GPU
# libraries). That index is reachable from a normal Docker build, not from the development sandbox.
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLUICE_MODELS__CACHE_DIR=/models

# A C compiler: the engine builds its CPU decode kernels (engines/cpu_kernels.c) on first use; without
# one it runs on PyTorch ops alone, slower at batch 1.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
# Dependencies first (a layer that survives source edits), then the source.
COPY pyproject.toml README.md ./
RUN mkdir -p gateway router engines kernels migrations bench \
    && touch gateway/__init__.py router/__init__.py engines/__init__.py kernels/__init__.py bench/__init__.py \
    && pip install . \
    && pip uninstall -y sluice
COPY gateway ./gateway
COPY router ./router
COPY engines ./engines
COPY kernels ./kernels
COPY migrations ./migrations
COPY bench ./bench
# Editable, so that migrations/ (scripts and templates, not Python modules) stay beside the code.
RUN pip install --no-deps -e . && useradd --create-home --uid 10001 sluice \
    && mkdir -p /models /app/var/spool && chown -R sluice:sluice /models /app/var
USER sluice

EXPOSE 8000 8100
ENTRYPOINT ["sluice"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
