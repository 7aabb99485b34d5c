"""Plan: the data a planning run produces, its files, and validation against a model.

Contract
--------
:mod:`.model` is the plan as pydantic data (``extra="forbid"``): rules, regions,
estimates, decisions, and a YAML/JSON form whose bytes do not depend on the machine that
wrote them. :mod:`.fileio` parses plan text once, strictly (``safe`` YAML, no aliases, no
duplicate keys), names file:line in every error, and writes atomically. :mod:`.validate`
lists what applying a plan to a given model would trip on. Nothing here imports torch's
tensor-parallel styles or plans anything; it is plain data, read and written.
"""

from .fileio import PlanFileError
from .model import (
    LAYOUT_RE, SIGNIFICANT_DIGITS, STYLES, Alternative, Collectives, Decision, Estimate, MeshInfo, ModelInfo, Plan,
    PlanOptions, Region, Rule, brace_members, brace_ranges, expand_braces, expand_pattern, fingerprint, load_plan,
    matches, portable,
)

__all__ = [
    "PlanFileError", "LAYOUT_RE", "SIGNIFICANT_DIGITS", "STYLES", "Alternative", "Collectives", "Decision", "Estimate",
    "MeshInfo", "ModelInfo", "Plan", "PlanOptions", "Region", "Rule", "expand_pattern", "fingerprint", "load_plan",
    "matches", "portable", "brace_members", "brace_ranges", "expand_braces",
]
