"""One engine version as the simulator plays it (`WireFormat`), and the metadata a store carries.

Each engine's formats are declared in its simulator profile (simulate/engines/): the event
structs and the request metadata of the version, and the facts of that version the simulated
node needs (its HTTP routes, what `/server_info` holds, the load publisher, the port rule).
encoders.py puts them on the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvobserve.simulate.wire_structs import Hash, Removed2, Stored6, TokenIds


@dataclass(frozen=True)
class StoreMeta:
    """Optional metadata on a store; each format keeps only the fields it has (`meta_fields`)."""

    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    extra_keys: list[Any] | None = None  # vLLM: one entry per block hash
    lookahead_token_ids: list[list[int]] | None = None  # vLLM 0.33: one list per block hash
    locality: str | None = None  # vLLM >= 0.27: "LOCAL" | "REMOTE"
    ownership: str | None = None  # vLLM >= 0.29: the offloading tier that made the event
    group_idx: int | None = None  # vLLM >= 0.21: None means the format's default group
    kv_cache_spec_kind: str | None = None  # vLLM >= 0.22
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class RemoveMeta:
    """Optional metadata on a removal (vLLM only)."""

    group_idx: int | None = None  # None means the format's default group
    locality: str | None = None
    ownership: str | None = None


NO_META = StoreMeta()
NO_REMOVE_META = RemoveMeta()
StoreFn = Callable[[list[Hash], Hash | None, TokenIds, int, str | None, StoreMeta], Any]
RemoveFn = Callable[[list[Hash], str | None, RemoveMeta], Any]
# (format, request number, its tokens, block size) -> the metadata its store carries
MetaFn = Callable[["WireFormat", int, Sequence[Any], int], StoreMeta]


def stored6(
    h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta
) -> Any:
    """The first era's store (SGLang 0.4.7 and vLLM 0.10 share it): no medium, no metadata."""
    return Stored6(h, p, t, bs, x.lora_id)


def removed2(h: list[Hash], m: str | None, x: RemoveMeta) -> Any:
    """The first era's removal: the hashes only."""
    return Removed2(h)


@dataclass(frozen=True)
class Shares:
    """What request number `n` carries, before a version shapes it into its fields."""

    session: str | None
    salt: str | None
    lora: bool
    lookahead: bool


def shares(fields: frozenset[str], n: int) -> Shares | None:
    """Fixed shares, no random draws (so the workload stays the same); None: nothing to carry."""
    session = f"session-{n // 3 % 64}" if n % 3 == 0 and "session_id" in fields else None
    salt = f"tenant-salt-{n // 5 % 4}" if n % 5 == 0 else None
    lora = n % 7 == 0
    lookahead = n % 11 == 0 and "lookahead_token_ids" in fields
    if not (session or salt or lora or lookahead):
        return None
    return Shares(session, salt, lora, lookahead)


@dataclass(frozen=True)
class WireFormat:
    """One engine version's wire behaviour: event structs, hash kind, block and replay semantics,
    and the facts of the version that the simulated node follows."""

    name: str  # `--format`
    engine: str  # the engine profile it belongs to (simulate/engines/)
    release: str  # the version it stands for, as the engine reports it ("0.5.23")
    version: tuple[int, int]  # (minor, patch) for SGLang 0.x.y, (minor, 0) for vLLM 0.x
    make_stored: StoreFn
    make_removed: RemoveFn
    cleared: Any
    make_meta: MetaFn
    meta_fields: frozenset[str]  # the request metadata this version sends (see request_meta)
    has_medium: bool
    hash_kind: str  # "int64" (signed) | "uint64" | "bytes32"
    cpu_medium: str  # the host tier's medium name on the wire
    api_routes: tuple[str, ...]  # what the API server serves (node 0, or every hybrid node)
    stub_routes: tuple[str, ...] = ()  # what a follower node's dummy server serves, if any
    per_page_stores: bool = False  # SGLang: one BlockStored per page, short last page allowed
    removed_per_node: bool = False  # SGLang >= 0.5.19: one BlockRemoved lists a radix node
    replay_with_topic: bool = False  # 4-frame replay replies and end marker
    group_idx: int | None = None  # vLLM >= 0.20 sets group_idx = 0
    root_parent: Hash | None = None
    server_info: frozenset[str] = frozenset()  # the /server_info parts this version has
    load_pub: bool = False  # the opt-in `load` PUB (SGLang >= 0.5.19)
    pure_dp_one_port: bool = False  # pure DP: every rank's publisher on the base port

    def stored(
        self,
        hashes: list[Hash],
        parent: Hash | None,
        token_ids: TokenIds,
        block_size: int,
        medium: str | None = "GPU",
        meta: StoreMeta = NO_META,
    ) -> Any:
        """A BlockStored struct of this version (medium dropped where the version has none)."""
        return self.make_stored(hashes, parent, token_ids, block_size, medium, meta)

    def removed(
        self, hashes: list[Hash], medium: str | None = "GPU", meta: RemoveMeta = NO_REMOVE_META
    ) -> Any:
        """A BlockRemoved struct of this version."""
        return self.make_removed(hashes, medium, meta)

    def request_meta(self, n: int, tokens: Sequence[Any], block_size: int) -> StoreMeta:
        """The metadata request number `n` carries (`shares`), only the fields this version
        sends. vLLM's per-block fields are built for the full blocks of `tokens`."""
        return self.make_meta(self, n, tokens, block_size)

    def wire_medium(self, medium: str | None) -> str | None:
        """The medium as this version puts it on the wire (None where it has no field)."""
        return medium if self.has_medium else None
