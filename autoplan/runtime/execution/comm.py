"""Point-to-point transfer of activations and gradients between pipeline stages.

Shapes and dtypes are known from the graph (`split.CrossingValue`), so a receive allocates its
buffer and posts `irecv` with no handshake. Every message carries a tag made from (kind, stage,
micro-batch, value index), so messages between two ranks match even when forward activations and
backward gradients interleave differently on the two sides (gloo matches by tag; NCCL matches in
posting order, which `Schedule.with_comms` keeps consistent between peers).

Sends are posted and not waited (buffered, as `Schedule.with_comms` assumes); the executor waits
for all of them at the end of the step. Every wait (receives before use, sends at the end of the
step) has a timeout, and a peer that dies makes the wait fail at once (gloo: "Connection closed by
peer"), so no rank blocks forever on a dead or hung peer (docs/reliability.md).

`op_hook`, when set, is called with ("send" | "recv", kind, stage, micro-batch, peer) before each
transfer is posted; the launcher's fault injection uses it to kill a rank in the middle of a step.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from autoplan.runtime.parallel.split import CrossingValue

__all__ = ["P2P", "P2PTimeout"]

_KIND_CODE = {"F": 0, "B": 1}
_MAX_VALUES = 64


def _short(exc: BaseException) -> str:
    """The useful part of a backend error: gloo's "[.../pair.cc:553] Connection closed by peer
    [127.0.0.1]:1234. This is typically caused by ..." becomes "Connection closed by peer [127.0.0.1]:1234"."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text.splitlines()[0])
    return text.split(". This is typically")[0].rstrip(".")


class P2PTimeout(RuntimeError):
    """A receive did not complete in time (a peer died or hangs)."""


class P2P:
    """isend / irecv of crossing values with tags; tracks outstanding sends."""

    def __init__(self, device: torch.device, num_stages: int, num_microbatches: int,
                 timeout: timedelta = timedelta(seconds=60), wire_dtype: torch.dtype | None = None):
        self.device = device
        self.wire_dtype = wire_dtype
        """Floating-point values travel and arrive in this dtype (the plan's compute dtype under
        mixed precision, runtime/parallel/precision.py; the graph's own dtypes were found in fp32)."""
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.timeout = timeout
        self._pending_sends: list[tuple[dist.Work, str]] = []
        self.op_hook: Callable[[str, str, int, int, int], None] | None = None

    def _tag(self, kind: str, stage: int, microbatch: int, index: int) -> int:
        # `stage` is the sending stage for F and the receiving-side producer stage for B, so both
        # peers compute the same tag from the message's identity.
        return ((_KIND_CODE[kind] * self.num_stages + stage) * self.num_microbatches + microbatch) * _MAX_VALUES + index

    def send(self, kind: str, stage: int, microbatch: int, tensors: Sequence[torch.Tensor | None], dst: int) -> None:
        """Post sends of `tensors` (None entries are skipped: they are not sent on either side)."""
        if self.op_hook is not None:
            self.op_hook("send", kind, stage, microbatch, dst)
        for i, t in enumerate(tensors):
            if t is None:
                continue
            t = t.detach()
            if self.wire_dtype is not None and t.is_floating_point():
                t = t.to(self.wire_dtype)
            t = t.contiguous()
            work = dist.isend(t, dst=dst, tag=self._tag(kind, stage, microbatch, i))
            self._pending_sends.append((work, f"send of {kind} values of stage {stage}, micro-batch {microbatch} "
                                              f"to rank {dst}"))

    def recv(self, kind: str, stage: int, microbatch: int, specs: Sequence[CrossingValue | None], src: int
             ) -> list[torch.Tensor | None]:
        """Receive one tensor per non-None spec from `src` and wait for all of them."""
        if self.op_hook is not None:
            self.op_hook("recv", kind, stage, microbatch, src)
        out: list[torch.Tensor | None] = []
        works = []
        for i, spec in enumerate(specs):
            if spec is None or not spec.is_tensor:
                out.append(None)
                continue
            dtype = spec.dtype
            if self.wire_dtype is not None and dtype is not None and dtype.is_floating_point:
                dtype = self.wire_dtype
            buf = torch.empty(spec.shape, dtype=dtype, device=self.device)
            works.append(dist.irecv(buf, src=src, tag=self._tag(kind, stage, microbatch, i)))
            out.append(buf)
        for w in works:
            self._wait(w, f"receive of {kind} values of stage {stage}, micro-batch {microbatch} from rank {src}")
        return out

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            detail = _short(exc)
            raise P2PTimeout(f"{what} failed: {detail}") from exc
        if ok is False:
            raise P2PTimeout(f"{what} timed out after {self.timeout.total_seconds():.0f} s")

    def wait_sends(self) -> None:
        """Wait for every posted send (end of step)."""
        pending, self._pending_sends = self._pending_sends, []
        for w, what in pending:
            self._wait(w, what)
