"""One stream-state poll for a sidecar with many buckets.

Each feed watches its stream's state for removals no message announces (a purge, limits
moving the first sequence, a max_age change: kvcache.feed.sweeps). Alone, a feed asks STREAM.INFO
every watch_period; with 1,000 buckets that was 800 JetStream API requests a second from
an idle sidecar. From SHARED_FROM buckets on, one task lists the account's streams instead
(STREAM.LIST, up to 256 a page) once per the shortest of their periods, and gives each feed
its own stream's entry: the same check on the same document, so no bucket's bound is looser.
A stream missing from the listing, or listed without a leader (a member's state may be far
behind its leader's: it would look like a purge), is asked about on its own. Each entry is
also that feed's quorum evidence (kvcache.feed.quorum): the meta leader gathers it from the
stream's leader after the page was asked for, so the page's send time bounds it. With the
fleet's shared polls (kvcache.feed.fleet), only the streams no other sidecar answers for are
looked at, and each entry is shared in turn.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..natsio import jetstream as jsapi
from ..natsio.nats_connection import NatsConnection
from ..stats import Stats

if TYPE_CHECKING:
    from .feed import Feed
    from .fleet import StateShare

log = logging.getLogger("kvcache.feed")

# From this many buckets the shared poll is used. A STREAM.LIST page carries up to 256 streams
# (every stream of the account, not only the sidecar's), so for a handful of buckets their
# own STREAM.INFO requests cost NATS less.
SHARED_FROM = 16


class StatePoll:
    """Watches the streams of `feeds` with STREAM.LIST pages; the feeds' own watch loops are
    off (Feed.start(watch=False))."""

    def __init__(self, nc: NatsConnection, feeds: Iterable[Feed], timeout: float, stats: Stats,
                 share: StateShare | None = None) -> None:
        self.nc = nc
        self.share = share  # the fleet's shared polls (kvcache.feed.fleet), if the sidecar shares them
        self.feeds = list(feeds)
        self.timeout = timeout
        self.stats = stats
        self._task: asyncio.Task | None = None

    def period(self) -> float:
        return min(feed.watch_period() for feed in self.feeds)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="removals:shared")

    async def stop(self) -> None:
        if self._task and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        while True:
            period = self.period()
            await asyncio.sleep(period)
            wanted = [feed for feed in self.feeds if feed.watching() or feed.quorum]
            share = self.share
            if share is not None:  # another sidecar of the fleet may poll these for this one
                wanted = [feed for feed in wanted if share.should_poll(feed.bucket, period)]
            if not wanted:
                continue
            try:
                listed = await self.list_streams()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the next period tries again; the data is still served
                log.warning("stream state poll (STREAM.LIST) failed: %s", e)
                continue
            for feed in wanted:
                info, sent = listed.get(feed.stream, (None, 0))
                if share is not None and info is not None:
                    await share.publish(feed.bucket, info, sent)
                if not feed.watching():
                    if feed.quorum and info is not None:  # evidence for fallback reads (Feed.fence)
                        feed.note_evidence(info, sent)
                    continue
                if info is not None and info.get("cluster") is not None and not jsapi.stream_leader(info):
                    info = None  # no leader in the listing: ask the stream itself (it waits for one)
                try:
                    await feed.check_state(info=info, sent_ns=sent)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.warning("bucket %s: stream state check failed: %s", feed.bucket, e)

    async def list_streams(self) -> dict[str, tuple[dict, int]]:
        """Every stream of the account: name -> its info (config, state, cluster) and when
        its page was asked for (time.time_ns())."""
        out: dict[str, tuple[dict, int]] = {}
        offset = 0
        while True:
            sent = time.time_ns()
            doc = await jsapi.api_request(self.nc, "$JS.API.STREAM.LIST", {"offset": offset}, self.timeout)
            self.stats.stream_list_requests += 1
            streams = doc.get("streams") or []
            for info in streams:
                name = (info.get("config") or {}).get("name")
                if name:
                    out[name] = (info, sent)
            offset += len(streams)
            if not streams or offset >= int(doc.get("total", 0)):
                return out
