"""Progress bars for long jobs: tqdm on a terminal, silent when output is piped."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *a: Any, **k: Any) -> None:
        pass


@contextmanager
def progress_bar(total: int | None = None, *, enabled: bool = True, desc: str = "",
                 unit: str = "rows"):
    """Yield an object with ``update(n)``; a tqdm bar only when enabled and stderr is a TTY."""
    if not enabled or not sys.stderr.isatty():
        yield _Silent()
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()
