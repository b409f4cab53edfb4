"""Compile ``native/embstore_ops.cc`` against the installed TensorFlow, once per version.

The library goes into a per-user cache directory (``$EMBSTORE_TF_CACHE``, else
``$XDG_CACHE_HOME/embstore/tf-ops`` or ``~/.cache/embstore/tf-ops``) under a name keyed by
the TensorFlow version and a hash of everything the build depends on (the source, the
compiler and its flags, TF's, Python's and numpy's versions), so an upgrade builds anew and
never loads a stale library. A build writes a temporary file and renames it into place:
processes building at the same time each leave a complete library, never a torn one.

The compiler is ``$EMBSTORE_TF_CXX``, else ``$CXX``, else the first of ``c++``, ``g++``,
``clang++`` on ``PATH``. A compile error is remembered beside the library (``*.failed``, the
compiler's message) so later processes do not spend the build time again; delete that file,
or change the compiler, to retry.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

__all__ = ["BuildError", "build", "cache_dir", "library_path"]

SOURCE = Path(__file__).resolve().parent / "native" / "embstore_ops.cc"
#: seconds a compile may take (TF's headers are large: ~10 s on an idle core)
TIMEOUT_S = 600.0


class BuildError(RuntimeError):
    """The op library could not be built (the adapter then uses ``tf.numpy_function``)."""


def cache_dir() -> Path:
    env = os.environ.get("EMBSTORE_TF_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "embstore" / "tf-ops"


def _compiler() -> list[str]:
    cxx = os.environ.get("EMBSTORE_TF_CXX") or os.environ.get("CXX")
    if cxx:
        return shlex.split(cxx)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return [found]
    raise BuildError("no C++ compiler (c++, g++ or clang++ on PATH, or $EMBSTORE_TF_CXX)")


def _command(cxx: list[str], out: str) -> list[str]:
    import numpy as np
    import tensorflow as tf

    cmd = [*cxx, "-shared", "-fPIC", "-O3", "-Wno-deprecated-declarations", str(SOURCE),
           "-o", out, *tf.sysconfig.get_compile_flags(),
           "-I" + sysconfig.get_paths()["include"], "-I" + np.get_include(),
           *tf.sysconfig.get_link_flags()]
    if sys.platform == "darwin":  # Python's symbols come from the process that loads it
        cmd += ["-undefined", "dynamic_lookup"]
    return cmd


def library_path() -> tuple[Path, list[str]]:
    """Where the library for this TF/Python/numpy/compiler lives, and the command building it.
    """
    import numpy as np
    import tensorflow as tf

    cxx = _compiler()
    cmd = _command(cxx, "OUT")
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), tf.__version__.encode(), np.__version__.encode(),
                 sys.version.encode(), sysconfig.get_platform().encode(),
                 "\0".join(cmd).encode()):
        key.update(hashlib.sha256(part).digest())
    name = f"embstore_ops-tf{tf.__version__}-{key.hexdigest()[:16]}.so"
    return cache_dir() / name, cmd


def build() -> Path:
    """The path of the compiled library, building it first if the cache has none.

    Raises
    ------
    BuildError
        No compiler, a compile error (remembered: see the module docstring), a timeout or an
        unwritable cache directory; the message is one line.
    """
    path, cmd = library_path()
    if path.exists():
        return path
    failed = path.with_name(path.name + ".failed")
    if failed.exists():
        raise BuildError(f"an earlier build failed ({failed}; delete it to retry)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise BuildError(f"cannot write the cache directory {path.parent}: {e}") from e
    try:
        cmd = [tmp if a == "OUT" else a for a in cmd]
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
        except FileNotFoundError as e:
            raise BuildError(f"compiler {cmd[0]!r} not found ({e.strerror})") from e
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"compiling {SOURCE.name} failed: {e}") from e
        if proc.returncode != 0:
            errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
            first = (errors or proc.stderr.strip().splitlines() or ["(no output)"])[0]
            try:
                failed.write_text(" ".join(cmd) + "\n\n" + proc.stderr)
            except OSError:
                pass
            raise BuildError(f"compiling {SOURCE.name} failed (exit {proc.returncode}): "
                             f"{first.strip()[:300]}")
        os.replace(tmp, path)
        return path
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
