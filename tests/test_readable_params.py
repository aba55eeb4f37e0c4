"""Parameters a user can read (issue 41 item 7): in a bf16 ZeRO-1 plan with tp 2 x dp 2, every
rank's `pm.named_parameters()` after `make_optimizer` gives values, never the NaN placeholders of the
fp32 masters other dp ranks own (runtime/parallel/precision.py `release_masters`): those come as their bf16
working copies, so `torch.save(dict(pm.named_parameters()))` writes real weights. A write made
outside the ZeRO-1 optimizer's step (a plain `torch.optim.SGD(pm.parameters())`, an in-place
write) is refused in one line naming ZeRO-1 and what to call instead (the optimizer at its step, the
write at the next `pm.step`)
(precision.py [Note: writes under ZeRO-1]); `pm.load_state_dict` is the way, and works. Through
`autoplan.suggest` and `autoplan.partition` on 4 gloo ranks."""

from __future__ import annotations

import io

import pytest
import torch
from _dist import run_ranks

import autoplan
from autoplan.runtime.parallel.errors import PartitionError

SPEC = "llama:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,vocab_size=64,max_seq_len=16"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rank_job(rank: int, world_size: int, plan) -> dict:
    pm = autoplan.partition(SPEC, plan, device="cpu")
    template = pm.output_template
    batch = pm.source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, template.shape, template.dtype)
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
    pm.step(*batch[0], target=batch[1])
    optimizer.step()
    out: dict = {"where": (pm.layout.tp_index, pm.layout.dp_index)}
    named = dict(pm.named_parameters())
    out["nan"] = sorted(n for n, p in named.items() if _local(p).isnan().any())
    out["masters_nan"] = sorted(n for n, p in pm.named_masters() if _local(p).isnan().any())
    out["unheld"] = sorted(n for n, p in named.items() if not pm.holds_values(p))
    out["same_as_parameters"] = [id(p) for p in named.values()] == [id(p) for p in pm.parameters()]
    buffer = io.BytesIO()
    torch.save({n: _local(p).detach() for n, p in named.items()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    out["saved_nan"] = sorted(n for n, t in saved.items() if t.isnan().any())
    # every rank's values, rounded to bf16: the dp replicas agree (owner's master, others' working copy)
    out["values"] = {n: _local(p).detach().to(torch.bfloat16).float().clone() for n, p in named.items()}
    state = {n: t.clone() for n, t in pm.state_dict().items()}

    # A plain optimizer over pm.parameters(): refused at its step, in one line, before it writes.
    try:
        torch.optim.SGD(pm.parameters(), lr=0.1).step()
        out["sgd"] = None
    except PartitionError as exc:
        out["sgd"] = str(exc)
    # pm.load_state_dict is the way to set weights: the next step runs
    pm.load_state_dict(state)
    loss = pm.step(*batch[0], target=batch[1])
    optimizer.step()
    out["after_load"] = None if loss is None else float(loss)
    # An in-place write into a working copy this rank reads: refused too
    name = out["unheld"][0]
    with torch.no_grad():
        _local(named[name]).mul_(2.0)
    try:
        pm.step(*batch[0], target=batch[1])
        out["write"] = None
    except PartitionError as exc:
        out["write"] = str(exc)
    out["written"] = name
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_named_parameters_of_a_bf16_zero_1_plan_are_values_and_outside_writes_are_refused():
    plan = autoplan.suggest(SPEC, "1x4xcpu", global_batch=8, seq_len=16, dtype="bf16", micro_batch_size=2, top=1,
                            tp=2, pp=1, dp=2, zero=1)[0]
    assert (plan.tp, plan.dp, plan.zero, plan.job.dtype) == (2, 2, 1, "bfloat16")
    results = run_ranks(_rank_job, 4, plan, timeout_s=280, pg_timeout_s=120)
    for rank, r in results.items():
        assert r["masters_nan"] and r["unheld"], (rank, r["masters_nan"])  # masters were released (the case)
        assert r["nan"] == [] and r["saved_nan"] == [], (rank, r["nan"], r["saved_nan"])
        assert r["same_as_parameters"], rank
        for key in ("sgd", "write"):
            message = r[key]
            assert message is not None, (rank, key)
            assert "ZeRO-1" in message and "load_state_dict" in message and "\n" not in message, message
        assert repr(r["written"]) in r["write"], r["write"]
    losses = [r["after_load"] for r in results.values() if r["after_load"] is not None]
    assert losses and all(loss == losses[0] for loss in losses), losses
    for tp_index in range(plan.tp):  # the dp replicas of one tp rank read the same values
        replicas = [r["values"] for r in results.values() if r["where"][0] == tp_index]
        assert len(replicas) == plan.dp
        for n, t in replicas[0].items():
            for other in replicas[1:]:
                torch.testing.assert_close(other[n], t, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
