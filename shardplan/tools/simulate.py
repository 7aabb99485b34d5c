"""Simulate: run an applied plan on the fake process group and record every collective.

Contract
--------
``record_collectives()`` (:mod:`shardplan.apply.collectives`) records each collective a run
issues as ``(kind, logical_bytes, ranks)``. ``simulate(model, plan,
example_inputs)`` applies ``plan`` under a fake process group of the plan's mesh size, runs
one forward and one backward, and returns the counted collectives per phase beside the
plan's prediction. Works on meta-device models, so 405B at tp=512 costs no memory.

With ``fsdp=True`` (or an :class:`~shardplan.apply.fsdp.FSDPOptions`) it also runs
``fully_shard_plan`` and counts FSDP2's own collectives, which are eager c10d ops
(``_allgather_base_``, ``_reduce_scatter_base_``, ``allreduce_``), not functional ones. FSDP
refuses meta parameters, so the run then materializes the model as fake CPU tensors
(``FakeTensorMode``): shapes and collectives are real, no memory and no arithmetic.
Collectives on a group other than the tp axis's go to a ``data_parallel`` phase (per step),
except expert parallelism's all-to-alls, which stay in their phase as the estimate counts them,
compared with the estimate's ``data_parallel`` entry; without ``fsdp`` that entry is not
compared (nothing ran on the data axes).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode, _clear_sharding_prop_cache

from ..apply.collectives import COLLECTIVE_OPS, record_collectives
from ..plan.model import Plan

__all__ = ["record_collectives", "simulate", "SimulationResult", "COLLECTIVE_OPS"]

DATA_PARALLEL = "data_parallel"


@dataclass
class SimulationResult:
    counted: dict[str, Counter] = field(default_factory=dict)
    counted_bytes: dict[str, int] = field(default_factory=dict)
    predicted: dict[str, dict[str, int]] = field(default_factory=dict)
    # the same run as DTensor's own CommDebugMode counts it, as a second witness
    comm_debug_mode: dict[str, Counter] = field(default_factory=dict)

    @property
    def matches(self) -> bool:
        return all(
            {k: v for k, v in self.counted.get(phase, Counter()).items() if v} == {k: v for k, v in want.items() if v}
            for phase, want in self.predicted.items()
        )


def _scalar_loss(out: Any) -> torch.Tensor:
    if hasattr(out, "logits"):
        out = out.logits
    elif hasattr(out, "to_tuple"):  # a Hugging Face ModelOutput: every tensor it returns
        return sum(t.float().sum() for t in out.to_tuple() if isinstance(t, torch.Tensor) and t.is_floating_point())
    if isinstance(out, (tuple, list)):
        out = out[0]
    if isinstance(out, DTensor):  # vocab-sharded logits: the loss runs under loss_parallel()
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            logits = out.flatten(0, -2)
            target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
            return torch.nn.functional.cross_entropy(logits, target)
    return out.float().sum()


def _backward(loss: torch.Tensor) -> None:
    if isinstance(loss, DTensor):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss.backward()
    else:
        loss.backward()


def simulate(
    model: torch.nn.Module, plan: Plan, example_inputs: tuple, example_kwargs: dict | None = None, *,
    comm_debug_mode: bool = False, fsdp: Any = None,
) -> SimulationResult:
    """Apply ``plan`` on a fake process group and count one forward + backward; with
    ``fsdp`` (``True`` or an ``FSDPOptions``), ``fully_shard_plan`` on the data axes too."""
    from ..apply.emit import apply_plan
    from ..apply.mesh import fake_process_group, make_mesh

    world = 1
    for n in plan.mesh.axes.values():
        world *= n
    estimated = plan.estimate.collectives if plan.estimate else {}
    result = SimulationResult(predicted={p: c.model_dump() for p, c in estimated.items() if fsdp or p != DATA_PARALLEL})
    # DTensor caches sharding decisions by mesh *value*: a cached spec would hand back the mesh
    # (and process groups) of an earlier fake world of the same shape, long destroyed
    _clear_sharding_prop_cache()
    with fake_process_group(world):
        mesh = make_mesh(plan.mesh.axes)
        apply_plan(model, mesh, plan)
        tp_ranks = tuple(dist.get_process_group_ranks(mesh[plan.mesh.tp_axis].get_group() if mesh.ndim > 1 else mesh.get_group()))
        with _fully_sharded(model, mesh, plan, fsdp) as to_device:
            inputs, kwargs = to_device(example_inputs), to_device(example_kwargs or {})
            # CommDebugMode's module tracker wraps module outputs in backward hooks, which some
            # models' in-place code rejects: it is an opt-in second witness
            witness = CommDebugMode if comm_debug_mode else contextlib.nullcontext
            with witness() as fwd_cdm, record_collectives(plan.tp) as fwd:
                out = model(*inputs, **kwargs)
            loss = _scalar_loss(out)
            with witness() as bwd_cdm, record_collectives(plan.tp) as bwd:
                _backward(loss)
    _count(result, fwd, bwd, tp_ranks, data_parallel=bool(fsdp))
    for phase, cdm in (("forward", fwd_cdm), ("backward", bwd_cdm)):
        if cdm is not None:
            result.comm_debug_mode[phase] = Counter(
                {COLLECTIVE_OPS.get(str(op).split(".")[-1], str(op)): n for op, n in cdm.get_comm_counts().items() if n}
            )
    return result


def _count(result: SimulationResult, fwd: list, bwd: list, tp_ranks: tuple[int, ...], *, data_parallel: bool) -> None:
    """Collectives on the tp group's ranks, or a sub-group of them (kv heads replicated on
    tp / groups ranks), and expert parallelism's all-to-alls (on the ep axis), per phase; any
    other group's (the data axes') per step."""
    def on_tp(e) -> bool:
        return e[2] is None or set(e[2]) <= set(tp_ranks) or e[0] == "all_to_all"

    phases = {"forward": [e for e in fwd if on_tp(e)], "backward": [e for e in bwd if on_tp(e)]}
    if data_parallel:
        phases[DATA_PARALLEL] = [e for e in fwd + bwd if not on_tp(e)]
    for phase, events in phases.items():
        result.counted[phase] = Counter(kind for kind, _, _ in events)
        result.counted_bytes[phase] = sum(n for _, n, _ in events)


@contextlib.contextmanager
def _fully_sharded(model: torch.nn.Module, mesh: Any, plan: Plan, fsdp: Any) -> Iterator[Any]:
    """Without ``fsdp``: nothing, inputs as given. With it: ``fully_shard_plan``, then a meta
    model's parameters materialized and its inputs made fake CPU tensors, since FSDP refuses
    to run on meta parameters (a model on the CPU runs as it is)."""
    if not fsdp:
        yield lambda tree: tree
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    from ..apply.fsdp import FSDPOptions, fully_shard_plan

    fully_shard_plan(model, mesh, plan, options=fsdp if isinstance(fsdp, FSDPOptions) else None)
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        yield lambda tree: tree  # real CPU tensors (expert dispatch counts tokens by value): run as they are
        return
    with FakeTensorMode(allow_non_fake_inputs=True):
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            model.to_empty(device="cpu")
        yield lambda tree: tree_map(
            lambda t: torch.zeros(t.shape, dtype=t.dtype, device="cpu") if isinstance(t, torch.Tensor) else t, tree)
