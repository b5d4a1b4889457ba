"""kvcache: a read-cache sidecar for NATS JetStream Key-Value buckets."""
__version__ = "0.1.0"

from .entry import Entry, Operation

__all__ = ["AsyncClient", "Client", "Entry", "LocalReader", "NotReplicated", "Operation", "ResponseError",
           "StaleReplica", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import kvcache` stays cheap for the CLI and for processes that only read LMDB.
    if name in ("Client", "AsyncClient", "ResponseError"):
        from .app import client
        return getattr(client, name)
    if name in ("LocalReader", "StaleReplica", "NotReplicated"):
        from .app import reader
        return getattr(reader, name)
    raise AttributeError(name)
