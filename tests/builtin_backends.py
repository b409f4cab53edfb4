"""The one registry of built-in backends the cross-backend tests run on.

Each entry says how a test makes a fresh store URL of that backend and what it can do. What a
:class:`~embstore.backends.base.Backend` declares (``persistent``) is read from its class; the
behaviours no flag states (several writing processes, a forked child's writes, kill loops worth
their time) are declared here, once. :func:`conformance_tests` subclasses an opt-in conformance
class of :mod:`embstore.testing` once per backend, so a test module holds no list of backends::

    globals().update(conformance_tests(SeveralWritersConformance))

A third-party backend does the same by subclassing the conformance class itself (see
``docs/architecture.md``, "Conformance tests for a backend").
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass(frozen=True)
class BuiltinBackend:
    """One built-in backend as the tests see it."""

    #: the test id ("postgres", not the scheme "postgresql")
    name: str
    scheme: str
    #: the session fixture that makes URLs on a real server (None: a local file or memory)
    server_fixture: str | None = None
    #: other processes may open the store for writing while one writes
    several_processes: bool = False
    #: a forked child's writes land (True), the child is refused (False), not checked (None)
    fork_writes: bool | None = None
    #: SIGKILL loops run on it (persistent backends; not the Bigtable emulator, too slow)
    crash: bool = False
    #: class attributes of the conformance classes (each class takes those it defines)
    settings: dict[str, Any] = field(default_factory=dict)

    def backend_class(self) -> type | None:
        """The backend class, or None when its module or extra is not installed."""
        from embstore.errors import BackendUnavailableError, UnknownSchemeError
        from embstore.registry import backend_class

        try:
            return backend_class(f"{self.scheme}://x")
        except (BackendUnavailableError, UnknownSchemeError, ImportError):
            return None

    @property
    def persistent(self) -> bool:
        cls = self.backend_class()
        return bool(cls is not None and cls.persistent)

    def url_factory(self, request: Any, tmp_path: Any) -> Callable[[], str]:
        """A callable returning a fresh, empty store URL per call; skips the test when the
        backend or its server is not available."""
        if self.backend_class() is None:
            pytest.skip(f"{self.name} backend not available")
        if self.server_fixture is not None:
            try:
                made = request.getfixturevalue(self.server_fixture)
            except pytest.FixtureLookupError:
                pytest.skip(f"no {self.server_fixture} fixture in this checkout")
            return made
        counter = itertools.count()
        if self.scheme == "memory":
            return lambda: "memory://"
        if self.scheme == "sqlite":
            return lambda: f"sqlite:///{tmp_path}/db{next(counter)}.sqlite"
        return lambda: f"{self.scheme}://{tmp_path}/{self.name}{next(counter)}"


_LOCAL_FAST = {"writer_options": {"durable": False}}  # fsync per batch is not under test

BUILTIN: tuple[BuiltinBackend, ...] = (
    BuiltinBackend("memory", "memory", settings={"restore_across_processes": False,
                                                 "replace_mechanism": "staging-table"}),
    BuiltinBackend("lmdb", "lmdb", several_processes=True, fork_writes=True, crash=True,
                   settings={**_LOCAL_FAST, "replace_mechanism": "transaction"}),
    BuiltinBackend("rocksdb", "rocksdb", fork_writes=False, crash=True,
                   settings={**_LOCAL_FAST, "restore_in_process": False,
                             "replace_mechanism": "staging-directory"}),
    BuiltinBackend("sqlite", "sqlite", several_processes=True, fork_writes=True, crash=True,
                   settings={**_LOCAL_FAST, "writer_steps": 30,
                             "replace_mechanism": "transaction"}),
    BuiltinBackend("postgres", "postgresql", "postgres_url_factory", several_processes=True,
                   fork_writes=True, crash=True,
                   settings={"writer_steps": 25, "restore_in_process": False,
                             "replace_mechanism": "transaction"}),
    BuiltinBackend("bigtable", "bigtable", "bigtable_url_factory", several_processes=True,
                   fork_writes=True,
                   # the emulator writes ~35k rows/s: a smaller table, fewer swaps
                   settings={"writer_steps": 10, "writer_keys": 40, "restore_rows": 1000,
                             "restore_rounds": 6, "restore_in_process": False,
                             "replace_mechanism": "staging-table"}),
)
BY_NAME = {b.name: b for b in BUILTIN}
#: every built-in backend's name, in registry order
NAMES: tuple[str, ...] = tuple(BY_NAME)


def names(where: Callable[[BuiltinBackend], bool]) -> list[str]:
    """The names of the built-in backends ``where`` accepts (for ``parametrize``)."""
    return [b.name for b in BUILTIN if where(b)]


def _class_settings(backend: BuiltinBackend, base: type) -> dict[str, Any]:
    declared = {"several_processes": backend.several_processes,
                "fork_writes": backend.fork_writes, **backend.settings}
    return {k: v for k, v in declared.items() if hasattr(base, k)}


def _fixture_of(backend: BuiltinBackend) -> Any:
    @pytest.fixture
    def url_factory(self, request, tmp_path):
        return backend.url_factory(request, tmp_path)
    return url_factory


def conformance_tests(base: type, where: Callable[[BuiltinBackend], bool] = lambda b: True
                      ) -> dict[str, type]:
    """``{"Test<Backend><Area>": subclass}``: ``base`` subclassed once per built-in backend
    ``where`` accepts, with that backend's URL fixture and settings."""
    area = base.__name__.removesuffix("Conformance")
    out: dict[str, type] = {}
    for b in BUILTIN:
        if where(b):
            name = f"Test{b.name.capitalize()}{area}"
            out[name] = type(name, (base,), {"url_factory": _fixture_of(b),
                                             **_class_settings(b, base)})
    return out
