"""Promotion admission inside vLLM's TieringOffloadingManager: which requests it holds a step,
promotes beside a recompute or behind prefills, how long a promotion under way goes first, and
that it decides a burst without scanning vLLM's queue.

Runs on ``PromotionAdmission`` alone, without an engine or a host; skipped with the other
vLLM tier tests where vLLM 0.33.0 is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.spec",
    reason="vLLM 0.33.0 is not installed (see requirements/vllm-0.33-cpu.txt)",
)

from torch_kv_tier.integrations.vllm.admission import PromotionAdmission, Verdict  # noqa: E402


def test_admission_holds_a_new_request_one_step_and_never_promises_a_key_twice() -> None:
    """The gates before a request's first promotion, without vLLM: a request alone on the
    engine is promoted in its arrival step; beside another it is held (RETRY) in that step, so
    a burst is seen whole, then promoted; and a key promised once is never promised again."""
    admission = PromotionAdmission(budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64)
    admission.on_new_request("p")
    assert admission.admit("p", b"p0") is Verdict.HIT  # alone: promoted in its arrival step
    admission.on_submitted("p", [b"p0"])
    admission.end_step(scheduled=("p",), preempted=())  # p runs
    admission.on_new_request("a")
    assert admission.admit("a", b"k0") is Verdict.RETRY  # arrived in this step, beside p
    admission.end_step(scheduled=(), preempted=())
    assert admission.admit("a", b"k0") is Verdict.HIT
    admission.on_submitted("a", [b"k0"])
    assert admission.held == 1  # p's left a step after p was scheduled; a's is read
    assert admission.admit("a", b"k0") is Verdict.MISS  # lost before use: not read again
    admission.end_step(scheduled=("a",), preempted=())
    assert admission.held == 1  # vLLM loads a's chunk into its KV cache in this step
    admission.end_step(scheduled=(), preempted=())
    assert admission.held == 0
    assert admission.stats.held == 1 and admission.stats.refused_repeat == 1


def test_admission_promotes_beside_a_recompute_so_one_recompute_does_not_breed_the_next() -> None:
    """A request that arrives while another recomputes is promoted (a step later), not
    refused: refused, it would prefill beside that recompute, and its own prefill would then
    refuse the request after it, and so on (serve-bench, concurrency 4, 8 MiB CPU tier: 6 to
    16 such refusals a scenario, 56 % to 76 % of the prompt tokens from the tier; 83 % to 93 %
    without them). A promoted request is no recompute."""
    admission = PromotionAdmission(budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64)
    admission.on_new_request("r")
    assert admission.recompute("r") is Verdict.MISS  # a key the tier does not hold
    admission.end_step(scheduled=("r",), preempted=())  # r recomputes
    admission.on_new_request("a")
    assert admission.admit("a", b"k0") is Verdict.RETRY  # its arrival step, beside r
    admission.end_step(scheduled=(), preempted=())
    assert admission.admit("a", b"k0") is Verdict.HIT  # promoted while r stores its prefix
    admission.on_submitted("a", [b"k0"])
    admission.end_step(scheduled=("a",), preempted=())
    admission.on_new_request("b")
    admission.end_step(scheduled=(), preempted=())
    assert admission.admit("b", b"k1") is Verdict.HIT
    assert admission.stats.refused() == {"busy": 0, "pressure": 0, "budget": 0}


def test_admission_lets_a_promotion_under_way_go_first_for_at_most_guard_s() -> None:
    """A request that reached an idle engine just ahead of a burst is promoted (it was seen
    alone). The burst's requests, which would recompute (their prefixes do not fit) and fill
    its steps with their prefill, wait instead (RETRY, once per step: the next lookup in the
    step ends vLLM's scan) until it is scheduled, and at most ``guard_s`` after they arrived.
    With no promotion under way, a request that would recompute does so at once."""
    now = [0.0]
    admission = PromotionAdmission(
        budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64, guard_s=0.05,
        clock=lambda: now[0],
    )  # fmt: skip
    assert admission.recompute("nobody") is Verdict.MISS
    admission.on_new_request("first")
    assert admission.admit("first", b"k0") is Verdict.HIT  # alone: promoted in its arrival step
    admission.on_submitted("first", [b"k0"])
    for n in range(3):  # the burst: four prefixes of 4 chunks do not fit a budget of 8
        admission.on_new_request(f"burst{n}")
    assert admission.admit("burst0", b"k1") is Verdict.RETRY  # a remote hit that would recompute
    assert admission.admit("burst0", b"k2") is Verdict.MISS  # the same step: the scan ends
    assert admission.recompute("burst1") is Verdict.RETRY  # a key the tier does not hold
    admission.end_step(scheduled=(), preempted=())
    now[0] += 0.01
    assert admission.recompute("burst1") is Verdict.RETRY  # next step: still waiting
    admission.end_step(scheduled=("first",), preempted=())  # the promoted request runs
    assert admission.admit("burst0", b"k1") is Verdict.MISS  # nothing under way: recompute
    assert admission.recompute("burst1") is Verdict.MISS
    assert admission.stats.guarded == 3 and admission.stats.refused_pressure == 1
    admission.end_step(scheduled=("burst0", "burst1"), preempted=())
    admission.end_step(scheduled=(), preempted=())
    admission.end_step(scheduled=(), preempted=())
    admission.on_new_request("second")
    admission.end_step(scheduled=(), preempted=())
    assert admission.admit("second", b"k3") is Verdict.HIT  # promoted; burst2 still waits:
    now[0] += 0.04  # 0.05 s after it arrived, it waits no longer (a promotion may be stuck)
    assert admission.recompute("burst2") is Verdict.MISS
    with pytest.raises(ValueError, match="guard_s"):
        PromotionAdmission(budget_chunks=8, tokens_per_chunk=16, guard_s=-1)


@pytest.mark.parametrize("ended", ["read failed", "dropped unread"])
def test_admission_guard_holds_nobody_for_a_promotion_that_failed_or_was_dropped(
    ended: str,
) -> None:
    """A promotion whose read failed (its host lost) or that was dropped unread (vLLM allocated
    only part of it) is no longer under way: its request recomputes, so a request that would
    recompute is not held for it, though the failed request is not yet scheduled."""
    now = [0.0]
    admission = PromotionAdmission(
        budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64, guard_s=0.05,
        clock=lambda: now[0],
    )  # fmt: skip
    admission.on_new_request("first")
    keys = [f"f{c}".encode() for c in range(4)]
    assert [admission.admit("first", k) for k in keys] == [Verdict.HIT] * 4  # alone
    dropped = ended == "dropped unread"  # vLLM allocated the first two only
    assert admission.on_submitted("first", keys[:2] if dropped else keys) is dropped
    if dropped:
        admission.on_read_failed("first", keys[:2])  # reported failed at once
    admission.end_step(scheduled=(), preempted=())
    if not dropped:
        admission.on_read_failed("first", keys)  # its host was lost: heard in the next step
    admission.on_new_request("next")
    assert admission.recompute("next") is Verdict.MISS  # not held: nothing under way
    assert admission.stats.guarded == 0
    admission.end_step(scheduled=("next",), preempted=())
    assert admission.held == 0


def _with_a_promotion_under_way(budget_chunks: int, now: list[float]) -> PromotionAdmission:
    """An admission with a 0.05 s guard on the clock ``now[0]``, whose request "first" arrived
    alone, promoted its 4-chunk prefix (submitted), and is not yet scheduled."""
    admission = PromotionAdmission(
        budget_chunks=budget_chunks, tokens_per_chunk=16, prefix_tokens=64, guard_s=0.05,
        clock=lambda: now[0],
    )  # fmt: skip
    admission.on_new_request("first")
    first = [f"f{c}".encode() for c in range(4)]
    assert [admission.admit("first", k) for k in first] == [Verdict.HIT] * 4  # alone
    admission.on_submitted("first", first)
    admission.end_step(scheduled=(), preempted=())
    return admission


def test_admission_holds_a_request_the_budget_refuses_while_a_promotion_is_under_way() -> None:
    """A request behind two prefills is promoted if its prefix fits the budget, else it
    recomputes: not at once while another request's promotion is under way, or its prefill
    fills that promotion's steps (CI, the engine burst test: three such recomputes scheduled in
    the step of the first request's load, its first token after 0.298 s against its 0.123 s
    recompute). It waits like any refused request, at most ``guard_s``."""
    now = [0.0]
    admission = _with_a_promotion_under_way(budget_chunks=8, now=now)
    for n in range(4):  # the burst arrives while first's promotion is under way
        admission.on_new_request(f"b{n}")
    for req_id in ("b0", "b1"):  # the queue does not fit: held
        assert admission.admit(req_id, f"{req_id}-0".encode()) is Verdict.RETRY
        assert admission.admit(req_id, f"{req_id}-1".encode()) is Verdict.MISS  # scan ends
    b2 = [f"b2-{c}".encode() for c in range(4)]  # behind b0's and b1's prefills: promoted
    assert [admission.admit("b2", k) for k in b2] == [Verdict.HIT] * 4
    admission.on_submitted("b2", b2)
    assert admission.admit("b3", b"b3-0") is Verdict.RETRY  # no room left: held, not recomputed
    assert admission.stats.refused_budget == 0
    admission.end_step(scheduled=("first",), preempted=())  # b2's promotion is still under way
    now[0] += 0.05  # the guard holds a request at most 0.05 s after it arrived
    assert admission.admit("b3", b"b3-0") is Verdict.MISS
    assert admission.stats.refused_budget == 1 and admission.stats.guarded == 3


def test_admission_counts_a_request_served_from_the_caches_above_it_as_no_recompute() -> None:
    """vLLM serves a repeated prompt from its own prefix cache or CPU tier without asking this
    tier: it computes nothing, so a request behind it waits behind no prefill and is not
    promoted past a queue that does not fit (serve-bench at concurrency 16: vLLM's random
    prompts repeat across rounds, and counted as recomputes such prompts refused the burst
    beside them). A request the tier answered MISS is a recompute."""
    admission = PromotionAdmission(
        budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64, primary_chunks=32
    )  # room for c's prefix beside a's and b's stores
    for req_id in ("cached0", "cached1", "a", "b", "c"):
        admission.on_new_request(req_id)
    admission.end_step(scheduled=("cached0", "cached1"), preempted=())  # never asked this tier
    assert admission.admit("a", b"a0") is Verdict.MISS  # three prefixes do not fit: pressure
    assert admission.admit("b", b"b0") is Verdict.MISS  # behind a only
    admission.end_step(scheduled=("a", "b"), preempted=())  # two recomputes
    assert admission.admit("c", b"c0") is Verdict.HIT  # behind two prefills: promoted
    assert admission.stats.refused_pressure == 2 and admission.stats.admitted == 1


def test_admission_promotes_a_request_that_would_recompute_behind_two_prefills() -> None:
    """A queue the CPU tier cannot take whole refuses a promotion only while the request's own
    recompute would start soon; otherwise a burst that never fits (issue 19's 8 MiB tier at
    concurrency 16) recomputes whole, in a queue. A request behind two prefills (a recompute
    scheduled in the last step, one waiting that arrived before it) is promoted; one that
    arrived before the waiting recompute is not behind it."""
    now = [0.0]
    admission = PromotionAdmission(
        budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64, clock=lambda: now[0]
    )  # four waiting prefixes of 4 chunks do not fit
    admission.on_new_request("early")
    now[0] += 0.001
    for req_id in ("r", "a", "b", "c"):
        admission.on_new_request(req_id)
    assert admission.recompute("r") is Verdict.MISS
    admission.end_step(scheduled=("r",), preempted=())  # r prefills
    assert admission.admit("a", b"a0") is Verdict.MISS  # behind r only: pressure
    assert admission.admit("early", b"e0") is Verdict.MISS  # a arrived after it: r only
    assert admission.admit("b", b"b0") is Verdict.HIT  # behind r, early and a: promoted
    assert admission.admit("b", b"b1") is Verdict.HIT
    assert admission.admit("c", b"c0") is Verdict.HIT
    assert admission.stats.refused_pressure == 2 and admission.stats.admitted == 3


def test_admission_pipelines_a_burst_larger_than_the_budget_from_its_third_step() -> None:
    """A burst whose prefixes do not all fit the CPU tier (issue 19's 8 MiB tier at
    concurrency 16: two prefixes' budget, sixteen requests), one recompute a step. The first
    two heads recompute (the queue does not fit, and promoting them past it would cost them
    three steps against one or two); from the third step on, a head has waited behind two
    recomputes and is promoted whole, with the next one while the budget holds whole prefixes,
    and the one after recomputes in the same step. A promise stays in the budget until vLLM
    has loaded it (the step after its request is scheduled), and is never made in part."""
    admission = PromotionAdmission(budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64)
    burst = [f"r{n}" for n in range(8)]  # budget: two prefixes of 4 chunks
    for req_id in burst:
        admission.on_new_request(req_id)
    assert admission.admit("r0", b"r0-0") is Verdict.MISS  # the queue does not fit: pressure
    admission.end_step(scheduled=("r0",), preempted=())
    assert admission.admit("r1", b"r1-0") is Verdict.MISS  # behind one prefill: pressure
    admission.end_step(scheduled=("r1",), preempted=())
    for req_id in ("r2", "r3"):  # behind two recomputes: promoted, each its whole prefix
        assert [admission.admit(req_id, f"{req_id}-{c}".encode()) for c in range(4)] == [
            Verdict.HIT
        ] * 4
        admission.on_submitted(req_id, [f"{req_id}-{c}".encode() for c in range(4)])
    assert admission.held == 8
    assert admission.admit("r4", b"r4-0") is Verdict.MISS  # no whole prefix left: recompute
    admission.end_step(scheduled=("r4",), preempted=())
    # r2's and r3's reads landed: their chunks stay in the budget (vLLM's stores would evict
    # them first) until vLLM has loaded them, the step after their request is scheduled
    assert admission.admit("r5", b"r5-0") is Verdict.MISS
    admission.end_step(scheduled=("r5",), preempted=())
    admission.on_read_failed("r3", [b"r3-3"])  # a failed read leaves the budget at once
    assert admission.held == 7
    admission.end_step(scheduled=("r2",), preempted=())
    assert admission.admit("r6", b"r6-0") is Verdict.MISS  # vLLM loads r2's chunks now
    admission.end_step(scheduled=("r6",), preempted=())
    assert admission.admit("r7", b"r7-0") is Verdict.HIT  # r2's budget: the next head's
    stats = admission.stats
    assert (stats.refused_pressure, stats.refused_busy, stats.refused_budget) == (2, 0, 3)
    assert stats.admitted == 9


@pytest.mark.parametrize(("primary_chunks", "verdict"), [(16, Verdict.MISS), (20, Verdict.HIT)])
def test_admission_promotes_behind_prefills_only_what_the_cpu_tier_holds_beside_their_stores(
    primary_chunks: int, verdict: Verdict
) -> None:
    """A request behind two prefills is promoted only if vLLM's CPU tier holds its prefix beside
    a prefix for each recompute of the last step, twice (that step's stores still in flight and
    this step's): its chunks land amid those stores and, idle until their request is scheduled,
    are what vLLM evicts (the CI engine burst test: request 1 evicted down to 3 of 62 chunks,
    then recomputed, its first token after 0.571 s against its 0.243 s recompute)."""
    admission = PromotionAdmission(
        budget_chunks=8, tokens_per_chunk=16, prefix_tokens=64, primary_chunks=primary_chunks
    )
    for req_id in ("r0", "r1", "r2"):
        admission.on_new_request(req_id)
    assert admission.admit("r0", b"r0-0") is Verdict.MISS  # the queue does not fit: pressure
    assert admission.admit("r1", b"r1-0") is Verdict.MISS
    admission.end_step(scheduled=("r0", "r1"), preempted=())  # two prefixes of stores ahead
    # behind two prefills, its 4 chunks in the budget; beside 2 x 2 x 4 chunks of stores?
    assert admission.admit("r2", b"r2-0") is verdict
    assert admission.stats.refused_busy == (verdict is Verdict.MISS)


def test_admission_guard_releases_the_requests_it_holds_in_queue_order() -> None:
    """The guard reads its clock once a step: a request it holds is never overtaken by one that
    arrived after it and was looked up later in the same step, past the guard's time by then
    (the CI engine burst test's repeat: requests 6 to 8 released 4 ms after 1 and 2 were held,
    in the same step, and scheduled before them)."""
    now = [0.0]
    admission = _with_a_promotion_under_way(budget_chunks=4, now=now)
    admission.on_new_request("a")
    now[0] = 0.01
    admission.on_new_request("b")
    now[0] = 0.049
    assert admission.recompute("a") is Verdict.RETRY  # held for first's promotion
    now[0] = 0.061  # later in the same step: b's 0.05 s are over by the wall clock
    assert admission.recompute("b") is Verdict.RETRY  # but a, ahead of it, is still held
    admission.end_step(scheduled=(), preempted=())
    assert [admission.recompute("a"), admission.recompute("b")] == [Verdict.MISS] * 2


class _CountingDict(dict):  # type: ignore[type-arg]
    """A dict that counts the entries its ``get`` and ``values`` calls touch."""

    touched = 0

    def get(self, *args: Any) -> Any:
        _CountingDict.touched += 1
        return super().get(*args)

    def values(self) -> Any:
        for value in super().values():
            _CountingDict.touched += 1
            yield value


def test_admission_decides_each_lookup_of_a_burst_without_scanning_the_queue() -> None:
    """Found by review: a lookup scanned every waiting request answered MISS (how many
    prefills a recompute would queue behind) and every request's promises (whether a promotion
    is under way, for the guard), so a step over a burst of n waiting requests, every one of
    them asked about since deferring costs vLLM no token budget, did n^2 work on vLLM's
    scheduler thread (0.6 s for 1,000 requests here). A lookup now costs the same however long
    the queue is."""
    n = 400
    admission = PromotionAdmission(n, 1, prefix_tokens=1, guard_s=1.0, primary_chunks=2 * n)
    admission._waiting = _CountingDict()
    admission._attempts = _CountingDict()
    old = [f"old-{i}" for i in range(n)]
    for req_id in old:
        admission.on_new_request(req_id)
    admission.end_step([], [])
    for req_id in old:  # promised, then never allocated by vLLM (its CPU tier was full)
        assert admission.admit(req_id, f"key-{req_id}") is Verdict.HIT
    admission.end_step([], [])
    new = [f"new-{i}" for i in range(n)]
    for req_id in new:
        admission.on_new_request(req_id)
    admission.end_step([], [])
    _CountingDict.touched = 0
    for i, req_id in enumerate(new):  # one step: vLLM asks about each in queue order
        if i % 2:
            admission.recompute(req_id)
        else:
            admission.admit(req_id, f"key-{req_id}")
    assert _CountingDict.touched <= 8 * n


def test_admission_rejects_a_cpu_tier_smaller_than_its_budget() -> None:
    with pytest.raises(ValueError, match="primary_chunks"):
        PromotionAdmission(budget_chunks=8, tokens_per_chunk=16, primary_chunks=7)
