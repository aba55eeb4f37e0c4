"""Checkpoint integrity: a damaged newest checkpoint (a flipped byte in a DCP data file or in its
.metadata, an altered or unparseable manifest, a manifest naming a file outside its directory or
recording no model fingerprint) is skipped with its reason, and `run_plan` resumes from the
checkpoint before it, bit for bit as a run never interrupted (docs/reliability.md).

Multi-rank runs use the launcher (`run_plan`) with a forkserver that has torch preloaded; one
reference run provides both the expected losses and the pristine checkpoints each case damages.
"""

from __future__ import annotations

import json
import multiprocessing
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _dist import make_plan

from autoplan import models as zoo
from autoplan.graph.profile import model_fingerprint
from autoplan.graph.trace import trace_model
from autoplan.runtime import checkpoint as ckpt
from autoplan.runtime import run_plan
from autoplan.runtime.checkpoint.integrity import file_entry
from autoplan.runtime.launcher.launch import FORKSERVER_PRELOAD

pytestmark = pytest.mark.multiproc

GPT = "gpt:num_layers=4,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"
FAST = dict(_start_method="forkserver", timeout_s=10)


@pytest.fixture(scope="module", autouse=True)
def _forkserver():
    """Start the forkserver with torch and the runtime imported (no-op if one already runs)."""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    forkserver.ensure_running()


def _plan_2x2():
    model = zoo.build_model(GPT, device="meta")
    traced = trace_model(model, (torch.zeros(2, 16, dtype=torch.long),))
    return make_plan(GPT, model_fingerprint(model), traced.block_names, pp=2, dp=2)


def _losses(path: Path) -> dict[int, float]:
    """{step: loss} of a metrics file (the last record of each step: the file may be appended to)."""
    return {m["step"]: m["loss"] for m in map(json.loads, path.read_text().splitlines())}


# ---- damage ----------------------------------------------------------------------------------------


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _largest_data_file(step_dir: Path) -> Path:
    return max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _edit_manifest_text(step_dir: Path, pattern: str, replace: Callable[[re.Match], str]) -> None:
    """Change the first match of `pattern` in manifest.json's text (the JSON still parses)."""
    path = step_dir / "manifest.json"
    text, n = re.subn(pattern, replace, path.read_text(), count=1)
    assert n == 1, pattern
    path.write_text(text)


def _edit_manifest(step_dir: Path, edit: Callable[[dict], None]) -> None:
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=1))


def _other_digit(m: re.Match) -> str:
    """The matched text with its last character changed to another digit (hex or decimal)."""
    last = m.group(0)[-1]
    return m.group(0)[:-1] + ("1" if last == "0" else "0")


def _name_outside(step_dir: Path) -> None:
    """Swap a data file's entry for `../step-000002/<same name>`, with that file's true size and sha256
    (a crafted manifest: every recorded number is right)."""
    other = step_dir.parent / "step-000002"
    name = _largest_data_file(step_dir).name

    def edit(manifest: dict) -> None:
        del manifest["files"][name]
        manifest["files"][f"../step-000002/{name}"] = json.loads((other / "manifest.json").read_text())["files"][name]

    _edit_manifest(step_dir, edit)


def _drop_fingerprint(manifest: dict) -> None:
    manifest.pop("model_fingerprint")
    manifest.get("extra", {}).pop("model_fingerprint", None)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    # kind: (damage step_dir in place, what the reason says)
    "data-byte": (lambda d: _flip_byte(_largest_data_file(d)),
                  r"__\d+_0\.distcp does not match its sha256 in manifest\.json"),
    "metadata-byte": (lambda d: _flip_byte(d / ".metadata"), r"^\.metadata does not match its sha256"),
    "manifest-size": (lambda d: _edit_manifest_text(d, r'"size": \d+', _other_digit),
                      r"has \d+ bytes, manifest\.json records \d+"),
    "manifest-sha256": (lambda d: _edit_manifest_text(d, r'"sha256": "[0-9a-f]{64}', _other_digit),
                        r"does not match its sha256 in manifest\.json"),
    "manifest-unparseable": (lambda d: _flip_byte(d / "manifest.json", 1), r"manifest\.json does not parse"),
    "manifest-names-another-step": (_name_outside, r"names '\.\./step-000002/__\d+_0\.distcp', not a file of"),
    "manifest-without-fingerprint": (lambda d: _edit_manifest(d, _drop_fingerprint),
                                     r"manifest\.json records no model fingerprint"),
}


def _damaged_copy(pristine: Path, kind: str, into: Path) -> Path:
    """`into` holding copies of `pristine`'s step-000002 and step-000004, the latter damaged."""
    for name in ("step-000002", "step-000004"):
        shutil.copytree(pristine / name, into / name)
    DAMAGE[kind][0](into / "step-000004")
    return into


# ---- verify_checkpoint, in one process -------------------------------------------------------------


class _FakePM:
    """The public surface of PartitionedModel that checkpoints use."""

    def __init__(self, params):
        self.params = params
        self.aliases = {}

    def named_parameters(self):
        return iter(self.params.items())

    def state_dict(self):
        return {n: p.detach() for n, p in self.params.items()}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """Checkpoints of steps 2 and 4 of a one-process model, saved without a process group."""
    root = tmp_path_factory.mktemp("small")
    params = {"w": torch.nn.Parameter(torch.randn(8, 8)), "b": torch.nn.Parameter(torch.randn(8))}
    pm, opt = _FakePM(params), torch.optim.AdamW(params.values())
    for step in (2, 4):
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.step()
        ckpt.save_checkpoint(root, step, pm, opt)
    return root


def _link_outside(d: Path) -> None:
    """The data file replaced by a link to step 2's, its manifest entry updated to match."""
    name = _largest_data_file(d).name
    (d / name).unlink()
    (d / name).symlink_to(d.parent / "step-000002" / name)
    _edit_manifest(d, lambda m: m["files"].update({name: file_entry(d / name)}))


def _files_of_step_2(d: Path) -> None:
    """Step 2's files under step 4's name, with a manifest consistent with them but for the step."""
    shutil.rmtree(d)
    shutil.copytree(d.parent / "step-000002", d)
    _edit_manifest(d, lambda m: m.update(step=4))


def _unlisted_data_file(d: Path) -> None:
    name = _largest_data_file(d).name
    _edit_manifest(d, lambda m: m["files"].pop(name))


UNIT_ONLY: dict[str, tuple[Callable[[Path], None], str]] = {
    "manifest-absolute-name": (lambda d: _edit_manifest(d, lambda m: m["files"].update(
        {str(d.parent / "step-000002" / "__0_0.distcp"): m["files"].pop("__0_0.distcp")})), r"names '/.*', not a file of"),
    "link-out-of-the-directory": (_link_outside, r"is a link to '.*step-000002.*', outside"),
    "manifest-step-not-the-directory's": (lambda d: _edit_manifest(d, lambda m: m.update(step=2)),
                                          r"records step 2, the directory's name step 4"),
    "files-of-another-step": (_files_of_step_2, r"rank 0's data records step 2, manifest\.json step 4"),
    "data-file-needed-but-unlisted": (_unlisted_data_file, r"\.metadata reads from '__0_0\.distcp', a file"),
    "checksums-missing": (lambda d: _edit_manifest(d, lambda m: m["files"].update(
        {n: e["size"] for n, e in m["files"].items()})), r"records no size and sha256 of"),
    "format-1": (lambda d: _edit_manifest(d, lambda m: m.update(format="autoplan-checkpoint/1")),
                 r"of format 'autoplan-checkpoint/1'; this version reads autoplan-checkpoint/2"),
}


@pytest.mark.parametrize("kind", [*DAMAGE, *UNIT_ONLY])
def test_verify_checkpoint_names_each_damage(small, tmp_path, kind):
    damage, reason = {**DAMAGE, **UNIT_ONLY}[kind]
    for name in ("step-000002", "step-000004"):
        shutil.copytree(small / name, tmp_path / name)
    good = tmp_path / "step-000004"
    assert ckpt.verify_checkpoint(good) is None
    damage(good)
    found = ckpt.verify_checkpoint(good)
    assert found is not None and re.search(reason, found) and "\n" not in found, found
    # The newest that verifies is chosen; the damaged one is named with the same reason.
    assert ckpt.choose_checkpoint(tmp_path) == (tmp_path / "step-000002", [(good, found)])
    skipped: list = []
    assert ckpt.latest_checkpoint(tmp_path, skipped) == tmp_path / "step-000002" and skipped == [(good, found)]
    with pytest.warns(UserWarning, match=f"skipping checkpoint {re.escape(repr(str(good)))}: "):
        assert ckpt.load_checkpoint(tmp_path).step == 2  # under the root: skipped, with a warning
    # Given directly, it is refused in one line before anything is read.
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(good)
    assert str(info.value).startswith(f"cannot read checkpoint {str(good)!r}: {found}") and "\n" not in str(info.value)


def test_incomplete_saves_are_ignored_silently_and_damaged_ones_named(small, tmp_path):
    for name in ("step-000002", "step-000004"):
        shutil.copytree(small / name, tmp_path / name)
    (tmp_path / "step-000006").mkdir()  # a save without its manifest
    (tmp_path / "step-000006" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / ".tmp-step-000008").mkdir()
    assert ckpt.choose_checkpoint(tmp_path) == (tmp_path / "step-000004", [])
    _flip_byte(tmp_path / "step-000004" / "__0_0.distcp")
    _flip_byte(tmp_path / "step-000002" / "__0_0.distcp")
    chosen, skipped = ckpt.choose_checkpoint(tmp_path)
    assert chosen is None and [p.name for p, _ in skipped] == ["step-000004", "step-000002"]
    with pytest.raises(ckpt.CheckpointError, match=r"no usable checkpoint in .*: 2 damaged, the newest step-000004: "
                                                   r"__0_0\.distcp does not match its sha256"):
        ckpt.load_checkpoint(tmp_path)


def test_restore_refuses_a_file_that_changed_after_the_checkpoint_was_opened(small, tmp_path):
    shutil.copytree(small / "step-000004", tmp_path / "step-000004")
    loaded = ckpt.load_checkpoint(tmp_path / "step-000004")
    data = tmp_path / "step-000004" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    target = _FakePM({"w": torch.nn.Parameter(torch.zeros(8, 8)), "b": torch.nn.Parameter(torch.zeros(8))})
    with pytest.raises(ckpt.CheckpointError, match=r"changed after it was opened: __0_0\.distcp has 100 bytes"):
        ckpt.restore(loaded, target)
    assert all(not p.any() for p in target.params.values())  # nothing loaded


# ---- resume through run_plan -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, float]:
    """The losses of 6 steps of pp 2 x dp 2, never interrupted."""
    root = tmp_path_factory.mktemp("straight")
    assert run_plan(_plan_2x2(), steps=6, metrics_path=str(root / "m.jsonl"), **FAST) == 0
    losses = _losses(root / "m.jsonl")
    assert sorted(losses) == [0, 1, 2, 3, 4, 5]
    return losses


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """The checkpoints of steps 2 and 4 of the same run stopped after step 4 (each case damages a
    copy)."""
    root = tmp_path_factory.mktemp("stopped") / "ckpt"
    assert run_plan(_plan_2x2(), steps=4, checkpoint_dir=root, checkpoint_every=2, **FAST) == 0
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 4]
    return root


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_and_the_resume_from_the_previous_is_exact(
        straight, stopped, tmp_path, capsys, kind):
    d = _damaged_copy(stopped, kind, tmp_path / "ckpt")
    reason = ckpt.verify_checkpoint(d / "step-000004")
    assert reason is not None and re.search(DAMAGE[kind][1], reason), reason
    code = run_plan(_plan_2x2(), steps=6, checkpoint_dir=d, checkpoint_every=2, resume=True,
                    metrics_path=str(tmp_path / "m.jsonl"), **FAST)
    err = capsys.readouterr().err
    assert code == 0, err
    resumed = _losses(tmp_path / "m.jsonl")
    assert sorted(resumed) == [2, 3, 4, 5]  # resumed from step 2
    assert all(resumed[s] == straight[s] for s in resumed), (resumed, straight)  # bitwise
    assert ckpt.choose_checkpoint(d) == (d / "step-000006", [])  # the damaged one was saved over
    # The launcher says which checkpoint it skipped and why, and which one it resumes from.
    assert "step-000004" in err and reason in err and "step-000002" in err, err
