"""A state word, a one-line reason and when the state began; each change is logged once.

Streams (sources/link.py) and scheduler sources (sources/scheduler.py) report their health this
way; the words are listed in docs/collector.md ("Stream states"). Retries that end in the same
state and reason change nothing, so nothing is logged per retry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("kvobserve.health")

# States in which a stream counts as up (kvobserve_stream_up 1): connected to a publisher.
UP_STATES = frozenset({"waiting", "up", "idle", "duplicate"})
# Fine states (logged at INFO; others at WARNING): `starting` is a stream's first connect, under
# way for at most LinkTimes.no_answer_s; it is not up, but not down either.
OK_STATES = UP_STATES | {"starting", "connected"}  # connected: a bound endpoint's publishers
# Fine as the first state after `starting` (logged at INFO then, WARNING later): a bound
# endpoint, or its stream, listening before any engine has connected.
FIRST_STATES = frozenset({"listening"})

OnChange = Callable[["Health", str], None]  # (health, previous state)


class Health:
    """State, reason and since (wall clock) of one stream or source."""

    __slots__ = ("name", "on_change", "reason", "since", "state")

    def __init__(
        self,
        name: str,
        state: str,
        reason: str,
        wall: float,
        on_change: OnChange | None = None,
    ) -> None:
        self.name = name  # e.g. "stream sglang-a rank 1 (tcp://10.0.0.5:5558)"; "" logs nothing
        self.state, self.reason, self.since = state, reason, wall
        self.on_change = on_change

    def set(self, state: str, reason: str, wall: float) -> bool:
        """Move to (state, reason); True when either changed (logged once; a new state calls
        `on_change`)."""
        if state == self.state and reason == self.reason:
            return False
        before = self.state
        self.state, self.reason = state, reason
        if self.name:
            fine = state in OK_STATES or (before == "starting" and state in FIRST_STATES)
            level = logging.INFO if fine else logging.WARNING
            if state == before:  # the same state for a new reason
                log.log(level, "%s: %s: %s", self.name, state, reason)
            else:
                log.log(level, "%s: %s -> %s: %s", self.name, before, state, reason)
        if state != before:
            self.since = wall
            if self.on_change is not None:
                self.on_change(self, before)
        return True

    @property
    def up(self) -> bool:
        """Whether the state counts as up."""
        return self.state in UP_STATES
