"""The engine's Prometheus /metrics text: pick the scheduler values per DP rank by the names its
profile declares (`SchedulerMetrics`), and pass the families through with `worker_id` and
`node_rank` added (`--passthrough-engine-metrics`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvobserve.engines import profile


@dataclass(slots=True)
class EngineScrape:
    """One parsed /metrics body."""

    families: list[Metric]
    values: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> field -> value
    prefix: dict[int, tuple[float, float]] = field(default_factory=dict)  # (hits, queries)
    worker_prefix: tuple[float, float] | None = None  # (hits, queries) of the whole worker
    bad_rank_labels: int = 0


def parse_engine_metrics(text: str, engine: str) -> EngineScrape:
    """Parse exposition text and map known names per DP rank; ValueError on malformed text."""
    m = profile(engine).metrics
    if m is None:
        raise ValueError(f"engine={engine!r}: serves no scheduler metrics")
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, TypeError, IndexError ...
        raise ValueError(f"malformed /metrics text: {exc!r}") from None
    out = EngineScrape(families)
    names, label, prefix_names = m.names, m.rank_label, m.prefix_counters
    worker_names = m.worker_prefix_counters
    prefix: dict[int, list[float]] = {}
    whole: list[float] | None = None
    for fam in families:
        for s in fam.samples:
            if s.name in worker_names:  # no rank label: the whole worker
                whole = whole or [0.0, 0.0]
                whole[worker_names.index(s.name)] += s.value
                continue
            text_rank = s.labels.get(label, "0")  # absent: a single-rank engine
            if not text_rank.isdigit():
                out.bad_rank_labels += 1
                continue
            rank = int(text_rank)
            key = names.get(s.name)
            if key is not None:
                out.values.setdefault(rank, {}).setdefault(key, s.value)  # first sample wins
            elif s.name == m.cache_info:
                blocks, size = s.labels.get("num_gpu_blocks", ""), s.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit():
                    out.values.setdefault(rank, {})["max_total_tokens"] = int(blocks) * int(size)
            elif s.name in prefix_names:
                pair = prefix.setdefault(rank, [0.0, 0.0])
                pair[prefix_names.index(s.name)] += s.value
    out.prefix = {r: (h, q) for r, (h, q) in prefix.items()}
    if whole is not None:
        out.worker_prefix = (whole[0], whole[1])
    return out


def relabel(families: Iterable[Metric], extra: Mapping[str, str]) -> list[Metric]:
    """Copies of `families` with `extra` labels on every sample; clashing engine labels are
    kept as `exported_<name>`, as Prometheus does without honor_labels."""
    out: list[Metric] = []
    for fam in families:
        m = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        for s in fam.samples:
            labels = {(f"exported_{k}" if k in extra else k): v for k, v in s.labels.items()}
            labels.update(extra)
            m.samples.append(s._replace(labels=labels))
        out.append(m)
    return out
