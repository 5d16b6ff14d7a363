"""kvobserve.export."""
