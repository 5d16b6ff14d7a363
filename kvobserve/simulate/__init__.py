"""Simulated SGLang / vLLM engine workers: real wire bytes, a prefix cache, faults, ground truth."""

from kvobserve.simulate.config import SimConfig
from kvobserve.simulate.faults import FaultConfig
from kvobserve.simulate.group import SimulatorGroup, nodes_of
from kvobserve.simulate.ranks import Endpoint
from kvobserve.simulate.worker import SimulatedWorker

__all__ = [
    "Endpoint",
    "FaultConfig",
    "SimConfig",
    "SimulatedWorker",
    "SimulatorGroup",
    "nodes_of",
]
