"""Acceptance: `kvobserve demo` (what `make run` starts) serves 12 streams fast and stops on SIGTERM."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvobserve.simulate.ports import free_port
from tests.integration.fleet_helpers import ROOT, Procs, Scrape, fetch, scrape
from tests.polling import until

pytestmark = pytest.mark.integration

STREAMS = {("sglang-dp8", str(r)) for r in range(8)} | {("vllm-dp4", str(r)) for r in range(4)}


def _collector(worker_id: str, rank: int) -> str:
    """The demo's collectors: SGLang ranks 0-3 on node 0, 4-7 on node 1; vLLM on one node."""
    return f"sglang-node-{rank // 4}" if worker_id == "sglang-dp8" else "vllm-node-0"


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def test_make_run_starts_the_demo() -> None:
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^run:.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert recipe is not None, "no `run` target in the Makefile"
    assert re.search(
        r"^\t@?\$\(BIN\)/kvobserve demo \$\(DEMO_FLAGS\)\s*$", recipe.group(1), re.MULTILINE
    )
    assert re.search(r"^run: venv-run$", text, re.MULTILINE)  # the runtime install only
    assert re.search(r"^BIN := \$\(VENV\)/bin$", text, re.MULTILINE)
    assert re.search(r"^VENV := \.venv$", text, re.MULTILINE)


def test_demo_serves_twelve_streams_and_stops_on_sigterm(procs: Procs) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    pid = procs.kvobserve("demo", "demo", "--listen", f"127.0.0.1:{port}", "--duration", "30")

    def twelve_up() -> Scrape | None:
        assert procs.alive(pid), procs.log(pid)
        s = scrape(base)
        if s is None:
            return None
        up = s.by("kvobserve_stream_up", ("worker_id", "dp_rank"))
        return s if set(up) == STREAMS and all(v == 1 for v in up.values()) else None

    s = until(twelve_up, 10, "12 streams up", lambda: scrape(base))
    took = time.monotonic() - t0
    assert took < 10.0, f"12 streams after {took:.1f} s"
    info = s.by("kvobserve_stream_info", ("worker_id", "dp_rank", "engine", "collector"))
    assert set(info) == {(w, r, w.split("-")[0], _collector(w, int(r))) for w, r in STREAMS}
    owners = s.by("kvobserve_dp_rank_owners", ("worker_id", "dp_rank"))
    assert owners == dict.fromkeys(STREAMS, 1.0)

    # every stream has a usage ratio (node 1's SGLang ranks too: their load PUB, read on node 1)
    # but vLLM rank 1, whose injected second publisher leaves an index that cannot vouch for
    # itself: no usage there, a lower bound and kvobserve_kv_index_unvouched instead
    dup = ("vllm-dp4", "1")

    def usage_everywhere() -> Scrape | None:
        s = scrape(base)
        if s is None:
            return None
        got = s.by("kvobserve_kv_cache_usage_ratio", ("worker_id", "dp_rank"))
        sched = s.by("kvobserve_scheduler_token_usage_ratio", ("worker_id", "dp_rank"))
        unvouched = s.by("kvobserve_kv_index_unvouched", ("worker_id", "dp_rank"))
        ok = set(got) == STREAMS - {dup} and set(sched) == STREAMS and unvouched == {dup: 1.0}
        return s if ok else None

    s = until(usage_everywhere, 10, "usage of 11 streams", lambda: scrape(base))
    ratios = s.by("kvobserve_kv_cache_usage_ratio", ("worker_id", "dp_rank")).values()
    assert all(0 <= v < 1 for v in ratios)  # 0 until a stream's first batch
    assert set(s.by("kvobserve_kv_tokens_lower_bound", ("worker_id", "dp_rank"))) == {dup}

    def both_sources() -> list[dict[str, object]] | None:  # load PUB and each node's /metrics
        streams: list[dict[str, object]] = json.loads(fetch(f"{base}/api/v1/streams") or "[]")
        sg = {x["scheduler_source"] for x in streams if x["worker_id"] == "sglang-dp8"}
        return streams if sg == {"load+metrics"} else None

    streams = until(both_sources, 10, "SGLang ranks read from load and /metrics", lambda: None)
    hosts = {
        (x["worker_id"], x["dp_rank"]): str(x["endpoint"]).split("://")[1].rsplit(":", 1)[0]
        for x in streams
    }
    # the two SGLang nodes on their own loopback addresses, each rank watched on its own
    assert hosts == {(w, int(r)): "127.0.0.2" if _collector(w, int(r)) == "sglang-node-1"
                     else "127.0.0.1" for w, r in STREAMS}  # fmt: skip
    assert {x["scheduler_source"] for x in streams if x["worker_id"] == "vllm-dp4"} == {"metrics"}

    page = fetch(f"{base}/")
    assert page is not None
    workers = page.split('id="workers"', 1)[1]
    assert "sglang-dp8 &middot; dp_size 8" in workers
    assert "vllm-dp4 &middot; dp_size 4" in workers
    assert "demo: 3 simulated engine nodes, 12 KV-event streams" in procs.log(pid)

    rc, took = procs.terminate(pid)
    assert rc == 0, procs.log(pid)
    assert took < 2.0, f"demo took {took:.2f} s to stop after SIGTERM"
