"""Sampled softmax over a store: output vectors of the candidates come from ``store.sample``.

The candidates of a batch are the batch's distinct positive keys merged with ``num_sampled``
negatives drawn by the store's sampler (DynamicEmbedding's ``Sample``). Every example scores
every candidate; the logits are corrected by ``log Q`` (the candidate's sampling probability)
so the sampled loss estimates the full softmax, and sampled negatives equal to a label are
dropped (accidental hits), so a label only ever scores in its own column.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embstore import StoreProtocol
from embstore.errors import InvalidInputError

from ._keys import prepare
from .modules import store_rows

__all__ = ["SampledSoftmaxLoss", "sampled_logits"]


def sampled_logits(hidden: torch.Tensor, labels: Any, store: StoreProtocol, num_sampled: int,
                   sampler: Any = None, *, remove_accidental_hits: bool = True,
                   subtract_log_q: bool = True, trainable: bool = True,
                   seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of each example against the merged positive + sampled candidates.

    Parameters
    ----------
    hidden : (batch, dim) float tensor
        The model's output vector per example.
    labels : (batch,) int64 tensor or list of str
        The true key of each example.
    store : embstore.EmbeddingStore
        Holds the output (softmax) vectors; it samples the negatives and applies their update.
    num_sampled : int
        Negatives to draw per batch (shared by all examples).
    sampler : embstore.sampling sampler, optional
        Passed to ``store.sample`` (its default when None).
    remove_accidental_hits : bool
        Drop sampled negatives equal to one of the batch's labels (so a label only ever
        scores in its own column).
    subtract_log_q : bool
        Subtract ``log(prob)`` of each candidate (the logQ correction; ``prob`` is the
        expected count from ``store.sample``). Keys with probability 0 are not corrected.
    trainable : bool
        Wire the candidate vectors to ``store.update`` on backward.

    Returns
    -------
    logits : (batch, n_candidates) tensor
    targets : (batch,) long tensor, the column of each example's label
    """
    if hidden.dim() != 2 or hidden.shape[1] != store.dim:
        raise InvalidInputError(f"hidden must be (batch, {store.dim}), got {tuple(hidden.shape)}")
    batch = prepare(labels)
    uniq, inv, shape = batch.uniq, batch.inv, batch.shape
    if shape != (hidden.shape[0],):
        raise InvalidInputError(f"labels must be ({hidden.shape[0]},), got {shape}")
    kwargs: dict[str, Any] = {"remove_accidental_hits": remove_accidental_hits}
    if sampler is not None:
        kwargs["sampler"] = sampler
    if seed is not None:
        kwargs["seed"] = seed
    res = store.sample(uniq, int(num_sampled), **kwargs)
    cand = res.keys
    n_pos = len(uniq)
    # store.sample returns the positives first, in the order given (distinct here).
    if int(np.count_nonzero(res.is_positive)) != n_pos or not res.is_positive[:n_pos].all():
        raise InvalidInputError("store.sample did not return the positives first")
    targets = inv.reshape(-1)
    counts = None
    if trainable:
        counts = np.zeros(len(cand), dtype=np.int64)
        counts[:n_pos] = batch.group()[2]
    w = store_rows(store, cand, insert=True, trainable=trainable, counts=counts)
    logits = hidden @ w.to(hidden.device, hidden.dtype).T
    if subtract_log_q:
        prob = np.asarray(res.prob, dtype=np.float64)
        # A key the sampler cannot draw (probability 0, e.g. a label never counted) is left
        # uncorrected rather than given an unbounded boost.
        log_q = torch.from_numpy(np.log(np.where(prob > 0, prob, 1.0)).astype(np.float32))
        logits = logits - log_q.to(logits.device, logits.dtype)
    return logits, targets.to(hidden.device)


class SampledSoftmaxLoss(nn.Module):
    """Sampled softmax cross-entropy with output vectors in a store.

    Parameters
    ----------
    store : embstore.EmbeddingStore
        The output-embedding store (one vector per label key); trained on backward.
    num_sampled : int
        Negatives drawn per batch with ``store.sample``.
    sampler : embstore.sampling sampler, optional
        E.g. ``LogUniformSampler()`` or ``UnigramSampler(power=0.75)``.
    remove_accidental_hits, subtract_log_q : bool
        See :func:`sampled_logits`.
    reduction : {"mean", "sum", "none"}

    Examples
    --------
    >>> loss_fn = SampledSoftmaxLoss(out_store, num_sampled=64)
    >>> loss = loss_fn(hidden, next_item_ids)       # hidden: (batch, dim)
    >>> loss.backward()                              # updates the sampled output vectors
    """

    def __init__(self, store: StoreProtocol, num_sampled: int, sampler: Any = None, *,
                 remove_accidental_hits: bool = True, subtract_log_q: bool = True,
                 reduction: str = "mean", trainable: bool | None = None) -> None:
        super().__init__()
        if int(num_sampled) < 0:
            raise InvalidInputError(f"num_sampled must be >= 0, got {num_sampled}")
        if reduction not in ("mean", "sum", "none"):
            raise InvalidInputError(f"reduction must be mean, sum or none, got {reduction!r}")
        self.store = store
        self.num_sampled = int(num_sampled)
        self.sampler = sampler
        self.remove_accidental_hits = remove_accidental_hits
        self.subtract_log_q = subtract_log_q
        self.reduction = reduction
        self.trainable = (not store.read_only) if trainable is None else bool(trainable)

    def forward(self, hidden: torch.Tensor, labels: Any) -> torch.Tensor:
        logits, targets = sampled_logits(
            hidden, labels, self.store, self.num_sampled, self.sampler,
            remove_accidental_hits=self.remove_accidental_hits,
            subtract_log_q=self.subtract_log_q, trainable=self.trainable,
        )
        return F.cross_entropy(logits, targets, reduction=self.reduction)

    def extra_repr(self) -> str:
        return f"{self.store.url!r}, num_sampled={self.num_sampled}, sampler={self.sampler!r}"
