"""Moved to :mod:`embstore.transfer` (import, export, copy and verify sit above the store and
the file codecs); this path keeps working for code written against it."""

from __future__ import annotations

from ...transfer import *  # noqa: F403
from ...transfer import __all__  # noqa: F401
