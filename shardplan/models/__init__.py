"""Built-in models the planner is demoed and tested on.

Every model here is a plain ``nn.Module`` that builds on the meta device without
allocating, traces with ``torch.fx`` (meta tensors along) and ``torch.export``,
and stays correct when a tensor-parallel rank holds only a fraction of the
attention heads. ``PRESETS`` names ready-made configurations; ``build_preset``
builds one (on meta by default).
"""

from .gpt2 import GPT2, GPT2Config, ParallelBlockModel
from .llama import LlamaConfig, Transformer
from .mlp import MLP
from .presets import PRESETS, Preset, build_preset, get_preset

__all__ = [
    "GPT2",
    "GPT2Config",
    "LlamaConfig",
    "MLP",
    "PRESETS",
    "ParallelBlockModel",
    "Preset",
    "Transformer",
    "build_preset",
    "get_preset",
]
