"""autoplan: decide how to split a PyTorch model over a GPU cluster, and run that split.

    import autoplan
    plans = autoplan.suggest("llama3-8b", "2x8xH100-80GB", global_batch=512, seq_len=4096)
    print(plans[0].tp, plans[0].pp, plans[0].predicted.step_time_s)

The public names load on first use (PEP 562 module `__getattr__`): `import autoplan` and
`autoplan --help` / `--version` must not pay for torch, networkx and rich (about 1-2 s; issue 29),
and every command imports only what it runs. `from autoplan import suggest` works as before.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from autoplan._version import __version__

# Public name -> the module that defines it (imported on first access, then cached in globals()).
_LAZY: dict[str, str] = {
    "profile": "autoplan.api",
    "profile_with_graph": "autoplan.api",
    "suggest": "autoplan.api",
    "suggest_with_stats": "autoplan.api",
    "Cluster": "autoplan.cluster",
    "parse_cluster": "autoplan.cluster",
    "attach_aux_loss": "autoplan.graph.aux_loss",
    "aux_loss_scale": "autoplan.graph.aux_loss",
    "Block": "autoplan.graph.blocks",
    "ModelProfile": "autoplan.graph.blocks",
    "Plan": "autoplan.plan",
    "validate": "autoplan.plan",
    "PartitionedModel": "autoplan.runtime",
    "partition": "autoplan.runtime",
    "run_plan": "autoplan.runtime",
}

if TYPE_CHECKING:  # type checkers and IDEs see the eager imports
    from autoplan.api import profile, profile_with_graph, suggest, suggest_with_stats
    from autoplan.cluster import Cluster, parse_cluster
    from autoplan.graph.aux_loss import attach_aux_loss, aux_loss_scale
    from autoplan.graph.blocks import Block, ModelProfile
    from autoplan.plan import Plan, validate
    from autoplan.runtime import PartitionedModel, partition, run_plan

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if not name.startswith("_") and importlib.util.find_spec(f"autoplan.{name}") is not None:
            # `import autoplan; autoplan.runtime...`: a subpackage, bound as the eager imports once bound it
            value = importlib.import_module(f"autoplan.{name}")
            globals()[name] = value
            return value
        raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
