"""Dictionary-free skip-gram Word2Vec on an embedding store, side by side with plain PyTorch
(prebuilt vocabulary) and gensim.

Raw words go straight from the text into the model: there is no vocabulary, no word -> index
table, no counting pass. Each word is a key of two embedding stores (input and output vectors,
embedded LMDB by default, any backend with ``--store``); the stores' optimizer (plain SGD with
gensim's linearly decaying rate) applies the gradients that flow back through the PyTorch adapter
(``embstore_torch.DynamicEmbedding``). Word frequencies are the output store's per-key
``count``, recorded as the text streams by on the first pass; a frequency-cutoff admission
policy stands in for gensim's ``min_count`` (a word gets a row on its ``min_count``-th
sighting), and frequency subsampling (``store.subsample_mask``) and the unigram^0.75 negative
sampler (``store.sample``) read the counts. At the end: nearest neighbours via ``store.top_k``,
the Spearman correlation on WordSim-353, and the same job as a user would write it without
embstore (a vocabulary pass, ``nn.Embedding(sparse=True)`` + ``torch.optim.SGD``) and gensim's
``Word2Vec``, on the same corpus and settings, with speed ratios.

Run ``python examples/word2vec.py`` (``make demo``); ``--quick`` for a smoke run. By default
the stores are LMDB environments under ``.demo/word2vec`` with a ``memory://`` cache in front
(write-back, flushed to LMDB at the end; ``--cache none`` trains on LMDB directly). ``--store``
runs on another backend, e.g.::

    python examples/word2vec.py --store 'lmdb:///tmp/w2v/{name}'
    BIGTABLE_EMULATOR_HOST=127.0.0.1:8086 python examples/word2vec.py \\
        --store 'bigtable://demo/inst/w2v_{name}' --cache memory://
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import embstore
from embstore.allocator import retain_freed_memory
from embstore.init import Uniform
from embstore.keys import DistinctKeys, factorize
from embstore.optim import SGD
from embstore.policies import FrequencyCutoff
from embstore.sampling import UnigramSampler
from embstore_torch import DynamicEmbedding, FactorizedKeys

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency of embstore
    tqdm = None

NEIGHBOUR_WORDS = ("war", "music", "church", "french", "water", "comput", "king", "film")


def data_dir() -> Path:
    try:
        import gensim
    except ImportError:
        sys.exit("this demo reads the corpus shipped in the gensim wheel: pip install gensim scipy")
    return Path(gensim.__file__).parent / "test" / "test_data"


def read_corpus(path: Path, max_docs: int | None) -> list[list[str]]:
    """One article per line, already tokenized (lower-case, Porter-stemmed)."""
    with open(path, encoding="utf-8") as f:
        docs = [line.split() for line in f if line.strip()]
    return docs[:max_docs] if max_docs else docs


def store_url(template: str, name: str) -> str:
    """The URL of one of the two stores: ``{name}`` in the template, or a suffix."""
    if "{name}" in template:
        return template.format(name=name)
    if template.rstrip("/") == "memory:":
        return "memory://"
    return f"{template.rstrip('/')}-{name}"


def open_stores(args: argparse.Namespace) -> tuple[embstore.EmbeddingStore, ...]:
    options: dict = {}
    cache = args.cache
    if cache is None and args.store is None:
        cache = "memory://"  # the default: embedded LMDB with the hot rows cached in memory
    if cache and cache != "none":
        options.update(cache=cache, cache_capacity=args.cache_capacity)
    template = args.store
    if template is None:
        demo = Path(args.demo_dir).resolve() / "word2vec"
        shutil.rmtree(demo, ignore_errors=True)  # a fresh run every time
        demo.mkdir(parents=True)
        template = f"lmdb://{demo}/{{name}}"
    if template.startswith("lmdb://"):
        # Training data is reproducible: trade crash durability for write speed.
        options.update(durable=False, writemap=True, map_size=1 << 30)
    common = dict(dim=args.dim, key_type="bytes", optimizer=SGD(lr=args.alpha), seed=args.seed,
                  value_dtype=args.value_dtype)
    # gensim's initialization: input vectors uniform in +-0.5/dim, output vectors zero.
    inp = embstore.open(store_url(template, "in"), initializer=Uniform(-0.5 / args.dim,
                                                                      0.5 / args.dim),
                        **common, **options)
    admission = FrequencyCutoff(args.min_count) if args.min_count > 1 else None
    out = embstore.open(store_url(template, "out"), initializer="zeros", admission=admission,
                        **common, **options)
    return inp, out


def chunks(docs: list[list[str]], words_per_chunk: int):
    """Groups of whole articles of about ``words_per_chunk`` words."""
    cur, n = [], 0
    for d in docs:
        cur.append(d)
        n += len(d)
        if n >= words_per_chunk:
            yield cur
            cur, n = [], 0
    if cur:
        yield cur


def skipgram_pairs(ids: np.ndarray, doc: np.ndarray, window: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(center, context) index pairs, as word2vec makes them: each center draws its window
    ``b`` uniformly in ``1..window`` and pairs with the words at distance ``<= b`` in its
    article. Vectorized over distances instead of looping over words."""
    b = rng.integers(1, window + 1, len(ids))
    cs, xs = [], []
    for d in range(1, window + 1):
        same = doc[:-d] == doc[d:]
        fwd = same & (b[:-d] >= d)   # center i, context i + d
        bwd = same & (b[d:] >= d)    # center i + d, context i
        cs += [ids[:-d][fwd], ids[d:][bwd]]
        xs += [ids[d:][fwd], ids[:-d][bwd]]
    return np.concatenate(cs), np.concatenate(xs)


class Clock:
    """Wall and CPU time of one training job that runs in segments: the jobs take turns
    epoch by epoch (see :func:`alternate`), and each counts only its own turns."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self._t = (0.0, 0.0)

    def start(self) -> None:
        self._t = (time.perf_counter(), time.process_time())

    def stop(self) -> None:
        self.wall += time.perf_counter() - self._t[0]
        self.cpu += time.process_time() - self._t[1]

    def elapsed(self) -> float:
        return self.wall + time.perf_counter() - self._t[0]


def alternate(jobs: list) -> list:
    """Run generator jobs in turns (each yields after an epoch) until all have returned; return
    their return values. Taking turns, the jobs meet the same machine: a change in the load
    of other processes slows them alike instead of skewing their ratio."""
    results: list = [None] * len(jobs)
    running = list(range(len(jobs)))
    while running:
        for i in list(running):
            try:
                next(jobs[i])
            except StopIteration as done:
                results[i] = done.value
                running.remove(i)
    return results


def train(args: argparse.Namespace, docs: list[list[str]], inp, out):
    """embstore's skip-gram training; a generator that yields after each epoch (see
    :func:`alternate`) and returns the timings."""
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    in_emb = DynamicEmbedding(inp)
    # The output store's counts are the corpus frequencies (recorded below, once per word
    # occurrence); training updates must not add to them.
    out_emb = DynamicEmbedding(out, count=False)
    sampler = UnigramSampler(power=0.75)
    corpus_words = sum(len(d) for d in docs)
    total = corpus_words * args.epochs
    done, pairs_done, loss_sum, loss_n = 0, 0, 0.0, 0
    bar = (tqdm(total=total, unit="w", unit_scale=True, desc="embstore skip-gram",
                dynamic_ncols=True, disable=args.no_progress) if tqdm else None)
    clock = Clock()
    epoch_wps, epoch_pairs, epoch_pps = [], [], []
    for epoch in range(args.epochs):
        clock.start()
        t_epoch, pairs_before = time.perf_counter(), pairs_done
        for group in chunks(docs, args.chunk_words):
            alpha = args.alpha - (args.alpha - args.min_alpha) * done / total
            doc = np.repeat(np.arange(len(group)), [len(d) for d in group])
            # 1. Record the sightings: the only "vocabulary" is the store's per-key count.
            # factorize: the chunk's distinct words (UTF-8 bytes) and each token's index among
            # them, hashed and compared in compiled code.
            words, inverse = factorize([w for d in group for w in d])
            tokens = words[inverse]
            if epoch == 0:
                # Counted on the first pass only: the counts are then the corpus frequencies,
                # which min_count, subsampling and the negative sampler mean. Counting every
                # pass again would admit a word seen once per epoch in the 5th epoch, so the
                # trained vocabulary (and the work per step) would keep growing epoch by epoch.
                occ = np.bincount(inverse, minlength=len(words))
                out.update(words, np.zeros((len(words), args.dim), np.float32), counts=occ)
            # 2. Frequency subsampling, then (center, context) pairs over what is kept.
            keep = out.subsample_mask(tokens, t=args.sample, seed=rng)
            if args.min_count > 1:
                # gensim's min_count without a vocabulary pass: the output store admits a word
                # (gives it a row, so it can be counted, sampled and trained) on its
                # min_count-th sighting; until then its occurrences are dropped.
                keep &= out.contains(words)[inverse]
            centers, contexts = skipgram_pairs(inverse[keep], doc[keep], args.window, rng)
            perm = rng.permutation(len(centers))
            centers, contexts = centers[perm], contexts[perm]
            scale = alpha / args.alpha  # the stores' SGD runs at args.alpha
            for s in range(0, len(centers), args.batch):
                c = rows_batch(words, centers[s:s + args.batch])
                x = words[contexts[s:s + args.batch]]
                loss = sgns_step(in_emb, out_emb, out, sampler, c, x, args.negatives, scale,
                                 rng)
                loss_sum += loss
                loss_n += len(x)
            pairs_done += len(centers)
            done += len(tokens)
            if bar is not None:
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss_sum / max(loss_n, 1):.3f}",
                                words_s=f"{done / clock.elapsed():,.0f}", lr=f"{alpha:.4f}")
                bar.update(len(tokens))
                loss_sum, loss_n = 0.0, 0
        seconds = time.perf_counter() - t_epoch
        epoch_wps.append(corpus_words / seconds)
        epoch_pairs.append(pairs_done - pairs_before)
        epoch_pps.append(epoch_pairs[-1] / seconds)
        clock.stop()
        yield
    clock.start()
    if bar is not None:
        bar.close()
    inp.flush()
    out.flush()
    clock.stop()
    return {"seconds": clock.wall, "words": total, "pairs": pairs_done,
            "words_per_s": total / clock.wall, "epoch_words_per_s": epoch_wps,
            "epoch_pairs": epoch_pairs, "epoch_pairs_per_s": epoch_pps,
            "words_per_cpu_s": total / clock.cpu}


def rows_batch(words: np.ndarray, rows: np.ndarray) -> FactorizedKeys:
    """A module input of keys given as rows of ``words`` (distinct keys): the words used,
    deduplicated by their row (integers, no bytes hashed or compared), and each element's
    index among them."""
    used = np.zeros(len(words), dtype=bool)
    used[rows] = True
    first = np.flatnonzero(used)
    index = np.cumsum(used) - 1
    # distinct rows of distinct words: distinct keys, as a dedupe would have found them
    return FactorizedKeys(DistinctKeys.found(words[first]), index[rows])


def sgns_step(in_emb, out_emb, out, sampler, centers: FactorizedKeys, contexts: np.ndarray,
              k: int, scale: float, rng: np.random.Generator) -> float:
    """One batch of skip-gram with negative sampling (``centers`` the batch's center words,
    ``contexts`` its context words, pair by pair); return the summed loss."""
    b = len(contexts)
    # k negatives per pair from the unigram^0.75 distribution over the output store's counts.
    negs = out.sample([], b * k, sampler, unique=False, remove_accidental_hits=False,
                      seed=rng).keys.reshape(b, k)
    # Row i of the output keys: the context word of pair i, then its k negatives,
    # deduplicated here (as the module would: the same rows and bits), so that the job can
    # compare keys by their row among the distinct ones.
    uniq, inverse = factorize(np.concatenate((contexts[:, None], negs), axis=1).reshape(-1),
                              distinct=True)
    inverse = inverse.reshape(b, k + 1)
    v = in_emb(centers)                                     # (b, dim)
    u = out_emb(FactorizedKeys(uniq, inverse))              # (b, 1 + k, dim)
    scores = (u * v.unsqueeze(1)).sum(2)                    # elementwise: no tiny matmuls
    sign = torch.ones(k + 1)
    sign[1:] = -1.0
    # word2vec skips a negative that happens to be the context word itself: the same key,
    # the same row of the distinct keys (no bytes compared or hashed again).
    weight = np.ones((b, k + 1), dtype=np.float32)
    weight[:, 1:] = inverse[:, 1:] != inverse[:, :1]
    loss = -(F.logsigmoid(scores * sign) * torch.from_numpy(weight)).sum()
    (loss * scale).backward()  # both stores apply their SGD step here
    return float(loss.detach())


# -- the baseline: what a user would write instead, with a vocabulary built first ------------
def train_baseline(args: argparse.Namespace, docs: list[list[str]]):
    """The same skip-gram model in plain PyTorch: a counting pass builds the vocabulary
    (``min_count``), the corpus is encoded to ids once, and two ``nn.Embedding(sparse=True)``
    tables train with ``torch.optim.SGD`` under the same learning-rate schedule, subsampling,
    windows, negatives and loss. A generator like :func:`train`; returns the timings and
    ``{word: input vector}``."""
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    # torch.optim imports its compiler helpers on a first step (seconds): not part of the run.
    warm = torch.nn.Parameter(torch.zeros(1))
    warm.grad = torch.zeros(1)
    torch.optim.SGD([warm], lr=0.1).step()
    clock = Clock()
    clock.start()   # the vocabulary pass is part of the baseline's run: counted in epoch 1
    freq = Counter(w for d in docs for w in d)
    vocab = [w for w, c in freq.items() if c >= args.min_count]
    index = {w: i for i, w in enumerate(vocab)}
    counts = np.array([freq[w] for w in vocab], dtype=np.float64)
    thr = args.sample * counts.sum()
    keep_p = np.minimum((np.sqrt(counts / thr) + 1) * thr / counts, 1.0)
    cdf = np.cumsum(counts ** 0.75)
    cdf /= cdf[-1]
    encoded = [np.array([index.get(w, -1) for w in d], dtype=np.int64) for d in docs]
    in_emb = torch.nn.Embedding(len(vocab), args.dim, sparse=True)
    out_emb = torch.nn.Embedding(len(vocab), args.dim, sparse=True)
    with torch.no_grad():
        in_emb.weight.uniform_(-0.5 / args.dim, 0.5 / args.dim)
        out_emb.weight.zero_()
    opt = torch.optim.SGD([in_emb.weight, out_emb.weight], lr=args.alpha)
    corpus_words = sum(len(d) for d in docs)
    total = corpus_words * args.epochs
    done, k = 0, args.negatives
    epoch_wps = []
    sign = torch.ones(k + 1)
    sign[1:] = -1.0
    for epoch in range(args.epochs):
        if epoch:
            clock.start()
        t_epoch = time.perf_counter()
        for group in chunks(encoded, args.chunk_words):
            alpha = args.alpha - (args.alpha - args.min_alpha) * done / total
            ids = np.concatenate(group)
            doc = np.repeat(np.arange(len(group)), [len(d) for d in group])
            known = ids >= 0
            keep = known & (rng.random(len(ids)) < keep_p[np.where(known, ids, 0)])
            centers, contexts = skipgram_pairs(ids[keep], doc[keep], args.window, rng)
            perm = rng.permutation(len(centers))
            centers, contexts = centers[perm], contexts[perm]
            for group_ in opt.param_groups:
                group_["lr"] = alpha
            for s in range(0, len(centers), args.batch):
                c, x = centers[s:s + args.batch], contexts[s:s + args.batch]
                b = len(c)
                negs = np.searchsorted(cdf, rng.random(b * k)).reshape(b, k)
                targets = np.concatenate((x[:, None], negs), axis=1)
                v = in_emb(torch.from_numpy(c))
                u = out_emb(torch.from_numpy(targets))
                scores = (u * v.unsqueeze(1)).sum(2)
                weight = np.ones((b, k + 1), dtype=np.float32)
                weight[:, 1:] = negs != x[:, None]
                loss = -(F.logsigmoid(scores * sign) * torch.from_numpy(weight)).sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            done += len(ids)
        epoch_wps.append(corpus_words / (time.perf_counter() - t_epoch))
        clock.stop()
        yield
    vectors = dict(zip(vocab, in_emb.weight.detach().numpy()))
    return ({"seconds": clock.wall, "words_per_s": total / clock.wall,
             "epoch_words_per_s": epoch_wps, "words_per_cpu_s": total / clock.cpu}, vectors)


# -- evaluation ------------------------------------------------------------------------------
def wordsim_pairs(path: Path) -> list[tuple[str, str, float]]:
    """WordSim-353, with words Porter-stemmed as the corpus is."""
    from gensim.parsing.porter import PorterStemmer

    ps = PorterStemmer()
    pairs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            a, b, score = line.rstrip("\n").split("\t")
            pairs.append((ps.stem(a.lower()), ps.stem(b.lower()), float(score)))
    return pairs


def spearman(vectors: dict[str, np.ndarray], pairs) -> float:
    from scipy.stats import spearmanr

    human, model = [], []
    for a, b, s in pairs:
        va, vb = vectors[a], vectors[b]
        human.append(s)
        model.append(float(va @ vb / (np.linalg.norm(va) * np.linalg.norm(vb) + 1e-12)))
    return float(spearmanr(human, model).correlation)


def normalized_copy(store) -> embstore.EmbeddingStore:
    """A memory:// store of unit vectors, so that ``top_k`` (dot product) ranks by cosine."""
    unit = embstore.open("memory://", dim=store.dim, key_type="bytes")
    for keys, vecs in store.items(batch_size=65536):
        norms = np.linalg.norm(vecs, axis=1, keepdims=True)
        unit.assign(keys, vecs / np.maximum(norms, 1e-12))
    return unit


def neighbours(unit, words: list[str], k: int = 6) -> list[tuple[str, list[str]]]:
    keys = [w.encode() for w in words]
    q = unit.lookup(keys, insert=False)
    found, _ = unit.top_k(q, k, exclude=[[kk] for kk in keys])
    return [(w, [x.decode() for x in row]) for w, row in zip(words, found)]


def run_gensim(args: argparse.Namespace, docs: list[list[str]]):
    from gensim.models import Word2Vec

    t, c = time.perf_counter(), time.process_time()
    model = Word2Vec(docs, vector_size=args.dim, window=args.window, negative=args.negatives,
                     sg=1, hs=0, sample=args.sample, alpha=args.alpha,
                     min_alpha=args.min_alpha, min_count=args.min_count, epochs=args.epochs,
                     workers=args.gensim_workers, seed=args.seed, ns_exponent=0.75)
    seconds = time.perf_counter() - t
    words = sum(len(d) for d in docs) * args.epochs
    return model, {"seconds": seconds, "words_per_s": words / seconds,
                   "words_per_cpu_s": words / (time.process_time() - c)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--dim", type=int, default=100)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--negatives", type=int, default=5)
    p.add_argument("--sample", type=float, default=1e-3, help="subsampling threshold t")
    p.add_argument("--alpha", type=float, default=0.025, help="initial learning rate")
    p.add_argument("--min-alpha", type=float, default=0.0001)
    p.add_argument("--min-count", type=int, default=5,
                   help="train a word once it was counted this often (gensim's min_count)")
    p.add_argument("--batch", type=int, default=8192, help="(center, context) pairs per step")
    p.add_argument("--chunk-words", type=int, default=20000)
    p.add_argument("--store", default=None,
                   help="store URL template with {name} (in/out); default: LMDB under --demo-dir")
    p.add_argument("--cache", default=None,
                   help="local cache URL in front of the stores (default: memory:// for the "
                        "default LMDB store, none for --store); 'none' disables it")
    p.add_argument("--cache-capacity", type=int, default=200_000, help="rows per cache")
    p.add_argument("--demo-dir", default=".demo")
    p.add_argument("--corpus", default="head500.noblanks.cor",
                   help="file in gensim/test/test_data (or a path)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for both PyTorch runs (default: torch's own choice, "
                        "one per core)")
    p.add_argument("--gensim-workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--value-dtype", default="float32",
                   choices=("float32", "float16", "bfloat16"),
                   help="storage dtype of the vectors (16-bit: stochastic rounding)")
    p.add_argument("--quick", action="store_true", help="60 articles, 1 epoch: a smoke run")
    p.add_argument("--no-gensim", action="store_true", help="skip the gensim comparison")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the plain-PyTorch (prebuilt vocabulary) comparison")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's malloc settings alone (see embstore.allocator)")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.max_docs = 1, 60
    else:
        args.max_docs = None
    return args


def print_table(result: dict) -> None:
    """Quality and speed side by side, with embstore's ratios to the other two."""
    ours = result["embstore"]
    rows = [("embstore", "no vocabulary: raw words are store keys", ours)]
    if "baseline" in result:
        rows.append(("pytorch", "nn.Embedding(sparse) + SGD, vocabulary built", result["baseline"]))
    if "gensim" in result:
        rows.append(("gensim", "Word2Vec, C inner loop", result["gensim"]))
    print(f"\nWordSim-353 Spearman on {result['pairs']} pairs (both words seen >= 5 times):")
    # words per CPU second as well: on a shared machine wall-clock rates swing with the load
    # of other processes, CPU time much less (gensim's counts its worker threads too).
    print(f"  {'':9s} {'spearman':>8s} {'words/s':>9s} {'words/cpu-s':>11s} {'seconds':>8s} "
          f"{'last/first epoch':>16s}")
    for name, what, r in rows:
        ep = r.get("epoch_words_per_s")
        flat = f"{ep[-1] / ep[0]:.2f}x" if ep else ""
        print(f"  {name:9s} {r['spearman']:8.3f} {r['words_per_s']:9,.0f} "
              f"{r['words_per_cpu_s']:11,.0f} {r['seconds']:8.1f} {flat:>16s}   {what}")
    for name, _, r in rows[1:]:
        print(f"  embstore vs {name}: speed {ours['words_per_s'] / r['words_per_s']:.2f}x "
              f"(per CPU second {ours['words_per_cpu_s'] / r['words_per_cpu_s']:.2f}x), "
              f"Spearman {ours['spearman'] - r['spearman']:+.3f}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # Every step allocates and frees the same large tensors; by default glibc hands that
    # memory back to the kernel and faults it in again each step. Kept in the process, all
    # three runs below (embstore, plain PyTorch, gensim) run 20-35% faster.
    retained = not args.default_malloc and retain_freed_memory()
    data = data_dir()
    corpus = Path(args.corpus) if os.sep in args.corpus else data / args.corpus
    docs = read_corpus(corpus, args.max_docs)
    n_words = sum(len(d) for d in docs)
    print(f"corpus {corpus.name}: {len(docs)} articles, {n_words:,} words; "
          f"skip-gram dim={args.dim} window={args.window} negatives={args.negatives} "
          f"sample={args.sample} min_count={args.min_count} epochs={args.epochs} "
          f"batch={args.batch} pairs")
    print("allocator: freed memory kept in the process for every run below "
          "(embstore.allocator.retain_freed_memory)" if retained
          else "allocator: glibc defaults")
    # gensim first, before torch starts its intra-op threads: once started, their idle
    # threads cost gensim's workers about a quarter of their speed.
    gensim_run = None if args.no_gensim else run_gensim(args, docs)
    print(f"torch threads: {torch.get_num_threads()}")
    inp, out = open_stores(args)
    print(f"stores: {inp.url} (input vectors), {out.url} (output vectors)")
    jobs = [train(args, docs, inp, out)]
    if not args.no_baseline:
        print("embstore and the PyTorch baseline train in turns, epoch by epoch")
        jobs.append(train_baseline(args, docs))
    trained = alternate(jobs)
    ours = trained[0]
    print(f"embstore: {len(inp):,} words learned, {len(out):,} counted (no vocabulary given), "
          f"{ours['pairs']:,} pairs in {ours['seconds']:.1f}s, "
          f"{ours['words_per_s']:,.0f} words/s")
    print("  words/s per epoch: " + ", ".join(f"{w:,.0f}" for w in ours["epoch_words_per_s"]))
    # Epoch 1 trains fewer pairs: a word's occurrences before its min_count-th are dropped.
    # So it runs ahead in words/s; the work rate, pairs/s, shows whether the steps stay flat.
    print("  pairs per epoch:   " + ", ".join(f"{p:,}" for p in ours["epoch_pairs"]))
    pps = ours["epoch_pairs_per_s"]
    print("  pairs/s per epoch: " + ", ".join(f"{r:,.0f}" for r in pps)
          + f"   (last/first epoch {pps[-1] / pps[0]:.2f}x)")

    # Evaluate on the WordSim-353 pairs whose words occur >= 5 times (gensim's default
    # min_count), the same pairs for both models.
    freq = Counter(w for d in docs for w in d)
    pairs = [(a, b, s) for a, b, s in wordsim_pairs(data / "wordsim353.tsv")
             if freq[a] >= 5 and freq[b] >= 5]
    eval_words = sorted({w for a, b, _ in pairs for w in (a, b)})
    vecs = inp.lookup([w.encode() for w in eval_words], insert=False)
    ours_vec = dict(zip(eval_words, vecs))
    ours["spearman"] = spearman(ours_vec, pairs) if len(pairs) > 2 else float("nan")
    unit = normalized_copy(inp)
    shown = [w for w in NEIGHBOUR_WORDS if freq[w] >= 20][:6]
    print("nearest neighbours (store.top_k over unit vectors):")
    for w, ns in neighbours(unit, shown):
        print(f"  {w:>8s}: {', '.join(ns)}")
    result = {"embstore": ours, "pairs": len(pairs)}
    if not args.no_baseline:
        base, base_vec = trained[1]
        base["spearman"] = spearman(base_vec, pairs) if len(pairs) > 2 else float("nan")
        result["baseline"] = base
    if gensim_run is not None:
        model, gs = gensim_run
        gs["spearman"] = spearman({w: model.wv[w] for w in eval_words}, pairs)
        result["gensim"] = gs
    print_table(result)
    inp.close()
    out.close()
    return result


if __name__ == "__main__":
    main()
