"""Pure state machines over decoded batches; no sockets, no clocks."""
