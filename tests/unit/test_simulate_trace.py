"""Trace replay in the simulator: the Mooncake fixture's facts, routing, pages, bad input."""

from __future__ import annotations

import gzip
import math
from collections import OrderedDict
from functools import cache
from pathlib import Path

import pytest

from kvobserve.simulate import SimConfig
from kvobserve.simulate.replay import replay_offline
from kvobserve.simulate.trace import (
    TRACE_BLOCK_TOKENS,
    TraceRequest,
    page_hash,
    read_trace,
    request_pages,
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "traces" / "mooncake-conversation.jsonl.gz"
UNLIMITED = 10**9  # tokens: more than the whole trace's 147.7M prompt tokens


@cache
def _trace(seconds: float = 0.0) -> tuple[TraceRequest, ...]:
    return tuple(read_trace(str(FIXTURE), seconds))


def test_the_fixture_is_the_published_conversation_trace() -> None:
    reqs = _trace()
    assert len(reqs) == 12_031
    assert sum(len(r.hash_ids) for r in reqs) == 288_500
    assert len({h for r in reqs for h in r.hash_ids}) == 182_790
    assert reqs[-1].timestamp_ms - reqs[0].timestamp_ms == 3_536_999


@pytest.mark.slow
def test_the_whole_trace_on_one_rank_with_unlimited_capacity_hits_what_the_ids_say() -> None:
    """Acceptance: 105,710 of 288,500 lookups hit (36.64 %), 182,790 compulsory (63.36 %)."""
    run = replay_offline(_trace(), ranks=1, capacity_tokens=UNLIMITED, page_size=512)
    pool = run.replay.truth()["pool"]
    want = {"lookups": 288_500, "hits": 105_710, "compulsory": 182_790, "capacity": 0,
            "placement": 0}  # fmt: skip
    assert pool["blocks"] == want
    assert pool["pages"] == want  # one page per block: the units agree
    assert round(100 * want["hits"] / want["lookups"], 2) == 36.64
    assert pool["unstored_pages"] == 0


def _expected_by_ids(reqs: tuple[TraceRequest, ...], page_size: int, partial: bool) -> tuple:
    """Hits and lookups of one cache that never evicts, from the ids alone (independently):
    a block hits when its id was seen before and the engine caches some page of it."""
    seen: set[int] = set()
    blocks = [0, 0]  # lookups, hits
    pages = [0, 0]
    for r in reqs:
        for i, b in enumerate(r.hash_ids):
            n = r.block_tokens(i)
            cached = math.ceil(n / page_size) if partial else n // page_size
            blocks[0] += 1
            pages[0] += cached
            if b in seen and cached:
                blocks[1] += 1
                pages[1] += cached
            seen.add(b)
    return tuple(blocks), tuple(pages)


@pytest.mark.parametrize(("fmt", "partial"), [("sglang-0.5.23", True), ("vllm-0.33", False)])
def test_engine_pages_of_16_tokens_hit_what_the_ids_say(fmt: str, partial: bool) -> None:
    reqs = _trace(60.0)
    run = replay_offline(reqs, format=fmt, ranks=1, capacity_tokens=UNLIMITED, page_size=16)
    pool = run.replay.truth()["pool"]
    (b_look, b_hit), (p_look, p_hit) = _expected_by_ids(reqs, 16, partial)
    assert (pool["blocks"]["lookups"], pool["blocks"]["hits"]) == (b_look, b_hit)
    assert (pool["pages"]["lookups"], pool["pages"]["hits"]) == (p_look, p_hit)
    assert pool["blocks"]["compulsory"] == b_look - b_hit  # nothing else without eviction
    assert pool["pages"]["compulsory"] == p_look - p_hit
    if not partial:  # vLLM caches no block shorter than one page: such a block never hits
        assert any(r.block_tokens(len(r.hash_ids) - 1) < 16 for r in reqs)


def _lru_fact(reqs: tuple[TraceRequest, ...], capacity_tokens: int) -> float:
    """The README's independent fact: one LRU cache of blocks, leading-run hits."""
    cache: OrderedDict[int, None] = OrderedDict()
    cap = capacity_tokens // TRACE_BLOCK_TOKENS
    hits = total = 0
    for r in reqs:
        run = True
        for b in r.hash_ids:
            total += 1
            if run and b in cache:
                hits += 1
            else:
                run = False
            cache[b] = None
            cache.move_to_end(b)
            while len(cache) > cap:
                cache.popitem(last=False)
    return 100 * hits / total


@pytest.mark.slow
@pytest.mark.parametrize(("tokens", "fact"), [(3_000_000, 13.6), (10_000_000, 28.5),
                                              (50_000_000, 36.4)])  # fmt: skip
def test_one_lru_cache_is_within_a_point_of_the_trace_facts(tokens: int, fact: float) -> None:
    """The simulator (a radix cache evicting unpinned leaves, tokens counted exactly) against
    the README's flat LRU of whole blocks: the policies differ a little, the facts hold."""
    reqs = _trace()
    assert round(_lru_fact(reqs, tokens), 1) == fact
    run = replay_offline(reqs, ranks=1, capacity_tokens=tokens, page_size=512)
    b = run.replay.truth()["pool"]["blocks"]
    assert abs(100 * b["hits"] / b["lookups"] - fact) < 1.0
    assert b["compulsory"] == 182_790  # eviction changes hits into capacity misses only
    assert b["hits"] + b["capacity"] == 105_710
    assert b["placement"] == 0  # one rank


@pytest.mark.slow
def test_routes_place_misses_where_the_router_sends_them() -> None:
    reqs = _trace(300.0)
    shares = {}
    for route in ("round_robin", "random", "kv_aware"):
        run = replay_offline(reqs, ranks=4, capacity_tokens=UNLIMITED, page_size=64, route=route)
        t = run.replay.truth()
        b = t["pool"]["blocks"]
        assert b["capacity"] == 0  # unlimited capacity: nothing was ever evicted
        assert b["lookups"] == sum(len(r.hash_ids) for r in reqs)
        assert b["lookups"] == b["hits"] + b["compulsory"] + b["placement"]
        for unit in ("blocks", "pages"):
            for k, v in t["pool"][unit].items():
                assert v == sum(rank[unit][k] for rank in t["ranks"].values())
        assert sum(rank["requests"] for rank in t["ranks"].values()) == len(reqs)
        shares[route] = b["placement"] / b["lookups"]
        if route == "round_robin":
            counts = [rank["requests"] for rank in t["ranks"].values()]
            assert max(counts) - min(counts) <= 1
    assert shares["random"] > 0.05  # a random router recomputes what another rank holds
    assert shares["kv_aware"] < shares["random"] / 5


def test_kv_aware_follows_the_prefix_and_passes_over_an_overloaded_rank() -> None:
    def req(ts: int, ids: list[int]) -> TraceRequest:
        return TraceRequest(ts, 512 * len(ids), 1000, tuple(ids))

    # long decodes (50 s at 20 tokens/s): every request is still in flight at the next one
    prefix = [req(0, [1, 2]), req(1, [3]), req(2, [1, 2, 4]), req(3, [3, 5])]
    run = replay_offline(prefix, ranks=2, capacity_tokens=UNLIMITED, page_size=512,
                         route="kv_aware")  # fmt: skip
    # 1: both empty, equal load -> rank 0; 2: rank 1 has less load; 3 and 4 follow their prefix
    assert [t.requests for t in run.replay.ranks] == [2, 2]
    assert run.replay.truth()["pool"]["blocks"]["hits"] == 3
    crowd = [req(i, [7, 100 + i]) for i in range(12)]  # everyone shares block 7
    run = replay_offline(crowd, ranks=2, capacity_tokens=UNLIMITED, page_size=512,
                         route="kv_aware")  # fmt: skip
    # the prefix draws requests to rank 0 until it has 8 more in flight than rank 1 (9 of
    # them); then rank 1 gets one, holds the prefix too, and load decides between equals
    assert [t.requests for t in run.replay.ranks] == [9, 3]


def test_page_hashes_are_deterministic_and_of_each_engines_type() -> None:
    assert page_hash("int64", 5, 0, 16) == page_hash("int64", 5, 0, 16)
    assert page_hash("int64", 5, 0, 16) != page_hash("int64", 5, 1, 16)
    assert page_hash("int64", 5, 0, 16) != page_hash("int64", 5, 0, 4)  # a short page differs
    assert -(2**63) <= page_hash("int64", 7, 3, 16) < 2**63  # type: ignore[operator]
    assert any(page_hash("int64", b, 0, 16) < 0 for b in range(8))  # type: ignore[operator]
    assert any(page_hash("uint64", b, 0, 16) >= 2**63 for b in range(8))  # type: ignore[operator]
    blob = page_hash("bytes32", 7, 3, 16)
    assert isinstance(blob, bytes) and len(blob) == 32
    r = TraceRequest(0, 512 + 40, 1, (9, 10))
    sg = request_pages(r, "int64", 16, keep_partial=True)
    vl = request_pages(r, "uint64", 16, keep_partial=False)
    assert sg.ends == [32, 35] and vl.ends == [32, 34]  # 40 tokens: 2 full pages + 8 (SGLang)
    assert [len(p.tokens) for p in sg.pages[32:]] == [16, 16, 8]
    assert len({p.hash for p in sg.pages}) == 35


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "t.jsonl:2: not JSON"),
        ('[1, 2]', "t.jsonl:2: list is not a JSON object"),
        ('{"timestamp": 5, "output_length": 1, "hash_ids": [1]}', "t.jsonl:2: input_length None"),
        ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
         "timestamp -1 must be an integer >= 0"),
        ('{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
         "input_length 600 needs 2 blocks of 512 tokens, hash_ids has 1"),
        ('{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}',
         "hash_ids \\['a'\\] must be a list of integers"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
         "t.jsonl:2: timestamp 0 is before the previous 3"),
    ],
)  # fmt: skip
def test_a_bad_trace_line_is_named_with_its_field(tmp_path: Path, line: str, needle: str) -> None:
    good = '{"timestamp": 3, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    path = _write(tmp_path / "t.jsonl", [good, line])
    with pytest.raises(ValueError, match=needle):
        read_trace(path)


def test_plain_and_gzipped_traces_read_alike_and_seconds_cut_the_start(tmp_path: Path) -> None:
    with gzip.open(FIXTURE, "rt") as f:
        head = [next(f).rstrip("\n") for _ in range(400)]
    plain = _write(tmp_path / "head.jsonl", head)
    reqs = read_trace(plain)
    assert tuple(reqs) == _trace()[:400]
    cut = read_trace(plain, seconds=30)
    assert cut and all(r.timestamp_ms < 30_000 for r in cut)
    assert reqs[len(cut)].timestamp_ms >= 30_000
    with pytest.raises(ValueError, match=r"trace: .*nope\.jsonl"):
        read_trace(str(tmp_path / "nope.jsonl"))
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz: unreadable"):
        read_trace(str(tmp_path / "bad.jsonl.gz"))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"route": "nearest"}, "route: 'nearest' is not round_robin, random, kv_aware"),
        ({"speed": -1.0}, "speed: -1.0 must be a number >= 0"),
        ({"trace": "t.jsonl", "page_size": 24}, "page_size: 24 must divide the trace's 512"),
        ({"trace": "t.jsonl", "event_plane": "zmq"}, "trace: a replayed trace publishes"),
    ],
)
def test_trace_settings_are_checked(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SimConfig(**kw).validate()  # type: ignore[arg-type]
