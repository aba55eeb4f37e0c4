"""`autoplan suggest --explain`: the best rejected configurations per reason, as a table.

The search records them (search/rejections.py [Note: recording rejections]); this module only
lays them out, and writes the line that counts what the search did.
"""

from __future__ import annotations

from rich.table import Table

from autoplan.search.rejections import REASONS
from autoplan.search.space import SearchResult

__all__ = ["rejections_table", "search_summary"]


def rejections_table(result: SearchResult) -> Table:
    """One row per kept rejection, reason by reason: the configuration, what it lacks (with figures)
    and, over memory, a change checked to fit (or that none of those tried does)."""
    counts = result.rejections.counts
    table = Table(title="why other configurations lost (the best few per reason)", title_justify="left")
    table.add_column("reason")
    table.add_column("configuration")
    table.add_column("why", overflow="fold")
    table.add_column("what would fit", overflow="fold")
    for reason, title in REASONS.items():
        kept = [r for r, _ in result.rejections.kept(reason)]
        for i, rejection in enumerate(kept):
            fix = rejection.fix or ("none of the changes tried fits (micro-batch 1, zero 3, full recompute, 2x pp, "
                                    "2x tp, where they apply)" if reason == "memory" else "")
            table.add_row(f"{title} ({counts[reason]:,})" if i == 0 else "", rejection.config, rejection.why, fix)
        if not kept and counts[reason]:
            table.add_row(f"{title} ({counts[reason]:,})", "", "(counted; none kept)", "")
    return table


def search_summary(result: SearchResult) -> str:
    """What the search did, in the numbers the JSON's `search` object holds under the same names."""
    counts = result.rejections.counts
    planned, listed = result.configs_planned, len(result.plans)
    # The count is the search's own (issue 43: derived from the rejections it read "0 gave a plan"
    # above the plan written); more can give a plan than the top k lists.
    gave = f"{planned:,} gave a plan" + (f" (the best {listed} listed)" if planned > listed else "")
    parts = [f"searched {_n(result.configs_considered, 'configuration')} (tp x pp x dp x micro-batch x schedule) in "
             f"{result.time_s:.2f} s: {gave}, {counts['bound']:,} pruned by a bound, {counts['memory']:,} over memory"]
    if counts["layout"]:
        parts.append(f"{counts['layout']:,} refused by the runtime")
    text = (", ".join(parts) + f"; {_n(result.configs_evaluated, 'memory variant')} (recompute x ZeRO/FSDP) cut and "
            "simulated")
    if counts["batch"]:
        text += f"; {_n(counts['batch'], 'split')} skipped (batch not divisible)"
    return text


def _n(count: int, noun: str) -> str:
    """"1 split", "2 splits"."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"
