"""Compare autoplan's predictions with every published run in benchmarks/data/, fit the calibrations
to them, and gate CI on the recorded predictions.

The runs (autoplan/published.py): Megatron-LM SC'21 Table 1 (ten A100 runs, tp x pp x dp) and
modern_runs.json (FSDP on A100/H100 from torchtitan and llm-foundry, Megatron-Core MoE on H100),
each predicted at its published dimensions with the search's own evaluation. Reported per run, per
source and per regime: the in-sample error (the shipped calibrations, which `--write` fits to all
runs) and the leave-one-source-out error (fitted without the run's source: [Note: the published
fit] in autoplan/published.py), and whether the run fits in memory (a run that trained and is
declared out of memory is a false OOM).

    python benchmarks/validate_published.py                 # table, summaries, leave-one-source-out
    python benchmarks/validate_published.py --write         # refit on all runs, write the shipped files
    python benchmarks/validate_published.py --check ci/published_predictions.json    # the CI gate (fast)
    python benchmarks/validate_published.py --record ci/published_predictions.json   # after a deliberate refit
    python benchmarks/validate_published.py --write-doc-tables   # docs/cost-model.md's tables from the files

`--check` exits 1 when a run's predicted step time or memory moved past the recorded tolerance, a run
leaves its tolerance against the published figure, or a run that trained is declared out of memory.

How long: the plain run takes about 4 minutes on an idle 2-core machine and 15-20 minutes when other
work shares it (leave-one-source-out refits the calibrations five times, each to convergence); `--no-loso` and `--check`
take about 15 s; `--write` adds two full fits (about 5 minutes more). Progress ("predicting the
published runs: 12/27 rows", "leave-one-source-out 3/5: ...", fit iterations) goes to stderr.

Each run's table line is followed by what the run states and what its prediction assumed ("reduce fp32
(assumed: stack default)"): no prediction reads the published figure it is checked against
(autoplan/published.py [Note: the reduce dtype a published run implies]).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

from autoplan.cost.calibration import Calibration
from autoplan.published import (
    FIT_PARAMETERS,
    SETTING_REASONS,
    STACK_FIT_PARAMETERS,
    Prediction,
    PublishedRun,
    calibrations_for,
    chip,
    chosen_dimensions,
    fit,
    fit_stacks,
    load_runs,
    neutral,
    parameters_of,
    predict_all,
    run_gpus,
    run_settings,
    shipped_by_chip,
    stack_parameters_of,
    summary,
    unfitted_stacks,
)

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"megatron-sc21": (0.03, 0.06), "modern": (0.05, 0.12), "loso": 0.06, "moe": 0.15}
"""In-sample (median, worst) per file (issue 28) and the leave-one-source-out median (issue 28: 8%;
issue 40: 6%); the worst error of a mixture-of-experts run, predicted at its published layout (issue 31)."""
NOT_FITTED_REGIMES = ("MoE",)
"""Regimes left out of the dense fit. The mixture-of-experts runs ran Megatron-Core's stack: they fit
only that stack's two numbers (autoplan/published.py [Note: Megatron-Core's MoE stack], `fit_stacks`),
with every dense number held, so they move no dense run and no dense run moves them."""
TOLERANCE_NOTES = {
    "zoo_q235_tp2_ep8_fsdp": (
        "priced with the stack's fp32 gradient reduction since issue 40 removed the rule that chose bf16 from "
        "this row's own published step (autoplan/published.py [Note: the reduce dtype a published run "
        "implies]); its error is the honest figure, kept as its tolerance (plus 2 points) until FSDP at "
        "this scale is modelled better"),
}
"""Why a run's recorded tolerance is wider than its target, written beside it in the record."""
STEP_DRIFT = 0.02
"""The gate's tolerance on a run's predicted step time against the recorded one (relative)."""
MEMORY_DRIFT = 0.02
"""The same for its peak memory per GPU."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _rows(what: str):
    """A `predict_all` progress callback: "<what>: 12/27 rows" on stderr."""
    return lambda done, total: _log(f"{what}: {done}/{total} rows")


def _describe(cals: dict[str, Calibration]) -> str:
    values = parameters_of(cals)
    return ", ".join(f"{n} {v:.3f}" for n, v in zip(FIT_PARAMETERS, values, strict=True))


def _line(p: Prediction, loso: float | None) -> str:
    r = p.run
    dims = f"tp{r.pins['tp']} pp{r.pins['pp']} dp{r.pins['dp']}"
    if r.pins.get("ep", 1) > 1:
        dims += f" ep{r.pins['ep']}"
    if r.pins.get("cp", 1) > 1:
        dims += f" cp{r.pins['cp']}"
    held = "" if p.plan.fits else "  OUT OF MEMORY"
    left = f"{loso:>+9.1%}" if loso is not None else f"{'':>9}"
    return (f"{r.id:<27} {r.source:<16} {r.regime:<8} {dims:<22} {r.published_step_s:>9.3f} {p.step_s:>9.3f} "
            f"{p.error:>+7.1%} {left} {p.plan.predicted.peak_memory_bytes / 2**30:>6.1f}{held}")


def _settings_line(p: Prediction) -> str:
    """What the run states and what its prediction assumed, e.g. "reduce fp32 (assumed: stack default)"."""
    return f"  {p.run.id:<27} " + "; ".join(f"{name} {value} ({how})" for name, value, how in run_settings(p.run, p.plan))


def _group_summaries(predictions: list[Prediction], loso: dict[str, float], key) -> list[str]:
    groups: dict[str, list[Prediction]] = defaultdict(list)
    for p in predictions:
        groups[key(p.run)].append(p)
    out = []
    for name, members in groups.items():
        inside = summary([p.error for p in members])
        line = f"  {name:<18} {len(members):>2} runs  in-sample median {inside['median']:.1%} worst {inside['worst']:.1%}"
        held = [loso[p.run.id] for p in members if p.run.id in loso]
        if held:
            outside = summary(held)
            line += f"  | left out: median {outside['median']:.1%} worst {outside['worst']:.1%}"
        out.append(line)
    return out


def _rms(runs: list[PublishedRun], cals: dict[str, Calibration]) -> float:
    errors = [math.log(p.step_s / p.run.published_step_s) for p in predict_all(runs, calibrations_for(cals, run_gpus(runs)))]
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def leave_one_source_out(runs: list[PublishedRun], shipped: dict[str, Calibration]) -> tuple[dict[str, float], dict]:
    """Per run: its error when its source is left out of the fit. Also the fitted values per source."""
    errors: dict[str, float] = {}
    fitted: dict[str, list[float]] = {}
    sources = list(dict.fromkeys(r.source for r in runs))
    for index, source in enumerate(sources, 1):
        started = time.perf_counter()
        _log(f"leave-one-source-out {index}/{len(sources)}: refitting without {source} ...")
        kept = [r for r in runs if r.source != source and r.regime not in NOT_FITTED_REGIMES]
        held = [r for r in runs if r.source == source]
        # The in-sample fit's own procedure (two rounds of eight iterations) from the round figures:
        # one round of six stopped short (without llm-foundry the rms log error was still falling,
        # 0.063 against 0.035 converged, the A100 GEMM share at 0.629 against 0.674), so the
        # figure left out measured the optimizer's budget as much as the missing source.
        cals, _ = fit(kept, neutral(shipped))
        # A source with MoE runs: the Megatron-Core stacks' numbers from the other sources' MoE runs
        # alone; with none left, no fitted numbers at all (the chip's attention share, no host term).
        moe_kept = [r for r in runs if r.source != source and r.regime in NOT_FITTED_REGIMES]
        refit_stacks = any(r.regime in NOT_FITTED_REGIMES for r in held)
        if refit_stacks:
            cals = fit_stacks(moe_kept, cals) if moe_kept else unfitted_stacks(cals, [f for f in cals if f == "H100"])
        gpus = run_gpus(runs)
        for p in predict_all(held, calibrations_for(cals, gpus)):
            errors[p.run.id] = p.error
        fitted[source] = [float(v) for v in parameters_of(cals)] + (list(stack_parameters_of(cals))
                                                                    if refit_stacks and "H100" in cals else [])
        _log(f"leave-one-source-out {index}/{len(sources)}: left out {source}, refitted on {len(kept)} runs in "
             f"{time.perf_counter() - started:.0f} s")
    return errors, fitted


def _write_calibrations(cals: dict[str, Calibration], runs: list[PublishedRun]) -> None:
    sources = sorted({r.source for r in runs})
    note = (f"fitted by `python benchmarks/validate_published.py --write` to {len(runs)} published runs "
            f"(benchmarks/data/: {', '.join(sources)}); autoplan/published.py [Note: the published fit]")
    for family, cal in cals.items():
        path = ROOT / "autoplan" / "cost" / "calibrations" / f"{cal.gpu}.json"
        if not path.exists():
            continue
        old = json.loads(path.read_text())
        new = cal.to_dict()
        new["source"] = (f"{cal.gpu}: GEMM and flash-attention shares, overlap slowdown, network efficiency and FSDP "
                         f"host time per unit fitted to published runs; memory bandwidth and kernel floor as before")
        new["gemm"]["source"] = note
        used = any(chip(g.name) == family and r.stack not in ("llm-foundry", "megatron-lm-2021")
                   for r in runs for g in run_gpus([r]))
        kernel = ("FlashAttention-2 (torch's SDPA flash backend), within its published range on this chip "
                  "(autoplan/cost/calibration.py [Note: attention kernels])")
        new["attention"]["source"] = (note if used else (
            f"not fitted: no published run on this chip used {kernel.split(' (')[0]}; this project's block times "
            "measured on the GPU (benchmarks/fit_measured_blocks.py), forward and backward combined as the fit "
            "combines them (autoplan/published.py measured_start)")) + (
            f"; {kernel}; forward and backward share one value; causal work fraction 0.5 (flash attention skips "
            "masked tiles, Dao 2023)")
        new["memory"]["source"] = old["memory"].get("source", "")
        new["overlap"] = {"compute_slowdown": cal.overlap_slowdown, "source": note}
        new["network"] = {"efficiency": cal.network_efficiency, "source": note}
        new["fsdp"] = {"unit_overhead_s": cal.fsdp_unit_overhead_s, "source": note}
        if "measurements" in old:
            new["measurements"] = old["measurements"]
            new["source"] += ("; this project's block times measured on the GPU are kept under 'measurements' "
                              "(benchmarks/fit_measured_blocks.py, which fitted them alone: docs/cost-model.md)")
        path.write_text(json.dumps(new, indent=2) + "\n")
        _log(f"wrote {path.relative_to(ROOT)} ({family})")


def _write_stacks(cals: dict[str, Calibration]) -> None:
    """Write the fitted Megatron-Core stacks into the shipped calibration files, nothing else."""
    for family, cal in cals.items():
        path = ROOT / "autoplan" / "cost" / "calibrations" / f"{cal.gpu}.json"
        if not path.exists() or not any(name.startswith("megatron-core") for name in cal.stacks):
            continue
        data = json.loads(path.read_text())
        data.setdefault("stacks", {}).update({k: v for k, v in cal.stacks.items() if k.startswith("megatron-core")})
        path.write_text(json.dumps(data, indent=2) + "\n")
        _log(f"wrote the Megatron-Core stacks of {path.relative_to(ROOT)} ({family})")


def _doc_tables(text: str) -> str:
    """docs/cost-model.md's calibration tables (per GPU; attention kernels per stack; the numbers shared
    by both chips) rewritten from the shipped calibration files, everything else as it was.
    tests/test_cost_docs.py checks that the doc prints the shipped numbers."""
    import re

    from autoplan.cost.calibration import ATTENTION_SHARE_BOUNDS, shipped_calibrations

    cals = shipped_calibrations()
    chips = {"A100": cals["A100-SXM4-80GB"], "H100": cals["H100-SXM-80GB"]}

    def per_gpu(line: str) -> str:
        for cal in chips.values():
            if line.startswith(f"| {cal.gpu}"):
                cells = line.split("|")
                cells[2:7] = [f" {cal.gemm('bf16'):.3f} ",
                              f" {cal.attention_fwd_efficiency:.3f} / {cal.attention_bwd_efficiency:.3f} ",
                              f" {cal.causal_work_fraction:g} ", f" {cal.memory_bandwidth_efficiency:g} ",
                              f" {cal.kernel_floor_s * 1e6:g} us "]
                return "|".join(cells)
        return line

    def kernel_row(stack: str, label: str) -> str:
        shares, ranges, kernel = [], [], "-"
        for family, cal in chips.items():
            if stack != cal.stack and stack not in cal.stacks:
                shares.append("-")
                ranges.append("-")
                continue
            under = cal.for_stack(stack)
            kernel = under.attention_kernel
            bounds = ATTENTION_SHARE_BOUNDS.get((kernel, family))
            shares.append("-" if kernel == "unfused" else f"{under.attention_fwd_efficiency:.3f}")
            ranges.append("-" if bounds is None else f"{bounds[0]:.2f}-{bounds[1]:.2f}")
        return f"| `{stack}`{label} | {kernel} | {shares[0]} | {shares[1]} | {ranges[0]} | {ranges[1]} |"

    def replace_body(text: str, header: str, rows: list[str]) -> str:
        pattern = re.compile(r"(" + re.escape(header) + r"[^\n]*\n\|[- |]*\n)((?:\|[^\n]*\n)*)")
        return pattern.sub(lambda m: m.group(1) + "\n".join(rows) + "\n", text, count=1)

    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("| GPU | e_gemm (bf16) |"))
    for i in range(start + 2, start + 4):
        lines[i] = per_gpu(lines[i])
    text = "\n".join(lines)
    stacks = [("flash", " (default)"), ("torchtitan", " (as the default)"), ("llm-foundry", ""),
              ("megatron-core", ""), ("megatron-core-deepep", ""), ("megatron-lm-2021", ""), ("deepspeed", "")]
    text = replace_body(text, "| stack | attention kernel |", [kernel_row(*s) for s in stacks])
    a100 = chips["A100"]
    shared = f"| {a100.overlap_slowdown:.3f} | {a100.network_efficiency:.3f} | {a100.fsdp_unit_overhead_s * 1e3:.2f} |"
    return replace_body(text, "| overlap slowdown |", [shared])


def _records(predictions: list[Prediction]) -> dict:
    rows = {}
    for p in predictions:
        tolerance = (TARGETS["megatron-sc21"][1] if p.run.source == "megatron-sc21" else
                     TARGETS["moe"] if p.run.regime in NOT_FITTED_REGIMES else TARGETS["modern"][1])
        rows[p.run.id] = {
            "step_s": p.step_s, "peak_memory_gib": p.plan.predicted.peak_memory_bytes / 2**30, "fits": p.plan.fits,
            "micro_batch_size": p.plan.micro_batch_size, "virtual_stages": p.plan.virtual_stages,
            "published_step_s": p.run.published_step_s, "error": p.error,
            # A run outside the targets keeps its present error as its tolerance until the model
            # reaches it (docs/status.md says which and why), so the gate still catches drift.
            "tolerance": max(tolerance, abs(p.error) + 0.02),
        }
        if p.run.id in TOLERANCE_NOTES and abs(p.error) + 0.02 > tolerance:
            rows[p.run.id]["why"] = TOLERANCE_NOTES[p.run.id]
    return {"schema": 1, "step_drift": STEP_DRIFT, "memory_drift": MEMORY_DRIFT,
            "about": "predictions of the published runs under the shipped calibrations; regenerate with "
                     "`python benchmarks/validate_published.py --record ci/published_predictions.json` in the "
                     "commit that changes them, and say why in its message", "runs": rows}


def check(path: Path, runs: list[PublishedRun]) -> int:
    """The CI gate: predictions under the shipped calibrations against the recorded ones."""
    recorded = json.loads(path.read_text())
    rows = recorded["runs"]
    chosen = {r.id: {"micro_batch_size": rows[r.id]["micro_batch_size"], "virtual_stages": rows[r.id]["virtual_stages"]}
              for r in runs if r.id in rows and not r.fully_pinned}
    failures = []
    predictions = predict_all(runs, None, chosen, progress=_rows("checking the published runs"))
    for p in predictions:
        row = rows.get(p.run.id)
        if row is None:
            failures.append(f"{p.run.id}: no recorded prediction (record it with --record)")
            continue
        drift = p.step_s / row["step_s"] - 1
        memory = p.plan.predicted.peak_memory_bytes / 2**30
        mem_drift = memory / row["peak_memory_gib"] - 1
        if abs(drift) > recorded["step_drift"]:
            failures.append(f"{p.run.id}: predicted step {p.step_s:.3f} s moved {drift:+.1%} from the recorded "
                            f"{row['step_s']:.3f} s (tolerance {recorded['step_drift']:.0%})")
        if mem_drift > recorded["memory_drift"]:
            failures.append(f"{p.run.id}: predicted memory {memory:.1f} GiB grew {mem_drift:+.1%} from the recorded "
                            f"{row['peak_memory_gib']:.1f} GiB")
        if abs(p.error) > row["tolerance"]:
            failures.append(f"{p.run.id}: predicted {p.step_s:.3f} s is {p.error:+.1%} from the published "
                            f"{p.run.published_step_s:.3f} s (tolerance {row['tolerance']:.0%})")
        if not p.plan.fits and row["fits"]:
            failures.append(f"{p.run.id}: declared out of memory ({memory:.1f} GiB per GPU), but it trained")
    print(f"published-run gate: {len(predictions)} runs checked against {path}")
    for p in predictions:
        print("  " + _line(p, None))
    known = [p.run.id for p in predictions if not p.plan.fits and not rows.get(p.run.id, {}).get("fits", True)]
    if known:
        print(f"known false out-of-memory (recorded, docs/status.md): {', '.join(known)}")
    for f in failures:
        print(f"FAIL {f}")
    print(f"published-run gate: {'FAILED' if failures else 'passed'} ({len(failures)} problems)")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Takes about 4 minutes on an idle 2-core machine, 15-20 under load (--no-loso, --check: about "
               "15 s; --write: about 5 minutes more); progress on stderr.")
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument("--write", action="store_true", help="refit on all runs and write the shipped calibrations")
    parser.add_argument("--check", type=Path, help="gate against recorded predictions (exit 1 on drift)")
    parser.add_argument("--record", type=Path, help="write the recorded predictions for --check")
    parser.add_argument("--write-stacks", action="store_true",
                        help="refit only the Megatron-Core stacks' numbers on the MoE runs and write them")
    parser.add_argument("--no-loso", action="store_true", help="skip leave-one-source-out (faster)")
    parser.add_argument("--write-doc-tables", action="store_true",
                        help="rewrite docs/cost-model.md's calibration tables from the shipped files and exit")
    parser.add_argument("--json", type=Path, help="write every row and summary as JSON")
    args = parser.parse_args()
    if args.write_doc_tables:
        doc = ROOT / "docs" / "cost-model.md"
        doc.write_text(_doc_tables(doc.read_text()))
        print(f"rewrote the calibration tables of {doc.relative_to(ROOT)} from the shipped files")
        return 0
    runs = load_runs(args.data)
    if args.check:
        return check(args.check, runs)
    started = time.perf_counter()
    shipped = shipped_by_chip(runs)
    print(f"shipped calibrations: {_describe(shipped)}")
    fitted_runs = [r for r in runs if r.regime not in NOT_FITTED_REGIMES]
    print(f"dense numbers fitted to {len(fitted_runs)} of {len(runs)} runs; the {', '.join(NOT_FITTED_REGIMES)} runs fit only "
          "the Megatron-Core stacks' numbers")
    if args.write:
        # From the round figures (and measured shares) leave-one-source-out starts from, and from
        # the shipped numbers: the better of the two fits (the objective has local minima where a
        # cutting or a chosen micro-batch size changes).
        candidates = [fit(fitted_runs, start, progress=_log)[0] for start in (neutral(shipped), shipped)]
        shipped = min(candidates, key=lambda cals: _rms(fitted_runs, cals))
        _write_calibrations(shipped, fitted_runs)
        print(f"fitted on {len(fitted_runs)} runs: {_describe(shipped)}")
    if args.write or args.write_stacks:
        shipped = fit_stacks([r for r in runs if r.regime in NOT_FITTED_REGIMES], shipped, progress=_log)
        _write_stacks(shipped)
    print("Megatron-Core stacks (MoE runs): " + ", ".join(
        f"{n} {v:.3g}" for n, v in zip(STACK_FIT_PARAMETERS, stack_parameters_of(shipped), strict=True)))
    gpus = run_gpus(runs)
    first = predict_all(runs, calibrations_for(shipped, gpus), progress=_rows("predicting the published runs"))
    predictions = predict_all(runs, calibrations_for(shipped, gpus), chosen_dimensions(first))
    loso, fitted = ({}, {}) if args.no_loso else leave_one_source_out(runs, shipped)

    print(f"{'run':<27} {'source':<16} {'regime':<8} {'dimensions':<22} {'published':>9} {'predicted':>9} "
          f"{'error':>7} {'left out':>9} {'GiB':>6}")
    for p in predictions:
        print(_line(p, loso.get(p.run.id)))
    print("what each run states, and what was assumed (autoplan/published.py [Note: the reduce dtype a "
          "published run implies]):")
    for p in predictions:
        print(_settings_line(p))
    for reason, meaning in SETTING_REASONS.items():
        print(f"  assumed: {reason} = {meaning}")
    print("per source:")
    print("\n".join(_group_summaries(predictions, loso, lambda r: r.source)))
    print("per regime:")
    print("\n".join(_group_summaries(predictions, loso, lambda r: r.regime)))
    print("per GPU:")
    print("\n".join(_group_summaries(predictions, loso, lambda r: chip(r.cluster.split("x")[-1]))))
    sc21 = summary([p.error for p in predictions if p.run.source == "megatron-sc21"])
    modern = summary([p.error for p in predictions if p.run.source != "megatron-sc21"
                      and p.run.regime not in NOT_FITTED_REGIMES])
    moe = summary([p.error for p in predictions if p.run.regime in NOT_FITTED_REGIMES])
    # Two decimals where a figure meets its target: 3.05% must not print as "3.0%" beside "3%".
    print(f"Megatron-LM SC'21 in-sample: median {sc21['median']:.2%}, worst {sc21['worst']:.2%} "
          f"(targets {TARGETS['megatron-sc21'][0]:.0%}, {TARGETS['megatron-sc21'][1]:.0%})")
    print(f"modern runs in-sample (fitted regimes): median {modern['median']:.2%}, worst {modern['worst']:.2%} "
          f"(targets {TARGETS['modern'][0]:.0%}, {TARGETS['modern'][1]:.0%})")
    if moe:
        within = sum(abs(p.error) <= TARGETS["moe"] for p in predictions if p.run.regime in NOT_FITTED_REGIMES)
        print(f"mixture-of-experts runs at their published layouts (Megatron-Core stacks): median {moe['median']:.1%}, worst "
              f"{moe['worst']:.1%}, {within} of {moe['count']} within {TARGETS['moe']:.0%} (target: all)")
    if loso:
        held = summary(list(loso.values()))
        print(f"leave-one-source-out: median {held['median']:.2%}, worst {held['worst']:.2%} "
              f"(target median {TARGETS['loso']:.0%})")
        for source, values in fitted.items():
            names = [*FIT_PARAMETERS, *(f"megatron-core.{n}" for n in STACK_FIT_PARAMETERS)]
            print(f"  fitted without {source}: " + ", ".join(f"{n} {v:.3g}" for n, v in zip(names, values)))
    false_oom = [p.run.id for p in predictions if not p.plan.fits]
    print(f"every run answered: {len(predictions)}/{len(runs)}; false out-of-memory: {len(false_oom)}"
          + (f" ({', '.join(false_oom)})" if false_oom else ""))
    print(f"took {time.perf_counter() - started:.0f} s")
    if args.record:
        args.record.write_text(json.dumps(_records(predictions), indent=2) + "\n")
        print(f"recorded {len(predictions)} predictions in {args.record}")
    if args.json:
        args.json.write_text(json.dumps({
            "calibrations": {k: v.to_dict() for k, v in shipped.items()},
            "runs": [{"id": p.run.id, "source": p.run.source, "regime": p.run.regime, "published_step_s":
                      p.run.published_step_s, "predicted_step_s": p.step_s, "error": p.error,
                      "loso_error": loso.get(p.run.id), "fits": p.plan.fits,
                      "peak_memory_gib": p.plan.predicted.peak_memory_bytes / 2**30,
                      "micro_batch_size": p.plan.micro_batch_size, "virtual_stages": p.plan.virtual_stages}
                     for p in predictions],
            "loso_fitted": fitted}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
