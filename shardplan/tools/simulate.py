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
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
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
}


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
        if kind is not None and isinstance(args[0], torch.Tensor):
            local = args[0].numel() * args[0].element_size()
            group = _group_size(args, self.group_size)
            self.events.append((kind, local * group if kind == "all_gather" else local))
        return func(*args, **(kwargs or {}))


def _group_size(args: tuple, default: int) -> int:
    for a in args[1:]:
        if isinstance(a, int) and not isinstance(a, bool) and a > 1:
            return a
    return default


@contextlib.contextmanager
def record_collectives(group_size: int) -> Iterator[list[tuple[str, int]]]:
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
    comm_debug_mode: bool = False,
) -> SimulationResult:
    """Apply ``plan`` on a fake process group and count one forward + backward."""
    from ..apply.emit import apply_plan
    from ..apply.mesh import fake_process_group, make_mesh

    world = 1
    for n in plan.mesh.axes.values():
        world *= n
    result = SimulationResult(predicted={p: c.model_dump() for p, c in (plan.estimate.collectives if plan.estimate else {}).items()})
    with fake_process_group(world):
        mesh = make_mesh(plan.mesh.axes)
        apply_plan(model, mesh, plan)
        # CommDebugMode's module tracker wraps module outputs in backward hooks, which some
        # models' in-place code rejects: it is an opt-in second witness
        witness = CommDebugMode if comm_debug_mode else contextlib.nullcontext
        with witness() as fwd_cdm, record_collectives(plan.tp) as fwd:
            out = model(*example_inputs, **(example_kwargs or {}))
        loss = _scalar_loss(out)
        with witness() as bwd_cdm, record_collectives(plan.tp) as bwd:
            _backward(loss)
    for phase, events, cdm in (("forward", fwd, fwd_cdm), ("backward", bwd, bwd_cdm)):
        result.counted[phase] = Counter(kind for kind, _ in events)
        result.counted_bytes[phase] = sum(n for _, n in events)
        if cdm is not None:
            result.comm_debug_mode[phase] = Counter(
                {COLLECTIVE_OPS.get(str(op).split(".")[-1], str(op)): n for op, n in cdm.get_comm_counts().items() if n}
            )
    return result

