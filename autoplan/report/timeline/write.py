"""Writing timelines to a file, the rendering picked by the file's suffix (.svg, .png, .json)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from autoplan.plan import Plan
from autoplan.report.timeline.chrome_trace import to_chrome_trace
from autoplan.report.timeline.model import Timeline, TimelineError
from autoplan.report.timeline.png import to_png
from autoplan.report.timeline.svg import to_svg

__all__ = ["write_timeline"]

def write_timeline(timelines: Sequence[Timeline], path: str | os.PathLike, plan: Plan | None = None) -> None:
    """Write by suffix: .svg, .png (matplotlib) or .json (Chrome trace)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".svg":
        text = to_svg(timelines, plan)
    elif suffix == ".json":
        text = json.dumps(to_chrome_trace(timelines))
    elif suffix == ".png":
        to_png(timelines, path, plan)
        return
    else:
        raise TimelineError(f"cannot write a timeline to {str(path)!r}: use a .svg, .png or .json file")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
