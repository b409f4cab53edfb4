"""``DynamicEmbedding`` / ``DynamicEmbeddingBag``: store-backed embedding layers for PyTorch.

The store holds the vectors and applies their updates itself (its own optimizer), so these
modules own no ``nn.Parameter``. The bridge is a ``torch.autograd.Function`` over the rows of a
batch's distinct keys. Its first input is a fresh zero-size tensor that requires grad (the
*trigger*): that makes the output part of the autograd graph even though no torch parameter is
involved, so ``loss.backward()`` reaches the function's ``backward``, which sums the gradient per
distinct key and sends it to ``store.update``. :class:`_StoreRows` is the generic form (rows
out, row gradients in); :class:`_StoreGather` and :class:`_StoreBag` fuse the gather / bag
pooling with it, so the per-key sum is one ``embedding_bag`` over the gradient. The user's
torch optimizer keeps driving the dense parameters as usual.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embstore import StoreProtocol
from embstore.errors import EmbstoreError, InvalidInputError, ReadOnlyError
from embstore.keys import normalize_keys

from . import _compiled
from ._checkpoint import restore_store, store_state
from ._keys import KeyBatch, _int_batch, factorize, per_key_sum, prepare, prepare_bags

__all__ = ["DynamicEmbedding", "DynamicEmbeddingBag", "TracingUnsupportedError", "store_rows"]


class TracingUnsupportedError(EmbstoreError, RuntimeError):
    """``torch.jit.trace`` of a store-backed module: the trace would freeze the looked-up rows."""


_TRACE_MESSAGE = (
    "torch.jit.trace cannot record a store lookup: the keys and rows would be baked into the "
    "trace as constants and no update would ever reach the store. Use torch.compile(model) "
    "(the store call is a custom op there), or trace/export only the dense part and feed it "
    "the embedding output."
)


class _Sink:
    """Where the gradient of one batch of rows goes: ``store.update`` of its distinct keys."""

    __slots__ = ("store", "keys", "counts", "applied", "skip")

    def __init__(self, store: StoreProtocol, keys: Any, counts: np.ndarray | None,
                 skip: int | None = None) -> None:
        self.store, self.keys, self.counts, self.applied = store, keys, counts, 0
        self.skip = skip  # row of the padding key: read as zeros, its gradient is dropped

    def apply(self, grad: torch.Tensor) -> None:
        g = grad.detach().to("cpu", torch.float32).contiguous().numpy()
        if self.skip is not None:
            g = np.delete(g, self.skip, axis=0)
        if self.store.read_only:  # a module unpickled over its writer's store (see __reduce__)
            raise ReadOnlyError(
                f"{self.store.url} is open read-only, so this backward cannot update it. A "
                "module unpickled from a writable one (torch.load, a DataLoader worker) reopens "
                "its store read-only on purpose, so a copy never writes behind the writer's "
                "back: unpickle inside `with embstore.writable_unpickling():` to keep training "
                "that store, or load_state_dict into a module over a writable one."
            )
        if self.counts is not None:
            self.store.update(self.keys, g, counts=self.counts)
        else:
            self.store.update(self.keys, g)
        self.applied += 1


class _StoreRows(torch.autograd.Function):
    """Rows of distinct keys; backward hands their gradient to the store."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, vectors: np.ndarray, sink: _Sink):
        ctx.sink = sink
        return torch.from_numpy(vectors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ctx.sink.apply(grad)
        return None, None, None


class _StoreGather(torch.autograd.Function):
    """``rows[inv]`` fused with the store update: the backward sums the gradient per key
    with one :func:`~embstore_torch._keys.per_key_sum` (several times faster than the generic
    embedding backward)."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, vectors: np.ndarray, batch: KeyBatch,
                sink: _Sink):
        ctx.sink, ctx.batch = sink, batch
        return F.embedding(batch.inv, torch.from_numpy(vectors))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        g = grad.to("cpu", torch.float32).reshape(-1, grad.shape[-1])
        order, starts, _ = ctx.batch.group()
        ctx.sink.apply(per_key_sum(g, order, starts))
        return None, None, None, None


class _StoreBag(torch.autograd.Function):
    """Sum/mean bag pooling fused with the store update (see :class:`_StoreGather`)."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, psw: torch.Tensor | None, vectors: np.ndarray,
                batch: KeyBatch, offs: torch.Tensor, size: int, mode: str, sink: _Sink):
        rows = torch.from_numpy(vectors)
        ctx.sink, ctx.batch, ctx.offs, ctx.size, ctx.mode = sink, batch, offs, size, mode
        ctx.rows, ctx.psw = rows, psw
        return F.embedding_bag(batch.inv, rows, offs, mode=mode, per_sample_weights=psw)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        grad = grad.to("cpu", torch.float32)
        inv, offs, size = ctx.batch.inv, ctx.offs, ctx.size
        order, starts, _ = ctx.batch.group()
        n = len(inv)
        # The bag of each element, in grouped order: each key sums the gradient rows of the
        # bags it occurs in, so no per-element gradient row is ever materialized.
        if size:  # fixed-size bags (a 2-D input)
            bag_of = None
            bag_sorted = order // size
        else:
            lengths = np.diff(offs.numpy(), append=n)
            bag_of = np.repeat(np.arange(len(offs)), lengths)
            bag_sorted = bag_of[order]
        weights = psw_grad = None
        if ctx.psw is not None:
            w = ctx.psw.detach().to("cpu", torch.float32)
            weights = w[torch.from_numpy(order)]
            if ctx.needs_input_grad[1]:
                bags = (torch.from_numpy(bag_of) if bag_of is not None
                        else torch.arange(n) // size)
                psw_grad = (ctx.rows.index_select(0, inv) * grad.index_select(0, bags)).sum(1)
        elif ctx.mode == "mean":
            if size:
                grad = grad / float(size)
            else:
                grad = grad / torch.from_numpy(np.maximum(lengths, 1)).to(grad.dtype)[:, None]
        ctx.sink.apply(per_key_sum(grad, bag_sorted, starts, weights))
        return None, psw_grad, None, None, None, None, None, None


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
        Write unknown keys on lookup (training) or not (serving).
    trainable : bool
        With False (or under ``torch.no_grad``) the rows are a plain tensor and nothing is
        ever written back.
    counts : array of int64, optional
        Occurrences of each key in the batch, forwarded to ``store.update`` where the store
        accepts them, so per-key frequency counts stay exact after deduplication.
    """
    vectors = store.lookup(keys, insert=insert)
    if not (trainable and torch.is_grad_enabled()):
        return torch.from_numpy(vectors)
    trigger = torch.empty(0, requires_grad=True)
    return _StoreRows.apply(trigger, vectors, _Sink(store, keys, counts))


def _collective(store: StoreProtocol) -> bool:
    """Whether every rank must call ``store`` in step (``embstore_torch.distributed.store``): an
    empty batch then still looks up, and its backward still updates, with no keys."""
    return bool(store.collective)


def _padding_key(store: StoreProtocol, padding_key: Any, padding_idx: Any) -> Any:
    """The padding key in the store's key form (int, or bytes), or None."""
    if padding_idx is not None:
        if padding_key is not None:
            raise InvalidInputError("pass padding_key or its alias padding_idx, not both")
        padding_key = padding_idx
    if padding_key is None:
        return None
    return normalize_keys([padding_key], store.key_type)[0]


class _StoreModule(nn.Module):
    #: Whether ``state_dict()`` carries the store's rows (True) or only a reference to the
    #: store (url, dim, key type, step) for tables too large to snapshot per checkpoint.
    checkpoint_rows: bool = True

    def __init__(self, store: StoreProtocol, trainable: bool | None, count: bool = True,
                 padding_key: Any = None) -> None:
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
        # Moves with module.to(device): outputs are placed where the rest of the model lives.
        self.register_buffer("_anchor", torch.empty(0), persistent=False)
        # Under torch.compile the store call is a custom op (see _compiled.py): the handle names
        # this module in it, the trigger is the grad-requiring graph input its backward uses.
        self.register_buffer("_trigger", torch.zeros(0, requires_grad=True), persistent=False)
        self._handle = _compiled.register(self)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_compiled_batch", None)  # a forward's grouping kept for its backward
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._handle = _compiled.register(self)  # copies (pickle, deepcopy) are other modules
        # modules pickled before padding keys and compiled ops existed
        self.__dict__.setdefault("padding_key", None)
        if "_trigger" not in self._buffers:
            self.register_buffer("_trigger", torch.zeros(0, requires_grad=True),
                                 persistent=False)

    def _pad_row(self, uniq: Any) -> int | None:
        """Row of the padding key among a batch's distinct keys, or None."""
        pad = self.padding_key
        if pad is None or len(uniq) == 0:
            return None
        if isinstance(uniq, np.ndarray) and uniq.dtype != object:  # sorted int64
            i = int(np.searchsorted(uniq, pad))
            return i if i < len(uniq) and uniq[i] == pad else None
        for i, k in enumerate(uniq):  # str keys are UTF-8 encoded by the store
            if (k.encode("utf-8") if isinstance(k, str) else bytes(k)) == pad:
                return i
        return None

    def _lookup(self, batch: KeyBatch) -> tuple[np.ndarray, _Sink | None]:
        """Vectors of the distinct keys, and the sink of their gradient (None: frozen).

        The padding key is never looked up (no row is created for it): it reads as zeros and
        its gradient row is dropped before ``store.update``.
        """
        if torch.jit.is_tracing():
            raise TracingUnsupportedError(_TRACE_MESSAGE)
        vectors, keys, pad = self._vectors(batch, self.training)
        if not (self.trainable and torch.is_grad_enabled()):
            return vectors, None
        return vectors, self._sink(batch, keys, pad)

    def _vectors(self, batch: KeyBatch, insert: bool) -> tuple[np.ndarray, Any, int | None]:
        """``(vectors of batch.uniq, the keys looked up, padding row or None)``."""
        pad = self._pad_row(batch.uniq)
        keys = batch.uniq
        if pad is not None:
            keys = (np.delete(keys, pad) if isinstance(keys, np.ndarray)
                    else keys[:pad] + keys[pad + 1:])
        vectors = self.store.lookup(keys, insert=insert)
        if pad is not None:
            vectors = np.insert(vectors, pad, 0.0, axis=0)
        return vectors, keys, pad

    def _sink(self, batch: KeyBatch, keys: Any, pad: int | None) -> _Sink:
        counts = (batch.group()[2] if self.count
                  else np.zeros(len(batch.uniq), dtype=np.int64))
        if pad is not None:
            counts = np.delete(counts, pad)
        return _Sink(self.store, keys, counts, pad)

    def _drop_padding(self, batch: KeyBatch, offs: torch.Tensor, size: int,
                      psw: torch.Tensor | None) -> tuple:
        """Bags without their padding elements, as ``nn.EmbeddingBag(padding_idx=)`` pools:
        a padding element counts in no sum, mean or max."""
        pad = self._pad_row(batch.uniq)
        if pad is None:
            return batch, offs, size, psw
        inv = batch.inv.reshape(-1).numpy()
        keep = inv != pad
        n = len(inv)
        lengths = np.diff(offs.numpy(), append=n)
        kept = np.bincount(np.repeat(np.arange(len(offs)), lengths)[keep],
                           minlength=len(offs))
        offs = torch.from_numpy(np.concatenate(([0], np.cumsum(kept)[:-1])).astype(np.int64))
        rows = inv[keep]
        if isinstance(batch.uniq, np.ndarray) and batch.uniq.dtype != object:
            batch = _int_batch(batch.uniq[rows], (len(rows),))
        else:
            uniq, new_inv = factorize([batch.uniq[i] for i in rows])
            batch = KeyBatch(uniq, torch.from_numpy(new_inv), (len(rows),))
        if psw is not None:
            psw = psw[torch.from_numpy(keep)]
        return batch, offs, 0, psw

    # -- checkpoints: the rows travel in the state_dict (see _checkpoint.py) -------------------
    def get_extra_state(self) -> dict[str, Any]:
        """The store's rows, optimizer slots, counts and step (the ``_extra_state`` entry)."""
        return store_state(self.store, rows=self.checkpoint_rows)

    def set_extra_state(self, state: Any) -> None:
        """Restore the snapshot of :meth:`get_extra_state` into this module's store, exactly."""
        restore_store(self.store, state, type(self).__name__)

    def extra_repr(self) -> str:
        pad = "" if self.padding_key is None else f", padding_key={self.padding_key!r}"
        return (f"{self.store.url!r}, embedding_dim={self.embedding_dim}, "
                f"trainable={self.trainable}{pad}")


class DynamicEmbedding(_StoreModule):
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
        A key that reads as a zero vector, receives no gradient and is never stored (like
        ``nn.Embedding(padding_idx=)``); ``padding_idx`` is an alias.

    Notes
    -----
    - Input: an integer tensor / numpy array of any shape (int64 store) or a str/bytes,
      a list of them, or a rectangular nested list (bytes store). Output: float32
      ``(*input.shape, dim)``, requiring grad when trainable and grad mode is on.
    - In ``train()`` mode unknown keys are inserted on lookup; in ``eval()`` mode they read as
      their initial vector and nothing is written.
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
    """

    def __init__(self, store: StoreProtocol, *, trainable: bool | None = None, count: bool = True,
                 padding_key: Any = None, padding_idx: Any = None) -> None:
        super().__init__(store, trainable, count, _padding_key(store, padding_key, padding_idx))

    def forward(self, input: Any) -> torch.Tensor:
        if torch.compiler.is_compiling() and _compiled.traceable(self, input):
            return _compiled.lookup(self, input).to(self._anchor.device)
        return self._forward(input)

    @torch.compiler.disable  # inputs the custom op cannot take (strings): a graph break
    def _forward(self, input: Any) -> torch.Tensor:
        batch = prepare(input)
        if len(batch.uniq) == 0 and not _collective(self.store):
            return torch.zeros(*batch.shape, self.embedding_dim, device=self._anchor.device,
                               requires_grad=False)
        vectors, sink = self._lookup(batch)
        if sink is None:
            out = F.embedding(batch.inv, torch.from_numpy(vectors))
        else:
            out = _StoreGather.apply(torch.empty(0, requires_grad=True), vectors, batch, sink)
        return out.to(self._anchor.device)


class DynamicEmbeddingBag(_StoreModule):
    """Pooled embeddings of multi-valued features, like ``nn.EmbeddingBag`` over a store.

    Parameters
    ----------
    store : embstore.EmbeddingStore
    mode : {"sum", "mean", "max"}
        How the vectors of one bag are pooled (an empty bag gives zeros).
    trainable, count : bool, optional
        As in :class:`DynamicEmbedding`.
    padding_key : int, str or bytes, optional
        Elements equal to it are left out of their bag (as ``nn.EmbeddingBag(padding_idx=)``:
        they count in no sum, mean or max), get no gradient and are never stored.

    Notes
    -----
    ``forward(input, offsets=None, per_sample_weights=None)`` takes a 2-D input (one bag per
    row), a 1-D input with ``offsets`` (start of each bag, as ``nn.EmbeddingBag``), or a list
    of lists of keys (ragged bags); it returns ``(n_bags, dim)``.
    """

    def __init__(self, store: StoreProtocol, mode: str = "sum", *, trainable: bool | None = None,
                 count: bool = True, padding_key: Any = None, padding_idx: Any = None) -> None:
        if mode not in ("sum", "mean", "max"):
            raise InvalidInputError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        super().__init__(store, trainable, count, _padding_key(store, padding_key, padding_idx))
        self.mode = mode

    def forward(self, input: Any, offsets: Any = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if (torch.compiler.is_compiling() and self.padding_key is None
                and _compiled.traceable(self, input)
                and (input.dim(), offsets is None) in ((2, True), (1, False))
                and (per_sample_weights is None or self.mode == "sum")):
            out = _compiled.bag(self, input, offsets, per_sample_weights)
            return out.to(self._anchor.device)
        return self._forward(input, offsets, per_sample_weights)

    @torch.compiler.disable  # inputs the custom op path does not take: a graph break
    def _forward(self, input: Any, offsets: Any = None,
                 per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        batch, offs, size = prepare_bags(input, offsets)
        if per_sample_weights is not None and self.mode != "sum":
            raise InvalidInputError("per_sample_weights only work with mode='sum'")
        dev = self._anchor.device
        psw = per_sample_weights
        if psw is not None:
            psw = psw.reshape(-1).to("cpu", torch.float32)
            if len(psw) != batch.inv.numel():
                raise InvalidInputError("per_sample_weights must have one weight per key")
        batch, offs, size, psw = self._drop_padding(batch, offs, size, psw)
        inv = batch.inv
        if len(batch.uniq) == 0 and not _collective(self.store):
            return torch.zeros(len(offs), self.embedding_dim, device=dev)
        vectors, sink = self._lookup(batch)
        if sink is None:
            out = F.embedding_bag(inv, torch.from_numpy(vectors), offs, mode=self.mode,
                                  per_sample_weights=psw)
        elif self.mode == "max":
            rows = _StoreRows.apply(torch.empty(0, requires_grad=True), vectors, sink)
            out = F.embedding_bag(inv, rows, offs, mode="max")
        else:
            out = _StoreBag.apply(torch.empty(0, requires_grad=True), psw, vectors, batch, offs,
                                  size, self.mode, sink)
        return out.to(dev)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"
