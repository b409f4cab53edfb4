"""The repository root, for tests that read files beside the package (docs, pyproject, deploy)
wherever under ``tests/`` they live."""

from __future__ import annotations

from pathlib import Path

#: the checkout's top directory (the parent of ``tests/``)
REPO_ROOT = Path(__file__).resolve().parent.parent
