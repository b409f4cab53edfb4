"""Logging and the optional metrics hook.

Every module logs to a child of the ``"embstore"`` logger (``logging.getLogger(__name__)``);
this module gives that logger a ``NullHandler``, so nothing is printed unless the
application configures logging. Levels: WARNING for trouble being worked around (a retry
after a transient error, a table recreated, a write-behind failure), ERROR when it gave up,
INFO for notable housekeeping (LMDB map growth, a recovery, evictions, expiry), DEBUG for
routine events (write-behind flushes, cache evictions).

:func:`set_metrics_hook` installs one callable that receives the same events as
``hook(name, fields)`` (``name`` like ``"bigtable.retry"``, ``fields`` a dict of numbers and
strings), e.g. to feed counters into Prometheus or TensorBoard. A hook that raises is
logged and never breaks the operation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .errors import InvalidInputError

MetricsHook = Callable[[str, dict[str, Any]], None]

_hook: MetricsHook | None = None
_log = logging.getLogger("embstore.metrics")
# silent unless the application configures logging (embstore/__init__ imports this module)
logging.getLogger("embstore").addHandler(logging.NullHandler())


def set_metrics_hook(hook: MetricsHook | None) -> MetricsHook | None:
    """Install ``hook(name, fields)`` for embstore's events (None removes it).

    Returns the previous hook, so a caller can restore it.
    """
    global _hook
    if hook is not None and not callable(hook):
        raise InvalidInputError(f"the metrics hook must be callable, got {hook!r}")
    previous, _hook = _hook, hook
    return previous


def event(logger: logging.Logger, level: int, name: str, msg: str, *args: Any,
          **fields: Any) -> None:
    """Log ``msg % args`` at ``level`` and tell the metrics hook ``(name, fields)``."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, *args)
    hook = _hook
    if hook is not None:
        try:
            hook(name, fields)
        except Exception:  # noqa: BLE001 - a broken hook must not break a write
            _log.exception("metrics hook failed on %s", name)
