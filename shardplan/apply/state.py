"""State: a sharded model's state in the unsharded model's own layout, and back.

Contract
--------
``full_state_dict(model)`` returns ``{name: tensor}`` with every DTensor gathered
(``full_tensor``) and every expert another ep rank holds (:mod:`.experts_listed`)
broadcast from it, in the layout the unsharded model has: the same keys as its
``state_dict()`` and, for packed weights too, the same element order (see
:func:`.styles.packed_placement`), so a file written from it loads into the plain model.
``load_full_state_dict(model, state_dict)`` is its inverse: each rank copies its own slice
of every tensor into its shards, with no communication (every rank holds the whole dict;
the keys of experts other ep ranks hold are theirs).
Both are collective when ``model`` is sharded: every rank calls them. Resharding through a
checkpoint (save at tp=a, load at tp=b) needs nothing from shardplan: DCP
(``torch.distributed.checkpoint``) saves the DTensors' global views and loads them under
any placement, optimizer state included, because those views do not depend on tp.
``local_runs(t)`` says which global elements a rank holds, per dim, as DTensor itself cuts
them; DCP's chunks of a packed weight and ``load_checkpoint``'s file reads both come from it.
Packed weights of unequal parts (:class:`.packed.PackedShard`: GQA's fused [Q; K; V]) take
the same paths: their global view is the module's own [Q; K; V], with one DCP chunk per part.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .experts_listed import gather_listed_state, held_elsewhere
from .packed import PackedShard, distribute

__all__ = ["full_state_dict", "load_full_state_dict", "local_runs"]


def full_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Every entry of ``model.state_dict()`` as a plain tensor (on the CPU unless ``cpu=False``).
    Each DTensor is one all-gather; call it on every rank."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"full_state_dict needs an nn.Module; got {type(model).__name__}")
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = full.detach().cpu() if cpu else full.detach()
    return gather_listed_state(model, out) if held_elsewhere(model) else out


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy an unsharded state dict into ``model``: each DTensor takes its own slice, cut
    locally (``distribute(..., src_data_rank=None)``, ``distribute_tensor`` keeping a packed
    weight's unequal parts: every rank has the whole tensor, so nothing is sent). ``strict`` refuses missing or unexpected keys and shape mismatches."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"load_full_state_dict needs an nn.Module; got {type(model).__name__}")
    own = model.state_dict()
    elsewhere = held_elsewhere(model)  # experts other ep ranks hold: theirs to load
    _check_keys(own, {k: v for k, v in state_dict.items() if k not in elsewhere}, strict=strict)
    with torch.no_grad():
        for name, target in own.items():
            if name in state_dict:
                _copy_into(name, target, state_dict[name])


def _check_keys(own: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], *, strict: bool) -> None:
    if not strict:
        return
    missing, unexpected = sorted(set(own) - set(given)), sorted(set(given) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"load_full_state_dict: the state dict does not match the model: missing {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}; "
            "pass strict=False to load the keys that match"
        )


def _copy_into(name: str, target: torch.Tensor, value: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        raise ValueError(f"load_full_state_dict: {name!r} must be a plain tensor (an unsharded state dict); "
                         f"got {type(value).__name__}. Gather it first with full_state_dict")
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"load_full_state_dict: {name!r} has shape {tuple(value.shape)}; the model's is "
                         f"{tuple(target.shape)} (the global shape, also for a sharded weight)")
    if isinstance(target, DTensor):
        local = distribute(value.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(value)


# --- DCP and packed weights ------------------------------------------------------------
# DCP asks each DTensor for the chunks of the global tensor its rank holds
# (``__create_chunk_list__``, ``__create_write_items__``) and for the local data of one
# chunk (``__get_tensor_shard__``). torch answers with one contiguous chunk per rank, which is
# right for Shard and for FSDP2's 2-D strided layouts, but a packed weight on the tp axis
# alone (``_StridedShard(dim, split_factor=k)``: rank r holds row blocks r, n + r, ... of
# k * n) is k separate chunks (a ``PackedShard`` of unequal parts, GQA's [Q; K; V], is
# one per part). torch 2.13 then reports overlapping chunks at save and, at load,
# fills the wrong rows without an error. These three methods answer with the blocks
# ``local_runs`` finds (the same per-dim index runs load_checkpoint reads by) wherever a
# _StridedShard leaves more than one, and defer to torch for every other layout.


def _strided_blocks(t: DTensor) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] | None:
    """``[(global offsets, sizes, local offsets)]`` of the contiguous blocks this rank holds,
    from :func:`local_runs`, for a layout with a ``_StridedShard`` that leaves more than one
    block; ``None`` for every layout torch handles (one block per rank)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    if (not any(isinstance(p, _StridedShard) and p.split_factor > 1 for p in t.placements)
            or any(p.is_partial() for p in t.placements) or t.device_mesh.get_coordinate() is None):
        return None
    blocks = [(tuple(a for _, a, _ in block), tuple(b - a for _, a, b in block), tuple(o for o, _, _ in block))
              for block in itertools.product(*local_runs(t, what="DCP"))]
    return blocks if len(blocks) > 1 else None


def _chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _install_dcp_chunks() -> None:
    if getattr(DTensor, "_shardplan_chunks", False):
        return
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.metadata import TensorProperties

    chunk_list, write_items, tensor_shard = DTensor.__create_chunk_list__, DTensor.__create_write_items__, DTensor.__get_tensor_shard__

    def create_chunk_list(self):
        found = _strided_blocks(self)
        return chunk_list(self) if found is None else [_chunk(g, n) for g, n, _ in found]

    def create_write_items(self, fqn, obj):
        found = _strided_blocks(self)
        if found is None:
            return write_items(self, fqn, obj)
        props = TensorProperties.create_from_tensor(self.to_local())
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props, size=self.size()))
                for c in (_chunk(g, n) for g, n, _ in found)]

    def get_tensor_shard(self, index):
        found = _strided_blocks(self)
        if found is None:
            return tensor_shard(self, index)
        for g, n, local in found:
            if index.offset is not None and tuple(index.offset) == g:
                return self.to_local()[tuple(slice(o, o + k) for o, k in zip(local, n))]
        raise ValueError(f"{index.fqn}: no chunk of this rank starts at {index.offset}; its chunks start at "
                         f"{[g for g, _, _ in found]}")

    DTensor.__create_chunk_list__ = create_chunk_list
    DTensor.__create_write_items__ = create_write_items
    DTensor.__get_tensor_shard__ = get_tensor_shard
    DTensor._shardplan_chunks = True


# --- which global elements a rank holds ------------------------------------------------


def local_runs(t: torch.Tensor, *, what: str = "load_checkpoint") -> list[list[tuple[int, int, int]]]:
    """Per dim, the contiguous runs of global indices this rank holds, in local order, as
    (local offset, start, stop). DTensor itself cuts a 1-D index per dim (every placement
    splits one dim, so the dims are independent): torch's own rule for chunk sizes, uneven
    shards and ``_StridedShard``, with no rule re-implemented here."""
    out = []
    for dim, size in enumerate(t.shape):
        on_dim = [_on_dim0(p, dim, t.ndim, what=what) for p in t.placements] if isinstance(t, DTensor) else []
        if all(p.is_replicate() for p in on_dim):
            out.append([(0, 0, size)])
            continue
        index = distribute(torch.arange(size), t.device_mesh, on_dim, src_data_rank=None).to_local()
        out.append(_runs(index.tolist()))
    local = tuple((t.to_local() if isinstance(t, DTensor) else t).shape)
    if tuple(sum(b - a for _, a, b in runs) for runs in out) != local:
        raise ValueError(f"{what}: cannot work out which elements this rank holds for a tensor placed "
                         f"{t.placements} with local shape {local}")
    return [[r for r in runs if r[2] > r[1]] for runs in out]


def _on_dim0(p: Any, dim: int, ndim: int, *, what: str) -> Any:
    """Placement ``p`` as it acts on a 1-D index of tensor dim ``dim``."""
    if p.is_replicate():
        return p
    if isinstance(p, PackedShard):  # unequal parts (GQA's [Q; K; V]): one run per part
        return PackedShard(0, parts=p.parts) if p.dim % ndim == dim else Replicate()
    if isinstance(p, _StridedShard):
        return _StridedShard(0, split_factor=p.split_factor) if p.dim % ndim == dim else Replicate()
    if isinstance(p, Shard):
        return Shard(0) if p.dim % ndim == dim else Replicate()
    raise ValueError(f"{what}: a tensor placed {p} cannot be read from a file (only Replicate, Shard and "
                     "_StridedShard are per-element layouts of one global tensor)")


def _runs(index: list[int]) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for offset, i in enumerate(index):
        if runs and runs[-1][2] == i:
            o, a, _ = runs[-1]
            runs[-1] = (o, a, i + 1)
        else:
            runs.append((offset, i, i + 1))
    return runs or [(0, 0, 0)]
