"""``split_cost``: the whole-transfer setting against NIXL's default split, end to end."""

from __future__ import annotations

import pytest

from torch_kv_tier.benchmarks import split_cost
from torch_kv_tier.transport.ucx_env import NO_SPLIT


def test_split_cost_compares_the_tiers_setting_with_nixls_default_and_verifies_bytes() -> None:
    """The two initiators really differ in the one setting under test (the live agents say so),
    every byte round-trips through both, and each op's ratio comes from paired rounds."""
    row = split_cost.measure(None, 4096, 1024, rounds=2, xfers=1)
    assert row["split_batch_size"] == {"whole": NO_SPLIT, "split": "NIXL default"}
    assert row["verified"] is True
    for op in ("write", "read"):
        figures = row[op]
        assert figures["ratio_min"] <= figures["ratio_median"] <= figures["ratio_max"]
        assert figures["whole_gbps_median"] > 0 and figures["split_gbps_median"] > 0


def test_split_cost_refuses_no_rounds() -> None:
    with pytest.raises(SystemExit):
        split_cost.main(["--rounds", "0"])
