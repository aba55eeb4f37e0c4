"""Issue 44 item 11: a launcher whose ranks were killed before their first line (while importing torch)
does not send the user to a folder of empty logs."""

from __future__ import annotations

from autoplan.runtime.launcher.ranks import logs_note


def test_empty_rank_logs_are_not_named_as_where_to_look(tmp_path):
    for r in range(2):
        (tmp_path / f"rank-{r}.log").write_text("")
    note = logs_note(tmp_path)
    assert "logs:" not in note and "wrote no log" in note and "importing torch" in note


def test_a_rank_log_with_lines_is_named(tmp_path):
    (tmp_path / "rank-0.log").write_text("")
    (tmp_path / "rank-1.log").write_text("Traceback ...\n")
    assert logs_note(tmp_path) == f"logs: {tmp_path / 'rank-*.log'}"
