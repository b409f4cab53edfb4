"""Only the Extension list lives here; everything else is in pyproject.toml."""

from Cython.Build import cythonize
from setuptools import Extension, setup

_HERE = ["embstore/_cython"]  # es_prefetch.h, es_memory.h, es_hash.h, es_xxh.h, es_keyword.h

extensions = [
    # -ffp-contract=off: in-place optimizer kernels must round as the numpy steps do;
    # -fno-math-errno: sqrtf becomes the (equally rounded) vector instruction
    Extension("embstore._cython.arena", ["embstore/_cython/arena.pyx"], include_dirs=_HERE,
              extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"]),
    # fused: bag sums and gradient sums round as torch's embedding_bag (fmaf only where it does)
    Extension("embstore._cython.fused", ["embstore/_cython/fused.pyx"], include_dirs=_HERE,
              extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"]),
    Extension("embstore._cython.cuckoo", ["embstore/_cython/cuckoo.pyx"], include_dirs=_HERE,
              extra_compile_args=["-O3"]),
    Extension("embstore._cython.initrand", ["embstore/_cython/initrand.pyx"], include_dirs=_HERE,
              extra_compile_args=["-O3"]),
    Extension("embstore._cython.strkeys", ["embstore/_cython/strkeys.pyx"], include_dirs=_HERE,
              extra_compile_args=["-O3"]),
    Extension("embstore._cython.bytestable", ["embstore/_cython/bytestable.pyx"],
              include_dirs=_HERE, extra_compile_args=["-O3"]),
    Extension(
        "embstore._cython.rowops", ["embstore/_cython/rowops.pyx"], extra_compile_args=["-O3"]
    ),
]

setup(ext_modules=cythonize(extensions, language_level=3))
