"""Keep freed memory in the process: CPU training loops stop faulting the same pages in again.

A training step allocates and frees the same large buffers step after step (activations and
gradients of a batch: tens of MB). glibc's ``malloc`` serves a block above its *mmap
threshold* with fresh pages from the kernel and hands freed memory at the top of the heap
back to the kernel beyond its *trim threshold*; both thresholds start low (128 KiB) and only
partly adapt. Then every step faults its buffers in again (a page fault and a zeroed page per
4 KiB), which cost the word2vec demo 20-35% of its time on a 2-core machine -- in plain
PyTorch as much as with embstore. PyTorch's CPU performance guide suggests jemalloc or
tcmalloc for the same reason; :func:`retain_freed_memory` gets most of the effect from glibc
itself, without a preloaded library.

It changes process-wide allocator settings, so it is a call the application makes (the demo
does), never something importing embstore does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["retain_freed_memory"]

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses mmap thresholds above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit systems.
_MAX_MMAP_THRESHOLD = 32 << 20


def retain_freed_memory(max_block: int = _MAX_MMAP_THRESHOLD,
                        keep: int = 1 << 30) -> bool:
    """Ask glibc to serve blocks up to ``max_block`` bytes from the heap and to keep up to
    ``keep`` bytes of freed heap memory, instead of returning either to the kernel.

    Parameters
    ----------
    max_block : int
        Blocks up to this size come from the reusable heap (at most 32 MiB, glibc's limit);
        larger ones are still mapped afresh.
    keep : int
        Freed memory at the top of the heap kept for reuse before any is returned.

    Returns
    -------
    bool
        True when the settings took effect; False where there is no glibc (macOS, musl,
        Windows), which changes nothing.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl has mallopt as a no-op stub
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    block = int(min(max(max_block, 0), _MAX_MMAP_THRESHOLD))
    kept = int(min(max(keep, 0), 2**31 - 1))
    return bool(mallopt(_M_MMAP_THRESHOLD, block)) and bool(mallopt(_M_TRIM_THRESHOLD, kept))
