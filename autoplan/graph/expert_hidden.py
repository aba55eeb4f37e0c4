"""Where the experts' hidden units are in a stacked-experts module (graph/experts.py), for expert
tensor parallelism (runtime/parallel/expert_tp.py [Note: expert tp]): read from the parameters' shapes,
checked on the module's own forward.

Which axis of a stacked-experts parameter holds the hidden units is read from the shapes: every
stacked (E, a, b) parameter has the model's width on one axis and the hidden units on the other; a
fused [gate | up] projection has twice the hidden units there (transformers' `gate_up_proj`, chunked
in two by the experts' forward), and its slice is the same 1/etp of each half. A (E, hidden) bias is
sliced with its units; a (E, width) bias, added after the down projection, would be added etp times
and is refused, as is an expert as wide as the model (no axis tells). The shapes alone leave two
readings when gate and up are (E, H, F) and down (E, F, H): H or F could be the width. Each reading
is checked numerically, once per module class and shapes, and the one kept is the one whose etp
slices' outputs sum to the whole module's output on random tokens (`check_hidden_split`). An expert
whose forward mixes its hidden units otherwise (an interleaved fused layout, a norm over the hidden
units) passes no reading and is refused in one line before anything runs, rather than trained wrong.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from autoplan.graph.experts import expert_modules, routed_expert_modules

__all__ = ["HiddenAxis", "check_hidden_split", "hidden_axes", "hidden_split_refusal", "slice_hidden"]


@dataclass(frozen=True)
class HiddenAxis:
    """Where a stacked-experts parameter holds the experts' hidden units."""

    axis: int
    chunks: int = 1
    """2 for a fused [gate | up] projection: each half is sliced alike."""


def _candidate_axes(module: nn.Module, path: str) -> list[dict[str, HiddenAxis]] | str:
    """Every assignment of hidden axes the shapes allow, one per candidate model width (a size every
    stacked parameter has on one of its axes past the experts'), or a one-line reason there is none."""
    params = dict(module.named_parameters(recurse=False))
    stacks = [p for p in params.values() if p.dim() == 3]
    shapes = ", ".join(f"{name} {tuple(p.shape)}" for name, p in params.items())
    widths = sorted(set.intersection(*(set(p.shape[1:]) for p in stacks))) if stacks else []
    out, reason = [], f"expert tp cannot tell the model width of '{path}' from its parameters ({shapes})"
    for width in widths:
        axes: dict[str, int] = {}
        for name, p in params.items():
            others = [a for a in range(1, p.dim()) if p.shape[a] != width]
            if p.dim() not in (2, 3) or len(others) != 1:
                if p.dim() == 3:
                    reason = (f"expert tp cannot tell which axis of '{path}.{name}' {tuple(p.shape)} holds the "
                              f"experts' hidden units (as many as the model's width, {width})")
                elif p.dim() == 2:
                    reason = (f"'{path}.{name}' {tuple(p.shape)} is a bias added after the experts' down projection, "
                              "which expert tp would add once per rank")
                else:
                    reason = f"expert tp cannot split '{path}.{name}' {tuple(p.shape)}"
                break
            axes[name] = others[0]
        else:
            hidden = min(params[name].shape[a] for name, a in axes.items())
            sizes = {params[name].shape[a] for name, a in axes.items()}
            if sizes <= {hidden, 2 * hidden}:
                out.append({name: HiddenAxis(a, params[name].shape[a] // hidden) for name, a in axes.items()})
            else:
                reason = f"expert tp cannot split '{path}' ({shapes}): hidden sizes {sorted(sizes)}"
    return out or reason


_RESOLVED: dict[tuple, dict[str, HiddenAxis] | str] = {}


def hidden_axes(module: nn.Module, path: str, etp: int, routed: bool) -> dict[str, HiddenAxis] | str:
    """Name -> `HiddenAxis` for every own parameter of the stacked-experts module at `path`: the
    assignment the shapes allow whose etp slices' outputs sum to the module's output
    (`check_hidden_split`), or a one-line reason there is none ([Note: expert tp]). Found once per
    module class and shapes (past the experts' axis, which ep slices)."""
    key = (type(module), etp, routed, tuple((n, tuple(p.shape[1:])) for n, p in module.named_parameters(recurse=False)))
    if key not in _RESOLVED:
        candidates = _candidate_axes(module, path)
        if isinstance(candidates, str):
            _RESOLVED[key] = candidates
        else:
            reasons = [check_hidden_split(module, path, axes, etp, routed) for axes in candidates]
            _RESOLVED[key] = next((axes for axes, why in zip(candidates, reasons) if why is None), reasons[0])
    return _RESOLVED[key]


def slice_hidden(tensor: torch.Tensor, where: HiddenAxis, index: int, etp: int) -> torch.Tensor:
    """Slice `index` of `etp` of the hidden units of `tensor` (of each half of a fused projection)."""
    parts = [part.chunk(etp, where.axis)[index] for part in tensor.chunk(where.chunks, where.axis)]
    return torch.cat(parts, where.axis) if len(parts) > 1 else parts[0]


_PROBE_EXPERTS = 2
"""Experts in the module the split is checked on: its parameters random, of the module's shapes but
for the experts' axis (the model's own may be on the meta device, or too large to copy)."""


def check_hidden_split(module: nn.Module, path: str, axes: dict[str, HiddenAxis], etp: int, routed: bool) -> str | None:
    """None when the module's output is the sum of its etp hidden slices' outputs on random tokens and
    random parameters of its shapes (in float32 on the CPU, with
    `_PROBE_EXPERTS` experts: a shallow copy whose `num_experts` says so, the contract of
    graph/experts.py, parameters substituted with `torch.func.functional_call`); else a one-line
    reason ([Note: expert tp])."""
    generator = torch.Generator().manual_seed(0)
    named = dict(module.named_parameters(recurse=False))
    params = {name: 0.1 * torch.randn(_PROBE_EXPERTS, *p.shape[1:], generator=generator, dtype=torch.float32)
              for name, p in named.items()}
    buffers = {name: torch.zeros(b.shape, dtype=b.dtype) if b.is_meta else b.detach().cpu()
               for name, b in module.named_buffers(recurse=False)}
    name, where = next((n, a) for n, a in axes.items() if named[n].dim() == 3)
    width = named[name].shape[3 - where.axis]
    probe = copy.copy(module)
    probe.num_experts = _PROBE_EXPERTS
    if routed:
        tokens = torch.randn(4, width, generator=generator, dtype=torch.float32)
        indices = torch.stack([torch.randperm(_PROBE_EXPERTS, generator=generator) for _ in range(4)])
        inputs = (tokens, indices, torch.rand(4, _PROBE_EXPERTS, generator=generator, dtype=torch.float32))
    else:
        inputs = (torch.randn(_PROBE_EXPERTS, 3, width, generator=generator, dtype=torch.float32),)
    try:
        whole = torch.func.functional_call(probe, {**params, **buffers}, inputs)
        summed = sum(torch.func.functional_call(
            probe, {**{n: slice_hidden(p, axes[n], i, etp) for n, p in params.items()}, **buffers}, inputs)
            for i in range(etp))
    except Exception as exc:  # the module's own code on slices: any failure is the refusal's reason
        return f"'{path}' does not run on 1/{etp} of its hidden units ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    # float32 (the experts' kernels may take nothing wider, e.g. grouped_mm): a sum of etp partial
    # products rounds differently, by about 1e-6 of the largest output; a wrong reading is off by O(1).
    if not torch.allclose(summed, whole, rtol=1e-3, atol=1e-4 * float(whole.abs().max())):
        return (f"the outputs of '{path}' on 1/{etp} of its hidden units do not sum to its output (its forward mixes "
                "hidden units, or a fused projection is not [gate | up])")
    return None


def hidden_split_refusal(model: nn.Module, etp: int, grouped: dict[str, nn.Module] | None = None) -> str | None:
    """Why the experts of `model` (its grouped-experts modules, or `grouped`, and its routed ones)
    cannot split their hidden units `etp` ways (one line), or None: no experts, a hidden axis the
    shapes and the check do not tell, or hidden units etp does not divide."""
    grouped = expert_modules(model) if grouped is None else grouped
    routed = routed_expert_modules(model)
    if not grouped and not routed:
        return "the model has no experts (graph/experts.py) to split"
    for modules, is_routed in ((grouped, False), (routed, True)):
        for path, module in modules.items():
            axes = hidden_axes(module, path, etp, is_routed)
            if isinstance(axes, str):
                return axes
            if any(p.shape[axes[name].axis] // axes[name].chunks % etp
                   for name, p in module.named_parameters(recurse=False)):
                return f"expert tp {etp} does not divide the hidden units of '{path}'"
    return None
