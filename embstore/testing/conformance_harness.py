"""The harness of the conformance suite: the ``url_factory`` fixture a subclass provides, the
stores a test opens (closed after it) and the layout a subclass runs over.

Every area of the suite (:class:`~embstore.testing.conformance.StoreConformance`,
:class:`~embstore.testing.conformance_lifecycle.StoreLifecycleConformance`,
:class:`~embstore.testing.conformance_backend.BackendPrimitiveConformance`) derives from
:class:`ConformanceHarness`; see :mod:`embstore.testing.conformance`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import embstore

from ..valuetypes import round_trip

DIM = 8
#: relative tolerance of a value stored after one step: two units in the last place
_RTOL = {"float32": 1e-6, "float16": 2.0 ** -9, "bfloat16": 2.0 ** -6}


def rows_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Structured-array equality that treats NaN bit patterns as data."""
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


def table_of(store: embstore.EmbeddingStore) -> dict[Any, np.ndarray]:
    """The whole table as {key: record} (keys as Python ints or bytes)."""
    out: dict[Any, np.ndarray] = {}
    for keys, recs in store.records(batch_size=97):
        for k, r in zip(keys.tolist(), recs):
            assert k not in out, f"scan returned key {k!r} twice"
            out[k] = r.copy()
    return out




class ConformanceHarness:
    """Opens the stores of one conformance test; see the module docstring."""

    open_options: dict[str, Any] = {}
    layout_options: dict[str, Any] = {}

    @pytest.fixture
    def url_factory(self):  # pragma: no cover - subclasses provide it
        raise NotImplementedError("subclasses define a url_factory fixture")

    @pytest.fixture(autouse=True)
    def _bind_factory(self, url_factory):
        self.url_factory = url_factory
        self._opened: list[embstore.EmbeddingStore] = []
        yield
        for s in self._opened:
            try:
                s.close()
            except Exception:  # noqa: BLE001 - cleanup must not mask the test's own failure
                pass

    # -- helpers -----------------------------------------------------------------------------------
    @property
    def value_dtype(self) -> str:
        return str(self.layout_options.get("value_dtype", "float32"))

    @property
    def rtol(self) -> float:
        """Relative tolerance of a value computed by one update step."""
        return _RTOL[self.value_dtype]

    def stored(self, values: Any) -> np.ndarray:
        """float32 ``values`` as the suite's layout stores (and reads back) them."""
        return round_trip(np.asarray(values, dtype=np.float32), self.value_dtype)

    def open(self, url: str | None = None, **kw: Any) -> embstore.EmbeddingStore:
        opts = {**self.layout_options, **self.open_options, **kw}
        if url is None:
            url = self.url_factory()
            opts.setdefault("dim", DIM)
        store = embstore.open(url, **opts)
        self._opened.append(store)
        return store

    def reopen(self, store: embstore.EmbeddingStore, **kw: Any) -> embstore.EmbeddingStore:
        url = store.url
        store.close()
        return self.open(url, **kw)

    def require_persistent(self, store: embstore.EmbeddingStore) -> None:
        if not store.backend.persistent:
            pytest.skip("backend is not persistent")
