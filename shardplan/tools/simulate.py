"""Simulate: run an applied plan on the fake process group and record every collective.

Contract
--------
``record_collectives()`` is a context manager (a ``TorchDispatchMode``) that records each
functional collective DTensor issues as ``(kind, logical_bytes)``; logical bytes are the
size of the whole tensor the collective is about (an all-gather's output, an all-reduce's
or reduce-scatter's input), the quantity the cost model prices. ``simulate(model, plan,
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
from torch.utils._python_dispatch import TorchDispatchMode

from ..plan.model import Plan

__all__ = ["record_collectives", "simulate", "SimulationResult", "COLLECTIVE_OPS"]

COLLECTIVE_OPS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    # eager c10d ops: FSDP2 issues these, not functional collectives
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "alltoall_base_": "all_to_all",  # expert parallelism's count exchange
}
# the argument holding the whole tensor(s): an all-gather's output, a reduce-scatter's input
_C10D_WHOLE_ARG = {"_allgather_base_": 0, "allgather_into_tensor_coalesced_": 0, "_reduce_scatter_base_": 1,
                   "reduce_scatter_tensor_coalesced_": 1, "allreduce_": 0, "alltoall_base_": 1}
DATA_PARALLEL = "data_parallel"


class _Recorder(TorchDispatchMode):
    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []
        self.group_size = group_size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # let DTensor desugar first: the collectives it issues come back through this mode
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        kind = COLLECTIVE_OPS.get(name)
        if kind is not None and name in _C10D_WHOLE_ARG:
            whole = args[_C10D_WHOLE_ARG[name]]
            tensors = whole if isinstance(whole, (list, tuple)) else [whole]
            self.events.append((kind, sum(t.numel() * t.element_size() for t in tensors), _group_ranks(args)))
        elif kind is not None and isinstance(args[0], torch.Tensor):
            local = args[0].numel() * args[0].element_size()
            group = _group_size(args, self.group_size)
            self.events.append((kind, local * group if kind == "all_gather" else local, _group_ranks(args)))
        return func(*args, **(kwargs or {}))


def _group_ranks(args: tuple) -> tuple[int, ...] | None:
    """The global ranks of the process group a collective runs on (a functional collective
    names its group last among its string arguments, after the reduce op; a c10d op passes
    the group itself). Ranks, not the name: torch may build a second group over the same
    ranks (a tp sub-mesh sliced out of FSDP's (dp, tp) mesh), and it is the same axis."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = next((dist.ProcessGroup.unbox(a) for a in args
                  if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())), None)
    names = [a for a in args if isinstance(a, str)]
    if group is None and names:
        group = _resolve_process_group(names[-1])
    return tuple(dist.get_process_group_ranks(group)) if group is not None else None


def _group_size(args: tuple, default: int) -> int:
    for a in args[1:]:
        if isinstance(a, int) and not isinstance(a, bool) and a > 1:
            return a
    return default


@contextlib.contextmanager
def record_collectives(group_size: int) -> Iterator[list[tuple[str, int, tuple[int, ...] | None]]]:
    """Records ``(kind, logical bytes, global ranks of its group)`` per collective."""
    rec = _Recorder(group_size)
    with rec:
        yield rec.events


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
