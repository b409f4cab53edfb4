"""Exports in parts: every backend's key ranges hold every row exactly once, the parts'
union equals a whole export, and a manifest with a missing, duplicated or damaged part is
refused before anything is written."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil

import numpy as np
import pytest

import embstore
from embstore.cli import main as cli
from embstore.errors import CapabilityError, CorruptFileError, InvalidInputError
from embstore.transfer import (
    export_file,
    finish_manifest,
    import_file,
    pending_parts,
    plan_parts,
    run_part,
    verify_file,
    verify_store,
)
from embstore.transfer.pipeline import NewStore

KINDS = ["memory", "lmdb", "rocksdb", "sqlite", "postgres", "bigtable"]


def _keys(key_type: str, n: int, seed: int = 0) -> np.ndarray | list[bytes]:
    rng = np.random.default_rng(seed)
    if key_type == "int64":
        # the extremes and zero too: the ordered encodings must cut them like any key
        keys = np.unique(np.concatenate([rng.integers(-2**63, 2**63 - 1, n - 3, dtype=np.int64),
                                         [-2**63, 0, 2**63 - 1]]))
        return keys
    return [b"", b"\x00", b"\xff" * 3] + [f"user:{i}".encode() for i in
                                          rng.permutation(n - 3).tolist()]


def _fill(url: str, key_type: str, n: int) -> embstore.EmbeddingStore:
    store = embstore.open(url, dim=8, key_type=key_type, optimizer="adagrad")
    keys = _keys(key_type, n)
    vals = np.random.default_rng(1).standard_normal((len(keys), 8)).astype(np.float32)
    store.assign(keys, vals)
    store.flush()
    return store


def _as_list(keys: np.ndarray) -> list:
    return keys.tolist() if keys.dtype == np.int64 else list(keys)


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_row_is_in_exactly_one_part_and_the_union_is_the_whole_export(
        kind, key_type, new_store_url, tmp_path):
    n_rows = 300 if kind == "bigtable" else 2000
    store = _fill(new_store_url(kind), key_type, n_rows)
    try:
        everything = sorted(k for ks, _ in store.records(512) for k in _as_list(ks))
        whole = tmp_path / "whole.emb"
        export_file(store, whole)
        for n in (1, 3, 8):
            parts = pickle.loads(pickle.dumps(plan_parts(store, n)))
            assert [p.index for p in parts] == list(range(n))
            seen = []
            for p in parts:
                for ks, recs in store.backend.scan_range(p.range, 97):
                    assert len(ks) == len(recs)
                    seen += _as_list(ks)
            assert sorted(seen) == everything, f"{n} parts"
            if kind not in ("memory", "bigtable"):  # by hash / by sampled bytes: roughly
                sizes = [sum(len(k) for k, _ in store.backend.scan_range(p.range)) for p in parts]
                assert max(sizes) - min(sizes) <= 1, sizes

        out = tmp_path / "parts"
        parts = plan_parts(store, 3)
        # a memory:// store's parts run here, handed the store; the others reopen their URL
        given = store if kind == "memory" else None
        results = [run_part(p, out, fmt="parquet", store=given) for p in parts]
        assert sum(r.rows for r in results) == len(everything)
        man = verify_file(out / "manifest.json")
        assert man.ok, man.problems
        assert man.rows == len(everything)
        assert man.digest == verify_file(whole).digest == verify_store(store).digest
        # and the parts' own digests add up to the store's
        total = sum(verify_store(store, part=p).digest for p in parts) % (1 << 64)
        assert total == verify_store(store).digest
    finally:
        store.close()


def test_bigtable_plans_from_its_row_key_samples_without_reading_rows(new_store_url):
    with embstore.open(new_store_url("bigtable"), dim=8) as store:
        keys = np.random.default_rng(3).integers(-2**62, 2**62, 6000)
        store.assign(keys, np.ones((6000, 8), np.float32))
        before = store.backend.counters["rows_read"]
        parts = plan_parts(store, 4)
        assert store.backend.counters["rows_read"] == before  # SampleRowKeys only
        sizes = [sum(len(k) for k, _ in store.backend.scan_range(p.range)) for p in parts]
        assert sum(sizes) == len(np.unique(keys))
        # sample offsets are approximate (on the emulator as on Bigtable): roughly even
        assert max(sizes) < 2 * min(sizes), sizes


@pytest.mark.parametrize("kind", ["memory", "lmdb", "sqlite", "bigtable"])
def test_more_parts_than_rows_and_an_empty_store(kind, new_store_url, tmp_path):
    for rows in (0, 3):
        store = embstore.open(new_store_url(kind), dim=4)
        try:
            if rows:
                store.assign(np.array([5, -7, 9]), np.ones((3, 4), np.float32))
            parts = plan_parts(store, 5)
            assert len(parts) == 5
            out = tmp_path / f"out-{kind}{rows}"
            given = store if kind == "memory" else None
            assert sum(run_part(p, out, store=given).rows for p in parts) == rows
            rep = verify_file(out / "manifest.json")
            assert rep.ok and rep.rows == rows
        finally:
            store.close()


def test_a_manifest_round_trips_through_import_with_whole_records(tmp_path):
    src = _fill(f"lmdb://{tmp_path}/src", "int64", 1500)
    src.update(np.asarray(_keys("int64", 1500)[:10]), np.ones((10, 8), np.float32))
    src.close()
    parts = plan_parts(f"lmdb://{tmp_path}/src", 4)
    for p in reversed(parts):  # any order
        run_part(p, tmp_path / "out")
    rep = import_file(NewStore(f"lmdb://{tmp_path}/dst", {"dim": 8, "optimizer": "adagrad"}),
                      tmp_path / "out" / "manifest.json")
    assert rep.mode == "records" and rep.rows == 1500
    with embstore.open(f"lmdb://{tmp_path}/src", read_only=True) as a, rep.store as b:
        ka = np.sort(np.concatenate([k for k, _ in a.records()]))
        ra = a.backend.get(ka)[0]
        assert np.array_equal(ra, b.backend.get(ka)[0])  # slots and stamps too


@pytest.fixture
def exported(tmp_path):
    url = f"lmdb://{tmp_path}/src"
    _fill(url, "int64", 900).close()
    out = tmp_path / "out"
    for p in plan_parts(url, 3):
        run_part(p, out)
    target = embstore.open(f"lmdb://{tmp_path}/target", dim=8, optimizer="adagrad")
    target.assign(np.array([1, 2, 3]), np.ones((3, 8), np.float32))
    target.close()
    return out, f"lmdb://{tmp_path}/target"


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


def _rewrite(out, doc):
    (out / "manifest.json").write_text(json.dumps(doc))


def _refused(out, target, match):
    with pytest.raises(CorruptFileError, match=match):
        verify_file(out / "manifest.json")
    with embstore.open(target) as store, pytest.raises(CorruptFileError, match=match):
        import_file(store, out / "manifest.json")
    with embstore.open(target, read_only=True) as store:  # untouched
        assert len(store) == 3
    new = NewStore(f"{target}-new", {"dim": 8})
    with pytest.raises(CorruptFileError, match=match):
        import_file(new, out / "manifest.json")
    assert not os.path.exists(f"{target}-new".removeprefix("lmdb://"))  # never created


def test_a_missing_part_file_is_refused(exported):
    out, target = exported
    os.unlink(out / "part-00002-of-00003.emb")
    _refused(out, target, "part 1 .*missing")


def test_a_part_missing_from_the_manifest_is_refused(exported):
    out, target = exported
    doc = _manifest(out)
    del doc["files"][2]
    _rewrite(out, doc)
    _refused(out, target, r"parts \[2\] of 3 are missing")


def test_a_duplicated_part_is_refused(exported):
    out, target = exported
    doc = _manifest(out)
    doc["files"][2] = dict(doc["files"][1])
    _rewrite(out, doc)
    _refused(out, target, "part 1 is listed twice")
    doc["files"][2]["index"] = 2  # the same file as two parts
    _rewrite(out, doc)
    _refused(out, target, "listed as two parts")


def test_a_corrupt_or_replaced_part_is_refused(exported):
    out, target = exported
    path = out / "part-00003-of-00003.emb"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    _refused(out, target, "part 2 .*checksum")
    shutil.copy(out / "part-00001-of-00003.emb", path)  # another part under its name
    _refused(out, target, "part 2 .*checksum")


def test_parts_carry_xxh3_and_manifests_with_sha256_still_import(exported):
    # manifests written before XXH3-128 carry SHA-256: they are checked against it, and an
    # entry with no checksum at all is refused
    out, target = exported
    doc = _manifest(out)
    assert all(len(e["xxh3_128"]) == 32 and "sha256" not in e for e in doc["files"])
    for e in doc["files"]:
        del e["xxh3_128"]
        e["sha256"] = hashlib.sha256((out / e["file"]).read_bytes()).hexdigest()
    _rewrite(out, doc)
    assert verify_file(out / "manifest.json").ok
    doc["files"][1]["sha256"] = "0" * 64
    _rewrite(out, doc)
    _refused(out, target, "part 1 .*checksum")
    del doc["files"][1]["sha256"]
    _rewrite(out, doc)
    _refused(out, target, "part 1 .*checksum")


def test_xxh3_is_the_reference_xxh3_128():
    from embstore._cython.digest import Xxh3

    vectors = {b"": "99aa06d3014798d86001c324468d497f",
               b"a": "a96faf705af16834e6c632b61e964e1f",
               b"embstore": "1f663fab81da144563309a1dfd93ffd0",
               bytes(range(256)) * 5: "d92ab3a1cb0542a74844b009e164352e"}
    for data, want in vectors.items():
        whole, pieces = Xxh3(), Xxh3()
        whole.update(data)
        for i in range(0, len(data), 97):  # streamed in uneven blocks: the same value
            pieces.update(data[i:i + 97])
        assert whole.hexdigest() == pieces.hexdigest() == want


def test_parts_of_different_plans_do_not_chain(exported, tmp_path):
    out, target = exported
    doc = _manifest(out)
    doc["files"][1]["range"]["lo"] = doc["files"][0]["range"]["lo"]  # overlaps part 0
    _rewrite(out, doc)
    _refused(out, target, "do not chain")


def test_finish_manifest_and_pending_parts_after_a_store_changed(tmp_path):
    url = f"lmdb://{tmp_path}/src"
    _fill(url, "int64", 600).close()
    out = tmp_path / "out"
    parts = plan_parts(url, 3)
    run_part(parts[0], out)
    assert [p.index for p in pending_parts(parts, out)] == [1, 2]
    with pytest.raises(CorruptFileError, match=r"parts \[2, 3\] of 3"):
        finish_manifest(out, 3)
    assert not (out / "manifest.json").exists()
    with embstore.open(url) as store:  # the store changes: a new plan cuts elsewhere
        store.assign(np.arange(5000, 5600), np.zeros((600, 8), np.float32))
    later = plan_parts(url, 3)
    assert later[1].plan != parts[1].plan
    run_part(later[1], out)
    with pytest.warns(UserWarning, match="no manifest: .*different plans"):
        run_part(later[2], out)
    with pytest.raises(CorruptFileError, match="different plans"):
        finish_manifest(out, 3)
    assert [p.index for p in pending_parts(later, out)] == [0]
    run_part(later[0], out)
    assert verify_file(out / "manifest.json").rows == 1200


def test_memory_parts_need_the_open_store_and_a_cache_has_no_ranges(tmp_path):
    with embstore.open("memory://", dim=4) as store:
        store.assign(np.arange(10), np.ones((10, 4), np.float32))
        parts = plan_parts(store, 2)
        with pytest.raises(InvalidInputError, match="run_part"):
            run_part(parts[0], tmp_path / "m")
    with embstore.open(f"lmdb://{tmp_path}/remote", dim=4) as remote:
        remote.assign(np.arange(10), np.ones((10, 4), np.float32))
    with embstore.open(f"lmdb://{tmp_path}/remote", cache="memory://", dim=4) as cached:
        assert not cached.backend.supports_ranges
        with pytest.raises(CapabilityError, match="cannot be split"):
            plan_parts(cached, 2)


def test_a_part_is_never_written_into_the_source_store(tmp_path):
    url = f"lmdb://{tmp_path}/src"
    _fill(url, "int64", 50).close()
    with pytest.raises(InvalidInputError, match="inside the storage"):
        run_part(plan_parts(url, 2)[0], tmp_path / "src" / "parts")
    assert not (tmp_path / "src" / "parts").exists()


def test_cli_part_export_copy_verify_and_manifest_import(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/s.db"
    _fill(url, "bytes", 700).close()
    out = tmp_path / "out"
    assert cli(["export", url, str(out), "--part", "2/2", "-f", "parquet", "-q"]) == 0
    assert not (out / "manifest.json").exists()
    assert cli(["export", url, str(out), "--part", "1/2", "-f", "parquet"]) == 0
    assert "all parts done" in capsys.readouterr().err
    assert cli(["verify", url, "-q"]) == 0
    whole = capsys.readouterr().out.split("digest ")[1].strip()
    assert cli(["verify", str(out / "manifest.json"), "-q"]) == 0
    assert capsys.readouterr().out.split("digest ")[1].strip() == whole
    assert cli(["import", str(out / "manifest.json"), f"lmdb://{tmp_path}/imp", "-q"]) == 0
    assert cli(["verify", f"lmdb://{tmp_path}/imp", "-q"]) == 0
    assert capsys.readouterr().out.split("digest ")[1].strip() == whole
    digests = []
    for i in (1, 2):
        assert cli(["copy", url, f"lmdb://{tmp_path}/c", "--part", f"{i}/2", "-q"]) == 0
        assert cli(["verify", url, "--part", f"{i}/2", "-q"]) == 0
        digests.append(int(capsys.readouterr().out.split("digest ")[1], 16))
    assert cli(["verify", f"lmdb://{tmp_path}/c", "-q"]) == 0
    assert capsys.readouterr().out.split("digest ")[1].strip() == whole
    assert f"{sum(digests) % (1 << 64):016x}" == whole
    for bad in ("3/2", "0/2", "x", "1/0"):
        assert cli(["export", url, str(tmp_path / "bad"), "--part", bad, "-q"]) == 1
        assert "--part must look like I/N" in capsys.readouterr().err
    assert cli(["export", url, str(tmp_path / "bad"), "--part", "1/2", "--since", "0"]) == 1
