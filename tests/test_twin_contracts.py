"""Each native/pure-Python pair against the contract it declares once (kvcache.native.CONTRACTS,
one typing.Protocol per pair and per class it hands out): for every pair and each twin that is
there (the extension is skipped only when it is not built), every member is present, every
callable takes the declared parameters (names, kinds, which have defaults) and a value is not
a method, and one real call per member gives the same answer on both.

Where inspect sees a Cython function: its `def` functions and methods (Cython 3 binds them
and tells their signature); a `cdef class`'s constructor has none (its `__init__` is a slot
wrapper), so it is read from the signature embedsignature puts in the class's docstring; a
`__call__` is a slot as well, with no signature anywhere: it is checked by being called with
its parameter by name (the behavioural calls name every parameter, which checks the names
of anything inspect could not). `test_what_inspect_cannot_see` lists what that leaves.
"""
from __future__ import annotations

import importlib
import inspect
import re
import time
import types
import typing
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import pytest

from kvcache import native
from kvcache.stats import Stats
from kvcache.store.record import item
from kvcache.store.replica import BucketMeta, Replica

# every pair: the modules of EXTENSIONS and the parts of their native paths (PARTS)
PAIRS = {**native.EXTENSIONS, **{name: twin for name, (_, twin) in native.PARTS.items()}}
TWINS = {name: importlib.import_module(f"kvcache.{twin}") for name, twin in PAIRS.items()}
NATIVES = {name: native.native_or_none(name) for name in PAIRS}  # None: not built

IMPLS = [pytest.param(name, "python", id=f"{name}-python") for name in PAIRS] + [
    pytest.param(name, "native", id=f"{name}-native",
                 marks=pytest.mark.skipif(NATIVES[name] is None, reason=f"kvcache._native.{name} not built"))
    for name in PAIRS]


def impl(name: str, kind: str) -> types.ModuleType:
    module = TWINS[name] if kind == "python" else NATIVES[name]
    assert module is not None
    return module


# --------------------------------------------------------------------------- the checker

Params = list[tuple[str, inspect._ParameterKind, bool]]  # name, kind, has a default

_EMBEDDED = re.compile(r"^\s*(\w+)\((.*)\)")


def embedded_signature(doc: str | None, name: str) -> Params | None:
    """The parameters Cython's embedsignature writes on a docstring's first line
    (`Name(Py_ssize_t a, b=3, *args, **kw)`: C types before the name), or None without one."""
    m = _EMBEDDED.match((doc or "").split("\n", 1)[0])
    if m is None or m[1] != name:
        return None
    parts, depth, cur = [], 0, ""
    for ch in m[2]:  # split on the commas outside brackets (a default may hold some)
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out: Params = []
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for part in (p.strip() for p in parts if p.strip()):
        head, eq, _ = part.partition("=")
        word = head.split()[-1]
        if word == "/":
            out = [(n, inspect.Parameter.POSITIONAL_ONLY, d) for n, _, d in out]
        elif word == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
        elif word.startswith("**"):
            out.append((word[2:], inspect.Parameter.VAR_KEYWORD, False))
        elif word.startswith("*"):
            out.append((word[1:], inspect.Parameter.VAR_POSITIONAL, False))
            kind = inspect.Parameter.KEYWORD_ONLY
        else:
            out.append((word, kind, bool(eq)))
    if out and out[0][0] == "self":
        out = out[1:]
    return out


def params_of(obj: Callable) -> Params | None:
    """What `obj` takes as the caller sees it (bound: no self), or None when nothing tells."""
    if isinstance(obj, (types.MethodWrapperType, types.WrapperDescriptorType)):
        return None  # a C slot (a cdef class's __call__): `(*args, **kwargs)` says nothing
    try:
        sig = inspect.signature(obj)
    except (ValueError, TypeError):
        return embedded_signature(obj.__doc__, obj.__name__) if isinstance(obj, type) else None
    return [(p.name, p.kind, p.default is not p.empty) for p in sig.parameters.values()]


def declared(contract: type, name: str) -> Params:
    sig = inspect.signature(getattr(contract, name))
    return [(p.name, p.kind, p.default is not p.empty) for p in list(sig.parameters.values())[1:]]


def _runtime_types(hint: Any) -> tuple[type, ...] | None:
    """The classes isinstance can test a hint with (`int`, `list[bytes]` as list, `bytes |
    None`, `type[X]` as type), or None for one it cannot (Any, a Protocol)."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    out = []
    for a in args:
        a = typing.get_origin(a) or a
        if a is Any:
            return None
        if a is type(None) or (isinstance(a, type) and not getattr(a, "_is_protocol", False)):
            out.append(a)
        else:
            return None
    return tuple(out)


def check(obj: object, contract: type) -> tuple[list[str], list[str]]:
    """(What `obj` does not meet of `contract`, the members whose parameters nothing tells.)"""
    problems, unverified = [], []
    hints = typing.get_type_hints(contract)
    for name in native.members(contract):
        if not hasattr(obj, name):
            problems.append(f"missing {name}")
            continue
        value = getattr(obj, name)
        decl = inspect.getattr_static(contract, name, None)
        if inspect.isfunction(decl):  # a method (or, for a module, a function or a constructor)
            if not callable(value):
                problems.append(f"{name}: not callable")
                continue
            got = params_of(value)
            if got is None:
                unverified.append(name)
            elif got != declared(contract, name):
                problems.append(f"{name}: takes {fmt(got)}, declared {fmt(declared(contract, name))}")
        elif isinstance(decl, property) or name in hints:  # a value
            if isinstance(decl, property) and callable(value) and not isinstance(value, type):
                problems.append(f"{name}: a method, declared a value")
            allowed = _runtime_types(hints[name]) if name in hints else None
            if allowed is not None and not isinstance(value, allowed):
                problems.append(f"{name}: {type(value).__name__}, declared {hints[name]}")
    return problems, unverified


def fmt(params: Params) -> str:
    """Parameters as Python writes them: `(a, /, b, *, c=...)`."""
    out, star = [], False
    for i, (n, k, d) in enumerate(params):
        if k == inspect.Parameter.KEYWORD_ONLY and not star:
            out.append("*")
        star = star or k in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_POSITIONAL)
        out.append({inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(k, "")
                   + n + ("=..." if d else ""))
        if k == inspect.Parameter.POSITIONAL_ONLY and (i + 1 == len(params)
                                                      or params[i + 1][1] != inspect.Parameter.POSITIONAL_ONLY):
            out.append("/")
    return "(" + ", ".join(out) + ")"


def constructors(contract: type) -> dict[str, type]:
    """A module contract's members that return an instance contract: name -> that contract."""
    out = {}
    for name in native.members(contract):
        fn = inspect.getattr_static(contract, name, None)
        if inspect.isfunction(fn):
            ret = typing.get_type_hints(fn, vars(native)).get("return")
            if getattr(ret, "_is_protocol", False):
                out[name] = ret
    return out


def made_by(contract: type, member: str) -> type:
    """The instance contract of what a module contract's member makes (a constructor's
    return, or X of an attribute `type[X]`: a class callers do not build themselves)."""
    return constructors(contract).get(member) or typing.get_args(typing.get_type_hints(contract)[member])[0]


# --------------------------------------------------------------------------- a replica to read

MiB = 1 << 20


class Witness:
    """What the GET path asks of a bucket's witness: may the replica answer, and max_age."""

    max_age_ns = 0

    def __init__(self) -> None:
        self.asked = 0

    def fresh_for_all(self, max_stale_ms: int) -> bool:
        self.asked += 1
        return True


class Transport:
    """A socket-less transport: what GetConnection writes."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def get_write_buffer_size(self) -> int:
        return 0


@pytest.fixture
def replica(tmp_path):
    r = Replica(str(tmp_path / "replica"), map_size=4 * MiB)
    r.apply_items("main", [item(b"a", b"1", 1, time.time_ns())],
                  BucketMeta(stream="KV_main", applied_seq=1, synced=True))
    try:
        yield r
    finally:
        r.close()


def get_cmd(key: bytes) -> bytes:
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(key), key)


# --------------------------------------------------------------------------- each pair, called

# Each builds the pair's instances with real calls (every parameter by name), checks a call per
# member, and returns its instances by the module contract's constructor that made them.

def exercise_resp(mod, replica) -> dict[str, list[object]]:
    rr = mod.RequestReader(max_request_bytes=MiB, max_args=1000)
    assert (rr.max_request_bytes, rr.max_args, rr.idle()) == (MiB, 1000, True)
    rr.feed(data=get_cmd(b"k") * 2 + b"*1\r\n$4\r\nPING\r\n")
    assert rr.buffered == 2 * len(get_cmd(b"k")) + 14 and not rr.idle()
    lengths, keys, start = rr.take_gets()
    assert (lengths, keys, start) == ([b"$1", b"$1"], [b"k", b"k"], 0) and lengths == [mod.GET_LEN[1]] * 2
    assert rr.take_gets() is None  # PING is next
    rr.rewind_gets(start=start, lengths=lengths, keys=keys, count=1)
    assert [rr.next_command(), rr.next_command(), rr.next_command()] == [[b"GET", b"k"], [b"PING"], None]
    assert rr.buffered == 0 and rr.idle()
    sentinel = object()
    reply = mod.ReplyReader(not_enough_data=sentinel)
    reply.feed(data=b"*2\r\n:1\r\n-ERR x\r\n+OK")
    assert reply.has_data()
    one, err = reply.gets()
    assert one == 1 and isinstance(err, mod.ReplyError) and str(err) == "ERR x"
    assert reply.gets() is sentinel and reply.buffered == 3
    return {"RequestReader": [rr], "ReplyReader": [reply]}


ACK = "$JS.ACK.KV_b.c.1.5.1.1700000000000000000.0"


def exercise_natsproto(mod, replica) -> dict[str, list[object]]:
    r = mod.NatsReader(max_control_line=4096, max_payload=MiB)
    assert (r.max_control_line, r.max_payload) == (4096, MiB)
    assert r.feed(data=b"PING\r\nMSG a.b 7 5\r\nhello\r\n+OK\r\n-ERR 'x'\r\nINFO {}\r\nPO") == [
        mod.PING, mod.Msg(7, "a.b", "", b"hello"), mod.OK, mod.Err("x"), mod.Info({})]
    assert r.buffered() == 2 and r.feed(b"NG\r\n") == [mod.PONG] and r.buffered() == 0
    delivery = b"MSG $KV.b.k 9 %b 1\r\nv\r\n" % ACK.encode()
    r.add_lane(sid=9, prefix_len=len("$KV.b."))
    (run,) = r.feed(delivery)
    assert type(run) is mod.Run and run.fields() == tuple(getattr(run, f) for f in mod.RUN_FIELDS)
    assert (run.sid, run.first_cseq, run.last_cseq, run.top_sseq, run.deletes, run.marks) == (9, 1, 1, 5, 0, [])
    assert run.items[0][0] == b"k" and (run.last_ts, run.last_pending) == (1700000000000000000, 0)
    r.remove_lane(sid=9)
    assert r.feed(delivery) == [mod.Msg(9, "$KV.b.k", ACK, b"v")]
    ack = mod.parse_ack(reply=ACK)
    assert isinstance(ack, mod.AckMeta) and (ack.stream, ack.stream_seq, ack.consumer_seq) == ("KV_b", 5, 1)
    assert mod.parse_ack(b"not.an.ack") is None
    assert (mod.MARK_DEL, mod.MARK_PURGE) == (1, 2) and mod.HMsg._fields[-1] == "multi"
    assert mod.MAX_CONTROL_LINE > 0 and mod.MAX_PAYLOAD > 0
    return {"NatsReader": [r], "Run": [run]}


def exercise_server_get(mod, replica) -> dict[str, list[object]]:
    from kvcache import resp
    planned: list[bytes] = []

    def planner(raw: bytes):
        planned.append(raw)
        return False  # any key not planned from the key itself: the generic path's

    gets = mod.ServerGets(replica=replica, planner=planner)
    assert (gets.cached, gets.defer, gets.call_soon, gets.timed) == (0, False, None, False)
    witness = Witness()
    gets.set_buckets(buckets=[("main", witness, 1000, True)], default="main")
    assert gets.serve(lengths=[b"$1", b"$1"], keys=[b"a", b"b"], proto=2, budget=MiB) == (
        b"$1\r\n1\r\n$-1\r\n", 2, 1)
    assert gets.serve([b"$3"], [b"x:y"], 3, MiB) == (b"", 0, 0) and planned == [b"x:y"]
    asked = witness.asked
    gets.forget_fresh()
    reader = resp.RequestReader()
    assert gets.answer(reader=reader, data=get_cmd(b"a"), proto=3, budget=MiB) == (b"$1\r\n1\r\n", 1, 0, False)
    assert witness.asked == asked + 1  # the verdict was forgotten: asked again
    assert gets.flush() is None
    assert gets.bucket_reads() == {"main": (2, 1)} and gets.cache_reads() == {}
    gets.observe(ns=500, n=2)
    counts, total = gets.latency()
    assert sum(counts) == 2 and total == 1000

    class Connection(mod.GetConnection):
        processed = 0

        def _process(self) -> None:  # the generic loop, as ClientConnection's
            self.processed += 1

    stats = Stats()
    base = mod.GetConnection(gets=gets, stats=stats, reader=resp.RequestReader())
    conn = Connection(gets, stats, resp.RequestReader())
    conn.transport = transport = Transport()
    assert conn.transport is transport and conn.proto == 2 and conn.last_cmd is None
    conn.data_received(data=get_cmd(b"a") + get_cmd(b"b"))
    assert transport.written == [b"$1\r\n1\r\n$-1\r\n"] and conn.last_cmd == b"get" and conn.processed == 0
    assert (stats.commands, stats.gets_local, stats.gets_notfound) == (2, 2, 1)
    conn.data_received(b"*1\r\n$4\r\nPING\r\n")
    assert conn.processed == 1 and conn.reader.next_command() == [b"PING"]
    conn._count(local=3, notfound=0)
    assert stats.commands == 5
    assert not (conn._closing or conn._paused_writing or conn._eof or conn._draining or conn._muted)
    assert conn._busy is None and conn._last_io > 0
    with pytest.raises(NotImplementedError):
        base._process()
    return {"ServerGets": [gets], "GetConnection": [base, conn]}


def exercise_app_get(mod, replica) -> dict[str, list[object]]:
    plans = {"a": ("main", replica.db("main"), b"a", 0)}
    fresh_until = {"main": time.monotonic() + 60}
    slow_keys: list[str] = []

    def slow(key: str) -> bytes | None:
        slow_keys.append(key)
        return b"slow"

    get = mod.LocalGet(plans=plans, fresh_until=fresh_until, begin=replica.env.begin, slow=slow)
    assert (get.plans, get.fresh_until, get.begin, get.slow) == (plans, fresh_until, replica.env.begin, slow)
    assert get(key="a") == b"1" and slow_keys == []  # by name: the one check of __call__'s parameter
    assert get("zz") == b"slow" and slow_keys == ["zz"]  # no plan
    plans["gone"] = ("main", replica.db("main"), b"gone", 0)
    assert get("gone") is None
    fresh_until["main"] = 0.0
    assert get("a") == b"slow" and slow_keys == ["zz", "a"]  # freshness to ask again
    return {"LocalGet": [get]}


def exercise_near_hits(mod, replica) -> dict[str, list[object]]:
    lru = OrderedDict((k, 1) for k in (b"a", b"b", b"c"))
    counter = mod.HitCounter(capacity=100, lru=lru)
    assert (counter.hits, counter.pending, counter.touched) == (0, 0, [])
    counter.take(keys=[b"a", b"b"])
    assert counter.touched == [b"a", b"b"] and (counter.hits, counter.pending) == (2, 2)  # rarely read: each
    assert counter.sketch.estimate(b"a") == 1 and counter.sketch.additions == 0  # noted at the handover
    counter.read(key=b"c")
    assert counter.sketch.estimate(b"c") == 1 and counter.sketch.additions == 1 and counter.hits == 2
    assert counter.drain() is None
    assert counter.touched == [] and list(lru) == [b"c", b"a", b"b"]
    return {"HitCounter": [counter]}


EXERCISES: dict[str, Callable[[Any, Replica], dict[str, list[object]]]] = {
    "resp": exercise_resp,
    "natsproto": exercise_natsproto,
    "server_get": exercise_server_get,
    "app_get": exercise_app_get,
    "near_hits": exercise_near_hits,
}


# --------------------------------------------------------------------------- the tests


def test_every_pair_declares_its_contract():
    assert set(native.CONTRACTS) == set(PAIRS) == set(EXERCISES)
    assert not set(native.PARTS) & set(native.EXTENSIONS)
    assert all(whole in native.EXTENSIONS for whole, _ in native.PARTS.values())
    for name, contract in native.CONTRACTS.items():
        assert getattr(contract, "_is_protocol", False) and contract.__doc__, name
        for inner in constructors(contract).values():
            assert inner.__doc__, inner


@pytest.mark.parametrize(("name", "kind"), IMPLS)
def test_twin_meets_its_contract(name, kind, replica):
    """The module meets its pair's contract, and each instance its classes made (by real
    calls, every member called once) meets its own."""
    mod = impl(name, kind)
    contract = native.CONTRACTS[name]
    assert check(mod, contract)[0] == []
    assert native.lacks(mod, contract) == []
    made = EXERCISES[name](mod, replica)
    kinds = constructors(contract)
    assert set(made) <= set(native.members(contract))
    for member, instances in made.items():
        for obj in instances:
            assert check(obj, made_by(contract, member))[0] == [], (member, obj)
    # every class the contract hands out was made and checked
    assert set(kinds) <= set(made)


def test_what_inspect_cannot_see(replica):
    """The members no signature tells of, on either twin: only a cdef class's __call__ (a
    slot), which exercise_app_get calls with its parameter by name. Everything else has its
    parameters compared (a cdef class's constructor through its embedded signature)."""
    seen = {}
    for name, contract in native.CONTRACTS.items():
        for kind, mod in (("python", TWINS[name]), ("native", NATIVES[name])):
            if mod is None:
                continue
            seen[(name, kind)] = check(mod, contract)[1]
            for member, instances in EXERCISES[name](mod, replica).items():
                seen[(name, kind)] += [f"{member}.{m}" for m in check(instances[0], made_by(contract, member))[1]]
    unverified = {k: v for k, v in seen.items() if v}
    expected = {("app_get", "native"): ["LocalGet.__call__"]} if NATIVES["app_get"] is not None else {}
    assert unverified == expected


# --------------------------------------------------------------------------- the checker catches


class BrokenRequestReader:
    """A twin gone wrong: no idle, rewind_gets' parameter renamed, next_command with one
    more, `buffered` a method and max_args not an int."""

    max_request_bytes = 1
    max_args = "many"

    def buffered(self) -> int:
        return 0

    def feed(self, data) -> None:
        pass

    def take_gets(self):
        return None

    def rewind_gets(self, start, lens, keys, count) -> None:
        pass

    def next_command(self, block=False):
        return None

    def take_rest(self) -> bytes:
        return b""


class BrokenResp:
    """A module stand-in: ReplyReader missing, RequestReader's limits keyword-only."""

    GET_LEN: typing.ClassVar[list[bytes]] = []
    ReplyError = Exception

    class RequestReader:
        def __init__(self, *, max_request_bytes: int = 0, max_args: int = 0) -> None:
            pass


def test_the_checker_catches_a_missing_member_and_a_wrong_signature():
    problems, _ = check(BrokenRequestReader(), native.RequestReaderAPI)
    assert problems == [
        "max_args: str, declared <class 'int'>",
        "buffered: a method, declared a value",
        "missing idle",
        "rewind_gets: takes (start, lens, keys, count), declared (start, lengths, keys, count)",
        "next_command: takes (block=...), declared ()",
    ]
    problems, _ = check(BrokenResp, native.Resp)
    assert problems == ["RequestReader: takes (*, max_request_bytes=..., max_args=...), "
                        "declared (max_request_bytes=..., max_args=...)",
                        "missing ReplyReader"]
    assert native.lacks(BrokenResp, native.Resp) == ["ReplyReader"]


def test_a_parameter_kind_or_default_counts():
    """Keyword-only where positional is declared, or a default dropped, is not the contract."""
    class Reader:
        def __init__(self, *, not_enough_data=False) -> None:
            pass

    class Module:
        GET_LEN: typing.ClassVar[list[bytes]] = [b"$0"]
        ReplyError = Exception
        ReplyReader = Reader

        class RequestReader:
            def __init__(self, max_request_bytes, max_args=0) -> None:
                pass

    problems, _ = check(Module, native.Resp)
    assert [p.split(":")[0] for p in problems] == ["RequestReader", "ReplyReader"]
    assert inspect.Parameter.KEYWORD_ONLY in [k for _, k, _ in params_of(Reader)]


def test_embedded_signatures_are_read_as_python_would():
    doc = "NatsReader(Py_ssize_t max_control_line=MAX_CONTROL_LINE, Py_ssize_t max_payload=f(1, 2))\n\nText."
    assert embedded_signature(doc, "NatsReader") == [
        ("max_control_line", inspect.Parameter.POSITIONAL_OR_KEYWORD, True),
        ("max_payload", inspect.Parameter.POSITIONAL_OR_KEYWORD, True)]
    assert embedded_signature("f(self, a, /, b, *args, c=1, **kw)", "f") == [
        ("a", inspect.Parameter.POSITIONAL_ONLY, False), ("b", inspect.Parameter.POSITIONAL_OR_KEYWORD, False),
        ("args", inspect.Parameter.VAR_POSITIONAL, False), ("c", inspect.Parameter.KEYWORD_ONLY, True),
        ("kw", inspect.Parameter.VAR_KEYWORD, False)]
    assert embedded_signature("Some text.", "f") is None


@pytest.mark.skipif(NATIVES["resp"] is None, reason="kvcache._native.resp not built")
def test_a_stale_build_is_refused_where_the_choice_is_made(monkeypatch):
    """An extension without a member of its contract (built from an older .pyx) is broken:
    the twin serves, and says why; with extensions required, it is an error."""
    class Newer(native.Resp, Protocol):
        """The contract grown by a member the built extension has not."""

        def added_later(self) -> None: ...

    monkeypatch.setattr(native, "NO_EXTENSIONS", False)
    monkeypatch.setattr(native, "REQUIRE_EXTENSIONS", False)
    monkeypatch.setitem(native.CONTRACTS, "resp", Newer)
    monkeypatch.setitem(native.CHOSEN, "resp", native.CHOSEN.get("resp", "native"))  # restored after
    assert native.pick("resp", "resp") is TWINS["resp"]
    assert native.CHOSEN["resp"] == "twin (broken: lacks added_later (a stale build?))"
    monkeypatch.setattr(native, "REQUIRE_EXTENSIONS", True)
    with pytest.raises(native.MissingExtension, match="lacks added_later"):
        native.pick("resp", "resp")
