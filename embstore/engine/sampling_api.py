"""The sampling and retrieval part of the engine's public API.

``EmbeddingStore`` inherits these methods, kept here so the engine module stays about storage
and learning; each one delegates to :mod:`embstore.sampling` or :mod:`embstore.retrieval`, which
keep their indexes current through the engine's observer hooks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..retrieval import top_k as _top_k
from ..sampling import sample as _sample
from ..sampling import subsample_mask as _subsample_mask


class SamplingAPI:
    """``sample``, ``subsample_mask`` and ``top_k`` of :class:`embstore.EmbeddingStore`."""

    def sample(self, positive_keys: Any, num_sampled: int, sampler: Any = None, *,
               offsets: Any = None, remove_accidental_hits: bool = True, unique: bool = True,
               seed: Any = None) -> Any:
        """Candidate sampling: positives and ``num_sampled`` sampled negatives, merged.

        Parameters
        ----------
        positive_keys : array-like, list of array-like, 2-D array, or flat keys with ``offsets``
            One example's positives, or a batch (multi-label): then a list of results.
        num_sampled : int
            Negatives drawn (shared by the examples of a batch, as in TF's sampled softmax).
        sampler : Sampler or str
            ``UniformSampler``, ``LogUniformSampler`` (default), ``UnigramSampler(0.75)``,
            ``FixedCandidatesSampler`` (from :mod:`embstore.sampling`) or their names.
        offsets : array-like of int, optional
            Row splits of a flat ``positive_keys`` (length batch + 1).
        remove_accidental_hits : bool
            Drop sampled negatives equal to one of the example's positives.
        unique : bool
            Draw until ``num_sampled`` distinct keys; ``prob`` is then an inclusion probability.
        seed : int or numpy Generator, optional

        Returns
        -------
        SampledResult or list of SampledResult
            ``keys``, ``is_positive``, ``prob`` (expected count, for the logQ correction).
        """
        return _sample(self, positive_keys, num_sampled, sampler, offsets=offsets,
                       remove_accidental_hits=remove_accidental_hits, unique=unique, seed=seed)

    def subsample_mask(self, keys: Any, t: float = 1e-3, seed: Any = None) -> np.ndarray:
        """word2vec's frequency subsampling: a bool mask keeping each occurrence of ``keys``
        with probability ``(sqrt(f / t) + 1) * t / f`` (``f``: the key's share of counts)."""
        return _subsample_mask(self, keys, t, seed)

    def top_k(self, queries: Any, k: int, exclude: Any = None, *,
              batch_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` keys by dot product for each query row.

        Parameters
        ----------
        queries : array-like, shape (n, dim) or (dim,)
        k : int
        exclude : array-like of keys, or a list of n arrays (one per query), optional
            Keys never returned (for all queries, or per query).
        batch_size : int, optional
            Items per block (default: about 8M scores per block).

        Returns
        -------
        keys : np.ndarray, shape (n, min(k, rows))
        scores : np.ndarray of float32, same shape
            Sorted by score descending, ties by key ascending; a NaN score (inf - inf) ranks
            last. Rows that run out of keys after per-query exclusion are padded with key
            ``embstore.retrieval.PAD_KEY`` (``b""`` for bytes keys) and score ``-inf``.
            The result is a :class:`embstore.retrieval.TopKResult`: it unpacks as
            ``(keys, scores)``, and its ``valid`` mask is False at padded places.
        """
        return _top_k(self, queries, k, exclude, batch_size=batch_size)
