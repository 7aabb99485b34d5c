"""Collectives: a record of every collective a run issues, for the checks that count them.

Contract
--------
``record_collectives(group_size)`` is a context manager (a ``TorchDispatchMode``) that
records each collective as ``(kind, logical_bytes, global ranks of its group)``: the
functional collectives DTensor issues (it lets DTensor desugar first, so its
redistributions come back through the mode) and the eager c10d ops FSDP2 issues. Logical
bytes are the size of the whole tensor the collective is about (an all-gather's output, an
all-reduce's or reduce-scatter's input), the quantity the cost model prices. Used by
:mod:`shardplan.tools.simulate` (a whole step against the estimate) and by the local check
(a ``norm_sharded`` module's own collectives).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["COLLECTIVE_OPS", "record_collectives"]

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
