"""The DynamicEmbedding Service: one table served by DynamicEmbedding Workers (DEWs) that many
jobs and frameworks share.

- ``embstore serve URL --listen HOST:PORT [--shard I/N]`` runs a worker
  (:mod:`embstore.service.run`, :class:`embstore.service.server.Worker`);
- ``embstore.open("des://host:port[,host:port...]")`` returns a client store
  (:class:`embstore.service.client.DesStore`) that satisfies :class:`embstore.StoreProtocol`.

Transport: Arrow Flight (``pyarrow``, the ``parquet`` extra); a client or follower on a
worker's host, as its user, sends the rows through shared memory (:mod:`embstore.service.shm`).
See docs/service.md.
"""
