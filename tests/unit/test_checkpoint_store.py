"""The checkpoint files on disk and the writer: real files, a real writer thread, a fake clock.

Bad and foreign state is never trusted (corrupt, truncated, foreign, old-version files: one log
line, one event, a count, no checkpoint); a read-only or full disk makes the store failing with
the reason and nothing raises.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import pytest

from kvobserve.analysis.checkpoint import StreamCopy, copy_stream, encode_copy, state_mark
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.config.model import WorkerConfig
from kvobserve.sources.checkpoint_store import (
    LOCK_FILE,
    UNREADABLE,
    CheckpointStore,
    config_fingerprint,
    file_name,
    identity_of,
)
from kvobserve.sources.checkpoint_writer import CheckpointWriter
from kvobserve.sources.plan import StreamSpec
from kvobserve.sources.stream_events import RecentEvents
from kvobserve.wire.checkpoint import FORMAT_VERSION, StreamIdentity, decode_checkpoint
from kvobserve.wire.kv_events import decode_payload
from tests.unit.test_checkpoint import anchor, workload

SPEC = StreamSpec(
    "sglang-a", 0, "sglang", "tcp://127.0.0.1:5557", "kv-events", "tcp://127.0.0.1:5657"
)
IDENT = identity_of(SPEC)
CONFIG = config_fingerprint("prod", WorkerConfig("sglang-a", "sglang"))


def fed(n: int, seed: int = 1) -> StreamSequencer:
    sq = StreamSequencer(0, replay=True)
    for seq, p in enumerate(workload(n, seed=seed)):
        sq.on_batch(decode_payload("kv-events", seq, p), p, float(seq))
    return sq


def data_of(sq: StreamSequencer, ident: StreamIdentity = IDENT, config: str = CONFIG) -> bytes:
    c = copy_stream(ident, sq, anchor(sq), config)
    assert c is not None
    return encode_copy(c, "0.1.0", 1000.0)


@pytest.fixture
def events() -> RecentEvents:
    return RecentEvents()


@pytest.fixture
def store(tmp_path: Path, events: RecentEvents) -> Iterator[CheckpointStore]:
    s = CheckpointStore(str(tmp_path / "state"), events)
    assert s.open()
    yield s
    s.close()


def test_a_written_checkpoint_loads_back_for_its_stream(store: CheckpointStore) -> None:
    sq = fed(300)
    assert store.write(IDENT.key, data_of(sq))
    ck = store.load(IDENT, CONFIG)
    assert ck is not None and ck.last_seq == 299 and ck.identity == IDENT
    assert store.stats().written == 1 and store.stats().loaded == 1
    assert (store.directory.stat().st_mode & 0o777) == 0o700  # other users do not read it
    assert store.load(msgspec.structs.replace(IDENT, dp_rank=1), CONFIG) is None  # no file


def test_file_names_are_safe_and_unique_for_any_worker_id() -> None:
    ids = ["sglang-a", "vllm@10.0.0.5:8000", "llm-d/pod-7f9c", "llm-d_pod-7f9c", "../../etc",
           "..", "ünïcode/名前", "x" * 300, "a b\tc\n", ""]  # fmt: skip
    names = {file_name((w, r)) for w in ids for r in (0, 1, 15)}
    assert len(names) == len(ids) * 3  # "llm-d/pod" and "llm-d_pod" read alike, differ
    for n in names:
        assert "/" not in n and not n.startswith(".") and len(n) < 120
        assert all(c.isascii() and (c.isalnum() or c in "._-") for c in n), n


def test_a_write_replaces_the_file_whole_and_a_crash_leftover_is_removed(
    tmp_path: Path, store: CheckpointStore
) -> None:
    old, new = data_of(fed(100)), data_of(fed(200))
    store.write(IDENT.key, old)
    path = store.path(IDENT.key)
    inode = path.stat().st_ino
    store.write(IDENT.key, new)
    assert path.read_bytes() == new and path.stat().st_ino != inode  # renamed over, not rewritten
    assert sorted(p.name for p in store.directory.iterdir()) == sorted([LOCK_FILE, path.name])
    leftover = path.with_name(path.name + ".tmp")
    leftover.write_bytes(new[:50])  # what a SIGKILL in the middle of a write leaves
    store.close()
    again = CheckpointStore(str(store.directory))
    assert again.open() and not leftover.exists()
    assert again.load(IDENT, CONFIG) is not None
    again.close()


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (lambda d: d[: len(d) // 2], "truncated"),
        (lambda d: d[:5], "truncated"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 0x10]), "corrupt"),
        (lambda d: b"not a checkpoint at all", "not_checkpoint"),
        (lambda d: d[:7] + bytes([FORMAT_VERSION - 1]) + d[8:], "format"),
        (lambda d: d[:7] + bytes([FORMAT_VERSION + 1]) + d[8:], "format"),
    ],
    ids=["half", "header", "bit-flip", "garbage", "older-format", "newer-format"],
)
def test_bad_files_are_ignored_with_one_line_one_event_and_a_count(
    store: CheckpointStore, events: RecentEvents, caplog: pytest.LogCaptureFixture, bad, reason: str
) -> None:
    store.path(IDENT.key).write_bytes(bad(data_of(fed(100))))
    with caplog.at_level(logging.WARNING):
        assert store.load(IDENT, CONFIG) is None
    lines = [r.getMessage() for r in caplog.records]
    assert (
        len(lines) == 1
        and f"checkpoint ignored, the stream starts without it: {reason}" in lines[0]
    )
    assert lines[0].startswith("sglang-a rank 0: ")
    (ev,) = events.recent()
    assert (ev.kind, ev.worker_id, ev.dp_rank) == ("checkpoint", "sglang-a", 0)
    assert reason in ev.message and store.stats().refused == {reason: 1}


@pytest.mark.parametrize("foreign", ["plan", "config"])
def test_a_foreign_checkpoint_is_ignored(store: CheckpointStore, events: RecentEvents,
                                         foreign: str) -> None:  # fmt: skip
    """Another engine behind the same stream key (its endpoint moved), or another config."""
    if foreign == "plan":
        other = msgspec.structs.replace(IDENT, endpoint="tcp://10.9.9.9:5557")
        store.write(IDENT.key, data_of(fed(100), ident=other))
    else:
        store.write(IDENT.key, data_of(fed(100), config=config_fingerprint("other-cluster")))
    assert store.load(IDENT, CONFIG) is None
    assert store.stats().refused == {foreign: 1}
    assert events.recent()[0].message.startswith(
        f"checkpoint ignored, the stream starts without it: {foreign}: "
    )


def test_an_unreadable_file_is_ignored_not_raised(store: CheckpointStore) -> None:
    store.path(IDENT.key).mkdir()  # read_bytes() of a directory: IsADirectoryError
    assert store.load(IDENT, CONFIG) is None
    assert store.stats().refused == {UNREADABLE: 1}


def test_the_fingerprint_follows_what_shapes_the_index_only() -> None:
    w = WorkerConfig("sglang-a", "sglang")
    base = config_fingerprint("prod", w)
    assert config_fingerprint("prod", replace(w, capacity_tokens=4096)) == base
    assert config_fingerprint("prod", replace(w, metrics_url="http://x/m")) == base
    for changed in (replace(w, engine="vllm"), replace(w, version="0.5.12"),
                    replace(w, block_size=32)):  # fmt: skip
        assert config_fingerprint("prod", changed) != base
    assert config_fingerprint("dev", w) != base
    assert config_fingerprint("prod", w, max_media=8) != base


# --- a disk that cannot be written ------------------------------------------------------------


ROOT = Path(__file__).resolve().parents[2]
# What a collector whose state_dir it cannot write sees: open, a write, a load, and its log.
READ_ONLY_CHILD = """
import json, logging, sys
from kvobserve.sources.checkpoint_store import CheckpointStore
from kvobserve.wire.checkpoint import StreamIdentity
logging.basicConfig(level=logging.WARNING, format="%(message)s")
ident = StreamIdentity(*json.loads(sys.argv[2]))
s = CheckpointStore(sys.argv[1])
opened, wrote = s.open(), s.write(ident.key, b"x" * 100)
ck = s.load(ident, sys.argv[3])
st = s.stats()
print(json.dumps({"opened": opened, "wrote": wrote, "loaded": ck and ck.last_seq,
                  "state": st.state, "reason": st.reason, "failing": st.failing,
                  "detail": st.detail}))
"""


def _unwritable(d: Path) -> tuple[dict[str, object], Callable[[], object]]:
    """Make `d` unwritable for a child process, root included: mode 0500; as root the immutable
    flag (chattr +i: ext4, xfs, btrfs), else (overlayfs, tmpfs) the child runs as nobody in
    the root-owned directory. The child's subprocess arguments, and how to undo it."""
    if os.geteuid() != 0:
        d.chmod(0o500)
        return {}, lambda: d.chmod(0o700)
    chattr = shutil.which("chattr")
    if chattr and subprocess.run([chattr, "+i", str(d)], capture_output=True).returncode == 0:
        return {}, lambda: subprocess.run([chattr, "-i", str(d)], check=True)
    d.chmod(0o755)
    return {"user": 65534, "group": 65534, "extra_groups": []}, lambda: None


def test_a_read_only_state_dir_is_failing_not_fatal_and_its_checkpoints_still_load() -> None:
    base = Path(tempfile.mkdtemp(prefix="kvobserve-ro-"))  # outside pytest's 0700 tree
    d = base / "state"
    undo: Callable[[], object] = lambda: None  # noqa: E731
    try:
        ok = CheckpointStore(str(d))
        assert ok.open() and ok.write(IDENT.key, data_of(fed(100)))
        ok.close()
        (d / LOCK_FILE).unlink()  # as a fresh read-only copy of the directory would be
        ok.path(IDENT.key).chmod(0o644)
        base.chmod(0o755)
        as_user, undo = _unwritable(d)
        ident = [getattr(IDENT, f) for f in StreamIdentity.__struct_fields__]
        proc = subprocess.run(
            [sys.executable, "-c", READ_ONLY_CHILD, str(d), json.dumps(ident), CONFIG],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=60, **as_user,  # type: ignore[call-overload]
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert str(d) in got.pop("detail")
        assert got == {"opened": False, "wrote": False, "loaded": 99, "state": "failing",
                       "reason": "read_only", "failing": {"read_only": 1}}  # fmt: skip
        began = [line for line in proc.stderr.splitlines() if "are not written" in line]
        assert len(began) == 1 and began[0].startswith("checkpoints are not written (read_only)")
        assert sorted(p.name for p in d.iterdir()) == [ok.path(IDENT.key).name]  # nothing new
    finally:
        undo()
        d.chmod(0o700)
        shutil.rmtree(base)


def test_a_state_dir_that_cannot_be_created_is_failing(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    s = CheckpointStore(str(tmp_path / "file" / "state"))
    assert not s.open() and not s.write(IDENT.key, b"x")
    assert (s.stats().state, s.stats().reason) == ("failing", "io")  # ENOTDIR
    assert s.load(IDENT, CONFIG) is None


def test_a_full_disk_is_failing_and_writes_resume_when_space_is_back(
    store: CheckpointStore,
) -> None:
    """/dev/full answers every write with ENOSPC, as a full filesystem does."""
    path = store.path(IDENT.key)
    tmp = path.with_name(path.name + ".tmp")
    tmp.symlink_to("/dev/full")  # the next write opens it for its temporary file
    assert not store.write(IDENT.key, data_of(fed(100)))
    st = store.stats()
    assert (st.state, st.reason, st.errors) == ("failing", "no_space", {"no_space": 1})
    assert not tmp.exists() and not path.exists()  # nothing half-written is left
    assert store.write(IDENT.key, data_of(fed(100)))
    assert (store.stats().state, store.stats().written) == ("failing", 1)
    store.sync(all_written=True)  # a round whose writes all succeeded
    assert store.stats().state == "ok"


def test_a_second_process_on_the_same_state_dir_neither_reads_nor_writes(
    store: CheckpointStore,
) -> None:
    store.write(IDENT.key, data_of(fed(100)))
    other = CheckpointStore(str(store.directory))
    assert not other.open()  # flock is per open file: a second open in one process is refused too
    assert (other.stats().reason, other.load(IDENT, CONFIG)) == ("in_use", None)
    assert f"(pid {os.getpid()})" in other.stats().detail
    store.close()
    assert other.open() and other.load(IDENT, CONFIG) is not None  # the lock went with its owner
    other.close()


# --- the writer -------------------------------------------------------------------------------


@dataclass
class Stream:
    """A stream as the core will offer it to the writer."""

    sq: StreamSequencer
    ident: StreamIdentity
    copies: int = 0

    @property
    def checkpoint_key(self) -> tuple[str, int]:
        return self.ident.key

    def checkpoint_mark(self) -> object:
        return state_mark(self.sq)

    def checkpoint_copy(self) -> StreamCopy | None:
        self.copies += 1
        return copy_stream(self.ident, self.sq, anchor(self.sq), CONFIG)


def streams(n: int, batches: int = 120) -> list[Stream]:
    return [
        Stream(fed(batches, seed=r), msgspec.structs.replace(IDENT, dp_rank=r)) for r in range(n)
    ]


def more(s: Stream, k: int = 1) -> None:
    """`k` more batches of the stream's own workload."""
    start = s.sq.last_seq + 1  # type: ignore[operator]
    for seq, p in enumerate(list(workload(start + k, seed=s.ident.dp_rank))[start:], start):
        s.sq.on_batch(decode_payload("kv-events", seq, p), p, float(seq))


def on_disk(store: CheckpointStore, s: Stream) -> int | None:
    ck = store.load(s.ident, CONFIG)
    return None if ck is None else ck.last_seq


def test_rounds_write_only_the_streams_that_changed(store: CheckpointStore) -> None:
    ss = streams(4)
    w = CheckpointWriter(store, 5.0, clock=lambda: 0.0)
    w.start()
    try:
        w.tick(0.0, ss)  # the first round: every stream
        assert w.wait_round(10.0)
        assert [on_disk(store, s) for s in ss] == [119] * 4 and store.written == 4
        more(ss[2], 3)
        w.tick(4.9, ss)  # not due yet
        assert [s.copies for s in ss] == [1, 1, 1, 1]
        w.tick(5.0, ss)
        assert w.wait_round(10.0)
        assert [s.copies for s in ss] == [1, 1, 2, 1] and store.written == 5
        assert [on_disk(store, s) for s in ss] == [119, 119, 122, 119]
        w.tick(10.0, ss)  # nothing changed: no copy, no write
        assert [s.copies for s in ss] == [1, 1, 2, 1] and w.rounds == 2
    finally:
        w.close()


def test_a_round_is_spread_over_ticks_by_its_block_budget(store: CheckpointStore) -> None:
    ss = streams(6)
    size = ss[0].checkpoint_copy().blocks + 1  # type: ignore[union-attr]
    assert all(s.checkpoint_copy().blocks + 1 == size for s in ss)  # type: ignore[union-attr]
    for s in ss:
        s.copies = 0
    w = CheckpointWriter(store, 5.0, budget_blocks=size + 1)  # two streams' copies per tick
    w.start()
    try:
        w.tick(0.0, ss)
        assert sum(s.copies for s in ss) == 2 and not w.wait_round(0.0)
        w.tick(0.1, ss)
        assert sum(s.copies for s in ss) == 4 and not w.wait_round(0.0)
        w.tick(0.2, ss)
        assert w.wait_round(10.0) and sum(s.copies for s in ss) == 6 and store.written == 6
    finally:
        w.close()


def test_sigterm_flush_writes_every_changed_stream_before_it_returns(
    store: CheckpointStore,
) -> None:
    ss = streams(3)
    w = CheckpointWriter(store, 5.0)
    w.start()
    w.tick(0.0, ss)
    assert w.wait_round(10.0)
    for s in ss[:2]:
        more(s, 2)
    assert w.flush(ss, timeout_s=10.0) == 0  # nothing left unwritten
    assert [on_disk(store, s) for s in ss] == [121, 121, 119]
    assert [s.copies for s in ss] == [2, 2, 1]
    w.close()


def test_a_failing_store_leaves_streams_changed_and_they_are_written_once_it_recovers(
    store: CheckpointStore,
) -> None:
    ss = streams(2)
    path = store.path(ss[0].checkpoint_key)
    path.with_name(path.name + ".tmp").symlink_to("/dev/full")
    w = CheckpointWriter(store, 5.0)
    w.start()
    try:
        w.tick(0.0, ss)
        assert w.wait_round(10.0)
        assert (w.stats().state, w.stats().reason) == ("failing", "no_space")
        assert [on_disk(store, s) for s in ss] == [None, 119]
        w.tick(5.0, ss)
        assert w.wait_round(10.0)
        assert [on_disk(store, s) for s in ss] == [119, 119] and [s.copies for s in ss] == [2, 1]
        assert w.stats().state == "ok" and w.stats().round_seconds > 0
    finally:
        w.close()


def test_no_interval_means_no_checkpoints(store: CheckpointStore) -> None:
    w = CheckpointWriter(store, 0.0)
    w.start()
    w.tick(100.0, streams(1))
    assert w.stats().state == "off" and store.written == 0 and w.flush(streams(1), 1.0) == 0
    w.close()


def test_the_writer_keeps_what_it_wrote_decodable(store: CheckpointStore) -> None:
    ss = streams(1)
    w = CheckpointWriter(store, 5.0)
    w.start()
    w.tick(0.0, ss)
    assert w.wait_round(10.0)
    w.close()
    ck = decode_checkpoint(store.path(ss[0].checkpoint_key).read_bytes(), ss[0].ident, CONFIG)
    assert ck.kvobserve and ck.written_at > 0


class ThreadCpu:
    """A CPU clock per thread that advances by a set step at each reading (the writer thread's
    step for any thread but this one): what a copy and a write cost, without timing anything."""

    def __init__(self, copy: float, write: float) -> None:
        self.here = threading.get_ident()
        self.step = {True: copy, False: write}
        self.now: dict[int, float] = {}

    def __call__(self) -> float:
        me = threading.get_ident()
        t = self.now[me] = self.now.get(me, 0.0) + self.step[me == self.here]
        return t


def test_the_cpu_budget_spreads_a_big_round_and_charges_the_writes_too(
    store: CheckpointStore,
) -> None:
    """2 % of a core at 5 s: 0.1 CPU-s in hand, 0.02 more per second. A copy costs 0.01 here."""
    ss = streams(20, batches=20)
    w = CheckpointWriter(store, 5.0, cpu_share=0.02, cpu=ThreadCpu(copy=0.01, write=0.0))
    w.start()
    try:
        w.tick(0.0, ss)
        assert sum(s.copies for s in ss) == 10  # the budget in hand: 0.1 s
        w.tick(0.0, ss)
        assert sum(s.copies for s in ss) == 10  # none refilled yet
        w.tick(2.5, ss)
        assert sum(s.copies for s in ss) == 15  # 2.5 s x 2 %
        w.tick(5.0, ss)
        assert sum(s.copies for s in ss) == 20 and w.wait_round(10.0)
        assert w.copy_cpu_s == pytest.approx(0.2)
    finally:
        w.close()
    # the writer's CPU is charged as well (ahead, as the last writes cost, then settled): with
    # 0.03 a write, the budget in hand pays for about two streams, and it is not overdrawn by
    # more than one stream's copy and write
    ss = streams(8, batches=20)
    w = CheckpointWriter(store, 5.0, cpu_share=0.02, cpu=ThreadCpu(copy=0.01, write=0.03),
                         max_in_flight=1)  # fmt: skip
    w.start()
    try:
        for _ in range(8):  # bounded: at most one copy per tick
            w.tick(0.0, ss)
            assert w.drain(10.0)
        copies = sum(s.copies for s in ss)
        assert 2 <= copies < 8
        assert w.write_cpu_s == pytest.approx(0.03 * copies)
        assert w.copy_cpu_s + w.write_cpu_s <= 0.1 + 0.04 + 1e-9
    finally:
        w.close()


def test_a_config_built_in_code_checkpoints_under_the_default_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`state_dir = ""` in a Config built in code (the demo, an embedding) is the default, as in
    a config file: it used to be a path relative to the working directory (a repository
    checkout collected the suite's checkpoints)."""
    from kvobserve.collector import Collector
    from kvobserve.config import CollectorConfig, Config
    from kvobserve.config import load as config_load
    from kvobserve.transport.local import LocalBus

    monkeypatch.chdir(tmp_path)
    writer = Collector(Config("c1", CollectorConfig("node-0")), LocalBus())._checkpoints()
    assert writer is not None
    default = Path(config_load.state_dir("", os.environ))  # this test's own (tests/conftest.py)
    assert writer.store.directory == default / "c1" / "node-0"
    assert not default.is_relative_to(tmp_path)
