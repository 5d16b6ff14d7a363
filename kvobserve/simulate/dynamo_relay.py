"""A simulated Dynamo KvEventPublisher: engine steps in, event-plane messages out (pure logic).

Like Dynamo's worker-side relay, it takes the engine's events (a SimStream), keeps full blocks
only (a store whose block size is not the page size is dropped), turns hashes into u64,
renumbers the events from `event_id` 1 and wraps them as `Vec<RouterEvent>` in an envelope of its
own random `publisher_id` with `sequence` from 0 (dynamo_encode.py). It also keeps the truth: the
blocks it published (`published`) and those a subscriber that got every delivered message holds
(`delivered`), and what was lost.
"""

from __future__ import annotations

import random
from typing import Any

from kvobserve.simulate import dynamo_encode as enc
from kvobserve.simulate.stream import SimStream

U64 = (1 << 64) - 1
MAX_EVENTS_PER_MESSAGE = 128  # Dynamo 1.6.x batches at most 128 events per message
MEDIUM_TIER = {"GPU": "device", "CPU": "host_pinned", "CPU_PINNED": "host_pinned", "DISK": "disk"}


def _u64(h: Any) -> int:
    return int(h) & U64  # SGLang's int64 hashes are bit-cast, as Dynamo does


def relay_event(ev: Any, page_size: int) -> tuple[Any, str] | None:
    """(data, storage tier) of one engine event; None when Dynamo drops it (partial block)."""
    name = type(ev).__name__
    if "Cleared" in name:
        return enc.CLEARED, "device"
    tier = MEDIUM_TIER.get(getattr(ev, "medium", None) or "GPU", "device")
    hashes = [_u64(h) for h in ev.block_hashes]
    if name.startswith("Removed"):
        return enc.removed(hashes), tier
    if ev.block_size != page_size:
        return None
    parent = ev.parent_block_hash
    blocks = [enc.block(h, h ^ 0x5A5A5A5A5A5A5A5A) for h in hashes]
    return enc.stored(blocks, None if parent is None else _u64(parent)), tier


def apply(view: dict[str, set[int]], data: Any, tier: str) -> None:
    """Apply one RouterEvent's data to a tier -> blocks view."""
    if data == enc.CLEARED:
        for blocks in view.values():
            blocks.clear()
        return
    blocks = view.setdefault(tier, set())
    if "stored" in data:
        blocks.update(b["block_hash"] for b in data["stored"]["blocks"])
    else:
        blocks.difference_update(data["removed"]["block_hashes"])


class DynamoPublisher:
    """One KvEventPublisher instance of one (worker_id, dp_rank)."""

    def __init__(
        self, stream: SimStream, worker_id: int, rank: int, page_size: int, rng: random.Random
    ) -> None:
        self.stream = stream
        self.worker_id = worker_id
        self.rank = rank
        self.page_size = page_size
        self.publisher_id = rng.getrandbits(53) or 1  # masked to 53 bits, as Dynamo does
        self.sequence = 0
        self.next_event_id = 1
        self.messages_sent = 0
        self.published: dict[str, set[int]] = {"device": set()}
        self.delivered: dict[str, set[int]] = {"device": set()}
        self.lost_event_ids: list[int] = []
        self.lost_sequences: list[int] = []
        self.ended = False

    def step(
        self, now_ms: int, drop_ids: frozenset[int]
    ) -> list[tuple[int, bytes, list[dict[str, Any]], bool]]:
        """One engine step: (sequence, envelope, its RouterEvents, delivered) per message."""
        events: list[dict[str, Any]] = []
        for ev in self.stream.step_events():
            relayed = relay_event(ev, self.page_size)
            if relayed is None:
                continue
            data, tier = relayed
            apply(self.published, data, tier)
            events.append(
                enc.router_event(
                    self.worker_id, self.next_event_id, data, self.rank, storage_tier=tier
                )
            )
            self.next_event_id += 1
        out = []
        for i in range(0, len(events), MAX_EVENTS_PER_MESSAGE):
            chunk = events[i : i + MAX_EVENTS_PER_MESSAGE]
            payload = enc.kv_events_payload(chunk)
            body = enc.envelope(enc.KV_EVENTS, self.publisher_id, self.sequence, now_ms, payload)
            ids = [e["event"]["event_id"] for e in chunk]
            delivered = not drop_ids.intersection(ids)
            if delivered:
                self.messages_sent += 1
                for e in chunk:
                    apply(self.delivered, e["event"]["data"], e["storage_tier"])
            else:
                self.lost_event_ids += ids
                self.lost_sequences.append(self.sequence)
            out.append((self.sequence, body, chunk, delivered))
            self.sequence += 1
        return out

    def truth(self) -> dict[str, Any]:
        """What this publisher instance did and holds."""
        s = self.stream
        return {
            "instance": s.instance,
            "kind": s.kind,
            "publisher_id": self.publisher_id,
            "events": self.next_event_id - 1,  # event_ids assigned: 1 .. events
            "messages": self.sequence,  # envelope sequences assigned: 0 .. messages-1
            "messages_sent": self.messages_sent,
            "lost_event_ids": list(self.lost_event_ids),
            "lost_sequences": list(self.lost_sequences),
            "ended_by_restart": self.ended,
            "resident": {t: sorted(b) for t, b in self.published.items()},
            "delivered_resident": {t: sorted(b) for t, b in self.delivered.items()},
            "held_tokens": s.held_tokens,
            "requests": s.requests,
        }
