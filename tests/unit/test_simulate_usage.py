"""Scheduler usage as the engines compute it: pages held by running requests, not cached pages."""

from __future__ import annotations

import zlib

from kvobserve.simulate.cache import PrefixCache, PromptLibrary, paginate
from kvobserve.simulate.config import SimConfig
from kvobserve.simulate.encoders import get_format
from kvobserve.simulate.sidechannels import load_stat_for
from kvobserve.simulate.stream import SimStream


def _stream(cfg: SimConfig, rank: int = 0) -> SimStream:
    """A rank's publisher instance exactly as SimulatedWorker builds it."""
    w = cfg.wire
    lib = PromptLibrary(cfg.seed, w.hash_kind, cfg.page_size, cfg.prompts, cfg.prefixes, cfg.zipf_s)
    seed = zlib.crc32(f"{cfg.seed}/{cfg.worker_id}/{rank}.0".encode())
    return SimStream(
        w, f"{rank}.0", "primary", rank, rank, b"", lib, seed, cfg.capacity_tokens, cfg.page_size,
        cfg.buffer_steps, cfg.faults, cfg.requests_per_batch, cfg.output_tokens, cfg.flush_every,
        cfg.max_running_requests,
    )  # fmt: skip


def _held_union(s: SimStream) -> int:
    """Tokens of the union of every running request's pages, counted independently of the cache."""
    pages = {h for held in s._live.values() for h in held}
    return sum(s.cache.nodes[h].tokens for h in pages)


def test_shared_pages_count_once_and_locked_leaves_are_not_evicted() -> None:
    c = PrefixCache(64)
    a = paginate("int64", list(range(32)), 16)
    b = paginate("int64", list(range(16)) + list(range(100, 116)), 16)  # shares a's first page
    c.insert(a)
    c.insert(b)
    c.lock([p.hash for p in a])
    c.lock([p.hash for p in b])
    assert (c.used_tokens, c.locked_tokens) == (48, 48)  # the shared root page once
    c.unlock([p.hash for p in b])
    assert c.locked_tokens == 32
    # b's leaf is evictable, a's locked leaf is not, although a is older
    res = c.insert(paginate("int64", list(range(200, 232)), 16))
    assert res.evicted == [[b[1].hash]] and len(res.stored) == 2
    assert {p.hash for p in a} <= c.resident()
    c.unlock([p.hash for p in a])
    assert c.locked_tokens == 0
    assert c.demand(a) == 32 and c.demand(paginate("int64", list(range(300, 316)), 16)) == 16


def test_default_workload_usage_is_running_requests_not_a_warm_cache() -> None:
    cfg = SimConfig(format="sglang-0.5.23")
    s = _stream(cfg)
    usage, resident = [], []
    for i in range(3000):
        s.next_batch(float(i))
        if i % 50 == 0:
            assert s.held_tokens == _held_union(s)
        usage.append(s.held_tokens / cfg.capacity_tokens)
        resident.append(s.cache.used_tokens / cfg.capacity_tokens)
    warm = usage[500:]
    assert max(resident) == 1.0  # the prefix cache fills up, as a real one does
    assert 0.1 < sum(warm) / len(warm) < 0.5 and max(warm) < 0.9
    assert s.preempted == 0 and s.running > 0


def test_memory_pressure_preempts_and_usage_never_passes_capacity() -> None:
    cfg = SimConfig(format="vllm-0.33", capacity_tokens=1024)
    s = _stream(cfg)
    for i in range(1500):
        s.next_batch(float(i))
        assert s.held_tokens <= cfg.capacity_tokens
        assert s.held_tokens == _held_union(s)
    assert s.preempted > 0


def test_a_flush_frees_every_page_and_the_requests_run_on() -> None:
    cfg = SimConfig(format="sglang-0.5.19", flush_every=100)
    s = _stream(cfg)
    for i in range(100):
        s.next_batch(float(i))
    running, held = s.running, s.held_tokens
    assert running > 0 and held > 0
    s.next_batch(100.0)  # seq 100: AllBlocksCleared
    assert s.cache.used_tokens == 0 and s.held_tokens == 0 and s.running >= running - 2


def test_load_stat_reports_held_tokens() -> None:
    stat = load_stat_for(
        get_format("sglang-0.5.23").version, running=3, waiting=1, used_tokens=700,
        capacity_tokens=4096, rank=2, waiting_uncached_tokens=16, max_running=48,
        prefill_uncached_total=5, prefill_busy_us_total=25,
    )  # fmt: skip
    assert (stat.num_tokens, stat.max_total_num_tokens, stat.num_total_tokens) == (700, 4096, 716)
