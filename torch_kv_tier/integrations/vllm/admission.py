"""Admission of remote-tier hits into vLLM's CPU primary tier: which lookup HITs may become
promotions.

vLLM's ``TieringOffloadingManager`` turns every HIT of a secondary tier into a promotion: it
allocates a primary-tier chunk at once (evicting the least recently used idle one) and reads
the chunk there at the end of the scheduler step; a request whose prefix has a promotion in
flight is deferred to a later step, when it looks its prefix up again. With more prefix chunks
wanted than the primary tier holds (a burst of long prompts, a small ``cpu_bytes_to_use``),
promoted chunks were evicted before their request ran (read for nothing, the request deferred
step after step; now held, ``promotion_pin``), and a chunk whose allocation fails still defers
its request (issue 19).

:class:`PromotionAdmission` decides each HIT. A promoted request needs three scheduler steps
before its first token (the promotion, vLLM's asynchronous load, the compute), a recomputed one
at the head of the queue one: promotion wins while those steps are short, i.e. while the
prefills around it are few, and the prefills are the requests this tier refuses (a promoted
request adds none). So a request's first promotion is admitted only when:

- **the whole queue fits**: the CPU tier could take a whole prefix
  (:attr:`PromotionAdmission.prefix_chunks`) for every request waiting to be scheduled;
- **the queue is known**: while others run or wait, not in the step the request arrived in
  (RETRY for one step), so a burst that reaches the engine together is seen whole. A request
  alone on the engine is promoted in its arrival step.

Others prefilling is no reason to refuse: a request refused for it recomputes, prefills beside
them and makes the next request's steps long in turn (README, "Under load", measures the rule
that did).

**Unless its own recompute would wait.** A request whose recompute ends behind two or more
prefills, counted from its arrival (the recomputes scheduled since, at least the last step's,
plus those waiting ahead of it; a recompute is a request this tier answered MISS, not one vLLM
serves from its own caches without asking, which computes nothing), is promoted whether or
not the queue fits or is known: its promotion takes w + 3 steps against w + 1 for w >= 2
waited, within 5/3 of its recompute. vLLM's scheduler asks about the waiting requests in queue
order until the step's token budget is spent; a request it defers (a promotion, a RETRY) spends
none of it, so one step asks about every request up to the recomputes that fill it, and from a
burst's third step on the first one it asks about has waited behind two recomputes. So each
step of a burst larger than the CPU tier recomputes and starts promoting side by side (without
the exception, a burst whose queue never fits the CPU tier recomputed whole, in a queue). It
applies only while:

- the request's whole prefix fits the budget left (part of one would cost it both the
  promotion's steps and a recompute), and
- **the stores ahead** leave room: its chunks land at the end of its step, amid the stores of
  that step's recomputes, while the last step's are still in flight (vLLM evicts none of those
  until their cascade to this tier finished); once landed they are held until their request
  runs (``promotion_pin``), so a store that finds no other room is refused and retried a step
  later. So the CPU tier (``primary_chunks``) must hold the promises held, the prefix, and a
  prefix per recompute of the last step twice over (docs/vllm-under-load.md, "Held until
  scheduled"). A request promoted because the queue fits and is known is not checked:
  unchecked, none lost a chunk in serve-bench at concurrency 4 and 16 with an 8 MiB tier, and
  checked, the tier served fewer prompt tokens (README, "Under load").

Otherwise the request recomputes at once (MISS), as without the tier (the guard below aside).
Its chunks are then promoted:

- **within a budget** of CPU-tier chunks
  (:func:`~torch_kv_tier.integrations.vllm.tier_sizing.promotion_budget`) for the chunks
  promised to requests not yet scheduled or scheduled in the last step: vLLM holds them as
  writes in flight while they are read, then as the source of its load into the KV cache in the
  step their request is scheduled in. A promise leaves the budget one step after its request is
  scheduled, when the request is preempted or finished, or when its read failed; one vLLM could
  not allocate (never submitted) leaves at the end of the step;
- **once per attempt**: a chunk already promised to the same request since it was last
  scheduled answers MISS: vLLM only asks again for a chunk its CPU tier lost (one the tier could
  not hold), and reading it again would be wasted.

**Promotions under way go first.** Steps are no clock: an idle engine runs empty steps well
under a millisecond apart, so a request a few milliseconds ahead of a burst is seen alone and
promoted, and the burst's prefills would fill its three steps. So while another request's
promotion is under way (promised, not yet scheduled, its read neither failed nor dropped), a
request that would recompute waits (RETRY) for at most ``guard_s`` after its arrival, then
recomputes. It costs nothing when no promotion is under way and bounds the wait when one is
stuck (its host froze). Its clock is read once a step, so it releases the requests it holds in
queue order. A speed rule only: no byte a load returns depends on it.

**A promotion vLLM could allocate only part of is dropped unread** (``on_submitted``): its CPU
tier, full of chunks it cannot evict, answered MISS for the rest, which ended the prefix scan;
read, the part would cost the request the promotion's steps and a recompute of the rest.
Reported failed, the request recomputes whole from the next step.

A MISS ends vLLM's prefix scan, so a refused request is served the leading chunks it has and
recomputes the rest at once; promises are made in lookup order, i.e. the leading chunks of a
prefix first. A request's promises are forgotten when it is scheduled, preempted or finished.
docs/vllm-under-load.md gives the measurements behind each rule.

Threading: none of its own; every method is called under vLLM's manager lock (see
:mod:`torch_kv_tier.integrations.vllm.remote_tier`), so no two run at once.
"""

from __future__ import annotations

import collections
import enum
import math
import time
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass, field

from torch_kv_tier.integrations.vllm import tier_sizing
from torch_kv_tier.integrations.vllm.admission_queue import Arrival, MissedQueue
from torch_kv_tier.integrations.vllm.admission_stats import AdmissionStats

# Finished requests whose prompt lengths the prefix estimate remembers.
_RECENT_REQUESTS = 64
# A request whose recompute ends behind this many prefills (counted from its arrival) is
# promoted even when the queue does not fit: w + 3 steps against w + 1, at most 5/3 of its
# recompute.
_PREFILLS_AHEAD_TO_PROMOTE = 2


@dataclass
class _Attempt:
    """One request's promises since it was last scheduled."""

    promised: set[Hashable] = field(default_factory=set)  # every key answered HIT
    held: set[Hashable] = field(default_factory=set)  # promised, read not landed: in the budget
    unsubmitted: set[Hashable] = field(default_factory=set)  # promised this step, not submitted


class Verdict(enum.Enum):
    """What a lookup of a chunk the tier holds answers."""

    HIT = "hit"  # promote it
    RETRY = "retry"  # ask again next step
    MISS = "miss"  # recompute from here


class PromotionAdmission:
    """Admission of promotions into vLLM's CPU tier; see the module docstring.

    Args:
        budget_chunks: CPU-tier chunks that promises not yet loaded by vLLM may occupy at once
            (>= 0; 0 admits nothing).
        tokens_per_chunk: tokens one chunk holds (>= 1).
        prefix_tokens: the prefix one waiting request is expected to promote; ``None``: the
            longest prompt among the last requests served (see :meth:`observe`).
        guard_s: how long a request that would recompute waits (RETRY) while another request's
            promotion is under way (>= 0; 0: never).
        clock: seconds, monotonic (``time.monotonic``; tests pass their own).
        primary_chunks: chunks of vLLM's CPU tier (>= ``budget_chunks``; ``None``: the
            budget at ``tier_sizing.PROMOTION_SHARE`` of it).
    """

    def __init__(
        self,
        budget_chunks: int,
        tokens_per_chunk: int,
        prefix_tokens: int | None = None,
        guard_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        primary_chunks: int | None = None,
    ) -> None:
        if primary_chunks is None:
            primary_chunks = math.floor(budget_chunks / tier_sizing.PROMOTION_SHARE)
        if budget_chunks < 0 or tokens_per_chunk < 1 or guard_s < 0:
            raise ValueError(
                "need budget_chunks >= 0, tokens_per_chunk >= 1 and guard_s >= 0, got "
                f"{budget_chunks}, {tokens_per_chunk}, {guard_s}"
            )
        if primary_chunks < budget_chunks:
            raise ValueError(
                f"primary_chunks ({primary_chunks}) is smaller than budget_chunks "
                f"({budget_chunks}): the budget is a share of vLLM's CPU tier"
            )
        self.budget = budget_chunks
        self.primary_chunks = primary_chunks
        self.stats = AdmissionStats()
        self._tokens_per_chunk = tokens_per_chunk
        self._prefix_tokens = prefix_tokens
        self._guard_s = guard_s
        self._clock = clock
        self._guarded: set[str] = set()  # requests the guard answered RETRY in this step
        self._guard_now: float | None = None  # the clock at the guard's first use in this step
        self._recent: collections.deque[int] = collections.deque(maxlen=_RECENT_REQUESTS)
        self._lengths: dict[str, int] = {}  # request -> furthest prompt token seen
        self._waiting: dict[str, Arrival] = {}  # requests not yet scheduled
        self._running: set[str] = set()  # scheduled, not finished (nor preempted)
        self._attempts: dict[str, _Attempt] = {}
        self._held = 0
        self._step = 0
        self._last_recomputes = 0  # recomputes scheduled in the last step
        self._recomputed = 0  # recomputes scheduled since the tier started
        self._loading = 0  # of ``_held``: promised to requests scheduled in the last step
        self._missed = MissedQueue()  # requests not yet scheduled this tier answered MISS

    @property
    def prefix_chunks(self) -> int:
        """Chunks one waiting request is expected to promote (at least 1)."""
        tokens = self._prefix_tokens or max(self._recent, default=0)
        return max(1, math.ceil(tokens / self._tokens_per_chunk))

    def observe(self, req_id: str, end_token: int | None) -> None:
        """``req_id`` has a chunk ending at prompt token ``end_token`` (vLLM's key position;
        ``None``: unknown): how long its prompt is, for :attr:`prefix_chunks`."""
        if end_token is not None and end_token > self._lengths.get(req_id, 0):
            self._lengths[req_id] = end_token

    @property
    def held(self) -> int:
        """Chunks in the budget: promised, and not yet loaded by vLLM (module docstring)."""
        return self._held

    def on_new_request(self, req_id: str) -> None:
        """``req_id`` arrived and waits to be scheduled."""
        self._waiting[req_id] = self._arrival()

    def admit(self, req_id: str, key: Hashable) -> Verdict:
        """What a lookup of ``key`` (held by the tier) for ``req_id`` answers."""
        return self._answer(req_id, self._admit(req_id, key))

    def _admit(self, req_id: str, key: Hashable) -> Verdict:
        attempt = self._attempts.get(req_id)
        if attempt is not None and key in attempt.promised:
            self.stats.refused_repeat += 1
            return Verdict.MISS
        if attempt is None:
            refusal = self._first_promotion(req_id)
            if refusal is not None:
                return refusal
        if self._held >= self.budget:
            # a first promotion may wait (the guard); in mid-prefix the scan ends here (MISS)
            return self._refuse(req_id, "budget")
        if attempt is None:
            attempt = self._attempts[req_id] = _Attempt()
        attempt.promised.add(key)
        attempt.held.add(key)
        attempt.unsubmitted.add(key)
        self._held += 1
        self.stats.admitted += 1
        return Verdict.HIT

    def _first_promotion(self, req_id: str) -> Verdict | None:
        """Why ``req_id`` may not start promoting now (``None``: it may). The refusals come
        first: a request that will recompute anyway is not held back a step."""
        if self._prefills_ahead(req_id) >= _PREFILLS_AHEAD_TO_PROMOTE:
            # Its promotion takes at most 5/3 of its recompute, counted from its arrival:
            # promoted if its whole prefix fits the budget left (part of one would cost it
            # both the promotion's steps and a recompute), else it recomputes now, or waits
            # while another request's promotion is under way, as any refused request (the
            # guard: its prefill would fill that promotion's steps). The queue behind it need
            # not fit: it recomputes meanwhile, one step sooner.
            if self._held + self.prefix_chunks > self.budget:
                return self._refuse(req_id, "budget")
            if self._held + self.prefix_chunks + self._stores_ahead() > self.primary_chunks:
                # its chunks would land amid stores the CPU tier cannot also hold, and crowd
                # them out until its request is scheduled (module docstring)
                return self._refuse(req_id, "busy")
            return None
        if len(self._waiting) * self.prefix_chunks > self.budget:
            return self._refuse(req_id, "pressure")
        others = len(self._running) + len(self._waiting) - (req_id in self._waiting)
        arrival = self._waiting.get(req_id)
        if others and arrival is not None and arrival.step >= self._step:
            self.stats.held += 1
            return Verdict.RETRY
        return None

    def _refuse(self, req_id: str, reason: str) -> Verdict:
        """A promotion refused for ``reason`` (one of ``admission_stats.REFUSAL_REASONS``): the
        request recomputes (MISS, counted), unless the guard holds it for another request's
        promotion (``_guard``'s answer, counted there as ``guarded``, not here)."""
        guard = self._guard(req_id)
        if guard is None:
            name = f"refused_{reason}"
            setattr(self.stats, name, getattr(self.stats, name) + 1)
        return guard or Verdict.MISS

    def _prefills_ahead(self, req_id: str) -> int:
        """The prefills ``req_id``'s recompute would end behind, counted from its arrival: the
        recomputes scheduled since it arrived (at least those of the last step, prefilling
        now) and those waiting that arrived before it (this tier answered them MISS; vLLM asks
        in queue order, so a request it asks about after them in the same step is behind
        them)."""
        arrival = self._waiting.get(req_id)
        since = 0 if arrival is None else self._recomputed - arrival.recomputed
        return max(since, self._last_recomputes) + self._missed.ahead_of(req_id, arrival)

    def _stores_ahead(self) -> int:
        """The chunks vLLM may store while a promotion admitted now lands and waits for its
        request's step: a prefix for each recompute of the last step (still in flight, not
        evictable until vLLM hears its cascade finished) and as many again for this step's."""
        return 2 * self._last_recomputes * self.prefix_chunks

    def _arrival(self) -> Arrival:
        return Arrival(self._step, self._clock(), self._recomputed)

    def recompute(self, req_id: str) -> Verdict:
        """What a lookup of a key the tier does not hold answers for ``req_id``: MISS (it
        recomputes from here), or RETRY while another request's promotion is under way."""
        return self._answer(req_id, self._guard(req_id) or Verdict.MISS)

    def _answer(self, req_id: str, verdict: Verdict) -> Verdict:
        if verdict is Verdict.MISS:
            self._missed.add(req_id, self._waiting.get(req_id))
        return verdict

    def _guard(self, req_id: str) -> Verdict | None:
        """``None`` unless ``req_id``, about to recompute, must wait for another request's
        promotion (module docstring): then RETRY on its first lookup in this step, MISS on the
        next ones (vLLM goes on scanning a prefix after a RETRY, and one RETRY already defers
        the request; the MISS ends the scan). Its clock is read once a step: vLLM looks the
        waiting requests up in queue order, so the ones it holds are released in that order,
        never one behind another that was still held in the same step (the CI engine burst
        test's repeat: requests 1 and 2 held, 6 to 8 released 4 ms later in the same step and
        scheduled first, 1 and 2 then first served after 0.48 and 0.62 s against 0.24 s)."""
        if req_id in self._attempts or self._held <= self._loading:  # no attempt holds a key
            return None  # its own promotion, or none under way (read failed or dropped unread)
        arrival = self._waiting.get(req_id)
        if self._guard_now is None:  # one time for the whole step (docstring)
            self._guard_now = self._clock()
        if arrival is None or self._guard_now - arrival.at_s >= self._guard_s:
            return None
        if req_id in self._guarded:
            return Verdict.MISS
        self._guarded.add(req_id)
        self.stats.guarded += 1
        return Verdict.RETRY

    def on_submitted(self, req_id: str, keys: Iterable[Hashable]) -> bool:
        """vLLM submitted a promotion of ``keys`` for ``req_id``: their allocation succeeded.
        Returns whether the promotion is to be dropped unread: vLLM could not allocate other
        chunks promised to the request in this step (its CPU tier was full of chunks it cannot
        evict: promotions not yet loaded, stores whose cascade is in flight), so its prefix
        scan ended there. vLLM submits one job per request at the end of the step, after every
        lookup, so the promises it left out are known here. Read, the part would cost the
        request the promotion's steps and then a recompute of the rest (the case a first
        promotion is refused for when its prefix does not fit the budget); dropped (reported
        failed: a MISS for the rest of the request), it recomputes whole from the next step."""
        attempt = self._attempts.get(req_id)
        if attempt is None:
            return False
        attempt.unsubmitted.difference_update(keys)
        if not attempt.unsubmitted:
            return False
        self.stats.dropped_partial += 1
        return True

    def on_read_failed(self, req_id: str, keys: Iterable[Hashable]) -> None:
        """The promotion of ``keys`` for ``req_id`` failed (the request recomputes them): they
        leave the budget. Chunks that landed stay in it until vLLM has loaded them."""
        attempt = self._attempts.get(req_id)
        if attempt is None:
            return
        for key in keys:
            if key in attempt.held:
                attempt.held.discard(key)
                self._held -= 1

    def end_step(self, scheduled: Collection[str], preempted: Collection[str]) -> None:
        """The scheduler step ended (after vLLM submitted its promotions): forget the
        requests it ``scheduled`` (their promises stay in the budget one step more, while vLLM
        loads them; ``preempted`` ones wait again, with a fresh attempt), and release the
        promises vLLM could not allocate."""
        recomputes = 0
        self._held -= self._loading
        self._loading = 0
        for req_id in scheduled:
            recomputes += req_id in self._missed and req_id not in self._attempts
            self._missed.discard(req_id)
            attempt = self._attempts.pop(req_id, None)
            if attempt is not None:  # vLLM loads its chunks into the KV cache in this step
                self._loading += len(attempt.held)
            self._waiting.pop(req_id, None)
            self._running.add(req_id)
        for req_id in preempted:
            self._forget_attempt(req_id)
            self._missed.discard(req_id)
            self._running.discard(req_id)
            self._waiting[req_id] = self._arrival()
        for attempt in self._attempts.values():
            if attempt.unsubmitted:
                self.stats.unallocated += len(attempt.unsubmitted)
                self._held -= len(attempt.unsubmitted & attempt.held)
                attempt.held.difference_update(attempt.unsubmitted)
                attempt.unsubmitted.clear()
        self._step += 1
        self._guarded.clear()
        self._guard_now = None
        self._last_recomputes = recomputes
        self._recomputed += recomputes

    def finish(self, req_id: str) -> None:
        """``req_id`` finished (or was aborted): remember its length, forget the rest."""
        self._forget_attempt(req_id)
        self._missed.discard(req_id)
        self._waiting.pop(req_id, None)
        self._running.discard(req_id)
        length = self._lengths.pop(req_id, None)
        if length is not None:
            self._recent.append(length)

    def _forget_attempt(self, req_id: str) -> None:
        attempt = self._attempts.pop(req_id, None)
        if attempt is not None:
            self._held -= len(attempt.held)


__all__ = ["PromotionAdmission", "Verdict"]
