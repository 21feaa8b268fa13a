"""A short run of the soak tool (tools/soak.py) against the live server: what CI can afford of it."""
import asyncio

from tools.soak import Soak


def test_short_soak_has_no_errors(server):
    soak = Soak(server, streams=8, duration_s=20, window_s=7, adapters=["sql"], cancel_fraction=0.2, seed=1)
    report = asyncio.run(soak.run())
    assert report["errors"] == 0, report["error_samples"]
    assert report["requests"] > 8 and report["cancelled"] > 0
    assert any("Engine" in name for name in report["windows"][-1]["rss_mb"])  # replica memory was read
