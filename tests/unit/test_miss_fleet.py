"""The miss split fleet-wide: collectors' samplers, the aggregator's merge, trust, hits, export."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.miss_fleet import MissMerge
from kvobserve.analysis.miss_sample import MissSampler
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.export.api import misses_json
from kvobserve.export.prometheus import FleetCollector
from kvobserve.sources.miss_stats import MissSamplers, pool_of
from kvobserve.wire.kv_events import BlockRemoved, BlockStored, KvBatch
from kvobserve.wire.misses import MissDelta, MissFeedback, decode_feedback, encode_feedback
from kvobserve.wire.snapshot import (
    CollectorInfo,
    PrefixCounters,
    Snapshot,
    StreamStats,
    WorkerInfo,
)

SPREAD = 0x9E3779B97F4A7C15  # hashes spread over the key space, as the engines' are
T0 = 1000.0


def _h(i: int) -> int:
    """An unsigned 64-bit hash in the sample at level 0."""
    return (i * SPREAD) % (1 << 64)


def _batch(seq: int, ts: float, *events: object) -> KvBatch:
    return KvBatch("", seq, ts, 0, list(events))  # type: ignore[arg-type]


def _store(*hashes: int) -> BlockStored:
    return BlockStored(list(hashes), None, 16)


class Node:
    """One collector of pool `p` (workers w0 and w1), its ranks' sequencers tapped."""

    def __init__(self, cid: str, ranks: list[tuple[str, int]], floor: int = 10**6) -> None:
        self.cid = cid
        self.samplers = MissSamplers({"w0": "p", "w1": "p"}, floor=floor)
        self.seqs = {}
        for w, r in ranks:
            seq = StreamSequencer(r, replay=False)
            self.samplers.attach(w, r, "vllm", seq)
            self.seqs[(w, r)] = seq
        for s in self.samplers.samplers.values():
            s.level = 0  # every block in the sample
            s._set_limit()
        self.n = 0
        self.streams = [StreamStats(w, r, up=True, trust="complete", block_size=16)
                        for w, r in ranks]  # fmt: skip

    def apply(self, rank: tuple[str, int], ts: float, *events: object) -> None:
        seq = self.seqs[rank]
        seq.on_batch(_batch(seq.batches_applied, ts, *events), b"", ts)

    def snapshot(self, until: float, **kw: object) -> Snapshot:
        self.n += 1
        workers = sorted({w for w, _ in self.seqs})
        return Snapshot(
            CollectorInfo(self.cid, 0, "h", 1.0), seq=self.n, time=until, interval_s=1.0,
            workers=[WorkerInfo(w, "vllm", len(rs), rs)
                     for w in workers for rs in [[r for x, r in self.seqs if x == w]]],
            streams=self.streams, misses=self.samplers.deltas(until), **kw,  # type: ignore[arg-type]
        )  # fmt: skip


def _fleet() -> tuple[FleetState, Node, Node]:
    state = FleetState()
    state.misses = MissMerge(floor=2, start_level=0)  # every block in the sample
    a = Node("a", [("w0", 0), ("w0", 1)])
    b = Node("b", [("w1", 0)])
    return state, a, b


def test_two_collectors_classify_each_store_of_the_pool() -> None:
    state, a, b = _fleet()
    a.apply(("w0", 0), T0 + 1, _store(_h(1), _h(2)))  # new: compulsory
    b.apply(("w1", 0), T0 + 2, _store(_h(1)))  # on w0 rank 0 (another collector): placement
    a.apply(("w0", 0), T0 + 3, BlockRemoved([_h(2)]))
    a.apply(("w0", 1), T0 + 4, _store(_h(2)))  # resident before, nowhere now: capacity
    for t, node in ((T0 + 5, a), (T0 + 5, b)):
        state.update(node.snapshot(t), t)
    v = state.view(T0 + 5)
    p = v.misses["p"]
    assert [w.worker_id for w in p.workers] == ["w0", "w1"]
    assert p.misses() == {"compulsory": 2.0, "capacity": 1.0, "placement": 1.0}
    w1 = next(w for w in p.workers if w.worker_id == "w1")
    assert w1.misses == {"compulsory": 0.0, "capacity": 0.0, "placement": 1.0}
    assert p.shares == {"compulsory": 0.5, "capacity": 0.25, "placement": 0.25}
    assert p.trusted, p.reason
    assert p.as_of == T0 + 5
    # the window holds everything since the pool's first delta
    assert p.recent is not None and p.recent.misses == p.misses()


def test_a_collector_down_is_waited_for_no_longer_and_the_split_says_so() -> None:
    state, a, b = _fleet()
    state.update(b.snapshot(T0), T0)  # b reports once, then goes silent
    a.apply(("w0", 0), T0 + 10, _store(_h(1)))
    state.update(a.snapshot(T0 + 11), T0 + 11)
    assert state.misses.pools["p"].split.pending == 1  # held until b's `until` passes it
    v = state.view(T0 + 11)  # b silent for 11 s: down
    p = v.misses["p"]
    assert p.misses()["compulsory"] == 1.0  # applied without waiting for b
    assert p.reasons == ("collector_down", "few_samples") and "b down" in p.reason
    doc = misses_json(v)["pools"][0]
    assert doc["trusted"] is False and doc["reasons"] == ["collector_down", "few_samples"]


def test_a_lost_delta_asks_for_a_full_one_and_trust_comes_back() -> None:
    state, a, b = _fleet()
    a.apply(("w0", 0), T0 + 1, _store(_h(1), _h(2)))
    state.update(a.snapshot(T0 + 1), T0 + 1)
    state.update(b.snapshot(T0 + 1), T0 + 1)
    a.apply(("w0", 0), T0 + 2, BlockRemoved([_h(1)]))
    a.snapshot(T0 + 2)  # lost on the way: the merge still holds h1 on w0 rank 0
    a.apply(("w0", 0), T0 + 3, _store(_h(3)))
    state.update(a.snapshot(T0 + 3), T0 + 3)
    state.update(b.snapshot(T0 + 3), T0 + 3)
    p = state.view(T0 + 3).misses["p"]
    assert not p.trusted and p.reasons == ("deltas_lost",)
    fb = decode_feedback(encode_feedback(state.misses.feedback(T0 + 3)))
    assert fb == MissFeedback({"p": 0}, {"a": ["p"]})
    assert state.misses.feedback(T0 + 4).resync == {}  # asked again only after 10 s
    a.samplers.follow(fb, "a")
    b.samplers.follow(fb, "b")  # not asked: sends no full delta
    snap = a.snapshot(T0 + 4)
    assert [d.full for d in snap.misses] == [False, True]
    state.update(snap, T0 + 4)
    state.update(b.snapshot(T0 + 4), T0 + 4)
    b.apply(("w1", 0), T0 + 5, _store(_h(1)))  # h1 left rank 0 (the full delta said): capacity
    state.update(a.snapshot(T0 + 6), T0 + 6)
    state.update(b.snapshot(T0 + 6), T0 + 6)
    p = state.view(T0 + 6).misses["p"]
    assert p.trusted
    assert next(w for w in p.workers if w.worker_id == "w1").misses["capacity"] == 1.0


def test_a_rank_partial_or_too_few_samples_is_told() -> None:
    state, a, b = _fleet()
    state.misses = MissMerge(floor=100, start_level=0)
    a.streams[1].trust = "partial"
    a.apply(("w0", 0), T0 + 1, _store(_h(1)))
    state.update(a.snapshot(T0 + 1), T0 + 1)
    state.update(b.snapshot(T0 + 1), T0 + 1)
    p = state.view(T0 + 1).misses["p"]
    assert p.reasons == ("rank_partial", "few_samples")
    assert "w0 rank 1" in p.reason and "1 sampled misses (< 100)" in p.reason


def test_hits_from_the_engines_counters_in_blocks_and_the_families() -> None:
    state, a, b = _fleet()
    a.apply(("w0", 0), T0 + 1, _store(_h(1), _h(2)))
    b.apply(("w1", 0), T0 + 2, _store(_h(1)))
    # w0: the whole worker's counters (SGLang's tokenizer); w1: per rank (vLLM)
    state.update(a.snapshot(T0 + 3, prefix=[PrefixCounters("w0", -1, 320.0, 1000.0)]), T0 + 3)
    state.update(b.snapshot(T0 + 3, prefix=[PrefixCounters("w1", 0, 64.0, 500.0)]), T0 + 3)
    v = state.view(T0 + 3)
    w0, w1 = v.misses["p"].workers
    assert (w0.hit_blocks, w1.hit_blocks) == (20.0, 4.0)  # tokens / 16
    r = CollectorRegistry()
    r.register(FleetCollector(lambda: v))
    fam = "kvobserve_worker_kv_lookups_total"

    def got(w: str, result: str) -> float | None:
        return r.get_sample_value(fam, {"worker_id": w, "pool": "p", "result": result})

    assert (got("w0", "hit"), got("w0", "compulsory"), got("w0", "placement")) == (20, 2, 0)
    assert (got("w1", "hit"), got("w1", "placement")) == (4, 1)
    # the engines' own counters, for a hit rate over any window (not the last batch's ratio)
    engine = "kvobserve_worker_prefix_cache_tokens_total"
    assert [r.get_sample_value(engine, {"worker_id": w, "tokens": t})
            for w in ("w0", "w1") for t in ("hit", "queried")] == [320, 1000, 64, 500]  # fmt: skip
    untrusted = "kvobserve_pool_kv_miss_split_untrusted"
    assert r.get_sample_value(untrusted, {"pool": "p", "reason": "few_samples"}) is None
    tokens = "kvobserve_worker_kv_lookup_tokens_total"
    assert r.get_sample_value(tokens, {"worker_id": "w0", "pool": "p", "result": "hit"}) is None
    detail = CollectorRegistry()
    detail.register(FleetCollector(lambda: v, per_stream_detail=True))
    labels = {"worker_id": "w0", "pool": "p", "result": "compulsory"}
    assert detail.get_sample_value(tokens, labels) == 32  # 2 blocks of 16 tokens


def test_a_pod_is_in_its_workers_pool_and_a_level_from_the_aggregator_is_followed() -> None:
    pools = {"llm": "chat", "a/b": "x"}
    assert pool_of(pools, "llm") == "chat"
    assert pool_of(pools, "llm/pod-7") == "chat"  # a pod of a [worker.kubernetes] selector
    assert pool_of(pools, "a/b/pod") == "x"
    assert pool_of(pools, "other") == "other"
    s = MissSampler("chat", signed=False, start_level=0)
    s.follow(3)
    s.follow(1)  # never lower
    assert s.level == 3
    d = s.delta(T0)
    assert isinstance(d, MissDelta) and d.level == 3 and d.pool == "chat"


def test_a_pool_whose_collectors_are_all_forgotten_goes() -> None:
    state, a, b = _fleet()
    state.forget_after_s = 100.0
    a.apply(("w0", 0), T0 + 1, _store(_h(1)))
    state.update(a.snapshot(T0 + 1, prefix=[PrefixCounters("w0", -1, 16.0, 32.0)]), T0 + 1)
    state.update(b.snapshot(T0 + 1), T0 + 1)
    assert set(state.view(T0 + 50).misses) == {"p"}
    state.update(b.snapshot(T0 + 120), T0 + 120)  # a is forgotten, b still reports
    assert set(state.view(T0 + 121).misses) == {"p"}
    assert state.view(T0 + 300).misses == {}  # both forgotten
    assert state.misses.prefix == {} and state.misses.pools == {}
