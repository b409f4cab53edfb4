import numpy as np
import numpy.typing as npt

from .arena import RecordArena

def dedupe(keys: npt.NDArray[np.int64], uniq: npt.NDArray[np.int64],
           inv: npt.NDArray[np.int64], counts: npt.NDArray[np.int64]) -> int: ...
def pool(arena: RecordArena, slots: npt.NDArray[np.uint32], inv: npt.NDArray[np.int64],
         offsets: npt.NDArray[np.int64], weights: npt.NDArray[np.float32], vec_offset: int,
         mean: bool, out: npt.NDArray[np.float32], threads: int = ..., kind: int = ...,
         argmax: npt.NDArray[np.int32] | None = ...) -> None: ...
def grad_sums(inv: npt.NDArray[np.int64], offsets: npt.NDArray[np.int64],
              weights: npt.NDArray[np.float32], mean: bool, grad: npt.NDArray[np.float32],
              sums: npt.NDArray[np.float32],
              argmax: npt.NDArray[np.int32] | None = ...) -> None: ...

RULES: dict[str, int]
RULE_SLOTS: dict[str, tuple[str, ...]]
KINDS: dict[str, int]

def split_threads(threads: int, work: int) -> int: ...

def step_bags(arena: RecordArena, slots: npt.NDArray[np.uint32], inv: npt.NDArray[np.int64],
              offsets: npt.NDArray[np.int64], weights: npt.NDArray[np.float32], mean: bool,
              grad: npt.NDArray[np.float32], rule: int, alpha: float, lr: float, eps: float,
              vec_offset: int, acc_offset: int, add_offsets: npt.NDArray[np.intp],
              add_values: npt.NDArray[np.int64], set_offsets: npt.NDArray[np.intp],
              set_bits: npt.NDArray[np.uint64], threads: int = ..., vec_kind: int = ...,
              acc_kind: int = ..., seed: int = ..., stochastic: bool = ...,
              hyper: npt.NDArray[np.float64] | None = ..., acc2_offset: int = ...,
              argmax: npt.NDArray[np.int32] | None = ...) -> bool: ...
