"""Exceptions that cross module boundaries; each carries a message fit for one stderr line,
and describe() makes such a line of any other exception."""


class KvcacheError(Exception):
    """Base class: the message is shown to users as is."""


class ConfigError(KvcacheError):
    """Invalid configuration, flags or environment."""


class UpstreamError(KvcacheError):
    """NATS could not answer: unreachable, timed out, or replied with an error status."""


class BehindQuorum(UpstreamError):
    """A server answered, but could not show that it holds every write the bucket's quorum
    acknowledged within the read's bound (kvcache.feed.quorum): its answer is not used."""


class BucketNotFound(KvcacheError):
    """A configured bucket has no stream on the server."""


class ReplicaError(KvcacheError):
    """The LMDB replica could not be opened or written."""


class CommandError(KvcacheError):
    """A command's one-line refusal, answered to the client as a RESP error (the message is
    the error text, code first); the connection stays usable."""


class ProtocolError(KvcacheError):
    """Malformed RESP or NATS input: the framing is lost and the connection must close.
    The NATS reader attaches the events parsed before the error as `events`."""

    events: list[object]


class ReplyTooLarge(KvcacheError):
    """One reply would carry more than max_reply_bytes of values (an MGET of many big keys):
    refused while it is gathered, before it can take the sidecar's memory."""


class ReplyBudget:
    """Bytes of values one reply may still gather, local and remote alike."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def fork(self) -> "ReplyBudget":
        """A budget for one attempt: a failed-over read must not be charged twice."""
        b = ReplyBudget(self.limit)
        b.left = self.left
        return b

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise ReplyTooLarge(f"ERR reply too large: its values exceed max_reply_bytes ({self.limit}); "
                                "ask for fewer keys at a time")


def describe(e: BaseException) -> str:
    """An exception as the short text a log line or the CLI's one error line shows: "timed
    out" for a timeout, nats-py's "nats: " prefix dropped, the type's name for an empty one."""
    if isinstance(e, TimeoutError):  # asyncio.TimeoutError too: the same class since 3.11
        return "timed out"
    text = str(e) or type(e).__name__
    return text.replace("nats: ", "")
