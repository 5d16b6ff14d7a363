"""The suite's process-wide setup: each parallel worker's port block, the Hypothesis profiles.

Ports: a test that needs a port range (an engine's ranks on base + rank) or a port for a process
that cannot report the port it bound takes it from `kvobserve.simulate.ports`; under pytest-xdist
each worker draws from its own block below the ephemeral range (`KVOBSERVE_SIM_PORTS`, which
the processes a test starts inherit), so that no other worker and no outgoing connection takes
it between the pick and the bind.

Checkpoints: each test's collectors keep theirs in a folder of its own (`state_dir`'s default,
and KVOBSERVE_COLLECTOR_STATE_DIR for the processes it starts), never in the machine's
/var/lib/kvobserve: tests running at once would share (and lock) it, and one test's checkpoints
would be offered to the next.

Hypothesis: `full` (the default here; Hypothesis's `ci` where CI is set) runs every property's
full count of examples, without a deadline; `quick` (`make check`) a tenth of them. A test asks
for its count through `tests.examples.examples(n)`.
"""

from __future__ import annotations

import os

import pytest

import kvobserve.config.load as config_load
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


STATE_ENV = "KVOBSERVE_COLLECTOR_STATE_DIR"


@pytest.fixture(autouse=True)
def _own_state_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This test's own default state_dir (checkpoints), in-process and in its processes."""
    folder = str(tmp_path_factory.mktemp("state"))
    monkeypatch.setattr(config_load, "default_state_dir", lambda env, root: folder)
    monkeypatch.setenv(STATE_ENV, folder)
