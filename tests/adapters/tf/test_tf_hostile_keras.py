"""Hostile and damaged ``.keras`` files: a generated corpus of bad archives, configs, store
entries and rows. Each must raise ``CorruptFileError`` in one line from
``embstore_tf.load_model``, create no store anywhere and leave existing stores untouched."""

from __future__ import annotations

import io
import json
import os
import socket
import zipfile

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import embstore  # noqa: E402
from embstore.errors import CorruptFileError, InvalidInputError  # noqa: E402
from embstore_tf import DynamicEmbedding, load_model  # noqa: E402

DIM = 4


def _save(store, path):
    inp = keras.Input(shape=(3,), dtype="int64")
    model = keras.Model(inp, keras.ops.sum(DynamicEmbedding(store, name="emb")(inp), axis=1))
    store.lookup([1, 2, 3])
    model.save(path)
    return path


def _members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def _write(path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def _layer_config(cfg) -> dict:
    """The DynamicEmbedding entry of a saved functional model's config."""
    for layer in cfg["config"]["layers"]:
        if layer["class_name"] == "DynamicEmbedding":
            return layer["config"]
    raise AssertionError("no DynamicEmbedding in the config")


def _edit_config(src, dst, edit) -> None:
    members = _members(src)
    cfg = json.loads(members["config.json"])
    edit(_layer_config(cfg))
    members["config.json"] = json.dumps(cfg).encode()
    _write(dst, members)


def _flip_rows(src, dst) -> None:
    h5py = pytest.importorskip("h5py")
    members = _members(src)
    buf = io.BytesIO(members["model.weights.h5"])
    with h5py.File(buf, "r+") as f:
        found = []
        f.visititems(lambda n, o: found.append(n) if n.endswith("embstore_native") else None)
        data = f[found[0]][()]
        data[len(data) // 2] ^= 0x55
        del f[found[0]]
        f[found[0]] = data
    members["model.weights.h5"] = buf.getvalue()
    _write(dst, members)


def _spec_edit(**changes):
    def edit(layer_cfg):
        layer_cfg["store"].update(changes)
    return edit


def _option_edit(**options):
    def edit(layer_cfg):
        layer_cfg["store"].setdefault("options", {}).update(options)
    return edit


@pytest.fixture(scope="module")
def memory_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("keras_ok")
    return _save(embstore.open("memory://", dim=DIM), d / "mem.keras")


@pytest.fixture
def evil_dir(tmp_path):
    return tmp_path / "evil"


def _cases(evil: str) -> dict:
    """name -> (builder(src, dst) for a memory-store file, words the message must hold)."""
    return {
        "not_a_zip": (lambda s, d: d.write_bytes(b"\x89HDF not a keras file" * 10), "archive"),
        "truncated": (lambda s, d: d.write_bytes(s.read_bytes()[:200]), "archive"),
        "config_not_json": (lambda s, d: _write(d, {**_members(s), "config.json": b"{oops"}),
                            "loadable"),
        "rebuilt_elsewhere": (lambda s, d: _edit_config(
            s, d, _spec_edit(url=f"lmdb://{evil}/a")), "memory://"),
        "huge_dim": (lambda s, d: _edit_config(s, d, _spec_edit(dim=1 << 40)), "dim"),
        "bad_key_type": (lambda s, d: _edit_config(s, d, _spec_edit(key_type="float")),
                         "key_type"),
        "huge_capacity": (lambda s, d: _edit_config(
            s, d, _option_edit(initial_capacity=1 << 40)), "out of bounds"),
        "huge_capacity_in_url": (lambda s, d: _edit_config(
            s, d, _spec_edit(url="memory://?initial_capacity=4000000000")), "out of bounds"),
        "capacity_in_url_above_the_file_bound": (lambda s, d: _edit_config(
            s, d, _spec_edit(url=f"memory://?initial_capacity={(1 << 24) + 1}")),
            "out of bounds"),
        "cache_elsewhere": (lambda s, d: _edit_config(
            s, d, _option_edit(cache=f"lmdb://{evil}/c")), "location"),
        "reserved_option": (lambda s, d: _edit_config(s, d, _option_edit(read_only=False)),
                            "reopen option"),
        "nested_option": (lambda s, d: _edit_config(s, d, _option_edit(x={"a": 1})),
                          "only strings"),
        "store_not_a_mapping": (lambda s, d: _edit_config(
            s, d, lambda c: c.__setitem__("store", [1, 2])), "mapping"),
        "no_url": (lambda s, d: _edit_config(s, d, _spec_edit(url=7)), "URL"),
        "bad_padding_key": (lambda s, d: _edit_config(
            s, d, lambda c: c.__setitem__("padding_key", {"hex": "zz"})), "padding_key"),
        "bad_optimizer": (lambda s, d: _edit_config(
            s, d, _spec_edit(optimizer={"name": "nope"})), "memory://"),
        "damaged_rows": (_flip_rows, "checksum"),
    }


CASES = sorted(_cases("x"))


@pytest.mark.parametrize("case", CASES)
def test_hostile_memory_store_files(case, memory_file, tmp_path, evil_dir):
    build, words = _cases(str(evil_dir))[case]
    path = tmp_path / f"{case}.keras"
    build(memory_file, path)
    with pytest.raises(CorruptFileError) as err:
        load_model(path)
    msg = str(err.value)
    assert "\n" not in msg and words in msg, msg
    assert not evil_dir.exists()  # no store created where the file said


def test_a_zip_bomb_is_refused_before_it_is_inflated(memory_file, tmp_path):
    members = _members(memory_file)
    path = tmp_path / "bomb.keras"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        with zf.open("assets/zeros.bin", "w") as out:
            block = bytes(1 << 20)
            for _ in range(80):  # 80 MiB of zeros, stored in well under 1 MiB
                out.write(block)
    with pytest.raises(CorruptFileError, match="decodes to"):
        load_model(path)


def test_a_file_never_creates_a_persistent_store(tmp_path, evil_dir):
    url = f"lmdb://{tmp_path}/real"
    store = embstore.open(url, dim=DIM, durable=False)
    src = _save(store, tmp_path / "lmdb.keras")
    store.close()
    path = tmp_path / "moved.keras"
    _edit_config(src, path, _spec_edit(url=f"lmdb://{evil_dir}/new"))
    for writable in (False, True):
        with pytest.raises(CorruptFileError, match="no store_dir") as err:
            load_model(path, writable=writable)
        assert "\n" not in str(err.value)
        # inside the store_dir the user allowed, the store is still only ever reopened
        with pytest.raises(CorruptFileError, match="never creates") as err:
            load_model(path, writable=writable, store_dir=tmp_path)
        assert "\n" not in str(err.value)
    assert not evil_dir.exists()
    # a store the user passes is used as is: nothing is created either
    mine = embstore.open("memory://", dim=DIM)
    loaded = load_model(path, stores={"emb": mine})
    assert loaded.get_layer("emb").store is mine and not evil_dir.exists()


def test_rows_in_a_file_never_overwrite_a_persistent_store(memory_file, tmp_path):
    url = f"lmdb://{tmp_path}/kept"
    with embstore.open(url, dim=DIM, durable=False) as s:
        s.assign([5, 6], np.ones((2, DIM), np.float32))
        before = {k: r.tobytes() for ks, rs in s.records() for k, r in zip(ks.tolist(), rs)}
    path = tmp_path / "redirected.keras"
    _edit_config(memory_file, path, _spec_edit(url=url, persistent=True))
    with pytest.raises(CorruptFileError, match="persistent") as err:
        load_model(path, writable=True, store_dir=tmp_path)
    assert "\n" not in str(err.value)
    with embstore.open(url, read_only=True) as s:
        after = {k: r.tobytes() for ks, rs in s.records() for k, r in zip(ks.tolist(), rs)}
    assert after == before


def test_a_url_in_stores_never_replaces_a_memory_store_from_the_file(memory_file, tmp_path):
    with pytest.raises(InvalidInputError, match="memory://"):
        load_model(memory_file, stores={"emb": f"lmdb://{tmp_path}/x"})
    assert not (tmp_path / "x").exists()


def test_the_valid_files_still_load(memory_file, tmp_path):
    loaded = load_model(memory_file)
    assert len(loaded.get_layer("emb").store) == 3


# -- a file cannot choose which persistent store a load opens ----------------------------------

@pytest.fixture
def lmdb_file(tmp_path):
    """A model saved over an LMDB store in ``tmp_path/allowed/st``: (file, allowed dir)."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    with embstore.open(f"lmdb://{allowed}/st", dim=DIM, durable=False) as store:
        path = _save(store, tmp_path / "lmdb.keras")
    return path, allowed


def _tree(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.fixture
def outside_store(tmp_path):
    """A real LMDB store outside the allowed directory, with its files as they are."""
    url = f"lmdb://{tmp_path}/outside/st"
    with embstore.open(url, dim=DIM, durable=False) as s:
        s.assign([5, 6], np.ones((2, DIM), np.float32))
    return url, tmp_path / "outside" / "st"


@pytest.mark.parametrize("writable", [False, True])
def test_a_store_outside_store_dir_is_never_opened(lmdb_file, outside_store, tmp_path,
                                                   writable):
    src, allowed = lmdb_file
    url, where = outside_store
    (allowed / "link").symlink_to(tmp_path / "outside", target_is_directory=True)
    before = _tree(where)
    redirects = {
        "outside": (url, "outside store_dir"),
        "dotdot": (f"lmdb://{allowed}/../outside/st", "'..'"),
        "symlink": (f"lmdb://{allowed}/link/st", "resolves to"),
        "rocksdb_outside": (f"rocksdb://{tmp_path}/outside/st", "outside store_dir"),
        "sqlite_outside": (f"sqlite:///{tmp_path}/outside/s.db?table=t", "outside store_dir"),
        "sqlite_dotdot": (f"sqlite:///{allowed}/../outside/s.db", "'..'"),
        "sqlite_uri": (f"sqlite:///{allowed}/s.db?uri=true", "only table="),
        "relative_sqlite": ("sqlite:///outside/s.db", "outside store_dir"),
    }
    for name, (evil_url, words) in redirects.items():
        path = tmp_path / f"{name}.keras"
        _edit_config(src, path, _spec_edit(url=evil_url))
        with pytest.raises(CorruptFileError) as err:
            load_model(path, writable=writable, store_dir=allowed)
        msg = str(err.value)
        assert "\n" not in msg and words in msg and "stores=" in msg, (name, msg)
    assert _tree(where) == before  # not opened: not even a lock file was touched
    assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == ["st"]
    # the user's own say still works: the same URL passed in stores=
    path = tmp_path / "outside.keras"
    loaded = load_model(path, stores={url: url})
    assert len(loaded.get_layer("emb").store) == 2
    loaded.get_layer("emb").store.close()


def test_a_network_store_named_by_a_file_is_refused_before_connecting(lmdb_file, tmp_path):
    src, allowed = lmdb_file
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        for name, evil_url in {
            "postgres": f"postgresql+psycopg://evil@127.0.0.1:{port}/db?table=t",
            "postgres_alias": f"postgres://127.0.0.1:{port}/db",
            "bigtable": "bigtable://evil-project/instance/table",
            "sharded": "sharded://?shard=lmdb%3A%2F%2F%2Ftmp%2Fx",
            "memory_as_persistent": "memory://",
            "custom_scheme": f"http://127.0.0.1:{port}/x",
        }.items():
            path = tmp_path / f"{name}.keras"
            _edit_config(src, path, _spec_edit(url=evil_url))
            for kwargs in ({}, {"store_dir": allowed}, {"store_dir": allowed,
                                                         "writable": True}):
                with pytest.raises(CorruptFileError) as err:
                    load_model(path, **kwargs)
                msg = str(err.value)
                assert "\n" not in msg and "stores=" in msg and "store_dir=" in msg, msg
                assert "evil@" in msg or "://" in msg
        with pytest.raises(BlockingIOError):
            listener.accept()  # no load ever connected
    finally:
        listener.close()


def test_store_dir_loads_the_saved_lmdb_model(lmdb_file):
    src, allowed = lmdb_file
    for writable in (False, True):
        loaded = load_model(src, store_dir=allowed, writable=writable)
        store = loaded.get_layer("emb").store
        assert store.read_only is not writable and len(store) == 3
        store.close()
