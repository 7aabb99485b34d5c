"""Structural checks shared by the gloo workers: what ``apply_plan`` did to the parameters."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def tied_groups(model: nn.Module) -> list[list[str]]:
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return sorted(g for g in owners.values() if len(g) > 1)


def _chunk_numel(p: DTensor, ref: nn.Parameter) -> int:
    """What this rank should hold of ``ref``: 1/n of each dim a mesh axis of n shards, or,
    where n does not divide it (a vocabulary of 513), torch.chunk's piece for this rank."""
    shape = list(ref.shape)
    for axis, placement in enumerate(p.placements):
        if placement.is_shard():
            pieces = [len(c) for c in torch.arange(shape[placement.dim]).chunk(p.device_mesh.size(axis))]
            rank = p.device_mesh.get_local_rank(axis)
            shape[placement.dim] = pieces[rank] if rank < len(pieces) else 0
    return math.prod(shape)


def parameter_checks(ref: nn.Module, tp: nn.Module) -> dict[str, Any]:
    """Same names, every parameter a DTensor, sharded ones really 1/tp (torch.chunk's piece
    where tp does not divide), ties kept."""
    ref_params = dict(ref.named_parameters())  # remove_duplicate=True: a tied weight once
    tp_params = dict(tp.named_parameters())
    sharded = sorted(n for n, p in tp_params.items() if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements))
    return {
        "names_match": sorted(ref_params) == sorted(tp_params),
        "missing": sorted(set(ref_params) - set(tp_params)),
        "extra": sorted(set(tp_params) - set(ref_params)),
        "non_dtensor_params": sorted(n for n, p in tp_params.items() if not isinstance(p, DTensor)),
        "sharded_params": sharded,
        "bad_local_shapes": sorted(
            n for n in sharded if tp_params[n].to_local().numel() != _chunk_numel(tp_params[n], ref_params[n])
        ),
        "tied_ref": tied_groups(ref),
        "tied_tp": tied_groups(tp),
    }


def assert_parameter_checks(ck: dict[str, Any], where: str) -> None:
    """The assertions every gloo test makes on ``parameter_checks``' result."""
    assert ck["names_match"], f"{where}: parameter names differ; missing {ck['missing']}, extra {ck['extra']}"
    assert not ck["non_dtensor_params"], f"{where}: not DTensors after apply_plan: {ck['non_dtensor_params']}"
    assert ck["sharded_params"], f"{where}: apply_plan sharded no parameter at all"
    assert not ck["bad_local_shapes"], f"{where}: local shards are not 1/tp: {ck['bad_local_shapes']}"
    assert ck["tied_tp"] == ck["tied_ref"], f"{where}: tied weights {ck['tied_ref']} became {ck['tied_tp']}"


def flat_state(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """A nested state dict (an optimizer's) as ``{"a.b.c": tensor}``."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat_state(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v.detach()
    return out
