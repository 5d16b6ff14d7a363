"""Where would a request hit, answered on an ingest thread's streams (docs/cache-analytics.md).

Runs in the thread that applies the streams' batches (sources/kv_stream.py, Dynamo's
sources/dynamo_ingest.py), between two batches, so the walk never races the index it reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.wire.kv_events import BlockHash
from kvobserve.wire.overlap import RankOverlap


def rank_overlaps(
    streams: Iterable[tuple[str, int, StreamSequencer, bool]], hashes: Sequence[BlockHash]
) -> list[RankOverlap]:
    """(worker_id, dp_rank, sequencer, up) of each stream -> its answer."""
    return [
        RankOverlap(worker_id, dp_rank, seq.index.leading_blocks(hashes), up, seq.trust.state)
        for worker_id, dp_rank, seq, up in streams
    ]
