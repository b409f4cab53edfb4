"""The engine: :class:`EmbeddingStore` and the parts it owns.

- :mod:`embstore.store.core`: ``EmbeddingStore``, which validates each call at its edge;
- :mod:`embstore.store.writer`: ``RecordWriter``, every row write and delete, the version
  clock, the step, the operation counters and the observers;
- :mod:`embstore.store.meta`: ``StoreMeta``, the schema and store-level metadata (created,
  checked on reopen, merged with other writers' on flush);
- :mod:`embstore.store.observers`: ``Observers``, who is told about each row change.

The seams the engine offers other layers (the store protocol, observers, the hosts that
sampling and the policies see) are declared in :mod:`embstore.engine.protocols`.
"""

from __future__ import annotations

from .core import EmbeddingStore

__all__ = ["EmbeddingStore"]
