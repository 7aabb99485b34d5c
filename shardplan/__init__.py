"""shardplan: a tensor-parallel sharding-plan compiler for PyTorch.

``plan_model`` decides (trace -> graph -> cost -> solve) and returns a :class:`Plan`;
``apply_plan`` applies one with ``parallelize_module``; ``auto_parallelize`` does both.
"""

from .api import PlanningError, TraceError, apply_plan, auto_parallelize, plan_model, price_styles
from .plan import Plan, PlanFileError, load_plan

__all__ = [
    "plan_model", "apply_plan", "auto_parallelize", "price_styles", "load_plan", "Plan",
    "PlanningError", "TraceError", "PlanFileError", "__version__",
]
__version__ = "0.1.0"
