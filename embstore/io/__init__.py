"""Interchange formats and offline transfer (import, export, copy, verify).

The names below are loaded on first use, so ``import embstore`` stays light (pyarrow, for
one, is imported only when a Parquet file is read or written).
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "import_file": "transfer", "export_file": "transfer", "copy_store": "transfer",
    "verify_file": "transfer", "verify_store": "transfer", "ImportReport": "transfer",
    "open_reader": "formats", "open_writer": "formats", "detect_format": "formats",
    "FORMATS": "formats",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
