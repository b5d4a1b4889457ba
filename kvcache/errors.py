"""Exceptions that cross module boundaries; each carries a message fit for one stderr line."""


class KvcacheError(Exception):
    """Base class: the message is shown to users as is."""


class ConfigError(KvcacheError):
    """Invalid configuration, flags or environment."""


class UpstreamError(KvcacheError):
    """NATS could not answer: unreachable, timed out, or replied with an error status."""


class BucketNotFound(KvcacheError):
    """A configured bucket has no stream on the server."""


class ReplicaError(KvcacheError):
    """The LMDB replica could not be opened or written."""


class ProtocolError(KvcacheError):
    """Malformed RESP: the framing is lost and the connection must close."""
