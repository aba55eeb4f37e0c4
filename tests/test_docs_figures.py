"""The figures the README and docs quote are what autoplan prints now (issue 44 item 8): every
`<!-- figures: NAME -->` block equals what benchmarks/regenerate_docs.py regenerates from the
command the doc shows. On a failure, `python benchmarks/regenerate_docs.py` rewrites the blocks
(after checking that the new figures are intended)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


regenerate_docs = load_benchmark("regenerate_docs")


def test_every_marked_block_matches_what_autoplan_prints():
    drifted = regenerate_docs.regenerate(check=True)
    assert not drifted, ("docs drifted from autoplan's output; if intended, run "
                         "`python benchmarks/regenerate_docs.py`:\n" + "\n".join(drifted))


def test_every_generator_has_a_block_and_every_block_a_generator():
    names = [name for _, name, _ in regenerate_docs.marked_blocks()]
    assert sorted(names) == sorted(regenerate_docs.BLOCKS), names


def _copy_docs(tmp_path: Path) -> Path:
    for doc in regenerate_docs.DOCS:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / doc, tmp_path / doc)
    return tmp_path


def test_a_perturbed_figure_is_reported_then_rewritten(tmp_path):
    root = _copy_docs(tmp_path)
    doc = root / "docs" / "export-deepspeed.md"
    before = doc.read_text()
    start = before.index("<!-- figures: deepspeed-example -->")
    predicted = before.index('"predicted: ', start)
    # Change the step time quoted in the block: what the drifted README/doc of issue 44 did.
    step = before[predicted + len('"predicted: '):before.index(" s/step", predicted)]
    perturbed = before[:predicted] + before[predicted:].replace(step, "9.9999", 1)
    doc.write_text(perturbed)

    drifted = regenerate_docs.regenerate(root, check=True, names={"deepspeed-example"})
    assert len(drifted) == 1
    assert "docs/export-deepspeed.md [deepspeed-example]" in drifted[0]
    assert "-      \"predicted: 9.9999 s/step" in drifted[0] and f"+      \"predicted: {step} s/step" in drifted[0]
    assert doc.read_text() == perturbed  # --check writes nothing

    regenerate_docs.regenerate(root, names={"deepspeed-example"})
    assert doc.read_text() == before
    assert regenerate_docs.regenerate(root, check=True, names={"deepspeed-example"}) == []


def test_search_wall_time_is_not_drift_but_a_planned_figure_is(tmp_path):
    root = _copy_docs(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    timed = regenerate_docs._VOLATILE[0].search(text)
    assert timed is not None, "README's suggest block no longer prints the search time"
    readme.write_text(text[:timed.start()] + timed.group(1) + "123.45 s" + text[timed.end():])
    assert regenerate_docs.regenerate(root, check=True, names={"readme-suggest"}) == []

    mfu = text.index("% │", text.index("<!-- figures: readme-suggest -->"))
    readme.write_text(text[:mfu - 4] + "99.9" + text[mfu:])
    assert len(regenerate_docs.regenerate(root, check=True, names={"readme-suggest"})) == 1


def test_check_command_exit_codes(capsys):
    assert regenerate_docs.main(["--check", "readme-export"]) == 0
    assert "0 marked block(s) differ" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        regenerate_docs.main(["--check", "no-such-block"])
    assert exited.value.code == 2
    assert "no block named no-such-block" in capsys.readouterr().err


def test_every_block_reports_a_change(tmp_path):
    """A check that cannot see a block is no check: an edited line in each block is a drift."""
    root = _copy_docs(tmp_path)
    for doc in regenerate_docs.DOCS:
        path = root / doc
        path.write_text(path.read_text().replace("<!-- /figures -->", "an edited line\n<!-- /figures -->"))
    drifted = regenerate_docs.regenerate(root, check=True)
    assert sorted(d.splitlines()[0].split("[")[1].split("]")[0] for d in drifted) == sorted(regenerate_docs.BLOCKS)
