"""The engine's Prometheus /metrics text: pick the scheduler values per DP rank, and pass the
families through with `worker_id` and `node_rank` added (`--passthrough-engine-metrics`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# sample name -> SchedulerValues field
SGLANG_NAMES = {
    "sglang:num_running_reqs": "running_requests",
    "sglang:num_queue_reqs": "queued_requests",
    "sglang:token_usage": "token_usage_ratio",
    "sglang:cache_hit_rate": "cache_hit_ratio",
    "sglang:max_total_num_tokens": "max_total_tokens",
}
VLLM_NAMES = {
    "vllm:num_requests_running": "running_requests",
    "vllm:num_requests_waiting": "queued_requests",
    "vllm:kv_cache_usage_perc": "token_usage_ratio",
    "vllm:gpu_cache_usage_perc": "token_usage_ratio",  # the name before vLLM renamed it
}
RANK_LABEL = {"sglang": "dp_rank", "vllm": "engine"}  # vLLM labels its DP engines `engine`
_PREFIX = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


@dataclass(slots=True)
class EngineScrape:
    """One parsed /metrics body."""

    families: list[Metric]
    values: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> field -> value
    prefix: dict[int, tuple[float, float]] = field(default_factory=dict)  # vLLM (hits, queries)
    bad_rank_labels: int = 0


def parse_engine_metrics(text: str, engine: str) -> EngineScrape:
    """Parse exposition text and map known names per DP rank; ValueError on malformed text."""
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, TypeError, IndexError ...
        raise ValueError(f"malformed /metrics text: {exc!r}") from None
    out = EngineScrape(families)
    names, label = (SGLANG_NAMES if engine == "sglang" else VLLM_NAMES), RANK_LABEL[engine]
    prefix: dict[int, list[float]] = {}
    for fam in families:
        for s in fam.samples:
            text_rank = s.labels.get(label, "0")  # absent: a single-rank engine
            if not text_rank.isdigit():
                out.bad_rank_labels += 1
                continue
            rank = int(text_rank)
            key = names.get(s.name)
            if key is not None:
                out.values.setdefault(rank, {}).setdefault(key, s.value)  # first sample wins
            elif s.name == "vllm:cache_config_info":
                blocks, size = s.labels.get("num_gpu_blocks", ""), s.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit():
                    out.values.setdefault(rank, {})["max_total_tokens"] = int(blocks) * int(size)
            elif s.name in _PREFIX:
                pair = prefix.setdefault(rank, [0.0, 0.0])
                pair[_PREFIX.index(s.name)] += s.value
    out.prefix = {r: (h, q) for r, (h, q) in prefix.items()}
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
