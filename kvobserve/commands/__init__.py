"""One module per `kvobserve` command: config in, running parts out (the only place that wires
HTTP, signals and transports)."""
