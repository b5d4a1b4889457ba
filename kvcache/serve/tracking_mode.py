"""One connection's CLIENT TRACKING mode: the options it turned tracking on with, the
CLIENT CACHING answer for its next command, and its keys in the server's table
(kvcache.serve.tracking). A module of its own: the connection holds one, the tracking server
manages them.
"""
from __future__ import annotations


class ClientTracking:
    """One connection's tracking mode (CLIENT TRACKING's options) and its keys in the table."""

    __slots__ = ("bcast", "broken", "caching", "keys", "noloop", "optin", "optout", "prefixes",
                 "redirect")

    def __init__(self, bcast: bool, optin: bool, optout: bool, noloop: bool, redirect: int,
                 prefixes: list[bytes]) -> None:
        self.bcast = bcast
        self.optin = optin
        self.optout = optout
        self.noloop = noloop
        self.redirect = redirect
        self.prefixes = prefixes
        self.caching: bool | None = None  # CLIENT CACHING YES/NO, for the next command
        self.keys: set[bytes] = set()      # this connection's names in the table
        self.broken = False                # the redirect connection is gone (told once)

    def wants(self) -> bool:
        """Is the command now running to be tracked (OPTIN/OPTOUT with CLIENT CACHING)?"""
        if self.bcast:
            return False
        if self.optin:
            return self.caching is True
        if self.optout:
            return self.caching is not False
        return True
