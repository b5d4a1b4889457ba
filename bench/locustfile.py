"""locust load over the sidecar's Unix socket: an application's read mix, not a GET loop.

Against `make demo` (run from the repository, in another terminal; locust is in the test and
bench extras), as is: the demo bucket holds the keys read here, and the socket's default is
the demo's (kvcache-data/kvcache.sock):

    locust -f bench/locustfile.py --headless -u 5 -r 5 -t 10s

Against a sidecar of your own, on a bucket you load with compare.py's keys:

    locust -f bench/locustfile.py --headless -u 50 -r 10 -t 30s --csv bench/results/locust \
        --kv-socket /path/to/kvcache.sock --kv-hot-keys 10000 --kv-cold-keys 10000

(`python bench/compare.py --only locust` starts nats-server and the sidecar with a loaded
bucket, runs exactly this, stops everything and prints the summary. tests/test_readme.py runs
it for 5 s against the demo and expects no failure.)

The bucket holds `hot.<NNNNNN>` keys, which the sidecar replicates (compare.py's bucket filter
`hot.>`), and `cold.<NNNNNN>` keys, which it does not there: reading those goes to NATS (Direct
Get). The demo bucket (kvcache.demo.demo_entries: 100 of each, the defaults below)
replicates every key, so a GET of a cold key would be answered locally there: when the
sidecar answers the first cold key from its replica or near cache (KV.GET's `source`, asked
once at the start), cold keys are read with `KV.GET key CONSISTENCY strong` instead, the read
a replicating sidecar still sends to NATS (the stream leader), and the mix keeps its remote
reads (one the sidecar answers itself is a failure). Each simulated user has its own
connection and, between requests, waits --kv-wait-ms on average:

| weight | request | what |
|---:|---|---|
| 70 | `GET hot (zipf)` | one key, Zipf-distributed over the hot keys (rank 1 most popular) |
| 15 | `MGET 8 hot (zipf)` | eight keys drawn the same way |
| 10 | `GET cold (remote)` | a key outside the replicated filter: the sidecar's Direct Get |
| | or `KV.GET cold strong (remote)` | where cold keys are replicated (the demo): the leader's answer |
| 5 | `GET missing` | a key inside the filter that does not exist: nil, answered locally |

Values are checked (`value-<key>-xxx...`, 100 bytes, as compare.py and the demo write them); a
wrong value is a failure.

kvcache.app.client.Client uses only the `socket` module, so under locust (gevent monkeypatches
`socket`) it is cooperative: a user blocked on a reply lets the others run. locust's own
percentiles round to whole milliseconds, too coarse here, so every response time is also kept
and, with --kv-latency-out, written as microsecond percentiles per request name (JSON) when
the test stops. Single process: locust runs here without workers.
"""
from __future__ import annotations

import itertools
import json
import random
import sys
import time
from pathlib import Path

from locust import User, events, task

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the keyspace as compare.py loads it (importing compare puts this checkout's kvcache first)
from compare import COLD_PREFIX, HOT_PREFIX, key_name, percentiles, value_of

from kvcache.app.client import Client


def zipf_cum_weights(n: int, s: float) -> list[float]:
    """Cumulative weights of ranks 1..n under Zipf(s), for random.choices(cum_weights=...)."""
    return list(itertools.accumulate(1.0 / r ** s for r in range(1, n + 1)))


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    group = parser.add_argument_group("kvcache")
    group.add_argument("--kv-socket", default="kvcache-data/kvcache.sock", env_var="KVBENCH_SOCKET",
                       help="the sidecar's Unix socket")
    # the defaults: the demo bucket's (kvcache.demo.DEMO_HOT_KEYS, DEMO_COLD_KEYS)
    group.add_argument("--kv-hot-keys", type=int, default=100, env_var="KVBENCH_HOT_KEYS",
                       help="hot.000000.. keys the sidecar replicates")
    group.add_argument("--kv-cold-keys", type=int, default=100, env_var="KVBENCH_COLD_KEYS",
                       help="cold.000000.. keys it does not (read remotely)")
    group.add_argument("--kv-zipf", type=float, default=1.1, env_var="KVBENCH_ZIPF",
                       help="Zipf exponent of the hot-key popularity")
    group.add_argument("--kv-wait-ms", type=float, default=10.0, env_var="KVBENCH_WAIT_MS",
                       help="mean think time between a user's requests (uniform 0.5x..1.5x)")
    group.add_argument("--kv-latency-out", default="", env_var="KVBENCH_LATENCY_OUT",
                       help="write microsecond percentiles per request name to this JSON file")


_samples: dict[str, list[float]] = {}
_cum_weights: list[float] = []
_cold_strong: list[bool] = [False]  # cold keys are replicated here: read them with CONSISTENCY strong
LOCAL_SOURCES = ("local", "cache")  # KV.GET's sources that are not NATS


@events.test_start.add_listener
def _start(environment, **_kw) -> None:
    opts = environment.parsed_options
    _cum_weights[:] = zipf_cum_weights(opts.kv_hot_keys, opts.kv_zipf)
    _samples.clear()
    with Client(opts.kv_socket, timeout=5) as c:
        _cold_strong[0] = c.entry(key_name(COLD_PREFIX, 0)).source in LOCAL_SOURCES


@events.test_stop.add_listener
def _stop(environment, **_kw) -> None:
    out = environment.parsed_options.kv_latency_out
    if out and _samples:
        summary = {name: percentiles(xs) for name, xs in sorted(_samples.items())}
        summary["Aggregated"] = percentiles([x for xs in _samples.values() for x in xs])
        Path(out).write_text(json.dumps(summary, indent=1) + "\n")


class KvcacheUser(User):
    """One application connection to the sidecar."""

    _wait_ms = 10.0

    def wait_time(self) -> float:
        return self._rng.uniform(0.0005 * self._wait_ms, 0.0015 * self._wait_ms)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self._wait_ms = opts.kv_wait_ms
        self._hot, self._cold = opts.kv_hot_keys, opts.kv_cold_keys
        self._rng = random.Random()
        self._client = Client(opts.kv_socket, timeout=5)

    def on_stop(self) -> None:
        self._client.close()

    def _hot_keys(self, k: int) -> list[str]:
        ranks = self._rng.choices(range(self._hot), cum_weights=_cum_weights, k=k)
        return [key_name(HOT_PREFIX, r) for r in ranks]

    def _request(self, kind: str, name: str, call, expected) -> None:
        exc: Exception | None = None
        length = 0
        t0 = time.perf_counter()
        try:
            reply = call()
            elapsed = time.perf_counter() - t0
            if reply != expected:
                raise AssertionError(f"{name}: got {reply!r:.80}, expected {expected!r:.80}")
            length = sum(len(v or b"") for v in reply) if isinstance(reply, list) else len(reply or b"")
        except Exception as e:
            elapsed = time.perf_counter() - t0
            exc = e
        _samples.setdefault(name, []).append(elapsed * 1e6)
        self.environment.events.request.fire(request_type=kind, name=name, response_time=elapsed * 1e3,
                                             response_length=length, exception=exc, context={})

    @task(70)
    def get_hot(self) -> None:
        key = self._hot_keys(1)[0]
        self._request("GET", "GET hot (zipf)", lambda: self._client.get(key), value_of(key))

    @task(15)
    def mget_hot(self) -> None:
        keys = self._hot_keys(8)
        self._request("MGET", "MGET 8 hot (zipf)", lambda: self._client.mget(keys),
                      [value_of(k) for k in keys])

    @task(10)
    def get_cold(self) -> None:
        key = key_name(COLD_PREFIX, self._rng.randrange(self._cold))
        if _cold_strong[0]:
            self._request("KV.GET", "KV.GET cold strong (remote)", lambda: self._strong_get(key), value_of(key))
        else:
            self._request("GET", "GET cold (remote)", lambda: self._client.get(key), value_of(key))

    def _strong_get(self, key: str) -> bytes | None:
        """The value NATS answers for `key`: a strong read, which no replica or cache answers."""
        entry = self._client.entry(key, consistency="strong")
        if entry.source in LOCAL_SOURCES:
            raise AssertionError(f"{key}: a strong read answered by the sidecar ({entry.source}), not NATS")
        return entry.value

    @task(5)
    def get_missing(self) -> None:
        key = key_name(HOT_PREFIX, self._hot + self._rng.randrange(1_000_000))
        self._request("GET", "GET missing", lambda: self._client.get(key), None)
