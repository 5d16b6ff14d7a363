"""Decode what a Dynamo KV indexer says it holds: `GET /dump` block sets, `POST /query` tree sizes.

Forms (Dynamo docs `components/router/standalone-indexer.md` and `lib/kv-router/src/bin/kv_indexer/
server.rs`, several versions; docs/dynamo.md "Drift"):
- `/dump`, newest: `{"<model>:<group>": {"block_size": 16, "events": [RouterEvent, ...]}, ...}`;
  an indexer that failed answers `{"<model>:<group>": {"error": "..."}}` for that key.
- `/dump`, 2026 H1: `{"<model>:<tenant>": [RouterEvent, ...]}`; first version: `[RouterEvent, ...]`.
- RouterEvent is the JSON form of the event-plane struct; a dump is made of `stored` events (the
  radix tree walked breadth first, `event_id` from 0); `block_hash` is the engine's own hash,
  the same value the event plane carries, so the dump is comparable block for block.
- `/query` (older versions): `{"scores": ..., "frequencies": ..., "tree_sizes": {"<worker_id>":
  {"<dp_rank>": blocks}}}`: sizes only, and only for the workers the answer lists.
Pure: raises WireError only.
"""

from __future__ import annotations

import msgspec
from msgspec import Raw, Struct

from kvobserve.wire.dynamo import RouterEvent, medium_of
from kvobserve.wire.errors import WireError, decode

MAX_DUMP_BYTES = 1 << 30  # a full tree of a large fleet is hundreds of MB of JSON
DumpKey = tuple[int, int, str]  # (Dynamo worker_id, dp_rank, kvobserve medium)


class IndexerDump(Struct, gc=False):
    """The block sets of a dump, per (worker_id, dp_rank, medium)."""

    blocks: dict[DumpKey, set[int]]
    groups: list[str]  # the `<model>:<group>` keys read ([] for the bare-array form)
    block_size: int = 0  # 0: the dump did not say
    other_events: int = 0  # removed/cleared events in a dump (none expected): ignored
    failed_groups: list[str] = []  # keys whose indexer answered an error


class _Group(Struct, gc=False):
    events: list[Raw] = []
    block_size: int = 0
    error: str | None = None


_dec_any = msgspec.json.Decoder(dict[str, Raw] | list[Raw])
_dec_group = msgspec.json.Decoder(_Group | list[Raw])
_dec_event = msgspec.json.Decoder(RouterEvent)
_dec_sizes = msgspec.json.Decoder(dict[str, Raw])
_dec_tree = msgspec.json.Decoder(dict[str, dict[str, int]])


def _add_events(raws: list[Raw], out: IndexerDump) -> None:
    blocks = out.blocks
    dec = _dec_event.decode
    try:
        for raw in raws:
            ev = dec(raw)
            data = ev.event.data
            stored = None if isinstance(data, str) else data.stored
            if stored is None:
                out.other_events += 1
                continue
            key = (ev.worker_id, ev.event.dp_rank, medium_of(ev.tier))
            dest = blocks.get(key)
            if dest is None:
                dest = blocks[key] = set()
            dest.update(b.block_hash for b in stored.blocks)
    except msgspec.ValidationError as exc:
        raise WireError("schema", f"dump RouterEvent: {exc}") from None
    except msgspec.DecodeError as exc:
        raise WireError("msgpack", f"dump RouterEvent: {exc}") from None


def decode_dump(body: bytes, model: str = "") -> IndexerDump:
    """Block sets of a `/dump` answer; `model` keeps only `<model>:*` groups ("" = all)."""
    top: dict[str, Raw] | list[Raw] = decode(_dec_any, body, "indexer dump", MAX_DUMP_BYTES)
    out = IndexerDump({}, [])
    if isinstance(top, list):
        _add_events(top, out)
        return out
    for name, raw in top.items():
        if model and name.partition(":")[0] != model:
            continue
        group = decode(_dec_group, raw, f"dump group {name[:80]!r}", MAX_DUMP_BYTES)
        out.groups.append(name)
        if isinstance(group, list):
            _add_events(group, out)
            continue
        if group.error is not None:
            out.failed_groups.append(name)
            continue
        out.block_size = out.block_size or group.block_size
        _add_events(group.events, out)
    return out


def decode_tree_sizes(body: bytes) -> dict[tuple[int, int], int]:
    """(worker_id, dp_rank) -> blocks from a `/query` answer's `tree_sizes`."""
    top: dict[str, Raw] = decode(_dec_sizes, body, "indexer query answer", 64 << 20)
    raw = top.get("tree_sizes")
    if raw is None:
        raise WireError("schema", "query answer has no tree_sizes (this indexer version omits it)")
    tree: dict[str, dict[str, int]] = decode(_dec_tree, raw, "tree_sizes")
    out: dict[tuple[int, int], int] = {}
    for wid, ranks in tree.items():
        for rank, n in ranks.items():
            if not (wid.isdigit() and rank.isdigit()):
                raise WireError("schema", f"tree_sizes key {wid!r}/{rank!r} is not a number")
            out[(int(wid), int(rank))] = n
    return out
