"""kvobserve.simulate."""
