"""No wrong bytes, ever (issue 17): a frozen writer and a rogue writer against real hosts.

``frozen_writer``: writer A (its own process) takes the whole pool of a
``torch-kv-tier serve --lease-timeout 1``, posts stores and is frozen with SIGSTOP while they
are in flight, for longer than every timeout; tier B takes the same slots and stores its keys;
A is resumed and its writes land. No load of B's may report ``ok`` with bytes other than its
key's; every future settles; and after A settled, B uses the whole pool again within a bound.
Private lease and shared pool, over UCX/TCP (writes stay in flight across the freeze) and the
default shared-memory transport (there A's next stores, posted as soon as it resumes, are the
late writes).

``rogue_writer``: a raw NIXL writer, bound by no lease, grant or fence, keeps overwriting every
slot of a host while a tier stores and loads there: every ``ok`` load is byte-correct.

Both fail on a build whose loads do not check the bytes they brought against their key.
"""

from __future__ import annotations

import pytest

from torch_kv_tier.benchmarks.frozen_writer import HELD_FIGURE, Setup, frozen_writer
from torch_kv_tier.benchmarks.reliability_common import Outcome
from torch_kv_tier.benchmarks.rogue_writer import rogue_writer


def report(outcome: Outcome) -> str:
    lines = [f"{f.name}: {f.text()} (limit {f.limit or '-'})" for f in outcome.figures]
    return "\n".join([f"{outcome.scenario} {outcome.params}", *lines, *outcome.problems])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tcp", [True, False], ids=["ucx-tcp", "shared-memory"])
@pytest.mark.parametrize("private", [True, False], ids=["private-lease", "shared-pool"])
def test_a_frozen_writer_never_makes_a_load_return_wrong_bytes(private: bool, tcp: bool) -> None:
    setup = Setup(private=private, tcp=tcp)
    assert setup.freeze_s > 2 * setup.lease_timeout_s and setup.freeze_s > setup.heartbeat_timeout_s
    outcome = frozen_writer(setup)
    assert outcome.ok, report(outcome)
    if tcp:  # the race under test: A's stores were still on the wire when it froze
        assert outcome.figure("A's stores in flight at the freeze").value >= 1, report(outcome)
    assert outcome.figure(HELD_FIGURE).value >= 1, report(outcome)
    assert outcome.figure("A's futures unsettled after its resume").value == 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("private", [True, False], ids=["private-lease", "shared-pool"])
def test_a_rogue_writer_on_every_slot_never_makes_a_load_return_wrong_bytes(private: bool) -> None:
    outcome = rogue_writer(private=private, seconds=3.0)
    assert outcome.ok, report(outcome)
    assert outcome.figure("rogue sweeps over the whole pool").value >= 1
