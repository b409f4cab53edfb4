"""Unknown options raise on every backend and layer, with a did-you-mean; nothing is created."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.backends.memory import MemoryBackend
from embstore.errors import InvalidInputError
from embstore.options import accepted_options


def test_misspelt_engine_option_raises_on_memory():
    # the case: this trained silently with SGD
    with pytest.raises(InvalidInputError, match=r"'optimzer' \(did you mean 'optimizer'\?\)"):
        embstore.open("memory://", dim=8, optimzer="adam")


@pytest.mark.parametrize("url_of", [
    lambda d: "memory://",
    lambda d: f"lmdb://{d}/l",
    lambda d: f"rocksdb://{d}/r",
    lambda d: f"sqlite:///{d}/s.db",
    lambda d: "sharded://?shard=memory://&shard=memory://",
])
def test_unknown_option_raises_everywhere_and_creates_nothing(tmp_path, url_of):
    url = url_of(tmp_path)
    with pytest.raises(InvalidInputError, match=r"'initialiser' \(did you mean 'initializer'"):
        embstore.open(url, dim=4, initialiser="zeros")
    with pytest.raises(InvalidInputError, match="unknown option.*'colour'"):
        embstore.open(url, dim=4, colour="red")
    assert list(tmp_path.iterdir()) == []


def test_postgres_url_checked_before_connecting_and_not_echoed():
    # no server listens there: the option check comes first, and the password stays out
    with pytest.raises(InvalidInputError, match="did you mean 'durable'") as e:
        embstore.open("postgresql+psycopg://u:secret@127.0.0.1:1/db", dim=4, durabel=False)
    assert "secret" not in str(e.value)


def test_layer_option_typo_suggests_the_layer_option():
    with pytest.raises(InvalidInputError, match="did you mean 'cache_capacity'"):
        embstore.open("memory://", dim=4, cache="memory://", cache_capcity=10)


def test_backend_option_of_another_backend_is_refused():
    with pytest.raises(InvalidInputError, match="'map_size'"):
        embstore.open("memory://", dim=4, map_size=1 << 20)


def test_backends_refuse_when_constructed_directly():
    with pytest.raises(InvalidInputError, match="did you mean 'prefault'"):
        MemoryBackend("memory://", prefaul=False)
    from embstore.backends.bigtable.backend import BigtableBackend

    with pytest.raises(InvalidInputError, match="did you mean 'inflight'"):
        BigtableBackend("bigtable://p/i/t", emulator_host="127.0.0.1:1", in_flight=2)


def test_accepted_options_are_declared_per_backend():
    assert accepted_options(MemoryBackend) == {"initial_capacity", "prefault", "hash_seed",
                                               "huge_pages"}
    from embstore.backends.lmdb import LmdbBackend

    assert {"map_size", "durable", "writemap"} <= accepted_options(LmdbBackend)


def test_third_party_backend_declares_its_options(tmp_path):
    class Plain(MemoryBackend):
        accepted_options = ("initial_capacity", "prefault", "colour")

        def __init__(self, url, *, read_only=False, colour="red", **options):
            super().__init__("memory://", read_only=read_only, **options)
            self.colour = colour

    embstore.register_backend("plain-test", Plain)
    with embstore.open("plain-test://", dim=4, colour="blue") as s:
        assert s.backend.colour == "blue"
        s.lookup(np.arange(3))
    with pytest.raises(InvalidInputError, match="did you mean 'colour'"):
        embstore.open("plain-test://", dim=4, color="blue")


def test_valid_options_still_work(tmp_path):
    with embstore.open(f"lmdb://{tmp_path}/ok", dim=4, durable=False, optimizer="adam",
                       map_size=1 << 24) as s:
        s.update([1, 2], np.ones((2, 4), np.float32))
        assert s.meta["optimizer"]["name"].lower() == "adam"
