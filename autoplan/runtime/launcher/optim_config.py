"""The optimizer of `autoplan run` (`OptimizerConfig`): AdamW's settings, the weight-decay groups
and the learning-rate schedule, checked before any rank starts and built the same way on every rank
and in a single-process loop.

[Note: weight-decay groups] Parameters of one or fewer dimensions (norm weights, biases) are never
decayed, as nanoGPT (`configure_optimizers`: "all biases and layernorms don't") and Megatron-LM
(`_get_param_groups`: "no_wd" for biases and 1-D parameters) do; embeddings are decayed unless
`no_decay_embeddings` (nanoGPT decays them, some recipes do not). Which parameter is which is read
from the whole model's names and shapes (`no_decay_names`: built on meta), not from this rank's
pieces, whose shapes a tp or FSDP shard changes; the groups are then built from the partitioned
model's own names (`param_groups`), so a single process given the same names gets the same groups.

[Note: the schedule] Warmup then decay, as a closed form of the step (`lr_factor`), run by
`torch.optim.lr_scheduler.LambdaLR`: the same learning rates, step by step, as torch's
`SequentialLR([LinearLR(1/(W+1), 1, W), CosineAnnealingLR(D-W, min_lr)], [W])` (or `LinearLR(1,
min_lr/lr, D-W)` for a linear decay), which tests/test_train_real_run.py checks. The warmup's
(step+1)/(W+1) never gives a zero learning rate at step 0 (nanoGPT's `get_lr` and torchtitan's
`linear_warmup_stable_decay` use the same +1). After `decay_steps` the rate stays at `min_lr`
(torch's cosine would rise again). A closed form, not a chain, so that a resumed run needs only the
step (`last_epoch`) to continue exactly, whatever learning rate a checkpoint restored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["LR_SCHEDULES", "OptimizerConfig", "make_optimizer", "make_scheduler", "no_decay_names", "param_groups",
           "restore_scheduler"]

LR_SCHEDULES = ("constant", "cosine", "linear")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW's settings and the learning-rate schedule of a run (the `autoplan run` flags)."""

    lr: float = 1e-3
    """Peak learning rate (--lr), reached after the warmup."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2) (--betas B1,B2): torch's defaults."""
    eps: float = 1e-8
    """AdamW's epsilon (--eps): torch's default."""
    weight_decay: float = 0.01
    """Decoupled weight decay (--weight-decay) of the decayed group: torch's AdamW default, what
    `autoplan run` used before the groups existed ([Note: weight-decay groups])."""
    no_decay_embeddings: bool = False
    """Leave embeddings undecayed too (--no-decay-embeddings)."""
    warmup_steps: int = 0
    """Steps of linear warmup (--warmup-steps): step k < W uses lr * (k+1)/(W+1)."""
    lr_schedule: str = "constant"
    """After the warmup (--lr-schedule): constant, cosine or linear decay to min_lr."""
    min_lr: float = 0.0
    """Where the decay ends (--min-lr), an absolute learning rate."""
    decay_steps: int | None = None
    """The step at which the decay reaches min_lr, counted from step 0 (--decay-steps; None: the run's
    --steps)."""

    def __post_init__(self) -> None:
        for flag, value in (("--lr", self.lr), ("--eps", self.eps)):
            if not _number(value) or not 0 < value < math.inf:
                raise ValueError(f"{flag} {value!r} must be a finite number above 0")
        for flag, value in (("--weight-decay", self.weight_decay), ("--min-lr", self.min_lr)):
            if not _number(value) or not 0 <= value < math.inf:
                raise ValueError(f"{flag} {value!r} must be a finite number >= 0")
        betas = self.betas
        if not (isinstance(betas, tuple | list) and len(betas) == 2 and all(_number(b) for b in betas)):
            raise ValueError(f"--betas {betas!r} must be two numbers B1,B2, e.g. 0.9,0.95")
        for name, b in zip(("beta1", "beta2"), betas):
            if not 0 <= b < 1:
                raise ValueError(f"--betas {betas[0]:g},{betas[1]:g}: {name} {b:g} must be in [0, 1)")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if not isinstance(self.no_decay_embeddings, bool):
            raise ValueError(f"--no-decay-embeddings must be true or false, got {self.no_decay_embeddings!r}")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool):
            raise ValueError(f"--warmup-steps {self.warmup_steps!r} must be an integer")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps {self.warmup_steps} must be >= 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule {self.lr_schedule!r} must be one of {', '.join(LR_SCHEDULES)}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr:g} must be at most --lr {self.lr:g}")
        if self.decay_steps is not None:
            if not isinstance(self.decay_steps, int) or isinstance(self.decay_steps, bool):
                raise ValueError(f"--decay-steps {self.decay_steps!r} must be an integer")
            self._check_decay(self.decay_steps, "--decay-steps")

    def _check_decay(self, decay_steps: int, flag: str) -> None:
        if self.lr_schedule != "constant" and decay_steps <= self.warmup_steps:
            raise ValueError(f"{flag} {decay_steps} must be above --warmup-steps {self.warmup_steps} for a "
                             f"{self.lr_schedule} decay (the decay runs from the end of the warmup to it)")

    def for_steps(self, steps: int) -> OptimizerConfig:
        """This config with `decay_steps` fixed: the run's total steps unless given; checked."""
        if self.decay_steps is not None:
            return self
        self._check_decay(steps, "--steps")
        return OptimizerConfig(**{**asdict(self), "decay_steps": steps})

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (checkpoints' extras)."""
        return {**asdict(self), "betas": list(self.betas)}

    def lr_factor(self, step: int) -> float:
        """The learning rate of step `step` over `lr` ([Note: the schedule])."""
        warmup = self.warmup_steps
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if self.lr_schedule == "constant":
            return 1.0
        assert self.decay_steps is not None, "call for_steps first"
        span = self.decay_steps - warmup
        progress = min(step - warmup, span) / span
        floor = self.min_lr / self.lr
        if self.lr_schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1 + (floor - 1) * progress

    def adamw_kwargs(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}


def no_decay_names(model: nn.Module, config: OptimizerConfig) -> set[str]:
    """Every name (tied aliases included) of a parameter left undecayed ([Note: weight-decay
    groups]): 1-D parameters, and embeddings with `no_decay_embeddings`. `model`: the whole model,
    on meta is enough."""
    names = {name for name, p in model.named_parameters(remove_duplicate=False) if p.dim() < 2}
    if config.no_decay_embeddings:
        by_id: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                names.update(by_id[id(module.weight)])  # a head tied to it too: one tensor
    return names


def _kernel_key(p: torch.Tensor) -> Any:
    """torch's fused AdamW runs one kernel per group and refuses a group that mixes plain tensors
    and DTensors, or DTensors of different meshes (as PartitionedModel._param_groups splits them)."""
    from torch.distributed.tensor import DTensor

    return (id(p.device_mesh), p.device_mesh.ndim) if isinstance(p, DTensor) else None


def param_groups(named: Iterable[tuple[str, torch.Tensor]], no_decay: set[str],
                 config: OptimizerConfig) -> list[dict[str, Any]]:
    """Optimizer groups over `named` (a model's `named_parameters()`, a partitioned model's
    `named_masters()`): the decayed group, then the undecayed (weight_decay 0), each split by kernel
    (`_kernel_key`); empty groups left out."""
    groups: dict[tuple[bool, Any], list[torch.Tensor]] = {}
    for name, p in named:
        groups.setdefault((name not in no_decay, _kernel_key(p)), []).append(p)
    ordered = sorted(groups, key=lambda key: not key[0])  # decayed first; stable within
    return [{"params": groups[key], "weight_decay": config.weight_decay if key[0] else 0.0} for key in ordered]


def make_optimizer(pm, config: OptimizerConfig, model: nn.Module | None = None,
                   **kwargs: Any) -> torch.optim.Optimizer:
    """AdamW over the partitioned model `pm` with `config`'s settings and groups, sharded as its
    plan says (`pm.make_optimizer`: ZeRO-1, FSDP). `model`: the whole model whose names say which
    parameters are decayed (default: `pm.source` built on meta). `kwargs`: AdamW's others (fused=True)."""
    if model is None:
        model = pm.source.build("meta")
    groups = param_groups(pm.named_masters(), no_decay_names(model, config), config)
    return pm.make_optimizer(torch.optim.AdamW, param_groups=groups, **config.adamw_kwargs(), **kwargs)


def make_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """torch's LambdaLR running `config.lr_factor` ([Note: the schedule]); call its `step()` after
    each optimizer step."""
    # A function, not the bound method: LambdaLR's state_dict then holds no copy of it.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: config.lr_factor(step))


def restore_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict[str, Any] | None, step: int) -> None:
    """Continue the schedule of a run resumed at `step`: the saved scheduler's count (`state`, as
    `state_dict()` saved it; else `step`), and every group's learning rate from this run's config,
    whatever the checkpoint's hyperparameters restored."""
    epoch = int(state["last_epoch"]) if state else step
    scheduler.last_epoch = epoch
    scheduler._step_count = int(state.get("_step_count", epoch + 1)) if state else epoch + 1
    lrs = [base * scheduler.lr_lambdas[i](epoch) for i, base in enumerate(scheduler.base_lrs)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
