"""shardplan: a tensor-parallel sharding-plan compiler for PyTorch.

``plan_model`` decides (analyze -> decide) and returns a :class:`Plan`; ``apply_plan``
applies one with ``parallelize_module``; ``auto_parallelize`` does both.

The stages are subpackages, each importing only from those before it: ``analyze``
(tracing, the op graph), ``plan`` (the data model, its files, validation), ``decide``
(strategies, cost model, the exact program, estimates, explanations), ``apply`` (the
emitter and its styles), then :mod:`shardplan.api`, ``interop`` (Hugging Face), ``tools``
(simulate, verify, launch, report, model sources) and :mod:`shardplan.cli` on top. The
names below load on first use, so ``shardplan --help`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "plan_model": "api", "apply_plan": "api", "auto_parallelize": "api", "price_styles": "api",
    "PlanningError": "api", "TraceError": "api",
    "Plan": "plan.model", "PlanFileError": "plan.fileio", "load_plan": "plan.model",
    "full_state_dict": "apply.state", "load_full_state_dict": "apply.state",
    "set_requires_gradient_sync": "apply.gradsync", "compile_blocks": "apply.compile",
    "materialize": "apply.load", "load_checkpoint": "apply.load",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
