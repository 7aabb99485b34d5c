"""Decide: price every way to split each weight and pick the plan, exactly.

Contract
--------
:mod:`.placements` is the strategy record; :mod:`.strategies` lists the placements each
plain op runs under shard-locally and :mod:`.weights` the styles of each weight module
(colwise, rowwise, packed, vocab-parallel, sequence parallel, experts, kv heads in groups);
:mod:`.heads` adds the strategies of heads shared across ranks (fewer kv heads than tp,
MLA's shared key), :mod:`.folded` those of heads folded into the batch, :mod:`.slices`
those that cut a whole bias where its module receives it, :mod:`.scatter` those of a MoE
block that gathers the tokens where it receives them and reduce-scatters its partial sums
where it returns, :mod:`.elementwise` finds the
modules with scalar parameters that act entry by entry, and :mod:`.propagation` gives
the strategies DTensor's own rules give. :mod:`.hardware`
holds the dtypes and hardware profiles, :mod:`.cost` the alpha-beta communication, memory
and compute model over them. :mod:`.solve`
builds the placement program (one binary per op and strategy, consistency between
producer and consumer) and solves it with HiGHS (:mod:`.milp`, the solver backend): least
weight bytes per device first, then the fastest plan among those. :mod:`.regions` finds values whose collective several Linears
can share; :mod:`.estimate` predicts memory, bytes, collectives and step time;
:mod:`.explain` prices each rejected alternative; :mod:`.assemble` writes the rules and
regions of the :class:`~shardplan.plan.Plan` and :mod:`.shortfalls` its warnings. :mod:`.axes` says what each named mesh axis is (tensor parallel, data, or refused); :mod:`.fsdp` lists the FSDP2
units of a plan (what ``fully_shard_plan`` wraps and the estimate prices on the data axes),
and :mod:`.splits` compares the dp x tp splits of a world size. Everything here is a pure
function of the graph and the options: no process group, no rank, no BLAS-dependent sums.
Importing this package loads nothing heavy (the CLI reads :mod:`.hardware`'s profiles for help).
"""
