"""Weight modules that are not the stock classes, outside the repeated blocks: the local
check runs them on their shards too. An Embedding subclass with its own forward (torchtitan
0.3.0's reads ``self.weight.to_local()``; others call ``F.embedding`` with the weight) is
vocab-parallel on local tensors (``LocalVocabParallel``); what still fails on its shards is
kept whole and run on local tensors."""

from __future__ import annotations

import pytest
import torch

import shardplan
from shardplan.tools.verify import verify
from tests.portability.custom_leaves import LocalEmbeddingLM

TOKENS = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)


def _plan(**kw) -> shardplan.Plan:
    with torch.device("meta"):
        model = LocalEmbeddingLM(**kw)
    return shardplan.plan_model(model, {"tp": 2}, example_inputs=TOKENS)


@pytest.mark.parametrize("layers", [2, 1])  # 1: nothing folds, the check runs the whole model
@pytest.mark.parametrize("embedding", ["local", "functional"])
def test_an_embedding_with_its_own_forward_is_vocab_parallel(layers: int, embedding: str) -> None:
    plan = _plan(layers=layers, embedding=embedding)
    styles = plan.module_styles()
    assert styles["embed"] == "embedding_rowwise" and styles["layers.0.up"] == "colwise", styles
    assert not [w for w in plan.warnings if w.startswith("embed:")], plan.warnings


def test_an_embedding_whose_forward_fails_on_its_shards_is_kept_whole() -> None:
    plan = _plan(embedding="global_view")
    assert plan.module_styles()["embed"] == "replicate"
    (note,) = [w for w in plan.warnings if w.startswith("embed:")]
    assert "own forward fails on its shards" in note and "custom_leaves.py" in note


def test_a_weight_read_by_code_outside_its_module_is_split_by_rows() -> None:
    """torchtune's ``TiedLinear`` computes with the embedding's weight: the table is split by
    vocabulary rows, and that code computes each rank's vocabulary (:mod:`shardplan.decide.tied`)."""
    plan = _plan(tied=True)
    assert plan.module_styles()["embed"] == "embedding_rowwise" and plan.rule_for("embed").read_outside
    assert not [w for w in plan.warnings if w.startswith("embed:")], plan.warnings


def test_pinning_a_split_the_reader_cannot_run_on_says_why() -> None:
    with torch.device("meta"):
        model = LocalEmbeddingLM(tied=True)
    with pytest.raises(ValueError, match="other code reads its weight as a tensor too"):
        shardplan.price_styles(model, {"tp": 2}, {"embed": "colwise"}, example_inputs=TOKENS)


def test_a_weight_read_outside_its_module_matches_one_process_on_gloo() -> None:
    """torchtune's TiedLinear, a plain object, computes with the embedding's weight in the
    root's forward: on each rank's vocabulary rows, the logits gathered."""
    result = verify("tests.portability.custom_leaves:tied_lm", nproc=2, timeout_s=240)
    assert result.plan.rule_for("embed").read_outside and result.plan.module_styles()["embed"] == "embedding_rowwise"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("builder", ["local_embedding_lm", "functional_embedding_lm"])
def test_an_own_forward_embedding_matches_one_process_on_gloo(builder: str) -> None:
    """Outputs, every gradient (the padding row's stays zero on the rank that holds it) and
    the weights after an optimizer step, on 2 gloo ranks against one process."""
    result = verify(f"tests.portability.custom_leaves:{builder}", nproc=2, timeout_s=240)
    assert result.plan.module_styles()["embed"] == "embedding_rowwise"
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_an_own_forward_embedding_issues_the_predicted_collectives(sequence_parallel: bool) -> None:
    """The local lookup's partial sums leave as torch's style's do: one all-reduce, or one
    reduce-scatter onto sequence shards, and nothing else (fake process group, tp=4)."""
    from shardplan.tools.simulate import simulate
    from tests.portability.custom_leaves import functional_embedding_lm

    with torch.device("meta"):
        model = LocalEmbeddingLM(embedding="functional")
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=TOKENS, sequence_parallel=sequence_parallel)
    assert plan.module_styles()["embed"] == "embedding_rowwise"
    result = simulate(functional_embedding_lm(), plan, (torch.randint(0, 128, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"
    assert (result.counted["forward"]["reduce_scatter"] > 0) == sequence_parallel, dict(result.counted)


def test_an_own_forward_embedding_trains_under_fsdp_as_one_process() -> None:
    """dp=2 x tp=2 on 4 gloo ranks: FSDP2 unshards the table before the embedding's own hooks
    take its local rows; losses, gradient norms and the weights after two AdamW steps match
    one process on the whole batch."""
    from shardplan.tools.launch import run_on_gloo
    from tests import _fsdp_workers as workers
    from tests.test_numerics import TOLS

    axes = {"dp": 2, "tp": 2}
    with torch.device("meta"):
        model = LocalEmbeddingLM(embedding="functional")
    plan = shardplan.plan_model(model, axes, example_inputs=(torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                                explain=False)
    assert plan.module_styles()["embed"] == "embedding_rowwise"
    atol, rtol = TOLS["param"]
    results = run_on_gloo(workers.train, world_size=4, timeout_s=300, args=(
        plan.to_yaml(), axes, 4, 2, 1.0, atol, rtol, "tests.portability.custom_leaves:functional_embedding_lm"))
    for r in results:
        for ref_loss, loss in r["losses"]:
            assert abs(loss - ref_loss) <= TOLS["loss"][0], r["losses"]
        assert r["worst_ratio"][1] <= 1.0, (r["worst_param"], r["worst_ratio"])


@pytest.mark.parametrize("tp", [2, 4])
def test_linears_written_by_hand_split_as_nn_linear(tp: int) -> None:
    """``F.linear(x, self.weight, self.bias)`` and ``x @ self.weight.t()`` in modules of their
    own: q/k/v and w1/w3 colwise, wo and w2 rowwise, the head count made local, no warning."""
    from tests.portability import by_hand

    with torch.device("meta"):
        model = by_hand.transformer()
    plan = shardplan.plan_model(model, {"tp": tp}, example_inputs=TOKENS)
    styles = plan.module_styles()
    want = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"}
    assert {k: styles[f"layers.0.attn.{k}"] for k in want} == want, styles
    assert [styles[f"layers.0.ffn.{k}"] for k in ("w1", "w3", "w2")] == ["colwise", "colwise", "rowwise"], styles
    assert [(a.module, a.values) for a in plan.attributes] == [("layers.*.attn", {"n_heads": 8 // tp})]
    assert not plan.warnings, plan.warnings


def test_linears_written_by_hand_match_one_process_on_gloo() -> None:
    result = verify("tests.portability.by_hand:transformer", nproc=2, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_linears_written_by_hand_simulate_as_predicted() -> None:
    from shardplan.tools.simulate import simulate
    from tests.portability import by_hand

    with torch.device("meta"):
        model = by_hand.transformer()
    plan = shardplan.plan_model(model, {"tp": 4}, example_inputs=TOKENS, sequence_parallel=True)
    result = simulate(by_hand.transformer(), plan, (torch.randint(0, 128, (2, 16)),))
    assert result.matches, f"counted {dict(result.counted)} != predicted {result.predicted}"


def test_a_module_under_two_names_is_styled_once_and_matches_one_process() -> None:
    """The decoder's ``emb`` is the encoder's: one module, one style (a second application
    failed in ``distribute_module``); the model's own ``max_seq_len`` bounds the sequence."""
    from tests.portability.custom_leaves import shared_table

    with torch.device("meta"):
        model = shared_table()
    plan = shardplan.plan_model(model, {"tp": 2})
    assert plan.options.seq_len == 32
    assert plan.module_styles()["encoder.emb"] != "replicate"
    result = verify("tests.portability.custom_leaves:shared_table", nproc=2, seq_len=16, timeout_s=300)
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_weight_norm_linears_train_replicated_as_one_process_on_gloo() -> None:
    """The parametrization runs on local tensors: on Replicate DTensors, backward failed in
    DTensor (no sharding rule for ``_weight_norm_interface_backward``)."""
    result = verify("tests.portability.custom_leaves:weight_norm_mlp", nproc=2, timeout_s=240)
    styles = result.plan.module_styles()
    assert styles["up.parametrizations.weight"] == "replicate" and styles["head"].startswith("colwise"), styles
    assert result.passed, result.summary() + "\n" + "\n".join(result.problems)


def test_a_module_that_keeps_its_forward_state_is_checked() -> None:
    """The local check copies each block; a tensor a forward left on it (a recurrent state)
    failed that copy with an internal error."""
    from tests.portability.custom_leaves import StatefulLM

    with torch.device("meta"):
        model = StatefulLM()
    plan = shardplan.plan_model(model, {"tp": 2}, example_inputs=TOKENS, explain=False)
    assert {plan.rule_for("up").style, plan.rule_for("down").style} == {"colwise", "rowwise"}
