"""Schedule IR: generators pass the validator over a grid, actions round-trip, lowering is sound."""

from __future__ import annotations

from collections import defaultdict

import pytest

from autoplan.schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    make_schedule,
    validate,
)
from autoplan.schedule.actions import compute_deps

F, B, W = ActionKind.F, ActionKind.B, ActionKind.W


def _grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for name in SCHEDULES:
        for p in (1, 2, 3, 4, 8):
            for m in range(1, 17):
                if name == "interleaved-1f1b":
                    if m % p == 0:
                        cases += [(name, p, m, v) for v in (2, 3, 4)]
                else:
                    cases.append((name, p, m, 1))
    return cases


GRID = _grid()


def _id(case: tuple[str, int, int, int]) -> str:
    return "{}-p{}-m{}-v{}".format(*case)


# --------------------------------------------------------------------------------- actions


@pytest.mark.parametrize("text", ["2F5", "0B3", "1W0", "3SEND_F2", "0RECV_F0", "12SEND_B7", "4RECV_B10"])
def test_action_str_parse_round_trip(text: str) -> None:
    action = Action.parse(text)
    assert str(action) == text
    assert Action.parse(str(action)) == action


def test_action_fields() -> None:
    assert Action.parse("3SEND_F2") == Action(ActionKind.SEND_F, 3, 2)
    assert str(Action(ActionKind.W, 1, 0)) == "1W0"


@pytest.mark.parametrize(
    "junk", ["", "F", "2F", "F5", "2X5", "2f5", "-1F2", "2F5x", "2 F 5", "2SEND5", "1.5F2"]
)
def test_action_parse_rejects_junk(junk: str) -> None:
    with pytest.raises(ValueError, match="cannot parse action") as err:
        Action.parse(junk)
    assert repr(junk) in str(err.value)


# --------------------------------------------------------------------------------- generators


@pytest.mark.parametrize("case", GRID, ids=_id)
def test_generators_validate(case: tuple[str, int, int, int]) -> None:
    name, p, m, v = case
    schedule = make_schedule(name, p, m, v)
    assert schedule.num_ranks == p and schedule.num_stages == p * v and schedule.virtual_stages == v
    assert schedule.split_backward() == (name == "zb-h1")
    validate(schedule)


def test_placement_is_looped() -> None:
    schedule = make_schedule("interleaved-1f1b", 4, 8, 3)
    assert [schedule.rank_of_stage(s) for s in range(12)] == [0, 1, 2, 3] * 3
    assert schedule.stages_of_rank(1) == [1, 5, 9]


def test_one_f_one_b_order() -> None:
    # Narayanan et al. 2021 (PipeDream-Flush): stage s warms up with p - s - 1 forwards.
    schedule = make_schedule("1f1b", 4, 6)
    assert " ".join(map(str, schedule.actions[1])) == "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5"
    # fewer micro-batches than ranks: warmup = min(p - s - 1, m)
    small = make_schedule("1f1b", 4, 2)
    assert " ".join(map(str, small.actions[0])) == "0F0 0F1 0B0 0B1"


def test_zb_h1_order_matches_paper_figure() -> None:
    # Qi et al. 2024 Fig. 3 (top): W of micro-batch i follows B of micro-batch i + s on stage s.
    schedule = make_schedule("zb-h1", 4, 8)
    assert " ".join(map(str, schedule.actions[0][:9])) == "0F0 0F1 0F2 0F3 0B0 0W0 0F4 0B1 0W1"
    assert " ".join(map(str, schedule.actions[3][:9])) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0"


def test_interleaved_order_matches_megatron() -> None:
    # Megatron-LM interleaving: groups of p micro-batches walk the chunks; warmup
    # (p - r - 1) * 2 + (v - 1) * p forwards on rank r.
    schedule = make_schedule("interleaved-1f1b", 2, 4, 2)
    assert " ".join(map(str, schedule.actions[0][:5])) == "0F0 0F1 2F0 2F1 0F2"
    assert " ".join(map(str, schedule.actions[1][:4])) == "1F0 1F1 3F0 3B0"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("pipedream", 2, 4), "unknown schedule 'pipedream'.*gpipe.*1f1b.*interleaved-1f1b.*zb-h1"),
        (("1f1b", 4, 0), "num_microbatches must be >= 1, got 0"),
        (("1f1b", 0, 4), "num_ranks must be >= 1, got 0"),
        (("1f1b", 4, 8, 2), "only virtual_stages=1, got 2"),
        (("gpipe", 4, 8, 0), "virtual_stages must be >= 1, got 0"),
        (("zb-h1", 4, 8, 3), "only virtual_stages=1, got 3"),
        (("interleaved-1f1b", 4, 8, 1), "virtual_stages >= 2, got 1"),
        (("interleaved-1f1b", 4, 6, 2), "num_microbatches=6, num_ranks=4"),
    ],
)
def test_make_schedule_rejects_bad_args(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_schedule(*args)


def test_schedule_rejects_bad_shape() -> None:
    with pytest.raises(ValueError, match="num_stages=5 is not a multiple of num_ranks=2"):
        Schedule("x", 2, 5, 1, ((), ()))
    with pytest.raises(ValueError, match="1 action lists for num_ranks=2"):
        Schedule("x", 2, 2, 1, ((),))


def test_format_grid() -> None:
    schedule = make_schedule("1f1b", 2, 2)
    grid = schedule.format_grid()
    lines = grid.splitlines()
    assert lines[1].split() == ["step", "rank0", "rank1"]
    assert lines[2].split() == ["0", "0F0", "1F0"]
    assert schedule.to_str() == grid
    marked = schedule.format_grid({1: 2})
    assert ">1F1<" in marked and marked.count("<-- here") == 1
    assert "0SEND_F0" in schedule.format_grid(lowered=True)


# --------------------------------------------------------------------------------- validate


def _with_rank(schedule: Schedule, rank: int, text: str) -> Schedule:
    actions = list(schedule.actions)
    actions[rank] = tuple(Action.parse(t) for t in text.split())
    return Schedule(
        schedule.name, schedule.num_ranks, schedule.num_stages, schedule.num_microbatches, tuple(actions)
    )


def test_validate_catches_deadlock_and_shows_grid() -> None:
    good = make_schedule("1f1b", 2, 2)  # rank 0: 0F0 0F1 0B0 0B1
    # 0B1 needs 1B1 <- 1F1 <- 0F1, which rank 0 now runs only after 0B1.
    broken = _with_rank(good, 0, "0F0 0B1 0F1 0B0")
    with pytest.raises(ScheduleError) as err:
        validate(broken)
    message = str(err.value)
    assert "deadlock" in message
    assert "rank0" in message and "rank1" in message  # the grid
    assert ">0B1<" in message and "<-- here" in message


@pytest.mark.parametrize(
    ("rank", "text", "match"),
    [
        (0, "0F0 0F1 0B0", "missing 0B1"),
        (0, "0F0 0F1 0B0 0B1 0B1", "appears twice"),
        (0, "0F0 0F1 0B0 0B1 1F0", "belongs on rank 1"),
        (0, "0F0 0F1 0B0 0B1 0SEND_F0", "not a compute action"),
        (0, "0F0 0F1 0F2 0B0 0B1", "out of range"),
    ],
)
def test_validate_catches_structural_errors(rank: int, text: str, match: str) -> None:
    broken = _with_rank(make_schedule("1f1b", 2, 2), rank, text)
    with pytest.raises(ScheduleError, match=match) as err:
        validate(broken)
    assert "rank0" in str(err.value)


def test_validate_w_before_b() -> None:
    good = make_schedule("zb-h1", 2, 2)
    assert " ".join(map(str, good.actions[1])) == "1F0 1B0 1F1 1B1 1W0 1W1"
    with pytest.raises(ScheduleError, match="1W0 runs before 1B0"):
        validate(_with_rank(good, 1, "1F0 1W0 1B0 1F1 1B1 1W1"))
    with pytest.raises(ScheduleError, match="missing 1W1"):
        validate(_with_rank(good, 1, "1F0 1B0 1F1 1B1 1W0"))


# --------------------------------------------------------------------------------- with_comms

_PEER_RECV = {ActionKind.SEND_F: (ActionKind.RECV_F, +1), ActionKind.SEND_B: (ActionKind.RECV_B, -1)}


def _run_blocking_p2p(schedule: Schedule) -> None:
    """Walk the lowered lists as an executor would: sends buffered, receives block.

    Also checks that every compute action has its inputs: local dependencies finished, and the
    receive done on this rank for a dependency on another rank.
    """
    lowered = schedule.with_comms()
    rank_of = schedule.rank_of_stage
    mailbox: set[Action] = set()  # receives whose matching send has been posted
    done: set[Action] = set()
    received: set[Action] = set()
    ptr = [0] * schedule.num_ranks
    while True:
        progressed = False
        for rank, actions in enumerate(lowered):
            while ptr[rank] < len(actions):
                a = actions[ptr[rank]]
                if a.kind in _PEER_RECV:
                    kind, step = _PEER_RECV[a.kind]
                    assert Action(F if a.kind is ActionKind.SEND_F else B, a.stage, a.microbatch) in done
                    mailbox.add(Action(kind, a.stage + step, a.microbatch))
                elif a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                    if a not in mailbox:
                        break
                    mailbox.remove(a)
                    received.add(a)
                else:
                    for dep in compute_deps(a, schedule.num_stages):
                        assert dep in done, f"{a} ran before {dep}"
                        if rank_of(dep.stage) != rank:
                            recv_kind = ActionKind.RECV_F if dep.kind is F else ActionKind.RECV_B
                            assert Action(recv_kind, a.stage, a.microbatch) in received
                    done.add(a)
                ptr[rank] += 1
                progressed = True
        if all(ptr[r] == len(lowered[r]) for r in range(schedule.num_ranks)):
            break
        assert progressed, f"blocking P2P deadlock at {ptr}\n{schedule.format_grid(lowered=True)}"
    assert not mailbox, f"sends never received: {sorted(map(str, mailbox))}"


@pytest.mark.parametrize("case", GRID, ids=_id)
def test_with_comms_runs_under_blocking_p2p(case: tuple[str, int, int, int]) -> None:
    name, p, m, v = case
    schedule = make_schedule(name, p, m, v)
    lowered = schedule.with_comms()
    assert [[a for a in r if a.kind in (F, B, W)] for r in lowered] == [list(r) for r in schedule.actions]
    # Every SEND has exactly one matching RECV on the peer rank, and vice versa.
    sends, recvs = set(), set()
    for rank, actions in enumerate(lowered):
        for a in actions:
            if a.kind in _PEER_RECV:
                kind, step = _PEER_RECV[a.kind]
                peer = Action(kind, a.stage + step, a.microbatch)
                assert schedule.rank_of_stage(peer.stage) != rank
                sends.add(peer)
            elif a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                assert a not in recvs
                recvs.add(a)
    assert sends == recvs
    if p == 1:
        assert not sends
    _run_blocking_p2p(schedule)


@pytest.mark.parametrize("case", GRID, ids=_id)
def test_with_comms_pairwise_fifo(case: tuple[str, int, int, int]) -> None:
    """Per (src, dst) rank pair, sends are posted in the order the peer posts the receives.

    Backends that match P2P messages by order rather than by tag (NCCL) need this.
    """
    schedule = make_schedule(*case)
    sent: dict[tuple[int, int], list[Action]] = defaultdict(list)
    got: dict[tuple[int, int], list[Action]] = defaultdict(list)
    rank_of = schedule.rank_of_stage
    for rank, actions in enumerate(schedule.with_comms()):
        for a in actions:
            if a.kind in _PEER_RECV:
                kind, step = _PEER_RECV[a.kind]
                peer = Action(kind, a.stage + step, a.microbatch)
                sent[rank, rank_of(peer.stage)].append(peer)
            elif a.kind is ActionKind.RECV_F:
                got[rank_of(a.stage - 1), rank].append(a)
            elif a.kind is ActionKind.RECV_B:
                got[rank_of(a.stage + 1), rank].append(a)
    assert sent == got
