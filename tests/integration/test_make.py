"""The two commands: `make run` installs only what the demo needs, quietly; `make test` the rest.
The package metadata builds without the setuptools license deprecation warning."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(target: str, venv: Path) -> list[str]:
    # run under `make test` too: a sub-make would print "make[1]: Entering directory" lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", target, f"VENV={venv}"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return proc.stdout.splitlines()


def test_make_run_installs_the_runtime_only_and_make_test_the_test_extras(tmp_path: Path) -> None:
    venv = tmp_path / "v"
    run = _dry_run("run", venv)
    installs = [ln for ln in run if "pip install" in ln]
    assert installs and all(" -qq " in ln for ln in installs)
    assert any(ln.endswith("-e .") for ln in installs)
    assert not any("[test]" in ln for ln in run)
    assert run[-1].strip() == f"{venv}/bin/kvobserve demo"
    test = _dry_run("test", venv)
    assert any("pip install" in ln and "-e '.[test]'" in ln for ln in test)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the demo's own imports are runtime dependencies, the tools are not
    assert not any(
        d.startswith(("pytest", "mypy", "ruff", "hypothesis")) for d in extras["dependencies"]
    )


def test_the_wheel_builds_without_a_license_deprecation(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "project.license" not in out and "deprecated" not in out.lower(), out
    (wheel,) = tmp_path.glob("kvobserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
