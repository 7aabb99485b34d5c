"""Expert parallelism: whole experts per rank over an ``ep`` mesh axis, tokens dispatched by all-to-all.

Contract
--------
``ExpertParallel()`` is a ``ParallelStyle`` for an expert bank that the model calls as
``bank(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` and that applies
the routing weights itself (Hugging Face's routed banks: Mixtral, Qwen3-MoE, DeepSeek-V3,
gpt-oss, ...), or as ``bank(num_tokens_per_expert [E], rows [N, H]) -> [N, H]`` (either
order) on rows the model sorted by expert (torchtitan's ``GroupedExperts``: the layer routes,
sorts, scales and adds back itself), or as ``bank(rows [E T, H])`` on every token once per
expert, pre-scaled and expert-major (Llama 4's: sorted rows of T per expert), applied with a
1-D ``ep`` mesh or a 2-D ``(ep, tp)`` one. Its 3-D weights
and 2-D biases become ``Shard(0)`` DTensors: rank ``r`` of ``ep`` holds experts
``[r E/ep, (r + 1) E/ep)``, whole, or on ``(ep, tp)`` split inside over tp as
``moe_tp_experts`` splits them (the class doc).

A call on each rank (its own tokens; ``ep`` is a data axis everywhere else):

1. its ``(token, slot)`` pairs sorted by expert, so by owner rank; the counts exchanged
   (``all_to_all_single``: the one host sync), then the rows (``all_to_all_single_autograd``);
2. the bank's own forward on the rows received, with the rank's experts as the bank
   (``num_experts`` and the parameters swapped for the call only), top-1 at weight 1;
3. the rows sent back the same way, put back in ``(token, slot)`` order, and the routing
   weights applied on the sending rank, where the router's gradient belongs.

Sorted rows (the second convention) skip steps 1's sort and 3's weights: the counts say
which run of rows goes to which rank; the rows received (by sending rank, then expert) are
regrouped by expert for the bank and put back before they return.

A rank that receives no rows still runs one zero row through its experts and drops it: its
backward then takes part in the return all-to-all (without it the other ranks wait forever).

Gradients: the all-to-all's backward sums every rank's contribution to each expert, which is
``ep`` times the mean a data-parallel average gives; the local weights' gradients are scaled
by ``1 / ep`` so that expert and dense gradients follow one convention (the mean over data
ranks, as DDP and FSDP average). Nothing about the module changes for good but its
parameters (DTensors) and its ``forward``.

Uniform routing is what the cost model assumes; this code does not: any split of the pairs,
empty ones included, is exchanged as it comes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from .dispatch import ScaleGrad, by_expert, exchange, send
from .styles import _CopyToTP, _ReduceFromTP, _ScaleForward, expert_tp_placements

__all__ = ["ExpertParallel", "WholeExperts", "bank_size"]


def bank_size(module: nn.Module) -> int:
    """E, the experts of a bank: the first dim shared by all its parameters."""
    sizes = {p.shape[0] for p in module.parameters(recurse=False)}
    if len(sizes) != 1:
        raise ValueError(f"{type(module).__name__}: expert parameters of first dims {sorted(sizes)}; "
                         "expected one expert count E shared by every weight [E, ...] and bias [E, ...]")
    return sizes.pop()


class ExpertParallel(ParallelStyle):
    """Whole experts over the ``ep`` mesh axis; see the module doc.

    On a 2-D ``(ep, tp)`` mesh the rank's experts are also split inside over tp as
    ``moe_tp_experts`` splits them (``inner_tp=True``: up on its features, down on its inner
    dim, :func:`.styles.expert_tp_placements`), or held whole on every tp rank (False). The tp
    ranks share their tokens, so each runs the same dispatch over its own ep group; inside,
    each tp rank's experts give a partial sum of every row: the tokens and the routing weights
    enter by Megatron's "f" (gradient all-reduced over tp), a down bias is added / tp, and the
    output is all-reduced over tp once, after the routing weights (``reduce_output=False``,
    ``output_layouts: Partial``: left as partial sums for the MoE block's return to
    reduce-scatter onto sequence shards)."""

    def __init__(self, *, inner_tp: bool = False, reduce_output: bool = True) -> None:
        super().__init__()
        self.inner_tp, self.reduce_output = inner_tp, reduce_output

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        ep_mesh = device_mesh if device_mesh.ndim == 1 else device_mesh[device_mesh.mesh_dim_names[0]]
        tp_mesh = None if device_mesh.ndim == 1 else device_mesh[device_mesh.mesh_dim_names[1]]
        ep = ep_mesh.size()
        experts = bank_size(module)
        if experts % ep:
            raise ValueError(f"{type(module).__name__} has {experts} experts, which ep={ep} does not divide; "
                             f"use an ep that divides {experts}")
        inner = dict(expert_tp_placements(module)) if self.inner_tp and tp_mesh is not None else {}
        for name, p in list(module.named_parameters(recurse=False)):
            where = [Shard(0)] + ([inner.get(name, Replicate())] if tp_mesh is not None else [])
            shard = distribute_tensor(p.detach(), device_mesh, where, src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
        split = tp_mesh is not None and self.inner_tp
        tp = _TpInside(tp_mesh.get_group().group_name, tp_mesh.size(), _down_bias(module), self.reduce_output) if split else None
        run = module.forward
        module.forward = partial(_ep_forward, module, run, group=ep_mesh.get_group(), ep=ep, local=experts // ep, tp=tp)
        return module


@dataclass(frozen=True)
class _TpInside:
    group: str
    size: int
    down_bias: str | None
    reduce_output: bool


def _down_bias(module: nn.Module) -> str | None:
    from ..analyze.graph import expert_params

    return expert_params(module).down_bias


@contextmanager
def _local_bank(module: nn.Module, *, local: int, ep: int, tp: _TpInside | None) -> Iterator[None]:
    """The rank's experts as the bank for one call: local tensors of the DTensor parameters
    (differentiable, their gradients scaled by 1 / ep; a down bias split inside over tp is
    added / tp, as the sum over tp then adds it once) and ``num_experts`` set to their count."""
    saved = dict(module._parameters)
    count = getattr(module, "num_experts", None)
    try:
        for name, p in saved.items():
            if p is not None:
                local_p = p.to_local()
                if tp is not None and name == tp.down_bias:  # bias / tp forward, its whole gradient back
                    local_p = _ScaleForward.apply(local_p, 1.0 / tp.size)
                module._parameters[name] = ScaleGrad.apply(local_p, 1.0 / ep)
        if count is not None:
            module.num_experts = local
        yield
    finally:
        module._parameters.update(saved)
        if count is not None:
            module.num_experts = count


def _ep_forward(module: nn.Module, run: Callable, *args: torch.Tensor, group: Any, ep: int, local: int,
                tp: _TpInside | None) -> torch.Tensor:
    if len(args) == 3:
        return _ep_routed(module, run, *args, group=group, ep=ep, local=local, tp=tp)
    counts, rows, call = _sorted_call(module, run, args, experts=local * ep)
    return _ep_sorted(module, call, counts, rows, group=group, ep=ep, local=local, tp=tp)


def _sorted_call(module: nn.Module, run: Callable, args: tuple, *, experts: int) -> tuple:
    """``(counts [E], rows sorted by expert, run(counts, rows))`` of a bank called on sorted
    rows: ``(num_tokens_per_expert, rows)`` in either order (torchtitan's), or one ``[E T, H]``
    tensor, every token once per expert, pre-scaled and expert-major (Llama 4's: T per expert)."""
    if len(args) == 1:
        rows = args[0]
        if rows.dim() != 2 or rows.shape[0] % experts:
            raise ValueError(f"{type(module).__name__} was called on one tensor of shape {tuple(rows.shape)}; expert "
                             f"parallelism reads one argument as every token once per expert, [E T, H] with E = "
                             f"{experts}; call the bank with its routing (hidden, top_k_index, top_k_weights)")
        counts = torch.full((experts,), rows.shape[0] // experts, dtype=torch.int64, device=rows.device)
        return counts, rows, lambda _c, r: run(r)
    counts_first = args[0].dim() == 1 and not args[0].is_floating_point()
    counts, rows = args if counts_first else args[::-1]
    return counts, rows, run if counts_first else (lambda c, r: run(r, c))


def _ep_sorted(module: nn.Module, run: Callable, counts: torch.Tensor, rows: torch.Tensor, *, group: Any, ep: int,
               local: int, tp: _TpInside | None) -> torch.Tensor:
    """``run(counts, rows)`` on this rank's experts and the rows the ranks send them."""
    if tp is not None and rows.requires_grad:
        rows = _CopyToTP.apply(rows, tp.group)
    got, received, sizes = send(rows, counts.reshape(ep, local).to(torch.int64), group)
    # got holds rank 0's rows for our expert 0, 1, ..., then rank 1's: regroup by expert
    perm = by_expert(received)
    with _local_bank(module, local=local, ep=ep, tp=tp):
        if got.shape[0]:
            y = run(received.sum(0), got[perm])[torch.argsort(perm)]
        else:  # nothing received: one zero row keeps this rank in the backward's all-to-all
            zero = got.sum(0, keepdim=True)
            y = run(torch.nn.functional.one_hot(received.new_zeros(()), local), zero)[:0]
    out = exchange(y, *sizes, group)
    return _ReduceFromTP.apply(out, tp.group) if tp is not None and tp.reduce_output else out


def _ep_routed(module: nn.Module, run: Callable, hidden: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, *, group: Any, ep: int, local: int, tp: _TpInside | None) -> torch.Tensor:
    if tp is not None:  # the tp ranks' partial sums meet below: these gradients are summed over tp
        hidden, top_k_weights = (_CopyToTP.apply(t, tp.group) if t.requires_grad else t for t in (hidden, top_k_weights))
    k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)  # pairs by expert, so by the rank that owns it
    outgoing = hidden.reshape(-1, hidden.shape[-1])[order // k]
    rows, received, sizes = send(outgoing, torch.bincount(ids, minlength=local * ep).view(ep, local), group)
    # rank j sent its rows for our expert 0, then expert 1, ...: each row's local expert id
    local_ids = torch.arange(local, device=ids.device).repeat(ep).repeat_interleave(received.reshape(-1)).unsqueeze(-1)
    with _local_bank(module, local=local, ep=ep, tp=tp):
        if rows.shape[0]:
            y = run(rows, local_ids, torch.ones_like(local_ids, dtype=rows.dtype))
        else:  # nothing received: one zero row keeps this rank in the backward's all-to-all
            zero = rows.sum(0, keepdim=True)
            y = run(zero, local_ids.new_zeros(1, 1), zero.new_ones(1, 1))[:0]
    back = exchange(y, *sizes, group)
    pairs = torch.empty_like(back)
    pairs[order] = back
    out = _weighted(pairs, top_k_weights, hidden)
    return _ReduceFromTP.apply(out, tp.group) if tp is not None and tp.reduce_output else out


class WholeExperts(ParallelStyle):
    """Whole experts over the tp axis (``moe_whole_experts``): rank r of tp holds experts
    ``[r E/tp, (r + 1) E/tp)`` whole (``Shard(0)`` DTensors). The tp ranks share their tokens,
    so no token moves: each rank runs its experts on the rows routed to them, leaves zeros
    for the others, and one all-reduce sums the ranks' outputs (Hugging Face's all-reduce
    expert parallelism, whose ep group is the tp group). The tokens and routing weights
    enter by Megatron's "f" (identity forward, gradient all-reduced over tp): each rank's
    experts give a partial gradient of them. An expert's weight gradients come from every
    routed row of the shared batch, on the one rank that holds it: the one-process gradient.
    The three calling conventions of :class:`ExpertParallel` (module doc) are taken: routed
    ``(hidden, top_k_index, top_k_weights)``, sorted rows with their counts, and Llama 4's
    ``[E T, H]``. ``reduce_output=False`` (``output_layouts: Partial``) hands the partial
    sums on for the MoE block's return to reduce-scatter onto sequence shards."""

    def __init__(self, *, reduce_output: bool = True) -> None:
        super().__init__()
        self.reduce_output = reduce_output

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        tp, experts = device_mesh.size(), bank_size(module)
        if experts % tp:
            raise ValueError(f"{type(module).__name__} has {experts} experts, which tp={tp} does not divide; "
                             f"plan it moe_tp_experts, or use a tp that divides {experts}")
        for name, p in list(module.named_parameters(recurse=False)):
            shard = distribute_tensor(p.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
        tp_group = _TpInside(device_mesh.get_group().group_name, tp, None, self.reduce_output)
        module.forward = partial(_whole_forward, module, module.forward, rank=device_mesh.get_local_rank(),
                                 local=experts // tp, tp=tp_group)
        return module


def _whole_forward(module: nn.Module, run: Callable, *args: torch.Tensor, rank: int, local: int,
                   tp: _TpInside) -> torch.Tensor:
    args = tuple(_CopyToTP.apply(t, tp.group) if t.requires_grad else t for t in args)
    if len(args) == 3:
        out = _whole_routed(module, run, *args, rank=rank, local=local)
    else:
        counts, rows, call = _sorted_call(module, run, args, experts=local * tp.size)
        out = _whole_sorted(module, call, counts, rows, rank=rank, local=local, tp=tp.size)
    return _ReduceFromTP.apply(out, tp.group) if tp.reduce_output else out


def _whole_routed(module: nn.Module, run: Callable, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, *, rank: int, local: int) -> torch.Tensor:
    """The (token, slot) pairs routed to this rank's experts, run at weight 1 with local ids,
    put back among zeros, then weighted and summed over the slots as one process does."""
    k, width = top_k_index.shape[-1], hidden.shape[-1]
    ids = top_k_index.reshape(-1)
    mine = torch.nonzero(ids // local == rank).squeeze(-1)
    rows = hidden.reshape(-1, width)[mine // k]
    local_ids = (ids[mine] - rank * local).unsqueeze(-1)
    with _local_bank(module, local=local, ep=1, tp=None):
        if rows.shape[0]:
            y = run(rows, local_ids, torch.ones_like(local_ids, dtype=rows.dtype))
        else:  # no rows here: one zero row keeps the tokens' gradient (and its all-reduce) on this rank
            zero = rows.sum(0, keepdim=True)
            y = run(zero, local_ids.new_zeros(1, 1), zero.new_ones(1, 1))[:0]
    return _weighted(y.new_zeros(ids.shape[0], width).index_copy(0, mine, y), top_k_weights, hidden)


def _weighted(pairs: torch.Tensor, top_k_weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Each token's output as one process makes it: its k (token, slot) rows, in that order,
    times their routing weights, summed over the slots, in the tokens' dtype and shape."""
    k = top_k_weights.shape[-1]
    weights = top_k_weights.reshape(-1, k, 1).to(pairs.dtype)
    return (pairs.view(-1, k, pairs.shape[-1]) * weights).sum(1).to(hidden.dtype).view(hidden.shape)


def _whole_sorted(module: nn.Module, run: Callable, counts: torch.Tensor, rows: torch.Tensor, *, rank: int,
                  local: int, tp: int) -> torch.Tensor:
    """``run(counts, rows)`` on the run of rows sorted to this rank's experts, among zeros."""
    per_rank = counts.reshape(tp, local).to(torch.int64)
    start, size = (int(n) for n in (per_rank[:rank].sum(), per_rank[rank].sum()))  # the one host sync
    with _local_bank(module, local=local, ep=1, tp=None):
        if size:
            y = run(per_rank[rank], rows[start:start + size])
        else:  # as _whole_routed: one zero row, dropped
            zero = rows[:0].sum(0, keepdim=True)
            y = run(torch.nn.functional.one_hot(per_rank.new_zeros(()), local), zero)[:0]
    return torch.nn.functional.pad(y, (0, 0, start, rows.shape[0] - start - size))
