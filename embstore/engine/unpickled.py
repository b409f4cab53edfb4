"""What a pickled store becomes when it cannot be reopened in the receiving process.

Unpickling runs inside the receiver's transport code: a ``multiprocessing.Pool`` worker reads
its task with ``pickle.loads`` and, when that raises (an ``OSError`` above all, which it takes
for a dead pipe), the worker exits and the task is lost: the pool hangs forever. So a store
that fails to reopen does not raise while being unpickled; it becomes an
:class:`UnopenedStore` that raises the reopen error on first use, inside the task, where the
pool reports it back to the caller like any other task failure.
"""

from __future__ import annotations

import functools
from typing import Any, NoReturn

from ..errors import EmbstoreError
from ..urls import redact_url
from .protocols import StoreProtocol, protocol_members

__all__ = ["UnopenedStore"]


class UnopenedStore:
    """Stand-in for an unpickled store whose reopen failed; every use raises that error.

    Attributes
    ----------
    url : str
        The store's URL (password redacted).
    error : BaseException
        The exception the reopen raised.
    """

    # Attribute access is the one way to reach every method of the real store without
    # listing them: here it only ever raises, it never delegates.
    def __init__(self, url: str, error: BaseException) -> None:
        self.__dict__.update(url=redact_url(url), error=error)

    def _fail(self) -> NoReturn:
        err = self.error
        msg = f"{self.url}: the unpickled store could not be reopened here: {err}"
        try:
            again = type(err)(msg) if isinstance(err, EmbstoreError) else None
        except Exception:  # noqa: BLE001 - an error type with another signature
            again = None
        raise (again or _ReopenError(msg)) from err

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._fail()

    def __len__(self) -> int:
        self._fail()

    def __enter__(self) -> NoReturn:
        self._fail()

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        """Nothing was opened: nothing to release."""

    @property
    def closed(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<UnopenedStore {self.url!r}: {type(self.error).__name__}: {self.error}>"


def _raising_method(declared: Any) -> Any:
    # the declared signature (``functools.wraps`` sets ``__wrapped__``, which
    # ``inspect.signature`` follows): the stand-in is held to the protocol like a real store
    @functools.wraps(declared)
    def method(self: UnopenedStore, *args: Any, **kwargs: Any) -> NoReturn:
        self._fail()

    return method


def _raising_property(name: str) -> property:
    def get(self: UnopenedStore) -> NoReturn:
        self._fail()

    return property(get, doc=f"Raises the reopen error (``{name}`` of the store).")


# Every member of the store protocol, declared here with its signature; it raises the reopen
# error (``__getattr__`` covers the rest of ``EmbeddingStore``'s surface the same way).
for _name, _declared in protocol_members(StoreProtocol).items():
    if _name in UnopenedStore.__dict__ or _name == "url":
        continue
    setattr(UnopenedStore, _name, _raising_method(_declared) if callable(_declared)
            and not isinstance(_declared, property) else _raising_property(_name))
del _name, _declared


class _ReopenError(EmbstoreError, RuntimeError):
    """A non-embstore error while reopening an unpickled store."""
