"""Mirrored streams: two streams of one worker delivering the same batches (docs/stream-semantics.md)."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from kvobserve.analysis.sequence import StreamSequencer


class MirrorDetector:
    """Per worker: notices two streams delivering the same batches (by a cheap fingerprint)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._owner: dict[Hashable, StreamSequencer] = {}
        self._order: deque[Hashable] = deque()
        self.capacity = capacity

    def observe(
        self, stream: StreamSequencer, fingerprint: Hashable, now: float
    ) -> StreamSequencer | None:
        """Record `fingerprint` (e.g. `(seq, ts, hash(payload))`) for `stream`; flag both on a match."""
        other = self._owner.get(fingerprint)
        if other is None:
            self._owner[fingerprint] = stream
            self._order.append(fingerprint)
            if len(self._order) > self.capacity:
                self._owner.pop(self._order.popleft(), None)
            return None
        if other is stream:
            return None
        other.mark_duplicate_stream(now)
        stream.mark_duplicate_stream(now)
        return other
