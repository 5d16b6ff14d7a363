"""kvobserve.sources."""
