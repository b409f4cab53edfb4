"""Only the Extension list lives here; everything else is in pyproject.toml."""

import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

_HERE = ["embstore/_cython"]  # the es_*.h headers
# Native threads for the fused kernels where the compiler has OpenMP (GCC on Linux; Apple's
# clang has none: there the kernels run on the calling thread, with the same bits)
_OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []

extensions = [
    # -ffp-contract=off: in-place optimizer kernels must round as the numpy steps do;
    # -fno-math-errno: sqrtf becomes the (equally rounded) vector instruction
    Extension("embstore._cython.arena", ["embstore/_cython/arena.pyx"], include_dirs=_HERE,
              extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"]),
    # fused: bag sums and gradient sums round as torch's embedding_bag (fmaf only where it does)
    # (OpenMP: bags, keys and rows are split over native threads when a caller asks for them)
    Extension("embstore._cython.fused", ["embstore/_cython/fused.pyx"], include_dirs=_HERE,
              extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", *_OPENMP],
              extra_link_args=_OPENMP),
    Extension("embstore._cython.cuckoo", ["embstore/_cython/cuckoo.pyx"], include_dirs=_HERE,
              extra_compile_args=["-O3"]),
    Extension("embstore._cython.initrand", ["embstore/_cython/initrand.pyx"], include_dirs=_HERE,
              extra_compile_args=["-O3"]),
    Extension("embstore._cython.strkeys", ["embstore/_cython/strkeys.pyx"], include_dirs=_HERE,
              extra_compile_args=["-O3"]),
    Extension("embstore._cython.bytestable", ["embstore/_cython/bytestable.pyx"],
              include_dirs=_HERE, extra_compile_args=["-O3"]),
    # rowops: the row-wise mean square (es_rowsq.h) must round as the fused step's
    Extension("embstore._cython.rowops", ["embstore/_cython/rowops.pyx"], include_dirs=_HERE,
              extra_compile_args=["-O3", "-ffp-contract=off"]),
]

setup(ext_modules=cythonize(extensions, language_level=3))
