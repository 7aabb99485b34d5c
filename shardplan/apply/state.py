"""State: a sharded model's state in the unsharded model's own layout, and back.

Contract
--------
``full_state_dict(model)`` returns ``{name: tensor}`` with every DTensor gathered
(``full_tensor``), in the layout the unsharded model has: the same keys as its
``state_dict()`` and, for packed weights too, the same element order (see
:func:`.styles.packed_placement`), so a file written from it loads into the plain model.
``load_full_state_dict(model, state_dict)`` is its inverse: each rank copies its own slice
of every tensor into its shards, with no communication (every rank holds the whole dict).
Both are collective when ``model`` is sharded: every rank calls them. Resharding through a
checkpoint (save at tp=a, load at tp=b) needs nothing from shardplan: DCP
(``torch.distributed.checkpoint``) saves the DTensors' global views and loads them under
any placement, optimizer state included, because those views do not depend on tp.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["full_state_dict", "load_full_state_dict"]


def full_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Every entry of ``model.state_dict()`` as a plain tensor (on the CPU unless ``cpu=False``).
    Each DTensor is one all-gather; call it on every rank."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"full_state_dict needs an nn.Module; got {type(model).__name__}")
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = full.detach().cpu() if cpu else full.detach()
    return out


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy an unsharded state dict into ``model``: each DTensor takes its own slice, cut
    locally (``distribute_tensor(..., src_data_rank=None)``: every rank has the whole tensor,
    so nothing is sent). ``strict`` refuses missing or unexpected keys and shape mismatches."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"load_full_state_dict needs an nn.Module; got {type(model).__name__}")
    own = model.state_dict()
    _check_keys(own, state_dict, strict=strict)
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
        local = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(value)


# --- DCP and packed weights ------------------------------------------------------------
# DCP asks each DTensor for the chunks of the global tensor its rank holds
# (``__create_chunk_list__``, ``__create_write_items__``) and for the local data of one
# chunk (``__get_tensor_shard__``). torch answers with one contiguous chunk per rank, which is
# right for Shard and for FSDP2's 2-D strided layouts, but a packed weight on the tp axis
# alone (``_StridedShard(dim, split_factor=k)``: rank r holds row blocks r, n + r, ... of
# k * n) is k separate chunks. torch 2.13 then reports overlapping chunks at save and, at load,
# fills the wrong rows without an error. These three methods answer with the k chunks for that
# layout and defer to torch for every other one.


def _strided_chunks(t: DTensor) -> list[tuple[int, int, int, int]] | None:
    """``[(dim, global_offset, local_offset, length)]`` for a DTensor whose only split is one
    ``_StridedShard`` with ``split_factor > 1``; ``None`` for every layout torch handles."""
    from torch.distributed.tensor.placement_types import _StridedShard

    split = [(i, p) for i, p in enumerate(t.placements) if not p.is_replicate()]
    if len(split) != 1 or not isinstance(split[0][1], _StridedShard) or split[0][1].split_factor <= 1:
        return None
    axis, p = split[0]
    n, k, size = t.device_mesh.size(axis), p.split_factor, t.shape[p.dim]
    if size % (k * n):
        return None
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None
    part, length = size // k, size // (k * n)
    return [(p.dim, j * part + coord[axis] * length, j * length, length) for j in range(k)]


def _chunk(t: DTensor, dim: int, offset: int, length: int):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    offsets, sizes = [0] * t.ndim, list(t.shape)
    offsets[dim], sizes[dim] = offset, length
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _install_dcp_chunks() -> None:
    if getattr(DTensor, "_shardplan_chunks", False):
        return
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.metadata import TensorProperties

    chunk_list, write_items, tensor_shard = DTensor.__create_chunk_list__, DTensor.__create_write_items__, DTensor.__get_tensor_shard__

    def create_chunk_list(self):
        found = _strided_chunks(self)
        return chunk_list(self) if found is None else [_chunk(self, d, g, n) for d, g, _, n in found]

    def create_write_items(self, fqn, obj):
        found = _strided_chunks(self)
        if found is None:
            return write_items(self, fqn, obj)
        props = TensorProperties.create_from_tensor(self.to_local())
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props, size=self.size()))
                for c in (_chunk(self, d, g, n) for d, g, _, n in found)]

    def get_tensor_shard(self, index):
        found = _strided_chunks(self)
        if found is None:
            return tensor_shard(self, index)
        for d, g, local, n in found:
            if index.offset is not None and index.offset[d] == g:
                return self.to_local().narrow(d, local, n)
        raise ValueError(f"{index.fqn}: no chunk of this rank starts at {index.offset}; its chunks start at "
                         f"{[g for _, g, _, _ in found]} on dim {found[0][0]}")

    DTensor.__create_chunk_list__ = create_chunk_list
    DTensor.__create_write_items__ = create_write_items
    DTensor.__get_tensor_shard__ = get_tensor_shard
    DTensor._shardplan_chunks = True
