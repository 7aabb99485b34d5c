"""The second front end (shardplan.analyze.export): torch.export where the meta fx tracer
gives up, building the same op graph. Plans on meta; numerics on 2 gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch

import shardplan
from shardplan.analyze.trace import TraceError
from shardplan.tools.verify import verify
from tests.portability import untraceable

os.environ["HF_HUB_OFFLINE"] = "1"
CASES = ["module_in_forward", "callable_argument", "autocast_by_device"]
X = (torch.zeros(2, 8, 32, device="meta"),)


def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return getattr(untraceable, name)()


def test_a_module_made_in_forward_is_traced_through_by_fx() -> None:
    """``nn.Identity()`` built per call (litgpt's clamp head) is not the model's: the meta fx
    tracer traces its code (no op) instead of naming it, so the model keeps the fast, folded
    front end and its regions, and matches one process on 2 gloo ranks."""
    plan = shardplan.plan_model(_meta("module_in_forward"), {"tp": 2}, example_inputs=X, explain=False, front_end="fx")
    assert [(r.module, r.style) for r in plan.rules][1:3] == [("layers.*.up", "colwise"), ("layers.*.down", "rowwise")]
    result = verify("tests.portability.untraceable:module_in_forward", nproc=2, seq_len=8, timeout_s=240)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("name", [c for c in CASES if c != "module_in_forward"])
def test_the_fx_tracer_alone_fails_on_it(name: str) -> None:
    with pytest.raises((TraceError, AttributeError)):
        shardplan.plan_model(_meta(name), {"tp": 2}, example_inputs=X, explain=False, front_end="fx")


@pytest.mark.parametrize("name", CASES)
def test_plans_through_torch_export(name: str) -> None:
    plan = shardplan.plan_model(_meta(name), {"tp": 2}, example_inputs=X, explain=False)
    styles = plan.module_styles()
    for i in (0, 1):
        assert (styles[f"layers.{i}.up"], styles[f"layers.{i}.down"]) == ("colwise", "rowwise"), styles
    assert not [w for w in plan.warnings if "all-gathered" in w or "not sharded" in w], plan.warnings
    # traced unfolded, written as the folded trace writes it: one rule per kind of block
    assert [r.module for r in plan.rules] == ["layers.*.norm", "layers.*.up", "layers.*.down", "head"]


def test_plan_is_the_same_file_twice() -> None:
    a = shardplan.plan_model(_meta("callable_argument"), {"tp": 2}, example_inputs=X).to_yaml()
    b = shardplan.plan_model(_meta("callable_argument"), {"tp": 2}, example_inputs=X).to_yaml()
    assert a == b


@pytest.mark.parametrize("name", ["callable_argument", "autocast_by_device"])
def test_exported_plan_matches_one_process_on_gloo(name: str) -> None:
    result = verify(f"tests.portability.untraceable:{name}", nproc=2, seq_len=8, timeout_s=240)
    assert {"colwise", "rowwise"} <= set(result.plan.module_styles().values())
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("model_type", ["llama", "mixtral", "gpt2"])
def test_both_front_ends_give_every_weight_the_same_style(model_type: str) -> None:
    """On code both can trace, the exported graph yields the fx tracer's styles weight by
    weight (its plan has no regions inside blocks, so it may count more collectives)."""
    pytest.importorskip("transformers")
    from shardplan.interop.hf_models import build_hf_model

    model, inputs, kwargs = build_hf_model(model_type, tiny=True, device="meta")
    styles = {
        fe: shardplan.plan_model(model, {"tp": 2}, example_inputs=inputs, example_kwargs=kwargs, explain=False,
                                 front_end=fe).module_styles()
        for fe in ("fx", "export")
    }
    # a bank split inside every expert or by whole experts over tp is one choice the cost model
    # makes on near-equal prices at tiny sizes; export's graph reads the bank's output value
    # otherwise (a known difference), so the two front ends may land on either split
    banks = {"moe_tp_experts": "split bank", "moe_whole_experts": "split bank"}
    assert {k: banks.get(v, v) for k, v in styles["fx"].items()} == {k: banks.get(v, v) for k, v in styles["export"].items()}


def test_code_neither_can_trace_is_one_error_naming_the_line() -> None:
    with torch.device("meta"):
        model = untraceable.ValueBranch()
    with pytest.raises(TraceError) as err:
        shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, 8, 32, device="meta"),))
    message = str(err.value)
    assert "untraceable.py:" in message and "h.sum() > 0" in message
    assert "the fx tracer" in message and "the second front end" in message


def test_unknown_front_end_is_refused() -> None:
    with pytest.raises(ValueError, match="front_end='jit'"):
        shardplan.plan_model(_meta("callable_argument"), {"tp": 2}, example_inputs=X, front_end="jit")


def test_data_dependent_sizes_plan_at_their_bound_and_run_on_gloo() -> None:
    """MoE dispatch by ``torch.where`` on the router's choice: export's sizes are symbols
    (``u0``), which the planner used to compare with integers and crash on. They are taken at
    their upper bound (every token reaching every expert), each expert is split as an MLP
    (w1, w3 colwise, w2 rowwise), and the plan matches one process on 2 gloo ranks."""
    from tests.portability import routed_experts

    with torch.device("meta"):
        model = routed_experts.moe_lm()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    styles = plan.module_styles()
    for e in range(4):
        assert [styles[f"moes.0.experts.{e}.{w}"] for w in ("w1", "w3", "w2")] == ["colwise", "colwise", "rowwise"], styles
    result = verify("tests.portability.routed_experts:moe_lm", nproc=2, seq_len=16, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_exporting_leaves_the_users_model_as_it_was() -> None:
    """torch.export runs the model's own forward on fake tensors: a tensor the forward caches
    on a module (x-transformers' ALiBi registers its bias as a buffer) and a module registered
    under two names (a tied ``token_emb``) must not leave fakes in the model, which then
    plans again, copies and runs."""
    from torch._subclasses.fake_tensor import FakeTensor

    class CachingBlock(untraceable.CallableArgument):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.register_buffer("cached", torch.zeros(self.up.in_features), persistent=False)
            self.scale = torch.ones(1)
            return super().forward(x) + self.cached

    model = untraceable.Stack(CachingBlock)
    model.alias = model.layers[0]  # one module under two names
    before = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, 8, 32),), explain=False)
    assert plan.module_styles()["layers.0.up"] == "colwise"
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[n] is p for n, p in before.items())
    tensors = [t for m in model.modules() for t in [*m._buffers.values(), *vars(m).values()] if isinstance(t, torch.Tensor)]
    assert not [t for t in tensors if isinstance(t, FakeTensor)]
    assert model(torch.randn(2, 8, 32)).shape == (2, 8, 32)


def test_the_local_check_runs_code_that_turns_autocast_off_on_its_device() -> None:
    """``autocast(x.device.type, enabled=False)`` fails on meta, which skipped the check for
    the whole exported model, so a q viewed by the global head count was split and crashed
    on the ranks. The check now runs it (autocast taken as cpu's), keeps that attention whole
    and the plan matches one process on 2 gloo ranks."""
    plan = shardplan.plan_model(_meta("autocast_off_around_scale"), {"tp": 2}, example_inputs=X, explain=False)
    assert not [w for w in plan.warnings if "check skipped" in w], plan.warnings
    result = verify("tests.portability.untraceable:autocast_off_around_scale_with_inputs", nproc=2, timeout_s=240)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_sizes_taken_at_their_bound_are_said_and_simulate_as_a_ceiling() -> None:
    """The plan says which sizes it bounded; ``shardplan simulate`` then holds the counted
    bytes to the predicted ceiling (the counts must still be equal)."""
    from shardplan import cli
    from shardplan.analyze.export import UPPER_BOUND_NOTE
    from tests.portability import routed_experts

    assert UPPER_BOUND_NOTE.startswith(cli._UPPER_BOUND_START)
    with torch.device("meta"):
        model = routed_experts.moe_lm()
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    assert UPPER_BOUND_NOTE in plan.warnings
    assert cli.main(["simulate", "tests.portability.routed_experts:moe_lm", "--mesh", "tp=4", "--seq", "16"]) == 0


def test_a_data_dependent_size_without_an_upper_bound_is_a_trace_error_not_a_crash() -> None:
    """torch's integer infinity calls itself finite (``int_oo.is_finite``), so an unbounded
    size reached ``int()`` and crashed inside sympy (full-size jetmoe under export)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from shardplan.analyze.export import _concrete
    from shardplan.analyze.trace import TraceError

    env = ShapeEnv()
    unbounded = env.create_unbacked_symint()
    with pytest.raises(TraceError, match="no upper bound"):
        _concrete(unbounded)
    torch._check(unbounded <= 7)  # a bound export's shape environment knows: taken as the size
    assert _concrete(unbounded) == 7


class _ShapeBug(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.a, self.b = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64), torch.nn.Linear(48, 32)

    def forward(self, idx):
        return self.b(self.a(self.emb(idx)))  # 64 features into a Linear of 48: the user's bug


def shape_bug() -> torch.nn.Module:
    return _ShapeBug()


def test_a_shape_bug_in_the_users_model_is_one_short_line(capfd) -> None:
    """Both front ends stop at the same error: said once, with the user's line and the
    shapes, and none of torch's fake-tensor log (117 lines of it before)."""
    with torch.device("meta"):
        model = shape_bug()
    with pytest.raises(TraceError) as err:
        shardplan.plan_model(model, {"tp": 2}, example_inputs=(torch.zeros(2, 8, dtype=torch.long, device="meta"),))
    message = str(err.value)
    assert "test_export.py:" in message and "[48, 32]" in message and "Both front ends stop there" in message
    assert "second front end" not in message and "\n" not in message
    assert "fake_tensor" not in capfd.readouterr().err
    with pytest.raises(TraceError):  # built on CPU: the kernels' messages differ, the log stays quiet
        shardplan.plan_model(shape_bug(), {"tp": 2}, example_inputs=(torch.zeros(2, 8, dtype=torch.long),))
    assert "fake_tensor" not in capfd.readouterr().err


def _decoder_ids(seq: int = 16) -> tuple[torch.Tensor]:
    return (torch.zeros(2, seq, dtype=torch.long, device="meta"),)


def _settings(plan) -> list[dict]:
    """The rules without their prices' wording: a folded graph prices a style change for every
    block it stands for, an unfolded one for the block whose rule is kept."""
    return [r.model_dump(exclude={"why"}) for r in plan.rules]


def test_repeated_blocks_fold_under_export_to_the_same_rules() -> None:
    """Only torch.export traces this decoder; its 6 layers fold as the fx tracer folds them
    (one traced, five single ops) and plan to the rules the unfolded graph gives."""
    plans = {}
    for fold in (True, False):
        with torch.device("meta"):
            model = untraceable.decoder(6)
        plans[fold] = shardplan.plan_model(model, {"tp": 2}, example_inputs=_decoder_ids(), fold_repeated=fold)
    assert _settings(plans[True]) == _settings(plans[False])
    assert plans[True].module_styles() == plans[False].module_styles()
    assert [(r.module, r.style) for r in plans[True].rules][1:6] == [
        ("layers.*.attn_norm", "replicate"), ("layers.*.wq", "colwise"), ("layers.*.wk", "colwise"),
        ("layers.*.wv", "colwise"), ("layers.*.wo", "rowwise")]


def test_folded_copies_are_single_calls_of_the_representative() -> None:
    from shardplan.analyze.export import export_trace

    with torch.device("meta"):
        model = untraceable.decoder(5)
    traced = export_trace(model, _decoder_ids())
    assert traced.folded == {f"layers.{i}": "layers.0" for i in range(1, 5)}
    calls = [n for n in traced.graph.nodes if n.op == "call_module" and n.target in traced.folded]
    assert [n.target for n in calls] == [f"layers.{i}" for i in range(1, 5)]
    assert not [n for n in traced.graph.nodes if n.op == "call_module" and n.target.startswith("layers.1.")]
    assert all(tuple(n.meta["val"].shape) == (2, 16, 64) and n.kwargs == {"causal": True} for n in calls)
    rep = traced.calls["layers.0"][0]  # as the fx tracer records it: the hidden state, the rope tuple, the flag
    assert rep.args[0] is not None and rep.args[1] is None and rep.outputs and calls[0].args[0] is rep.outputs[0]
    assert rep.example[1] == {"causal": True} and rep.example[0][0].is_meta
    unfolded = export_trace(model, _decoder_ids(), fold_repeated=False)
    assert unfolded.folded == {} and list(unfolded.calls) == [""]
    # the model is left as it was: no forward patched on the class or the instances
    assert untraceable.DecoderLayer.forward.__qualname__ == "DecoderLayer.forward"
    assert not [m for m in model.modules() if "forward" in vars(m)]


def test_a_copy_called_with_other_inputs_is_traced_through() -> None:
    """Folding reuses the representative's output only for inputs of its shapes."""
    from shardplan.analyze.export import export_trace

    class Widening(untraceable.Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layers[0](x)
            x = self.layers[1](x[:, :4])  # a shorter sequence than layers.0 saw
            return self.head(self.layers[2](x))

    with torch.device("meta"):
        model = Widening(untraceable.CallableArgument, layers=3)
    traced = export_trace(model, X)
    assert traced.folded == {}  # layers.1 and layers.2 both see [2, 4, 32], layers.0 [2, 8, 32]
    leaves = {n.target for n in traced.graph.nodes if n.op == "call_module"}
    assert {"layers.1.up", "layers.2.down"} <= leaves


def test_the_forwards_are_put_back_when_the_export_fails() -> None:
    class Failing(untraceable.CallableArgument):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = super().forward(x)
            return h if h.sum() > 0 else -h  # a branch on values: torch.export stops here

    with torch.device("meta"):
        model = untraceable.Stack(Failing, layers=3)
    with pytest.raises(TraceError):
        shardplan.plan_model(model, {"tp": 2}, example_inputs=X, explain=False, front_end="export")
    assert "forward" in vars(Failing) and Failing.forward.__qualname__.endswith("Failing.forward")
    assert "forward" not in vars(untraceable.CallableArgument) or \
        untraceable.CallableArgument.forward.__qualname__ == "CallableArgument.forward"


def test_a_deep_export_only_model_plans_in_seconds() -> None:
    """Llama-3-70B's shapes (80 layers of hidden 8192, 64 heads, 8 kv heads) that only
    torch.export traces: one layer is traced and solved, not 80 (17 s before, 3 s here)."""
    import time

    with torch.device("meta"):
        model = untraceable.decoder_70b(80)
    start = time.perf_counter()
    plan = shardplan.plan_model(model, {"tp": 8}, example_inputs=(torch.zeros(2, 2048, dtype=torch.long, device="meta"),))
    elapsed = time.perf_counter() - start
    assert plan.module_styles()["layers.79.wq"] == "colwise" and plan.module_styles()["layers.79.w2"] == "rowwise"
    assert len(plan.rules) == 12
    assert elapsed < 15, f"{elapsed:.1f} s"
