"""A prompt library with shared prefixes and a per-rank prefix (radix) cache with LRU eviction.

Pure logic: no sockets, no clocks. Hashes are SHA-256 chains over (parent digest, page tokens),
turned into each engine's hash type: signed int64 (SGLang), unsigned uint64 (vLLM, the lower 64
bits, so about half are >= 2^63) or the 32 raw bytes (vLLM with int hashes off).
"""

from __future__ import annotations

import hashlib
import random
from array import array
from bisect import bisect_left
from collections import OrderedDict
from itertools import accumulate
from typing import NamedTuple

Hash = int | bytes


class Page(NamedTuple):
    """One page (block) of a token sequence, hashed in chain order."""

    hash: Hash
    digest: bytes
    tokens: list[int]


def page_hash(hash_kind: str, parent_digest: bytes, tokens: list[int]) -> tuple[Hash, bytes]:
    """(wire hash, digest) of a page chained on its parent's digest."""
    d = hashlib.sha256(parent_digest + array("q", tokens).tobytes()).digest()
    if hash_kind == "int64":
        return int.from_bytes(d[:8], "big", signed=True), d
    if hash_kind == "uint64":
        return int.from_bytes(d[24:], "big"), d
    return d, d


def paginate(
    hash_kind: str,
    tokens: list[int],
    page_size: int,
    parent: bytes = b"",
    keep_partial: bool = True,
) -> list[Page]:
    """Split tokens into hashed pages; a short last page is kept only if `keep_partial`."""
    pages: list[Page] = []
    for start in range(0, len(tokens), page_size):
        chunk = tokens[start : start + page_size]
        if len(chunk) < page_size and not keep_partial:
            break
        h, parent = page_hash(hash_kind, parent, chunk)
        pages.append(Page(h, parent, chunk))
    return pages


class PromptLibrary:
    """Prompts built from a few shared system prefixes plus a body; chosen by Zipf popularity."""

    def __init__(
        self,
        seed: int,
        hash_kind: str,
        page_size: int,
        n_prompts: int = 200,
        n_prefixes: int = 8,
        zipf_s: float = 1.1,
        vocab: int = 32000,
    ) -> None:
        rng = random.Random(seed)
        prefixes = [
            [rng.randrange(vocab) for _ in range(page_size * rng.randint(2, 16))]
            for _ in range(max(1, n_prefixes))
        ]
        self.prompts: list[list[Page]] = []
        for i in range(max(1, n_prompts)):
            body = [rng.randrange(vocab) for _ in range(page_size * rng.randint(1, 8))]
            self.prompts.append(paginate(hash_kind, prefixes[i % len(prefixes)] + body, page_size))
        weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(self.prompts))]
        self._cum = list(accumulate(weights))

    def sample(self, rng: random.Random) -> list[Page]:
        """One prompt's pages, the popular ones far more often (Zipf over the library)."""
        i = bisect_left(self._cum, rng.random() * self._cum[-1])
        return self.prompts[min(i, len(self.prompts) - 1)]


class _Node:
    __slots__ = ("children", "parent", "refs", "tokens")

    def __init__(self, parent: Hash | None, tokens: int) -> None:
        self.parent = parent
        self.tokens = tokens
        self.children = 0
        self.refs = 0  # running requests holding this page: not evictable while > 0


class InsertResult(NamedTuple):
    """What one insertion did: tokens hit, pages stored (in chain order), evicted runs."""

    hit_tokens: int
    parent: Hash | None  # the hash the first stored page hangs off (None = root)
    stored: list[Page]
    evicted: list[list[Hash]]  # each run leaf-first: a leaf, then the parents it exposed
    hit_pages: int = 0  # the sequence's first pages that were resident already


class PrefixCache:
    """Pages in a tree; capacity in tokens; only unlocked leaves are evicted, LRU first.

    `used_tokens` counts every resident page (what the events describe); `locked_tokens` counts the
    pages running requests hold, each once however many share it: the engines' scheduler usage
    (SGLang total - available - evictable, vLLM blocks with ref_cnt > 0).
    """

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.nodes: dict[Hash, _Node] = {}
        self._leaves: OrderedDict[Hash, None] = OrderedDict()  # evictable leaves, LRU first
        self.used_tokens = 0
        self.locked_tokens = 0

    def __len__(self) -> int:
        return len(self.nodes)

    def clear(self) -> None:
        """Drop everything (a flush, or a restarted engine)."""
        self.nodes.clear()
        self._leaves.clear()
        self.used_tokens = 0
        self.locked_tokens = 0

    def insert(self, pages: list[Page]) -> InsertResult:
        """Look up a sequence, touch what hits, evict to make room, store the rest that fits."""
        nodes = self.nodes
        leaves = self._leaves
        parent: Hash | None = None
        hit = 0
        i = 0
        for page in pages:
            if page.hash not in nodes:
                break
            parent = page.hash
            hit += len(page.tokens)
            i += 1
        if parent is not None and parent in leaves:
            leaves.move_to_end(parent)
        new = pages[i:]
        if not new:
            return InsertResult(hit, parent, [], [], i)
        if parent is not None:
            leaves.pop(parent, None)  # pinned: it is about to get a child, never evict it now
        need = sum(len(p.tokens) for p in new)
        evicted: list[list[Hash]] = []
        run_next: Hash | None = None  # the parent of the last evicted page
        while self.used_tokens + need > self.capacity_tokens and leaves:
            h, _ = leaves.popitem(last=False)
            node = nodes.pop(h)
            self.used_tokens -= node.tokens
            if evicted and h == run_next:
                evicted[-1].append(h)
            else:
                evicted.append([h])
            up = run_next = node.parent
            if up is not None:
                pnode = nodes.get(up)
                if pnode is not None:
                    pnode.children -= 1
                    if pnode.children == 0 and pnode.refs == 0 and up != parent:
                        # it became a leaf; it was touched no later than its child: evict it next
                        leaves[up] = None
                        leaves.move_to_end(up, last=False)
        stored: list[Page] = []
        top = parent
        for page in new:
            n = len(page.tokens)
            if self.used_tokens + n > self.capacity_tokens:
                break
            nodes[page.hash] = _Node(top, n)
            if top is not None:
                nodes[top].children += 1
            self.used_tokens += n
            top = page.hash
            stored.append(page)
        if top is not None and nodes[top].children == 0 and nodes[top].refs == 0:
            leaves[top] = None
        return InsertResult(hit, parent, stored, evicted, i)

    def demand(self, pages: list[Page]) -> int:
        """Tokens a request on these pages would add to the locked total (held pages count 0)."""
        nodes = self.nodes
        need = 0
        for page in pages:
            node = nodes.get(page.hash)
            if node is None or node.refs == 0:
                need += len(page.tokens)
        return need

    def lock(self, hashes: list[Hash]) -> None:
        """A request starts running on these resident pages: they stop being evictable."""
        nodes, leaves, locked = self.nodes, self._leaves, 0
        for h in hashes:
            node = nodes[h]
            if node.refs == 0:
                locked += node.tokens
                leaves.pop(h, None)
            node.refs += 1
        self.locked_tokens += locked

    def unlock(self, hashes: list[Hash]) -> None:
        """The request finished: pages no request holds become evictable again (leaves at MRU)."""
        nodes, leaves, freed = self.nodes, self._leaves, 0
        for h in hashes:
            node = nodes[h]
            node.refs -= 1
            if node.refs == 0:
                freed += node.tokens
                if node.children == 0:
                    leaves[h] = None
        self.locked_tokens -= freed

    def resident(self) -> set[Hash]:
        """Hashes resident now."""
        return set(self.nodes)
