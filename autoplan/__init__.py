"""autoplan: decide how to split a PyTorch model over a GPU cluster, and run that split.

    import autoplan
    profile = autoplan.profile("llama3-8b", batch_size=1, seq_len=8192)
"""

from __future__ import annotations

__version__ = "0.1.0"

from autoplan.api import profile, profile_with_graph  # noqa: E402
from autoplan.graph.blocks import Block, ModelProfile  # noqa: E402

__all__ = ["Block", "ModelProfile", "__version__", "profile", "profile_with_graph"]
