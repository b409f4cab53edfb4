"""``DynamicEmbeddingBag``: ``nn.EmbeddingBag`` over a store (the bridges are in ``modules``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from embstore import StoreProtocol
from embstore.errors import InvalidInputError

from . import _compiled, _fused
from ._bridges import StoreBag, StoreRows
from ._keys import kept_starts, prepare_bags
from .modules import StoreModule, padding_key_of, store_is_collective

__all__ = ["DynamicEmbeddingBag"]


class DynamicEmbeddingBag(StoreModule):
    """Pooled embeddings of multi-valued features, like ``nn.EmbeddingBag`` over a store.

    Parameters
    ----------
    store : embstore.EmbeddingStore
    mode : {"mean", "sum", "max"}
        How the vectors of one bag are pooled (an empty bag gives zeros). The default is
        ``"mean"``, as ``nn.EmbeddingBag``'s. Each trains on the fused path where the store
        offers it (``_fused.py``); max as torch's CPU ``embedding_bag`` takes it (ties and
        NaN: the earlier element), its gradient to the id that gave each value.
    trainable, count : bool, optional
        As in :class:`~embstore_torch.DynamicEmbedding`.
    padding_key : int, str or bytes, optional
        Elements equal to it are left out of their bag (as ``nn.EmbeddingBag(padding_idx=)``:
        they count in no sum, mean or max), get no gradient and are never stored.
    max_norm, norm_type, scale_grad_by_freq :
        As ``nn.EmbeddingBag`` (see :class:`~embstore_torch.DynamicEmbedding`);
        ``scale_grad_by_freq`` is refused with ``mode="max"``, as torch refuses it.
    include_last_offset : bool
        As ``nn.EmbeddingBag``: ``offsets`` has one more entry, ``len(input)``, closing the
        last bag.

    Notes
    -----
    ``forward(input, offsets=None, per_sample_weights=None)`` takes a 2-D input (one bag per
    row), a 1-D input with ``offsets`` (start of each bag, as ``nn.EmbeddingBag``), or a list
    of lists of keys (ragged bags); it returns ``(n_bags, dim)`` in the module's dtype.
    Input checks follow torch's: ``offsets`` must be 1-D, ``per_sample_weights`` must have the
    input's shape, need ``mode="sum"`` and the module's dtype.
    """

    #: Take the fused path (``_fused.py``) where the store offers it; False: always the
    #: unfused one (the two give the same bits: tests compare them).
    use_fused_path: bool = True
    #: Run the fused path through the ``embstore::fused_bag`` custom op instead of its eager
    #: ``autograd.Function`` (same store calls, same bits; the op costs more to dispatch).
    fused_custom_op: bool = False

    def __init__(self, store: StoreProtocol, mode: str = "mean", *, trainable: bool | None = None,
                 count: bool = True, padding_key: Any = None, padding_idx: Any = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, include_last_offset: bool = False) -> None:
        if mode not in ("sum", "mean", "max"):
            raise InvalidInputError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        if scale_grad_by_freq and mode == "max":
            raise InvalidInputError("mode='max' does not support scale_grad_by_freq (as torch)")
        super().__init__(store, trainable, count, padding_key_of(store, padding_key, padding_idx),
                         max_norm, norm_type, scale_grad_by_freq)
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("include_last_offset", False)

    def forward(self, input: Any, offsets: Any = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if self._fused_usable(input, offsets, per_sample_weights):  # one fused op
                self._check_weights(input, offsets, per_sample_weights)
                return self._fused_op(input, offsets, per_sample_weights, True)
            if (self.padding_key is None and self.max_norm is None
                    and not self.include_last_offset and _compiled.traceable(self, input)
                    and (input.dim(), offsets is None) in ((2, True), (1, False))
                    and (per_sample_weights is None or self.mode == "sum")):
                self._check_weights(input, offsets, per_sample_weights)
                rows = self._compiled_rows(input.reshape(-1))
                return self._output(_compiled.bag(rows, input, offsets, per_sample_weights,
                                                  self.mode))
            # inputs the custom op path does not take: a graph break
            return _compiled.graph_break(self._forward)(input, offsets, per_sample_weights)
        return self._forward(input, offsets, per_sample_weights)

    def _fused_usable(self, input: Any, offsets: Any, psw: torch.Tensor | None,
                      eager: bool = False) -> bool:
        """Whether this training call runs as the fused op (``_fused.py``): options that
        change the rows (max_norm, scale_grad_by_freq) take the unfused path; eagerly, bags
        with padding elements or a closing offset are first reshaped (:meth:`_fused_bags`),
        which a compiled graph leaves to the unfused op (their sizes depend on the data)."""
        return (self.use_fused_path and self._writes()
                and (eager or (self.padding_key is None and not self.include_last_offset))
                and self.max_norm is None and not self.scale_grad_by_freq and self._counts
                and _fused.usable_input(input, offsets, psw, self.mode)
                and _fused.store_pools(self._store_here()))

    def _fused_op(self, ids: torch.Tensor, offsets: Any, psw: torch.Tensor | None,
                  custom_op: bool) -> torch.Tensor:
        """The fused path's output for these bags: through the custom ops with ``custom_op``
        (``embstore::fused_bag``, or ``embstore::fused_bag_max`` for max), else
        ``FusedBag``."""
        if not custom_op:
            out = _fused.eager_bag(self._buffers["_trigger"], self._eager_how(self.mode), ids,
                                   offsets, psw)
        elif self.mode == "max":
            out = _fused.max_bag(ids, offsets, self._trigger, self._handle,
                                self.embedding_dim)
        else:
            out = _fused.bag(ids, offsets, psw, self._trigger, self._handle, self.mode,
                             self.embedding_dim, custom_op)
        return self._output(out)

    def _fused_bags(self, input: torch.Tensor, offsets: Any, psw: torch.Tensor | None
                    ) -> tuple[torch.Tensor, Any, torch.Tensor | None, int]:
        """``(ids, offsets, weights, n_bags)`` for the fused op: ``include_last_offset``'s
        closing offset taken off, padding elements dropped from their bags (the bits of the
        unfused path, which drops them before its lookup)."""
        offsets = self._open_offsets(input, offsets)
        n_bags = input.shape[0] if input.dim() == 2 else offsets.shape[0]
        if self.padding_key is None:
            return input, offsets, psw, n_bags
        ids = _fused.int64_ids(input)
        assert ids is not None  # an integer tensor (usable_input)
        keep = ids != self.padding_key
        starts = (np.arange(n_bags, dtype=np.int64) * input.shape[1] if input.dim() == 2
                  else offsets.to("cpu", torch.long).numpy())
        starts = kept_starts(starts, len(ids), keep)
        weights = None if psw is None else psw.reshape(-1)[torch.from_numpy(keep).to(psw.device)]
        return torch.from_numpy(ids[keep]), torch.from_numpy(starts), weights, n_bags

    def _open_offsets(self, input: Any, offsets: Any) -> Any:
        """``offsets`` without ``include_last_offset``'s closing entry (checked first)."""
        if not self.include_last_offset:
            return offsets
        if offsets is None:
            raise InvalidInputError("include_last_offset=True needs offsets")
        offsets = torch.as_tensor(offsets)
        if offsets.numel() < 1 or int(offsets[-1]) != len(input):
            raise InvalidInputError("with include_last_offset=True the last offset must "
                                    f"be len(input) = {len(input)}")
        return offsets[:-1]

    def _check_weights(self, input: Any, offsets: Any, psw: torch.Tensor | None) -> None:
        """torch's checks on ``offsets`` and ``per_sample_weights``, before any lookup."""
        if isinstance(offsets, torch.Tensor) and offsets.dim() != 1:
            raise InvalidInputError(f"offsets must be a 1-D tensor, got shape "
                                    f"{tuple(offsets.shape)}")
        if psw is None:
            return
        if self.mode != "sum":
            raise InvalidInputError(f"per_sample_weights only work with mode='sum' (got "
                                    f"mode={self.mode!r})")
        if not isinstance(psw, torch.Tensor) or not psw.dtype.is_floating_point:
            raise InvalidInputError("per_sample_weights must be a floating-point tensor")
        if psw.dtype != self._dtype:
            raise InvalidInputError(f"per_sample_weights are {psw.dtype}, the module is "
                                    f"{self._dtype}: give them in the module's dtype")
        if isinstance(input, torch.Tensor) and tuple(psw.shape) != tuple(input.shape):
            raise InvalidInputError(f"per_sample_weights of shape {tuple(psw.shape)} must have "
                                    f"the input's shape {tuple(input.shape)}")

    def _forward(self, input: Any, offsets: Any = None,
                 per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        self._check_weights(input, offsets, per_sample_weights)
        if self._fused_usable(input, offsets, per_sample_weights, eager=True):
            ids, offs_in, psw_in = input, offsets, per_sample_weights
            if self.padding_key is not None or self.include_last_offset:
                ids, offs_in, psw_in, n_bags = self._fused_bags(input, offsets, psw_in)
                if ids.numel() == 0:  # every element padding: nothing to read or train
                    return self._empty_output((n_bags, self.embedding_dim))
            return self._fused_op(ids, offs_in, psw_in, self.fused_custom_op)
        offsets = self._open_offsets(input, offsets)
        batch, offs, size = prepare_bags(input, offsets)
        psw = per_sample_weights
        if psw is not None:
            psw = psw.reshape(-1).to("cpu", torch.float32)
            if len(psw) != batch.inv.numel():
                raise InvalidInputError("per_sample_weights must have one weight per key")
        batch, offs, size, psw = self._drop_padding(batch, offs, size, psw)
        inv = batch.inv
        if len(batch.uniq) == 0 and not store_is_collective(self.store):
            return self._empty_output((len(offs), self.embedding_dim))
        vectors, sink = self._lookup(batch)
        if sink is None:
            out = F.embedding_bag(inv, torch.from_numpy(vectors), offs, mode=self.mode,
                                  per_sample_weights=psw)
        elif self.mode == "max":
            rows = StoreRows.apply(torch.empty(0, requires_grad=True), vectors, sink)
            out = F.embedding_bag(inv, rows, offs, mode="max")
        else:
            out = StoreBag.apply(torch.empty(0, requires_grad=True), psw, vectors, batch, offs,
                                  size, self.mode, sink)
        return self._output(out)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"
