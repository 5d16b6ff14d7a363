"""kvobserve benchmarks; each module runs with `python -m benchmarks.<name>` and prints its figures."""
