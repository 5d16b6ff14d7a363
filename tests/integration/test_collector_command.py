"""`kvobserve collect` as an operator runs it: local /metrics on 127.0.0.1, NATS, SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvobserve.simulate.ports import free_port, free_port_range
from tests.integration.collector_helpers import Sims, sim_config, truth_instance
from tests.integration.conftest import NatsServer
from tests.polling import until_async

pytestmark = pytest.mark.integration


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(url: str) -> Samples:
    """(sample name, sorted labels) -> value; empty while nothing answers."""
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for (n, lb), v in samples.items() if n == name and set(labels.items()) <= set(lb)]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


async def test_collect_serves_local_metrics_and_stops_on_sigterm(
    tmp_path: Path, nats_server: NatsServer, sims: Sims
) -> None:
    kv, replay, port = free_port_range("127.0.0.1", 3), free_port_range("127.0.0.1", 2), free_port()
    cfg = tmp_path / "node0.toml"
    cfg.write_text(
        'cluster = "t"\n[collector]\nid = "node-0"\ninterval_s = 0.2\n'
        f'[http]\nlisten = "127.0.0.1:{port}"\n'
        '[[worker]]\nid = "w"\nengine = "sglang"\ndp_size = 2\ndp_attention = true\n'
        f'kv_endpoint = "tcp://127.0.0.1:{kv}"\nreplay_endpoint = "tcp://127.0.0.1:{replay}"\n'
    )
    log = (tmp_path / "collect.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvobserve", "collect", "-c", str(cfg), "--nats", nats_server.url],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    logfile = tmp_path / "collect.log"

    async def scrape_until(pred: Callable[[Samples], bool], what: str) -> Samples:
        async def scraped() -> Samples | None:
            assert proc.poll() is None, f"collect exited: {logfile.read_text()}"
            samples = await scrape(url)
            return samples if pred(samples) else None

        got: Samples = await until_async(scraped, 15.0, what, logfile.read_text)
        return got

    try:
        samples = await scrape_until(
            lambda m: value(m, "kvobserve_stream_up", dp_rank="1") is not None, "local /metrics"
        )
        assert value(samples, "kvobserve_stream_up", dp_rank="0") == 0.0  # no engine yet
        sim = sims.start(sim_config("sglang-0.5.23", kv_port=kv, replay_port=replay))
        samples = await scrape_until(
            lambda m: all(
                value(m, "kvobserve_kv_event_batches_total", dp_rank=str(r)) == 60.0 for r in (0, 1)
            ),
            "every batch counted",
        )
        truth = sim.truth()
        for r in (0, 1):
            blocks = len(truth_instance(truth, r)["resident"]["GPU"])
            assert value(samples, "kvobserve_kv_blocks", dp_rank=str(r), medium="GPU") == blocks
            assert value(samples, "kvobserve_stream_up", dp_rank=str(r)) == 1.0
            assert value(samples, "kvobserve_kv_batches_lost_total", dp_rank=str(r)) == 0.0
        assert value(samples, "kvobserve_collector_up", collector="node-0") == 1.0
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 2.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        log.close()
