"""The pipeline executor: walks this rank's list from `Schedule.with_comms()` and runs it.

These are the very lists the simulator scores (docs/architecture.md, "A schedule is data"), so a measured
timeline can be compared with the prediction action by action: every action is recorded as
(action, start, end) in `time.perf_counter()` seconds.

- F(s, m): run stage s on micro-batch m; the last stage returns loss / num_microbatches so the
  gradients summed over micro-batches are those of the mean loss. Inputs and outputs are kept
  until the backward.
- B(s, m): backward from the received output gradients. With gpipe / 1f1b / interleaved-1f1b it
  is the full backward (input and weight gradients, accumulated in `.grad`).
- zb-h1: B computes input gradients only and W the weight gradients, using torch's
  `stage_backward_input` / `stage_backward_weight` (torch.distributed.pipelining._backward), which
  keep the intermediate gradients B computed so W does not repeat them. A stage with no input that
  needs a gradient (the first stage) has nothing to send back, so it runs its whole backward at B
  and its W is a no-op.
- SEND_*: `isend`, waited for at the end of the step; RECV_*: `irecv` into a buffer allocated from
  the graph's shapes, waited on (with a timeout) inside the RECV action, so the timeline shows
  waiting time on the receive.
- After a stage's last backward action (its last B, or W where the backward is split) the executor
  calls `on_stage_backward_done(stage)`: FSDP reduce-scatters that stage's gradient and reshards its
  parameters there (runtime/execution/dimensions/dp.py), as torch's pipelining schedules
  `perform_reduce_grad` right after a stage's last backward, so a rank holding several stages
  (interleaved 1F1B) does not keep every stage's unsharded gradient until the step ends.

[Note: forward-only steps]
`run(..., forward_only=True)` (an evaluation: `PartitionedModel.evaluate`) walks the same list
without its backward (schedule/actions.py `forward_only`: F, SEND_F and RECV_F in the training
order, which cannot deadlock where the full list cannot) under `torch.no_grad()`: no autograd graph
is recorded, received values are not made leaves, and a micro-batch's state is dropped as soon as
its output is sent on (or its loss added), so nothing is kept for a backward. It leaves gradients
and `last_trace` (the last training step's) alone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoplan.graph.aux_loss import aux_loss_scale
from autoplan.runtime.execution.comm import P2P
from autoplan.runtime.parallel.split import StageSpec
from autoplan.schedule import make_schedule
from autoplan.schedule.actions import Action, ActionKind, forward_only

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["ActionRecord", "PipelineExecutor", "Stage", "build_executor"]


@dataclass
class Stage:
    """One virtual stage on this rank: its spec and its GraphModule."""

    spec: StageSpec
    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)
    runner: Callable[..., Any] | None = None
    """Runs the stage in place of `module` (recompute.RecomputeRunner: same inputs and outputs)."""

    split_backward: bool = True
    """Whether zb-h1's split backward (input gradients at B, weight gradients at W) is exact for this
    stage; see `splits_backward_exactly`. When not, B computes both and W does nothing."""

    def __post_init__(self) -> None:
        if not self.params:
            self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.split_backward = splits_backward_exactly(self.module)

    def __call__(self, *args: Any) -> Any:
        return (self.runner or self.module)(*args)


def splits_backward_exactly(module: nn.Module) -> bool:
    """False when a stage that receives gradients also computes a value from parameters alone (no
    input reaches it) and mixes it with input-dependent values or sends it on: T5's relative-position
    bias, looked up in one embedding table and added to every decoder layer's scores, or a decoder's
    token embedding (a lookup of integer ids) sent to the next stage. torch's split weight backward
    (`stage_backward_weight`) groups the weights by the intermediates next to them and clamps their
    gradients, which counts such a value's gradient wrongly (measured: a T5 bias table's gradient off
    by up to 10x under zb-h1). Views of a parameter (a linear's transposed weight) do not count, and a
    first stage, which receives no gradient, splits exactly (everything in it is parameter-only)."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return True
    from_inputs: set[str] = set()
    from_params: set[str] = set()
    computed: set[str] = set()  # parameter-only values that are more than a view of a parameter
    for node in graph.nodes:
        sources = node.all_input_nodes
        if not _differentiable(node):  # integer indices, shapes: no gradient flows through them
            continue
        if _carries_gradient(node) or any(a.name in from_inputs for a in sources):
            from_inputs.add(node.name)
        elif _is_parameter(module, node) or any(a.name in from_params for a in sources):
            from_params.add(node.name)
            if node.op != "get_attr" and (not _is_view(node) or any(a.name in computed for a in sources)):
                computed.add(node.name)
    if not from_inputs:
        return True
    mixed = (node for node in graph.nodes if node.op == "output" or node.name in from_inputs)
    return not any(a.name in computed for node in mixed for a in node.all_input_nodes)


_VIEW_METHODS = {"t", "transpose", "permute", "view", "reshape", "expand", "unsqueeze", "squeeze", "contiguous",
                 "to", "type_as", "float", "half", "bfloat16", "flatten", "unflatten", "__getitem__"}


def _is_view(node) -> bool:
    """A node that only reshapes, retypes or aliases its input (no new values to differentiate)."""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function":
        if getattr(node.target, "is_view", False):
            return True
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        return name in _VIEW_METHODS or name in ("_to_copy", "clone", "alias", "_unsafe_view")
    return False


def _differentiable(node) -> bool:
    """Whether a gradient can pass through the node's value: not an integer or boolean tensor, not a
    size (when the graph records values, as torch.export does; assumed so otherwise)."""
    if "val" not in node.meta:
        return True
    value = node.meta["val"]
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() or value.is_complex()
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in value)
    return False


def _is_parameter(module: nn.Module, node) -> bool:
    """A get_attr of a trainable parameter (buffers such as rotary tables take no gradient)."""
    if node.op != "get_attr":
        return False
    try:
        value = module.get_parameter(str(node.target))
    except AttributeError:
        return False
    return value.requires_grad


def _carries_gradient(node) -> bool:
    """A stage input a gradient can flow back to: any placeholder but integer ones (token ids,
    position buckets), when the graph records the value's dtype (torch.export does)."""
    if node.op != "placeholder":
        return False
    value = node.meta.get("val")
    return not isinstance(value, torch.Tensor) or value.is_floating_point()


@dataclass(frozen=True)
class ActionRecord:
    action: Action
    start_s: float
    end_s: float

    def __str__(self) -> str:
        return f"{self.action} {1e3 * (self.end_s - self.start_s):.3f} ms"


@dataclass
class _MicroBatchState:
    received: list[Any] = field(default_factory=list)
    """Values received for spec.recv (tensors requiring grad are leaves of this stage's graph)."""
    sent: list[Any] = field(default_factory=list)
    """Values for spec.send, or [scaled loss] on the last stage."""
    input_grads: list[torch.Tensor | None] = field(default_factory=list)
    param_groups: list | None = None


class PipelineExecutor:
    """Runs one rank's action list over its stages (see the module docstring)."""

    def __init__(self, stages: Mapping[int, Stage], actions: Sequence[Action], *, num_stages: int,
                 num_microbatches: int, rank_of_stage: Callable[[int], int], comm: P2P,
                 split_backward: bool, loss_scale: float | None = None,
                 on_weight_grads: Callable[[], None] | None = None):
        self.stages = dict(stages)
        self.actions = tuple(actions)
        self.forward_actions = forward_only(self.actions)
        """`actions` without the backward ([Note: forward-only steps])."""
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.rank_of_stage = rank_of_stage
        """Virtual stage -> global rank of the peer that runs it (same dp / tp coordinates)."""
        self.comm = comm
        self.split_backward = split_backward
        self.loss_scale = 1.0 / num_microbatches if loss_scale is None else loss_scale
        self.grad_scale = 1.0
        """fp16's dynamic loss scale (precision.py [Note: fp16 loss scaling]): the backward starts from
        the loss times it; the returned loss is not scaled by it."""
        self.last_trace: list[ActionRecord] = []
        self.on_weight_grads = on_weight_grads
        """Called after each W action (zb-h1), whose weight gradients autograd does not accumulate
        itself: mixed precision moves them to the fp32 masters (precision.py)."""
        self.on_action: Callable[[Action], None] | None = None
        """Called before each action (the launcher's heartbeat records where the rank is)."""
        self.on_stage_backward_done: Callable[[int], None] | None = None
        """Called with a stage's index right after its last backward action of a training step."""
        self._last_backward_at = _last_backward_indices(self.actions)
        self._forward_only = False

    # ------------------------------------------------------------------------------------------
    def run(self, microbatches: Sequence[Mapping[str, Any]], *, forward_only: bool = False) -> torch.Tensor | None:
        """One pipelined forward and backward over `microbatches` (model input name -> value).

        Gradients accumulate into the stages' `.grad`. Returns the summed scaled loss (the mean
        over micro-batches) on the rank holding the last stage, else None. With `forward_only`, the
        forward alone, without autograd and touching no gradient ([Note: forward-only steps]).
        """
        assert len(microbatches) == self.num_microbatches
        actions = self.forward_actions if forward_only else self.actions
        self._forward_only = forward_only
        self._data = microbatches
        self._state: dict[tuple[int, int], _MicroBatchState] = {}
        self._local_fwd: dict[tuple[int, int], list[Any]] = {}
        self._local_bwd: dict[tuple[int, int], list[Any]] = {}
        self._loss: torch.Tensor | None = None
        trace: list[ActionRecord] = []
        last_backward_at = {} if forward_only else self._last_backward_at
        handlers = {
            ActionKind.F: self._forward, ActionKind.B: self._backward, ActionKind.W: self._weight,
            ActionKind.SEND_F: self._send_f, ActionKind.RECV_F: self._recv_f,
            ActionKind.SEND_B: self._send_b, ActionKind.RECV_B: self._recv_b,
        }
        # Auxiliary losses inside the stages (graph/aux_loss.py) get the loss's own 1 / M.
        no_grad = torch.no_grad() if forward_only else contextlib.nullcontext()
        try:
            with aux_loss_scale(self.loss_scale * self.grad_scale), no_grad:
                for index, action in enumerate(actions):
                    if self.on_action is not None:
                        self.on_action(action)
                    start = time.perf_counter()
                    handlers[action.kind](action.stage, action.microbatch)
                    trace.append(ActionRecord(action, start, time.perf_counter()))
                    if self.on_stage_backward_done is not None and last_backward_at.get(action.stage) == index:
                        self.on_stage_backward_done(action.stage)
            self.comm.wait_sends()
        finally:
            self._forward_only = False
        if not forward_only:
            self.last_trace = trace
        self._state.clear()
        return self._loss

    # ------------------------------------------------------------------------------------------
    def _forward(self, s: int, m: int) -> None:
        stage = self.stages[s]
        spec = stage.spec
        state = self._state.setdefault((s, m), _MicroBatchState())
        if s > 0:
            if (s, m) in self._local_fwd:  # previous stage on this rank: a fresh leaf per stage
                raw = self._local_fwd.pop((s, m))
                state.received = [v.detach() if isinstance(v, torch.Tensor) else v for v in raw]
            # else: filled by RECV_F
            for cv, v in zip(spec.recv, state.received):
                if isinstance(v, torch.Tensor) and cv.requires_grad and not self._forward_only:
                    v.requires_grad_(True)
        env: dict[str, Any] = {cv.name: (v if cv.is_tensor else cv.constant) for cv, v in zip(spec.recv, state.received)}
        data = self._data[m]
        for name in spec.data_inputs:
            env[name] = data[name]
        out = stage(*[env[n] for n in spec.inputs])
        produced = dict(zip(spec.outputs, out if isinstance(out, (tuple, list)) else (out,)))
        if s == self.num_stages - 1:
            loss = produced[spec.outputs[0]] * self.loss_scale
            detached = loss.detach().float()  # a bf16 loss is summed over micro-batches in fp32
            self._loss = detached if self._loss is None else self._loss + detached
            if self._forward_only:  # nothing to run a backward from
                del self._state[(s, m)]
                return
            # fp32: an fp16 loss times the scale can pass fp16's range; its gradient S / M does not
            state.sent = [loss.float() * self.grad_scale if self.grad_scale != 1.0 else loss]
        else:
            state.sent = [produced[cv.name] if cv.name in produced else env[cv.name] for cv in spec.send]
            if self.split_backward and not self._forward_only:
                # torch's split backward detaches outputs in place, which a view refuses
                state.sent = [v.clone() if isinstance(v, torch.Tensor) and v._is_view() and v.requires_grad else v
                              for v in state.sent]
            if self.rank_of_stage(s + 1) == self.rank_of_stage(s):
                self._local_fwd[(s + 1, m)] = state.sent
                if self._forward_only:
                    del self._state[(s, m)]

    def _send_f(self, s: int, m: int) -> None:
        spec = self.stages[s].spec
        tensors = [v if cv.is_tensor else None for cv, v in zip(spec.send, self._state[(s, m)].sent)]
        self.comm.send("F", s, m, tensors, dst=self.rank_of_stage(s + 1))
        if self._forward_only:  # sent on: this micro-batch has no backward here
            del self._state[(s, m)]

    def _recv_f(self, s: int, m: int) -> None:
        spec = self.stages[s].spec
        state = self._state.setdefault((s, m), _MicroBatchState())
        state.received = self.comm.recv("F", s - 1, m, spec.recv, src=self.rank_of_stage(s - 1))

    def _recv_b(self, s: int, m: int) -> None:
        spec = self.stages[s].spec
        wanted = [cv if cv.requires_grad else None for cv in spec.send]
        self._local_bwd[(s, m)] = self.comm.recv("B", s + 1, m, wanted, src=self.rank_of_stage(s + 1))

    def _send_b(self, s: int, m: int) -> None:
        state = self._state[(s, m)]
        self.comm.send("B", s, m, state.input_grads, dst=self.rank_of_stage(s - 1))
        if state.param_groups is None:
            del self._state[(s, m)]

    def _backward(self, s: int, m: int) -> None:
        stage = self.stages[s]
        spec = stage.spec
        state = self._state[(s, m)]
        last = s == self.num_stages - 1
        grads_in = [None] if last else self._local_bwd.pop((s, m))
        inputs = [v if isinstance(v, torch.Tensor) and cv.requires_grad else None
                  for cv, v in zip(spec.recv, state.received)]
        input_ids = {id(v): i for i, v in enumerate(inputs) if v is not None}
        passthrough: list[tuple[int, torch.Tensor]] = []
        outputs: list[torch.Tensor] = []
        out_grads: list[torch.Tensor | None] = []
        for v, g in zip(state.sent, grads_in):
            if not isinstance(v, torch.Tensor) or not v.requires_grad:
                continue
            if id(v) in input_ids:  # forwarded unchanged (see [Note: crossing values] in split.py)
                if g is not None:
                    passthrough.append((input_ids[id(v)], g))
                continue
            if g is None and not last:
                continue
            outputs.append(v)
            # A gradient arrives in the wire dtype; backward wants the output's own.
            out_grads.append(g if g is None or g.dtype == v.dtype else g.to(v.dtype))
        leaves = [v for v in inputs if v is not None]
        if self.split_backward and stage.split_backward and leaves and outputs:
            from torch.distributed.pipelining._backward import stage_backward_input

            grads, state.param_groups = stage_backward_input(
                outputs, None if last else out_grads, leaves, iter(stage.params))
            grad_of = {id(v): g for v, g in zip(leaves, grads)}
        else:
            if outputs:
                torch.autograd.backward(outputs, None if last else out_grads)
            grad_of = {id(v): v.grad for v in leaves}
        input_grads: list[torch.Tensor | None] = [None] * len(inputs)
        for i, v in enumerate(inputs):
            if v is not None:
                g = grad_of.get(id(v))
                input_grads[i] = torch.zeros_like(v) if g is None else g
        for i, g in passthrough:
            input_grads[i] = input_grads[i] + g
        state.input_grads = input_grads
        state.sent = []
        if s > 0 and self.rank_of_stage(s - 1) == self.rank_of_stage(s):
            self._local_bwd[(s - 1, m)] = input_grads
        if (s == 0 or self.rank_of_stage(s - 1) == self.rank_of_stage(s)) and state.param_groups is None:
            del self._state[(s, m)]

    def _weight(self, s: int, m: int) -> None:
        state = self._state.get((s, m))
        if state is None or state.param_groups is None:
            return  # full backward already ran at B (first stage, or not split)
        from torch.distributed.pipelining._backward import stage_backward_weight

        # retain_graph: parameter groups can share part of the graph (T5's relative-position bias is
        # computed once from a parameter and used by every decoder layer of the stage); without it the
        # first group's gradient frees what the next one needs. The graph is freed with the state below.
        stage_backward_weight(iter(self.stages[s].params), state.param_groups, retain_graph=True)
        del self._state[(s, m)]
        if self.on_weight_grads is not None:
            self.on_weight_grads()


def _last_backward_indices(actions: Sequence[Action]) -> dict[int, int]:
    """Stage -> the index in `actions` of its last backward action (B, or W where the backward is
    split: W runs after its B)."""
    out: dict[int, int] = {}
    for index, action in enumerate(actions):
        if action.kind in (ActionKind.B, ActionKind.W):
            out[action.stage] = index
    return out


def build_executor(build: StageBuild, plan: Plan, layout: ParallelLayout, *, device: torch.device,
                   timeout: timedelta) -> PipelineExecutor:
    """The last step: the executor of this rank's list of the plan's schedule over its stages, with
    the p2p channels to its pipeline peers (sent in the compute dtype)."""
    schedule = make_schedule(plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
    return PipelineExecutor(
        build.stages, schedule.with_comms()[layout.pp_index], num_stages=plan.num_stages,
        num_microbatches=plan.num_microbatches, rank_of_stage=lambda s: layout.stage_rank[s],
        comm=P2P(device, plan.num_stages, plan.num_microbatches, timeout,
                 wire_dtype=None if build.compute_dtype == torch.float32 else build.compute_dtype),
        split_backward=schedule.split_backward(),
        on_weight_grads=None if build.precision is None else build.precision.flush_grads,
    )
