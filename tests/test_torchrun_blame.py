"""Under torchrun, the rank that died is the one autoplan names (issue 43: with rank 1 killed, rank 0's
line read "rank 0 failed: P2PTimeout ... Connection reset by peer" while torchrun's own summary named
rank 1). See [Note: blame under torchrun] in runtime/launcher/launch.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autoplan.runtime.execution.comm import P2PTimeout
from autoplan.runtime.launcher.launch import _torchrun_failure
from tests._cli import run_main

TINY = "gpt:num_layers=2,hidden_size=16,num_heads=2,vocab_size=32,max_seq_len=8"


def _raised_from(message: str, cause: str) -> P2PTimeout:
    try:
        try:
            raise RuntimeError(cause)
        except RuntimeError as exc:
            raise P2PTimeout(message) from exc
    except P2PTimeout as exc:
        return exc


@pytest.mark.parametrize(("exc", "rank", "world", "words"), [
    # a P2P wait names its peer
    (P2PTimeout("receive of B values of stage 1, micro-batch 0 from rank 3 failed: Read error [127.0.0.1]:1: "
                "Connection reset by peer"), 2, 4, "rank 3 failed first (its connection was reset"),
    # a collective's error names an address, not a rank: in a world of 2 the peer is the other rank
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5"), 1, 2,
     "rank 0 failed first (its connection was reset"),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5"), 1, 4,
     "a peer of rank 1 failed first"),
    # the reason is in the error the P2P error was raised from
    (_raised_from("send of F values of stage 0, micro-batch 2 to rank 1 failed", "Broken pipe"), 0, 2,
     "rank 1 failed first (its connection was reset"),
    (P2PTimeout("receive of F values of stage 0, micro-batch 0 from rank 0 timed out after 20 s"), 1, 2,
     "rank 0 failed first (it did not answer in time"),
    # its own error, even one that reads like a wait: itself
    (TimeoutError("the --data server timed out"), 0, 2, "rank 0 failed: TimeoutError: the --data server timed out"),
    (BrokenPipeError("[Errno 32] Broken pipe"), 1, 2, "rank 1 failed: BrokenPipeError"),
    (RuntimeError("injected failure at step 1"), 1, 2, "rank 1 failed: RuntimeError: injected failure at step 1"),
])
def test_a_wait_on_a_peer_names_the_peer(exc, rank, world, words):
    line = _torchrun_failure(exc, rank, world)
    assert line.startswith(words), line
    assert "\n" not in line
    if "first" in words:
        assert f"rank {rank} stopped waiting on it: {type(exc).__name__}" in line, line


@pytest.mark.extended  # torchrun starts two ranks that import torch: 30-60 s on 2 loaded cores
def test_torchrun_names_the_killed_rank(tmp_path):
    """`torchrun --standalone --nproc-per-node 2 -m autoplan run p.json` on gloo with rank 1 SIGKILLed
    before step 1: autoplan's line names rank 1, as torchrun's summary does, and rank 0 as stopped."""
    plan = tmp_path / "p.json"
    result = run_main("suggest", "--model", TINY, "--cluster", "1x2xcpu", "--global-batch", "8", "--seq-len", "8",
                      "--pp", "2", "--out", str(plan))
    assert result.returncode == 0, result.stderr
    assert json.loads(plan.read_text())["pp"] == 2
    env = dict(os.environ, AUTOPLAN_FAULT="kill@1:1", OMP_NUM_THREADS="1")
    # --monitor-interval 5: torchrun looks at its workers every 5 s (default 0.1 s), so rank 0 meets the
    # dead connection before torchrun stops it (with the default the race is the user's: the issue's
    # line was printed, this test's run may have been stopped first).
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "--monitor-interval", "5", "-m", "autoplan", "run", str(plan), "--steps", "3",
                          "--timeout", "30"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("autoplan: error:")]
    assert len(ours) == 1, run.stderr[-3000:]
    assert ours[0].startswith("autoplan: error: rank 1 failed first (its connection was reset"), ours[0]
    assert "rank 0 stopped waiting on it" in ours[0] and "rank 0 failed" not in ours[0]
    assert "exitcode  : -9" in run.stderr and "rank      : 1" in run.stderr  # torchrun's summary agrees
