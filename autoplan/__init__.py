"""autoplan: decide how to split a PyTorch model over a GPU cluster, and run that split.

    import autoplan
    plans = autoplan.suggest("llama3-8b", "2x8xH100-80GB", global_batch=512, seq_len=4096)
    print(plans[0].tp, plans[0].pp, plans[0].predicted.step_time_s)
"""

from __future__ import annotations

__version__ = "0.1.0"

from autoplan.api import profile, profile_with_graph, suggest, suggest_with_stats  # noqa: E402
from autoplan.cluster import Cluster, parse_cluster  # noqa: E402
from autoplan.graph.aux_loss import attach_aux_loss, aux_loss_scale  # noqa: E402
from autoplan.graph.blocks import Block, ModelProfile  # noqa: E402
from autoplan.plan import Plan, validate  # noqa: E402
from autoplan.runtime import PartitionedModel, partition, run_plan  # noqa: E402

__all__ = [
    "Block",
    "Cluster",
    "ModelProfile",
    "PartitionedModel",
    "Plan",
    "__version__",
    "attach_aux_loss",
    "aux_loss_scale",
    "parse_cluster",
    "partition",
    "profile",
    "profile_with_graph",
    "run_plan",
    "suggest",
    "suggest_with_stats",
    "validate",
]
