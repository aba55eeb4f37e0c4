"""Grouping a traced graph's nodes into blocks: the model's repeated layer stacks and the units
that become blocks of their own.

[Note: blocks]
A block is a contiguous run of graph nodes. The default granularity is the model's repeated
layer unit. Every layer stack is found (`find_layer_containers`: a `ModuleList`/`Sequential` whose
children, at least 2 and most of them, share one composite class), and each child of each stack
is one block: `layers.0`.. for a GPT, `encoder.block.*` and `decoder.block.*` for T5, the
bottlenecks `layer1.0`..`layer4.2` of a ResNet. The outermost stack wins (an MoE layer's `experts`
stay inside their layer), except that a stack of pure wrappers around stacks (HF ResNet's
`stages`, each holding only its `layers`) gives way to the stacks inside.
Everything before the first layer is one `embedding` block (a ResNet's stem). After it, every
distinct module outside the layers (final norm, head, T5's `decoder.embed_tokens`) starts a block
of its own, named by its shortest path that does not hold a stack (`encoder.final_layer_norm`).
Glue stays in the block before it: functional ops, code in a stack's ancestors (T5's mask
building in `decoder`), stateless modules (dropout, pooling) and modules called a second time
(T5's `decoder.dropout`); so a loss appended after the head lands in the head block. Modules
named in `leaf_modules` become blocks of their own too; one inside a layer replaces that layer
(finer units).

Apart from the tracers (graph/trace.py): every tracer's graph is grouped the same way, from the
module paths its nodes carry.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import torch.fx as fx
from torch import nn

from autoplan.graph.trace_errors import TraceError

__all__ = ["find_layer_container", "find_layer_containers", "group_blocks", "largest_stack", "placeable_units",
           "stateless_modules"]


def _is_layer_stack(module: nn.Module) -> bool:
    """A ModuleList/Sequential whose children (at least 2, most of them) share one composite class."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    if len(children) < 2:
        return False
    layer_class, count = Counter(type(c) for c in children).most_common(1)[0]
    # Require the repeated class to be a composite layer, not e.g. a Sequential of Linears+ReLUs.
    layer = next(c for c in children if type(c) is layer_class)
    return count >= 2 and count >= len(children) * 0.5 and any(True for _ in layer.children())


def find_layer_containers(model: nn.Module) -> list[str]:
    """Paths of the model's repeated layer stacks, in registration order (see [Note: blocks]).

    The outermost stack wins: stacks inside a layer (an MoE layer's experts) are not descended
    into. A stack of pure wrappers around stacks (HF ResNet's `stages`, each holding nothing but
    its `layers`) gives way to the stacks inside it."""
    stacks = {path for path, module in model.named_modules() if _is_layer_stack(module)}
    selected: list[str] = []

    def join(prefix: str, name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    def wraps_stacks(module: nn.Module, path: str) -> bool:
        for name, child in module.named_children():
            child_path = join(path, name)
            inner = [s for s in stacks if s == child_path or s.startswith(child_path + ".")]
            if not inner or not _params_inside(child, child_path, inner):
                return False
        return True

    def visit(module: nn.Module, path: str) -> None:
        if path in stacks and not wraps_stacks(module, path):
            selected.append(path)
            return
        for name, child in module.named_children():
            visit(child, join(path, name))

    visit(model, "")
    return selected


def _params_inside(module: nn.Module, path: str, stacks: list[str]) -> bool:
    """Every parameter of `module` (at `path`) lies inside one of `stacks`."""
    return all(any(f"{path}.{name}".startswith(s + ".") for s in stacks)
               for name, _ in module.named_parameters(remove_duplicate=False))


def find_layer_container(model: nn.Module) -> str | None:
    """The repeated layer stack with the most layers (the first on ties), or None.

    Kept for callers that want one stack; `find_layer_containers` lists all of them."""
    return largest_stack(model, find_layer_containers(model))


def largest_stack(model: nn.Module, containers: Sequence[str]) -> str | None:
    return max(containers, key=lambda path: len(model.get_submodule(path)), default=None)


def placeable_units(model: nn.Module, containers: Sequence[str], leaf_modules: Sequence[str]) -> list[str]:
    """Module paths that become blocks of their own (every stack's layers plus user-named leaves)."""
    units: list[str] = []
    for container in containers:
        prefix = f"{container}." if container else ""
        units += [f"{prefix}{name}" for name, _ in model.get_submodule(container).named_children()]
    for pattern in leaf_modules:
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        matched = [path for path, _ in model.named_modules() if path and regex.match(path)]
        if not matched:
            raise TraceError(f"leaf module '{pattern}' matches no module of the model; use a path such as 'layers.*.attention'")
        units += matched
    # A user leaf inside a layer replaces that layer as the unit (finer granularity).
    finer = set(units)
    return [u for u in units if not any(other != u and other.startswith(u + ".") for other in finer)]


def _node_module_path(node: fx.Node, tracer: str) -> str | None:
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0] or str(node.target)
    if tracer == "export":
        stack = node.meta.get("nn_module_stack")
        if stack:
            path = list(stack.values())[-1][0]
            return path or None
    return None


def _unit_of(path: str, units: list[str]) -> str | None:
    for unit in units:
        if path == unit or path.startswith(unit + "."):
            return unit
    return None


def _holds_stack(path: str, containers: Sequence[str]) -> bool:
    """`path` is a layer stack or an ancestor of one (its own code is glue between layers)."""
    return any(c == path or c.startswith(path + ".") for c in containers)


def _layer_of(path: str, containers: Sequence[str]) -> str | None:
    """The layer (a child of a stack) that `path` is in, or None."""
    for container in containers:
        prefix = f"{container}." if container else ""
        if path.startswith(prefix) and len(path) > len(prefix):
            return prefix + path[len(prefix):].split(".")[0]
    return None


def _owner_outside_layers(path: str, containers: Sequence[str]) -> str:
    """The shortest prefix of `path` that neither is a layer stack nor holds one."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if not _holds_stack(prefix, containers):
            return prefix
    return path


def stateless_modules(model: nn.Module) -> set[str]:
    """Paths of modules with no parameters and no buffers (dropout, activations, pooling)."""
    return {path for path, module in model.named_modules(remove_duplicate=False)
            if path and next(module.parameters(), None) is None and next(module.buffers(), None) is None}


def group_blocks(gm: fx.GraphModule, tracer: str, containers: Sequence[str], units: list[str],
                 stateless: set[str] = frozenset()):
    """Assign every node a block (see [Note: blocks]); returns (names, node_block, modules)."""
    names: list[str] = []
    modules: list[list[str]] = []
    node_block: dict[str, int] = {}
    seen_layer = False
    current: int | None = None
    current_owner: str | None = None
    deferred: list[fx.Node] = []  # get_attr nodes: they go with their first user

    def start(name: str) -> int:
        names.append(name)
        modules.append([])
        return len(names) - 1

    # Nodes inside a layer but outside the user's finer leaves (a pre-norm before `attention`) wait
    # here and join the next leaf if it is in the same layer, else the current block.
    pending: list[tuple[fx.Node, str | None]] = []

    def assign(node: fx.Node, block: int, path: str | None) -> None:
        node_block[node.name] = block
        if path is not None and (not modules[block] or modules[block][-1] != path):
            modules[block].append(path)

    def flush(block: int) -> None:
        for waiting, waiting_path in pending:
            assign(waiting, block, waiting_path)
        pending.clear()

    def layer_of(path: str) -> str | None:
        return _layer_of(path, containers)

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            deferred.append(node)
            continue
        path = _node_module_path(node, tracer)
        if path is not None and _holds_stack(path, containers):
            path = None  # glue code in the layers' parent module (reshapes, masks): stays in the current block
        unit = _unit_of(path, units) if path else None
        if unit is not None:
            seen_layer = True
            if current_owner != unit:
                pending_layer = layer_of(pending[0][1]) if pending and pending[0][1] else None
                new_block = start(unit)
                flush(new_block if pending_layer is not None and pending_layer == layer_of(unit) else current)
                current, current_owner = new_block, unit
            else:
                flush(current)
        elif path is not None and seen_layer and layer_of(path) is not None and units and layer_of(path) not in units:
            pending.append((node, path))
            continue
        elif pending:
            if path is None:
                pending.append((node, path))
                continue
            flush(current)
        if unit is None and path is not None and seen_layer:
            owner = _owner_outside_layers(path, containers)
            # A stateless module (dropout, pooling) or one called again (T5's `decoder.dropout`,
            # after the embedding and after the final norm) is glue: it stays in the current block.
            if current_owner != owner and owner not in stateless and owner not in names:
                current, current_owner = start(owner), owner
        elif unit is None and current is None:
            current, current_owner = start("embedding"), "embedding"
        assign(node, current, path)
    if pending:
        flush(current)

    if not names:
        raise TraceError("the traced graph has no operations")
    for node in deferred:
        users = [node_block[u.name] for u in node.users if u.name in node_block]
        node_block[node.name] = min(users) if users else 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node_block[node.name] = 0
        elif node.op == "output":
            node_block[node.name] = len(names) - 1
    _check_contiguous(gm, node_block)
    return names, node_block, modules


def _check_contiguous(gm: fx.GraphModule, node_block: dict[str, int]) -> None:
    last = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        block = node_block[node.name]
        if block < last:
            raise TraceError(
                f"graph node '{node.name}' belongs to an earlier block than the one before it; the model "
                "re-enters a layer after a later one ran, so blocks are not contiguous (name leaf modules to fix)"
            )
        last = block
