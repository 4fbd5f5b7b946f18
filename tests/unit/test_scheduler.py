"""The scheduler alone (kvrag.engine.scheduler): no threads, no model, no clock -- every policy as a function of
events, including property tests over random arrival / cancel / drop / stream / finish sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrag.engine.lease import KVBudget
from kvrag.engine.scheduler import HOLDING, RequestState, Scheduler, SchedulerError

S = RequestState


def _sched(limit: int = 100, batch: int = 2) -> Scheduler:
    return Scheduler(KVBudget(limit, 1), batch, pack_suffixes=True)


def _prepare_all(s: Scheduler) -> list[int]:
    """Plans until nothing more is admitted; each admitted request is prepared and streamed."""
    got = []
    while (plan := s.schedule()).prepare is not None:
        s.prepared(plan.prepare, True)
        s.stream(plan.prepare)
        got.append(plan.prepare)
    return got


def test_one_prepare_per_plan_and_every_running_request_in_every_step() -> None:
    s = _sched(batch=3)
    ids = [s.add(10) for _ in range(4)]
    plans = []
    for _ in range(4):
        plan = s.schedule()
        plans.append(plan)
        assert plan.prepare == ids[len(plans) - 1]
        s.prepared(plan.prepare, True)
        s.stream(plan.prepare)
    # a request joins at the plan after its stream started; at most batch-size rows; each once
    assert [p.decode for p in plans] == [[], ids[:1], ids[:2], ids[:3]]
    assert s.schedule().decode == ids[:3]  # the fourth waits for a place
    s.stepped([ids[0]])
    assert s.schedule().decode == [ids[1], ids[2], ids[3]]


def test_admission_in_arrival_order_and_a_large_request_is_not_passed() -> None:
    s = _sched(limit=100)
    a = s.add(60)
    assert s.schedule().prepare == a
    s.prepared(a, True)
    big = s.add(500)  # larger than the whole bound
    small = s.add(10)  # would fit now, but arrived later: it does not pass the big one
    plan = s.schedule()
    assert plan.prepare is None and s.ahead(small) == 1
    s.release(a)  # the only holder lets go: the big one runs alone
    plan = s.schedule()
    assert plan.finish == [(a, "dropped")] and plan.prepare == big
    assert s.budget.used == 500
    assert s.schedule().prepare == big  # its next piece: nobody else is admitted meanwhile
    s.cancel(big)
    assert s.prepared(big, True) is S.FINISHED  # cancelled while PREPARING: it leaves after its prepare
    plan = s.schedule()
    assert plan.finish == [(big, "cancelled")] and plan.prepare == small


def test_a_prepare_in_pieces_keeps_its_turn_and_a_cancel_stops_it_at_a_piece_boundary() -> None:
    s = _sched(batch=2)
    a, b = s.add(10), s.add(10)
    assert s.schedule().prepare == a
    assert s.schedule().prepare == a  # its next piece: b is not admitted meanwhile
    assert s.state(b) is S.WAITING
    s.cancel(a)
    plan = s.schedule()  # a stops here, b's turn begins
    assert plan.finish == [(a, "cancelled")] and plan.prepare == b and s.budget.used == 10


def test_cancellation_by_state() -> None:
    s = _sched(limit=100, batch=4)
    ids = [s.add(10) for _ in range(4)]
    _prepare_all(s)
    s.schedule()  # all RUNNING
    waiting = s.add(10)
    assert s.cancel(waiting) is S.WAITING  # leaves at once, holding nothing
    assert s.cancel(ids[0]) is S.RUNNING  # stays until the step in flight is done...
    assert s.state(ids[0]) is S.RUNNING and s.budget.used == 40
    plan = s.schedule()  # ...and is not in the next one
    assert ids[0] not in plan.decode and (ids[0], "cancelled") in plan.finish and (waiting, "cancelled") in plan.finish
    assert s.budget.used == 30 and s.budget.snapshot()["leases"] == 3
    assert s.cancel(ids[0]) is S.FINISHED  # idempotent


def test_a_request_is_streamed_once_and_a_closed_scheduler_takes_nothing() -> None:
    s = _sched()
    rid = s.add(10)
    with pytest.raises(SchedulerError, match="waiting: cannot start streaming"):
        s.stream(rid)
    s.prepared(s.schedule().prepare, True)  # type: ignore[arg-type]
    s.stream(rid)
    with pytest.raises(SchedulerError, match="queued: cannot start streaming"):
        s.stream(rid)
    s.close(cancel=True)
    assert s.schedule().finish == [(rid, "closed")] and s.budget.used == 0
    with pytest.raises(SchedulerError):
        s.add(1)


def test_a_failed_prepare_gives_its_lease_back() -> None:
    s = _sched()
    rid = s.add(10)
    s.schedule()
    assert s.prepared(rid, False) is S.FINISHED
    assert s.budget.used == 0 and s.schedule().finish == [(rid, "failed")]
    assert s.idle()


def test_parked_suffixes_wait_for_the_next_arrivals_and_go_together() -> None:
    s = _sched(limit=100, batch=3)
    a, b, c = s.add(10), s.add(10), s.add(90)
    assert s.schedule().prepare == a
    s.park(a)  # the runner asks right after the piece: b is admitted next, so a waits for it
    assert s.flush() == [] and s.state(a) is S.PREPARING
    plan = s.schedule()
    assert plan.prepare == b and plan.suffixes == []
    s.park(b)
    assert s.flush() == [a, b]  # c does not fit the bound: nobody joins them, the two go now
    s.prepared(a, True)
    s.prepared(b, True)
    assert s.schedule().prepare is None and s.state(c) is S.WAITING


def test_without_packing_a_parked_request_goes_alone() -> None:
    s = Scheduler(KVBudget(100, 1), 4)  # the default
    a, b = s.add(10), s.add(10)
    assert s.schedule().prepare == a
    s.park(a)
    assert s.flush() == [a]  # b would be admitted next: with packing a would wait for it
    s.prepared(a, True)
    assert s.schedule().prepare == b


def test_flush_at_max_batch_size_parked_and_while_a_long_prepare_runs() -> None:
    s = _sched(limit=1000, batch=2)
    ids = [s.add(10) for _ in range(4)]
    for rid in ids[:2]:
        assert s.schedule().prepare == rid
        s.park(rid)
    assert s.flush() == ids[:2]  # two parked: as many as one step takes, even with more in line
    for rid in ids[:2]:
        s.prepared(rid, True)
    assert s.schedule().prepare == ids[2]
    s.park(ids[2])
    assert s.schedule().prepare == ids[3]  # a long prepare (it does not park): the parked one goes with its piece
    assert s.flush() == [ids[2]]


def test_while_requests_decode_a_parked_request_does_not_wait_for_later_arrivals() -> None:
    s = _sched(limit=100, batch=4)
    a = s.add(10)
    s.prepared(s.schedule().prepare, True)  # type: ignore[arg-type]
    s.stream(a)
    b, c = s.add(10), s.add(10)
    plan = s.schedule()
    assert plan.decode == [a] and plan.prepare == b
    s.park(b)
    assert s.flush() == [b]  # c could be admitted next, but a decodes: b's suffix runs before a's step
    s.prepared(b, True)
    assert s.schedule().prepare == c


def test_a_parked_request_cancelled_leaves_at_the_next_plan() -> None:
    s = _sched(limit=100)
    a, b = s.add(10), s.add(10)
    s.schedule()
    s.park(a)
    assert s.cancel(a) is S.PREPARING and s.budget.used == 10
    plan = s.schedule()
    assert plan.finish == [(a, "cancelled")] and plan.prepare == b and a not in s.parked and s.budget.used == 10
    with pytest.raises(SchedulerError, match="finished: cannot park"):
        s.park(a)


# ---- properties ----------------------------------------------------------------------------------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.integers(1, 160)),
    st.tuples(st.just("cancel"), st.integers(0, 40)),
    st.tuples(st.just("drop"), st.integers(0, 40)),
    st.tuples(st.just("stream"), st.integers(0, 40)),
    st.tuples(st.just("plan"), st.integers(0, 2**16)),
), max_size=120)


def _check(s: Scheduler, seen_finished: set[int]) -> None:
    holding = [r for r in s.requests.values() if r.state in HOLDING]
    assert s.budget.used == sum(r.kv_bytes for r in holding)  # reservations == the live requests'
    assert len(s.budget.leases) == len(holding)
    assert s.budget.used <= s.budget.limit or len(holding) == 1  # over the bound only alone
    assert s.budget.waiting == len(s.waiting) == sum(r.state is S.WAITING for r in s.requests.values())
    assert len(s.running) <= s.max_batch_size
    assert not seen_finished & set(s.requests)


def _plan(s: Scheduler, seed: int, admitted: list[int], seen_finished: set[int]) -> None:
    plan = s.schedule()
    assert len(set(plan.decode)) == len(plan.decode)  # no request stepped twice in a step
    assert all(s.state(r) is S.RUNNING for r in plan.decode)
    assert not seen_finished & ({r for r, _ in plan.finish} | set(plan.decode))  # a finished request never returns
    seen_finished.update(r for r, _ in plan.finish)
    suffixes = plan.suffixes
    if plan.prepare is not None:
        assert not suffixes and plan.prepare not in s.parked
        assert all(w > plan.prepare for w in s.waiting)  # arrival order: nobody earlier is still in line
        if not admitted or plan.prepare != admitted[-1]:  # a new admission (else: the next piece of the same one)
            assert not admitted or plan.prepare > admitted[-1]
            admitted.append(plan.prepare)
        if seed % 5 == 2:  # parks at its suffix prefill
            s.park(plan.prepare)
        elif seed % 5 != 1:  # else the prepare has more pieces
            s.prepared(plan.prepare, ok=seed % 7 != 0)
        suffixes = s.flush()  # what the runner asks after the piece
    assert len(suffixes) <= s.max_batch_size and not set(suffixes) & set(s.parked)
    for rid in suffixes:  # the packed suffix forward ran: each prepare ends
        assert s.state(rid) is S.PREPARING
        s.prepared(rid, ok=seed % 11 != 0)
    s.stepped([r for i, r in enumerate(plan.decode) if (seed >> i) & 1])
    _check(s, seen_finished)
    assert s.preparing is None or s.state(s.preparing) is S.PREPARING
    assert all(s.state(r) is S.PREPARING for r in s.parked) and s.preparing not in s.parked


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS, st.integers(1, 4), st.integers(50, 400), st.booleans())
def test_random_sequences_keep_every_invariant_and_nobody_starves(ops: list[tuple[str, int]], batch: int,
                                                                  limit: int, pack: bool) -> None:
    s = Scheduler(KVBudget(limit, 1), batch, pack_suffixes=pack)
    rids: list[int] = []
    admitted: list[int] = []
    seen_finished: set[int] = set()
    for op, arg in ops:
        if op == "arrive":
            rids.append(s.add(arg))
        elif op == "plan":
            _plan(s, arg, admitted, seen_finished)
        elif rids:
            rid = rids[arg % len(rids)]
            if op == "cancel":
                s.cancel(rid)
            elif op == "drop" and s.state(rid) is S.READY:
                s.release(rid)
            elif op == "stream" and s.state(rid) is S.READY:
                s.stream(rid)
        _check(s, seen_finished)
    # no starvation: once arrivals stop and callers stream what is ready, every request finishes, each within a
    # bounded number of plans (its place in line, then its answer)
    for _ in range(4 * len(rids) + 4):
        for r in [r for r in s.requests.values() if r.state is S.READY]:
            s.stream(r.rid)
        _plan(s, 0b11, admitted, seen_finished)  # one row finishes per step; prepares end
        if s.idle() and not s.requests:
            break
    assert not s.requests and s.idle()
    assert s.budget.used == 0 and not s.budget.leases
    assert seen_finished == set(rids)
