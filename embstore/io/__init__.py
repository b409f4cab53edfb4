"""File codecs: the interchange formats (native, Parquet, npz, word2vec, TSV) and their limits.

The codecs know no store; import, export, copy and verify live in :mod:`embstore.transfer`.
Each codec is its own module (``embstore.io.native``, ``embstore.io.parquet``, ...) and
:mod:`embstore.io.formats` picks one by name or file; nothing is imported here, so
``import embstore`` stays light (pyarrow, for one, is imported only when a Parquet file is read
or written).
"""
