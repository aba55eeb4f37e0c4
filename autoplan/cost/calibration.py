"""Calibrations: what one GPU type achieves, as numbers the operator-level time model reads.

A `Calibration` holds, for one GPU type, the parameters of `cost/ops.py`: the GEMM's achieved share
of peak per dtype, flash attention's forward and backward share, the achieved memory bandwidth and
the per-kernel floor of memory-bound operators, and optionally the measured collective curves of the
links (`cluster/collectives.py`). Every section says where its numbers come from (`source`): measured
by `autoplan calibrate` on that GPU, fitted by this project to published runs, or assumed.

The package ships one file per GPU it knows (`autoplan/cost/calibrations/*.json`); `autoplan
calibrate` writes the same format, and `autoplan suggest --calibration FILE` uses it in place of the
shipped one for that GPU type. A GPU type without a file gets `default_calibration(gpu)`, which
assumes and says so.

File format (JSON, `schema` 1):

    {"schema": 1, "gpu": "H100-SXM-80GB", "source": "...",
     "gemm": {"efficiency": {"bf16": 0.78, ...}, "source": "..."},
     "attention": {"fwd_efficiency": 0.5, "bwd_efficiency": 0.4, "causal_work_fraction": 0.5, "source": "..."},
     "memory": {"bandwidth_efficiency": 0.8, "kernel_floor_s": 4e-6, "source": "..."},
     "collectives": {...},           # optional, read by cluster/collectives.py
     "measurements": {...}}          # optional: the raw points `autoplan calibrate` measured, with spread
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from autoplan._files import read_json
from autoplan.cluster import GPU

__all__ = ["CALIBRATION_SCHEMA", "Calibration", "CalibrationError", "Calibrations", "default_calibration",
           "load_calibration", "shipped_calibrations"]

CALIBRATION_SCHEMA = 1


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class Calibration:
    """The achieved rates of one GPU type (see the module docstring and cost/ops.py)."""

    gpu: str
    """`GPU.name` this calibration describes."""
    gemm_efficiency: dict[str, float]
    """Achieved share of dense peak of a large GEMM, per dtype key (`cluster.DTYPE_KEYS`); a dtype
    missing here uses the largest one given."""
    attention_fwd_efficiency: float
    """Share of dense peak a fused attention forward reaches on the FLOPs it does."""
    attention_bwd_efficiency: float
    """The same for its backward (which recomputes the scores: Dao 2023, FlashAttention-2, Sec. 3.1)."""
    causal_work_fraction: float
    """Share of the full s x s score work a causal attention kernel does: about 1/2 for flash
    attention, which skips masked tiles (Dao 2023, Sec. 3.1.1); 1 for an unfused kernel that masks
    after computing every score."""
    memory_bandwidth_efficiency: float
    """Achieved share of `GPU.mem_bw_bytes_per_s` of a streaming (memory-bound) kernel."""
    kernel_floor_s: float
    """Shortest time any kernel takes (launch and tail), seconds."""
    collectives: dict[str, Any] = field(default_factory=dict)
    """Measured collective curves per link kind (cluster/collectives.py reads them); empty: the
    cluster's own link figures."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each section's numbers come from: keys `gemm`, `attention`, `memory`, `collectives`, and
    `file` for the whole file."""
    measurements: dict[str, Any] = field(default_factory=dict, compare=False)
    """Raw points behind a measured calibration (shapes, medians, spread), kept for the record."""

    def gemm(self, dtype_key: str) -> float:
        if dtype_key in self.gemm_efficiency:
            return self.gemm_efficiency[dtype_key]
        return max(self.gemm_efficiency.values())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": CALIBRATION_SCHEMA,
            "gpu": self.gpu,
            "source": self.sources.get("file", ""),
            "gemm": {"efficiency": dict(self.gemm_efficiency), "source": self.sources.get("gemm", "")},
            "attention": {"fwd_efficiency": self.attention_fwd_efficiency,
                          "bwd_efficiency": self.attention_bwd_efficiency,
                          "causal_work_fraction": self.causal_work_fraction,
                          "source": self.sources.get("attention", "")},
            "memory": {"bandwidth_efficiency": self.memory_bandwidth_efficiency,
                       "kernel_floor_s": self.kernel_floor_s, "source": self.sources.get("memory", "")},
        }
        if self.collectives:
            out["collectives"] = {**self.collectives, "source": self.sources.get("collectives", "")}
        if self.measurements:
            out["measurements"] = self.measurements
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "calibration") -> Calibration:
        def section(name: str) -> dict[str, Any]:
            value = data.get(name)
            if not isinstance(value, dict):
                raise CalibrationError(f"{where}: missing section {name!r}; write one as `autoplan calibrate` does")
            return value

        def fraction(sec: str, key: str, value: Any, upper: float = 1.0) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= upper:
                raise CalibrationError(f"{where}: {sec}.{key} must be a number in (0, {upper:g}], got {value!r}")
            return float(value)

        if data.get("schema") != CALIBRATION_SCHEMA:
            raise CalibrationError(f"{where}: schema {data.get('schema')!r} is not {CALIBRATION_SCHEMA}; "
                                   "re-run `autoplan calibrate` with this version")
        if not isinstance(data.get("gpu"), str) or not data["gpu"]:
            raise CalibrationError(f"{where}: 'gpu' must name the GPU type (e.g. \"H100-SXM-80GB\")")
        gemm, attention, memory = section("gemm"), section("attention"), section("memory")
        efficiency = gemm.get("efficiency")
        if not isinstance(efficiency, dict) or not efficiency:
            raise CalibrationError(f"{where}: gemm.efficiency must map dtypes to fractions, e.g. {{\"bf16\": 0.7}}")
        floor = memory.get("kernel_floor_s")
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor < 1:
            raise CalibrationError(f"{where}: memory.kernel_floor_s must be seconds in [0, 1), got {floor!r}")
        collectives = dict(data.get("collectives") or {})
        sources = {"file": str(data.get("source", "")), "gemm": str(gemm.get("source", "")),
                   "attention": str(attention.get("source", "")), "memory": str(memory.get("source", "")),
                   "collectives": str(collectives.pop("source", ""))}
        return cls(
            gpu=data["gpu"],
            gemm_efficiency={k: fraction("gemm.efficiency", k, v) for k, v in efficiency.items()},
            attention_fwd_efficiency=fraction("attention", "fwd_efficiency", attention.get("fwd_efficiency")),
            attention_bwd_efficiency=fraction("attention", "bwd_efficiency", attention.get("bwd_efficiency")),
            causal_work_fraction=fraction("attention", "causal_work_fraction",
                                          attention.get("causal_work_fraction", 1.0)),
            memory_bandwidth_efficiency=fraction("memory", "bandwidth_efficiency", memory.get("bandwidth_efficiency")),
            kernel_floor_s=float(floor),
            collectives=collectives,
            sources=sources,
            measurements=dict(data.get("measurements") or {}),
        )

    def replace(self, **changes: Any) -> Calibration:
        return dataclasses.replace(self, **changes)


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file; a missing or malformed one raises CalibrationError (one line)."""
    path = Path(path)
    data = read_json(path, "calibration file", CalibrationError, f"write one with `autoplan calibrate --out {path}`")
    if not isinstance(data, dict):
        raise CalibrationError(f"calibration file {path}: expected a JSON object")
    return Calibration.from_dict(data, where=str(path))


def shipped_calibrations() -> dict[str, Calibration]:
    """The calibrations packaged with autoplan, by GPU name."""
    out = {}
    folder = resources.files("autoplan.cost") / "calibrations"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            cal = Calibration.from_dict(json.loads(entry.read_text()), where=f"autoplan/cost/calibrations/{entry.name}")
            out[cal.gpu] = cal
    return out


_SHIPPED: dict[str, Calibration] | None = None

_SAME_CHIP = {"H200": "H100"}
"""GPU families built on another's chip (H200: the H100's GH100 with more and faster HBM)."""


def default_calibration(gpu: GPU) -> Calibration:
    """The shipped calibration of `gpu`'s type, else one of the same chip (an A100-40GB uses the
    A100-80GB file, an H200 the H100's), else assumed figures, marked as such."""
    global _SHIPPED
    if _SHIPPED is None:
        _SHIPPED = shipped_calibrations()
    if gpu.name in _SHIPPED:
        return _SHIPPED[gpu.name]
    family = _SAME_CHIP.get(gpu.name.split("-")[0], gpu.name.split("-")[0])
    for name, cal in _SHIPPED.items():
        if name.split("-")[0] == family:
            return cal.replace(gpu=gpu.name, sources={**cal.sources, "file": f"{cal.sources.get('file', '')} "
                                                      f"(the {name} calibration, same chip)"})
    return _assumed(gpu)


def _assumed(gpu: GPU) -> Calibration:
    """No measurement for this GPU type: the A100 fit's GEMM share and typical streaming and
    launch figures. Run `autoplan calibrate` on the device to replace them."""
    note = f"assumed for {gpu.name} (no calibration shipped; run `autoplan calibrate` on one)"
    base = (_SHIPPED or {}).get("A100-SXM4-80GB")
    gemm = dict(base.gemm_efficiency) if base is not None else {"bf16": 0.6}
    attention = (base.attention_fwd_efficiency, base.attention_bwd_efficiency) if base is not None else (0.3, 0.3)
    return Calibration(
        gpu=gpu.name, gemm_efficiency=gemm, attention_fwd_efficiency=attention[0],
        attention_bwd_efficiency=attention[1], causal_work_fraction=1.0,
        memory_bandwidth_efficiency=0.8, kernel_floor_s=5e-6,
        sources={"file": note, "gemm": note, "attention": note, "memory": note},
    )


@dataclass
class Calibrations:
    """The calibration to use for each GPU type of a search: user files first, then shipped ones."""

    overrides: dict[str, Calibration] = field(default_factory=dict)

    @classmethod
    def from_files(cls, paths: list[str | Path] | tuple[str | Path, ...] = ()) -> Calibrations:
        overrides: dict[str, Calibration] = {}
        for path in paths:
            cal = load_calibration(path)
            overrides[cal.gpu] = cal
        return cls(overrides)

    def for_gpu(self, gpu: GPU) -> Calibration:
        if gpu.name in self.overrides:
            return self.overrides[gpu.name]
        return default_calibration(gpu)
