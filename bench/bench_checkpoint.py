"""Peak memory of checkpointing a large LMDB table, each case in a fresh process.

A 1M-row, dim-64 Adagrad table (about 540 MB of records) in LMDB under a
``DynamicEmbedding`` + ``nn.Linear``. Each case runs in its own child: open the store, build
the model, read the RSS, reset the kernel's peak (``/proc/self/clear_refs``), run the case,
read the peak (``VmHWM``) and the peak of anonymous memory (``RssAnon``, sampled every 2 ms: the
LMDB map's pages that a scan reads count in RSS as file pages, which the kernel can drop):

- ``state_dict``: ``torch.save(model.state_dict(), path)`` as is (the table is above the inline
  limit: a reference to the flushed version). Target: peak <= 1.2 x before + one chunk.
- ``inline``: the same with the rows forced inline (``checkpoint_rows=1 << 40``), what every
  ``state_dict`` did before: the whole table in memory, more than once.
- ``streamed``: ``embstore_torch.checkpoint.save(model, path)`` (reference + streamed export).

Usage: ``python bench/bench_checkpoint.py [--rows N] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

DIM = 64


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def build(url: str, rows: int) -> None:
    import embstore

    with embstore.open(url, dim=DIM, optimizer="adagrad", map_size=4 << 30) as s:
        rng = np.random.default_rng(0)
        for lo in range(0, rows, 65536):
            keys = np.arange(lo, min(rows, lo + 65536), dtype=np.int64)
            s.assign(keys, rng.standard_normal((len(keys), DIM), dtype=np.float32))


def child(case: str, url: str, out: str) -> None:
    import gc

    import torch

    import embstore
    import embstore_torch.checkpoint as ckpt
    from embstore_torch import DynamicEmbedding

    store = embstore.open(url)
    model = torch.nn.Sequential(DynamicEmbedding(store), torch.nn.Linear(DIM, 2))
    if case == "inline":
        model[0].checkpoint_rows = 1 << 40
    gc.collect()
    before = _status("VmRSS")
    anon_before = _status("RssAnon")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    peak_anon = [anon_before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    if case == "streamed":
        ckpt.save(model, out)
    else:
        torch.save(model.state_dict(), out)
    seconds = time.perf_counter() - t0
    done.set()
    t.join()
    print(json.dumps({"case": case, "before": before, "peak": _status("VmHWM"),
                      "anon_before": anon_before, "anon_peak": peak_anon[0],
                      "seconds": seconds, "file": os.path.getsize(out),
                      "table": len(store) * store.layout.itemsize}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", nargs=3, metavar=("CASE", "URL", "OUT"))
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    from embstore_torch.checkpoint import EXPORT_CHUNK_BYTES

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        url = f"lmdb://{d}/table"
        t0 = time.perf_counter()
        build(url, args.rows)
        print(f"built {args.rows} rows x dim {DIM} (adagrad) in {time.perf_counter() - t0:.1f}s")
        mib = 1 << 20
        print(f"{'case':<12}{'RSS before':>12}{'peak':>10}{'peak/before':>13}"
              f"{'anon +':>10}{'seconds':>9}{'file':>10}")
        for case in ("state_dict", "streamed", "inline"):
            out = os.path.join(d, f"{case}.pt")
            res = subprocess.run([sys.executable, __file__, "--child", case, url, out],
                                 capture_output=True, text=True, check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{case:<12}{r['before'] / mib:>10.0f}MB{r['peak'] / mib:>8.0f}MB"
                  f"{r['peak'] / r['before']:>12.2f}x"
                  f"{(r['anon_peak'] - r['anon_before']) / mib:>8.0f}MB{r['seconds']:>9.2f}"
                  f"{r['file'] / mib:>8.0f}MB")
            if case == "state_dict":
                limit = 1.2 * r["before"] + EXPORT_CHUNK_BYTES
                print(f"{'':<12}target: peak <= 1.2 x before + one chunk = {limit / mib:.0f}MB "
                      f"({'met' if r['peak'] <= limit else 'NOT met'}); table "
                      f"{r['table'] / mib:.0f}MB")


if __name__ == "__main__":
    main()
