"""A batch's BlockStored events split into requests by their parent chains (`tap --requests`,
`overlap`): on synthetic events, and on the conversation trace replayed through the simulator's
engines, where each request's chain must be its prompt's pages exactly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobserve.commands.tap_requests import Request, Requests
from kvobserve.simulate.encoders import get_format
from kvobserve.simulate.replay import replay_offline
from kvobserve.simulate.trace import TraceRequest, read_trace, request_pages
from kvobserve.simulate.truth import hash_json
from kvobserve.wire.kv_events import decode_message
from kvobserve.wire.kv_view import batch_view

TRACE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "mooncake-conversation.jsonl.gz"
)


def st(hashes: list[int], parent: int | None, medium: str | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "medium": medium}  # fmt: skip


def chains(reqs: list[Request]) -> list[tuple[list[Any], int, Any]]:
    return [(r.hashes, r.stored, r.parent) for r in reqs]


def test_a_batch_of_several_requests_is_split_where_a_chain_breaks() -> None:
    removed = {"type": "BlockRemoved", "block_hashes": [50]}
    got = Requests().split([st([1, 2], None), st([3], 2), removed, st([9], None), st([4], 3)])
    # 1-2-3 is one request; 9 starts another; 4 hangs off 3, which is not the previous store's
    # last block (9): another request, given the blocks it hangs off
    assert chains(got) == [([1, 2, 3], 3, None), ([9], 1, None), ([1, 2, 3, 4], 1, None)]
    assert [r.index for r in got] == [1, 2, 3]


def test_a_request_gets_the_chain_it_hangs_off_from_earlier_batches() -> None:
    r = Requests()
    assert chains(r.split([st([10, 11, 12], 99)])) == [([10, 11, 12], 3, 99)]
    # the next batch: one request off the middle (a shared prefix), one off the end (the next
    # prefill chunk, or the next turn): both from the first block tap saw; 99 is still unknown
    got = r.split([st([20], 11), st([30, 31], 12), st([40], 7)])
    assert chains(got) == [
        ([10, 11, 20], 1, 99),
        ([10, 11, 12, 30, 31], 2, 99),
        ([40], 1, 7),  # 7 was stored before tap saw the stream
    ]


def test_only_the_top_tier_stores_are_requests() -> None:
    got = Requests().split([st([1, 2], None, "GPU"), st([1, 2], None, "CPU_PINNED"), st([3], 2)])
    assert chains(got) == [([1, 2, 3], 3, None)]
    assert Requests().split([{"type": "AllBlocksCleared"}, st([], None), "junk"]) == []


def test_the_memory_of_chains_is_bounded() -> None:
    r = Requests(keep=6)  # two halves of 3 hashes
    r.split([st([1, 2], None)])
    r.split([st([3, 4], None)])  # 4 in the newer half: it becomes the older one
    r.split([st([5, 6, 7], None)])  # and again: 1-4 are forgotten
    assert chains(r.split([st([8], 5), st([9], 1)])) == [([5, 8], 1, None), ([9], 1, 1)]


@pytest.mark.parametrize("fmt", ["sglang-0.5.23", "vllm-0.33"])
def test_every_request_of_the_trace_is_its_prompts_pages(fmt: str) -> None:
    """The simulator's engines store a request's missed pages hanging off its last hit page.
    Batches of 8 requests' events each, split: each request's chain is its whole prompt (the
    pages an engine of this kind caches), in order, however much of it was cached before."""
    requests = read_trace(str(TRACE), seconds=30)
    served: list[int] = []  # the request each batch is of
    views: list[dict[str, Any]] = []

    def each() -> Iterator[TraceRequest]:
        for i, q in enumerate(requests):
            served.append(i)
            yield q

    def on_batch(rank: int, seq: int, payload: bytes) -> None:
        frames = [b"", seq.to_bytes(8, "big"), payload]
        views.append({**batch_view(decode_message(frames), payload), "request": served[-1]})

    replay_offline(each(), format=fmt, capacity_tokens=50_000_000, on_batch=on_batch)
    wire = get_format(fmt)
    keep_partial = fmt.startswith("sglang")  # vLLM caches full pages only
    with_stores = [v["request"] for v in views if v["events"]]  # all cached: no store
    assert len(with_stores) > 70
    want = [
        [
            hash_json(p.hash)
            for p in request_pages(requests[i], wire.hash_kind, 16, keep_partial).pages
        ]
        for i in with_stores
    ]
    splitter, got = Requests(), []
    for i in range(0, len(views), 8):  # a busy rank: 8 requests' events in one batch
        got += splitter.split([ev for v in views[i : i + 8] for ev in v["events"]])
    assert [r.hashes for r in got] == want
    assert all(r.parent is None for r in got)  # every chain was seen from its first block
    assert sum(r.index > 1 for r in got) > 60  # most batches held several requests
