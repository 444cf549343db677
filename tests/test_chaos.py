"""``torch-kv-tier chaos`` in CI (issue 18): 75 s (and 40 s more over TCP) of hosts and tiers
killed, frozen, restarted and cut off at random, bad keys fed to the API, every loaded block
checked.

What must hold: 0 wrong blocks, 0 hung futures, 0 calls raising unexpectedly, no tier silently
stale (a listed host's probe key seen, or the host dropped, within the bound), every
long-lived tier's fds, threads and RSS flat, every worker finished. The long run:
``torch-kv-tier chaos --seconds 600 --json chaos.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torch_kv_tier.cli import main


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("transport", "seconds"), [([], "75"), (["--tcp"], "40")], ids=["ucx-default", "tcp"]
)
def test_chaos_keeps_every_promise(tmp_path: Path, transport: list[str], seconds: str) -> None:
    """UCX's choice (shared memory: a transfer mostly completes inside the call), and UCX over
    TCP (transfers in flight while their writers and hosts freeze, die and reconnect)."""
    out = tmp_path / "chaos.json"
    args = ["--log-level", "CRITICAL", "chaos", "--seconds", seconds, "--writers", "1"]
    code = main([*args, *transport, "--readers", "2", "--pause", "0.01", "--json", str(out)])
    report = json.loads(out.read_text())
    figures = {f["name"]: f for f in report["figures"]}
    table = "\n".join(f"{f['name']}: {f['value']} ({f['limit']})" for f in report["figures"])
    failed = [f["name"] for f in report["figures"] if not f["ok"]]
    assert code == 0 and report["ok"], f"{failed}\n{table}\n" + "\n".join(report["problems"])
    assert figures["wrong blocks"]["value"] == 0
    assert figures["futures hung"]["value"] == 0
    assert figures["stale probes (a listed host's key never seen)"]["value"] == 0
    assert figures["blocks verified"]["value"] > 0
    assert figures["host restarts"]["value"] > 0  # the chaos really happened


@pytest.mark.timeout(600)
def test_chaos_with_disk_tiers_keeps_every_promise(tmp_path: Path) -> None:
    """The same chaos with every host keeping a disk tier behind a pool of a quarter of the key
    space: keys leave DRAM for disk and come back, and hosts SIGKILLed mid-write restart on
    their directories (``serve --disk``)."""
    out = tmp_path / "chaos.json"
    args = ["--log-level", "CRITICAL", "chaos", "--seconds", "40", "--writers", "1"]
    args += ["--readers", "1", "--pause", "0.01", "--disk", str(tmp_path / "disks")]
    code = main([*args, "--json", str(out)])
    report = json.loads(out.read_text())
    figures = {f["name"]: f for f in report["figures"]}
    failed = [f["name"] for f in report["figures"] if not f["ok"]]
    assert code == 0 and report["ok"], f"{failed}\n" + "\n".join(report["problems"])
    assert figures["wrong blocks"]["value"] == 0 and figures["futures hung"]["value"] == 0
    assert figures["blocks verified"]["value"] > 0
    assert figures["host restarts"]["value"] > 0
