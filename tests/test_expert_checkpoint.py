"""Checkpoints of expert-parallel plans ([Note: experts in a checkpoint] in runtime/checkpoint/state.py):
each rank holds a slice of every experts parameter under the parameter's full name, and the checkpoint
holds each whole, once, so it loads under another ep, without ep, and into a plain model. Through
`autoplan.partition` on 4 gloo ranks (ZeRO-1 and FSDP, the ep group folded over tp), and through
`autoplan suggest --ep 2 --out` / `autoplan run --checkpoint-dir` / `--resume`."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from test_expert_zero1 import SPEC, _plan
from test_user_paths import _full

import autoplan

pytestmark = pytest.mark.multiproc

GLOBAL_BATCH, SEQ, LR = 8, 16, 1e-3


def _named_state(pm, optimizer) -> dict:
    """{name: exp_avg} of the parameters this rank's optimizer steps."""
    from autoplan.runtime.checkpoint import local_optimizer

    names = {id(p): n for n, p in pm.named_parameters()}
    return {names[id(p)]: s["exp_avg"] for p, s in local_optimizer(optimizer).state.items() if "exp_avg" in s}


def _train_and_save(rank: int, world_size: int, plans: dict, root: str) -> dict:
    """Two AdamW steps of each plan, then a checkpoint: every rank's expert slices (parameters and
    the moments it holds), whole over FSDP, with its ep index."""
    from autoplan.runtime import checkpoint as ckpt

    out = {}
    for name, plan in plans.items():
        pm = autoplan.partition(SPEC, plan, device="cpu")
        template = pm.output_template
        optimizer = pm.make_optimizer(torch.optim.AdamW, lr=LR)
        for step in range(2):
            inputs, target = pm.source.batch(0, step, GLOBAL_BATCH, SEQ, template.shape, template.dtype)
            pm.step(*inputs, target=target)
            optimizer.step()
        experts = {id(p) for p in pm.expert_params}
        params = {n: _full(p).detach().clone() for n, p in pm.named_parameters() if id(p) in experts}
        moments = {n: _full(v).clone() for n, v in _named_state(pm, optimizer).items()}
        path = ckpt.save_checkpoint(f"{root}/{name}", 2, pm, optimizer)
        out[name] = dict(path=str(path), ep_index=pm.layout.ep_index, params=params,
                         moments={n: v for n, v in moments.items() if n in params})
    return out


def _restore(rank: int, world_size: int, plans: dict, paths: dict) -> dict:
    """Each checkpoint restored into each plan: this rank's expert slices and moments, whole."""
    from autoplan.runtime import checkpoint as ckpt

    out = {}
    for (name, plan), path in ((item, paths[item[0]]) for item in plans.items()):
        pm = autoplan.partition(SPEC, plan, device="cpu")
        optimizer = pm.make_optimizer(torch.optim.AdamW, lr=LR)
        step = ckpt.restore(ckpt.load_checkpoint(path), pm, optimizer, strict=True)
        experts = {id(p) for p in pm.expert_params} or {id(p) for n, p in pm.named_parameters() if ".experts." in n}
        params = {n: _full(p).detach().clone() for n, p in pm.named_parameters() if id(p) in experts}
        moments = {n: _full(v).clone() for n, v in _named_state(pm, optimizer).items() if n in params}
        out[name] = dict(step=step, ep=plan.ep, ep_index=pm.layout.ep_index, params=params, moments=moments)
    torch.distributed.barrier()
    return out


def _whole(results: dict, name: str, key: str, ep: int) -> dict[str, torch.Tensor]:
    """The whole expert tensors of `key` over the ranks, slices in ep order (copies checked to agree)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for r in results.values():
        for n, t in r[name][key].items():
            index = r[name]["ep_index"]
            if index in parts.get(n, {}):
                torch.testing.assert_close(t, parts[n][index])
            parts.setdefault(n, {})[index] = t
    assert all(sorted(p) == list(range(ep)) for p in parts.values()), {n: sorted(p) for n, p in parts.items()}
    return {n: torch.cat([p[i] for i in range(ep)]) for n, p in parts.items()}


@pytest.mark.timeout(300)
def test_an_ep_checkpoint_holds_every_expert_once_and_restores_under_another_ep():
    """Saved at ep 2 x tp 2 (the ep group folded over tp x dp) with ZeRO-1 and with FSDP: the
    checkpoint's experts are the whole (E, ...) tensors, the slices of every ep index in place, the
    same for the Adam moments of whichever rank owned them; restored at ep 4 (FSDP), at ep 1 (zero 0)
    and at ep 2 under HSDP, every rank reads its own slice of them."""
    import tempfile

    from autoplan.runtime.checkpoint import load_checkpoint

    saved = {"ep2-tp2-zero1": _plan(tp=2, pp=1, dp=2, ep=2, zero=1),
             "ep2-tp2-zero3": _plan(tp=2, pp=1, dp=2, ep=2, zero=3)}
    assert all(plan.expert_token_split == 2 for plan in saved.values())
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_train_and_save, 4, saved, root, timeout_s=250, pg_timeout_s=60)
        paths = {name: results[0][name]["path"] for name in saved}
        for name in saved:
            whole_params, whole_moments = (_whole(results, name, key, 2) for key in ("params", "moments"))
            assert whole_params and set(whole_moments) == set(whole_params), name
            ckpt = load_checkpoint(paths[name])
            assert ckpt.manifest["layout"]["ep"] == 2
            for n, value in whole_params.items():  # whole (4 experts), every slice at its place
                assert ckpt.params[n].shape[0] == 4, (name, n, tuple(ckpt.params[n].shape))
                torch.testing.assert_close(ckpt.params[n], value, msg=f"{name}: {n}")
                torch.testing.assert_close(ckpt.optimizer_state[n]["exp_avg"], whole_moments[n])
        # Each checkpoint into ep 4 under FSDP and into ep 1 without ZeRO.
        targets = {"ep4-zero3": _plan(tp=1, pp=1, dp=4, ep=4, zero=3), "ep1": _plan(tp=1, pp=1, dp=4, ep=1, zero=0),
                   "ep2-hsdp": _plan(tp=1, pp=1, dp=4, ep=2, zero=3, dp_replicate=2)}
        for source in saved:
            ckpt = load_checkpoint(paths[source])
            restored = run_ranks(_restore, 4, targets, dict.fromkeys(targets, paths[source]), timeout_s=250,
                                 pg_timeout_s=60)
            for name in targets:
                assert all(r[name]["step"] == 2 for r in restored.values())
                for r in restored.values():
                    index, ep = r[name]["ep_index"], r[name]["ep"]
                    assert r[name]["params"], (source, name)
                    for n, value in r[name]["params"].items():
                        rows = ckpt.params[n].shape[0] // ep
                        expected = ckpt.params[n][index * rows:(index + 1) * rows]
                        torch.testing.assert_close(value, expected, msg=f"{source} -> {name}: {n}")
                    for n, value in r[name]["moments"].items():
                        rows = ckpt.params[n].shape[0] // ep
                        moments = ckpt.optimizer_state[n]["exp_avg"]
                        torch.testing.assert_close(value, moments[index * rows:(index + 1) * rows])



@pytest.mark.extended
@pytest.mark.timeout(400)
@pytest.mark.parametrize("zero", ["1", "3"])
def test_a_transformers_moe_resumes_exactly_from_an_ep_checkpoint(zero, tmp_path):
    """Transformers' Mixtral (routed experts, run again as the model's own module) at ep 2 x tp 2 through
    `autoplan suggest --out` / `autoplan run --checkpoint-dir`: resumed from step 2, steps 2 and 3
    print the losses of the run that was never stopped."""
    import json
    import shutil
    import subprocess
    import sys

    from test_expert_parallel_routed import MODELS

    from autoplan.runtime.checkpoint.format import step_dir_name

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, timeout=300)

    plan_file, checkpoints = tmp_path / "plan.json", tmp_path / "ckpt"
    made = cli("suggest", "--model", MODELS["hf-mixtral"], "--cluster", "1x4xcpu", "--global-batch", "8", "--seq-len",
               "16", "--tp", "2", "--dp", "2", "--ep", "2", "--zero", zero, "--out", str(plan_file))
    assert made.returncode == 0, made.stderr[-2000:]
    plan = json.loads(plan_file.read_text())
    assert (plan["tp"], plan["ep"], plan["zero"], plan["expert_tp"]) == (2, 2, int(zero), 1)
    straight = cli("run", str(plan_file), "--steps", "4", "--checkpoint-dir", str(checkpoints), "--checkpoint-every",
                   "2", "--metrics", str(tmp_path / "straight.jsonl"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    shutil.rmtree(checkpoints / step_dir_name(4))
    resumed = cli("run", str(plan_file), "--steps", "4", "--checkpoint-dir", str(checkpoints), "--resume",
                  "--metrics", str(tmp_path / "resumed.jsonl"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    def losses(name: str) -> dict[int, float]:
        rows = map(json.loads, (tmp_path / name).read_text().splitlines())
        return {m["step"]: m["loss"] for m in rows if m.get("loss") is not None}

    before, after = losses("straight.jsonl"), losses("resumed.jsonl")
    assert sorted(after) == [2, 3] and all(after[s] == before[s] for s in after), (before, after)


TWO_EXPERTS = SPEC.replace("num_experts=4", "num_experts=2").replace("experts_per_token=2", "experts_per_token=1")
"""Two experts at ep 2 under FSDP over 2 ranks: each rank's one-expert slice shards as (1, ...) and (0, ...)."""


def _save_two_experts(rank: int, world_size: int, plan, root: str) -> dict:
    from autoplan.runtime import checkpoint as ckpt

    pm = autoplan.partition(TWO_EXPERTS, plan, device="cpu")
    template = pm.output_template
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=LR)
    inputs, target = pm.source.batch(0, 0, GLOBAL_BATCH, SEQ, template.shape, template.dtype)
    pm.step(*inputs, target=target)
    optimizer.step()
    experts = {id(p) for p in pm.expert_params}
    local_rows = sorted({p.to_local().shape[0] for p in pm.expert_params})
    params = {n: _full(p).detach().clone() for n, p in pm.named_parameters() if id(p) in experts}
    path = ckpt.save_checkpoint(f"{root}/two", 1, pm, optimizer)
    return {"two": dict(path=str(path), ep_index=pm.layout.ep_index, params=params, local_rows=local_rows)}


@pytest.mark.timeout(200)
def test_an_empty_fsdp_shard_of_an_expert_slice_writes_nothing_and_the_checkpoint_is_whole():
    """A one-expert slice sharded over 2 FSDP ranks leaves one rank an empty shard: it writes no box,
    and the checkpoint still holds both experts whole, loaded into one process."""
    import tempfile

    from autoplan.runtime.checkpoint import load_checkpoint

    plan = autoplan.suggest(TWO_EXPERTS, "1x4xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype="fp32",
                            micro_batch_size=2, top=1, tp=1, pp=1, dp=4, ep=2, zero=3)[0]
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_save_two_experts, 4, plan, root, timeout_s=180, pg_timeout_s=60)
        assert {rows for r in results.values() for rows in r["two"]["local_rows"]} == {0, 1}  # an empty shard
        ckpt = load_checkpoint(results[0]["two"]["path"])
        whole = _whole(results, "two", "params", 2)
        assert whole and all(value.shape[0] == 2 for value in whole.values())
        for n, value in whole.items():
            torch.testing.assert_close(ckpt.params[n], value, msg=f"two experts: {n}")
