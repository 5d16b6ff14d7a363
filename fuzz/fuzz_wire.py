"""Coverage-guided fuzzing of every wire decoder with atheris: only WireError may escape.

Run: `make fuzz` (FUZZ_RUNS inputs, default 1,000,000), or
`.venv/bin/python fuzz/fuzz_wire.py -atheris_runs=N [CORPUS_DIR ...]` (libFuzzer flags pass through).

One input = a selector byte (which decoder) + the message; multi-frame decoders split the rest on
SEP into ZMQ frames. Batches that decode also go through `batch_to_dict`, `batch_view` (what `tap`
prints) and a BlockIndex (what the collector does), which must not raise at all. Without a corpus directory
on the command line, a temporary one is seeded from tests/fixtures/engine-captures (every live,
replay, load, kv_metrics and forward-pass frame), KvMetrics pickles and an encoded snapshot.
"""

from __future__ import annotations

import base64
import json
import pickle
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports(include=["kvobserve"]):
    from kvobserve.analysis.blocks import BlockIndex
    from kvobserve.wire.errors import REASONS, WireError
    from kvobserve.wire.kv_events import KvBatch, decode_message, decode_payload
    from kvobserve.wire.kv_view import batch_to_dict, batch_view
    from kvobserve.wire.replay import decode_replay_message
    from kvobserve.wire.scheduler import (
        decode_forward_pass_message,
        decode_forward_pass_metrics,
        decode_kv_metrics,
        decode_load_message,
        decode_load_stat,
    )
    from kvobserve.wire.snapshot import (
        CollectorInfo,
        MediumStats,
        Snapshot,
        StreamStats,
        WorkerInfo,
        decode_snapshot,
        encode_snapshot,
    )

CAPTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "engine-captures"
SEP = b"\xfe\xed\xfa\xce"  # frame separator inside one fuzz input


def _check_batch(batch: KvBatch | None, payload: bytes) -> None:
    """What tap and the collector do with a decoded batch: only WireError may come out."""
    if batch is None:
        return
    json.dumps(batch_to_dict(batch, token_ids=True))  # lazily decoded fields: WireError only
    json.dumps(batch_view(batch, payload, token_ids=True))
    BlockIndex().apply_batch(batch)


def _kv_message(frames: list[bytes], body: bytes) -> None:
    _check_batch(decode_message(frames), frames[-1] if frames else b"")


def _kv_payload(frames: list[bytes], body: bytes) -> None:
    _check_batch(decode_payload("kv-events", 0, body), body)


def _replay(frames: list[bytes], body: bytes) -> None:
    _check_batch(decode_replay_message(frames, "kv-events"), frames[-1] if frames else b"")


# selector byte % len(TARGETS) picks the decoder; order is part of the corpus format
TARGETS: list[tuple[str, Callable[[list[bytes], bytes], object]]] = [
    ("kv_message", _kv_message),
    ("kv_payload", _kv_payload),
    ("replay", _replay),
    ("load_message", lambda fr, body: decode_load_message(fr)),
    ("load_stat", lambda fr, body: decode_load_stat(body)),
    ("kv_metrics", lambda fr, body: decode_kv_metrics(body)),
    ("kv_metrics_pickle", lambda fr, body: decode_kv_metrics(body, allow_pickle=True)),
    ("fpm_message", lambda fr, body: decode_forward_pass_message(fr)),
    ("fpm", lambda fr, body: decode_forward_pass_metrics(body)),
    ("snapshot", lambda fr, body: decode_snapshot(body)),
]
INDEX = {name: i for i, (name, _) in enumerate(TARGETS)}


def test_one_input(data: bytes) -> None:
    """One fuzz input: decoders raise WireError with a known reason, or return."""
    if not data:
        return
    _, fn = TARGETS[data[0] % len(TARGETS)]
    body = data[1:]
    try:
        fn(body.split(SEP), body)
    except WireError as exc:
        if exc.reason not in REASONS:
            raise AssertionError(f"WireError with unknown reason {exc.reason!r}") from None


# --- seed corpus ---------------------------------------------------------------------------------


def _lines(folder: Path) -> Iterator[tuple[str, list[bytes]]]:
    for line in (folder / "frames.jsonl").read_text().splitlines():
        obj = json.loads(line)
        yield obj["source"], [base64.b64decode(f) for f in obj["frames"]]


def _kv_metrics_pickles() -> list[bytes]:
    """Pickles of a plain-class KvMetrics under SGLang's module path (throwaway modules)."""
    path = "sglang.srt.managers.scheduler_components.kv_events_publisher"
    names = [".".join(path.split(".")[:i]) for i in range(1, path.count(".") + 2)]
    added = [n for n in names if n not in sys.modules]
    for n in added:
        sys.modules[n] = types.ModuleType(n)
    try:
        cls = type("KvMetrics", (), {"__module__": path, "__qualname__": "KvMetrics"})
        sys.modules[path].KvMetrics = cls  # type: ignore[attr-defined]
        obj = cls()
        obj.__dict__.update(
            request_active_slots=3, request_total_slots=48, kv_active_blocks=100,
            kv_total_blocks=1000, num_requests_waiting=1, gpu_cache_usage_perc=0.1,
            gpu_prefix_cache_hit_rate=0.5, data_parallel_rank=1,
        )  # fmt: skip
        return [pickle.dumps(obj, protocol=p) for p in (2, 4, 5)]
    finally:
        for n in added:
            del sys.modules[n]


def _snapshot_seed() -> bytes:
    media = [MediumStats("GPU", 3, 48, 10, 7)]
    return encode_snapshot(
        Snapshot(
            CollectorInfo("node-0", 0, "host", 1.0, "c", "0.1.0"),
            seq=3,
            time=2.0,
            workers=[WorkerInfo("w", "sglang", 2, [0, 1], True)],
            streams=[StreamStats("w", 0, "sglang", "tcp://127.0.0.1:1", up=True, media=media)],
            refused={"streams": 1},
        )
    )


def seeds() -> Iterator[bytes]:
    """Every seed input: selector byte + frames joined by SEP (or the bare payload)."""
    sel = {k: bytes([v]) for k, v in INDEX.items()}
    for meta in sorted(CAPTURES.glob("**/meta.json")):
        folder = meta.parent
        kind = folder.name
        for source, frames in _lines(folder):
            joined = SEP.join(frames)
            if kind == "load":
                yield from (sel["load_message"] + joined, sel["load_stat"] + frames[-1])
            elif kind == "kv_metrics":
                yield from (sel["kv_metrics"] + frames[0], sel["kv_metrics_pickle"] + frames[0])
            elif kind == "forward_pass_metrics":
                yield from (sel["fpm_message"] + joined, sel["fpm"] + frames[-1])
            elif source == "replay":
                yield sel["replay"] + joined
            else:
                yield from (sel["kv_message"] + joined, sel["kv_payload"] + frames[-1])
    for p in _kv_metrics_pickles():
        yield sel["kv_metrics_pickle"] + p
        yield sel["kv_metrics"] + p
    yield sel["snapshot"] + _snapshot_seed()


def write_corpus(directory: Path) -> int:
    """Write the seeds into `directory`; returns how many."""
    n = 0
    for n, seed in enumerate(seeds(), 1):
        (directory / f"seed-{n:04d}").write_bytes(seed)
    return n


def main(argv: list[str]) -> None:
    """Seed a temporary corpus unless directories are given, then fuzz."""
    args: list[Any] = list(argv)
    if not any(not a.startswith("-") for a in args[1:]):
        corpus = Path(tempfile.mkdtemp(prefix="kvobserve-fuzz-"))
        print(f"fuzz_wire: {write_corpus(corpus)} seeds in {corpus}", file=sys.stderr)
        args.append(str(corpus))
        if not any(a.startswith("-artifact_prefix=") for a in args):
            # crash-*/oom-* files go next to the corpus, not into the working tree
            args.insert(1, f"-artifact_prefix={corpus.parent / (corpus.name + '-')}")
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
