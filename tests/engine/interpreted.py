"""Running Triton kernels on the CPU through Triton's interpreter, for tests.

`@triton.jit` reads TRITON_INTERPRET when a kernel module is imported, so interpreted cases run in a subprocess
with it set: the test module runs itself as a script (`report_when_run` in its `__main__` block), which prints
one JSON object of figures; the test process reads it (`interpreted_report`) and never launches a kernel itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def interpreted_report(script: str) -> dict[str, float]:
    """Run the test module `script` (its `__file__`) under TRITON_INTERPRET=1; its figures, or a skip when
    Triton cannot interpret here."""
    environment = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, script], cwd=REPO_ROOT, env=environment, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if "unavailable" in report:
        pytest.skip(f"Triton interpretation unavailable: {report['unavailable']}")
    return report


def report_when_run(figures: Callable[[], dict[str, float]]) -> None:
    """The subprocess side: print `figures()` as JSON, or why Triton is unusable here."""
    try:
        import triton.language  # noqa: F401
    except Exception as error:  # no usable Triton install: let the tests skip
        print(json.dumps({"unavailable": f"{type(error).__name__}: {error}"}))
        sys.exit(0)
    print(json.dumps(figures()))


@contextmanager
def nan_filled_empty() -> Iterator[None]:
    """`torch.empty` returns NaN-filled float tensors: scratch that a kernel reads before writing shows."""
    real_empty = torch.empty

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    with mock.patch.object(torch, "empty", empty):
        yield
