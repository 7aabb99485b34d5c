"""Analyze: from a model and example inputs to the op graph the planner decides on.

Contract
--------
:mod:`.trace` runs the model on the meta device (nothing is allocated; a 405B model costs
no memory) under a ``torch.fx`` tracer that carries meta tensors along, so every value has
a shape; weight-bearing modules stay leaves and repeated blocks are traced once; where code
reads a value, :mod:`.values` computes it from the example inputs.
:mod:`.export` is the second front end, torch.export on fake tensors rewritten into the
same graph form, for code the tracer cannot follow; :mod:`.frontend` chooses between them.
:mod:`.graph` turns the trace into an :class:`~.graph.OpGraph` (``networkx``): weight
modules and the ops between them, with shapes, multiplicities and source lines.
:mod:`.snapshot` puts the user's model back as it was, whatever its forward wrote to it
while it was traced (planning never changes the user's model). Nothing here knows
sharding, costs or plans; the stages above read this graph.
"""
