"""TFRA's ``de.embedding_lookup`` step as a peer process, the TF adapter's rival in
``bench_adapters.py``.

TFRA 0.8.1 needs TF 2.16, so it runs in its own venv (``make tfra-venv``): this file is
started there as a long-lived child that times one round of steps each time it is told to
(JSON-free lines over stdin/stdout), so its rounds alternate with the other contenders'.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from races import local_round


class TFRAPeer:
    """The TFRA step in a subprocess (its own venv and TF version), timed one round per call."""

    def __init__(self, python: str, batches: list[np.ndarray], id_space: int, dim: int,
                 lr: float, warmup: int) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="embstore-tfra-")
        path = os.path.join(self._dir.name, "batches.npy")
        np.save(path, np.stack(batches))
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="1")
        self._err = open(os.path.join(self._dir.name, "stderr"), "w+")
        self._p = subprocess.Popen(
            [python, os.path.abspath(__file__), path, "--id-space", str(id_space),
             "--dim", str(dim), "--lr", str(lr), "--warmup", str(warmup)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        self._expect("ready")

    def _expect(self, what: str) -> str:
        line = self._p.stdout.readline().strip()
        if not line.startswith(what):
            self._err.seek(0)
            tail = "".join(self._err.readlines()[-5:]).strip()
            self.close()
            raise RuntimeError(f"TFRA worker failed ({line!r}): {tail}")
        return line

    def round(self) -> tuple[float, float]:
        self._p.stdin.write("round\n")
        self._p.stdin.flush()
        _, wall, cpu = self._expect("round").split()
        return float(wall), float(cpu)

    def close(self) -> None:
        if self._p.poll() is None:
            try:
                self._p.stdin.write("quit\n")
                self._p.stdin.flush()
                self._p.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._p.kill()
        self._err.close()
        self._dir.cleanup()


def serve(batch_file: str, id_space: int, dim: int, lr: float, warmup: int) -> None:
    """Child side of :class:`TFRAPeer` (runs under the TFRA venv's python)."""
    # Protocol lines go to the original stdout; anything TF/TFRA prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import tensorflow as tf
    from tensorflow_recommenders_addons import dynamic_embedding as de

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    batches = [tf.constant(b) for b in np.load(batch_file)]
    var = de.get_variable("bench", key_dtype=tf.int64, value_dtype=tf.float32, dim=dim,
                          initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05),
                          init_size=id_space)  # default kv_creator: CuckooHashTable
    chunk = 200_000
    for s in range(0, id_space, chunk):  # the same table size as the embstore side
        k = tf.range(s, min(id_space, s + chunk), dtype=tf.int64)
        var.upsert(k, tf.random.uniform((tf.size(k), dim), -0.05, 0.05))
    opt = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(lr))

    @tf.function
    def step(keys):
        with tf.GradientTape() as tape:
            vecs = de.embedding_lookup(var, keys, name="bench_lookup")
            loss = tf.reduce_sum(vecs) * 1e-3
        # TFRA's documented TF2 path: the lookup's shadow (trainable) variable, by name
        tw = var.get_trainable_by_name("bench_lookup")
        opt.apply_gradients(zip(tape.gradient(loss, [tw]), [tw]))
        return loss

    for b in batches[:warmup]:
        step(b)
    timed = local_round(step, batches[warmup:])
    print("ready", file=proto, flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        wall, cpu = timed()
        print(f"round {wall} {cpu}", file=proto, flush=True)


def default_python() -> str | None:
    env = os.environ.get("EMBSTORE_TFRA_PYTHON")
    if env:
        return env
    local = Path(__file__).resolve().parent.parent / ".venv-tfra" / "bin" / "python"
    return str(local) if local.exists() else None


def main() -> None:
    p = argparse.ArgumentParser(description="the TFRA side of bench_adapters.py (a child)")
    p.add_argument("batches")
    p.add_argument("--id-space", type=int, required=True)
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup", type=int, required=True)
    a = p.parse_args()
    serve(a.batches, a.id_space, a.dim, a.lr, a.warmup)


if __name__ == "__main__":
    main()
