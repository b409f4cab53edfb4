"""An int64 store survives every export format's round trip as an int64 store.

TSV and word2vec files cannot say their key type: a new store made from such a file gets int64
keys when the file's keys are integers as an int64 store writes them, else bytes keys.
"""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.cli import main

FORMATS = ["native", "npz", "parquet", "tsv", "word2vec", "word2vec-binary"]
KEYS = np.array([-5, 0, 7, 2**62, -(2**63)], dtype=np.int64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_int64_keys_come_back_as_int64(tmp_path, fmt, capsys):
    vecs = np.arange(len(KEYS) * 3, dtype=np.float32).reshape(-1, 3)
    with embstore.open(f"lmdb://{tmp_path}/src", dim=3) as s:
        s.assign(KEYS, vecs)
    dest = tmp_path / "out.file"
    assert main(["export", f"lmdb://{tmp_path}/src", str(dest), "--format", fmt, "-q"]) == 0
    assert main(["import", str(dest), f"lmdb://{tmp_path}/dst", "--format", fmt]) == 0
    with embstore.open(f"lmdb://{tmp_path}/dst", read_only=True) as d:
        assert d.key_type == "int64"
        np.testing.assert_array_equal(d.lookup(KEYS, insert=False), vecs)
    if fmt in ("tsv", "word2vec", "word2vec-binary"):
        assert "keys are integers" in capsys.readouterr().err   # said, not silent


@pytest.mark.parametrize("fmt", ["tsv", "word2vec"])
def test_text_keys_that_only_look_numeric_stay_bytes(tmp_path, fmt):
    keys = [b"12", b"007", b"+3"]    # not as an int64 export writes numbers: text
    with embstore.open(f"lmdb://{tmp_path}/src", dim=2, key_type="bytes") as s:
        s.assign(keys, np.ones((3, 2), np.float32))
    dest = tmp_path / "out.file"
    assert main(["export", f"lmdb://{tmp_path}/src", str(dest), "--format", fmt, "-q"]) == 0
    assert main(["import", str(dest), f"lmdb://{tmp_path}/dst", "--format", fmt, "-q"]) == 0
    with embstore.open(f"lmdb://{tmp_path}/dst", read_only=True) as d:
        assert d.key_type == "bytes" and d.contains(keys).all()


def test_key_type_option_overrides_the_inference(tmp_path):
    with embstore.open(f"lmdb://{tmp_path}/src", dim=2) as s:
        s.assign([1, 2], np.ones((2, 2), np.float32))
    dest = tmp_path / "v.tsv"
    assert main(["export", f"lmdb://{tmp_path}/src", str(dest), "-q"]) == 0
    assert main(["import", str(dest), f"lmdb://{tmp_path}/dst", "--key-type", "bytes",
                 "-q"]) == 0
    with embstore.open(f"lmdb://{tmp_path}/dst", read_only=True) as d:
        assert d.key_type == "bytes" and d.contains([b"1", b"2"]).all()
