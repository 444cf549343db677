"""``split_cost``: the whole-transfer setting against NIXL's default split, end to end."""

from __future__ import annotations

import pytest

from torch_kv_tier.benchmarks import split_cost
from torch_kv_tier.transport.ucx_env import ucx_backend_params


def test_split_cost_compares_the_tiers_setting_with_nixls_split_and_verifies_bytes() -> None:
    """The two initiators really run as claimed (the live agents' options say so: the tier's
    default has no worker threads, the reference 4 and NIXL's default split), every byte
    round-trips through both, and each op's ratio comes from paired rounds."""
    row = split_cost.measure(None, 4096, 1024, rounds=2, xfers=1)
    nixl_split = {k: v for k, v in ucx_backend_params(4).items() if k != "split_batch_size"}
    assert row["ucx_options"] == {"whole": ucx_backend_params(0), "split": nixl_split}
    assert "num_threads" not in row["ucx_options"]["whole"]
    added = row["threads_and_fds_added"]  # NIXL's worker threads, their workers' sockets
    assert added["split"]["threads"] > added["whole"]["threads"]
    assert added["split"]["fds"] > added["whole"]["fds"]
    assert row["verified"] is True
    for op in ("write", "read"):
        figures = row[op]
        assert figures["ratio_min"] <= figures["ratio_median"] <= figures["ratio_max"]
        assert figures["whole_gbps_median"] > 0 and figures["split_gbps_median"] > 0


def test_split_cost_refuses_no_rounds() -> None:
    with pytest.raises(SystemExit):
        split_cost.main(["--rounds", "0"])
