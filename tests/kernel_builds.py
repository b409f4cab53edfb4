"""One fused training run in a fresh process for each build of the fused kernels' inner loops
(es_fused.h): the AVX2/FMA one and the baseline one, forced with EMBSTORE_BASELINE_KERNELS.
The two must give the same bits; tests compare the bytes each run prints."""

from __future__ import annotations

import os
import subprocess
import sys

_TRAIN_SCRIPT = """
import sys, numpy as np, embstore
from embstore.optim import FTRL, Adagrad, Adam, Momentum
opt = {"adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
       "nesterov": lambda: Momentum(lr=0.05, momentum=0.8, nesterov=True),
       "adam": lambda: Adam(lr=0.01, slot_dtype=sys.argv[2]),
       "ftrl": lambda: FTRL(alpha=0.5, l1=0.01, l2=0.1, l21=0.1)}[sys.argv[1]]()
store = embstore.open("memory://", dim=40, seed=3, optimizer=opt, value_dtype=sys.argv[2])
rng = np.random.default_rng(5)
for _ in range(3):
    lengths = rng.integers(0, 7, 3000)
    ids = rng.zipf(1.2, int(lengths.sum())) % 500
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    w = rng.random(len(ids), dtype=np.float32)
    out, batch = store.pool_bags(ids, offsets, weights=w, threads=2)
    store.update_bags(batch, rng.standard_normal(out.shape).astype(np.float32), threads=2)
recs, found = store.get_records(np.arange(500))
sys.stdout.buffer.write(out.tobytes() + b"".join(recs[found][n].tobytes()
                                                 for n in recs.dtype.names[:3]))
"""


def runs_of_both_builds(opt: str, value_dtype: str) -> list[bytes]:
    """The bytes (last pooled output, then the first three record fields of every row) of the
    same training run with the wide build and with the baseline one."""
    runs = []
    for baseline in ("0", "1"):
        env = dict(os.environ, EMBSTORE_BASELINE_KERNELS=baseline)
        done = subprocess.run([sys.executable, "-c", _TRAIN_SCRIPT, opt, value_dtype], env=env,
                              capture_output=True, timeout=300, check=True)
        runs.append(done.stdout)
    return runs
