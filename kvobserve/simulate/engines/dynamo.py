"""Dynamo as the simulator plays it: a worker relays an SGLang or vLLM format onto Dynamo's event
plane (dynamo_worker.py, dynamo_relay.py); dynamo_encode.py writes every captured version's
messages byte for byte."""

from __future__ import annotations

from kvobserve.simulate.engines.base import SimEngine

SIM = SimEngine(name="dynamo", title="Dynamo", plane_versions=("0.7.1", "1.2.1", "1.6.1"))
