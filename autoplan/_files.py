"""Reading the JSON and YAML files users hand to autoplan (plans, traces, baselines, suites, clusters,
calibrations, Hugging Face configs) with one-line errors.

Every such file goes through `parse_json` / `parse_yaml`, which bound what a file may be: at most
`MAX_FILE_BYTES` of text and `MAX_NESTING` levels of lists and mappings. Without the bounds a
deeply nested file (`[[[[...]]]]`, a YAML flow sequence of 100,000 brackets) ended in a
RecursionError traceback inside the parser or inside our own walks of the data (issue "Faults and
hostile input"); no file autoplan reads nests deeper than about 6 levels.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_FILE_BYTES", "MAX_NESTING", "check_output_file", "nesting_depth", "parse_json", "parse_yaml", "path_kind",
    "read_json", "read_text",
]

MAX_NESTING = 64
"""Deepest nesting of lists and mappings accepted in any file (a plan nests 4 levels, a suite 5)."""
MAX_FILE_BYTES = 256 * 2**20
"""Largest file read: a Chrome trace of a long run is tens of MB; nothing autoplan reads is larger."""


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """Levels of lists / tuples / mappings in `value`, counted without recursion (a hostile file must
    not overflow the stack here either); stops counting past `limit`."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list | tuple))
    return deepest


def _bracket_depth(text: str, limit: int) -> int:
    """Deepest bracket nesting in `text`, ignoring string contents only roughly: a fast pre-check
    so that the parsers never recurse past `limit` (it over-counts brackets inside strings, which is
    harmless: the parsed depth is checked again)."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif ch in "]}":
            depth = max(0, depth - 1)
    return deepest


def _too_deep(what: str) -> str:
    return f"{what} nests lists or mappings more than {MAX_NESTING} levels deep; no autoplan file does, fix the file"


def path_kind(path: str | os.PathLike) -> str | None:
    """'dir', 'file' (anything else that exists), or None when nothing is at `path`: also for a string that cannot name a file
    (a component longer than the system allows, a NUL byte). `Path.exists()` raises OSError
    (ENAMETOOLONG) on those, and a long model spec was once read as a path that way (issue 31)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return "dir" if stat.S_ISDIR(mode) else "file"


def read_text(path: str | os.PathLike, what: str, error: type[ValueError], create_hint: str) -> str:
    """The text of the file at `path`; `error(...)` naming `what` and the problem if it is missing, a
    directory, too large or not text."""
    path = Path(path)
    kind = path_kind(path)
    if kind is None:
        raise error(f"{what} {str(path)!r} does not exist; {create_hint}")
    if kind == "dir":
        raise error(f"{what} {str(path)!r} is a directory, not a file")
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise error(f"{what} {str(path)!r} is larger than {MAX_FILE_BYTES >> 20} MiB; no autoplan file is")
        return path.read_text()
    except UnicodeDecodeError:
        raise error(f"{what} {str(path)!r} is not a text file") from None
    except OSError as exc:
        raise error(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None


def parse_json(text: str, what: str, error: type[ValueError]) -> Any:
    """Parsed JSON of `text` (from `what`), bounded in nesting; `error(...)` in one line otherwise."""
    if _bracket_depth(text, MAX_NESTING) > MAX_NESTING:
        raise error(_too_deep(what))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except (RecursionError, ValueError) as exc:  # ValueError: e.g. an integer of more than 4300 digits
        raise error(f"{what} is not valid JSON ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})") from None
    if nesting_depth(data) > MAX_NESTING:
        raise error(_too_deep(what))
    return data


def parse_yaml(text: str, what: str, error: type[ValueError]) -> Any:
    """Parsed YAML (safe_load) of `text` (from `what`), bounded in nesting; `error(...)` in one line
    otherwise. Block-style nesting is bounded by the indentation a file can hold; flow style
    (`[[[...]]]`) is checked before parsing."""
    import yaml

    if _bracket_depth(text, MAX_NESTING) > MAX_NESTING:
        raise error(_too_deep(what))
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error(f"{what} is not valid YAML{where}: {problem}; fix the syntax") from None
    except RecursionError:  # block-style nesting deep enough to exhaust the parser's stack
        raise error(_too_deep(what)) from None
    except (ValueError, OverflowError) as exc:
        raise error(f"{what} is not valid YAML ({type(exc).__name__}); fix the file") from None
    if nesting_depth(data) > MAX_NESTING:
        raise error(_too_deep(what))
    return data


def read_json(path: str | os.PathLike, what: str, error: type[ValueError], create_hint: str) -> Any:
    """The parsed JSON at `path`; `error(...)` naming `what` and the problem if it is missing or not
    JSON. `create_hint` says how to make one (e.g. "create one with `autoplan suggest --out p.json`")."""
    text = read_text(path, what, error, create_hint)
    return parse_json(text, f"{what} {str(path)!r}", error)


def check_output_file(flag: str, path: str | os.PathLike) -> None:
    """Refuse, before any work, an output file that could not be written: empty, a directory, or in
    a directory that does not exist or is not writable."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{flag} must be a path, got {path!r}")
    if not str(path).strip():
        raise ValueError(f"{flag} is empty; name a file")
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; name a file")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: directory {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{flag} {str(path)!r} is not writable")
