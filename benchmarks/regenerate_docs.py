"""Regenerate the figures the README and docs quote from autoplan's own output (issue 44 item 8).

    python benchmarks/regenerate_docs.py           # rewrite every marked block in place
    python benchmarks/regenerate_docs.py --check   # exit 1 with a diff of each block that drifted

A quoted figure lives between two Markdown comments (invisible on GitHub):

    <!-- figures: NAME -->
    ...text this script writes...
    <!-- /figures -->

NAME is a key of BLOCKS: a function that runs the command the doc shows (through `autoplan.cli.main`
in this process, in a scratch directory) and returns the block's text. Only the text between the
markers is rewritten; the prose around it is the doc's. tests/test_docs_figures.py runs `--check`.
"""

from __future__ import annotations

import argparse
import difflib
import io
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/export-torchtitan.md", "docs/export-deepspeed.md", "docs/export-megatron.md",
        "docs/cost-model.md")
MARKER = re.compile(r"^<!-- figures: (?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /figures -->$", re.M | re.S)

# Figures that differ from run to run on the same code (the search's wall-clock time): the check
# compares them as a placeholder, so only a change in what autoplan computes counts as drift.
_VOLATILE = (re.compile(r"(configurations \(tp x pp x dp x micro-batch x schedule\) in )\d+\.\d+ s"),)

TINY_LLAMA = "llama:num_layers=12,hidden_size=256,num_heads=4,num_kv_heads=2,vocab_size=32000,max_seq_len=512"
TINY_LLAMA_SHORT = "llama:num_layers=12,...,max_seq_len=512"


class _Scratch:
    """Runs `autoplan ARGS` in one scratch directory, so an export reads the plan a suggest wrote;
    each distinct command runs once per regeneration."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="autoplan-docs-"))
        self._done: dict[tuple[str, ...], tuple[str, str]] = {}
        self._subs: dict[str, _Scratch] = {}

    def cli(self, *args: str) -> str:
        """What `autoplan ARGS` prints on stdout, lines right-stripped."""
        return self._run(args)[0]

    def cli_stderr(self, *args: str) -> str:
        """What `autoplan ARGS` prints on stderr (an export's "wrote ..." and "run it: ..." lines)."""
        return self._run(args)[1]

    def _run(self, args: tuple[str, ...]) -> tuple[str, str]:
        if args not in self._done:
            from autoplan.cli import main

            out, err = io.StringIO(), io.StringIO()
            cwd = os.getcwd()
            os.chdir(self._dir)
            try:
                with redirect_stdout(out), redirect_stderr(err):
                    code = main(list(args))
            finally:
                os.chdir(cwd)
            if code != 0:
                raise RuntimeError(f"`autoplan {' '.join(args)}` exited {code}: {err.getvalue().strip()}")
            # rich pads table titles and wrapped lines to the console's width.
            self._done[args] = tuple("\n".join(line.rstrip() for line in stream.getvalue().splitlines())
                                     for stream in (out, err))
        return self._done[args]

    def sub(self, name: str) -> _Scratch:
        """A scratch directory of its own (created once), for commands whose files would collide."""
        if name not in self._subs:
            self._subs[name] = _Scratch()
        return self._subs[name]

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def read(self, name: str) -> str:
        return (self._dir / name).read_text()


def _rows(table_text: str, first: str, num_cells: int) -> list[str]:
    """The table rows whose first cell is `first` (or any, for None), cut to their first cells."""
    rows = []
    for line in table_text.splitlines():
        cells = line.split("│")
        if len(cells) > num_cells and (first is None or cells[1].strip() == first):
            rows.append("│".join(cells[:num_cells + 1]) + "│ ...")
    return rows


# --- README.md ----------------------------------------------------------------------------------

def readme_suggest(run: _Scratch) -> str:
    return "```\n" + run.cli("suggest") + "\n```\n"


README_SUGGEST = ("suggest", "--model", "llama3-8b", "--cluster", "2x8xH100-80GB", "--global-batch", "512",
                  "--seq-len", "4096", "--pp", "2", "--schedule", "interleaved-1f1b", "--out", "llama.json")


def readme_export(run: _Scratch) -> str:
    run.cli(*README_SUGGEST)
    out = run.cli_stderr("export", "llama.json", "--to", "megatron", "--out", "llama_args.sh", "--allow-approx")
    header = run.read("llama_args.sh").splitlines()
    plan = next(line for line in header if line.startswith("# tp "))  # "# tp 1 x pp 2 x dp 8; ...; zero 1; ..."
    parts = plan[2:].split("; ")
    zero = next(part for part in parts if part.startswith(("zero", "FSDP")))
    pp = re.search(r"pp \d+", parts[0]).group(0)
    found = re.search(r"\((\d+) differences? from the plan", out)
    if found is None:
        here = f"here: nothing, the plan, {zero} with {pp} and {parts[1].split(' with')[0]}, runs as planned"
    else:
        diffs = [line.strip()[2:] for line in header if line.startswith("#   - ")]
        here = f"here {found.group(1)}: " + "; ".join(d.split(";")[0] for d in diffs)
    return ("```bash\n"
            f"autoplan {' '.join(README_SUGGEST)}\n"
            "autoplan export llama.json --to megatron --out llama_args.sh --allow-approx"
            f"   # lists what Megatron-LM runs differently ({here})\n"
            "autoplan export llama.json --to torchtitan --out llama_plan.py --allow-approx"
            "  # a config-registry file; prints the torchrun line that runs it\n"
            "```\n")


# --- docs/export-torchtitan.md ------------------------------------------------------------------

TITAN_SUGGEST = ("suggest", "--model", TINY_LLAMA, "--cluster", "1x8xA100-80GB", "--global-batch", "32",
                 "--seq-len", "512", "--pp", "2", "--zero", "2", "--out", "plan.json")
TITAN_EXPORT = ("export", "plan.json", "--to", "torchtitan", "--out", "my_plan.py")


def titan_console(run: _Scratch) -> str:
    printed = run.cli(*TITAN_SUGGEST)
    export = run.cli_stderr(*TITAN_EXPORT)
    stages = [r for r in _rows(printed, None, 3) if re.match(r"│\s+\d+ │\s+\d+ │ \d", r)]
    stages.sort(key=lambda r: int(r.split("│")[1]))
    return "\n".join([
        "```console",
        f'$ autoplan suggest --model "{TINY_LLAMA}" \\',
        "    --cluster 1x8xA100-80GB --global-batch 32 --seq-len 512 --pp 2 --zero 2 --out plan.json",
        "...",
        *_rows(printed, "1", 7)[:1],  # the ranked plans' table comes before the stages'
        "...",
        *stages,
        printed.splitlines()[-1],
        "",
        "$ autoplan export plan.json --to torchtitan --out my_plan.py",
        export,
        "```",
    ]) + "\n"


def _shorten_titan_module(text: str) -> list[str]:
    """The exported module as the doc quotes it: the header with the middle stages elided, then the
    model builder, the stages and the plan, without imports, comments and the builder's long lines."""
    lines = text.replace(TINY_LLAMA, TINY_LLAMA_SHORT).splitlines()
    body_at = next(i for i, line in enumerate(lines) if line.startswith("def _autoplan_model_spec"))
    header = [line for line in lines[:body_at] if line.startswith("#")]
    stages = [i for i, line in enumerate(header) if line.startswith("#   stage ")]
    header = header[:stages[0] + 1] + ["#   ..."] + header[stages[-1]:]
    out = [*header, "..."]
    body = iter(lines[body_at:])
    for line in body:
        stripped = line.strip()
        if stripped.startswith("#") or stripped.startswith('"""The plan\'s model'):
            continue
        if stripped == "model = Llama3Model.Config(":
            inner = []
            for inner_line in body:
                if inner_line.strip() == ")":
                    break
                inner.append(inner_line.strip())
            first = inner[0].rstrip(",")
            tail = ", ".join(i.rstrip(",") for i in inner[-2:])
            out.append(f"    model = Llama3Model.Config({first}, ..., {tail})")
            continue
        if stripped.startswith("loss=ChunkedLossWrapper"):
            out.append("        ...")
            for skipped in body:
                if skipped.strip().startswith("dataloader="):
                    break
            continue
        out.append(line)
    return out


def titan_module(run: _Scratch) -> str:
    run.cli(*TITAN_SUGGEST)
    run.cli(*TITAN_EXPORT)
    return "```python\n" + "\n".join(_shorten_titan_module(run.read("my_plan.py"))) + "\n```\n"


# --- docs/export-deepspeed.md -------------------------------------------------------------------

DS_SUGGEST = ("suggest", "--model", TINY_LLAMA, "--cluster", "1x8xA100-80GB", "--global-batch", "32",
              "--seq-len", "512", "--tp", "2", "--pp", "2", "--dp", "2", "--schedule", "1f1b",
              "--recompute", "full", "--out", "plan.json")
DS_EXPORT = ("export", "plan.json", "--to", "deepspeed", "--out", "ds.json")


def _shorten_ds_json(text: str) -> list[str]:
    """ds.json as the doc quotes it: the model name shortened, one note, the first two and last
    three layers."""
    text = text.replace(TINY_LLAMA, "llama:num_layers=12,...")
    text = re.sub(r'("usage": ".*?per entry of \'layers\', ).*"', r'\1...], ...)"', text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if line.strip() in ('"notes": [', '"layers": ['):
            end = next(j for j in range(i, len(lines)) if lines[j].strip() in ("]", "],"))
            items = lines[i:end]
            keep_head, keep_tail = (1, 0) if "notes" in line else (2, 3)
            if len(items) > keep_head + keep_tail:
                indent = items[0][:len(items[0]) - len(items[0].lstrip())]
                items = items[:keep_head] + [indent + "..."] + (items[-keep_tail:] if keep_tail else [])
            out.extend(items)
            i = end
    return out


def ds_console(run: _Scratch) -> str:
    printed = run.cli(*DS_SUGGEST)
    export = run.cli_stderr(*DS_EXPORT)
    return "\n".join([
        "```console",
        f"$ autoplan suggest --model {TINY_LLAMA} \\",
        "    --cluster 1x8xA100-80GB --global-batch 32 --seq-len 512 --tp 2 --pp 2 --dp 2 --schedule 1f1b \\",
        "    --recompute full --out plan.json",
        "...",
        printed.splitlines()[-1],
        "$ autoplan export plan.json --to deepspeed --out ds.json",
        export,
        "$ cat ds.json",
        *_shorten_ds_json(run.read("ds.json")),
        "```",
    ]) + "\n"


# --- docs/export-megatron.md --------------------------------------------------------------------

MEGATRON_SUGGEST = ("suggest", "--model", TINY_LLAMA, "--cluster", "1x4xA100-80GB", "--global-batch", "16",
                    "--seq-len", "512", "--pp", "2", "--tp", "1", "--dp", "2", "--schedule", "interleaved-1f1b",
                    "--virtual-stages", "3", "--zero", "1", "--out", "plan.json")
MEGATRON_EXPORT = ("export", "plan.json", "--to", "megatron", "--out", "args.sh")


def megatron_console(run: _Scratch) -> str:
    # Its own scratch directory: the torchtitan and DeepSpeed examples write plan.json too.
    run = run.sub("megatron")
    printed = run.cli(*MEGATRON_SUGGEST)
    export = run.cli_stderr(*MEGATRON_EXPORT)
    stages = [r for r in _rows(printed, None, 3) if re.match(r"│\s+\d+ │\s+\d+ │ \d", r)]
    stages.sort(key=lambda r: int(r.split("│")[1]))
    return "\n".join([
        "```console",
        f'$ autoplan suggest --model "{TINY_LLAMA}" \\',
        "    --cluster 1x4xA100-80GB --global-batch 16 --seq-len 512 \\",
        "    --pp 2 --tp 1 --dp 2 --schedule interleaved-1f1b --virtual-stages 3 --zero 1 --out plan.json",
        "...",
        *stages,
        printed.splitlines()[-1],
        "",
        "$ autoplan export plan.json --to megatron --out args.sh",
        export,
        "```",
    ]) + "\n"


def megatron_args(run: _Scratch) -> str:
    """args.sh as the doc quotes it: the plan's header lines, every argument, the launch shortened."""
    run = run.sub("megatron")
    run.cli(*MEGATRON_SUGGEST)
    run.cli(*MEGATRON_EXPORT)
    lines = run.read("args.sh").splitlines()
    head = lines[:2] + [line for line in lines if line.startswith(("# tp ", "# layers per stage"))] + ["# ..."]
    start = lines.index("MEGATRON_ARGS=(")
    end = lines.index(")", start)
    defaults = next(line for line in lines if line.startswith("RUN_DEFAULTS="))
    launch = next(line for line in lines if line.strip().startswith("exec torchrun "))
    launch = launch[:launch.index("--nnodes")] + '--nnodes "${NNODES:-1}" ... "${MEGATRON_LM:?...}/pretrain_gpt.py" \\'
    run_line = next(line for line in lines if line.strip().startswith('"${MEGATRON_ARGS[@]}"'))
    return "\n".join([
        "```bash", *head, *lines[start:end + 1], defaults,
        'if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then',
        "    ...   # --mock-data unless a data flag is passed",
        launch, run_line, "fi", "```",
    ]) + "\n"


# --- docs/cost-model.md -------------------------------------------------------------------------

COST_SUGGEST = ("suggest", "--model", "llama3-8b", "--cluster", "1x8xH100-80GB", "--global-batch", "512",
                "--seq-len", "4096")


def cost_fsdp_note(run: _Scratch) -> str:
    """The best plan's sharding note, unwrapped from the console and re-wrapped as a quote."""
    import textwrap

    printed = run.cli(*COST_SUGGEST).splitlines()
    start = next(i for i, line in enumerate(printed) if line.startswith("note: zero "))
    note = [printed[start][len("note: "):]]
    for line in printed[start + 1:]:
        if line.startswith(("note: ", "searched ", "best plan ", "wrote ")):
            break
        note.append(line)
    text = " ".join(note)
    return "\n".join("> " + line for line in textwrap.wrap(text, 98, break_on_hyphens=False)) + "\n"


BLOCKS: dict[str, Callable[[_Scratch], str]] = {
    "readme-suggest": readme_suggest,
    "readme-export": readme_export,
    "torchtitan-example": titan_console,
    "torchtitan-module": titan_module,
    "deepspeed-example": ds_console,
    "megatron-example": megatron_console,
    "megatron-args": megatron_args,
    "cost-fsdp-note": cost_fsdp_note,
}


def _normalized(text: str) -> str:
    for pattern in _VOLATILE:
        text = pattern.sub(r"\1<time> s", text)
    return text


def marked_blocks(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(doc, block name, current text) for every marked block of the docs."""
    found = []
    for doc in DOCS:
        for match in MARKER.finditer((root / doc).read_text()):
            found.append((doc, match.group("name"), match.group("body")))
    return found


def regenerate(root: Path = ROOT, check: bool = False, names: set[str] | None = None) -> list[str]:
    """Rewrite (or, with check, only compare) every marked block; returns a unified diff per block
    that differs from what the commands print now (ignoring _VOLATILE figures)."""
    run = _Scratch()
    try:
        return _regenerate(run, root, check, names)
    finally:
        run.close()


def _regenerate(run: _Scratch, root: Path, check: bool, names: set[str] | None) -> list[str]:
    drifted = []
    for doc in DOCS:
        path = root / doc
        text = path.read_text()

        def _replace(match: re.Match, doc: str = doc) -> str:
            name, body = match.group("name"), match.group("body")
            if names is not None and name not in names:
                return match.group(0)
            if name not in BLOCKS:
                raise KeyError(f"{doc}: marked block {name!r} has no generator in benchmarks/regenerate_docs.py")
            new = BLOCKS[name](run)
            if _normalized(new) == _normalized(body):
                return match.group(0)  # a new search time alone is no reason to rewrite the doc
            drifted.append("".join(difflib.unified_diff(
                body.splitlines(keepends=True), new.splitlines(keepends=True),
                f"{doc} [{name}] (as written)", f"{doc} [{name}] (as autoplan prints it now)")))
            return f"<!-- figures: {name} -->\n{new}<!-- /figures -->"

        new_text = MARKER.sub(_replace, text)
        if not check and new_text != text:
            path.write_text(new_text)
    return drifted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any block drifted")
    parser.add_argument("names", nargs="*", help=f"only these blocks (of {', '.join(BLOCKS)})")
    args = parser.parse_args(argv)
    unknown = set(args.names) - set(BLOCKS)
    if unknown:
        parser.error(f"no block named {', '.join(sorted(unknown))}; the blocks are {', '.join(BLOCKS)}")
    try:
        drifted = regenerate(check=args.check, names=set(args.names) or None)
    except (KeyError, RuntimeError) as error:  # a marker without a generator, a command that failed
        print(f"regenerate_docs: error: {error.args[0]}", file=sys.stderr)
        return 2
    for diff in drifted:
        print(diff)
    if args.check:
        print(f"{len(drifted)} marked block(s) differ from what the commands print now"
              + ("; run `python benchmarks/regenerate_docs.py` to rewrite them" if drifted else ""))
        return 1 if drifted else 0
    print(f"rewrote {len(drifted)} marked block(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
