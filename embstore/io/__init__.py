"""File codecs: the interchange formats (native, Parquet, npz, word2vec, TSV) and their limits.

The codecs know no store. Import, export, copy and verify live in :mod:`embstore.transfer`;
their names are still reachable here. Names are loaded on first use, so ``import embstore``
stays light (pyarrow, for one, is imported only when a Parquet file is read or written).
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "import_file": "embstore.transfer", "export_file": "embstore.transfer",
    "copy_store": "embstore.transfer", "verify_file": "embstore.transfer",
    "verify_store": "embstore.transfer", "ImportReport": "embstore.transfer",
    "open_reader": "embstore.io.formats", "open_writer": "embstore.io.formats",
    "detect_format": "embstore.io.formats", "FORMATS": "embstore.io.formats",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
