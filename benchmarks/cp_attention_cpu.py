"""Context parallelism's attention on CPU, before and after issue 31: the mask and the peak memory of
one rank's attention (forward and backward) over the all-gathered keys, side by side in one run.

    python benchmarks/cp_attention_cpu.py [--seq-len 16384] [--cp 2] [--heads 2] [--head-dim 64]

Before: the local queries (S/cp of them, chunks i and 2cp-1-i) against all S keys with the causal
mask written out from positions, an (S/cp x S) boolean tensor. After (runtime/parallel/context.py): one call
per local chunk over the keys it sees, with `causal_lower_right` (on CPU a (S/2cp x keys) mask per
chunk, built inside the call, as runtime/parallel/context.py calls it; on CUDA the efficient kernel without one). Rank 0 of the cp group is
measured (its chunks 0 and 2cp-1: the first sees S/2cp keys, the last all S). Peak memory is the
largest sum of the tensors the operators of the call make (forward and backward) live at once, above
what the inputs hold (`_LiveBytes`); both paths' outputs and gradients are checked equal.
"""

from __future__ import annotations

import argparse
import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import TorchDispatchMode


def positions(seq_len: int, cp: int, index: int) -> torch.Tensor:
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(index * size, (index + 1) * size),
                      torch.arange((2 * cp - 1 - index) * size, (2 * cp - index) * size)])


def before(q, k, v, seq_len: int, cp: int):
    mask = torch.arange(seq_len).unsqueeze(0) <= positions(seq_len, cp, 0).unsqueeze(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), mask.numel() * mask.element_size()


def after(q, k, v, seq_len: int, cp: int):
    size = seq_len // (2 * cp)
    bias = _BIASES[(size, seq_len)]
    out, mask_bytes = [], 0
    for row, start in ((0, 0), (size, (2 * cp - 1) * size)):
        keys = start + size
        args = (q[..., row:row + size, :], k[..., :keys, :], v[..., :keys, :])
        if keys == size:
            out.append(F.scaled_dot_product_attention(*args, is_causal=True))
            continue
        mask_bytes += size * keys  # what CausalBias materializes on CPU (bool)
        out.append(CausalBias._dispatch(*args, bias, 0.0, False, None, False))
    return torch.cat(out, dim=-2), mask_bytes


_BIASES: dict[tuple[int, int], CausalBias] = {}
"""The chunks' biases, made before the measurement (a tensor subclass cannot be made under a dispatch
mode); only rank 0's last chunk, which sees all keys, needs one."""


class _LiveBytes(TorchDispatchMode):
    """The bytes of the tensors that operators make, live at once: their peak (a storage is counted
    from the operator that makes it until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                self.seen.add(key)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, nbytes)
        return out


def measure(fn, q, k, v, seq_len: int, cp: int):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    with _LiveBytes() as mode:
        out, mask_bytes = fn(q, k, v, seq_len, cp)
        out.sum().backward()
    return out.detach(), (q.grad, k.grad, v.grad), mask_bytes, mode.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    s, cp = args.seq_len, args.cp
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, s // cp, args.head_dim, generator=gen)
    k, v = (torch.randn(1, args.heads, s, args.head_dim, generator=gen) for _ in range(2))
    _BIASES[(s // (2 * cp), s)] = causal_lower_right(s // (2 * cp), s)
    results = {name: measure(fn, q, k, v, s, cp) for name, fn in (("before", before), ("after", after))}
    (out0, grads0, *_), (out1, grads1, *_) = results["before"], results["after"]
    torch.testing.assert_close(out1, out0, rtol=1e-4, atol=1e-5)
    for g1, g0 in zip(grads1, grads0):
        torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-5)
    print(f"seq_len {s}, cp {cp}, heads {args.heads}, head_dim {args.head_dim}, rank 0 of the cp group "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads); outputs and gradients equal")
    print(f"{'':8} {'mask MiB':>10} {'peak MiB':>10}")
    for name, (*_, mask_bytes, peak) in results.items():
        print(f"{name:8} {mask_bytes / 2**20:10.1f} {peak / 2**20:10.1f}")
    (_, _, m0, p0), (_, _, m1, p1) = results["before"], results["after"]
    print(f"after / before: mask {m1 / m0:.3f}, peak {p1 / p0:.3f}")


if __name__ == "__main__":
    main()
