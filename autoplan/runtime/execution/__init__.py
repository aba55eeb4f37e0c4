"""Running a step: the pipeline executor and its transfers, the running `PartitionedModel`, the
dimensions' hooks it calls (dimensions/), recomputation and gradient clipping (docs/architecture.md, "A schedule is data").
"""
