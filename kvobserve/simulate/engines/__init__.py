"""The simulator's engine profiles, one per engine: how each engine is played, version by
version. Ask `engine(name)`; never compare an engine's name (docs/engines.md)."""

from __future__ import annotations

from kvobserve.simulate.engines import dynamo, sglang, vllm
from kvobserve.simulate.engines.base import SimEngine

ENGINES: dict[str, SimEngine] = {e.name: e for e in (sglang.SIM, vllm.SIM, dynamo.SIM)}


def engine(name: str) -> SimEngine:
    """The simulator profile of engine `name`; ValueError naming the value and the choices."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"engine: unknown {name!r}; one of {', '.join(ENGINES)}") from None


def titles(names: list[str]) -> str:
    """`SGLang or vLLM`: the engines' titles for a message."""
    return " or ".join(ENGINES[n].title for n in names)
