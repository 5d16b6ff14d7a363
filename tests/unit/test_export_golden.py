"""A deterministic scrape of the rich fleet, sorted and masked, equals the checked-in golden file."""

from __future__ import annotations

import gzip
import os
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest

from kvobserve import __version__
from kvobserve.export.catalog import CATALOG
from kvobserve.export.prometheus import FleetCollector
from kvobserve.export.scrape import ScrapeCache
from tests.unit.test_export_fleet import rich_view

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "metrics.txt"
TIMELY = tuple(m.name for m in CATALOG if m.timely)


def golden_text(body: str) -> str:
    """Sorted sample lines (HELP/TYPE kept), clock-dependent values and the version masked."""
    lines = []
    for line in body.splitlines():
        line = line.replace(f'version="{__version__}"', 'version="VERSION"')
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if not line.startswith("#") and name in TIMELY:
            line = line.rsplit(" ", 1)[0] + " MASKED"
        lines.append(line)
    return "\n".join(sorted(lines)) + "\n"


def test_scrape_matches_golden_file() -> None:
    r = CollectorRegistry()
    view = rich_view()
    r.register(FleetCollector(lambda: view))
    got = golden_text(generate_latest(r).decode())
    if os.environ.get("KVOBSERVE_UPDATE_GOLDEN"):
        GOLDEN.write_text(got)
    assert GOLDEN.read_text() == got, (
        "scrape differs from tests/fixtures/golden/metrics.txt; if intended, regenerate with "
        "KVOBSERVE_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_export_golden.py"
    )
    assert "MASKED" in got  # the masks apply to something


@pytest.mark.parametrize("packed", [False, True])
def test_cached_scrape_matches_golden_file(packed: bool) -> None:
    view = rich_view()
    cache = ScrapeCache()
    for _ in range(2):  # rendered, then from the cache
        body = cache.render(view, [], generate_latest, False, packed)
        text = gzip.decompress(body) if packed else body
        assert golden_text(text.decode()) == GOLDEN.read_text()


def test_cached_openmetrics_scrape_is_prometheus_clients() -> None:
    view = rich_view()
    r = CollectorRegistry()
    r.register(FleetCollector(lambda: view))
    want = om_generate_latest(r)
    cache = ScrapeCache()
    assert cache.render(view, [], om_generate_latest, True) == want
    assert gzip.decompress(cache.render(view, [], om_generate_latest, True, True)) == want
    assert want.endswith(b"# EOF\n") and want.count(b"# EOF") == 1
