"""One configuration for every command: kvobserve.toml + KVOBSERVE_* env + flags (docs/configuration.md)."""

from kvobserve.config.load import add_config_flags, load_config, overrides_from_args
from kvobserve.config.model import (
    SECTIONS,
    AggregatorConfig,
    CollectorConfig,
    Config,
    ConfigError,
    HttpConfig,
    NatsConfig,
    WorkerConfig,
)
from kvobserve.config.values import WILDCARD_HOSTS, split_host_port

__all__ = [
    "SECTIONS",
    "WILDCARD_HOSTS",
    "AggregatorConfig",
    "CollectorConfig",
    "Config",
    "ConfigError",
    "HttpConfig",
    "NatsConfig",
    "WorkerConfig",
    "add_config_flags",
    "load_config",
    "overrides_from_args",
    "split_host_port",
]
