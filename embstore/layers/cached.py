"""Import path kept for :class:`CachedBackend`, which lives in :mod:`embstore.layers.cache`."""

from __future__ import annotations

from .cache import CachedBackend

__all__ = ["CachedBackend"]
