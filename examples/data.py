"""Your own batches for `autoplan run --data examples/data.py:batches` (here: a toy copy task).

autoplan calls `batches(step, batch_size, seq_len)` on every rank for every step; it returns the
global batch as (inputs, target): inputs are the model's forward arguments (a tensor or a tuple),
the target what the loss compares the output with. Each data-parallel replica takes its rows.
"""

from __future__ import annotations

import torch


def batches(step: int, batch_size: int, seq_len: int):
    gen = torch.Generator().manual_seed(step)  # a pure function of the step: resumed runs see the same data
    ids = torch.randint(0, 8192, (batch_size, seq_len), generator=gen)
    return (ids,), ids  # predict each token itself
