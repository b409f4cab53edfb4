"""The store's own metadata: created or checked on open, written back merged on flush.

:class:`StoreMeta` owns what a store records about itself besides its rows' counters: the
schema (key type, layout, optimizer, initializer, seed), the extra metadata other writers
keep, and the :class:`~embstore.engine.metadata_merge.MetadataSync` that merges this writer's
step, version and policy state into what is stored (several writers never overwrite each
other's share).
"""

from __future__ import annotations

from typing import Any

from .. import init as _init
from .. import optim as _optim
from .._keys import check_key_type
from ..backends.base import Backend
from ..engine.metadata_fields import check_metadata, check_policy_fields, meta_fields
from ..engine.metadata_merge import MetadataSync
from ..engine.schema import FORMAT, FORMAT_VERSION, check_stored_meta
from ..errors import InvalidInputError, SchemaMismatchError, StoreNotFoundError
from ..layout import Layout
from ..policies.runtime import PolicyRuntime
from ..valuetypes import check_value_dtype

__all__ = ["StoreMeta"]


class StoreMeta:
    """The schema and store-level metadata of one open store.

    Parameters
    ----------
    backend : Backend
        Where the metadata is read from and written to.
    policy : PolicyRuntime
        The store's policies (their configuration and state are part of the metadata).
    url : str
        The store's URL (password redacted), for error messages.
    """

    key_type: str
    layout: Layout
    optimizer: _optim.Optimizer
    initializer: _init.Initializer
    seed: int

    def __init__(self, backend: Backend, policy: PolicyRuntime, url: str) -> None:
        self.backend, self.policy, self.url = backend, policy, url
        #: the metadata as last synced with the backend (merged on flush/close)
        self.sync = MetadataSync(backend, policy)
        #: metadata kept for others (e.g. a cache's writer leases), written back unchanged
        self.extra: dict[str, Any] = {}

    def open(self, *, read_only: bool, dim: int | None, key_type: str | None,
             initializer: Any, optimizer: Any, seed: int | None, value_dtype: str | None,
             metadata: str | None) -> tuple[int, int]:
        """Create the store's metadata, or check the stored one against what the caller
        asked for (options as given to ``embstore.open``); bind the backend to the layout and
        return the stored ``(step, version)``."""
        initializer, optimizer = _init.resolve(initializer), _optim.resolve(optimizer)
        metadata = check_metadata(metadata)
        if value_dtype is not None:
            value_dtype = check_value_dtype(value_dtype, serving=True)
        meta = self.backend.read_meta()
        if meta is None:
            if read_only:
                raise StoreNotFoundError(f"{self.url}: no store here to open read-only")
            if dim is None:
                raise InvalidInputError(f"{self.url}: dim is required to create a store")
            self.key_type = check_key_type(key_type or "int64")
            self.optimizer = optimizer or _optim.SGD(lr=0.01)
            self.initializer = initializer or _init.Uniform(-0.05, 0.05)
            self.seed = int(seed or 0)
            self.policy.restore({}, self.key_type, 0, created=True)
            serving = value_dtype == "int8"  # a serving table keeps no optimizer state
            self.layout = Layout(dim, () if serving else tuple(self.optimizer.slots(int(dim))),
                                 value_dtype or "float32",
                                 "float32" if serving else self.optimizer.slot_dtype,
                                 meta_fields(metadata or "full", self.policy, self.optimizer))
            self.backend.bind(self.layout, self.key_type)
            self.backend.write_meta(self.document(0, 0))
            self.sync.mark(0)
            return 0, 0
        stored = check_stored_meta(self.url, meta, dim=dim, key_type=key_type,
                                   initializer=initializer, optimizer=optimizer, seed=seed,
                                   value_dtype=value_dtype)
        self.key_type = stored.key_type
        self.layout = stored.layout
        self.optimizer = stored.optimizer
        self.initializer = stored.initializer
        self.seed = stored.seed
        step, version = int(meta.get("step", 0)), int(meta.get("version", 0))
        self.extra = dict(meta.get("extra", {}))
        stored_kind = "compact" if self.layout.is_compact else "full"
        if metadata is not None and metadata != stored_kind:
            raise SchemaMismatchError(f"{self.url}: the store was created with "
                                      f"metadata={stored_kind!r}, opened with {metadata!r}")
        self.backend.bind(self.layout, self.key_type)
        self.policy.restore(self.extra, self.key_type, version, created=False)
        check_policy_fields(self.url, self.layout, self.policy, self.optimizer)
        self.sync.mark(step)
        return step, version

    def document(self, step: int, version: int) -> dict[str, Any]:
        """The store-level metadata as recorded in the backend and in exports."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dim": self.layout.dim,
            "key_type": self.key_type,
            "layout": self.layout.to_json(),
            "record_size": self.layout.itemsize,
            "optimizer": self.optimizer.config(),
            "initializer": self.initializer.config(),
            "seed": self.seed,
            "step": step,
            "version": version,
            "extra": {**self.extra, "policies": self.policy.to_json()},
        }

    def write(self, step: int, version: int) -> tuple[int, int]:
        """Write this writer's metadata merged with the stored one; return the merged
        ``(step, version)`` (see :mod:`embstore.engine.metadata_merge`)."""
        return self.sync.write(step, self.document(step, version))

    def mark(self, step: int) -> None:
        """Count ``step`` as what the backend holds: the next write adds only later steps."""
        self.sync.mark(step)
