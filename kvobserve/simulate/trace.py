"""Request traces in the Mooncake format, and the engine pages of their blocks.

One JSON object per line, one request each: `{"timestamp": ms, "input_length": tokens,
"output_length": tokens, "hash_ids": [...]}` (the Mooncake FAST'25 traces; AIPerf and Dynamo's
data generator read the same). Each hash id is one 512-token block of the prompt and stands for
its whole prefix, so equal ids are shareable prefix blocks; the last block holds what is left of
`input_length` (usually a partial block). A file ending in `.gz` is read compressed.

An engine caches pages of its own block size. Page `j` of trace block `b` holds the tokens
`[j * page_size, (j + 1) * page_size)` of the block (fewer on the block's last page), and its hash
is derived from `(b, j, tokens on the page)` alone: the id already names the whole prefix, so
identical prefixes give identical pages on every rank and every run, in each engine's hash type.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
from collections.abc import Iterator
from typing import IO, NamedTuple

from kvobserve.simulate.cache import Hash, Page

TRACE_BLOCK_TOKENS = 512  # Mooncake: one hash id per 512 prompt tokens
_KEY = struct.Struct("<QII")
_MAX_ID = (1 << 64) - 1


class TraceRequest(NamedTuple):
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, i: int) -> int:
        """Prompt tokens in block `i` (the last block holds the rest of `input_length`)."""
        if i < len(self.hash_ids) - 1:
            return TRACE_BLOCK_TOKENS
        return self.input_length - TRACE_BLOCK_TOKENS * (len(self.hash_ids) - 1)


def _open(path: str) -> IO[str]:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _int_field(obj: dict[str, object], name: str, where: str) -> int:
    v = obj.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{where}: {name} {v!r} must be an integer >= 0")
    return v


def parse_request(line: str, where: str) -> TraceRequest:
    """One trace line; ValueError naming the line, the field and the bad value."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: {type(obj).__name__} is not a JSON object")
    ts = _int_field(obj, "timestamp", where)
    n_in = _int_field(obj, "input_length", where)
    n_out = _int_field(obj, "output_length", where)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= _MAX_ID for h in ids
    ):
        raise ValueError(f"{where}: hash_ids {ids!r} must be a list of integers >= 0")
    blocks = len(ids)
    if blocks != -(-n_in // TRACE_BLOCK_TOKENS):
        raise ValueError(
            f"{where}: input_length {n_in} needs {-(-n_in // TRACE_BLOCK_TOKENS)} blocks of "
            f"{TRACE_BLOCK_TOKENS} tokens, hash_ids has {blocks}"
        )
    return TraceRequest(ts, n_in, n_out, tuple(ids))


def iter_trace(path: str, seconds: float = 0.0) -> Iterator[TraceRequest]:
    """The requests of a trace file in order; with `seconds` > 0 only those of its first
    `seconds` (timestamps from the first request). Timestamps must not go backwards."""
    first: int | None = None
    last = -1
    with _open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            req = parse_request(line, f"{path}:{n}")
            if req.timestamp_ms < last:
                raise ValueError(
                    f"{path}:{n}: timestamp {req.timestamp_ms} is before the previous {last}"
                )
            last = req.timestamp_ms
            if first is None:
                first = req.timestamp_ms
            if seconds > 0 and req.timestamp_ms - first >= seconds * 1000:
                return
            yield req


def read_trace(path: str, seconds: float = 0.0) -> list[TraceRequest]:
    """`iter_trace` as a list; OSError and ValueError name the file (and line)."""
    try:
        return list(iter_trace(path, seconds))
    except (EOFError, gzip.BadGzipFile, UnicodeDecodeError) as exc:  # BadGzipFile is an OSError
        raise ValueError(f"trace: {path}: unreadable ({exc})") from None
    except OSError as exc:
        raise ValueError(f"trace: {path}: {exc.strerror or exc}") from None


def page_hash(hash_kind: str, block_id: int, page: int, tokens: int) -> Hash:
    """The engine hash of page `page` (holding `tokens` tokens) of trace block `block_id`."""
    if hash_kind == "bytes32":
        return hashlib.blake2b(_KEY.pack(block_id, page, tokens), digest_size=32).digest()
    d = hashlib.blake2b(_KEY.pack(block_id, page, tokens), digest_size=8).digest()
    return int.from_bytes(d, "big", signed=hash_kind == "int64")


def page_tokens(block_id: int, page: int, tokens: int) -> list[int]:
    """Token ids of a page, for the wire: one id repeated, the same for the same page
    everywhere (a trace names no tokens; the count and the ids' size on the wire are real)."""
    return [256 + (block_id * 131 + page * 31) % 31744] * tokens


class RequestPages(NamedTuple):
    """A request's engine pages in order, and where each trace block's pages end."""

    pages: list[Page]
    ends: list[int]  # block i owns pages [ends[i - 1], ends[i]) (ends[-1] == len(pages))


def request_pages(
    req: TraceRequest, hash_kind: str, page_size: int, keep_partial: bool
) -> RequestPages:
    """The pages an engine of this block size caches for the request's prompt.

    `keep_partial`: a short last page of a block is cached too (SGLang); else only full pages
    (vLLM), so a block shorter than one page has none.
    """
    pages: list[Page] = []
    ends: list[int] = []
    last = len(req.hash_ids) - 1
    for i, b in enumerate(req.hash_ids):
        n = TRACE_BLOCK_TOKENS if i < last else req.input_length - TRACE_BLOCK_TOKENS * last
        full, rest = divmod(n, page_size)
        for j in range(full):
            h = page_hash(hash_kind, b, j, page_size)
            pages.append(Page(h, b"", page_tokens(b, j, page_size)))
        if rest and keep_partial:
            h = page_hash(hash_kind, b, full, rest)
            pages.append(Page(h, b"", page_tokens(b, full, rest)))
        ends.append(len(pages))
    return RequestPages(pages, ends)
