"""Keep freed memory in the process while training on CPU, instead of handing it back to the kernel at every step.

Purpose: `kept_heap()` is a context manager for a CPU training loop. glibc's malloc serves every allocation above
its mmap threshold (at most 32 MiB) with a fresh `mmap` and unmaps it on free, so a tensor of that size made at every
step (the embedded target's logits: 8 x 256 x 8192 fp32 = 64 MiB, and their gradients) faults in and zeroes every
page again, step after step: on a small target that kernel work is a sizeable share of a CPU step, and keeping the
heap removes almost all of it (bench/README.md, "Figures moved from code comments"). Inside the block
`mallopt` stops malloc from using `mmap` (`M_MMAP_MAX` 0: every allocation comes from the heap and is reused) and
returns the heap's free top to the kernel only past 1 GiB (`M_TRIM_THRESHOLD`); on exit glibc's default limit and
trim threshold come back and `malloc_trim(0)` hands the free memory back. The peak memory is the loop's own; what
changes is that it is kept until the block ends. On a C library other than glibc (macOS, musl) it does nothing.
Not here: threads (`eagle.target_path.cpu_threads`), CUDA (its caching allocator already keeps memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from typing import Iterator

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_MAX = -4
DEFAULT_MMAP_MAX = 65536  # glibc's defaults
DEFAULT_TRIM_THRESHOLD = 128 * 1024
TRIM_THRESHOLD = 1 << 30


def _glibc():
    """The process's glibc, or None on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        return libc
    except (OSError, AttributeError):
        return None


@contextlib.contextmanager
def kept_heap(enabled: bool = True) -> Iterator[bool]:
    """Run the block with freed memory kept in the heap (glibc only); yields whether it is."""
    libc = _glibc() if enabled else None
    if libc is None:
        yield False
        return
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    libc.mallopt(M_MMAP_MAX, 0)
    try:
        yield True
    finally:
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)
