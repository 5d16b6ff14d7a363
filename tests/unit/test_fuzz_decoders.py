"""Property tests: random and mutated input makes every wire decoder raise WireError, nothing else."""

from __future__ import annotations

import json
import pickle
import random
import sys
import types
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvobserve.wire.errors import REASONS, WireError
from kvobserve.wire.kv_events import decode_message, decode_payload
from kvobserve.wire.kv_view import batch_view
from kvobserve.wire.replay import decode_replay_message
from kvobserve.wire.scheduler import (
    decode_forward_pass_message,
    decode_kv_metrics,
    decode_load_message,
)
from tests.examples import examples
from tests.unit.test_captures import CAPTURES, KV_FOLDERS, load_lines

FUZZ = settings(
    max_examples=examples(10_000),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# headers that claim 2^32-1 elements or bytes: array32, map32, bin32, str32, ext32
HUGE = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"]
HUGE += [b"\xdb\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff", b"\xde\xff\xff"]
HUGE += [b"\x91" * 3000, b"\x81\xa1k" * 1000]  # nesting deeper than any recursion limit
# wrong-typed values dropped into a valid structure
ODD: list[Any] = [None, True, -1, 2**64 - 1, -(2**63), 1.5, "", "BlockStored", b"\x00" * 32]
ODD += [[], {}, [None], {"type": "BlockStored"}, {1: 2}, ["AllBlocksCleared"], [[[[[]]]]]]


def _kv_frames() -> tuple[list[list[bytes]], list[list[bytes]]]:
    live: list[list[bytes]] = []
    replay: list[list[bytes]] = []
    for name in KV_FOLDERS:
        for ln in load_lines(CAPTURES / name):
            (live if ln["source"] == "live" else replay).append(ln["frames"])
    return live, replay


def _side(name: str) -> list[list[bytes]]:
    return [ln["frames"] for ln in load_lines(CAPTURES / "sglang-0.5.23" / name)]


def _kv_metrics_pickles() -> list[bytes]:
    """Pickles of a plain-class and a msgspec-Struct KvMetrics, made with throwaway modules."""
    path = "sglang.srt.managers.scheduler_components.kv_events_publisher"
    names = [".".join(path.split(".")[:i]) for i in range(1, path.count(".") + 2)]
    saved = {k: sys.modules.get(k) for k in names}
    for k in names:
        sys.modules.setdefault(k, types.ModuleType(k))
    mod = sys.modules[path]
    try:
        plain = type("KvMetrics", (), {"__module__": path, "__qualname__": "KvMetrics"})
        mod.KvMetrics = plain  # type: ignore[attr-defined]
        obj = plain()
        obj.__dict__.update(request_active_slots=1, gpu_cache_usage_perc=0.5, data_parallel_rank=0)
        out = [pickle.dumps(obj)]
        fields = [("request_active_slots", int), ("gpu_cache_usage_perc", float)]
        for kw_only in (True, False):
            cls = msgspec.defstruct("KvMetrics", fields, tag=True, kw_only=kw_only, module=path)
            mod.KvMetrics = cls  # type: ignore[attr-defined]
            out.append(pickle.dumps(cls(request_active_slots=1, gpu_cache_usage_perc=0.5)))
        return out
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


LIVE, REPLAY = _kv_frames()
KV_PAYLOADS = [f[2] for f in LIVE]
LOAD = _side("load")
FPM = _side("forward_pass_metrics")
KVM = [f[0] for f in _side("kv_metrics")] + _kv_metrics_pickles()


# Each example draws one seed and builds its input with random.Random(seed): one Hypothesis draw
# per example keeps 10,000 examples per decoder affordable on a 2-core machine.
SEEDS = st.integers(min_value=0, max_value=2**64 - 1)


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """Truncate, flip, insert, delete, or plant a header that claims a huge length."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        pos = rng.randint(0, len(buf))
        kind = rng.randrange(5)
        if kind == 0:
            del buf[pos:]
        elif kind == 1 and buf:
            buf[pos % len(buf)] ^= rng.randint(1, 255)
        elif kind == 2:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 6))
        elif kind == 3:
            buf[pos:pos] = rng.choice(HUGE)
        else:
            del buf[pos : pos + rng.randint(1, 8)]
    return bytes(buf)


def _restructure(rng: random.Random, data: bytes) -> bytes:
    """Swap one nested value for a wrong-typed one, or add extra elements or keys."""
    obj = msgspec.msgpack.decode(data)
    node = obj
    for _ in range(rng.randint(0, 4)):
        if isinstance(node, list) and node:
            node = rng.choice(node)
        elif isinstance(node, dict) and node:
            node = node[rng.choice(list(node))]
    value = rng.choice(ODD)
    if isinstance(node, list):
        if node and rng.random() < 0.5:
            node[rng.randrange(len(node))] = value
        else:
            node.append(value)
    elif isinstance(node, dict):
        node[rng.choice(list(node)) if node and rng.random() < 0.5 else "extra"] = value
    else:
        obj = value
    return msgspec.msgpack.encode(obj)


def fuzz_payload(rng: random.Random, seeds: list[bytes]) -> bytes:
    """Random bytes, or a seed mutated at byte level or in its structure."""
    r = rng.random()
    if r < 0.1:
        return rng.randbytes(rng.randint(0, 64))
    seed = rng.choice(seeds)
    if r < 0.5:
        try:
            return _restructure(rng, seed)
        except msgspec.DecodeError:  # a pickle seed: mutate its bytes instead
            pass
    return _mutate(rng, seed)


def fuzz_frames(rng: random.Random, seeds: list[list[bytes]]) -> list[bytes]:
    """A seed message with its payload (or another frame) mutated, or frames dropped or added."""
    frames = list(rng.choice(seeds))
    r = rng.random()
    if r < 0.05:
        return [rng.randbytes(rng.randint(0, 12)) for _ in range(rng.randint(0, 5))]
    if r < 0.65:
        frames[-1] = fuzz_payload(rng, [frames[-1]])
    elif r < 0.85:
        i = rng.randrange(len(frames))
        frames[i] = _mutate(rng, frames[i])
    elif r < 0.93:
        del frames[rng.randrange(len(frames))]
    else:
        frames.insert(rng.randint(0, len(frames)), rng.randbytes(rng.randint(0, 9)))
    return frames


def tap_view(payload: bytes) -> str:
    """What `kvobserve tap` prints for a payload: the hot-path decode, then the full view."""
    return json.dumps(batch_view(decode_payload("t", 1, payload), payload, token_ids=True))


def _kv_message(rng: random.Random) -> list[Any]:
    payload = fuzz_payload(rng, KV_PAYLOADS)
    return [
        (tap_view, (payload,), {}),
        (decode_message, (fuzz_frames(rng, LIVE),), {}),
    ]


def _kv_metrics(rng: random.Random) -> list[Any]:
    if rng.random() < 0.1:  # pickle-looking garbage: PROTO opcode, a protocol, random opcodes
        payload = b"\x80" + bytes([rng.randint(0, 6)]) + rng.randbytes(rng.randint(0, 40))
    else:
        payload = fuzz_payload(rng, KVM)
    return [(decode_kv_metrics, (payload,), {"allow_pickle": rng.random() < 0.7})]


# decoder name -> builds (decoder, args, kwargs) calls from the example's random stream
CASES: dict[str, Callable[[random.Random], list[Any]]] = {
    "kv payload and message": _kv_message,
    "replay message": lambda rng: [(decode_replay_message, (fuzz_frames(rng, REPLAY), "t"), {})],
    "LoadStat": lambda rng: [(decode_load_message, (fuzz_frames(rng, LOAD),), {})],
    "KvMetrics": _kv_metrics,
    "ForwardPassMetrics": lambda rng: [(decode_forward_pass_message, (fuzz_frames(rng, FPM),), {})],
}


def _outcome(decode: Callable[..., object], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """ "ok", or the WireError reason; anything else raised fails with the input shown."""
    try:
        decode(*args, **kwargs)
    except WireError as exc:
        assert exc.reason in REASONS
        return exc.reason
    except Exception as exc:
        raise AssertionError(f"{decode.__name__}{(*args, kwargs)!r} raised {exc!r}") from exc
    return "ok"


# Hypothesis costs ~0.5-1 ms per example here whatever the strategy, so one test feeds every
# decoder its own input per example: 10,000 examples = 10,000 inputs for each decoder.
@FUZZ
@given(seed=SEEDS)
def test_every_decoder_raises_only_wire_error(seed: int) -> None:
    rng = random.Random(seed)
    for build in CASES.values():
        for decode, args, kwargs in build(rng):
            _outcome(decode, args, kwargs)


def test_fuzz_inputs_reach_success_and_each_error_path() -> None:
    # a mutator that only made garbage would pass the property test without testing much
    rng = random.Random(7)
    outcomes: dict[str, set[str]] = {name: set() for name in CASES}
    for _ in range(3000):
        for name, build in CASES.items():
            for call in build(rng):
                outcomes[name].add(_outcome(*call))
    framing = {"frame_count", "seq_length"}
    for name, seen in outcomes.items():
        wanted = {"ok", "msgpack", "schema"}
        wanted |= {"pickle_refused", "pickle_forbidden"} if name == "KvMetrics" else framing
        assert wanted <= seen, (name, seen)


BAD_UTF8 = b"\xa1\xc2"  # a 1-byte msgpack str that is not UTF-8


@pytest.mark.parametrize(
    "payload",
    [
        b"\x93\xcb" + bytes(8) + b"\x91\x91" + BAD_UTF8 + b"\x00",  # event tag (array form)
        b"\x93\xcb" + bytes(8) + b"\x91\x81\xa4type" + BAD_UTF8 + b"\x00",  # tag (map form)
        b"\x93\xcb" + bytes(8) + b"\x92\x91\xb0AllBlocksCleared\x91" + BAD_UTF8 + b"\x00",
    ],
)
def test_invalid_utf8_is_a_msgpack_error(payload: bytes) -> None:
    # found by the property test: msgspec raises UnicodeDecodeError, not DecodeError
    with pytest.raises(WireError) as info:
        decode_payload("t", 0, payload)
    assert info.value.reason == "msgpack"
    with pytest.raises(WireError) as info:
        decode_kv_metrics(b"\x99" + BAD_UTF8 + bytes(8))
    assert info.value.reason == "msgpack"
