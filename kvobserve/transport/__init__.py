"""kvobserve.transport."""
