"""Blocks in the order of their last event, and how many tokens came after each: a stack in epochs.

The capacity curve (analysis/capacity.py) asks one question many times: of the blocks in this
stack, how many tokens were pushed after block `k` and are still here? In the ghost list (the
blocks a rank evicted and has not stored again, in eviction order) that is the depth at which a
re-stored block would still have been resident; in a rank's resident blocks ordered by last
access, it is the depth at which a hit was found (below the capacity, opt-in).

Entries are grouped in *epochs* of about `width` tokens: a key maps to its epoch number (one int
object shared by every key of the epoch: a dict entry, a slot of one list of the keys in push
order and the key are the whole cost per entry), and the tokens of each closed epoch sit in a Fenwick tree over a ring of
`slots` epochs, so a push costs a dict store and an append, a pop a dict pop and two prefix sums
of about log2(slots) steps. The tokens after `k` are exact to within half of `k`'s own epoch (the keys of
one epoch are not ordered among themselves, nor when they leave): the caller picks `width` small against the depths
it tells apart (analysis/capacity.py: 1/256 of the rank's capacity).

Epochs older than the stack keeps (`trim`, or a ring that would wrap) leave it with their keys:
`trim` hands them to the caller (analysis/capacity.py keeps a sample of them: the blocks that
only unlimited memory would have kept). Pure: no clock, no I/O.
"""

from __future__ import annotations


class RecencyStack:
    """Keys (64-bit ints) in push order, with the tokens of each; see the module docstring."""

    __slots__ = (
        "_base", "_cur", "_cur_keys", "_cur_tokens", "_fill", "_flat", "_head", "_keys", "_live",
        "_odd", "_of", "_slots", "_spill", "_starts", "_tree", "oldest", "tokens", "usual", "width",
    )  # fmt: skip

    def __init__(self, width: float = 1.0, slots: int = 4096, usual: int = 1) -> None:
        if slots < 2 or slots & (slots - 1):
            raise ValueError(f"slots={slots}: must be a power of two >= 2")
        self.width = max(width, 1e-9)  # tokens per epoch
        self.usual = usual  # the tokens of a key pushed without its own count
        self._slots = slots
        self._tree = [0] * (slots + 1)  # Fenwick over slot = epoch % slots: closed epochs' tokens
        self._live = [0] * slots  # the same per slot, read directly
        self._keys = [0] * slots  # live keys per slot
        # every key pushed, in order (one list: `_flat[_starts[slot] - _base:]` is an epoch's);
        # a popped or moved key stays until its epoch leaves (its dict entry says where it is)
        self._flat: list[int] = []
        self._base = 0  # the absolute position of _flat[0]
        self._head = 0  # _flat before this has left
        self._starts = [0] * slots  # absolute position where each slot's epoch begins
        self._spill: list[int] = []  # keys of epochs that left, not yet handed out (`trim`)
        self._of: dict[int, int] = {}  # key -> its epoch (one shared int object per epoch)
        self._odd: dict[int, int] = {}  # key -> its tokens where they are not `usual`
        self._cur = 0  # the open epoch
        self._cur_tokens = 0  # live tokens of the open epoch (not in the tree yet)
        self._cur_keys = 0  # live keys of the open epoch
        self._fill = 0.0  # tokens ever pushed into the open epoch (when it closes)
        self.oldest = 0  # the oldest epoch in the stack
        self.tokens = 0  # tokens in the stack (open epoch included)

    def __len__(self) -> int:
        """Keys held."""
        return len(self._of)

    def __contains__(self, key: int) -> bool:
        return key in self._of

    # --- the tree -----------------------------------------------------------------------------

    def _add(self, slot: int, v: int) -> None:
        self._live[slot] += v
        tree, n = self._tree, self._slots
        i = slot + 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def _prefix(self, slot: int) -> int:
        """Tokens of slots [0, slot)."""
        tree = self._tree
        s = 0
        i = slot
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    def _between(self, first: int, last: int) -> int:
        """Tokens of the closed epochs first .. last (inclusive; none when first > last)."""
        if first > last:
            return 0
        n = self._slots
        a, b = first % n, last % n
        if a <= b:
            return self._prefix(b + 1) - self._prefix(a)
        return self._prefix(n) - self._prefix(a) + self._prefix(b + 1)

    def _close(self) -> None:
        """The open epoch becomes a closed one in the tree; a new one opens."""
        cur = self._cur
        if self._cur_tokens:
            self._add(cur % self._slots, self._cur_tokens)
        self._keys[cur % self._slots] = self._cur_keys
        self._cur = cur + 1
        self._cur_tokens = self._cur_keys = 0
        self._fill = 0.0
        while self._cur - self.oldest >= self._slots:  # the ring would wrap: the oldest goes
            self._drop_oldest()
        self._starts[self._cur % self._slots] = self._base + len(self._flat)

    def _drop_oldest(self) -> None:
        epoch = self.oldest
        slot = epoch % self._slots
        v = self._live[slot]
        if v:
            self._add(slot, -v)
            self.tokens -= v
        end = self._starts[(epoch + 1) % self._slots] - self._base
        if self._keys[slot]:
            of, odd = self._of, self._odd
            for k in self._flat[self._starts[slot] - self._base : end]:
                if of.get(k) == epoch:
                    del of[k]
                    if odd:
                        odd.pop(k, None)
                    self._spill.append(k)
        self._head = end
        if self._head > 1024 and self._head * 2 > len(self._flat):  # keep the list short
            del self._flat[: self._head]
            self._base += self._head
            self._head = 0
        self._keys[slot] = 0
        self.oldest = epoch + 1

    # --- use ----------------------------------------------------------------------------------

    def push(self, key: int, tokens: int) -> None:
        """`key` is the newest entry (a key already held is moved: pop it first to learn its
        depth)."""
        if key in self._of:
            self.pop(key)
        cur = self._cur
        self._of[key] = cur
        self._flat.append(key)
        if tokens != self.usual:
            self._odd[key] = tokens
        self._cur_tokens += tokens
        self._cur_keys += 1
        self.tokens += tokens
        self._fill += tokens
        if self._fill >= self.width:
            self._close()

    def pop(self, key: int) -> float | None:
        """Remove `key`; the tokens pushed after it that are still here (half of its own
        epoch's other tokens stand for those of its epoch after it); None if it is not held."""
        epoch = self._of.pop(key, None)
        if epoch is None:
            return None
        w = self._odd.pop(key, self.usual) if self._odd else self.usual
        self.tokens -= w
        cur = self._cur
        if epoch == cur:
            self._cur_tokens -= w
            self._cur_keys -= 1
            return max(0, self._cur_tokens) / 2
        slot = epoch % self._slots
        own = self._live[slot] - w
        self._keys[slot] -= 1
        self._add(slot, -w)
        return self._between(epoch + 1, cur - 1) + self._cur_tokens + max(0, own) / 2

    def trim(self, max_tokens: float) -> list[int]:
        """Drop the oldest epochs until at most `max_tokens` tokens are left (the open epoch
        stays); the keys that left, since the last call (a ring that would wrap drops too)."""
        while self.tokens > max_tokens and self.oldest < self._cur:
            self._drop_oldest()
        spill, self._spill = self._spill, []
        return spill

    def held(self) -> list[int]:
        """The keys held (a copy)."""
        return list(self._of)

    def clear(self) -> None:
        """Empty the stack (its width, ring size and usual tokens stay)."""
        self._tree = [0] * (self._slots + 1)
        self._live = [0] * self._slots
        self._keys = [0] * self._slots
        self._flat, self._base, self._head = [], 0, 0
        self._starts = [0] * self._slots
        self._spill = []
        self._of.clear()
        self._odd.clear()
        self._cur, self._cur_tokens, self._cur_keys, self._fill = 0, 0, 0, 0.0
        self.oldest = self.tokens = 0
