"""Once an engine is loaded, the C heap keeps what a step frees for the next step (`keep_freed_memory`): glibc's
defaults hand large freed blocks back to the OS, and a prefill's activations then fault their pages in anew for
every op of every layer."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

# A fresh interpreter (the allocator's history decides its adaptive thresholds): free a 4 MB and then a 24 MB block
# and print the bytes the heap keeps free (glibc `mallinfo2`), with or without `keep_freed_memory` first.
SCRIPT = """
import ctypes, sys
import torch
from engines.cpu import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for megabytes in (4, 24):
    block = torch.empty(megabytes << 18)
    block.fill_(1.0)
    del block
print(libc.mallinfo2().fordblks)
"""


def heap_free_bytes_after_freeing(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="the heap's thresholds are glibc's (2.33+)")
def test_freed_activation_blocks_stay_in_the_heap_for_the_next_step() -> None:
    assert heap_free_bytes_after_freeing("keep") >= 24 << 20
    assert heap_free_bytes_after_freeing("default") < 24 << 20  # glibc's own thresholds gave it back
