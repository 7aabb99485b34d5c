"""Interop: other libraries' plan formats and model builders.

Contract
--------
:mod:`.hf` reads a Hugging Face model's own ``tp_plan``, converts plans in both directions
(``Plan.to_hf_tp_plan`` output is what ``from_pretrained(..., tp_plan=...)`` takes) and
compares shardplan's choices with Hugging Face's. :mod:`.hf_models` builds Hugging Face
models from configs (never downloads), full size on meta or tiny on CPU. ``transformers``
is optional and imported lazily, only by the functions that need it.
"""
