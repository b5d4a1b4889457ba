"""What a NATS watch of a KV bucket resumed from a sequence delivers: the reference the
`@<bucket>` streams are checked against (tests/test_streams.py, tests/test_node_clients.py)."""
from __future__ import annotations

import asyncio

import nats
from nats.js.api import ConsumerConfig, DeliverPolicy


def nats_watch_from(url: str, bucket: str, seq: int) -> list[tuple[int, str, str]]:
    """A JetStream consumer on the bucket's stream from sequence `seq` + 1, read up to the
    stream's last sequence now: (sequence, key, operation) in delivery order. In a history-1
    bucket that is each changed key's latest message, once, in sequence order."""
    async def go():
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            last = (await js.stream_info(f"KV_{bucket}")).state.last_seq
            if last <= seq:
                return []
            sub = await js.subscribe(f"$KV.{bucket}.>", ordered_consumer=True,
                                     config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                                           opt_start_seq=seq + 1))
            out = []
            while True:
                msg = await sub.next_msg(timeout=5)
                op = (msg.headers or {}).get("KV-Operation", "PUT")
                out.append((msg.metadata.sequence.stream, msg.subject[len(f"$KV.{bucket}."):], op))
                if msg.metadata.sequence.stream >= last or not msg.metadata.num_pending:
                    return out  # the last sequence may be a message since removed
        finally:
            await nc.close()
    return asyncio.run(go())
