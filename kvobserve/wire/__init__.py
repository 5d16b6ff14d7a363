"""Pure decoding of engine and kvobserve wire messages; no I/O."""
