"""The suite's process-wide setup: each parallel worker's port block, the Hypothesis profiles.

Ports: a test that needs a port range (an engine's ranks on base + rank) or a port for a process
that cannot report the port it bound takes it from `kvobserve.simulate.ports`; under pytest-xdist
each worker draws from its own block below the ephemeral range (`KVOBSERVE_SIM_PORTS`, which
the processes a test starts inherit), so that no other worker and no outgoing connection takes
it between the pick and the bind.

Hypothesis: `full` (the default here; Hypothesis's `ci` where CI is set) runs every property's
full count of examples, without a deadline; `quick` (`make check`) a tenth of them. A test asks
for its count through `tests.examples.examples(n)`.
"""

from __future__ import annotations

import os

import pytest

from kvobserve.simulate import ports
from tests import examples

examples.register_profiles()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist: this worker's port block, before any test module is imported."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and count > 1:
        lo, hi = ports.worker_block(int(worker[2:]), count)
        os.environ[ports.ENV] = f"{lo}-{hi}"
