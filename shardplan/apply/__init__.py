"""Apply: the emitter, a thin loop from a plan to ``parallelize_module``.

Contract
--------
:mod:`.styles` holds the ``ParallelStyle`` classes shardplan adds to torch's (replicated
parameters, packed fused projections, Conv1D, expert banks, containers, vocab-parallel
embeddings on local tensors) and :mod:`.head_styles` those for heads shared across ranks
(kv heads in groups, MLA's shared key); :mod:`.emit`
maps each rule and region to a style, applies them on the plan's tensor-parallel mesh
axis, re-ties shared weights and installs :mod:`.gradsync` (one bucketed all-reduce of
the Partial norm gradients sequence parallel leaves, once per optimizer step).
These three are the only modules that import torch's TP styles. :mod:`.mesh` makes the fake
process group and named meshes; :mod:`.localcheck` applies a plan on a fake group to a
meta copy of the model and runs it, so a split that the model's own code cannot run
(a hard-coded head count) is found while planning; :mod:`.localsizes` then finds the
integer attributes, or the views (:mod:`.localviews`, installed by the emitter), that let it
run on its shards. :mod:`.state` gives and takes a sharded
model's state in the unsharded model's layout, :mod:`.load` materializes a meta-built model
shard by shard and reads each rank's slices of a safetensors checkpoint, :mod:`.fsdp` adds
FSDP2 on the data axes and :mod:`.compile` compiles the repeated blocks.
"""
