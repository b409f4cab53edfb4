"""Store-level metadata: what a store records about itself, and the checks made on reopen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import init as _init
from .. import optim as _optim
from ..errors import SchemaMismatchError
from ..layout import Layout

FORMAT = "embstore"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class StoredSchema:
    """The schema a store was created with, as read back from its metadata."""

    key_type: str
    layout: Layout
    optimizer: _optim.Optimizer
    initializer: _init.Initializer
    seed: int


def check_stored_meta(url: str, meta: dict[str, Any], *, dim: int | None, key_type: str | None,
                      initializer: Any, optimizer: Any, seed: int | None,
                      value_dtype: str | None = None) -> StoredSchema:
    """Parse stored metadata and compare it with what the caller asked for.

    Every option the caller gave must equal the stored one; options left out (None) are
    taken from the store. Raises ``SchemaMismatchError`` naming both values otherwise.
    """
    if meta.get("format") != FORMAT:
        raise SchemaMismatchError(f"{url}: holds data that is not an embstore store")
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise SchemaMismatchError(
            f"{url}: store format {meta['format_version']} is newer than this embstore "
            f"supports ({FORMAT_VERSION}); upgrade embstore"
        )
    stored_layout = Layout.from_json(meta["layout"])

    def mismatch(what: str, stored: Any, given: Any) -> SchemaMismatchError:
        return SchemaMismatchError(
            f"{url}: the store was created with {what}={stored!r}, opened with {given!r}"
        )

    if dim is not None and int(dim) != stored_layout.dim:
        raise mismatch("dim", stored_layout.dim, dim)
    if value_dtype is not None and value_dtype != stored_layout.value_dtype:
        raise mismatch("value_dtype", stored_layout.value_dtype, value_dtype)
    if key_type is not None and key_type != meta["key_type"]:
        raise mismatch("key_type", meta["key_type"], key_type)
    stored_opt = _optim.from_config(meta["optimizer"])
    if optimizer is not None and optimizer != stored_opt:
        raise mismatch("optimizer", stored_opt, optimizer)
    stored_init = _init.from_config(meta["initializer"])
    if initializer is not None and initializer != stored_init:
        raise mismatch("initializer", stored_init, initializer)
    if seed is not None and int(seed) != int(meta["seed"]):
        raise mismatch("seed", meta["seed"], seed)
    slots = () if not stored_layout.trainable else tuple(stored_opt.slots(stored_layout.dim))
    expected = Layout(stored_layout.dim, slots,
                      stored_layout.value_dtype,
                      stored_opt.slot_dtype if stored_layout.trainable else "float32",
                      stored_layout.meta)
    if expected != stored_layout:
        raise SchemaMismatchError(
            f"{url}: stored layout {stored_layout} does not fit optimizer {stored_opt}"
        )
    return StoredSchema(meta["key_type"], stored_layout, stored_opt, stored_init,
                        int(meta["seed"]))
