"""Mixed precision as Megatron-LM runs it: bf16 weights and compute, fp32 master weights and gradients.

[Note: mixed precision]
A plan with dtype bfloat16 is run the way the cost model counts it (cost/memory.py [Note: bytes per
parameter]) and the profile measures it (every floating tensor in bf16), not with `torch.autocast`,
which would keep a bf16 copy of every weight per micro-batch in flight (the casts are saved for
backward), and fp32 residual streams:

- The stage modules compute with bf16 *working* parameters and buffers; activations, the values sent
  between stages and their gradients are bf16.
- Each working parameter has an fp32 *master* (Micikevicius et al. 2018, "Mixed Precision Training",
  Sec. 3.1). The masters are what the user sees (`PartitionedModel.named_parameters()`, but see
  ZeRO-1 below), what the optimizer steps, what `state_dict` and checkpoints hold.
- Gradients accumulate over micro-batches in fp32 on the master (`master.grad`), as Megatron-LM's
  `main_grad` with `accumulate_allreduce_grads_in_fp32`: a post-accumulate-grad hook adds each bf16
  gradient as soon as autograd produces it and frees it; weight gradients that zb-h1 computes
  outside autograd's accumulation are moved by `flush_grads`. The dp all-reduce then runs on fp32.
- `refresh` copies the masters into the working parameters at the start of every step (after the
  previous step's optimizer update).
- Under a ZeRO-1 optimizer (runtime/parallel/optimizer.py [Note: ZeRO-1 optimizer]) a rank keeps the fp32
  values of the masters it owns only, as Megatron-LM's distributed optimizer keeps its fp32 "main
  params" for its shard: `release_masters` drops the others' values. A released master stays the
  same nn.Parameter (its name, shape, placement and identity: the optimizer's groups and the
  checkpoints key by it) and keeps its full fp32 gradient (`.grad`, the accumulation buffer that is
  all-reduced over dp, Megatron-LM's `main_grad`), but its values are one shared NaN expanded to
  its shape (4 bytes for them all): this rank's values of that parameter are the bf16 working
  copy, which the owner writes after its step and broadcasts (`ZeroOneOptimizer`), and which
  `PartitionedModel.named_parameters`, `parameters` and `state_dict` give for it (the released
  master itself only through `PartitionedModel.named_masters`, never where a user reads weights).
- [Note: writes under ZeRO-1] Then a parameter's values live on one rank in fp32 and reach the
  others only through the owner's step, so a write made outside that step (an in-place
  initialisation, a plain torch optimizer over `parameters()`) would reach this rank's copy only,
  and be lost or make the replicas differ. Rather than let that pass, both are refused in one line
  naming ZeRO-1 and the calls that do it right:
  - another optimizer's step over any of these parameters, by a global optimizer step pre-hook
    (torch.optim.optimizer `register_optimizer_step_pre_hook`, `_refuse_other_optimizers`), exact
    whatever the optimizer's implementation;
  - an in-place write, at the start of the next step (`PartitionedModel.step`): the values a user
    sees (the held masters and the released masters' working copies) have their version counters
    recorded after every write the runtime makes (`mark_versions`: after a release, a `refresh`,
    an owner's step) and compared (`changed_master`). A DTensor's own counter and its local
    tensor's are both read, since an op on the DTensor bumps the first and one on `.to_local()`
    the second. (torch's foreach and fused kernels bump neither on a DTensor: the optimizers,
    which the hook covers.)

Bytes per parameter: 2 (bf16 weight) + 4 (fp32 gradient) + 4 (fp32 master) + 8 (Adam's moments) = 18,
Megatron-LM's figure for this setup, and the cost model's (cost/memory.py); under ZeRO-1, 2 + 4 +
(4 + 8) / dp.

[Note: fp16 loss scaling]
An fp16 plan runs as a bf16 one (fp16 working copies, fp32 masters and gradients, the same 18 bytes
per parameter) plus a dynamic loss scale, because fp16's 5 exponent bits flush small gradients to
zero (Micikevicius et al. 2018, Sec. 3.2): the last stage's loss is multiplied by the scale S before
its backward (every activation gradient of every stage, the values sent between stages included,
is S times the true one), the fp32 master gradients are multiplied by 1 / S once they are
accumulated and reduced, and then, as torch.amp.GradScaler and Megatron-LM's DynamicGradScaler do:
- a step whose gradients hold an infinity or a NaN on ANY rank (the launcher's one MAX all-reduce
  over the whole world, `launch._loss_and_nonfinite`, which every rank reads) is an overflow: no
  optimizer step on any rank, S halves;
- after `growth_interval` steps in a row without overflow, S doubles, up to `max_scale`.
S starts at, and never grows past, 2**15 (GradScaler starts at 2**16 and has no cap): here the loss
itself is fp16 (the stages compute in the plan's dtype, the loss included, with no autocast to promote
it to fp32), and the gradient the backward hands that fp16 loss is S (the executor scales the loss in
fp32), which must stay below fp16's largest finite value, 65504: at 2**16 every step would overflow. S
never goes below `min_scale` (1, Megatron-LM's `min_loss_scale`): an overflow at S = 1 is a
non-finite gradient, not a too-large scale, and the run treats it as one (--skip-nonfinite).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from autoplan.runtime.parallel.errors import PartitionError
from autoplan.runtime.parallel.tensor_parallel import grad_like_param

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["LossScaler", "MixedPrecision", "apply_precision", "cast_buffers", "compute_dtype"]


def compute_dtype(plan: Plan) -> torch.dtype:
    """The plan's compute dtype: fp32, or bf16 / fp16 with fp32 masters ([Note: mixed precision];
    fp16 with a loss scale, [Note: fp16 loss scaling])."""
    dtype = getattr(torch, plan.job.dtype, None)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise PartitionError(f"the runtime runs plans in bfloat16, float16 or float32, not {plan.job.dtype}; "
                             f"re-plan with --dtype bf16")
    return dtype


def apply_precision(build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
    """The precision step: the stages compute in the plan's dtype. bf16 / fp16 working copies with
    fp32 masters (`MixedPrecision`), except under FSDP (zero >= 2, [Note: FSDP under the pipeline
    executor] in fsdp.py), whose policy casts the parameters: only buffers are cast here then."""
    build.compute_dtype = compute_dtype(plan)
    if build.compute_dtype == torch.float32:
        return
    if plan.zero < 2:
        build.precision = MixedPrecision(list(build.modules.values()), build.compute_dtype)
    else:
        cast_buffers(list(build.modules.values()), build.compute_dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of a parameter: the tp shard of a DTensor, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class MixedPrecision:
    """bf16 working copies of the floating parameters and buffers of `modules`, with fp32 masters."""

    def __init__(self, modules: Sequence[nn.Module], dtype: torch.dtype):
        self.dtype = dtype
        self.master_of: dict[int, nn.Parameter] = {}
        """id(working parameter) -> its fp32 master."""
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self.working_of: dict[int, nn.Parameter] = {}
        """id(fp32 master) -> its working parameter."""
        self._released: set[int] = set()
        """id(master) of the masters whose values this rank does not hold (`release_masters`)."""
        self._placeholders: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._versions: dict[int, int] = {}
        """id(master) -> the version counter of what a user sees of it, at the runtime's last write
        (only once masters are released: [Note: writes under ZeRO-1])."""
        working_of: dict[int, nn.Parameter] = {}
        seen_modules: set[int] = set()
        for root in modules:
            for mod in root.modules():
                if id(mod) in seen_modules:
                    continue
                seen_modules.add(id(mod))
                for name, p in list(mod._parameters.items()):
                    if p is None or not p.is_floating_point():
                        continue
                    if id(p) in self.master_of:  # already a working copy (a module reached twice)
                        continue
                    working = working_of.get(id(p))
                    if working is None:  # first sight of this master (tied parameters share one)
                        working = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                        working_of[id(p)] = working
                        self.master_of[id(working)] = p
                        self._pairs.append((p, working))
                        self.working_of[id(p)] = working
                        if working.requires_grad:
                            working.register_post_accumulate_grad_hook(self._accumulate)
                    mod._parameters[name] = working
        cast_buffers(modules, dtype)

    def _accumulate(self, working: torch.Tensor) -> None:
        master = self.master_of[id(working)]
        grad = working.grad
        if grad is None:
            return
        grad = grad_like_param(working, grad)
        if master.grad is None:
            master.grad = grad.to(master.dtype)
        else:
            master.grad.add_(grad)
        working.grad = None

    def flush_grads(self) -> None:
        """Move any gradient still on a working parameter (zb-h1's W) into its master."""
        for _, working in self._pairs:
            if working.grad is not None:
                self._accumulate(working)

    def holds(self, master: torch.Tensor) -> bool:
        """Whether this rank holds the fp32 values of `master` (not released)."""
        return id(master) not in self._released

    def readable(self, master: nn.Parameter) -> nn.Parameter:
        """What a user reads of `master`: itself, or its working copy once released."""
        return self.working_of[id(master)] if id(master) in self._released else master

    def mark_versions(self) -> None:
        """Record the version counters of what a user sees of every master ([Note: writes under
        ZeRO-1]); nothing to record before a release."""
        if self._released:
            self._versions = {id(master): _versions(self.readable(master)) for master, _ in self._pairs}

    def changed_master(self) -> nn.Parameter | None:
        """A master whose visible values were written since `mark_versions`, or None."""
        for master, _ in self._pairs:
            recorded = self._versions.get(id(master))
            if recorded is not None and _versions(self.readable(master)) != recorded:
                return master
        return None

    def visible_ids(self) -> set[int]:
        """id() of what a user sees of every master (`readable`)."""
        return {id(self.readable(master)) for master, _ in self._pairs}

    @torch.no_grad()
    def release_masters(self, keep: set[int]) -> None:
        """Drop the fp32 values of every master whose id is not in `keep` (module docstring): its
        values become a shared NaN expanded to its (local) shape; its gradient stays."""
        for master, _ in self._pairs:
            if id(master) in keep or id(master) in self._released:
                continue
            local = _local(master)
            key = (local.dtype, local.device)
            if key not in self._placeholders:
                self._placeholders[key] = torch.full((), float("nan"), dtype=local.dtype, device=local.device)
            placeholder = self._placeholders[key].expand(local.shape)
            if hasattr(master, "_local_tensor"):  # a tp shard (DTensor): the wrapper keeps its global metadata
                master._local_tensor = placeholder
            else:
                master.data = placeholder
            self._released.add(id(master))
        if self._released:
            _RELEASED.add(self)
            _install_optimizer_hook()
        self.mark_versions()

    @torch.no_grad()
    def refresh(self) -> None:
        """Working parameters <- masters (bf16 rounding of the fp32 values), of the masters this rank
        holds (a released master's working copy is written by its owner, optimizer.py)."""
        for master, working in self._pairs:
            if id(master) not in self._released:
                working.copy_(master)
        self.mark_versions()


def _versions(t: torch.Tensor) -> tuple[int, int]:
    """(the tensor's version counter, its local tensor's): [Note: writes under ZeRO-1]."""
    return t._version, _local(t)._version


_RELEASED: weakref.WeakSet[MixedPrecision] = weakref.WeakSet()
"""The live `MixedPrecision`s with released masters: the parameters another optimizer may not step."""
_hook: object | None = None


def _install_optimizer_hook() -> None:
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook = register_optimizer_step_pre_hook(_refuse_other_optimizers)


def _refuse_other_optimizers(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global optimizer step pre-hook: an optimizer other than the ZeRO-1 one (and the torch
    optimizer inside it, both marked `_autoplan_zero_one`) that steps the parameters of a model
    whose masters are released is refused ([Note: writes under ZeRO-1])."""
    if not _RELEASED or getattr(optimizer, "_autoplan_zero_one", False):
        return
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for precision in list(_RELEASED):
        if mine & precision.visible_ids():
            raise PartitionError(
                f"{type(optimizer).__name__} is stepping parameters of a bf16 ZeRO-1 model: under ZeRO-1 each dp rank "
                f"holds the fp32 values of 1/dp of the parameters (pm.parameters() gives the others as bf16 copies "
                f"without gradients), so another optimizer would update them on one rank only; step with the "
                f"optimizer pm.make_optimizer({type(optimizer).__name__}, ...) returns, and set weights with "
                f"pm.load_state_dict(state_dict)")


def cast_buffers(modules: Sequence[nn.Module], dtype: torch.dtype) -> None:
    """Persistent floating buffers of `modules` in the compute dtype (under FSDP too, whose policy
    casts parameters only). Non-persistent buffers are tables a model computes from positions
    (rotary frequencies, cos / sin): they stay fp32, since bf16 holds integers exactly only up to 256
    and the positions the graph multiplies them by follow their dtype."""
    for root in modules:
        for mod in root.modules():
            for name, b in list(mod._buffers.items()):
                if name in mod._non_persistent_buffers_set:
                    continue
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    mod._buffers[name] = b.to(dtype)


class LossScaler:
    """The dynamic loss scale of an fp16 plan ([Note: fp16 loss scaling]); torch.amp.GradScaler's
    rule (growth 2, backoff 0.5, growth interval 2000) on the fp32 master gradients."""

    def __init__(self, init_scale: float = 2.0**15, *, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0, max_scale: float = 2.0**15):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale, self.max_scale = growth_interval, min_scale, max_scale
        self.good_steps = 0
        """Steps without overflow since the scale last changed."""

    @torch.no_grad()
    def unscale_(self, grads: Sequence[torch.Tensor]) -> None:
        """Multiply gradients (fp32, or DTensors of fp32) by 1 / scale in place."""
        local = [_local(g) for g in grads]
        if local:
            torch._foreach_mul_(local, 1.0 / self.scale)

    @property
    def at_minimum(self) -> bool:
        """An overflow at this scale is a non-finite gradient, not a scale to lower."""
        return self.scale <= self.min_scale

    def update(self, overflow: bool) -> None:
        """After a step: halve on an overflow (the step was skipped), grow after `growth_interval`
        good steps in a row, never past `max_scale`."""
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)  # the fp16 loss's gradient is S
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
