"""SGLang scheduler side channels: the `load` PUB (LoadStat) and the KvMetrics PUSH, byte-exact."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import zmq
from msgspec import Struct

from kvobserve.simulate.engines.sglang import LOAD_STAT_FULL
from kvobserve.simulate.stream import PREFILL_US_PER_TOKEN

if TYPE_CHECKING:
    from kvobserve.simulate.ranks import Node

LOAD_TOPIC = b"load"


class LoadStat(Struct, array_like=True, tag=True, gc=False):
    """SGLang >= 0.5.20 LoadStat: an 11-element tagged positional array."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    max_total_num_tokens: int
    attn_dp_rank: int
    num_waiting_uncached_tokens: int
    num_total_tokens: int
    max_running_requests: int
    total_prefill_uncached_tokens: int
    total_prefill_busy_us: int


class LoadStat19(Struct, array_like=True, tag="LoadStat", gc=False):
    """SGLang 0.5.19 LoadStat: only the first 5 fields (6 elements with the tag)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    max_total_num_tokens: int
    attn_dp_rank: int


class KvMetrics(Struct, tag=True, kw_only=True, array_like=True, gc=False):
    """SGLang KvMetrics (msgpack mode); kv_*_blocks hold TOKEN counts, as in the engine."""

    request_active_slots: int
    request_total_slots: int
    kv_active_blocks: int
    kv_total_blocks: int
    num_requests_waiting: int
    gpu_cache_usage_perc: float
    gpu_prefix_cache_hit_rate: float
    data_parallel_rank: int


_encoder = msgspec.msgpack.Encoder()


def encode_load(stat: LoadStat | LoadStat19) -> bytes:
    """The LoadStat payload frame."""
    return _encoder.encode(stat)


def encode_kv_metrics(m: KvMetrics) -> bytes:
    """The single KvMetrics frame a scheduler's PUSH sends."""
    return _encoder.encode(m)


def load_stat_for(
    version: tuple[int, int],
    *,
    running: int,
    waiting: int,
    used_tokens: int,
    capacity_tokens: int,
    rank: int,
    waiting_uncached_tokens: int,
    max_running: int,
    prefill_uncached_total: int,
    prefill_busy_us_total: int,
) -> LoadStat | LoadStat19:
    """The LoadStat of this SGLang version for one rank's current state."""
    if version < LOAD_STAT_FULL:
        return LoadStat19(running, waiting, used_tokens, capacity_tokens, rank)
    return LoadStat(
        running,
        waiting,
        used_tokens,
        capacity_tokens,
        rank,
        waiting_uncached_tokens,
        used_tokens + waiting_uncached_tokens,
        max_running,
        prefill_uncached_total,
        prefill_busy_us_total,
    )


def emit_side_channels(w: Node) -> None:
    """Send one LoadStat and one KvMetrics per hosted rank; capacity is the same number in both."""
    c = w.cfg
    for st in w.ranks:
        s = st.streams[0]
        used = s.held_tokens  # locked by running requests; evictable cached pages count as free
        if st.load is not None:
            stat = load_stat_for(
                w.fmt.version, running=s.running, waiting=s.waiting, used_tokens=used,
                capacity_tokens=c.capacity_tokens, rank=st.rank,
                waiting_uncached_tokens=s.waiting * c.page_size, max_running=s.max_running,
                prefill_uncached_total=s.prefill_uncached_tokens,
                prefill_busy_us_total=s.prefill_uncached_tokens * PREFILL_US_PER_TOKEN,
            )  # fmt: skip
            st.load.send_multipart([LOAD_TOPIC, st.load_seq.to_bytes(8, "big"), encode_load(stat)])
            st.load_seq += 1
        if st.push is not None:
            usage = used / c.capacity_tokens
            msg = KvMetrics(
                request_active_slots=s.running, request_total_slots=s.max_running,
                kv_active_blocks=int(usage * c.capacity_tokens), kv_total_blocks=c.capacity_tokens,
                num_requests_waiting=s.waiting, gpu_cache_usage_perc=usage,
                gpu_prefix_cache_hit_rate=s.batch_hit_rate, data_parallel_rank=st.rank,
            )  # fmt: skip
            try:
                st.push.send(encode_kv_metrics(msg), zmq.NOBLOCK)
            except zmq.Again:
                st.side_dropped += 1  # no consumer bound yet and the pipe is full
