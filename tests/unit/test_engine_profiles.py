"""What differs per engine is declared once, in its profile: kvobserve's (kvobserve/engines/) and
the simulator's (kvobserve/simulate/engines/). No other module compares an engine's name or a
hard-coded version; every declared version is tied to its capture; both sides name the same
engines, versions, event fields, discovery routes and layout rules."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvobserve.engines import PROFILES, profile
from kvobserve.engines.docs import replaced
from kvobserve.engines.profile import opened
from kvobserve.simulate.discovery import ANSWERS
from kvobserve.simulate.engines import ENGINES
from kvobserve.simulate.wire_format import RemoveMeta, StoreMeta, WireFormat
from kvobserve.sources.discovery_parse import PARSERS
from kvobserve.wire.kv_events import decode_payload
from kvobserve.wire.kv_view import batch_view

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvobserve"
FIXTURES = ROOT / "tests" / "fixtures"
PROFILE_DIRS = (PACKAGE / "engines", PACKAGE / "simulate" / "engines")
NAMES = frozenset(PROFILES) | frozenset(ENGINES)
_ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_VERSION_TEXT = re.compile(r"^v?\d+\.\d+")


def _constants(node: ast.expr) -> list[Any]:
    """The constant an operand is, or the constants of a literal tuple, list or set."""
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    return []


def _is_version(node: ast.expr) -> bool:
    """A hard-coded version: `(5, 19)`, `(0, 5, 16)` or `"0.31"`."""
    if isinstance(node, ast.Tuple):
        values = _constants(node)
        return len(node.elts) >= 2 and len(values) == len(node.elts)
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and bool(_VERSION_TEXT.match(node.value))
    )


def switches(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) for every place the code branches on an engine's name or a version."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for value in (v for o in operands for v in _constants(o)):
                if isinstance(value, str) and value in NAMES:
                    yield node.lineno, f"compares with the engine name {value!r}"
            if any(isinstance(op, _ORDER) for op in node.ops) and any(map(_is_version, operands)):
                yield node.lineno, "compares with a hard-coded version"
        elif isinstance(node, ast.Dict):  # a table with a row per engine
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in NAMES]
            if len(keys) > 1:
                yield node.lineno, f"a table keyed by the engine names {keys}"
        elif (
            isinstance(node, ast.MatchValue)
            and isinstance(node.value, ast.Constant)
            and node.value.value in NAMES
        ):
            yield node.lineno, f"matches the engine name {node.value.value!r}"


def test_the_check_finds_each_kind_of_switch() -> None:
    code = """
if w.engine == "sglang": pass
if engine not in ("vllm", "x"): pass
LABEL = {"sglang": "dp_rank", "vllm": "engine"}
if fmt.version >= (5, 19): pass
if "0.31" <= text: pass
match engine:
    case "dynamo": pass
"""
    assert [line for line, _ in switches(code)] == [2, 3, 4, 5, 6, 8]
    allowed = (
        'x = "sglang"\nf(engine="vllm")\nif p.layout.dp_attention: pass\nif n < (1, k): pass\n'
    )
    assert list(switches(allowed)) == []


def test_no_module_outside_the_profiles_branches_on_an_engine() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(d in path.parents for d in PROFILE_DIRS)
        for line, what in switches(path.read_text())
    ]
    assert found == [], "ask the engine's profile instead"


def test_the_registry_names_each_profile_by_its_own_name() -> None:
    assert list(PROFILES) == ["sglang", "vllm", "dynamo"]  # the order config errors list them
    assert all(profile(n).name == n for n in PROFILES)
    with pytest.raises(ValueError, match="engine='tgi': must be one of sglang, vllm, dynamo"):
        profile("tgi")
    for p in PROFILES.values():  # an engine is either read per rank or from an event plane
        assert (p.layout is None) == p.event_plane, p.name
        versions = [v.version for v in p.versions]
        assert versions == sorted(versions, key=lambda v: tuple(map(int, v.split(".")))), p.name


def _capture_folders() -> set[str]:
    return {
        f"{kind}/{d.name}"
        for kind in ("engine-captures", "dynamo-captures")
        for d in (FIXTURES / kind).iterdir()
        if d.is_dir()
    }


def test_every_capture_belongs_to_exactly_one_declared_version() -> None:
    claimed = [c for p in PROFILES.values() for v in p.versions for c in v.captures]
    assert len(claimed) == len(set(claimed))
    assert set(claimed) == _capture_folders()


@pytest.mark.parametrize(
    ("name", "version", "folder"),
    [(p.name, v.version, c) for p in PROFILES.values() for v in p.versions for c in v.captures],
)
def test_a_capture_is_of_its_version_and_sends_only_declared_fields(
    name: str, version: str, folder: str
) -> None:
    meta = json.loads((FIXTURES / folder / "meta.json").read_text())
    assert meta["version"] == version
    v = next(v for v in profile(name).versions if v.version == version)
    if profile(name).event_plane:
        return  # Dynamo's expected.json is the generic decode of its messages
    assert meta["engine"] == name
    expected = json.loads((FIXTURES / folder / "expected.json").read_text())
    sent = {
        (ev["type"], key)
        for batch in expected
        for ev in batch["events"]
        for key in ev
        if key not in ("type", "num_tokens", "wire_variant") and ev[key] is not None
    }
    declared = {("BlockStored", n) for f in v.stored for n in opened(f)} | {
        ("BlockRemoved", n) for f in v.removed for n in opened(f)
    }
    assert sent - declared == set()
    form = "map" if "map" in meta["event_encoding"] else "array"
    assert v.form == form
    assert (v.replay == "4 frames, with topic") == (
        "topic" in meta["replay_reply_layout"].split(";")[0]
    )


def test_array_layouts_agree_by_position() -> None:
    """tap names an array event's elements by the longest layout: every other layout must be a
    prefix of it, up to a map element (SGLang 0.5.19's `{cache_salt}`), which ends a layout."""
    for tag in ("stored", "removed"):
        layouts = [
            getattr(v, tag)
            for p in PROFILES.values()
            if not p.event_plane
            for v in p.versions
            if v.form == "array"
        ]
        longest = max(layouts, key=len)
        for lay in layouts:
            assert all(not f.startswith("{") for f in lay[:-1]), lay  # a map comes last
            plain = lay[:-1] if lay[-1].startswith("{") else lay
            assert plain == longest[: len(plain)], lay


# values of the fields the hot path decodes (it checks their types); any other field is a string
_TYPED = {
    "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2,
    "lora_id": 1, "medium": "GPU", "group_idx": 0, "kv_cache_spec_kind": "full_attention",
}  # fmt: skip


@pytest.mark.parametrize("tag", ["BlockStored", "BlockRemoved"])
def test_tap_names_every_field_any_version_declares(tag: str) -> None:
    names = {
        n
        for p in PROFILES.values()
        if not p.event_plane
        for v in p.versions
        for f in (v.stored if tag == "BlockStored" else v.removed)
        for n in opened(f)
    }
    event = {"type": tag, **{n: _TYPED.get(n, f"value-of-{n}") for n in sorted(names)}}
    payload = msgspec.msgpack.encode([1.5, [event], 0])
    (shown,) = batch_view(decode_payload("t", 0, payload), payload)["events"]
    assert "unknown_fields" not in shown
    for n in names - {"token_ids"}:
        assert shown[n] == event[n], n


# --- the simulator's side ------------------------------------------------------------------


def test_both_sides_name_the_same_engines_and_versions() -> None:
    ours = {n: [v.version for v in p.versions] for n, p in PROFILES.items()}
    simulated = {n: list(e.versions) for n, e in ENGINES.items()}
    assert simulated == ours


def _field_names(struct: type) -> tuple[str, ...]:
    """A struct's fields in wire order; a nested struct is `{its fields}`."""
    out = []
    for f in msgspec.structs.fields(struct):
        inner = f.type if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct) else None
        out.append("{" + ", ".join(_field_names(inner)) + "}" if inner else f.name)
    return tuple(out)


_EVERY_META = StoreMeta(
    lora_id=1, lora_name="l", cache_salt="s", session_id="x", extra_keys=[None],
    lookahead_token_ids=[[1]], locality="LOCAL", ownership="o", group_idx=0,
    kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=4,
)  # fmt: skip
_FORMATS = [f for e in ENGINES.values() for f in e.formats]


@pytest.mark.parametrize("fmt", _FORMATS, ids=lambda f: f.name)
def test_each_simulated_format_sends_the_fields_kvobserve_declares(fmt: WireFormat) -> None:
    v = next(v for v in profile(fmt.engine).versions if v.version == fmt.release)
    stored = type(fmt.stored([1], None, [1], 1, "GPU", _EVERY_META))
    removed = type(fmt.removed([1], "GPU", RemoveMeta(group_idx=0)))
    assert _field_names(stored) == v.stored
    assert _field_names(removed) == v.removed
    form = "array" if stored.__struct_config__.array_like else "map"
    assert form == v.form
    assert fmt.hash_kind in v.hashes
    assert fmt.replay_with_topic == (v.replay == "4 frames, with topic")


def test_both_sides_agree_on_discovery_routes_and_the_rank_layout() -> None:
    assert set(ANSWERS) == set(PARSERS)  # every route has an answer there and a parser here
    for name, sim in ENGINES.items():
        p = profile(name)
        served = {r for f in sim.formats for r in f.api_routes if r in ANSWERS}
        assert served <= set(p.discovery.routes if p.discovery else ()), name
        if p.layout is None:
            continue
        assert sim.pure_dp_on_leader == p.layout.pure_dp_on_leader
        for f in sim.formats:  # the version from which pure DP publishes as the DP rank
            version = tuple(map(int, f.release.split(".")))
            before = bool(p.layout.dp_rank_selection) and version < p.layout.dp_rank_selection
            assert f.pure_dp_one_port == before, f.name


def test_docs_engines_md_holds_the_generated_tables() -> None:
    text = (ROOT / "docs" / "engines.md").read_text()
    assert replaced(text) == text, (
        "docs/engines.md is stale: python -m kvobserve.engines.docs --write docs/engines.md"
    )
    for p in PROFILES.values():  # every version is in the table under its engine's title
        for v in p.versions:
            assert f"| {p.title} | {v.version} |" in text
