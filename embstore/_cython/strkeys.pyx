# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Bytes keys in compiled loops: UTF-8 encoding, the fixed 64-bit hash, batch factorization.

Keys reach this module as a 1-D object array, list or tuple of ``bytes``/``str``.
:c:func:`key_views` borrows a (pointer, length) view of every key under the GIL -- a ``str``
contributes its UTF-8 form, which CPython caches on the string, so ``"é"`` and
``"é".encode()`` are one key -- and the loops over the views (hashing, probing, comparing)
run without the GIL. The views stay valid while the container that holds the keys is alive.

The hash is XXH3-64 (xxHash 0.8, vendored in ``vendor/xxhash.h``): ~1-2 ns per short key,
against ~100 ns per key for a C blake2b (a 12-round compression per 128-byte block) or
~300 ns for ``hashlib.blake2b`` called from Python. Its values are fixed by the xxHash
specification, so every process and machine agrees (sharding depends on that).

Beyond numpy this module imports nothing; callers translate TypeError into their own errors.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_CheckExact
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from cpython.unicode cimport PyUnicode_Check
from libc.stdint cimport int64_t, uint8_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memset

import os

import numpy as np

cdef extern from "es_prefetch.h":
    void ES_PREFETCH(const void* p) nogil
cdef extern from "es_keyobj.h":
    const char* ES_BYTES_SHORT_END(PyObject* o) nogil

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL
    object PyUnicode_AsUTF8String(object s)
    PyObject** PySequence_Fast_ITEMS(object o)
    # (on a borrowed pointer, as the checks in strkeys.pxd)
    bint _is_plain_bytes "PyBytes_CheckExact"(PyObject* o) nogil

# factorize() only needs a hash no outsider can predict (its result does not depend on it):
# a per-process seed keeps crafted batches from piling onto one probe chain.
cdef uint64_t _FACTORIZE_SEED = int.from_bytes(os.urandom(8), "little")
cdef PyObject* _NO_ITEMS[1]
# factorize() dedupes by object address first when a batch is this long and a prefix of it
# (a quarter, at most _PROBE items) repeats objects (see factorize).
cdef enum:
    _BY_OBJECT_MIN = 1024
    _PROBE = 4096
# How many key objects ahead the loops over object arrays fetch: the objects lie scattered
# over the heap and a loop step takes a few ns. A miss took longer than 32 steps of
# all_plain_bytes on a busy machine: its 1M-key batches ran at 5.5 ns/key 32 ahead, 3.5 ns
# 96 to 128 ahead (the two lines of each object in flight at once, see es_keyobj.h).
cdef enum:
    OBJ_AHEAD = 128


cdef inline void _prefetch_key(PyObject* o) noexcept nogil:
    """Fetch the object ``o`` and the line holding its bytes when it is a bytes key of up to
    15 bytes (ES_BYTES_SHORT_END), from its address alone."""
    ES_PREFETCH(o)
    ES_PREFETCH(ES_BYTES_SHORT_END(o))


cdef PyObject** key_items(object keys, Py_ssize_t* n) except NULL:
    """The object pointers of a 1-D object ndarray, list or tuple (borrowed)."""
    if isinstance(keys, np.ndarray):
        if keys.dtype != object or keys.ndim != 1:
            raise TypeError(f"expected a 1-D object array, got {keys.dtype} {keys.shape}")
        if not keys.flags.c_contiguous:
            raise ValueError("expected a contiguous object array")
        n[0] = keys.shape[0]
        if n[0] == 0:
            return _NO_ITEMS
        return <PyObject**> <size_t> keys.__array_interface__["data"][0]
    if not isinstance(keys, (list, tuple)):
        raise TypeError(f"expected an object array, list or tuple, got {type(keys).__name__}")
    n[0] = len(keys)
    return PySequence_Fast_ITEMS(keys) if n[0] else _NO_ITEMS


cdef KeyView* key_views(object keys, Py_ssize_t* n_out) except NULL:
    """(pointer, length) of every key; the caller frees the array. bytes (and subclasses such
    as ``np.bytes_``) are viewed as they are, str as its cached UTF-8 encoding."""
    cdef Py_ssize_t n, i
    cdef PyObject** items = key_items(keys, &n)
    cdef KeyView* v = <KeyView*> malloc((n + 1) * sizeof(KeyView))
    cdef PyObject* p
    cdef object o
    if v == NULL:
        raise MemoryError("cannot allocate key views")
    try:
        for i in range(n):
            # The key objects lie scattered over the heap: fetch ahead, or each costs a miss.
            if i + OBJ_AHEAD < n:
                _prefetch_key(items[i + OBJ_AHEAD])
            p = items[i]
            if _is_bytes(p):
                v[i].p = _bytes_data(p)
                v[i].n = _bytes_size(p)
            else:
                o = <object> p
                if PyUnicode_Check(o):
                    v[i].p = PyUnicode_AsUTF8AndSize(o, &v[i].n)
                else:
                    raise TypeError(f"keys must be bytes or str, got {type(o).__name__}")
            # A long key's last bytes lie past the line fetched ahead: fetch them now, for
            # the hashing pass that follows, which otherwise waited on them.
            if v[i].n > 15:
                ES_PREFETCH(v[i].p + v[i].n - 1)
    except BaseException:
        free(v)
        raise
    n_out[0] = n
    return v


class NotPlainBytes(Exception):
    """A probe told ``plain_only`` met a key that is not exactly ``bytes`` (str, a bytes
    subclass or a wrong type) and changed nothing: the caller normalizes the batch (which
    encodes str, or refuses the wrong type) and asks again."""


def encode_keys(object keys):
    """A new 1-D object array of ``bytes``: bytes kept, ``str`` UTF-8 encoded, bytes
    subclasses, ``bytearray`` and ``memoryview`` copied into plain bytes.

    Raises TypeError naming the first key of any other type (ints, None, nested lists).
    """
    cdef Py_ssize_t n, i
    cdef PyObject** items = key_items(keys, &n)
    out = np.empty(n, dtype=object)
    if n == 0:
        return out
    cdef PyObject** dst = <PyObject**> <size_t> out.__array_interface__["data"][0]
    cdef object o, b
    for i in range(n):
        if i + OBJ_AHEAD < n:
            ES_PREFETCH(items[i + OBJ_AHEAD])   # scattered objects: fetch ahead
        o = <object> items[i]
        if PyBytes_CheckExact(o):
            b = o
        elif PyUnicode_Check(o):
            b = PyUnicode_AsUTF8String(o)
        elif PyBytes_Check(o):
            b = PyBytes_FromStringAndSize(PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o))
        elif isinstance(o, (bytearray, memoryview)):
            b = bytes(o)
        else:
            raise TypeError(f"keys must be bytes or str, got {type(o).__name__}")
        Py_INCREF(b)
        Py_DECREF(<object> dst[i])   # the None np.empty put there
        dst[i] = <PyObject*> b
    return out


def all_plain_bytes(object keys):
    """True when every item of a 1-D object array, list or tuple is exactly ``bytes``: such
    an array is already in the store's key form, so it needs no copy. Only reads the items
    (a copy would write each scattered object's reference count)."""
    cdef Py_ssize_t n, i
    cdef PyObject** items = key_items(keys, &n)
    for i in range(n):
        # This is the first walk over the key objects; the store's probe walks them next
        # and reads their bytes, which can lie on the line after the header: both lines
        # are fetched ahead, so neither walk waits for them.
        if i + OBJ_AHEAD < n:
            _prefetch_key(items[i + OBJ_AHEAD])
        if not _is_plain_bytes(items[i]):   # on the pointer: no reference count written
            return False
        if _bytes_size(items[i]) > 15:
            ES_PREFETCH(_bytes_data(items[i]) + _bytes_size(items[i]))   # a long key's end
    return True


def hash64(object keys, uint64_t seed=0):
    """XXH3-64 (with ``seed``) of every key, as a uint64 array."""
    cdef Py_ssize_t n, i
    cdef KeyView* v = key_views(keys, &n)
    out = np.empty(n, dtype=np.uint64)
    cdef uint64_t[::1] o = out
    with nogil:
        for i in range(n):
            o[i] = hash_view(v[i], seed)
    free(v)
    return out


ctypedef struct _Slot:
    uint64_t h
    int64_t id      # distinct key number, -1 when free


cdef _Slot* _new_table(Py_ssize_t n, uint64_t* mask) noexcept nogil:
    """An empty probing table for up to ``n`` keys, at most half full (NULL: no memory);
    ``mask[0]`` receives its size - 1."""
    cdef uint64_t cap = 16, j
    while cap < 2 * <uint64_t> n:
        cap *= 2
    mask[0] = cap - 1
    cdef _Slot* table = <_Slot*> malloc(cap * sizeof(_Slot))
    if table != NULL:
        for j in range(cap):
            table[j].id = -1
    return table


cdef inline uint64_t _probe(const _Slot* table, uint64_t mask, uint64_t h, KeyView key,
                            const KeyView* views, const int64_t* first) noexcept nogil:
    """The slot of ``key`` (hash ``h``): the one holding an equal key, else the free slot where
    it goes. A slot's key is ``views[id]``, or ``views[first[id]]`` where ``first`` is given."""
    cdef uint64_t j = h & mask
    cdef int64_t f
    while table[j].id >= 0:
        if table[j].h == h:
            f = table[j].id if first == NULL else first[table[j].id]
            if views[f].n == key.n and memcmp(views[f].p, key.p, <size_t> key.n) == 0:
                return j
        j = (j + 1) & mask
    return j


def prefixed(object keys, bytes prefix):
    """A list of ``prefix + key`` for every key (bytes or str), built in C: the form key-value
    drivers such as LMDB take (they need a list of bytes objects anyway)."""
    cdef Py_ssize_t n, i, m = len(prefix)
    cdef KeyView* v = key_views(keys, &n)
    cdef list out = [None] * n
    cdef object b
    cdef char* dst
    try:
        for i in range(n):
            b = PyBytes_FromStringAndSize(NULL, m + v[i].n)
            dst = PyBytes_AS_STRING(b)
            memcpy(dst, <const char*> prefix, <size_t> m)
            memcpy(dst + m, v[i].p, <size_t> v[i].n)
            out[i] = b
    finally:
        free(v)
    return out


def strip_prefix(object raw, Py_ssize_t m):
    """An object array of the ``bytes`` of every item (bytes-like: bytes, memoryview...)
    without its first ``m`` bytes: the inverse of :func:`prefixed`."""
    cdef Py_ssize_t n = len(raw), i
    out = np.empty(n, dtype=object)
    cdef object k
    cdef const unsigned char[::1] mv
    for i in range(n):
        k = raw[i]
        if PyBytes_Check(k):
            out[i] = PyBytes_FromStringAndSize(PyBytes_AS_STRING(k) + m,
                                               PyBytes_GET_SIZE(k) - m)
        else:
            out[i] = bytes(k[m:])
    return out


@cython.final
cdef class KeySnapshot:
    """A private copy of a batch of keys (their lengths and bytes, packed), to tell later
    whether another batch holds the same keys in the same order.

    It holds no references to the key objects: copying an object array instead writes the
    reference count of every scattered key object, twice with the release, which cost more
    than the bytes-table probe of the batch. Being a copy, it is not fooled by a caller that
    refills its key array in place.

    ``KeySnapshot()`` is empty; the bytes table's probe loops fill one key by key
    (:c:func:`snapshot_add`) as they probe it, while its bytes are in cache: a second walk
    over the scattered key objects cost 8% of a lookup, and a pass over the views after the
    probe, which had to fetch the keys' bytes again, 4 ns per key."""

    def __cinit__(self, object keys=None):
        cdef Py_ssize_t n
        cdef KeyView* v
        if keys is None:
            return
        v = key_views(keys, &n)
        try:
            self.fill(v, n)
        finally:
            free(v)

    cdef int reserve(self, Py_ssize_t n, Py_ssize_t nbytes) except -1:
        """Empty the snapshot, with room for ``n`` keys and ``nbytes`` bytes of them, a key
        of up to 16 bytes counting 16 (:c:func:`snapshot_add` grows it past that)."""
        free(self.lens)
        free(self.data)
        self.n = self.used = 0
        self.cap = nbytes
        self.lens = <Py_ssize_t*> malloc((n + 1) * sizeof(Py_ssize_t))
        self.data = <char*> malloc(nbytes + 16)
        if self.lens == NULL or self.data == NULL:
            self.cap = 0
            raise MemoryError("cannot allocate a key snapshot")
        return 0

    cdef int fill(self, KeyView* v, Py_ssize_t n) except -1:
        """Take the ``n`` keys of ``v`` (replacing any held before)."""
        cdef Py_ssize_t i, nbytes = 0
        for i in range(n):
            nbytes += max(v[i].n, <Py_ssize_t> 16)
        self.reserve(n, nbytes)
        with nogil:
            for i in range(n):
                snapshot_add(self, v[i])    # room made above: never fails
        return 0

    def __dealloc__(self):
        free(self.lens)
        free(self.data)

    def __len__(self):
        return self.n

    def same(self, object keys):
        """True when ``keys`` holds the snapshot's keys, byte for byte, in the same order."""
        cdef Py_ssize_t n, i, pos = 0
        key_items(keys, &n)
        if n != self.n:     # another batch, told without reading its keys
            return False
        cdef KeyView* v = key_views(keys, &n)
        cdef bint same = True
        if same:
            with nogil:
                for i in range(n):
                    if (v[i].n != self.lens[i]
                            or memcmp(v[i].p, self.data + pos, <size_t> v[i].n) != 0):
                        same = False
                        break
                    pos += v[i].n
        free(v)
        return same


def factorize(object keys):
    """``(first, inverse)``: the position of each distinct key's first occurrence, in order of
    first occurrence, and the distinct-key number of every element (both int64).

    ``keys[first]`` are the distinct keys in first-seen order; ``first[inverse]`` maps every
    element to the position of its first occurrence. str and its UTF-8 bytes are one key.

    Batches that repeat the same key *objects* (words gathered from one vocabulary array,
    sampled keys) are first deduplicated by object address, which reads no key object and
    hashes no bytes; only the distinct objects are then hashed and compared by content.
    """
    cdef Py_ssize_t n
    cdef PyObject** items = key_items(keys, &n)
    cdef int64_t[::1] oinv, cinv
    cdef Py_ssize_t i
    if n >= _BY_OBJECT_MIN and _objects_repeat(items, n):
        obj_first, obj_inv = _factorize_objects(items, n)
        first, inv = _factorize_content(_object_array(items, obj_first))
        oinv, cinv = obj_inv, inv
        with nogil:
            for i in range(n):      # in place: no second element-sized array
                oinv[i] = cinv[oinv[i]]
        return obj_first[first], obj_inv
    return _factorize_content(keys)


cdef bint _objects_repeat(PyObject** items, Py_ssize_t n) noexcept:
    """Whether the first quarter of the items (at most _PROBE) holds a tenth or more repeated
    objects. Repeats grow with the length read: a batch drawn from 11k words (a skip-gram
    step's contexts and negatives) repeats 3% of its first 256 objects, 20-30% of its first
    4096 and 76% of all 49k, where deduplicating by address first halves the work. The
    prefix costs ~5 ns an item; a batch whose objects are all distinct pays it on a quarter."""
    cdef uintptr_t seen[2 * _PROBE]
    cdef Py_ssize_t i, m = min(n // 4, <Py_ssize_t> _PROBE), distinct = 0
    cdef uintptr_t p
    cdef uint64_t j, mask = 1
    while mask < <uint64_t> (2 * m):  # at most half full, and only what is read is cleared
        mask *= 2
    mask -= 1
    memset(seen, 0, (mask + 1) * sizeof(uintptr_t))
    for i in range(m):
        p = <uintptr_t> items[i]
        j = _pointer_hash(p) & mask
        while seen[j] != 0 and seen[j] != p:
            j = (j + 1) & mask
        if seen[j] == 0:
            seen[j] = p
            distinct += 1
    return distinct * 10 <= m * 9


cdef inline uint64_t _pointer_hash(uintptr_t p) noexcept nogil:
    return (<uint64_t> p * 0x9E3779B97F4A7C15ULL) >> 17


ctypedef struct _ObjSlot:
    uintptr_t addr      # 0: free
    int64_t id


cdef _ObjSlot* _object_table(uint64_t cap) noexcept nogil:
    cdef _ObjSlot* t = <_ObjSlot*> malloc(cap * sizeof(_ObjSlot))
    cdef uint64_t j
    if t != NULL:
        for j in range(cap):
            t[j].addr = 0
    return t


cdef tuple _factorize_objects(PyObject** items, Py_ssize_t n):
    """``(first, inverse)`` of the items by object identity (int64 arrays). The table starts
    small and doubles at half load: sized for the distinct objects, not for ``n`` (a table
    for every element would be fresh memory to fault in on every call)."""
    cdef uint64_t cap = 4096, mask = cap - 1, j, k
    cdef _ObjSlot* table = _object_table(cap)
    cdef _ObjSlot* bigger
    if table == NULL:
        raise MemoryError("factorize: cannot allocate its object table")
    first_arr = np.empty(n, dtype=np.int64)
    inv_arr = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] first = first_arr
    cdef int64_t[::1] inv = inv_arr
    cdef Py_ssize_t i, nu = 0
    cdef uintptr_t p
    cdef bint failed = False
    with nogil:
        for i in range(n):
            p = <uintptr_t> items[i]
            j = _pointer_hash(p) & mask
            while table[j].addr != 0 and table[j].addr != p:
                j = (j + 1) & mask
            if table[j].addr == 0:
                table[j].addr = p
                table[j].id = nu
                first[nu] = i
                nu += 1
                if <uint64_t> nu * 2 > cap:     # half full: double, re-placing every object
                    bigger = _object_table(cap * 2)
                    if bigger == NULL:
                        failed = True
                        break
                    free(table)
                    table, cap = bigger, cap * 2
                    mask = cap - 1
                    for k in range(<uint64_t> nu):
                        p = <uintptr_t> items[first[k]]
                        j = _pointer_hash(p) & mask
                        while table[j].addr != 0:
                            j = (j + 1) & mask
                        table[j].addr = p
                        table[j].id = <int64_t> k
                    inv[i] = nu - 1
                    continue
            inv[i] = table[j].id
    free(table)
    if failed:
        raise MemoryError("factorize: cannot grow its object table")
    return first_arr[:nu], inv_arr


cdef object _object_array(PyObject** items, int64_t[::1] at):
    """A new object array of ``items[at]``."""
    cdef Py_ssize_t m = at.shape[0], i
    out = np.empty(m, dtype=object)
    cdef PyObject** dst = <PyObject**> <size_t> out.__array_interface__["data"][0]
    for i in range(m):
        Py_INCREF(<object> items[at[i]])
        Py_DECREF(<object> dst[i])   # the None np.empty put there
        dst[i] = items[at[i]]
    return out


cdef tuple _factorize_content(object keys):
    """:func:`factorize` by hashing and comparing every key's bytes."""
    cdef Py_ssize_t n, i, nu = 0
    cdef KeyView* v = key_views(keys, &n)
    cdef uint64_t mask, j, h
    cdef _Slot* table = _new_table(n, &mask)
    if table == NULL:
        free(v)
        raise MemoryError("factorize: cannot allocate its hash table")
    first_arr = np.empty(n, dtype=np.int64)
    inv_arr = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] first = first_arr
    cdef int64_t[::1] inv = inv_arr
    with nogil:
        for i in range(n):
            h = hash_view(v[i], _FACTORIZE_SEED)
            j = _probe(table, mask, h, v[i], v, &first[0])
            if table[j].id < 0:
                table[j].h = h
                table[j].id = nu
                first[nu] = i
                nu += 1
            inv[i] = table[j].id
    free(table)
    free(v)
    return first_arr[:nu], inv_arr


def isin(object keys, object among):
    """A bool array: whether each of ``keys`` equals some key of ``among`` (byte for byte; str
    as its UTF-8 form). One hash set of ``among``'s keys, then one probe per key: linear in
    both, where ``np.isin`` over object arrays compares every pair."""
    cdef Py_ssize_t n, m, i
    cdef KeyView* a = key_views(among, &m)
    cdef KeyView* v
    try:
        v = key_views(keys, &n)
    except BaseException:
        free(a)
        raise
    cdef uint64_t mask, j, h
    cdef _Slot* table = _new_table(m, &mask)
    if table == NULL:
        free(a)
        free(v)
        raise MemoryError("isin: cannot allocate its hash table")
    out_arr = np.zeros(n, dtype=np.bool_)
    cdef uint8_t[::1] out = out_arr.view(np.uint8)
    with nogil:
        for i in range(m):          # the set of among's keys (a repeated one is kept once)
            h = hash_view(a[i], _FACTORIZE_SEED)
            j = _probe(table, mask, h, a[i], a, NULL)
            if table[j].id < 0:
                table[j].h = h
                table[j].id = i
        for i in range(n):
            j = _probe(table, mask, hash_view(v[i], _FACTORIZE_SEED), v[i], a, NULL)
            out[i] = table[j].id >= 0
    free(table)
    free(a)
    free(v)
    return out_arr


def count_matching(object keys, const uint8_t[::1] marked):
    """How many of ``keys`` equal a key at some ``marked`` position (nonzero entries; those
    positions count themselves): every key hashed once, a set of the marked keys, then one
    probe per unmarked key -- linear in the batch."""
    cdef Py_ssize_t n, i, m = 0, count = 0
    cdef KeyView* v = key_views(keys, &n)
    if marked.shape[0] != n:
        free(v)
        raise ValueError(f"count_matching: {marked.shape[0]} marks for {n} keys")
    for i in range(n):
        m += marked[i] != 0
    cdef uint64_t mask, j
    cdef _Slot* table = _new_table(m, &mask)
    cdef uint64_t* hs = <uint64_t*> malloc((n + 1) * sizeof(uint64_t))
    if table == NULL or hs == NULL:
        free(table)
        free(hs)
        free(v)
        raise MemoryError("count_matching: cannot allocate its hash table")
    with nogil:
        for i in range(n):
            hs[i] = hash_view(v[i], _FACTORIZE_SEED)
        for i in range(n):          # the marked keys (a repeated one is kept once)
            if not marked[i]:
                continue
            count += 1
            j = _probe(table, mask, hs[i], v[i], v, NULL)
            if table[j].id < 0:
                table[j].h = hs[i]
                table[j].id = i
        if m:
            for i in range(n):
                if not marked[i] and table[_probe(table, mask, hs[i], v[i], v, NULL)].id >= 0:
                    count += 1
    free(table)
    free(hs)
    free(v)
    return count
