"""In-store optimizers: vectorized numpy updates over record batches, state in record slots."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidInputError
from .adagrad import Adagrad
from .adam import Adam
from .base import Optimizer
from .ftrl import FTRL
from .momentum import Momentum
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Momentum", "Adagrad", "Adam", "FTRL", "from_config", "resolve",
           "register_optimizer"]

_BY_NAME: dict[str, type[Optimizer]] = {
    c.name: c for c in (SGD, Momentum, Adagrad, Adam, FTRL)
}


def register_optimizer(cls: type[Optimizer]) -> type[Optimizer]:
    """Make an optimizer class known to ``from_config`` (used on reopen and import)."""
    _BY_NAME[cls.name] = cls
    return cls


def from_config(cfg: dict[str, Any]) -> Optimizer:
    cfg = dict(cfg)
    name = cfg.pop("name", None)
    if name not in _BY_NAME:
        raise InvalidInputError(f"unknown optimizer {name!r}; known: {sorted(_BY_NAME)}")
    try:
        return _BY_NAME[name](**cfg)
    except TypeError as e:
        raise InvalidInputError(f"bad parameters for optimizer {name!r}: {e}") from e


def resolve(opt: Optimizer | str | dict | None) -> Optimizer | None:
    """Accept an Optimizer, a name (``"sgd"``), a config dict or None."""
    if opt is None or isinstance(opt, Optimizer):
        return opt
    if isinstance(opt, str):
        return from_config({"name": opt})
    if isinstance(opt, dict):
        return from_config(opt)
    raise InvalidInputError(f"not an optimizer: {opt!r}")
