"""The KV-event structs every engine shares, as msgspec writes them byte for byte: the batch, the
first era's 6-element store and 2-element removal (SGLang 0.4.7, vLLM 0.10), and the clears.

Each engine's own structs are in its simulator profile (simulate/engines/). Every struct mirrors
the field list and struct flags of an engine version as its wheel defines them (SGLang
`disaggregation/kv_events.py`, vLLM `vllm/distributed/kv_events.py`; docs/wire.md has the table)
and as the captures in tests/fixtures/engine-captures show them: tagged arrays with trailing nils
(array_like ignores omit_defaults), fixmap with omitted None fields (SGLang 0.5.23), and map16
headers for vLLM 0.33 (msgspec sizes the header for the 16 declared keys).
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


class ClearedMap(Struct, omit_defaults=True, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass
