"""String keys: the containers users hold, the compiled hash and bytes table, dedupe."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore._cython.arena import RecordArena
from embstore._cython.bytestable import BytesTable, find_or_insert
from embstore._cython.strkeys import KeySnapshot
from embstore._keys import factorize_keys, key_hash64, normalize_keys
from embstore.errors import InvalidInputError, KeyTypeError, SchemaMismatchError
from embstore.keys import factorize, hash64

WORDS = ["the", "cat", "sat", "on", "the", "mat", "é", "naïve", ""]
ENCODED = [w.encode() for w in WORDS]
_EMPTY = 0xFFFFFFFF

# XXH3-64, seed 0, from the xxHash reference (xxhsum -H3); fixed forever: shards depend on it.
XXH3_VECTORS = {b"": 0x2D06800538D394C2, b"a": 0xE6C632B61E964E1F,
                b"hello": 0x9555E8555C62DCFD}


def containers():
    out = {"list of str": list(WORDS), "list of bytes": list(ENCODED), "tuple": tuple(WORDS),
           "mixed list": [w if i % 2 else w.encode() for i, w in enumerate(WORDS)],
           "numpy U": np.array(WORDS), "numpy O": np.array(WORDS, dtype=object),
           "numpy S": np.array(ENCODED, dtype="S"),
           "numpy StringDType": np.array(WORDS, dtype=np.dtypes.StringDType())}
    pa = pytest.importorskip("pyarrow")
    out["pyarrow string"] = pa.array(WORDS)
    out["pyarrow large_string"] = pa.array(WORDS, type=pa.large_string())
    out["pyarrow binary"] = pa.array(ENCODED, type=pa.binary())
    out["pyarrow chunked"] = pa.chunked_array([WORDS[:4], WORDS[4:]])
    out["pyarrow sliced"] = pa.array(["x"] + WORDS)[1:]
    return out


@pytest.mark.parametrize("name", list(containers()))
def test_every_container_normalizes_to_the_same_keys(name):
    keys = normalize_keys(containers()[name], "bytes")
    assert keys.dtype == object and keys.tolist() == ENCODED
    assert all(type(k) is bytes for k in keys)


def test_object_array_of_plain_bytes_is_used_as_is_and_mixed_ones_are_converted():
    plain = np.array([b"a", b"bc", b""], dtype=object)
    assert normalize_keys(plain, "bytes") is plain  # no per-key copy, as for int64 arrays
    mixed = np.array([b"a", "bc", np.bytes_(b"d")], dtype=object)
    out = normalize_keys(mixed, "bytes")
    assert out is not mixed
    assert [type(k) for k in out] == [bytes, bytes, bytes]
    assert out.tolist() == [b"a", b"bc", b"d"]
    assert mixed[1] == "bc"  # the caller's array is left alone


@pytest.mark.parametrize("name", list(containers()))
def test_memory_store_round_trip_per_container(name):
    with embstore.open("memory://", dim=4, key_type="bytes") as store:
        vecs = np.arange(len(WORDS) * 4, dtype=np.float32).reshape(-1, 4)
        store.assign(ENCODED[:-1], vecs[:-1])
        got = store.lookup(containers()[name], insert=False)
        expect = {k: v for k, v in zip(ENCODED[:-1], vecs[:-1], strict=True)}
        for k, row in zip(ENCODED[:-1], got[:-1], strict=True):
            np.testing.assert_array_equal(row, expect[k])
        assert store.contains(containers()[name]).tolist() == [True] * 8 + [False]


def test_tf_string_tensor_keys():
    tf = pytest.importorskip("tensorflow")
    keys = normalize_keys(tf.constant(ENCODED), "bytes")
    assert keys.tolist() == ENCODED


def test_bad_keys_raise_clear_errors():
    with pytest.raises(KeyTypeError, match="int"):
        normalize_keys(["a", 3], "bytes")
    with pytest.raises(KeyTypeError, match="NoneType"):
        normalize_keys(["a", None], "bytes")
    with pytest.raises(InvalidInputError, match="flat"):
        normalize_keys([["a"], ["b"]], "bytes")
    with pytest.raises(KeyTypeError, match="float"):
        normalize_keys(np.array([1.5]), "bytes")
    pa = pytest.importorskip("pyarrow")
    with pytest.raises(KeyTypeError, match="NoneType"):
        normalize_keys(pa.array(["a", None]), "bytes")


def test_hash_is_xxh3_64_and_str_hashes_as_its_utf8():
    keys = np.array(list(XXH3_VECTORS), dtype=object)
    assert key_hash64(keys).tolist() == list(XXH3_VECTORS.values())
    assert hash64(["é"]).tolist() == hash64([b"\xc3\xa9"]).tolist()
    xxhash = pytest.importorskip("xxhash")
    many = [bytes([i % 251]) * (i % 300) + b"%d" % i for i in range(2000)]
    assert hash64(many).tolist() == [xxhash.xxh3_64_intdigest(k) for k in many]


def test_factorize_first_seen_order_and_inverse():
    uniq, inv = factorize(WORDS)
    assert uniq.tolist() == list(dict.fromkeys(ENCODED))
    assert uniq[inv].tolist() == ENCODED
    uniq, inv = factorize([])
    assert len(uniq) == 0 and len(inv) == 0


@pytest.mark.parametrize("repeat", ["few", "wide", None])
def test_factorize_by_object_then_content_matches_a_dict(repeat):
    # Long batches that repeat key objects are deduplicated by address first; equal keys held
    # by different objects (copies, str vs its UTF-8 bytes) must still be one key. "wide":
    # 18k objects drawn 40k times, whose repeats show only past the first few hundred (a
    # skip-gram step's batch).
    rng = np.random.default_rng(5)
    vocab = [b"w%d" % i for i in range({"few": 30, "wide": 6000, None: 300}[repeat])]
    copies = [bytes(bytearray(w)) for w in vocab]          # equal content, other objects
    texts = [w.decode() for w in vocab]
    pool = vocab + copies + texts
    picks = (rng.integers(0, len(pool), 5000 if repeat == "few" else 40000) if repeat
             else np.arange(len(pool)))
    keys = np.empty(len(picks), dtype=object)
    keys[:] = [pool[i] for i in picks]
    if not repeat:
        keys = np.concatenate([keys, np.array([b"x%d" % i for i in range(2000)], object)])
    first, inv = factorize_keys(keys)
    model: dict[bytes, int] = {}
    want_first, want_inv = [], []
    for i, k in enumerate(keys.tolist()):
        b = k.encode() if isinstance(k, str) else k
        if b not in model:
            model[b] = len(model)
            want_first.append(i)
        want_inv.append(model[b])
    assert first.tolist() == want_first and inv.tolist() == want_inv


def test_torch_factorize_handles_str_and_bytes_alike():
    pytest.importorskip("torch")
    from embstore_torch._keys import factorize as torch_factorize
    from embstore_torch._keys import prepare

    # the distinct keys come out in the store's key form (UTF-8 bytes), encoded once
    uniq, inv = torch_factorize(["a", b"a", "b", "a"])
    assert uniq.tolist() == [b"a", b"b"] and inv.tolist() == [0, 0, 1, 0]
    batch = prepare(np.array([["x", "y"], ["y", "x"]], dtype=np.dtypes.StringDType()))
    assert list(batch.uniq) == [b"x", b"y"] and batch.inv.tolist() == [[0, 1], [1, 0]]


TRICKY = [b"", b"\x00", b"\x00\x00", b"a\x00", b"a", b"ab", b"abcdefgh", b"abcdefgh\x00",
          b"abcdefghi", b"abcdefgh" * 1000, b"abcdefgh" * 1000 + b"x", b"\xff" * 8,
          b"\xff" * 9, "é".encode(), b"prefix-1", b"prefix-10", b"prefix-100"]


@pytest.mark.parametrize("bits", [64, 3, 1])
def test_table_is_collisionless_with_forced_fingerprint_collisions(bits):
    table, arena = BytesTable(16, fingerprint_bits=bits), RecordArena(8)
    keys = np.array(TRICKY, dtype=object)
    slots = np.empty(len(keys), np.uint32)
    assert find_or_insert(table, arena, keys, slots) == len(keys)
    assert len(set(slots.tolist())) == len(keys)
    again = np.empty(len(keys), np.uint32)
    assert table.find(keys, again) == len(keys)
    assert again.tolist() == slots.tolist()
    got_keys, got_slots = table.items()
    assert dict(zip(got_keys.tolist(), got_slots.tolist(), strict=True)) == \
        dict(zip(TRICKY, slots.tolist(), strict=True))
    missing = np.array([b"abcdefgh" * 999, b"\x00" * 3, b"b"], dtype=object)
    out = np.empty(3, np.uint32)
    assert table.find(missing, out) == 0 and (out == _EMPTY).all()


def test_short_keys_differing_in_any_one_byte_are_distinct():
    # Keys of up to 16 bytes are compared as two words loaded in registers (overlapping
    # loads for 4..7-byte tails): every length and every byte position must count.
    base = bytes(range(1, 25))
    keys = [base[:n] for n in range(25)]
    keys += [k[:i] + b"\xee" + k[i + 1:] for k in keys for i in range(len(k))]
    keys += [k + b"\x00" for k in keys[:25]]       # a trailing zero byte is a different key
    arr = np.empty(len(keys), dtype=object)
    arr[:] = keys
    assert len(set(keys)) == len(keys)
    table, arena = BytesTable(16, fingerprint_bits=1), RecordArena(8)
    slots = np.empty(len(keys), np.uint32)
    assert find_or_insert(table, arena, arr, slots) == len(keys)
    again = np.empty(len(keys), np.uint32)
    assert table.find(arr, again) == len(keys) and again.tolist() == slots.tolist()
    got_keys, got_slots = table.items()
    assert dict(zip(got_keys.tolist(), got_slots.tolist(), strict=True)) == \
        dict(zip(keys, slots.tolist(), strict=True))


def test_update_after_lookup_follows_a_key_array_refilled_in_place():
    # The memory store reuses the slots of the last looked-up batch for an update of the same
    # keys; a caller that refills its array in between must update the new keys' rows.
    with embstore.open("memory://", dim=2, key_type="bytes",
                       optimizer=embstore.optim.SGD(lr=1.0)) as store:
        store.assign([b"a", b"b", b"c", b"d"], np.zeros((4, 2), np.float32))
        keys = np.array([b"a", b"b"], dtype=object)
        store.lookup(keys)
        keys[0], keys[1] = b"c", b"d"
        store.update(keys, np.ones((2, 2), np.float32))
        got = store.lookup([b"a", b"b", b"c", b"d"], insert=False)
        assert got.tolist() == [[0, 0], [0, 0], [-1, -1], [-1, -1]]


def test_probe_fills_a_key_snapshot_that_tells_same_keys_from_others():
    # The memory store keeps the last looked-up keys as a snapshot the probe fills; it must
    # hold exactly those keys, whatever their length, and be replaced by a later probe.
    table, arena = BytesTable(16), RecordArena(8)
    keys = np.array(TRICKY, dtype=object)
    snap = KeySnapshot()
    assert len(snap) == 0 and snap.same(np.empty(0, dtype=object))
    slots = np.empty(len(keys), np.uint32)
    find_or_insert(table, arena, keys, slots, None, snap)
    assert len(snap) == len(keys) and snap.same(keys) and snap.same(list(TRICKY))
    refilled = keys.copy()
    refilled[3] = refilled[3] + b"!"
    assert not snap.same(refilled) and not snap.same(keys[:-1]) and not snap.same(keys[::-1].copy())
    table.find(keys[:4], slots, snap)
    assert len(snap) == 4 and snap.same(keys[:4]) and not snap.same(keys)
    assert KeySnapshot(keys).same(keys) and not KeySnapshot(keys[1:]).same(keys)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "del"]),
                          st.lists(st.binary(max_size=12), max_size=30)), max_size=25),
       st.sampled_from([2, 64]))
def test_table_matches_a_dict_under_inserts_and_erases(ops, bits):
    table, arena = BytesTable(16, fingerprint_bits=bits), RecordArena(8)
    model: dict[bytes, int] = {}
    for op, batch in ops:
        keys = np.empty(len(batch), dtype=object)
        keys[:] = batch
        out = np.empty(len(batch), np.uint32)
        if op == "put":
            find_or_insert(table, arena, keys, out)
            for k, s in zip(batch, out.tolist(), strict=True):
                assert model.setdefault(k, s) == s
        else:
            table.erase(keys, out)
            for k, s in zip(batch, out.tolist(), strict=True):
                assert model.pop(k, _EMPTY) == s
        assert len(table) == len(model)
    k, s = table.items()
    assert dict(zip(k.tolist(), s.tolist(), strict=True)) == model


def test_table_grows_and_keeps_every_key():
    table, arena = BytesTable(16), RecordArena(8)
    keys = np.array([b"key-%d" % i for i in range(50_000)], dtype=object)
    slots = np.empty(len(keys), np.uint32)
    find_or_insert(table, arena, keys, slots)
    assert table.rehashes >= 10 and len(table) == len(keys)
    removed = np.empty(25_000, np.uint32)
    assert table.erase(np.ascontiguousarray(keys[::2]), removed) == 25_000
    out = np.empty(len(keys), np.uint32)
    assert table.find(keys, out) == 25_000
    assert (out[1::2] == slots[1::2]).all() and (out[::2] == _EMPTY).all()


def test_tables_are_seeded_per_store():
    assert BytesTable(16).seed != BytesTable(16).seed
    with embstore.open("memory://", dim=2, key_type="bytes") as a, \
            embstore.open("memory://", dim=2, key_type="bytes") as b:
        a.lookup(["x"])
        b.lookup(["x"])
        assert a._backend._table.seed != b._backend._table.seed


def test_failed_grow_raises_capacity_error_and_leaves_table_unchanged():
    code = textwrap.dedent("""
        import resource, numpy as np
        from embstore._cython.arena import RecordArena
        from embstore._cython.bytestable import BytesTable, find_or_insert
        from embstore.errors import CapacityError
        t, a = BytesTable(16), RecordArena(8, prefault=False)
        keys = np.array([b"k%d" % i for i in range(300_000)], dtype=object)
        find_or_insert(t, a, keys[:190_000], np.empty(190_000, np.uint32))
        before = t.capacity
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))
        try:
            find_or_insert(t, a, keys[190_000:], np.empty(110_000, np.uint32))
        except CapacityError as e:
            assert "cannot grow" in str(e), e
        else:
            raise SystemExit("no CapacityError")
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
        assert t.capacity == before and len(t) == 190_000  # nothing of the batch stayed
        assert a.live == 190_000
        out = np.empty(len(keys), np.uint32)
        assert t.find(keys[:190_000], out) == 190_000
        print("ok", len(t))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


def test_sharded_bytes_set_placed_by_the_old_hash_is_refused(tmp_path):
    from embstore.layers.sharded import sharded_url
    from embstore.registry import backend_class

    urls = [f"lmdb://{tmp_path / f's{i}'}" for i in range(2)]
    with embstore.open("sharded://", shards=urls, dim=2, key_type="bytes") as store:
        store.assign(["a", "b", "c"], np.ones((3, 2), np.float32))
    for i, url in enumerate(urls):
        shard = backend_class(url)(url)
        meta = shard.read_meta()
        assert meta["sharding"] == {"count": 2, "index": i, "hash": "xxh3-64"}
        meta["sharding"] = {"count": 2, "index": i}  # as a blake2b-era embstore wrote it
        shard.write_meta(meta)
        shard.close()
    with pytest.raises(SchemaMismatchError, match="blake2b"):
        embstore.open(sharded_url(urls))


def test_sharded_routes_bytes_keys_by_the_fixed_hash():
    with embstore.open("sharded://", shards=["memory://"] * 3, dim=2, key_type="bytes") as s:
        keys = [b"k%d" % i for i in range(200)]
        s.assign(keys, np.ones((200, 2), np.float32))
        expect = (hash64(keys) % np.uint64(3)).astype(np.int64)
        for i, shard in enumerate(s._backend.shards):
            held: set = set()
            for batch_keys, _ in shard.scan():
                held.update(batch_keys.tolist())
            assert held == {k for k, e in zip(keys, expect, strict=True) if e == i}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=60), st.data())
def test_count_repeats_of_matches_isin_for_both_key_types(ids, data):
    from embstore.engine.batch import count_repeats_of
    marked = np.array(data.draw(st.lists(st.booleans(), min_size=len(ids),
                                         max_size=len(ids))), dtype=bool)
    ints = np.array(ids, dtype=np.int64)
    strs = np.empty(len(ids), dtype=object)
    strs[:] = [b"k%d" % i for i in ids]
    expected = int(np.isin(ints, ints[marked]).sum())
    assert count_repeats_of(ints, marked) == expected
    assert count_repeats_of(strs, marked) == expected


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_lookup_with_new_and_repeated_keys_counts_hits_and_misses(key_type):
    ids = np.arange(8000, dtype=np.int64)
    keys = ids if key_type == "int64" else np.array([b"w%d" % i for i in ids], dtype=object)
    with embstore.open("memory://", dim=4, key_type=key_type) as s:
        s.lookup(keys[:4000])
        before = s.stats()
        # half the batch new, every new key twice, old keys once
        batch = np.concatenate([keys[:2000], keys[4000:6000], keys[4000:6000]])
        s.lookup(batch)
        after = s.stats()
        assert after["hits"] - before["hits"] == 2000
        assert after["misses"] - before["misses"] == 4000
        assert after["inserts"] - before["inserts"] == 2000
        assert len(s) == 6000


@pytest.mark.parametrize("dups", ["none", "few", "many"])
def test_bytes_update_sums_duplicates_like_int64(dups):
    rng = np.random.default_rng(3)
    n = 512
    ids = {"none": rng.permutation(4096)[:n], "few": rng.integers(0, 4096, n),
           "many": rng.integers(0, 16, n)}[dups].astype(np.int64)
    strs = np.array([b"k%d" % i for i in ids.tolist()], dtype=object)
    g = rng.standard_normal((n, 8), dtype=np.float32)
    with embstore.open("memory://", dim=8, optimizer="sgd", initializer="zeros") as a, \
            embstore.open("memory://", dim=8, optimizer="sgd", initializer="zeros",
                          key_type="bytes") as b:
        a.update(ids, g)
        b.update(strs, g)
        u = np.unique(ids)
        np.testing.assert_array_equal(a.lookup(u, insert=False),
                                      b.lookup([b"k%d" % i for i in u.tolist()], insert=False))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=40), st.lists(st.integers(0, 30), max_size=40))
def test_keys_in_matches_isin_for_both_key_types(ids, among):
    from embstore._keys import keys_in

    def as_bytes(xs):
        out = np.empty(len(xs), dtype=object)
        out[:] = [b"k%d" % i for i in xs]
        return out

    expected = np.isin(np.array(ids, np.int64), np.array(among, np.int64))
    np.testing.assert_array_equal(keys_in(np.array(ids, np.int64), np.array(among, np.int64)),
                                  expected)
    np.testing.assert_array_equal(keys_in(as_bytes(ids), as_bytes(among)), expected)
