"""Decode SGLang scheduler side-channel payloads: LoadStat, KvMetrics, ForwardPassMetrics.

- LoadStat (S19+): frames `[b"load", seq, payload]`, payload the tagged array
  `["LoadStat", ...]` of 6 (S19) or 11 (S20+) elements.
- KvMetrics: one frame, the tagged array `["KvMetrics", 8 values]` (msgpack), or a pickle when
  the engine runs with SGLANG_USE_PICKLE_IPC (its default). Pickle is refused unless the caller
  opts in, and even then only the KvMetrics classes are accepted, mapped to a local stand-in.
- ForwardPassMetrics (S23): frames `[b"", seq, payload]`, payload a msgpack map.

Unknown map keys and trailing array elements are ignored. Every decoder raises WireError only.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec import Struct

from kvobserve.wire.errors import WireError, decode
from kvobserve.wire.kv_events import decode_seq

DEFAULT_MAX_SCHEDULER_PAYLOAD = 1024 * 1024
LOAD_TOPIC = b"load"


class LoadStat(Struct, array_like=True, tag="LoadStat", frozen=True, gc=False):
    """One rank's scheduler load; fields after `attn_dp_rank` are None on SGLang 0.5.19."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int  # KV tokens in use
    max_total_num_tokens: int  # KV capacity in tokens, 0 when unknown
    attn_dp_rank: int | None = None
    num_waiting_uncached_tokens: int | None = None
    num_total_tokens: int | None = None
    max_running_requests: int | None = None
    total_prefill_uncached_tokens: int | None = None  # cumulative
    total_prefill_busy_us: int | None = None  # cumulative


class KvMetrics(Struct, frozen=True, gc=False):
    """SGLang's pushed scheduler stats; `kv_*_blocks` are TOKEN counts despite their names."""

    request_active_slots: int
    request_total_slots: int
    kv_active_blocks: int
    kv_total_blocks: int
    num_requests_waiting: int
    gpu_cache_usage_perc: float
    gpu_prefix_cache_hit_rate: float
    data_parallel_rank: int | None = None


class _KvMetricsArr(KvMetrics, array_like=True, tag="KvMetrics", frozen=True, gc=False):
    pass


class ScheduledRequests(Struct, frozen=True, gc=False):
    """Requests in one forward pass."""

    num_prefill_requests: int
    sum_prefill_tokens: int
    var_prefill_length: float
    sum_prefill_kv_tokens: int
    num_decode_requests: int
    sum_decode_kv_tokens: int
    var_decode_kv_tokens: float


class QueuedRequests(Struct, frozen=True, gc=False):
    """Requests waiting at the time of one forward pass."""

    num_prefill_requests: int
    sum_prefill_tokens: int
    var_prefill_length: float
    num_decode_requests: int
    sum_decode_kv_tokens: int
    var_decode_kv_tokens: float


class ForwardPassMetrics(Struct, frozen=True, gc=False):
    """One forward pass (or an idle heartbeat: all zero, `wall_time` 0.0)."""

    version: int
    worker_id: str
    dp_rank: int
    counter_id: int
    wall_time: float
    scheduled_requests: ScheduledRequests
    queued_requests: QueuedRequests


_dec_load = msgspec.msgpack.Decoder(LoadStat)
_dec_kv_metrics = msgspec.msgpack.Decoder(_KvMetricsArr)
_dec_fpm = msgspec.msgpack.Decoder(ForwardPassMetrics)
_KV_METRICS_FIELDS: tuple[str, ...] = KvMetrics.__struct_fields__


def _seq_message(frames: Sequence[bytes], topic: bytes, what: str) -> tuple[int, bytes]:
    if len(frames) != 3:
        raise WireError("frame_count", f"{what}: {len(frames)} frames, expected 3")
    if frames[0] != topic:
        raise WireError(
            "frame_count", f"{what}: topic frame {bytes(frames[0])!r}, expected {topic!r}"
        )
    return decode_seq(frames[1]), frames[2]


def decode_load_stat(payload: bytes, max_payload: int = DEFAULT_MAX_SCHEDULER_PAYLOAD) -> LoadStat:
    """Decode a LoadStat payload (6 or 11 elements)."""
    return decode(_dec_load, payload, "LoadStat", max_payload)


def decode_load_message(
    frames: Sequence[bytes], max_payload: int = DEFAULT_MAX_SCHEDULER_PAYLOAD
) -> tuple[int, LoadStat]:
    """Decode `[b"load", seq, payload]` into (seq, LoadStat)."""
    seq, payload = _seq_message(frames, LOAD_TOPIC, "LoadStat")
    return seq, decode_load_stat(payload, max_payload)


def decode_forward_pass_metrics(
    payload: bytes, max_payload: int = DEFAULT_MAX_SCHEDULER_PAYLOAD
) -> ForwardPassMetrics:
    """Decode a ForwardPassMetrics map payload."""
    return decode(_dec_fpm, payload, "ForwardPassMetrics", max_payload)


def decode_forward_pass_message(
    frames: Sequence[bytes], max_payload: int = DEFAULT_MAX_SCHEDULER_PAYLOAD
) -> tuple[int, ForwardPassMetrics]:
    """Decode `[b"", seq, payload]` into (seq, ForwardPassMetrics)."""
    seq, payload = _seq_message(frames, b"", "ForwardPassMetrics")
    return seq, decode_forward_pass_metrics(payload, max_payload)


# --- KvMetrics pickles (opt-in) ------------------------------------------------------------

# where SGLang defined KvMetrics over time (S14-S23, S4.10-S8, S10-S12)
KV_METRICS_PICKLE_CLASSES = frozenset(
    {
        ("sglang.srt.managers.scheduler_components.kv_events_publisher", "KvMetrics"),
        ("sglang.srt.managers.scheduler_metrics_mixin", "KvMetrics"),
        ("sglang.srt.observability.scheduler_metrics_mixin", "KvMetrics"),
    }
)
# msgspec pickles kw_only Structs (S23's KvMetrics) as rebuild(cls, {field: value})
_MSGSPEC_REBUILD = ("msgspec._utils", "rebuild")


class _PickledKvMetrics:
    """Stand-in the restricted unpickler builds instead of SGLang's KvMetrics class."""

    __slots__ = ("args", "state")

    args: tuple[object, ...]
    state: dict[Any, Any]

    def __new__(cls, *args: object, **kwargs: object) -> _PickledKvMetrics:
        # NEWOBJ calls only __new__ (then BUILD); REDUCE calls the class: both land here
        self = super().__new__(cls)
        self.args = args
        self.state = dict(kwargs)
        return self

    def __setstate__(self, state: object) -> None:
        # plain classes pickle `__dict__`; classes with slots pickle (dict | None, slots_dict)
        if isinstance(state, tuple) and len(state) == 2:
            for part in state:
                if isinstance(part, dict):
                    self.state.update(part)
        elif isinstance(state, dict):
            self.state.update(state)
        else:
            raise WireError("schema", f"KvMetrics pickle state of type {type(state).__name__}")

    def fields(self) -> dict[Any, Any]:
        """Field values by name, positional arguments first."""
        out: dict[Any, Any] = dict(zip(_KV_METRICS_FIELDS, self.args, strict=False))
        out.update(self.state)
        return out


class _Rebuild:
    """Stand-in for msgspec's rebuild(cls, kwargs) that builds only the KvMetrics stand-in."""

    __slots__ = ()  # no __dict__: a BUILD opcode aimed at this helper cannot leave state on it

    def __call__(self, cls: object, kwargs: object) -> _PickledKvMetrics:
        if cls is not _PickledKvMetrics or not isinstance(kwargs, dict):
            raise WireError("pickle_forbidden", "msgspec rebuild of a class other than KvMetrics")
        return _PickledKvMetrics(**{str(k): v for k, v in kwargs.items()})

    def __setstate__(self, state: object) -> None:
        raise WireError("pickle_forbidden", "pickle sets state on the rebuild helper")


_rebuild = _Rebuild()


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the KvMetrics class paths (and msgspec's rebuild helper); nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in KV_METRICS_PICKLE_CLASSES:
            return _PickledKvMetrics
        if (module, name) == _MSGSPEC_REBUILD:
            return _rebuild
        raise WireError("pickle_forbidden", f"pickle names {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise WireError("pickle_forbidden", "pickle uses a persistent id")


_MEMO_INDEXED = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})


def _load_kv_metrics_pickle(payload: bytes) -> KvMetrics:
    # walk the opcodes first: every counted length is checked against the real data, so the
    # C unpickler never pre-allocates a size a forged header claims
    try:
        for ops, (op, arg, _) in enumerate(pickletools.genops(payload), 1):
            # the C unpickler sizes its memo table by the largest index a PUT names: a forged
            # index (2**31) would reserve gigabytes; a real pickle never names more slots than
            # it has opcodes
            if op.name in _MEMO_INDEXED and isinstance(arg, int) and arg > ops:
                raise WireError("schema", f"KvMetrics pickle: memo index {arg} out of range")
    except WireError:
        raise
    except Exception as exc:  # genops raises ValueError and friends on malformed input
        raise WireError("schema", f"KvMetrics pickle: {exc!r}") from None
    try:
        obj = _RestrictedUnpickler(io.BytesIO(payload)).load()
    except WireError:
        raise
    except Exception as exc:  # only our stand-in is callable, so this is malformed input
        raise WireError("schema", f"KvMetrics pickle: {exc!r}") from None
    if not isinstance(obj, _PickledKvMetrics):
        raise WireError("schema", f"KvMetrics pickle holds a {type(obj).__name__}")
    try:
        return msgspec.convert(obj.fields(), KvMetrics)
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        raise WireError("schema", f"KvMetrics pickle: {exc}") from None


def decode_kv_metrics(
    payload: bytes, allow_pickle: bool = False, max_payload: int = DEFAULT_MAX_SCHEDULER_PAYLOAD
) -> KvMetrics:
    """Decode one KvMetrics frame (msgpack; pickle only with allow_pickle)."""
    if len(payload) > max_payload:
        raise WireError("oversize", f"KvMetrics of {len(payload)} bytes > limit {max_payload}")
    if payload[:1] == b"\x80":  # pickle PROTO opcode (in msgpack an empty map, never KvMetrics)
        if not allow_pickle:
            raise WireError("pickle_refused", "KvMetrics payload is a pickle; pickle is disabled")
        return _load_kv_metrics_pickle(payload)
    return decode(_dec_kv_metrics, payload, "KvMetrics", max_payload)
