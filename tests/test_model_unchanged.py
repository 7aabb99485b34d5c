"""Planning never changes the user's model, on success or on error.

The planner runs forward (the meta fx tracer, torch.export on fake tensors), and forward
code writes to its modules: a RoPE table filled on the first call, a buffer registered
then, a memo dict keyed by sequence length, a step counter, a hook, the last hidden state.
After planning every module's ``__dict__`` holds the objects it held before (tensors,
containers and their items, hooks), and a real forward gives the values it gave before.
The models are written here, each in a style people use, on CPU, their caches not yet
filled.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import shardplan

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 8


def rope_table(seq: int, dim: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, device=device).float() / dim)
    freqs = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    return freqs.cos(), freqs.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, DIM))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """Token ids -> logits; ``rope(x, seq)`` gives the cos/sin tables, each subclass its own way."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def rope(self, x: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        cos, sin = self.rope(h, ids.shape[1])
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.head(self.norm(h))


class AttributeCacheLM(TinyLM):
    """The table as plain attributes, ``None`` until the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.cos_cached = None
        self.sin_cached = None

    def rope(self, x, seq):
        if self.cos_cached is None or self.cos_cached.shape[0] < seq:
            self.cos_cached, self.sin_cached = rope_table(seq, DIM // HEADS, device=x.device)
        return self.cos_cached[:seq], self.sin_cached[:seq]


class LazyBufferLM(TinyLM):
    """The table registered as a non-persistent buffer on the first call."""

    def rope(self, x, seq):
        if not hasattr(self, "rope_cos") or self.rope_cos.shape[0] < seq:
            cos, sin = rope_table(seq, DIM // HEADS, device=x.device)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        return self.rope_cos[:seq], self.rope_sin[:seq]


class MemoLM(TinyLM):
    """One table per sequence length, memoized in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, x, seq):
        if seq not in self._tables:
            self._tables[seq] = rope_table(seq, DIM // HEADS, device=x.device)
        return self._tables[seq]


class CountingLM(AttributeCacheLM):
    """Counts its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def forward(self, ids):
        self.steps += 1
        return super().forward(ids)


class HookingLM(AttributeCacheLM):
    """Registers a hook on its first call and keeps the last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.hooked = False

    def forward(self, ids):
        if not self.hooked:
            self.norm.register_forward_hook(lambda module, args, out: None)
            self.hooked = True
        out = super().forward(ids)
        self.last_logits = out
        return out


class RotaryEmbedding(nn.Module):
    """Hugging Face's pattern: the table is grown in forward, computed in float32 with
    autocast off on the input's device (which sends the planner to torch.export)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.cos_cached = None
        self.sin_cached = None

    def forward(self, x: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos_cached is None or self.cos_cached.shape[0] < seq:
            self.cos_cached, self.sin_cached = rope_table(seq, self.dim, device=x.device)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.cos_cached[:seq].float(), self.sin_cached[:seq].float()


class RotaryModuleLM(TinyLM):
    """The RoPE module is a submodule whose cache is filled after the fx tracer got that far."""

    def __init__(self) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(DIM // HEADS)

    def rope(self, x, seq):
        return self.rotary(x, seq)


class RopeTable(nn.Module):
    def __init__(self, seq: int, dim: int, device: torch.device) -> None:
        super().__init__()
        cos, sin = rope_table(seq, dim, device=device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)


class LazyRopeModuleLM(TinyLM):
    """The RoPE module itself is built on the first call, on the input's device, under
    autocast off (torch.export plans it): fake tensors it was built with stayed in the model."""

    def __init__(self) -> None:
        super().__init__()
        self.rotary = None

    def rope(self, x, seq):
        with torch.autocast(device_type=x.device.type, enabled=False):
            if self.rotary is None or self.rotary.cos.shape[0] < seq:
                self.rotary = RopeTable(seq, DIM // HEADS, x.device)
            return self.rotary.cos[:seq], self.rotary.sin[:seq]


class ContextLM(CountingLM):
    """Refuses sequences longer than its context, after caching and counting."""

    context = 64

    def forward(self, ids):
        out = super().forward(ids)
        if ids.shape[1] > self.context:
            raise ValueError(f"sequence of {ids.shape[1]} tokens is longer than the context ({self.context})")
        return out


class ReassignedBufferLM(TinyLM):
    """The table a buffer from the start, assigned anew in forward (CTRL's
    ``self.pos_encoding = self.pos_encoding.to(device=..., dtype=...)``): the fx tracer left a
    proxy in the buffer, and the planner's own later run of the model's code called it
    (a segmentation fault)."""

    def __init__(self) -> None:
        super().__init__()
        cos, sin = rope_table(4096, DIM // HEADS)  # beyond the 2048 positions planning infers
        self.register_buffer("table", torch.stack((cos, sin)))

    def rope(self, x, seq):
        self.table = self.table.to(device=x.device, dtype=x.dtype)
        return self.table[0, :seq], self.table[1, :seq]


MODELS = [AttributeCacheLM, LazyBufferLM, MemoLM, CountingLM, HookingLM, RotaryModuleLM, LazyRopeModuleLM,
          ReassignedBufferLM]


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _build(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def _items(value):
    if isinstance(value, dict):
        return [(k, v) for k, v in value.items()]
    return list(value) if isinstance(value, (list, set, tuple)) else None


def _state(model: nn.Module) -> dict[str, dict]:
    """Every module's ``__dict__``: each entry's object and a container's items (by identity),
    and every tensor's values."""
    modules = {name: {k: (v, _items(v)) for k, v in vars(m).items()} for name, m in model.named_modules()}
    tensors = {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    return {"modules": modules, "tensors": tensors}


def _real(value) -> bool:
    """A tensor (or a container of them) that a real forward can use: not fake, not meta,
    not a tracer's proxy."""
    leaves = torch.utils._pytree.tree_leaves(value)
    return not any(isinstance(v, torch.fx.Proxy) or (isinstance(v, torch.Tensor) and (
        v.is_meta or type(v).__name__ == "FakeTensor")) for v in leaves)


def _assert_unchanged(model: nn.Module, before: dict) -> None:
    after = _state(model)
    assert after["modules"].keys() == before["modules"].keys(), "modules added or removed"
    for name, entries in before["modules"].items():
        now = after["modules"][name]
        assert now.keys() == entries.keys(), f"{name or 'model'}: attributes {set(now) ^ set(entries)} added or removed"
        for key, (value, items) in entries.items():
            assert now[key][0] is value, f"{name or 'model'}.{key} was replaced"
            if items is not None:
                same = len(now[key][1]) == len(items) and all(
                    a is b or (isinstance(a, tuple) and all(x is y for x, y in zip(a, b)))
                    for a, b in zip(now[key][1], items))
                assert same, f"{name or 'model'}.{key}: its contents changed"
            assert _real(value), f"{name or 'model'}.{key} holds a fake, meta or traced value"
    for name, t in before["tensors"].items():
        now = dict([*model.named_parameters(), *model.named_buffers()])[name]
        assert type(now) in (torch.Tensor, nn.Parameter) and now.device == t.device and torch.equal(now, t), name


def _assert_forward_as_before(model: nn.Module, cls: type[nn.Module]) -> None:
    expected = _build(cls)(_ids())
    out = model(_ids())
    assert type(out) is torch.Tensor and not out.is_meta
    assert torch.equal(out, expected)


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("given", [False, True], ids=["inferred_inputs", "example_inputs"])
def test_planning_leaves_the_model_as_it_was(cls, given):
    model = _build(cls)
    before = _state(model)
    shardplan.plan_model(model, {"tp": 2}, example_inputs=(_ids(),) if given else None, explain=False)
    _assert_unchanged(model, before)
    _assert_forward_as_before(model, cls)


def test_a_cache_the_user_filled_stays_the_one_they_filled():
    model = _build(AttributeCacheLM)
    model(_ids())  # 8 positions; the planner's inferred inputs have 2048: forward grows the cache
    before = _state(model)
    shardplan.plan_model(model, {"tp": 2}, explain=False)
    _assert_unchanged(model, before)
    _assert_forward_as_before(model, AttributeCacheLM)


def test_planning_twice_gives_the_same_plan():
    model = _build(AttributeCacheLM)
    first = shardplan.plan_model(model, {"tp": 2}, explain=False)
    second = shardplan.plan_model(model, {"tp": 2}, explain=False)
    assert json.dumps(first.model_dump(), sort_keys=True) == json.dumps(second.model_dump(), sort_keys=True)


def test_torch_export_starts_from_the_model_as_it_was():
    """The fx tracer fills RotaryEmbedding's cache, then stops at its autocast: the second
    front end must not find the tracer's proxies in the cache (it raised reading them)."""
    plan = shardplan.plan_model(_build(RotaryModuleLM), {"tp": 2}, explain=False)
    assert {r.module for r in plan.rules} >= {"tok", "layers.*.qkv", "head"}


@pytest.mark.parametrize("front_end", ["auto", "fx", "export"])
@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_the_op_graph_leaves_the_model_as_it_was(cls, front_end: str):
    """Each front end on its own, not only planning as a whole: the planner runs the model's
    code again after tracing (the outer-code check), which must find the model's own values,
    not a tracer's proxy (CTRL's reassigned buffer: the process crashed there)."""
    from shardplan.analyze.frontend import op_graph

    model = _build(cls)
    before = _state(model)
    try:
        op_graph(model, (_ids(),), None, front_end=front_end)
    except shardplan.TraceError:
        pass  # the other front end traces it (RotaryModuleLM's autocast stops fx); left as it was all the same
    _assert_unchanged(model, before)


def test_a_model_that_raises_is_left_as_it_was():
    model = _build(ContextLM)
    before = _state(model)
    with pytest.raises(shardplan.TraceError, match="longer than the context"):
        shardplan.plan_model(model, {"tp": 2}, explain=False)  # inferred inputs: 2048 tokens
    _assert_unchanged(model, before)
    _assert_forward_as_before(model, ContextLM)


def test_a_refused_plan_leaves_the_model_as_it_was():
    model = _build(HookingLM)
    before = _state(model)
    with pytest.raises(shardplan.PlanningError):
        shardplan.plan_model(model, {"tp": 2}, example_inputs=(_ids(),), explain=False, strict=True,
                             memory_budget=1024)
    _assert_unchanged(model, before)
    _assert_forward_as_before(model, HookingLM)


def test_world_size_and_price_styles_leave_the_model_as_it_was():
    model = _build(CountingLM)
    before = _state(model)
    shardplan.plan_model(model, world_size=4, example_inputs=(_ids(),), explain=False)
    shardplan.price_styles(model, {"tp": 2}, {"layers.*.up": "colwise"}, example_inputs=(_ids(),))
    _assert_unchanged(model, before)
    _assert_forward_as_before(model, CountingLM)


_FRESH_PROCESS = """
import sys, torch
from torch import nn
import shardplan

class Routed(nn.Module):  # reads its routing counts as Python ints: the trace computes them
    def __init__(self):
        super().__init__()
        self.router, self.proj = nn.Linear(32, 4), nn.Linear(32, 32)
    def forward(self, x):
        counts = torch.bincount(self.router(x).argmax(-1).flatten(), minlength=4).tolist()
        return self.proj(x) * max(counts)

hook = sys.excepthook
shardplan.plan_model(Routed(), {"tp": 2}, example_inputs=(torch.randn(2, 8, 32),), explain=False)
with torch.device("meta"):
    table = torch.arange(0, 8, 2).float()
    layer = nn.Linear(4, 4)
print(table.device, layer.weight.device, sys.excepthook is hook)
"""


def test_planning_leaves_the_process_as_it_was():
    """In a fresh process (what torch builds once per process is at stake): a trace that
    computes values (``.tolist()`` of counts) ran while fx had swapped ``torch.arange`` for a
    wrapper, and torch's device context then stopped moving ``torch.arange``: a model built
    on meta afterwards got CPU buffers. The fake group's ``init_process_group`` wrapped
    ``sys.excepthook`` for good, one ``[rank0]:`` prefix more per plan."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["meta", "meta", "True"], out.stdout


class CacheBlock(Block):
    """A block that writes what it receives into a cache buffer and reads it back, as Meta's
    reference llama does its keys (``self.cache_k[:b, pos:pos + s] = k``) at inference."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, SEQ, DIM), persistent=False)

    def forward(self, x, cos, sin):
        self.cache[: x.shape[0], : x.shape[1]] = x
        return super().forward(self.cache[: x.shape[0], : x.shape[1]], cos, sin)


class KVCacheLM(TinyLM):
    """A forward with autograd on leaves each block's cache with a history, which
    ``copy.deepcopy`` refuses: planning crashed (``Only Tensors created explicitly by the
    user (graph leaves) support the deepcopy protocol``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CacheBlock() for _ in range(2))

    def rope(self, x, seq):
        return rope_table(seq, DIM // HEADS, x.device)


def test_a_cache_written_with_autograd_on_is_planned_and_left_as_it_was():
    model = _build(KVCacheLM)
    model(_ids())  # the user's own forward, gradients on
    before = _state(model)
    shardplan.plan_model(model, {"tp": 2}, example_inputs=(_ids(),), explain=False)
    _assert_unchanged(model, before)
    _assert_forward_as_before(model, KVCacheLM)
