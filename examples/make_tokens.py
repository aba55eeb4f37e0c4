"""Writes examples/tokens.bin, the small token file the README's training example reads: 8,192 token
ids below 256 (the README's toy GPT vocabulary) as nanoGPT's prepare.py writes its train.bin, uint16
(docs/training.md). Real data: tokenize your text with your model's tokenizer and write the ids the
same way.

    python examples/make_tokens.py examples/tokens.bin
"""

from __future__ import annotations

import sys

import numpy as np

# A repeating pattern with noise: a model can learn it, so the README run's loss falls.
rng = np.random.default_rng(0)
pattern = rng.integers(0, 256, 64)
ids = np.tile(pattern, 128)
noise = rng.random(ids.size) < 0.1
ids[noise] = rng.integers(0, 256, int(noise.sum()))
ids.astype(np.uint16).tofile(sys.argv[1] if len(sys.argv) > 1 else "tokens.bin")
