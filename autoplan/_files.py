"""Reading the JSON files users hand to autoplan (plans, traces, baselines) with one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_json"]


def read_json(path: str | os.PathLike, what: str, error: type[ValueError], create_hint: str) -> Any:
    """The parsed JSON at `path`; `error(...)` naming `what` and the problem if it is missing or not
    JSON. `create_hint` says how to make one (e.g. "create one with `autoplan suggest --out p.json`")."""
    path = Path(path)
    if not path.exists():
        raise error(f"{what} {str(path)!r} does not exist; {create_hint}")
    if path.is_dir():
        raise error(f"{what} {str(path)!r} is a directory, not a file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{what} {str(path)!r} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except UnicodeDecodeError:
        raise error(f"{what} {str(path)!r} is not a text file") from None
