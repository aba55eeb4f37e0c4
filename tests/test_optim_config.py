"""`OptimizerConfig` (runtime/launcher/optim_config.py): the schedule equals torch's own schedulers step by step,
the weight-decay groups follow the usual rule, a resumed scheduler continues exactly, and every bad
setting is one line naming its flag (through `autoplan run`, exit 2, before torch loads a rank)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from autoplan import models as zoo
from autoplan.runtime.launcher.optim_config import (
    OptimizerConfig,
    make_scheduler,
    no_decay_names,
    param_groups,
    restore_scheduler,
)

GPT = "gpt:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"  # ties its head to the embedding
LLAMA = "llama:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,vocab_size=64,max_seq_len=16"


def _torch_lrs(schedule: str, lr: float, warmup: int, decay: int, min_lr: float, steps: int) -> list[float]:
    """The learning rate of each step under torch's own schedulers (what a single-process loop uses)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    S = torch.optim.lr_scheduler
    decays = {"cosine": lambda: S.CosineAnnealingLR(optimizer, T_max=decay - warmup, eta_min=min_lr),
              "linear": lambda: S.LinearLR(optimizer, 1.0, min_lr / lr, total_iters=decay - warmup),
              "constant": lambda: S.ConstantLR(optimizer, factor=1.0, total_iters=0)}
    after = decays[schedule]()
    scheduler = (S.SequentialLR(optimizer, [S.LinearLR(optimizer, 1 / (warmup + 1), 1.0, total_iters=warmup), after],
                                [warmup]) if warmup else after)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("schedule, warmup", [("cosine", 5), ("linear", 5), ("constant", 5), ("cosine", 0),
                                              ("linear", 0)])
def test_the_schedule_is_torchs_step_by_step(schedule, warmup):
    config = OptimizerConfig(lr=3e-3, warmup_steps=warmup, lr_schedule=schedule, min_lr=3e-4).for_steps(40)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = make_scheduler(optimizer, config)
    ours = []
    for _ in range(40):
        ours.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = _torch_lrs(schedule, 3e-3, warmup, 40, 3e-4, 40)
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert len(set(ours)) > 5  # it did schedule
    # past decay_steps the rate stays at min_lr (torch's cosine would rise again)
    if schedule != "constant":
        assert config.lr_factor(40) * config.lr == pytest.approx(3e-4) == config.lr_factor(400) * config.lr


def test_a_restored_scheduler_continues_exactly():
    config = OptimizerConfig(lr=1e-3, warmup_steps=3, lr_schedule="cosine", min_lr=1e-5).for_steps(20)
    straight_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=config.lr)
    straight = make_scheduler(straight_opt, config)
    for _ in range(11):
        straight_opt.step()
        straight.step()
    saved = straight.state_dict()
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=config.lr)
    resumed = make_scheduler(opt, config)
    opt.param_groups[0]["lr"] = 123.0  # whatever a checkpoint's hyperparameters restored
    restore_scheduler(resumed, saved, 11)
    for _ in range(9):
        assert opt.param_groups[0]["lr"] == straight_opt.param_groups[0]["lr"]
        opt.step()
        resumed.step()
        straight_opt.step()
        straight.step()


def test_weight_decay_groups_leave_norms_biases_and_on_request_embeddings_undecayed():
    model = zoo.build_model(GPT, device="meta")
    plain = no_decay_names(model, OptimizerConfig())
    assert plain == {n for n, p in model.named_parameters(remove_duplicate=False) if p.dim() < 2}
    assert plain and all(".weight" in n or ".bias" in n for n in plain)
    embeddings = no_decay_names(model, OptimizerConfig(no_decay_embeddings=True)) - plain
    tied = {n for n, p in model.named_parameters(remove_duplicate=False) if p is model.get_parameter(
        next(iter(embeddings)))}
    assert embeddings and tied <= embeddings  # the head tied to the embedding: the same tensor, undecayed too
    groups = param_groups(model.named_parameters(), plain, OptimizerConfig(weight_decay=0.1))
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    decayed = {id(p) for p in groups[0]["params"]}
    assert all((p.dim() >= 2) == (id(p) in decayed) for p in model.parameters())
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


@pytest.mark.parametrize("kwargs, message", [
    (dict(warmup_steps=-1), "--warmup-steps -1 must be >= 0"),
    (dict(lr=0.0), "--lr 0.0 must be a finite number above 0"),
    (dict(lr=float("nan")), "--lr nan must be a finite number above 0"),
    (dict(eps=-1e-8), "--eps -1e-08 must be"),
    (dict(weight_decay=-0.1), "--weight-decay -0.1 must be a finite number >= 0"),
    (dict(betas=(0.9, 1.0)), "beta2 1 must be in [0, 1)"),
    (dict(betas=(0.9,)), "--betas (0.9,) must be two numbers"),
    (dict(lr_schedule="cosin"), "--lr-schedule 'cosin' must be one of constant, cosine, linear"),
    (dict(min_lr=1.0), "--min-lr 1 must be at most --lr 0.001"),
    (dict(lr_schedule="cosine", warmup_steps=10, decay_steps=10), "--decay-steps 10 must be above --warmup-steps 10"),
    (dict(warmup_steps=1.5), "--warmup-steps 1.5 must be an integer"),
])
def test_a_bad_setting_is_one_line_naming_its_flag(kwargs, message):
    with pytest.raises(ValueError) as caught:
        OptimizerConfig(**kwargs)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_decay_longer_than_the_warmup_is_checked_against_the_steps():
    with pytest.raises(ValueError, match="--steps 4 must be above --warmup-steps 5 for a cosine decay"):
        OptimizerConfig(warmup_steps=5, lr_schedule="cosine").for_steps(4)
    assert OptimizerConfig(warmup_steps=5).for_steps(4).decay_steps == 4  # constant: no decay to check


def test_bad_optimizer_flags_exit_2_with_one_line_before_any_rank(tmp_path):
    plan = tmp_path / "p.json"
    made = subprocess.run([sys.executable, "-m", "autoplan", "suggest", "--model", LLAMA, "--cluster", "1x1xcpu",
                           "--global-batch", "4", "--seq-len", "16", "--dtype", "fp32", "--out", str(plan)],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    for flags, message in ((["--warmup-steps", "-1"], "--warmup-steps -1 must be >= 0"),
                           (["--lr-schedule", "cosine", "--warmup-steps", "20"],
                            "--steps 10 must be above --warmup-steps 20"),
                           (["--betas", "0.9"], "'0.9' must be two numbers B1,B2")):
        ran = subprocess.run([sys.executable, "-m", "autoplan", "run", str(plan), *flags], capture_output=True,
                             text=True, timeout=300)
        assert ran.returncode == 2 and message in ran.stderr, (flags, ran.stderr)
        assert "Traceback" not in ran.stderr and "launching" not in ran.stderr, ran.stderr


def test_make_optimizer_groups_a_partitioned_models_parameters_by_their_names():
    """Through the public API on one process: `make_optimizer(pm, config)` decays exactly the
    parameters of two or more dimensions, under the model's own names, and the scheduler moves
    every group's rate."""
    import autoplan
    from autoplan.runtime.launcher.optim_config import make_optimizer

    plan = autoplan.suggest(LLAMA, "1x1xcpu", global_batch=4, seq_len=16, dtype="fp32", top=1)[0]
    pm = autoplan.partition(LLAMA, plan, device="cpu")
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1, warmup_steps=2, lr_schedule="linear").for_steps(10)
    optimizer = make_optimizer(pm, config)
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    named = dict(pm.named_parameters())
    assert set(decay_of) == {id(p) for p in named.values()}
    for name, p in named.items():
        assert decay_of[id(p)] == (0.1 if p.dim() >= 2 else 0.0), name
    assert any(p.dim() < 2 for p in named.values())
    scheduler = make_scheduler(optimizer, config)
    assert {g["lr"] for g in optimizer.param_groups} == {1e-3 / 3}
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([2e-3 / 3] * len(optimizer.param_groups))
