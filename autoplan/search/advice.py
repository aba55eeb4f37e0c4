"""What to tell a user when no plan fits (issue 29): by how much the closest configuration is over
memory, and only advice that helps, each checked under the model before it is given: a change
to the closest configuration that fits (evaluated), a pin whose removal lets a plan fit, or a
cluster size that fits (searched, `advise=False` so that these searches do not advise in turn).

Called by search/space.py only once a search has found nothing; never on the search's fast path. The
search that checks the advice is passed in (`search`: space.search_plans), so that this module reads
the configurations from search/configs.py and never imports space.py back (issue 30: no import circle).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from autoplan.cluster import Cluster, NodeGroup
from autoplan.cost.memory import MIN_BYTES_PER_PARAM, allowance_bytes, block_static_bytes
from autoplan.search.bounds import min_gpus_needed
from autoplan.search.configs import base_configs, frugal_config, memory_fix, shardings
from autoplan.search.context import SearchContext
from autoplan.search.evaluate import min_memory_bytes

__all__ = ["no_plan_message"]

_CLOSEST = 3
"""Configurations (the least static memory per GPU first) whose memory need is measured."""
_BUDGET_S = 10.0
"""Seconds the checking searches may take together; advice past it is left out, not guessed."""


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}"


def _closest(ctx: SearchContext, pins: dict, sp_allowed: bool):
    """(need bytes, configuration): the configuration the pins allow that needs the least memory per
    GPU in its most frugal memory option, among the `_CLOSEST` with the least static bytes."""
    profile, cluster, job = ctx.profile, ctx.cluster, ctx.job
    statics = []
    for cfg in base_configs(profile, cluster, job, pins):
        if not shardings(cfg, pins, cluster.gpus_per_node, profile):
            continue
        frugal = frugal_config(cfg, pins, sp_allowed, cluster.gpus_per_node, profile)
        statics.append((float(block_static_bytes(profile, frugal, job.dtype).sum()) / cfg.pp, len(statics), frugal))
    statics.sort(key=lambda e: e[:2])
    best = None
    for _, _, cfg in statics[:_CLOSEST]:
        need = min_memory_bytes(ctx, cfg)
        if need is None:
            continue
        if best is None or need < best[0]:
            best = (need, cfg)
    return best


def _bigger(cluster: Cluster, num_nodes: int) -> Cluster | None:
    if not cluster.is_homogeneous:
        return None
    gpu = cluster.gpu
    return dataclasses.replace(cluster, name=f"{num_nodes}x{cluster.gpus_per_node}x{gpu.name}",
                               groups=(NodeGroup(num_nodes, cluster.gpus_per_node, gpu),))


def _plan_line(plan) -> str:
    # dp as the table shows it (the replicas; `plan.dp` also counts cp ranks), cp its own degree.
    cp = f" cp {plan.cp}" if plan.cp > 1 else ""
    return (f"tp {plan.tp} pp {plan.pp} dp {plan.replicas}{cp}, micro-batch {plan.micro_batch_size}, {plan.schedule}, recompute "
            f"{plan.recompute}, zero {plan.zero}: {plan.predicted.step_time_s:.4g} s per step, "
            f"{plan.predicted.peak_memory_bytes / 2**30:.1f} GiB per GPU")


def _fits_on_more_gpus(ctx: SearchContext, cluster: Cluster, pins: dict, at_least: int,
                       deadline: float, search: Callable[..., Any]) -> str | None:
    """The smallest cluster of this GPU (whole nodes, at least `at_least` GPUs, up to 8x) on which a
    search finds a plan, as advice; None when none was found in time."""
    per_node = cluster.gpus_per_node
    nodes = max(cluster.num_nodes + 1, math.ceil(at_least / per_node))
    while nodes <= 8 * max(cluster.num_nodes, math.ceil(at_least / per_node)) and time.perf_counter() < deadline:
        bigger = _bigger(cluster, nodes)
        if bigger is None:
            return None
        unpinnable = {k: v for k, v in pins.items() if k not in ("dp",)}  # dp follows the GPU count
        try:
            result = search(ctx.profile, bigger, ctx.job, model_spec=ctx.model_spec, top=1,
                            pins=unpinnable, calibrations=ctx.calibrations, advise=False)
        except ValueError:
            nodes *= 2
            continue
        return f"use {nodes * per_node} GPUs (--cluster {bigger.name}: {_plan_line(result.plans[0])})"
    return None


def _fits_without_a_pin(ctx: SearchContext, cluster: Cluster, pins: dict, deadline: float,
                        search: Callable[..., Any]) -> str | None:
    """A pin whose removal lets a plan fit on this cluster, with that plan; None when none does."""
    for key in sorted(pins):
        if time.perf_counter() > deadline:
            return None
        relaxed = {k: v for k, v in pins.items() if k != key}
        try:
            result = search(ctx.profile, cluster, ctx.job, model_spec=ctx.model_spec, top=1,
                            pins=relaxed, calibrations=ctx.calibrations, advise=False)
        except ValueError:
            continue
        flag = "--" + key.replace("_", "-")
        return f"without {flag} a plan fits ({_plan_line(result.plans[0])})"
    return None


def no_plan_message(ctx: SearchContext, cluster: Cluster, pins: dict, sp_allowed: bool, advise: bool, *,
                    search: Callable[..., Any]) -> str:
    """The one-line error when no plan fits: the figure by which the closest configuration is over,
    and the checked advice (module docstring). `cluster`: as the user gave it (the context's has the
    calibrated network efficiency applied, which a new search applies again). `search`: the search
    that checks the advice (space.search_plans)."""
    profile, job = ctx.profile, ctx.job
    deadline = time.perf_counter() + _BUDGET_S
    gpu = min(cluster.gpu_types, key=lambda g: g.mem_bytes)
    capacity = gpu.mem_bytes
    need_gpus = min_gpus_needed(profile, job.dtype, gpu.mem_bytes, allowance_bytes(gpu))
    where = f"{cluster.num_gpus} x {gpu.name} ({capacity / 2**30:.1f} GiB)"
    per_param = MIN_BYTES_PER_PARAM(job.dtype)
    if need_gpus > cluster.num_gpus and "dp" not in pins:
        # Weights, gradients and optimizer states fully sharded over every GPU do not fit: no batch,
        # sequence, recompute or pin can help, only more (or larger) GPUs.
        text = (f"{profile.model_name} does not fit on {where} in any plan: it needs at least {need_gpus} GPUs of "
                f"this type for its weights, gradients and optimizer states alone "
                f"({profile.num_params * per_param / 2**30:,.0f} GiB: {_fmt_count(profile.num_params)} parameters x "
                f"{per_param:g} bytes, fully sharded with zero 3), which a smaller batch or sequence does not change")
        more = _fits_on_more_gpus(ctx, cluster, pins, need_gpus, deadline, search) if advise else None
        return text + (f"; {more}" if more else f"; use at least {need_gpus} GPUs")
    closest = _closest(ctx, pins, sp_allowed)
    parts = []
    if pins:
        pinned = ", ".join(f"{k}={v}" for k, v in sorted(pins.items()))
        parts.append(f"no plan with {pinned} fits {where}")
    else:
        parts.append(f"{profile.model_name} does not fit on {where} in any plan")
    if closest is not None:
        need, cfg = closest
        parts.append(f"the closest, {cfg.describe()}, needs about {need / 2**30:.1f} GiB per GPU "
                     f"({(need - capacity) / 2**30:.1f} GiB over)")
    if advise:
        fix = memory_fix(ctx, closest[1], pins, sp_allowed) if closest is not None else None
        if fix is not None:
            parts.append(f"with {fix[0]}")
        else:
            relaxed = _fits_without_a_pin(ctx, cluster, pins, deadline, search) if pins else None
            more = None if relaxed else _fits_on_more_gpus(ctx, cluster, pins, cluster.num_gpus + 1, deadline, search)
            if relaxed or more:
                parts.append(relaxed or more)
            elif time.perf_counter() >= deadline:  # the searches stopped early: say so, do not guess
                parts.append(f"no pin removal or larger cluster was found to fit within the {_BUDGET_S:.0f} s "
                             "spent looking")
            else:
                parts.append("no pin removal or cluster up to 8x this size was found to fit")
    return "; ".join(parts)
