"""Candidate samplers and the ``SampledResult`` they produce.

A sampler is a small, immutable description of a distribution over the store's keys; the
per-store :class:`~embstore.sampling.index.SamplingIndex` turns it into arrays it can draw
from. Weights come from metadata the store keeps per key (``count``: training sightings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidInputError


@dataclass(frozen=True, eq=False)
class SampledResult:
    """Positives and sampled negatives of one example, merged (DynamicEmbedding contract).

    Attributes
    ----------
    keys : np.ndarray
        Positives first (in the order given), then the sampled negatives.
    is_positive : np.ndarray
        ``(n,)`` bool, True for the positives.
    prob : np.ndarray
        ``(n,)`` float64: the expected number of times each key appears among the sampled
        candidates -- TF's ``true_expected_count`` / ``sampled_expected_count``. Subtract
        ``log(prob)`` from the logits for the logQ correction of sampled softmax.
    num_tries : int
        Number of draws made (equals ``num_sampled`` unless ``unique=True``).
    """

    keys: np.ndarray
    is_positive: np.ndarray
    prob: np.ndarray
    num_tries: int = 0

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def negatives(self) -> np.ndarray:
        return self.keys[~self.is_positive]


class Sampler:
    """Base class: a distribution over the keys of a store.

    Subclasses define ``weights(keys, counts)``; ``rank_based`` samplers get the keys of the
    whole table at once (their weight of a key depends on the others).
    """

    #: weights depend on counts (so a snapshot goes stale when counts change)
    uses_counts: bool = True
    #: weight of a key depends on its rank among all keys
    rank_based: bool = False

    def weights(self, counts: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def cache_key(self) -> tuple:
        return (type(self).__name__,)


@dataclass(frozen=True)
class UniformSampler(Sampler):
    """Every stored key with the same probability, ``1 / len(store)``."""

    uses_counts = False

    def weights(self, counts: np.ndarray) -> np.ndarray:
        return np.ones(len(counts), dtype=np.float64)


@dataclass(frozen=True)
class UnigramSampler(Sampler):
    """Probability proportional to ``(count + smoothing) ** power`` (word2vec: power 0.75).

    Parameters
    ----------
    power : float
        Distortion of the counts (1.0 = raw unigram, 0.0 = uniform).
    smoothing : float
        Pseudo-count added to every key, so keys never trained (count 0) can be drawn.
    """

    power: float = 0.75
    smoothing: float = 0.0

    def __post_init__(self) -> None:
        for name in ("power", "smoothing"):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer))
                    or not np.isfinite(v) or v < 0):
                raise InvalidInputError(f"{name} must be a finite number >= 0, got {v!r}")

    def weights(self, counts: np.ndarray) -> np.ndarray:
        c = counts.astype(np.float64)
        if self.smoothing:
            c += self.smoothing
        if self.power == 1.0:
            return c
        w = np.power(c, self.power)
        w[c == 0] = 0.0  # 0 ** 0 would make untrained keys drawable at power 0
        return w

    def cache_key(self) -> tuple:
        return ("unigram", float(self.power), float(self.smoothing))


@dataclass(frozen=True)
class LogUniformSampler(Sampler):
    """Zipfian over the frequency rank, as ``tf.random.log_uniform_candidate_sampler``.

    Keys are ranked by ``count`` (most frequent first; ties by key ascending) and rank ``r``
    of ``N`` keys has probability ``log((r + 2) / (r + 1)) / log(N + 1)``.
    """

    rank_based = True

    def weights(self, counts: np.ndarray) -> np.ndarray:  # weights by *rank*, see index
        r = np.arange(len(counts), dtype=np.float64)
        return np.log1p(1.0 / (r + 1.0)) / np.log(len(counts) + 1.0)

    def cache_key(self) -> tuple:
        return ("log_uniform",)


@dataclass(frozen=True, eq=False)
class FixedCandidatesSampler(Sampler):
    """Always returns the given candidates (the first ``num_sampled``), for tests.

    Parameters
    ----------
    candidates : array-like
        Keys returned as negatives, in order.
    prob : float or array-like
        Expected count reported for each candidate (default 1.0); positives that are among the
        candidates get the candidate's value, other positives ``0``.
    """

    candidates: Any
    prob: Any = 1.0
    _p: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = np.broadcast_to(np.asarray(self.prob, dtype=np.float64),
                            (len(self.candidates),)).copy()
        if not np.isfinite(p).all() or (p < 0).any():
            raise InvalidInputError("FixedCandidatesSampler: prob must be finite and >= 0")
        object.__setattr__(self, "_p", p)

    @property
    def expected_counts(self) -> np.ndarray:
        """The expected count reported for each candidate (``prob`` broadcast, float64)."""
        return self._p

    def cache_key(self) -> tuple:
        return ("fixed", id(self))


_BY_NAME = {
    "uniform": UniformSampler,
    "unigram": UnigramSampler,
    "log_uniform": LogUniformSampler,
    "loguniform": LogUniformSampler,
}


def resolve_sampler(sampler: Any) -> Sampler:
    """A :class:`Sampler` from an instance or a name (``"uniform"``, ``"unigram"``,
    ``"log_uniform"``); ``None`` means log-uniform, TF's default for sampled softmax."""
    if sampler is None:
        return LogUniformSampler()
    if isinstance(sampler, Sampler):
        return sampler
    if isinstance(sampler, str) and sampler.lower() in _BY_NAME:
        return _BY_NAME[sampler.lower()]()
    raise InvalidInputError(
        f"unknown sampler {sampler!r}; use a Sampler instance or one of {sorted(_BY_NAME)}"
    )
