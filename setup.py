"""Only the Extension list lives here; everything else is in pyproject.toml."""

import glob
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

_HERE = ["embstore/_cython"]  # the es_*.h headers
# every module rebuilds when a header changes (the fused kernels' bodies sit two includes
# down, where Cython's own tracking does not look)
_HEADERS = sorted(glob.glob("embstore/_cython/es_*.h"))
# Native threads for the fused kernels where the compiler has OpenMP (GCC on Linux; Apple's
# clang has none: there the kernels run on the calling thread, with the same bits)
_OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []


def _module(name: str, sources: list[str], **kw: object) -> Extension:
    return Extension(f"embstore._cython.{name}", sources, include_dirs=_HERE, depends=_HEADERS,
                     **kw)


extensions = [
    # -ffp-contract=off: in-place optimizer kernels must round as the numpy steps do;
    # -fno-math-errno: sqrtf becomes the (equally rounded) vector instruction
    _module("arena", ["embstore/_cython/arena.pyx"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"]),
    # fused: bag sums and gradient sums round as torch's embedding_bag (fmaf only where it does)
    # (OpenMP: bags, keys and rows are split over native threads when a caller asks for them)
    _module("fused", ["embstore/_cython/fused.pyx"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", *_OPENMP],
            extra_link_args=_OPENMP),
    # fused_tables: fused's kernels for a collection's tables, spread over threads
    _module("fused_tables", ["embstore/_cython/fused_tables.pyx"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", *_OPENMP],
            extra_link_args=_OPENMP),
    _module("cuckoo", ["embstore/_cython/cuckoo.pyx"], extra_compile_args=["-O3"]),
    # deltaops: a follower's delta read from a memory:// table, the lock taken per chunk
    _module("deltaops", ["embstore/_cython/deltaops.pyx"], extra_compile_args=["-O3"]),
    _module("initrand", ["embstore/_cython/initrand.pyx"], extra_compile_args=["-O3"]),
    _module("strkeys", ["embstore/_cython/strkeys.pyx"], extra_compile_args=["-O3"]),
    _module("bytestable", ["embstore/_cython/bytestable.pyx"], extra_compile_args=["-O3"]),
    # digest: XXH3-128 of a part file (a manifest's checksum)
    _module("digest", ["embstore/_cython/digest.pyx"], extra_compile_args=["-O3"]),
    # rowops: the row-wise mean square (es_rowsq.h) must round as the fused step's
    # qscan: the int8 scan of the exact "scan" top-k index (an AVX2 build picked at run time)
    _module("qscan", ["embstore/_cython/qscan.pyx"], extra_compile_args=["-O3"]),
    _module("rowops", ["embstore/_cython/rowops.pyx"],
            extra_compile_args=["-O3", "-ffp-contract=off"]),
    # indexops: the sampler's inverse-cdf search and weights, a batch's grouping (exact ops)
    _module("indexops", ["embstore/_cython/indexops.pyx"],
            extra_compile_args=["-O3", "-ffp-contract=off"]),
]

setup(ext_modules=cythonize(extensions, language_level=3))
