"""embstore.allocator: freed memory stays in the process (fewer page faults, not a timing)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import embstore.allocator

_PROBE = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from embstore.allocator import retain_freed_memory
    if sys.argv[1] == "tuned":
        assert retain_freed_memory()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):   # a training step's pattern: the same large buffers, again and again
        a = np.ones(5_000_000, np.float32)
        b = a * 2
        del a, b
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         timeout=120, check=True)
    return int(out.stdout.strip())


def test_retained_memory_is_reused_instead_of_faulted_in_again():
    if not embstore.allocator.retain_freed_memory():
        pytest.skip("no glibc malloc here")
    default, tuned = _faults("default"), _faults("tuned")
    # 40 steps x 40 MB: by default many steps fault (part of) their buffers in afresh;
    # retained, only the first step does (~10k faults).
    assert tuned * 10 < default, (default, tuned)


def test_sizes_beyond_what_glibc_takes_are_clamped_not_refused():
    if not embstore.allocator.retain_freed_memory():
        pytest.skip("no glibc malloc here")
    assert embstore.allocator.retain_freed_memory(max_block=1 << 40, keep=1 << 40)
