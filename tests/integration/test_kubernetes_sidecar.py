"""The collector sidecar of deploy/kubernetes/sglang-dp8-lws.yaml: the environment each LWS pod
gives it, and its keep-running wrapper run for real under /bin/sh."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.k8s_helpers import (
    kvobserve_args,
    lws_sidecar_env,
    lws_templates,
)
from tests.polling import until

pytestmark = pytest.mark.integration


def _sidecar(role: str) -> dict[str, Any]:
    (sidecar,) = lws_templates()[role]["spec"]["initContainers"]
    return sidecar


@pytest.mark.parametrize(("group", "worker"), [(0, 0), (0, 1), (3, 1)])
def test_each_lws_pod_gives_its_collector_its_own_id_and_rank(group: int, worker: int) -> None:
    pod, env = lws_sidecar_env(group, worker)
    assert pod == (f"sglang-dp8-{group}" if worker == 0 else f"sglang-dp8-{group}-{worker}")
    assert env["KVOBSERVE_COLLECTOR_ID"] == pod
    assert env["KVOBSERVE_COLLECTOR_NODE_RANK"] == str(worker)
    assert env["KVOBSERVE_COLLECTOR_NNODES"] == "2"
    assert env["KVOBSERVE_WORKER_ID"] == f"sglang-dp8-{group}"  # one per group, on all its nodes
    assert env["KVOBSERVE_NATS_URL"] == "nats://nats:4222"
    assert not any("$(" in v for v in env.values()), env


def _fake_kvobserve(bin_dir: Path) -> None:
    """A `kvobserve` that fails its first start, then runs until SIGTERM (logged, exit 0)."""
    bin_dir.mkdir()
    fake = bin_dir / "kvobserve"
    fake.write_text(
        "#!/bin/sh\n"
        "trap 'echo term >> \"$FAKE_LOG\"; exit 0' TERM\n"  # before it says it started
        'echo "start $$ $*" >> "$FAKE_LOG"\n'
        'if [ "$(grep -c start "$FAKE_LOG")" -eq 1 ]; then exit 3; fi\n'
        "while :; do sleep 0.05; done\n"
    )
    fake.chmod(0o755)


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_the_wrapper_restarts_a_failed_collector_and_passes_sigterm_on(tmp_path: Path) -> None:
    sidecar = _sidecar("worker")
    assert sidecar["command"] == ["/bin/sh", "-c"]
    script = sidecar["args"][0]
    assert "sleep 10 &" in script
    script = script.replace("sleep 10 &", "sleep 0.2 &")  # the retry delay, shortened for the test
    assert "/tmp/kvobserve-collect.pid" in script
    pid_file = tmp_path / "collect.pid"
    script = script.replace("/tmp/kvobserve-collect.pid", str(pid_file))
    _fake_kvobserve(tmp_path / "bin")
    log = tmp_path / "fake.log"
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "FAKE_LOG": str(log)}
    proc = subprocess.Popen(["/bin/sh", "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    try:
        starts = until(
            lambda: _lines(log) if len(_lines(log)) >= 2 else None,
            10,
            "the collector started again after exit 3",
            lambda: _lines(log),
        )
        assert len(starts) == 2, f"started more than twice: {starts}"
        assert proc.poll() is None, "the wrapper exited: the container would restart"
        for line in starts:
            assert line.split()[2:] == ["collect", *kvobserve_args(sidecar)[1:]]
        assert pid_file.read_text().strip() == starts[1].split()[1]  # the running collector
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert _lines(log)[-1] == "term", "SIGTERM did not reach kvobserve"
        assert proc.stderr is not None
        assert "kvobserve collect exited with 3" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        lines = _lines(log)
        if lines and lines[-1].startswith("start "):  # a fake still running after a failure
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(lines[-1].split()[1]), signal.SIGKILL)
