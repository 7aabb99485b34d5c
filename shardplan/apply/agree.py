"""Agree: make every rank hold the same plan before any weight collective runs.

Contract
--------
``agree(plan_or_error)`` is one small exchange over the default process group
(``all_gather_object`` of a hash and the rule lines, a few KB). Every rank calls it with
its plan, or with the exception its planner raised. It returns the plan when every rank
holds the same one. Otherwise every rank raises the same :class:`RankDisagreement` (a
``ValueError``) within seconds: the ranks that failed to plan and their messages, or the
ranks whose plan differs from rank 0's and the first rule that differs. Without this, two
ranks applying different plans issue different collectives and wait for each other until
the process group's timeout (30 minutes for gloo by default).

It does nothing without a process group, with one rank, or on the ``fake`` backend (whose
collectives return nothing; it simulates one rank's view).
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from ..plan.model import Plan

__all__ = ["RankDisagreement", "agree"]


class RankDisagreement(ValueError):
    """The ranks do not hold the same plan, or some could not make one."""


def _payload(plan: Plan | BaseException) -> dict:
    if isinstance(plan, BaseException):
        return {"error": f"{type(plan).__name__}: {str(plan).splitlines()[0] if str(plan) else ''}"}
    text = plan.to_yaml()
    rules = [f"{r.module}: {r.style}" + (f" {r.input_layouts}->{r.output_layouts}" if r.input_layouts or r.output_layouts else "")
             for r in plan.rules] + [f"region {r.module} ({r.input})" for r in plan.regions]
    mesh = ",".join(f"{k}={v}" for k, v in plan.mesh.axes.items())
    return {"hash": hashlib.sha256(text.encode()).hexdigest(), "rules": rules, "mesh": mesh}


def _first_difference(a: dict, b: dict) -> str:
    if a["mesh"] != b["mesh"]:
        return f"mesh {a['mesh']} vs {b['mesh']}"
    for x, y in zip(a["rules"], b["rules"]):
        if x != y:
            return f"rule {x!r} vs {y!r}"
    if len(a["rules"]) != len(b["rules"]):
        return f"{len(a['rules'])} rules and regions vs {len(b['rules'])}"
    return "the rules agree; options, estimates or the model fingerprint differ"


def _message(gathered: list[dict]) -> str | None:
    failed = [(r, p["error"]) for r, p in enumerate(gathered) if "error" in p]
    if failed:
        names = ", ".join(f"rank {r}: {msg}" for r, msg in failed[:4])
        return f"planning failed on {len(failed)} of {len(gathered)} ranks ({names}); every rank stops here"
    differ = [r for r, p in enumerate(gathered) if p["hash"] != gathered[0]["hash"]]
    if not differ:
        return None
    return (f"ranks {differ} hold another plan than rank 0 (first difference, rank 0 vs rank {differ[0]}: "
            f"{_first_difference(gathered[0], gathered[differ[0]])}); give every rank the same plan file, "
            "or plan on every rank with the same model, mesh and options")


def agree(plan: Plan | BaseException) -> Plan:
    """``plan`` when every rank holds the same one; else :class:`RankDisagreement` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        if isinstance(plan, BaseException):
            raise plan
        return plan
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _payload(plan))
    message = _message(gathered)  # never None when this rank sent an error
    if message is not None:
        raise RankDisagreement(message)
    return plan
