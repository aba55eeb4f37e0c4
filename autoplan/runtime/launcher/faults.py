"""Fault injection for tests: `run_plan(_fault=...)` (or the environment variable AUTOPLAN_FAULT),
entries separated by ';', each `KIND@RANK:STEP[:N]` with RANK a number or '*' (every rank):
- `raise@R:S`            rank R raises RuntimeError before step S (0-based)
- `kill@R:S`             rank R SIGKILLs itself before step S
- `hang@R:S`             rank R sleeps forever before step S (its peers' timeouts must fire)
- `stop@R:S`             rank R SIGSTOPs itself before step S (frozen, heartbeat included)
- `nan@R:S`              rank R makes one gradient element of its stage NaN in step S
- `nan-weight@R:S`       rank R makes one weight element of its stage NaN before step S (NaN loss)
- `kill-mid-step@R:S:N`  rank R SIGKILLs itself at its N-th (1-based) P2P transfer of step S
                         (or after its pipeline work of that step, if it has fewer)
- `kill-in-checkpoint@R:S`  rank R SIGKILLs itself halfway through writing its DCP data file
                         (`__R_0.distcp`) of the checkpoint of step S (S = steps completed)
- `slow-start@R:T`       rank R sleeps T seconds before joining the process group (a rank that
                         starts late: [Note: start-up and step timeouts])

Apart from the training loop (training.py), which asks `Fault.hits` where a fault may strike and
calls `inject` / `poison` / `sigkill_self`; `kill-in-checkpoint` strikes inside
checkpoint/save.py (`save_checkpoint(_kill_midway=True)`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

import torch

__all__ = ["FAULT_ENV", "Fault", "inject", "parse_faults", "poison", "sigkill_self"]

FAULT_ENV = "AUTOPLAN_FAULT"
_FAULT_KINDS = ("raise", "kill", "hang", "stop", "nan", "nan-weight", "kill-mid-step", "kill-in-checkpoint",
                "slow-start")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None  # None: every rank
    step: int
    n: int = 1

    def hits(self, kind: str, rank: int, step: int) -> bool:
        return self.kind == kind and self.step == step and (self.rank is None or self.rank == rank)


def parse_faults(text: str | None) -> tuple[Fault, ...]:
    faults = []
    for entry in (text or "").replace(",", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        try:
            kind, _, where = entry.partition("@")
            parts = where.split(":")
            if kind not in _FAULT_KINDS or len(parts) not in (2, 3):
                raise ValueError
            rank = None if parts[0] == "*" else int(parts[0])
            faults.append(Fault(kind, rank, int(parts[1]), int(parts[2]) if len(parts) == 3 else 1))
        except ValueError:
            raise ValueError(f"bad fault {entry!r} in {FAULT_ENV}; expected KIND@RANK:STEP[:N] with KIND one of "
                             f"{', '.join(_FAULT_KINDS)}") from None
    return tuple(faults)


def sigkill_self() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)

def inject(faults: tuple[Fault, ...], fail_at: tuple[int, int] | None, rank: int, step: int) -> None:
    """The faults that strike before a step (module docstring)."""
    if (fail_at is not None and fail_at == (rank, step)) or any(f.hits("raise", rank, step) for f in faults):
        raise RuntimeError(f"injected failure at step {step}")
    if any(f.hits("kill", rank, step) for f in faults):
        sigkill_self()
    if any(f.hits("stop", rank, step) for f in faults):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, threads included, until SIGCONT or SIGKILL
    if any(f.hits("hang", rank, step) for f in faults):
        while True:
            time.sleep(3600)


def poison(pm, what: str) -> None:
    """Faults `nan` and `nan-weight`: one element of a gradient (or a weight) of this rank's first
    stage becomes NaN."""
    for _, p in pm.named_parameters():
        tensor = p.grad if what == "grad" else p.data
        if tensor is not None:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            with torch.no_grad():
                local.view(-1)[0] = float("nan")
            return
