"""A collector's checkpoints on local disk: one file per stream identity in `[collector]
state_dir`, written atomically, read once at start (docs/reliability.md, "Restarts of
kvobserve").

- One process per directory: `open` takes an exclusive lock on `state_dir/lock` (flock, released
  when the process ends, also by SIGKILL); a second kvobserve on the same directory neither reads
  nor writes there (`in_use`).
- A file's name is the stream identity made safe for any worker id or pod name (letters, digits,
  `.`, `_`, `-`; the rest `_`, at most 64 characters) with the rank and a 16-hex digest of the
  exact identity, so two ids that read alike never share a file.
- `write` puts the bytes in `<name>.tmp`, fsyncs it and renames it over `<name>`; `sync` fsyncs
  the directory once per round of renames. A reader therefore sees the old file or the new one,
  never a part, unless the disk lies (and then the checksum refuses it).
- `load` reads a stream's file and decodes it for that stream and configuration; anything it
  cannot trust (wire/checkpoint.py's reasons, or `unreadable`) is logged in one line, recorded
  as an event and counted, and the stream starts as if there were none. Nothing here raises.
- A full or read-only disk (or another process's lock) makes the store `failing` with the reason,
  logged when it begins and when it ends (a round whose writes all succeed): collection goes on;
  the collector's snapshot carries it (`stats`) for the `checkpoint_failing` condition.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from kvobserve.config.model import WorkerConfig
from kvobserve.sources.plan import StreamSpec
from kvobserve.sources.stream_events import RecentEvents
from kvobserve.wire.checkpoint import (
    HEADER_BYTES,
    MAX_BODY_BYTES,
    CheckpointRefused,
    StreamCheckpoint,
    StreamIdentity,
    decode_checkpoint,
)
from kvobserve.wire.snapshot import CheckpointStats

log = logging.getLogger(__name__)

SUFFIX = ".ckpt"
LOCK_FILE = "lock"
WRITE_REASONS = ("read_only", "no_space", "in_use", "io")  # why writes fail
UNREADABLE = "unreadable"  # a refusal reason of the store's own: the file could not be read
# The worker settings that shape what the index holds from the same bytes (the stream's plan,
# endpoint, topic and replay endpoint, is checked on its own, StreamIdentity).
FINGERPRINT_FIELDS = ("engine", "version", "block_size")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def identity_of(spec: StreamSpec) -> StreamIdentity:
    """The identity a stream's checkpoint must match: the stream and its plan."""
    return StreamIdentity(
        spec.worker_id, spec.dp_rank, spec.engine, spec.endpoint, spec.topic, spec.replay_endpoint
    )


def config_fingerprint(cluster: str, worker: WorkerConfig | None = None, **extra: object) -> str:
    """A short digest of the settings that change what a stream's index means (the cluster and
    the worker's FINGERPRINT_FIELDS, plus any `extra` the caller adds): a checkpoint written
    under another one is refused."""
    parts: dict[str, object] = {"cluster": cluster, **extra}
    if worker is not None:
        parts.update((f, getattr(worker, f)) for f in FINGERPRINT_FIELDS)
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def file_name(key: tuple[str, int]) -> str:
    """The file of stream (worker_id, dp_rank): safe on any filesystem, unique per identity."""
    worker, rank = key
    safe = _UNSAFE.sub("_", worker)[:64].lstrip(".") or "stream"
    digest = hashlib.blake2b(f"{worker}\0{rank}".encode(), digest_size=8).hexdigest()
    return f"{safe}.{rank}.{digest}{SUFFIX}"


def write_reason(exc: OSError) -> str:
    """Why a write failed, as one of WRITE_REASONS."""
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "read_only"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no_space"
    return "io"


class CheckpointStore:
    """The checkpoint files of one collector; `write` and `sync` may run on another thread than
    `load`, and `stats` on any."""

    def __init__(
        self,
        directory: str,
        events: RecentEvents | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.directory = Path(directory)
        self._events = events
        self._wall = wall
        self._lock_fd: int | None = None
        self._mutex = threading.Lock()
        self.readable = False  # files may be read (opened, or a read-only directory)
        self.state, self.reason, self.detail, self.since = "ok", "", "", wall()
        self.written = self.loaded = 0
        self.errors: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()

    # --- start ------------------------------------------------------------------------------

    def open(self) -> bool:
        """Create the directory (0700), take its lock and remove leftover temporary files;
        False (and failing, with the reason) when that is not possible. Safe to call again."""
        if self._lock_fd is not None:
            return True
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            # a read-only directory can still be read: its checkpoints resume, none is written
            self.readable = write_reason(exc) == "read_only" and self.directory.is_dir()
            self._failing(write_reason(exc), f"{self.directory}: {exc.strerror or exc}")
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            self.readable = False  # another live process's files: not ours to read or write
            holder = _read_pid(self.directory / LOCK_FILE)
            who = f" (pid {holder})" if holder else ""
            self._failing("in_use", f"{self.directory} is in use by another kvobserve{who}: "
                          f"{exc.strerror or exc}")  # fmt: skip
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        self.readable = True
        for tmp in self.directory.glob(f"*{SUFFIX}.tmp"):
            tmp.unlink(missing_ok=True)  # a write that a crash interrupted
        self._ok()
        return True

    def path(self, key: tuple[str, int]) -> Path:
        """The file of stream `key`."""
        return self.directory / file_name(key)

    def load(self, identity: StreamIdentity, config: str) -> StreamCheckpoint | None:
        """The stream's checkpoint if there is one it can trust; None otherwise (a refusal is
        logged, recorded as an event and counted)."""
        if not self.readable:
            return None
        path = self.path(identity.key)
        try:
            size = path.stat().st_size
            if size > HEADER_BYTES + MAX_BODY_BYTES:
                raise CheckpointRefused("corrupt", f"{size} bytes: larger than any checkpoint")
            data = path.read_bytes()
            ck = decode_checkpoint(data, identity, config)
        except FileNotFoundError:
            return None
        except CheckpointRefused as exc:
            self._refuse(identity, exc.reason, str(exc), path)
            return None
        except OSError as exc:
            self._refuse(identity, UNREADABLE, f"{UNREADABLE}: {exc.strerror or exc}", path)
            return None
        with self._mutex:
            self.loaded += 1
        log.debug("checkpoint of %s rank %d found at seq %s", *identity.key, ck.last_seq)
        return ck

    def _refuse(self, ident: StreamIdentity, reason: str, why: str, path: Path) -> None:
        with self._mutex:
            self.refused[reason] += 1
        msg = f"checkpoint ignored, the stream starts without it: {why} ({path.name})"
        log.warning("%s rank %d: %s", ident.worker_id, ident.dp_rank, msg)
        if self._events is not None:
            self._events.add("checkpoint", msg, worker_id=ident.worker_id, dp_rank=ident.dp_rank)

    # --- writes (the writer thread) -----------------------------------------------------------

    def write(self, key: tuple[str, int], data: bytes) -> bool:
        """Replace the stream's file with `data` atomically (the rename is made durable by the
        next `sync`); False when it failed (the store is then failing, with the reason, until
        a round of writes all succeed: `sync(True)`)."""
        if self._lock_fd is None and not self.open():
            return False
        path = self.path(key)
        tmp = path.with_name(path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            reason = write_reason(exc)
            with self._mutex:
                self.errors[reason] += 1
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)  # a partial file takes space another write needs
            self._failing(reason, f"{path}: {exc.strerror or exc}")
            return False
        with self._mutex:
            self.written += 1
        return True

    def sync(self, all_written: bool) -> None:
        """Make the renames of a round's writes durable (fsync of the directory); when every
        write of the round succeeded (`all_written`), the store is no longer failing."""
        if self._lock_fd is None:
            return
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self._failing(write_reason(exc), f"{self.directory}: {exc.strerror or exc}")
            return
        if all_written:
            self._ok()

    def remove(self, key: tuple[str, int]) -> None:
        """Delete a stream's checkpoint (a stream that is gone for good)."""
        if self._lock_fd is None:
            return
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as exc:
            log.debug("checkpoint of %s rank %d not removed: %s", *key, exc)

    def close(self) -> None:
        """Release the lock; safe to call twice."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock

    # --- health ---------------------------------------------------------------------------------

    def _failing(self, reason: str, detail: str) -> None:
        with self._mutex:
            began = self.state != "failing" or self.reason != reason
            self.state, self.reason, self.detail = "failing", reason, detail
            if began:
                self.since = self._wall()
        if began:
            log.warning("checkpoints are not written (%s): %s; collection goes on", reason, detail)

    def _ok(self) -> None:
        with self._mutex:
            if self.state == "ok":
                return
            self.state, self.reason, self.detail, self.since = "ok", "", "", self._wall()
        log.info("checkpoints are written again in %s", self.directory)

    def stats(self) -> CheckpointStats:
        """The store's state for the collector's snapshot."""
        with self._mutex:
            return CheckpointStats(
                self.state, self.reason, self.detail, self.since, self.written,
                dict(self.errors), self.loaded, dict(self.refused),
            )  # fmt: skip


def _read_pid(path: Path) -> str:
    try:
        return path.read_text().strip()[:16]
    except OSError:
        return ""
