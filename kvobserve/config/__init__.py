"""One configuration for every command: kvobserve.toml + KVOBSERVE_* env + flags (docs/configuration.md)."""

from kvobserve.config.load import add_config_flags as add_config_flags
from kvobserve.config.load import load_config as load_config
from kvobserve.config.load import overrides_from_args as overrides_from_args
from kvobserve.config.model import *  # noqa: F403 - the model: one dataclass per section
from kvobserve.config.values import WILDCARD_HOSTS as WILDCARD_HOSTS
from kvobserve.config.values import split_host_port as split_host_port
