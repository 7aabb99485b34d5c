"""Built-in models the planner is demoed and tested on.

Every model here is a plain ``nn.Module`` that builds on the meta device without
allocating, traces with ``torch.fx`` (meta tensors along) and ``torch.export``,
and stays correct when a tensor-parallel rank holds only a fraction of the
attention heads. ``PRESETS`` names ready-made configurations; ``build_preset``
builds one (on meta by default). ``PRESET_NAMES`` lists the names without importing
torch (for the CLI's help); a test holds it equal to ``PRESETS``' keys.
"""

from __future__ import annotations

import importlib
from typing import Any

PRESET_NAMES = (
    "gpt2", "gpt2-debug", "llama3-405b", "llama3-70b", "llama3-8b", "llama3-debug", "llama3-small", "mlp",
    "parallel-debug",
)

_EXPORTS = {
    "GPT2": "gpt2", "GPT2Config": "gpt2", "ParallelBlockModel": "gpt2", "LlamaConfig": "llama", "Transformer": "llama",
    "MLP": "mlp", "PRESETS": "presets", "Preset": "presets", "build_preset": "presets", "get_preset": "presets",
}
__all__ = ["PRESET_NAMES", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardplan.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
