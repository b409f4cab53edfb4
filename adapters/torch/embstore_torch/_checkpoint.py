"""The rows of a store inside a module's ``state_dict`` (its ``_extra_state`` entry).

A store-backed module owns no ``nn.Parameter``, so without this a checkpoint would hold no
embeddings at all. The snapshot is the store's own native export (vectors, optimizer slots,
counts, metadata; CRC-checked) as one ``bytes`` value plus the few fields a restore checks. It
is ``bytes`` rather than a tensor on purpose: ``torch.load(weights_only=True)`` accepts it, and
``torch.distributed.checkpoint`` saves non-tensor values as byte blobs that a load *replaces*,
whereas it loads tensors in place into tensors of the same shape, which a table that grew or
shrank since the module was built does not have.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

import embstore
from embstore import StoreProtocol
from embstore.errors import EmbstoreError, InvalidInputError, ReadOnlyError, SchemaMismatchError

FORMAT = "embstore.rows/1"


def store_state(store: StoreProtocol, rows: bool = True) -> dict[str, Any]:
    """A snapshot of every record of ``store`` and its step, as plain Python values (with
    ``rows=False`` a reference only: ``"rows"`` is None)."""
    blob = None
    if rows:
        buf = io.BytesIO()
        store.export(buf)
        blob = buf.getvalue()
    return {"format": FORMAT, "url": store.url, "dim": int(store.dim),
            "key_type": store.key_type, "step": int(store.step), "rows": blob}


def restore_store(store: StoreProtocol, state: Any, where: str = "") -> None:
    """Make ``store`` hold exactly the snapshot ``state``: its rows (vectors, slots, counts)
    and its step. Rows written after the snapshot are deleted; ``version`` keeps moving
    forward (incremental exports see the restore as new writes and deletions)."""
    what = f"{where} checkpoint of {store.url}".strip()
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise InvalidInputError(f"{what}: not an embstore rows snapshot ({FORMAT})")
    if int(state["dim"]) != store.dim or state["key_type"] != store.key_type:
        raise SchemaMismatchError(
            f"{what}: the snapshot has dim={state['dim']}, key_type={state['key_type']!r}; "
            f"the store has dim={store.dim}, key_type={store.key_type!r}")
    if state["rows"] is None:  # a reference-only entry (checkpoint_rows=False): nothing to load
        return
    if store.read_only:
        raise ReadOnlyError(f"{what}: the store is open read-only; load_state_dict writes it")
    rows = state["rows"]
    if isinstance(rows, (bytearray, memoryview)):
        rows = bytes(rows)
    # Verify the snapshot before deleting anything: a damaged one leaves the store untouched.
    _verify(store, rows, what)
    current = [keys for keys, _ in store.records(65536)]
    if current:
        store.delete(np.concatenate(current) if store.key_type == "int64"
                     else [k for ks in current for k in ks])
    store.import_(rows)
    store.step = int(state["step"])
    store.flush()


def _verify(store: StoreProtocol, rows: bytes, what: str) -> None:
    with embstore.open("memory://", dim=store.dim, key_type=store.key_type,
                       optimizer=store.optimizer) as probe:
        try:
            probe.import_(rows)
        except EmbstoreError as e:  # name the module and store, keep the error's type
            raise type(e)(f"{what}: {e}") from e
