"""The optional dependency groups (pyproject's extras) and the command that installs each.

Every "this needs a package" message is built here, so the extra it names always exists and
the requirement beside it is the one pyproject declares (a test holds the two equal).
"""

from __future__ import annotations

import shlex

__all__ = ["EXTRAS", "install_hint", "missing_module"]

#: extra -> the requirements it installs (the drivers only; core deps are numpy and tqdm)
EXTRAS: dict[str, tuple[str, ...]] = {
    "lmdb": ("lmdb>=1.4",),
    "rocksdb": ("rocksdict>=0.3.20",),
    "sql": ("sqlalchemy>=2.0",),
    "postgres": ("sqlalchemy>=2.0", "psycopg[binary]>=3.1"),
    "bigtable": ("google-cloud-bigtable>=2.20",),
    "bloom": ("pybloom-live>=4.0",),
    "parquet": ("pyarrow>=14",),
    "service": ("pyarrow>=14",),
    "ann": ("pyarrow>=14", "usearch>=2.9"),
}


def install_hint(extra: str) -> str:
    """The commands that install ``extra``: from a checkout, and beside an installed wheel.

    embstore is not on PyPI, so the extra cannot be named on the package there; beside a wheel
    the extra's own requirements are installed directly.
    """
    hint = f"pip install -e '.[{extra}]' in a checkout of embstore"
    reqs = EXTRAS.get(extra)
    if reqs:
        hint += f", or pip install {' '.join(shlex.quote(r) for r in reqs)} beside a wheel"
    return hint


def missing_module(e: BaseException) -> str | None:
    """The name of the module whose import failed, following ``raise ... from`` chains."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ImportError) and seen.name:
            return seen.name
        seen = seen.__cause__
    return None
