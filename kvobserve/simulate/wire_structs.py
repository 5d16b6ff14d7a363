"""The engines' KV-event structs, one set per wire format, as msgspec writes them byte for byte.

Each set mirrors the field list and struct flags of that engine version as its wheel defines them
(SGLang `disaggregation/kv_events.py`, vLLM `vllm/distributed/kv_events.py`; docs/wire.md has the
table) and as the captures in tests/fixtures/engine-captures show them: tagged arrays with
trailing nils (array_like ignores omit_defaults), fixmap with omitted None fields (SGLang 0.5.23),
and map16 headers for vLLM 0.33 (msgspec sizes the header for the 16 declared keys).
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

Hash = int | bytes
TokenIds = list[Any]  # ints, or [a, b] bigram pairs


class Batch(Struct, array_like=True, gc=False):
    """`[ts, events, dp_rank]` as every version sends it (omit_defaults would be ignored anyway)."""

    ts: float
    events: list[Any]
    dp_rank: int | None = None


# --- SGLang 0.4.7 and vLLM 0.10: 6-element tagged arrays --------------------------------------


class Stored6(Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None = None


class Removed2(Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]


class ClearedArr(Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


# --- SGLang 0.5.12 (0.5.10-0.5.16) and 0.5.19 (0.5.18-0.5.19): + medium -----------------------


class Stored7(Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class CacheSaltMeta(Struct, omit_defaults=True, gc=False):
    cache_salt: str | None = None


class Stored8Salt(Struct, array_like=True, tag="BlockStored", gc=False):
    """SGLang 0.5.18/19 `BlockStoredWithMetadata`: element 7 is a `{"cache_salt": ...}` map."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None
    metadata: CacheSaltMeta


class Removed3(Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None = None


# --- SGLang 0.5.23 (0.5.20+): tagged map, None optionals omitted --------------------------------


class StoredS23(Struct, omit_defaults=True, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class RemovedS23(Struct, omit_defaults=True, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None = None


class ClearedMap(Struct, omit_defaults=True, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


# --- vLLM 0.23 (0.22-0.23): 12-element tagged arrays ------------------------------------------


class StoredV23(Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class RemovedV23(Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


# --- vLLM 0.33: tagged map, 16 declared keys -> map16 header -----------------------------------


class StoredV33(Struct, omit_defaults=True, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None  # one list per block hash


class RemovedV33(Struct, omit_defaults=True, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
