"""kvobserve: observe the KV caches of distributed LLM serving engines."""

__version__ = "0.1.0"
