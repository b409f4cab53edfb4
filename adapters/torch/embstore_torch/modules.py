"""``DynamicEmbedding`` and what every store-backed module shares (``StoreModule``).

The store holds the vectors and applies their updates itself (its own optimizer), so these
modules own no ``nn.Parameter``; the autograd bridges that carry a backward's gradient into
``store.update`` are in ``_bridges.py``, ``DynamicEmbeddingBag`` in ``bag.py``. The user's
torch optimizer keeps driving the dense parameters as usual.
"""

from __future__ import annotations

import copy
import inspect
import os
import pickle
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embstore import StoreProtocol
from embstore.errors import EmbstoreError, InvalidInputError, ReadOnlyError
from embstore.keys import normalize

from . import _compiled, _fused, _transfer
from ._bridges import Sink, StoreGather, StoreRows
from ._checkpoint import restore_store, store_state
from ._keys import KeyBatch, factorize, int_batch, integer_ids, kept_starts, per_key_sum, prepare
from .distributed.checkpoint import restore_shard, shard_state

__all__ = ["DynamicEmbedding", "TracingUnsupportedError", "store_rows"]


class TracingUnsupportedError(EmbstoreError, RuntimeError):
    """``torch.jit.trace`` of a store-backed module: the trace would freeze the looked-up rows."""


_TRACE_MESSAGE = (
    "torch.jit.trace cannot record a store lookup: the keys and rows would be baked into the "
    "trace as constants and no update would ever reach the store. Use torch.compile(model) "
    "(the store call is a custom op there), or trace/export only the dense part and feed it "
    "the embedding output."
)


# Bumped in every forked child: a module notices it runs in a copy of its writer's process
# (a DataLoader worker started by fork) with one integer compare per forward.
_FORKS = [0]


def _after_fork_in_child() -> None:
    _FORKS[0] += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _supports_counts(store: StoreProtocol, method: str = "update") -> bool:
    try:
        return "counts" in inspect.signature(getattr(store, method)).parameters
    except (TypeError, ValueError, AttributeError):  # pragma: no cover - exotic store objects
        return False


def _process_copy(store: StoreProtocol) -> StoreProtocol:
    """The store a module uses in a forked child (a DataLoader worker started by fork): the
    inherited handle is the parent's writer, so reopen it as an unpickled copy is reopened,
    read-only (see ``embstore.writable_unpickling``). A store that refuses to pickle
    (``memory://``) stays: its backend raises ``ForkedProcessError`` on first use."""
    try:
        blob = pickle.dumps(store)
    except (pickle.PicklingError, TypeError, AttributeError):
        return store
    return pickle.loads(blob)


def store_rows(store: StoreProtocol, keys: Any, *, insert: bool = True, trainable: bool = True,
               counts: np.ndarray | None = None) -> torch.Tensor:
    """Vectors of distinct ``keys`` as a ``(n, dim)`` float32 tensor wired to ``store.update``.

    This is the primitive both modules (and :class:`~embstore_torch.SampledSoftmaxLoss`) build
    on: gather from the returned rows with ordinary torch ops, and on ``backward`` the rows'
    gradient is applied by the store's optimizer, once per backward pass.

    Parameters
    ----------
    store : embstore.EmbeddingStore
    keys : int64 array or list of str/bytes
        Distinct keys (duplicates work but are summed by the store).
    insert : bool
        Write unknown keys on lookup (training) or not (serving). Only where a backward can
        follow: with ``trainable=False`` or under ``torch.no_grad`` nothing is inserted.
    trainable : bool
        With False (or under ``torch.no_grad``) the rows are a plain tensor and nothing is
        ever written back.
    counts : array of int64, optional
        Occurrences of each key in the batch, forwarded to ``store.update`` where the store
        accepts them, so per-key frequency counts stay exact after deduplication.
    """
    vectors = store.lookup(keys, insert=insert and trainable and torch.is_grad_enabled())
    if not (trainable and torch.is_grad_enabled()):
        return torch.from_numpy(vectors)
    trigger = torch.empty(0, requires_grad=True)
    return StoreRows.apply(trigger, vectors, Sink(store, keys, counts))


def store_is_collective(store: StoreProtocol) -> bool:
    """Whether every rank must call ``store`` in step (``embstore_torch.distributed.store``): an
    empty batch then still looks up, and its backward still updates, with no keys."""
    return bool(getattr(store, "collective", False))


def padding_key_of(store: StoreProtocol, padding_key: Any, padding_idx: Any) -> Any:
    """The padding key in the store's key form (int, or bytes), or None."""
    if padding_idx is not None:
        if padding_key is not None:
            raise InvalidInputError("pass padding_key or its alias padding_idx, not both")
        padding_key = padding_idx
    if padding_key is None:
        return None
    return normalize([padding_key], store.key_type)[0]


class StoreModule(nn.Module):
    #: Whether ``state_dict()`` carries the store's rows (True) or only a reference to the
    #: store (url, dim, key type, step) for tables too large to snapshot per checkpoint.
    checkpoint_rows: bool = True

    def __init__(self, store: StoreProtocol, trainable: bool | None, count: bool = True,
                 padding_key: Any = None, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False) -> None:
        super().__init__()
        if trainable and store.read_only:
            raise ReadOnlyError(
                f"{store.url} is open read-only: a trainable embedding would have to write it; "
                "pass trainable=False (or leave it unset) to serve from it"
            )
        self.store = store
        self.trainable = (not store.read_only) if trainable is None else bool(trainable)
        self.embedding_dim = int(store.dim)
        self.count = bool(count)
        self.padding_key = padding_key
        self.max_norm = None if max_norm is None else float(max_norm)
        self.norm_type = float(norm_type)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)
        self._counts = _supports_counts(store)
        self._lookup_counts = _supports_counts(store, "lookup")
        self._forks = _FORKS[0]
        # Moves with module.to(device): outputs are placed where the rest of the model lives.
        self.register_buffer("_anchor", torch.empty(0), persistent=False)
        # Under torch.compile the store call is a custom op (see _compiled.py): the handle names
        # this module in it, the trigger is the grad-requiring graph input its backward uses.
        self.register_buffer("_trigger", torch.zeros(0, requires_grad=True), persistent=False)
        self._handle = _compiled.register(self)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # a forward's grouping kept for its backward, by modules pickled before the compiled
        # ops kept it themselves
        state.pop("_compiled_batch", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._handle = _compiled.register(self)  # copies (pickle, deepcopy) are other modules
        # modules pickled before these options and compiled ops existed
        for name, default in (("padding_key", None), ("max_norm", None), ("norm_type", 2.0),
                              ("scale_grad_by_freq", False), ("_lookup_counts", False)):
            self.__dict__.setdefault(name, default)
        self._forks = _FORKS[0]  # an unpickled store is already this process's own
        if "_trigger" not in self._buffers:
            self.register_buffer("_trigger", torch.zeros(0, requires_grad=True),
                                 persistent=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> StoreModule:
        """A copy over the *same* store object (EMA, ``AveragedModel``): the store is a
        database handle, not a tensor, so its rows are shared, never duplicated."""
        memo.setdefault(id(self.store), self.store)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = self.__getstate__()
        state.pop("_handle", None)
        new.__dict__.update({name: copy.deepcopy(value, memo) for name, value in state.items()},
                            _handle=_compiled.register(new))
        return new

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        out = super()._apply(fn, recurse)
        # .double() / .to(dtype) turns the trigger into a non-leaf: it must stay a leaf that
        # requires grad (the compiled backward hangs on it; deepcopy copies only leaves). It
        # moves with the module (DDP broadcasts buffers on the model's device): the ops take
        # it as .cpu(), and autograd carries its gradient back to its device.
        trig = self._buffers.get("_trigger")
        if trig is not None and not trig.is_leaf:
            self._buffers["_trigger"] = trig.detach().requires_grad_(True)
        return out

    @property
    def _dtype(self) -> torch.dtype:
        """The module's float dtype (``.double()``, ``.half()``, ``.to(torch.bfloat16)``)."""
        return self._anchor.dtype

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """The float32 rows in the module's device and dtype (autograd casts gradients back)."""
        anchor = self._buffers["_anchor"]  # (not nn.Module.__getattr__: paid every step)
        return _transfer.to_device(out, anchor.device, anchor.dtype)

    def _eager_how(self, mode: str) -> tuple[str, StoreProtocol, bool, bool]:
        """``_fused.eager_bag``'s ``(mode, store, count, pinned)`` for this module."""
        return mode, self.store, self.count, _transfer.staged(self._buffers["_anchor"].device)

    @property
    def pooled_pinned(self) -> bool:
        """Whether fused forwards pool into pinned host memory (the module is on a GPU)."""
        return _transfer.staged(self._anchor.device)

    def _store_here(self) -> StoreProtocol:
        """``self.store``, reopened read-only first where this is a forked child."""
        if self._forks != _FORKS[0]:
            self._forks = _FORKS[0]
            self.store = _process_copy(self.store)
        return self.store

    def _compiled_rows(self, input: torch.Tensor) -> torch.Tensor:
        """The rows of ``input`` through the ``embstore::lookup`` custom op (``_compiled.py``):
        its backward reaches this module's :meth:`apply_gradient` by the module's handle."""
        trigger = self._trigger if self.trainable else self._trigger.detach()
        return _compiled.lookup(input, trigger, self._handle, self.embedding_dim, self._writes())

    def lookup_rows(self, batch: KeyBatch, insert: bool) -> np.ndarray:
        """The vectors of ``batch.uniq`` (the padding key's row included), inserting unknown
        keys where ``insert``: the forward of the ``embstore::lookup`` custom op."""
        return self._vectors(batch, insert)[0]

    def apply_gradient(self, batch: KeyBatch, grad: torch.Tensor) -> None:
        """Hand ``grad``, float32 ``(n, dim)`` rows aligned with ``batch``'s flattened input,
        to the store, summed per key (the padding key's dropped): the backward of the
        ``embstore::lookup`` custom op."""
        pad = self._pad_row(batch.uniq)
        keys = batch.keys
        if pad is not None:
            keys = batch.uniq
            keys = (np.delete(keys, pad) if isinstance(keys, np.ndarray)
                    else keys[:pad] + keys[pad + 1:])
        order, starts, _ = batch.group()
        self._sink(batch, keys, pad).apply(per_key_sum(grad, order, starts))

    def _empty_output(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The output of an empty batch: zeros in the module's dtype and device, requiring
        grad where a trainable module's would, so ``loss.backward()`` runs (and writes
        nothing)."""
        grad = self.trainable and torch.is_grad_enabled()
        return torch.zeros(shape, device=self._anchor.device, dtype=self._anchor.dtype,
                           requires_grad=grad)

    @property
    def op_handle(self) -> int:
        """The integer naming this module in the compiled ops (``_compiled.module_of``)."""
        return self._handle

    @property
    def op_trigger(self) -> torch.Tensor:
        """The grad-requiring input the compiled ops hang their backward on."""
        return self._trigger

    def _writes(self) -> bool:
        """Whether this forward may write: a training step that a backward can follow."""
        return self.training and self.trainable and torch.is_grad_enabled()

    def _pad_row(self, uniq: Any) -> int | None:
        """Row of the padding key among a batch's distinct keys, or None."""
        pad = self.padding_key
        if pad is None or len(uniq) == 0:
            return None
        if isinstance(uniq, np.ndarray) and uniq.dtype != object:  # int64 (FactorizedKeys':
            hit = np.flatnonzero(uniq == pad)                        # in any order)
            return int(hit[0]) if len(hit) else None
        for i, k in enumerate(uniq):  # str keys are UTF-8 encoded by the store
            if (k.encode("utf-8") if isinstance(k, str) else bytes(k)) == pad:
                return i
        return None

    def _lookup(self, batch: KeyBatch) -> tuple[np.ndarray, Sink | None]:
        """Vectors of the distinct keys, and the sink of their gradient (None: frozen).

        Unknown keys are inserted only by a training forward a backward can follow
        (:meth:`_writes`). The padding key is never inserted: it reads what the store holds
        for it (zeros unless assigned) and its gradient row is dropped before ``store.update``.
        """
        if torch.jit.is_tracing():
            raise TracingUnsupportedError(_TRACE_MESSAGE)
        self._store_here()
        vectors, keys, pad = self._vectors(batch, self._writes())
        if not (self.trainable and torch.is_grad_enabled()):
            return vectors, None
        return vectors, self._sink(batch, keys, pad)

    def _vectors(self, batch: KeyBatch, insert: bool) -> tuple[np.ndarray, Any, int | None]:
        """``(vectors of batch.uniq, the keys looked up, padding row or None)``."""
        store = self._store_here()
        pad = self._pad_row(batch.uniq)
        # the store's key form, known distinct where embstore deduplicated the batch
        keys = batch.uniq if pad is not None or self.max_norm is not None else batch.keys
        counts = None
        if insert and self._lookup_counts and getattr(store, "admission", None) is not None:
            counts = batch.group()[2]  # admission counts occurrences, not distinct keys
        if pad is not None:
            keys = (np.delete(keys, pad) if isinstance(keys, np.ndarray)
                    else keys[:pad] + keys[pad + 1:])
            counts = None if counts is None else np.delete(counts, pad)
        if counts is not None:
            vectors = store.lookup(keys, insert=insert, counts=counts)
        else:
            vectors = store.lookup(keys, insert=insert)
        if self.max_norm is not None and len(keys):
            vectors = self._renorm(keys, vectors, insert)
        if pad is not None:
            vectors = np.insert(vectors, pad, self._pad_vector(store), axis=0)
        return vectors, keys, pad

    def _pad_vector(self, store: StoreProtocol) -> np.ndarray:
        """What the store holds for the padding key, zeros where it holds nothing."""
        if bool(store.contains([self.padding_key])[0]):
            return store.lookup([self.padding_key], insert=False)[0]
        return np.zeros(self.embedding_dim, dtype=np.float32)

    def _renorm(self, keys: Any, vectors: np.ndarray, write: bool) -> np.ndarray:
        """``max_norm`` as ``nn.Embedding``: rows whose ``norm_type`` norm exceeds it are
        scaled to it (``max_norm / (norm + 1e-7)``) and written back where this forward may
        write; elsewhere only the output is renormalized."""
        # in float64 as torch's kernel: the 1e-7 keeps a scaled row's norm at or below it
        norms = np.linalg.norm(vectors.astype(np.float64), ord=self.norm_type, axis=1)
        over = norms > self.max_norm
        if not over.any():
            return vectors
        vectors = vectors.copy()
        scale = self.max_norm / (norms[over] + 1e-7)
        vectors[over] = (vectors[over] * scale[:, None]).astype(np.float32)
        if write and not self.store.read_only:
            picked = (keys[over] if isinstance(keys, np.ndarray)
                      else [k for k, o in zip(keys, over.tolist(), strict=True) if o])
            self.store.assign(picked, vectors[over])
        return vectors

    def _sink(self, batch: KeyBatch, keys: Any, pad: int | None) -> Sink:
        counts = None
        if self._counts:
            counts = (batch.group()[2] if self.count
                      else np.zeros(len(batch.uniq), dtype=np.int64))
            if pad is not None:
                counts = np.delete(counts, pad)
        freq = batch.group()[2] if self.scale_grad_by_freq else None
        return Sink(self.store, keys, counts, pad, freq)

    def _drop_padding(self, batch: KeyBatch, offs: torch.Tensor, size: int,
                      psw: torch.Tensor | None) -> tuple:
        """Bags without their padding elements, as ``nn.EmbeddingBag(padding_idx=)`` pools:
        a padding element counts in no sum, mean or max."""
        pad = self._pad_row(batch.uniq)
        if pad is None:
            return batch, offs, size, psw
        inv = batch.inv.reshape(-1).numpy()
        keep = inv != pad
        offs = torch.from_numpy(kept_starts(offs.numpy(), len(inv), keep))
        rows = inv[keep]
        if isinstance(batch.uniq, np.ndarray) and batch.uniq.dtype != object:
            batch = int_batch(batch.uniq[rows], (len(rows),))
        else:
            uniq, new_inv = factorize([batch.uniq[i] for i in rows])
            batch = KeyBatch(uniq, torch.from_numpy(new_inv), (len(rows),))
        if psw is not None:
            psw = psw[torch.from_numpy(keep)]
        return batch, offs, 0, psw

    # -- checkpoints: the rows travel in the state_dict (see _checkpoint.py) -------------------
    def get_extra_state(self) -> dict[str, Any]:
        """The store's rows, optimizer slots, counts and step (the ``_extra_state`` entry)."""
        if store_is_collective(self.store):  # this rank's own shard, no collective
            return shard_state(self.store, rows=self.checkpoint_rows)
        return store_state(self.store, rows=self.checkpoint_rows)

    def set_extra_state(self, state: Any) -> None:
        """Restore the snapshot of :meth:`get_extra_state` into this module's store, exactly."""
        if store_is_collective(self.store):
            restore_shard(self.store, state, type(self).__name__)
        else:
            restore_store(self.store, state, type(self).__name__)

    def extra_repr(self) -> str:
        pad = "" if self.padding_key is None else f", padding_key={self.padding_key!r}"
        return (f"{self.store.url!r}, embedding_dim={self.embedding_dim}, "
                f"trainable={self.trainable}{pad}")


class DynamicEmbedding(StoreModule):
    """An embedding layer over an :class:`embstore.EmbeddingStore`: no vocabulary, no size.

    Parameters
    ----------
    store : embstore.EmbeddingStore
        Holds the vectors and their optimizer (``store.update`` applies the gradients).
    trainable : bool, optional
        Default: True unless the store is read-only. A non-trainable module returns tensors
        that do not require grad, so ``backward`` never writes; asking for a trainable module
        over a read-only store raises ``ReadOnlyError``.
    count : bool
        Whether updates add each key's occurrences in the batch to its ``count`` (the
        frequency that admission policies, unigram sampling and subsampling read). Use False
        when the frequencies are recorded separately (see ``examples/word2vec.py``).
    padding_key : int, str or bytes, optional
        As ``nn.Embedding(padding_idx=)`` (``padding_idx`` is an alias): the key reads what the
        store holds for it (zeros unless assigned), never receives a gradient and is never
        inserted by a lookup.
    max_norm, norm_type : float, optional
        As ``nn.Embedding``: looked-up rows whose ``norm_type``-norm exceeds ``max_norm`` are
        scaled down to it, and written back to the store by a training forward.
    scale_grad_by_freq : bool
        Divide each key's gradient by its number of occurrences in the batch (as torch).

    Notes
    -----
    - Input: an integer tensor / numpy array of any shape (int64 store) or a str/bytes,
      a list of them, or a rectangular nested list (bytes store). Output: float32
      ``(*input.shape, dim)``, requiring grad when trainable and grad mode is on.
    - Output dtype and device follow the module (``.double()``, ``.half()``,
      ``.to(torch.bfloat16)``, ``.to("cuda")``); gradients reach the store as float32.
    - Unknown keys are inserted on lookup only by a forward a backward can follow: ``train()``
      mode, grad enabled, trainable. In ``eval()``, under ``torch.no_grad()`` /
      ``torch.inference_mode()`` they read as their initial vector and nothing is written.
    - ``copy.deepcopy`` gives a module over the same store object (rows shared).
    - The update happens *inside* ``loss.backward()``: gradient rows are summed per key and
      applied once per backward pass (no gradient accumulation across backward calls; a
      ``retain_graph`` second backward applies a second step). ``optimizer.zero_grad`` /
      ``step`` of the dense parameters are unaffected.
    - ``state_dict()`` carries the store's rows, optimizer slots, counts and step (the
      ``_extra_state`` entry, a ``bytes`` snapshot); ``load_state_dict`` makes the store hold
      exactly that again. Works with ``torch.save`` / ``torch.load(weights_only=True)`` and
      ``torch.distributed.checkpoint``.
    - Pickling (DataLoader workers, ``torch.save(model)``) carries the store's URL, not its
      rows; the copy reopens the store read-only unless unpickled inside
      ``embstore.writable_unpickling()``. A ``memory://`` store refuses to pickle.
    - ``torch.compile``: with an integer tensor input the store call is a custom op
      (``embstore::lookup``, backward ``embstore::update``), so the model compiles into one
      graph (``fullgraph=True`` works); string inputs run as a graph break.
      ``torch.jit.trace`` raises :class:`TracingUnsupportedError`.
    - Over a store that pools in place (``store.fused_bags()``), a training forward of an
      integer tensor is the fused bag path with one id per bag (``_fused.py``: one compiled
      gather and, in the backward, one compiled gradient sum and optimizer step), eagerly and
      under ``torch.compile`` (``embstore::fused_bag``); the same bits as the general path.
    """

    #: Take the fused path where the store offers it; False: always the general one.
    use_fused_path: bool = True
    #: Run the fused path through the ``embstore::fused_bag`` custom op eagerly too.
    fused_custom_op: bool = False

    def __init__(self, store: StoreProtocol, *, trainable: bool | None = None, count: bool = True,
                 padding_key: Any = None, padding_idx: Any = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False) -> None:
        super().__init__(store, trainable, count, padding_key_of(store, padding_key, padding_idx),
                         max_norm, norm_type, scale_grad_by_freq)

    def forward(self, input: Any) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if self._fused_usable(input):
                return self._fused_rows(input, True)
            if _compiled.traceable(self, input) and self.max_norm is None:
                return self._output(self._compiled_rows(input))
            # inputs the custom op cannot take (strings): a graph break
            return _compiled.graph_break(self._forward)(input)
        return self._forward(input)

    def _fused_usable(self, input: Any) -> bool:
        """Whether this training call runs as the fused path: an integer CPU tensor, no
        option that changes rows or gradients, a store that pools in place."""
        return (self.use_fused_path and self._writes() and self.padding_key is None
                and self.max_norm is None and not self.scale_grad_by_freq and self._counts
                and isinstance(input, torch.Tensor) and input.numel() > 0
                and integer_ids(input) and _fused.store_pools(self._store_here()))

    def _fused_rows(self, input: torch.Tensor, custom_op: bool) -> torch.Tensor:
        """The rows of ``input`` as bags of one id each (``_fused.bag``)."""
        flat = input.reshape(-1)
        ones = torch.arange(flat.numel(), dtype=torch.long)
        rows = (_fused.bag(flat, ones, None, self._trigger, self._handle, "sum",
                           self.embedding_dim, custom_op) if custom_op
                else _fused.eager_bag(self._trigger, self._eager_how("sum"), flat, ones, None))
        return self._output(rows.reshape(*input.shape, self.embedding_dim))

    def _forward(self, input: Any) -> torch.Tensor:
        if self._fused_usable(input):
            return self._fused_rows(input, self.fused_custom_op)
        batch = prepare(input)
        if len(batch.uniq) == 0 and not store_is_collective(self.store):
            return self._empty_output((*batch.shape, self.embedding_dim))
        vectors, sink = self._lookup(batch)
        if sink is None:
            out = F.embedding(batch.inv, torch.from_numpy(vectors))
        else:
            out = StoreGather.apply(torch.empty(0, requires_grad=True), vectors, batch, sink)
        return self._output(out)
