"""Requests in a KV-event stream: each batch's BlockStored events split by their parent chains.

An engine stores the blocks a request computed as one or more BlockStored events, each hanging
off the block before it (`parent_block_hash`). A batch of a busy rank holds several requests: a
store whose parent is not the previous store's last block starts another one. A request that
hangs off a block stored earlier in the stream (the shared system prompt, the turn before in a
conversation, a prefill chunk of an earlier batch) gets that block's chain first, so its hashes
are the request from its first block; one that hangs off a block stored before the stream was
seen keeps that block as `parent`, and its hashes start after it. Only the top tier's stores
are requests: a copy to another medium (an offload to CPU) is not.

`kvobserve tap --requests` prints one line per request and batch; `kvobserve overlap` splits
tap's batches the same way and asks where each request would hit. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvobserve.analysis.tiers import DEFAULT_MEDIUM, TOP_MEDIA

KEEP_HASHES = 200_000  # hashes remembered to find the chain a request hangs off (bounded)

Hash = int | str  # a block hash as tap prints it: an integer, or hex for 32-byte hashes


@dataclass(slots=True)
class Request:
    """One request of a batch: its block hashes in order, the last `stored` of them stored by
    its own events; `parent` is the block it hangs off when that was stored before the stream
    was seen (its hashes start after it), else None."""

    index: int  # 1-based, within its batch
    hashes: list[Hash]
    stored: int
    parent: Hash | None = None

    def json(self) -> dict[str, Any]:
        """The fields `tap --requests` prints after the batch's."""
        return {
            "request": self.index,
            "block_hashes": self.hashes,
            "stored": self.stored,
            "parent_block_hash": self.parent,
        }


class Requests:
    """Splits batches into requests, remembering the chains seen so far (the last
    `keep` hashes, in two generations) to give a request the blocks it hangs off."""

    def __init__(self, keep: int = KEEP_HASHES) -> None:
        self._keep = max(2, keep)
        self._new: dict[Hash, tuple[Request, int]] = {}  # hash -> (its request, position)
        self._old: dict[Hash, tuple[Request, int]] = {}

    def split(self, events: Iterable[Any]) -> list[Request]:
        """The requests of one batch's events (its `events`, as tap prints them), in order."""
        out: list[Request] = []
        last: Hash | None = None  # the previous store's last block
        for ev in events:
            if not isinstance(ev, dict) or ev.get("type") != "BlockStored":
                continue
            if (ev.get("medium") or DEFAULT_MEDIUM) not in TOP_MEDIA:
                continue
            hashes: list[Hash] = list(ev.get("block_hashes") or ())
            if not hashes:
                continue
            parent: Hash | None = ev.get("parent_block_hash")
            if out and parent is not None and parent == last:
                req = out[-1]
                req.hashes += hashes
                req.stored += len(hashes)
            else:
                req = self._start(len(out) + 1, parent, hashes)
                out.append(req)
            self._remember(req, len(req.hashes) - len(hashes))
            last = hashes[-1]
        return out

    def _start(self, index: int, parent: Hash | None, hashes: list[Hash]) -> Request:
        """A request whose first stored block hangs off `parent`."""
        if parent is None:
            return Request(index, hashes, len(hashes))
        seen = self._new.get(parent) or self._old.get(parent)
        if seen is None:  # stored before the stream was seen: its chain is unknown
            return Request(index, hashes, len(hashes), parent)
        earlier, at = seen
        return Request(index, [*earlier.hashes[: at + 1], *hashes], len(hashes), earlier.parent)

    def _remember(self, req: Request, start: int) -> None:
        """Where each hash of `req` from `start` on sits; the older half is forgotten first."""
        for i in range(start, len(req.hashes)):
            self._new[req.hashes[i]] = (req, i)
        if len(self._new) >= self._keep // 2:
            self._old, self._new = self._new, {}
