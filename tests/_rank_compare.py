"""One check the multi-rank numerics tests share: what every rank returned for a case equals a
single-process reference (the loss on the ranks that have it, and each parameter's gradient from the
rank that holds it whole)."""

from __future__ import annotations

import pytest
import torch


def assert_ranks_match_reference(name: str, results: dict, model: torch.nn.Module, ref_loss: float,
                                 ref_grads: dict[str, torch.Tensor], *, rtol: float) -> None:
    """`results`: rank -> case name -> {"loss": float | None, "grads": {parameter name: gradient}}.
    Every parameter of `model` must come back from some rank, and only names the reference has."""
    losses = [r[name]["loss"] for r in results.values() if r[name]["loss"] is not None]
    assert losses and all(loss == pytest.approx(ref_loss, rel=rtol) for loss in losses), (name, losses, ref_loss)
    grads = {}
    for r in results.values():
        grads.update(r[name]["grads"])
    assert set(grads) <= set(ref_grads) and len(grads) >= len(dict(model.named_parameters())), name
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=rtol, atol=rtol * scale,
                                   msg=lambda m, n=n: f"{name}: {n}: {m}")
