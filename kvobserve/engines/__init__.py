"""The engine profiles, one per engine (docs/engines.md): the one place that knows how engines
differ. Ask `profile(name)`; never compare an engine's name."""

from __future__ import annotations

from kvobserve.engines import dynamo, sglang, vllm
from kvobserve.engines.profile import EngineProfile

PROFILES: dict[str, EngineProfile] = {
    p.name: p for p in (sglang.PROFILE, vllm.PROFILE, dynamo.PROFILE)
}
NAMES = tuple(PROFILES)  # `[[worker]] engine` takes one of these


def profile(name: str) -> EngineProfile:
    """The profile of engine `name`; ValueError naming the value and the choices otherwise."""
    try:
        return PROFILES[name]
    except (KeyError, TypeError):
        raise ValueError(f"engine={name!r}: must be one of {', '.join(NAMES)}") from None


def titles(names: list[str] | tuple[str, ...]) -> str:
    """`SGLang or vLLM`: the engines' titles for a message."""
    return " or ".join(PROFILES[n].title for n in names)
