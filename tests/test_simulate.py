"""Simulator: closed forms from the schedule papers, comm and tail on hand-computed cases."""

from __future__ import annotations

import pytest

from autoplan.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    make_schedule,
    simulate,
)

F, B, W = ActionKind.F, ActionKind.B, ActionKind.W
PM = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


def f1_b2(action: Action) -> float:
    return 1.0 if action.kind is F else 2.0


@pytest.mark.parametrize(("p", "m"), PM)
def test_one_f_one_b_closed_form(p: int, m: int) -> None:
    # Narayanan et al. SC'21 Sec 2.2.1: bubble = (p-1)/(m+p-1) of the step; peak in-flight
    # activations on stage s = min(p - s, m).
    result = simulate(make_schedule("1f1b", p, m), f1_b2)
    assert result.makespan_s == pytest.approx((m + p - 1) * 3.0)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.peak_inflight == tuple(min(p - s, m) for s in range(p))
    assert result.busy_s == pytest.approx([3.0 * m] * p)
    assert result.idle_s == pytest.approx([3.0 * (p - 1)] * p)


@pytest.mark.parametrize(("p", "m"), PM)
def test_gpipe_closed_form(p: int, m: int) -> None:
    # Huang et al. 2019 Sec 2.3: the same (p-1)/(m+p-1) bubble as 1F1B, but all m in flight.
    result = simulate(make_schedule("gpipe", p, m), f1_b2)
    assert result.makespan_s == pytest.approx((m + p - 1) * 3.0)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.peak_inflight == (m,) * p


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize(("p", "m"), [(p, m) for p in (1, 2, 4, 8) for m in (p, 2 * p, 4 * p)])
def test_interleaved_bubble_is_one_over_v_of_1f1b(p: int, m: int, v: int) -> None:
    # Narayanan et al. SC'21 Sec 2.2.2: with v chunks per rank (each 1/v of the stage's work) the
    # bubble time shrinks from (p-1)(t_f+t_b) to (1/v)(p-1)(t_f+t_b), i.e. (1/v)(p-1)/m of the
    # ideal time m(t_f+t_b).
    one_f_one_b = simulate(make_schedule("1f1b", p, m), f1_b2)
    interleaved = simulate(make_schedule("interleaved-1f1b", p, m, v), lambda a: f1_b2(a) / v)
    ideal_s = 3.0 * m
    assert interleaved.busy_s == pytest.approx([ideal_s] * p)
    for idle_1f1b, idle_interleaved in zip(one_f_one_b.idle_s, interleaved.idle_s):
        assert idle_interleaved == pytest.approx(idle_1f1b / v)
    assert (interleaved.makespan_s - ideal_s) / ideal_s == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, p, 2 * p, 16)])
def test_zb_h1_bubble_matches_paper(p: int, m: int) -> None:
    # Qi et al. 2024 Table 2: bubble (p-1)(T_F + T_B - T_W) for ZB-H1 versus
    # (p-1)(T_F + T_B + T_W) for 1F1B, where their T_B is the input-gradient half only. With
    # T_F = T_B = T_W = 1 that is a third of 1F1B's, for the same total work (1F1B: F=1, B=2).
    zb = simulate(make_schedule("zb-h1", p, m), lambda a: 1.0)
    one_f_one_b = simulate(make_schedule("1f1b", p, m), f1_b2)
    assert zb.busy_s == pytest.approx(one_f_one_b.busy_s)
    assert one_f_one_b.makespan_s - 3.0 * m == pytest.approx((p - 1) * (1 + 1 + 1))
    if m >= p:  # the paper's steady-state analysis; with m < p the W passes cannot fill the tail
        assert zb.makespan_s - 3.0 * m == pytest.approx((p - 1) * (1 + 1 - 1))
    if p > 1:
        assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    # Sec 2.1: every worker keeps the same number of micro-batches in flight, as stage 0 of 1F1B
    # (activations are held until W).
    assert zb.peak_inflight == (min(p, m),) * p


def test_zb_h1_bubble_with_unequal_passes() -> None:
    # Table 2 again with T_F=2, T_B=1.5, T_W=1: bubble (p-1)(2 + 1.5 - 1).
    p, m = 4, 12
    times = {F: 2.0, B: 1.5, W: 1.0}
    zb = simulate(make_schedule("zb-h1", p, m), lambda a: times[a.kind])
    assert zb.makespan_s - m * 4.5 == pytest.approx((p - 1) * 2.5)


def test_comm_and_tail_hand_computed() -> None:
    # 2 ranks, 1 micro-batch, F=1, B=2, 0.5 s per transfer:
    #   rank 0: 0F0 [0, 1]                      rank 1: 1F0 [1.5, 2.5], 1B0 [2.5, 4.5]
    #   rank 0: 0B0 [5.0, 7.0]  (gradient arrives at 4.5 + 0.5)
    calls = []

    def comm(src: int, dst: int, kind: ActionKind) -> float:
        calls.append((src, dst, kind))
        return 0.5

    schedule = make_schedule("1f1b", 2, 1)
    result = simulate(schedule, f1_b2, comm)
    assert sorted(calls, key=str) == sorted([(0, 1, F), (1, 0, B)], key=str)
    assert result.makespan_s == pytest.approx(7.0)
    assert [(str(t.action), t.rank, t.start_s, t.end_s) for t in result.timeline] == [
        ("0F0", 0, 0.0, 1.0),
        ("0B0", 0, 5.0, 7.0),
        ("1F0", 1, 1.5, 2.5),
        ("1B0", 1, 2.5, 4.5),
    ]
    assert result.compute_end_s == pytest.approx((7.0, 4.5))
    # bubble over the compute span [0, 7]: rank 0 busy 3, rank 1 busy 3.
    assert result.bubble_fraction == pytest.approx(1 - 6.0 / 14.0)

    with_tail = simulate(schedule, f1_b2, comm, rank_tail_s=[0.25, 3.0])
    assert with_tail.rank_end_s() == pytest.approx((7.25, 7.5))
    assert with_tail.makespan_s == pytest.approx(7.5)
    assert with_tail.idle_s == pytest.approx((4.5, 4.5))
    assert with_tail.bubble_fraction == pytest.approx(result.bubble_fraction)  # tails excluded

    free = simulate(schedule, f1_b2)
    assert free.makespan_s == pytest.approx(6.0)
    assert free.rank_end_s() == pytest.approx((6.0, 4.0))


def test_comm_not_asked_within_a_rank() -> None:
    def comm(src: int, dst: int, kind: ActionKind) -> float:
        raise AssertionError("single rank: no P2P")

    result = simulate(make_schedule("interleaved-1f1b", 1, 4, 3), lambda a: 1.0, comm)
    assert result.makespan_s == pytest.approx(4 * 3 * 2)
    assert result.bubble_fraction == pytest.approx(0.0)


def test_unequal_stages_follow_the_slowest() -> None:
    # 1F1B steady state is paced by the slowest stage: makespan ~ m * (F + B) of that stage.
    p, m = 4, 32

    def times(a: Action) -> float:
        scale = 2.0 if a.stage == 2 else 1.0
        return scale * (1.0 if a.kind is F else 2.0)

    result = simulate(make_schedule("1f1b", p, m), times)
    assert result.busy_s[2] == pytest.approx(6.0 * m)
    assert result.makespan_s >= 6.0 * m
    assert result.makespan_s == pytest.approx(6.0 * m + 3.0 * 3 + 3.0, abs=6.0)


def test_rank_tail_length_checked() -> None:
    with pytest.raises(ValueError, match="rank_tail_s has 1 entries for num_ranks=2"):
        simulate(make_schedule("1f1b", 2, 2), f1_b2, rank_tail_s=[1.0])


def test_simulate_detects_deadlock() -> None:
    good = make_schedule("1f1b", 2, 2)
    broken = Schedule(
        good.name, 2, 2, 2, (tuple(Action.parse(t) for t in ["0F0", "0B1", "0F1", "0B0"]), good.actions[1])
    )
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(broken, f1_b2)
    assert ">0B1<" in str(err.value)


def test_large_simulation_runs() -> None:
    # Speed is reported by benchmarks, not asserted; this only checks the 64 x 256 case works.
    result = simulate(make_schedule("1f1b", 64, 256), f1_b2)
    assert result.bubble_fraction == pytest.approx(63 / (256 + 63))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"])
def test_duration_table_matches_callback(name: str) -> None:
    """The per-stage table path replays the same walk with the same arithmetic: identical numbers."""
    import random

    rng = random.Random(7)
    for p in (1, 2, 3, 4):
        for m in (1, 2, 4, 8):
            for v in ((2, 3) if name == "interleaved-1f1b" else (1,)):
                if name == "interleaved-1f1b" and m % p:
                    continue
                schedule = make_schedule(name, p, m, v)
                table = {k: [rng.uniform(0.1, 2.0) for _ in range(schedule.num_stages)] for k in (F, B, W)}
                delays: dict[tuple[int, int], float] = {}

                def comm(src: int, dst: int, kind: ActionKind, delays=delays) -> float:
                    return delays.setdefault((src, dst), rng.uniform(0.0, 0.3))

                tails = [rng.uniform(0.0, 1.0) for _ in range(p)]
                called = simulate(schedule, lambda a, table=table: table[a.kind][a.stage], comm, tails)
                tabled = simulate(schedule, table, comm, tails)
                for field in ("makespan_s", "busy_s", "idle_s", "bubble_fraction", "peak_inflight", "compute_end_s",
                              "tail_s"):
                    assert getattr(tabled, field) == getattr(called, field), (name, p, m, v, field)
                assert tabled.timeline == called.timeline


def test_deadlock_found_before_any_duration_is_asked() -> None:
    good = make_schedule("1f1b", 2, 2)
    broken = Schedule(
        good.name, 2, 2, 2, (tuple(Action.parse(t) for t in ["0F0", "0B1", "0F1", "0B0"]), good.actions[1])
    )
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(broken, {F: [1.0, 1.0], B: [2.0, 2.0]})


def test_unsimulable_action_named() -> None:
    good = make_schedule("1f1b", 2, 2)
    bad = Schedule(good.name, 2, 2, 2, (good.actions[0], (*good.actions[1][:-1], Action(B, 5, 0))))
    with pytest.raises(ScheduleError, match="cannot simulate 5B0"):
        simulate(bad, f1_b2)
