"""Which modules of a model are stacks of experts (mixture-of-experts layers), from their shapes and
how they are called: the two expert contracts expert parallelism (runtime/parallel/experts.py) serves.

Both kinds say what they are by an integer attribute `num_experts` that every one of their own
parameters has as its first dimension (the expert), one of them at least a stack of matrices (3-D);
no class name is looked up, so a user's model opts in by the same facts. They differ in what their forward takes:

- grouped experts take tokens already grouped by expert: input (num_experts, tokens, ...) ->
  output of the same leading shape (torchtitan's `GroupedExperts`, the zoo's `GroupedExperts` under
  capacity routing). A rank keeps a slice of the experts and exchanges equal token groups.
- routed experts take the tokens with the router's choice: forward(tokens (T, H), expert indices
  (T, k), weights (T, k)) -> (T, H), each token's weighted sum over its k experts (transformers'
  `MixtralExperts`, `Qwen2MoeExperts`, `Qwen3MoeExperts`, `DeepseekV3Experts`, and the zoo's
  `RoutedExperts` under dropless routing). The runtime sends each (token, expert) copy to the rank
  holding that expert, in variable numbers (dropless).

A routed-experts module is told apart from a router (which also holds `num_experts` and a weight
whose first dimension is the expert) by its forward taking the three inputs. A graph traced by
torch.export inlines the module's forward; `inlined_call` finds its three inputs and its output
among the graph's nodes (their `nn_module_stack`), so the runtime can call the module there again.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

__all__ = ["InlinedCall", "expert_modules", "inlined_call", "inlined_expert_calls", "is_grouped_experts",
           "is_routed_experts", "routed_expert_modules"]


def _stacked_count(module: nn.Module) -> int | None:
    """The expert count every own parameter of `module` has as its first dimension, where one of
    them at least is a stack of matrices (3-D): a router's (num_experts, hidden) weight is not a
    stack of experts. None otherwise."""
    params = list(module.parameters(recurse=False))
    if not params or params[0].dim() < 2 or params[0].shape[0] < 2:
        return None
    count = int(params[0].shape[0])
    if all(p.dim() >= 2 and p.shape[0] == count for p in params) and any(p.dim() >= 3 for p in params):
        return count
    return None


def _stacked(module: nn.Module) -> bool:
    """`num_experts` (an int of 2 or more) is the stacked count of the module's parameters."""
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        return False
    return _stacked_count(module) == count


def _positional_inputs(module: nn.Module) -> int | None:
    """How many positional inputs the module's forward takes (None: any number, `*args`)."""
    try:
        params = inspect.signature(type(module).forward).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = [p.kind for p in params][1:]  # without self
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        # transformers' `use_experts_implementation` wraps forward as (*args, **kwargs): the
        # wrapped function (functools.wraps) says what it takes.
        wrapped = getattr(type(module).forward, "__wrapped__", None)
        if wrapped is None:
            return None
        kinds = [p.kind for p in inspect.signature(wrapped).parameters.values()][1:]
    return sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)


def is_routed_experts(module: nn.Module) -> bool:
    """Whether `module` holds routed experts (module docstring): stacked expert parameters and a
    forward of (tokens, expert indices, weights)."""
    return _stacked(module) and _positional_inputs(module) == 3


def is_grouped_experts(module: nn.Module) -> bool:
    """Whether `module` is a stack of grouped experts (module docstring): stacked expert parameters,
    and not routed experts."""
    return _stacked(module) and _positional_inputs(module) != 3


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every grouped-experts module of `model` by its path (none inside another)."""
    return {name: m for name, m in model.named_modules() if is_grouped_experts(m)}


def routed_expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every routed-experts module of `model` by its path."""
    return {name: m for name, m in model.named_modules() if is_routed_experts(m)}


@dataclass(frozen=True)
class InlinedCall:
    """One call of a routed-experts module as an inlined graph holds it."""

    tokens: fx.Node
    indices: fx.Node
    weights: fx.Node
    output: fx.Node
    nodes: tuple[fx.Node, ...]
    """Every node the call computes, in graph order (the parameters' get_attr nodes excluded)."""


def _module_calls(node: fx.Node, path: str) -> set[str]:
    """The keys of `node`'s module-stack entries for the module at `path` (a node inside one of
    its children has that entry too): one key per call of the module (torch.export names a second
    call `...@1`)."""
    return {key for key, entry in (node.meta.get("nn_module_stack") or {}).items() if entry[0] == path}


def inlined_call(gm: fx.GraphModule, path: str) -> InlinedCall | str | None:
    """The call of the routed-experts module at `path` in `gm`, where the graph inlines it
    (torch.export); None where no node of the graph runs inside it (a graph that calls it as a
    module, or does not call it); a one-line reason where its nodes do not form one call of three
    inputs and one output."""
    calls = {n: _module_calls(n, path) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    nodes = [n for n, keys in calls.items() if keys]
    if not nodes:
        return None
    times = len(set().union(*calls.values()))
    if times > 1:
        return f"'{path}' is called {times} times (expert parallelism exchanges the tokens of one call per module)"
    members = set(nodes)

    def external(arg: fx.Node) -> bool:
        return arg not in members and not (arg.op == "get_attr" and str(arg.target).startswith(path + "."))

    inputs: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if external(arg) and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in nodes if any(user not in members for user in n.users)]
    vals = [a.meta.get("val") for a in inputs]
    if any(v is None for v in vals):  # fx records no shapes
        return (f"the graph inlines '{path}' without the shapes of its inputs (fx); keep it whole with "
                f"--leaf-modules {path}")
    if len(inputs) != 3 or len(outputs) != 1 or not all(isinstance(v, torch.Tensor) for v in vals):
        return (f"'{path}' is called with {len(inputs)} tensors and gives {len(outputs)} "
                "(routed experts take tokens, expert indices and weights and give one tensor)")
    integer = [a for a, v in zip(inputs, vals) if not v.is_floating_point()]
    if len(integer) != 1:
        return f"'{path}' is called without one integer tensor of expert indices"
    indices = integer[0]
    shape = indices.meta["val"].shape
    floats = [a for a in inputs if a is not indices]
    weights = [a for a in floats if a.meta["val"].shape == shape]
    tokens = [a for a in floats if a.meta["val"].shape != shape]
    if len(weights) != 1 or len(tokens) != 1 or len(shape) != 2 or tokens[0].meta["val"].dim() != 2:
        return f"'{path}' is not called as (tokens (T, H), expert indices (T, k), weights (T, k))"
    return InlinedCall(tokens[0], indices, weights[0], outputs[0], tuple(nodes))


def inlined_expert_calls(gm: fx.GraphModule) -> dict[str, tuple[int, InlinedCall]]:
    """Path -> (expert count, call) of every routed-experts module `gm` inlines, found from the graph
    alone: torch.export keeps a module's parameters under its path but not its class or attributes,
    so the facts are its stacked parameters (the count) and a call of (tokens, expert indices,
    weights) giving one tensor."""
    found = {}
    for path, module in gm.named_modules():
        count = _stacked_count(module) if path else None
        if count is not None:
            call = inlined_call(gm, path)
            if isinstance(call, InlinedCall):
                found[path] = (count, call)
    return found
