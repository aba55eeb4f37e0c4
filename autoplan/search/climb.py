"""Cutting under shared cores: a pattern search over stage boundaries on the simulated step.

Apart from the DP (partition.py) because its objective is not the DP's: where ranks share a
machine's cores the slowest stage does not bound the step, so the DP's cutting is only the start of
a local search scored by the simulation (search/evaluate.py calls it).

[Note: cutting under shared cores]
The DP minimizes the slowest stage, which is the step's bound when every rank has a device of its
own. Ranks that share a machine's cores (`1x4xcpu` on 2 cores) are not bound that way: a rank that
waits frees its core for the others, so the work gets done at the machine's pace, and the step
grows with the spans where fewer ranks than cores can run: the ramp-up and the ramp-down, which
are the first stage's forwards and backwards. The simulation with processor sharing
(cost/sharing.py) sees this and the slowest-stage objective does not: on the 256k-vocabulary gpt
over 4 ranks on 2 cores the DP's cutting simulated 7.75 s and parameter-balanced cuts (a light
first stage) 7.77 s, and parameter-balanced ran faster (8.5 s against 9.2 s measured). So under
sharing the DP's cutting is the start of a local search on the simulated step: move one boundary
by a step, keep a move that shortens the step, halve the step when none does (a pattern search,
Hooke and Jeeves 1961). The simulation is the objective, so the result is never worse than the
DP's cutting under the model.
"""

from __future__ import annotations

from collections.abc import Callable

from autoplan.search.stage_model import CutProblem, violations

__all__ = ["climb_boundaries"]


def climb_boundaries(problem: CutProblem, start: tuple[int, ...], step_time_s: Callable[[tuple[int, ...]], float],
                     *, max_evaluations: int = 400) -> tuple[tuple[int, ...], float]:
    """Pattern search from `start` on `step_time_s` over legal cuttings that fit in memory
    ([Note: cutting under shared cores]); returns the best cutting and its step time."""
    best = tuple(int(x) for x in start)
    best_s = step_time_s(best)
    step = max(1, problem.num_blocks // (2 * problem.num_stages))
    evaluations = 0
    while step >= 1 and evaluations < max_evaluations:
        improved = False
        for i in range(1, len(best) - 1):
            for delta in (-step, step):
                candidate = best[:i] + (best[i] + delta,) + best[i + 1:]
                if not candidate[i - 1] < candidate[i] < candidate[i + 1] or violations(problem, candidate):
                    continue
                seconds = step_time_s(candidate)
                evaluations += 1
                if seconds < best_s * (1 - 1e-9):
                    best, best_s, improved = candidate, seconds, True
        if not improved:
            step //= 2
    return best, best_s
