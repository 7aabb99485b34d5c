"""The bad-input table: one row per way to hand shardplan something it cannot use.

A row is data. ``cli(...)`` runs ``shardplan.cli.main(argv)`` in this process, ``proc(...)``
runs ``python -m shardplan ARGV`` in a subprocess (only where the process itself matters:
a crash, ``os._exit``, the real exit status), ``api(...)`` calls a function and expects an
exception. Every row names

* ``id``; ``argv`` (a shell-like string or a list) or ``call`` (``fx -> ...``, see
  :class:`Fixtures` in test_bad_inputs.py: ``fx.plan("mlp")`` is a small valid plan);
* ``files``: ``{name: text | bytes | Edit(...) | DIR}`` created in a fresh temporary
  directory, which is the working directory while the row runs. ``Edit("mlp", (old, new),
  ...)`` is the text of a valid plan file (``BASES``) with each ``old`` replaced once by
  ``new``; ``DIR`` makes a directory;
* the expected exit status (``code``: 2 unusable input, 1 ``check`` findings) or exception
  type (``exc``);
* ``match``: a regex searched in stderr (CLI) or ``str(exception)`` (API); ``out``: one for
  stdout (``check`` prints its findings there). ``{line:REGEX}`` in either stands for the
  1-based number of the first line, in the row's files, that REGEX matches;
* ``bound``: seconds the answer must come within (measured around the call);
* ``xfail``: what happens today when that is wrong; the row keeps the right expectation
  and is ``xfail(strict=True)`` until shardplan is fixed.

Every row also asserts: no "Traceback" on stderr, no "internal error", and for exit 2 one
``shardplan: error:`` line (plus at most one more for details).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import shardplan
from shardplan import PlanFileError, PlanningError, TraceError
from shardplan.apply.mesh import make_mesh
from shardplan.cli import parse_mesh

from .models import builders

__all__ = ["Case", "Edit", "DIR", "BASES", "CASES", "cli", "proc", "api"]

BUILDERS = (Path(__file__).parent / "models" / "builders.py").read_text()

# valid plan files the plan-file rows edit (written once per session with `shardplan plan -o`)
BASES: dict[str, list[str]] = {
    "mlp": ["plan", "mlp", "--mesh", "tp=2", "--no-explain"],
    "llama": ["plan", "llama3-debug", "--mesh", "tp=2", "--no-explain"],
}


@dataclass(frozen=True)
class Edit:
    """The text of base plan ``base`` with each ``(old, new)`` replaced once (``old``, a string
    or a compiled regex, must occur)."""

    base: str
    pairs: tuple[tuple[Any, str], ...] = ()

    def __init__(self, base: str, *pairs: tuple[Any, str]) -> None:
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "pairs", tuple(pairs))

    def apply(self, text: str) -> str:
        for old, new in self.pairs:
            if isinstance(old, re.Pattern):
                assert old.search(text), f"fixture edit: {old.pattern!r} matches nothing in the {self.base} plan any more"
                text = old.sub(new, text, count=1)
            else:
                assert old in text, f"fixture edit: {old!r} is not in the {self.base} plan any more"
                text = text.replace(old, new, 1)
        return text


DIR = object()  # files={"name": DIR}: a directory


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # "cli" (in-process main), "proc" (python -m shardplan), "api"
    argv: tuple[str, ...] = ()
    call: Callable[[Any], Any] | None = None
    files: Mapping[str, Any] = field(default_factory=dict)
    code: int | None = None
    exc: type[BaseException] | None = None
    match: str = ""
    out: str | None = None
    bound: float = 20.0
    xfail: str | None = None

    @property
    def timeout(self) -> int:
        """Hard stop for a hang (pytest-timeout): well past the bound, so the bound's own
        assertion reports a slow answer first."""
        return int(max(30, 3 * self.bound))


def _argv(argv: str | list[str]) -> tuple[str, ...]:
    return tuple(shlex.split(argv) if isinstance(argv, str) else argv)


def cli(id: str, argv: str | list[str], match: str, *, code: int = 2, files: Mapping[str, Any] | None = None,
        out: str | None = None, bound: float = 20.0, xfail: str | None = None) -> Case:
    return Case(id, "cli", argv=_argv(argv), files=files or {}, code=code, match=match, out=out, bound=bound, xfail=xfail)


def proc(id: str, argv: str | list[str], match: str, *, code: int = 2, files: Mapping[str, Any] | None = None,
         out: str | None = None, bound: float = 20.0, xfail: str | None = None) -> Case:
    return Case(id, "proc", argv=_argv(argv), files=files or {}, code=code, match=match, out=out, bound=bound, xfail=xfail)


def api(id: str, call: Callable[[Any], Any], exc: type[BaseException], match: str, *,
        files: Mapping[str, Any] | None = None, bound: float = 20.0, xfail: str | None = None) -> Case:
    return Case(id, "api", call=call, files=files or {}, exc=exc, match=match, bound=bound, xfail=xfail)


# --------------------------------------------------------------------------- helpers the API rows call


def mlp() -> torch.nn.Module:
    from shardplan.models import build_preset

    return build_preset("mlp")


def llama() -> torch.nn.Module:
    from shardplan.models import build_preset

    return build_preset("llama3-debug")


def llama_inputs() -> tuple:
    from shardplan.models import get_preset

    return get_preset("llama3-debug").example_inputs(device="meta")


def on_fake_mesh(axes: dict[str, int], body: Callable[[Any], Any]) -> Any:
    """``body(mesh)`` under a fake process group of the axes' world size."""
    import math

    from shardplan.apply.mesh import fake_process_group

    with fake_process_group(math.prod(axes.values())):
        return body(make_mesh(axes))


def apply_twice(fx: Any) -> None:
    from shardplan.models import build_preset

    def body(mesh: Any) -> None:
        model = build_preset("mlp", device="cpu")
        shardplan.apply_plan(model, mesh, fx.plan("mlp"))
        shardplan.apply_plan(model, mesh, fx.plan("mlp"))

    on_fake_mesh({"tp": 2}, body)


def apply_on_cpu_mlp(axes: dict[str, int], plan: Any) -> None:
    from shardplan.models import build_preset

    on_fake_mesh(axes, lambda mesh: shardplan.apply_plan(build_preset("mlp", device="cpu"), mesh, plan))


# --------------------------------------------------------------------------- plan-file texts

P = "plan.yaml"
ALIAS_BOMB = "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
    f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 12)]) + "\n"
DEEP_LIST = "rules: " + "[" * 100_000 + "]" * 100_000 + "\n"
DEEP_MAP = "rules: " + "{a: " * 100_000 + "1" + "}" * 100_000 + "\n"
DEEP_DASHES = "rules:\n  " + "- " * 100_000 + "x\n"  # block sequences nested on one line: no brackets, no indent
DEEP_BLOCK = "rules:\n" + "".join("  " * i + "- a:\n" for i in range(1, 41)) + "  " * 41 + "  x: 1\n"
RULE0 = "- module: layers.0\n  style: colwise\n"  # the mlp plan's first rule
STYLES_RE = r"expected one of 'colwise', 'rowwise', .* or 'replicate'"
NOT_DIVISIBILITY = r"^(?![\s\S]*not divisible)[\s\S]*"  # a message that does not blame divisibility, then ...

SYNTAX_ERROR = "import torch\n\n\ndef build(:\n    return torch.nn.Linear(4, 4)\n"
IMPORT_RAISES = 'import torch\n\nCONFIG = {"width": 64}\nWIDTH = CONFIG["depth"]\n\n\ndef build():\n    return torch.nn.Linear(4, 4)\n'
NEG_HEADS = ('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
             '"num_attention_heads": -4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}\n')
B = {"bi_builders.py": BUILDERS}

SEGFAULT = ("'- - - ... x' (100000 block sequences nested on one line) passes fileio's bracket/indentation "
            "pre-check; libyaml's recursive composer then overflows the C stack: SIGSEGV (signal 11, 139 in a shell)")
ABS_PATH = ("names the absolute path (/tmp/.../{0}); docs/troubleshooting.md: a <file>:<line> is written relative to "
            "the working directory when the file is under it")

# --------------------------------------------------------------------------- the table

CASES: list[Case] = [
    # ---- plan files: syntax and structure (shardplan check PLAN MODEL)
    cli("pf-not-yaml", f"check {P} mlp", r"plan\.yaml:3: not valid YAML \(.+\); fix the syntax",
        files={P: "version: 1\nrules: [\n"}),
    cli("pf-top-level-list", f"check {P} mlp", r"plan\.yaml:\d+: a plan file is a YAML mapping .*; got sequence",
        files={P: "- version: 1\n- rules: []\n"}),
    cli("pf-top-level-scalar", f"check {P} mlp", r"plan\.yaml:\d+: a plan file is a YAML mapping .*; got scalar",
        files={P: "just some words\n"}),
    cli("pf-empty-file", f"check {P} mlp", r"plan\.yaml:\d+: a plan file is a YAML mapping .*; got nothing", files={P: ""}),
    cli("pf-unknown-key-top", f"check {P} mlp", r"plan\.yaml:{line:^colour:}: colour: unknown key",
        files={P: Edit("mlp", ("regions: []\n", "regions: []\ncolour: red\n"))}),
    cli("pf-unknown-key-rule", f"check {P} mlp", r"plan\.yaml:{line:^  colour:}: rules\.0\.colour: unknown key",
        files={P: Edit("mlp", (RULE0, RULE0 + "  colour: red\n"))}),
    cli("pf-unknown-key-mesh", f"check {P} mlp", r"plan\.yaml:{line:^  shape:}: mesh\.shape: unknown key",
        files={P: Edit("mlp", ("  tp_axis: tp\n", "  tp_axis: tp\n  shape: [2]\n"))}),
    cli("pf-wrong-style", f"check {P} mlp",
        rf"plan\.yaml:{{line:colwize}}: rules\.0\.style: 'colwize' is not allowed; {STYLES_RE}",
        files={P: Edit("mlp", ("style: colwise\n", "style: colwize\n"))}),
    cli("pf-two-wrong-styles", f"check {P} mlp",
        r"plan\.yaml:{line:colwize}: rules\.0\.style: 'colwize' is not allowed[\s\S]*"
        r"plan\.yaml:{line:rowwize}: rules\.1\.style: 'rowwize' is not allowed",
        files={P: Edit("mlp", ("style: colwise\n", "style: colwize\n"), ("style: rowwise\n", "style: rowwize\n"))}),
    cli("pf-missing-module", f"check {P} mlp", r"plan\.yaml:{line:^- style: colwise}: rules\.0\.module: this key is required",
        files={P: Edit("mlp", (RULE0, "- style: colwise\n"))}),
    cli("pf-missing-style", f"check {P} mlp", r"plan\.yaml:{line:^- module: layers\.0}: rules\.0\.style: this key is required",
        files={P: Edit("mlp", (RULE0, "- module: layers.0\n"))}),
    cli("pf-layout-not-a-layout", f"check {P} mlp",
        r"plan\.yaml:{line:Shard\(x\)}: rules\.0\.output_layouts: .*layout 'Shard\(x\)' is not one of Replicate, Partial, Shard\(d\)",
        files={P: Edit("mlp", (RULE0, RULE0 + "  output_layouts: Shard(x)\n"))}),
    cli("pf-layout-shard-99", f"check {P} mlp",
        r"plan\.yaml:{line:Shard\(99\)}: rules\.0\.output_layouts: .*layout 'Shard\(99\)' shards a dimension no tensor here has",
        files={P: Edit("mlp", (RULE0, RULE0 + "  input_layouts: Replicate\n  output_layouts: Shard(99)\n"))}),
    cli("pf-region-input-out-of-range", f"check {P} llama3-debug",
        r"plan\.yaml:({line:^- module: layers\.\*\.attention$}|{line:^  input: 5}): regions\.0: "
        r".*input 5 is not one of the call's 3 positional arguments",
        files={P: Edit("llama", ("  input: 0\n  num_inputs: 3\n", "  input: 5\n  num_inputs: 3\n"))}),
    cli("pf-packed-0", f"check {P} mlp", r"plan\.yaml:{line:packed: 0}: rules\.0\.packed: .*packed 0 is neither a count of equal parts \(an int >= 2\) nor the widths of unequal ones",
        files={P: Edit("mlp", ("  style: colwise\n", "  style: packed_colwise\n  packed: 0\n"))}),
    cli("pf-packed-1", f"check {P} mlp", r"plan\.yaml:{line:packed: 1}: rules\.0\.packed: .*packed 1 is neither a count of equal parts \(an int >= 2\) nor the widths of unequal ones",
        files={P: Edit("mlp", ("  style: colwise\n", "  style: packed_colwise\n  packed: 1\n"))}),
    cli("pf-tp-0", f"check {P} mlp", r"plan\.yaml:{line:^    tp:}: mesh\.axes\.tp: .*greater than or equal to 1; got 0",
        files={P: Edit("mlp", ("    tp: 2\n", "    tp: 0\n"))}),
    cli("pf-tp-negative", f"check {P} mlp", r"plan\.yaml:{line:^    tp:}: mesh\.axes\.tp: .*greater than or equal to 1; got -2",
        files={P: Edit("mlp", ("    tp: 2\n", "    tp: -2\n"))}),
    cli("pf-tp-true", f"check {P} mlp", r"plan\.yaml:{line:^    tp:}: mesh\.axes\.tp: .*valid integer; got True",
        files={P: Edit("mlp", ("    tp: 2\n", "    tp: true\n"))}),
    cli("pf-tp-string", f"check {P} mlp", r"plan\.yaml:{line:^    tp:}: mesh\.axes\.tp: .*valid integer; got '8'",
        files={P: Edit("mlp", ("    tp: 2\n", '    tp: "8"\n'))}),
    cli("pf-tp-axis-not-an-axis", f"check {P} mlp",
        r"plan\.yaml:({line:^mesh:}|{line:^  tp_axis:}): mesh[.:].*tp_axis 'dp' is not one of the mesh axes \['tp'\]",
        files={P: Edit("mlp", ("  tp_axis: tp\n", "  tp_axis: dp\n"))}),
    cli("pf-version-2", f"check {P} mlp", r"plan\.yaml:1: version: 2 is not allowed; expected one of 1",
        files={P: Edit("mlp", ("version: 1\n", "version: 2\n"))}),
    cli("pf-duplicate-key", f"check {P} mlp",
        r"plan\.yaml:{line:# dup}: rules\.0\.style: key given twice \(lines {line:^  style: colwise$} and {line:# dup}\)",
        files={P: Edit("mlp", (RULE0, RULE0 + "  style: rowwise  # dup\n"))}),
    cli("pf-yaml-alias-bomb", f"check {P} mlp", r"plan\.yaml:2: a1\.0: YAML aliases \(\*name\) are not allowed",
        files={P: ALIAS_BOMB}, bound=2),
    proc("pf-nesting-100000-deep-list", f"check {P} mlp", r"plan\.yaml(:\d+)?: nested deeper than a plan file can be",
         files={P: DEEP_LIST}, bound=10),
    proc("pf-nesting-100000-deep-map", f"check {P} mlp", r"plan\.yaml(:\d+)?: nested deeper than a plan file can be",
         files={P: DEEP_MAP}, bound=10),
    proc("pf-nesting-100000-compact-dashes", f"check {P} mlp", r"plan\.yaml(:\d+)?: nested deeper than a plan file can be",
         files={P: DEEP_DASHES}, bound=10),
    cli("pf-nesting-40-block-levels", f"check {P} mlp", r"plan\.yaml:\d+: nested deeper than a plan file can be",
        files={P: DEEP_BLOCK}),
    cli("pf-yaml-python-tag", f"check {P} mlp",
        r"plan\.yaml:{line:python/object}: model\.class_name: YAML tag '[^']*os\.system' is not allowed",
        files={P: Edit("mlp", ("  class_name: MLP\n", "  class_name: !!python/object/apply:os.system ['echo hi']\n"))}),
    cli("pf-yaml-timestamp", f"check {P} mlp", r"plan\.yaml:{line:2024-01-01}: model\.class_name: YAML tag 'timestamp'",
        files={P: Edit("mlp", ("  class_name: MLP\n", "  class_name: 2024-01-01\n"))}),
    cli("pf-yaml-merge-key", f"check {P} mlp", r"plan\.yaml:{line:<<}: mesh\.axes: .*'<<'",
        files={P: Edit("mlp", ("mesh:\n  axes:\n    tp: 2\n", "mesh:\n  axes:\n    <<: {tp: 2}\n"))}),
    cli("pf-non-scalar-key", f"check {P} mlp", r"plan\.yaml:{line:^\? \[a, b\]}: <top>: a key must be a plain name",
        files={P: Edit("mlp", ("version: 1\n", "version: 1\n? [a, b]\n: 1\n"))}),
    cli("pf-non-utf8", f"check {P} mlp", r"plan\.yaml: not a UTF-8 text file \(byte \d+ is 0xff\)",
        files={P: b"version: 1\nrules: \xff\xfe\x00\n"}),
    cli("pf-missing-file", "check missing.yaml mlp", r"cannot read plan file 'missing\.yaml': No such file or directory"),
    cli("pf-directory", "check plans mlp", r"cannot read plan file 'plans': Is a directory", files={"plans": DIR}),
    cli("pf-more-than-five-problems", f"check {P} mlp",
        r"plan\.yaml:{line:^  x: 1}: mesh\.x: unknown key[\s\S]*'c1' is not allowed[\s\S]*\.\.\. and 1 more",
        files={P: Edit("mlp", ("  tp_axis: tp\n", "  tp_axis: tp\n  x: 1\n  y: 2\n"), ("style: colwise\n", "style: c1\n"),
                       ("style: rowwise\n", "style: r1\n"), ("style: colwise\n", "style: c1\n"),
                       ("style: rowwise\n", "style: r1\n"))}),
    # ---- check findings: a valid file that does not fit the model (exit 1, findings on stdout)
    cli("check-plan-for-another-model", f"check {P} mlp", r"finding\(s\): plan\.yaml does not fit mlp", code=1,
        out=r"plan\.yaml:{line:^  fingerprint:}: fingerprint: the plan is for a Transformer with sha256:\w+, "
            r"the model is a MLP with sha256:\w+",
        files={P: Edit("llama")}),
    cli("check-rule-matches-no-module", f"check {P} mlp", r"finding\(s\): plan\.yaml does not fit mlp", code=1,
        out=r"plan\.yaml:{line:layers\.9}: rule layers\.9 \(rowwise\): matches no module of the model",
        files={P: Edit("mlp", ("module: layers.3\n", "module: layers.9\n"))}),
    cli("check-star-rule-on-containers", f"check {P} mlp", r"finding\(s\): plan\.yaml does not fit mlp", code=1,
        out=r"plan\.yaml:{line:module: '\*'}: rule \* \(colwise\): .*owns no parameters",
        files={P: Edit("mlp", ("module: layers.0\n", "module: '*'\n"))}),
    cli("check-rule-on-norms", f"check {P} llama3-debug", r"finding\(s\): plan\.yaml does not fit llama3-debug", code=1,
        out=r"plan\.yaml:{line:attention_norm}: rule layers\.\*\.attention_norm \(colwise\): layers\.0\.attention_norm "
            r"is a RMSNorm \(norm\), which colwise cannot split",
        files={P: Edit("llama", ("- module: layers.*.attention_norm\n  style: replicate\n",
                                 "- module: layers.*.attention_norm\n  style: colwise\n"))}),
    cli("check-weight-no-rule-covers", f"check {P} mlp", r"1 finding\(s\): plan\.yaml does not fit mlp", code=1,
        out=r"^layers\.3 \(Linear\): owns parameters but no rule covers it$",
        files={P: Edit("mlp", ("- module: layers.3\n  style: rowwise\n", ""))}),
    cli("check-tp-does-not-divide", f"check {P} mlp", r"finding\(s\): plan\.yaml does not fit mlp", code=1,
        out=r"plan\.yaml:{line:^  style: colwise}: layers\.0: colwise splits weight dim 0 of size 512, which tp=3 does not divide",
        files={P: Edit("mlp", ("    tp: 2\n", "    tp: 3\n"))}),
    cli("check-unknown-model", f"check {P} nosuch-model", r"unknown model 'nosuch-model'", files={P: Edit("mlp")}),
    # ---- other plan-file commands
    cli("diff-missing-file", f"diff {P} missing.yaml", r"cannot read plan file 'missing\.yaml'", files={P: Edit("mlp")}),
    cli("diff-not-a-plan", f"diff {P} list.yaml", r"list\.yaml:\d+: a plan file is a YAML mapping .*; got sequence",
        files={P: Edit("mlp"), "list.yaml": "- a\n- b\n"}),
    cli("plan-output-exists", f"plan mlp --mesh tp=2 -o {P}", r"plan\.yaml exists; pass --force to overwrite it",
        files={P: "keep me\n"}, bound=5),
    cli("plan-output-with-table-format", "plan mlp -o out.yaml --format table", r"-o writes a plan file: use --format yaml"),
    cli("plan-output-parent-is-a-file", "plan mlp --mesh tp=2 --no-explain -o afile/p.yaml", r"afile/p\.yaml",
        files={"afile": "not a directory\n"}, bound=5),
    cli("plan-output-is-a-directory", "plan mlp --mesh tp=2 --no-explain --force -o outdir", r"-o outdir: is a directory",
        files={"outdir": DIR}),
    cli("simulate-plan-missing", "simulate mlp --plan missing.yaml", r"cannot read plan file 'missing\.yaml'"),
    cli("simulate-plan-without-estimate", f"simulate mlp --plan {P}", r"plan\.yaml records no estimate",
        files={P: Edit("mlp", (re.compile(r"^estimate:\n(  .*\n)+", re.M), "estimate: null\n"))}),
    cli("simulate-plan-batch-differs", f"simulate mlp --plan {P} --batch 7",
        r"--batch 7 differs from the 2 plan\.yaml was planned for", files={P: Edit("mlp")}),
    cli("verify-plan-with-mesh", f"verify mlp --plan {P} --mesh tp=2", r"--mesh: planning options do not apply to --plan plan\.yaml",
        files={P: Edit("mlp")}),
    cli("verify-plan-nproc-mismatch", f"verify mlp --plan {P} --nproc 3", r"tp=2 but nproc=3", files={P: Edit("mlp")}),
    # ---- command line: options
    cli("cli-no-command", [], r"usage: shardplan"),
    cli("cli-unknown-command", "frobnicate", r"invalid choice: 'frobnicate'"),
    cli("cli-missing-model", "plan", r"the following arguments are required: MODEL"),
    cli("cli-unknown-preset", "plan llama3-dbug", r"unknown model 'llama3-dbug'.*did you mean llama3-debug"),
    cli("mesh-tp-0", "plan mlp --mesh tp=0", r"bad --mesh 'tp=0': expected axis=size pairs \(positive sizes\)"),
    cli("mesh-tp-abc", "plan mlp --mesh tp=abc", r"bad --mesh 'tp=abc'"),
    cli("mesh-axis-twice", "plan mlp --mesh tp=8,tp=4", r"bad --mesh 'tp=8,tp=4': axis 'tp' appears twice"),
    cli("mesh-empty", ["plan", "mlp", "--mesh", ""], r"bad --mesh ''"),
    cli("mesh-dp-0", "plan mlp --mesh dp=0,tp=2", r"bad --mesh 'dp=0,tp=2'"),
    cli("mesh-tp-1000000", "plan mlp --mesh tp=1000000", r"tp=1000000 is more ranks .*largest dimension is 512 \(layers\.\d\.weight\)",
        bound=5),
    cli("mesh-tp-2147483648", "plan mlp --mesh tp=2147483648", r"tp=2147483648 is more ranks .*largest dimension is 512", bound=5),
    cli("mesh-tp-huge-big-preset", "plan llama3-405b --mesh tp=1000000",
        r"tp=1000000 is more ranks .*largest dimension is 128256 \(tok_embeddings\.weight\)", bound=10),
    cli("opt-batch-0", "plan mlp --batch 0", r"argument --batch: expected a positive integer, got '0'"),
    cli("opt-seq-negative", "plan mlp --seq -1", r"argument --seq: expected a positive integer, got '-1'"),
    cli("opt-batch-overflow", "plan mlp --no-explain --batch 99999999999999999999", r"99999999999999999999"),
    cli("opt-seq-beyond-preset", "plan llama3-debug --seq 100000", r"preset llama3-debug: seq_len must be in \[1, 64\], got 100000"),
    cli("opt-dtype-fp13", "plan mlp --dtype fp13", r"unknown dtype 'fp13'; expected one of: bf16"),
    cli("opt-dtype-not-on-hardware", "plan mlp --no-explain --dtype fp8 --hardware a100", r"a100 has no peak FLOP/s for 'fp8'"),
    cli("opt-hardware-tpu", "plan mlp --hardware tpu", r"unknown hardware profile 'tpu'; expected one of: a100"),
    cli("opt-memory-budget-80XB", "plan mlp --memory-budget 80XB", r"cannot parse byte size '80XB'"),
    cli("opt-memory-budget-negative", "plan mlp --memory-budget=-5", r"byte size '-5'"),
    cli("opt-memory-budget-fraction", "plan mlp --memory-budget 1.5", r"byte size '1\.5' is not a whole number of bytes"),
    cli("opt-memory-budget-1e400", "plan mlp --no-explain --memory-budget 1e400", r"'1e400'"),
    cli("opt-memory-budget-1KB-no-plan-fits", "plan mlp --no-explain --memory-budget 1KB",
        r"memory budget 1000 B per device cannot be met at tp=8"),
    cli("opt-format-xml", "plan mlp --format xml", r"argument --format: invalid choice: 'xml'"),
    cli("opt-sequence-parallel-maybe", "plan mlp --sequence-parallel maybe", r"invalid choice: 'maybe'"),
    cli("opt-strict-refuses", "plan mlp --mesh tp=3 --no-explain --strict",
        r"strict planning refused the plan:\n  layers\.0: output all-gathered: .*tp=3"),
    cli("explain-no-such-module", "explain mlp layers.9 --mesh tp=2", r"mlp has no module 'layers\.9'; weight modules look like 'layers\.0'"),
    cli("verify-nproc-0", "verify mlp --nproc 0", r"argument --nproc: expected a positive integer, got '0'"),
    cli("verify-timeout-0", "verify mlp --timeout 0", r"argument --timeout: expected a positive number of seconds, got '0'"),
    cli("verify-model-too-big", "verify llama3-8b --nproc 2", r"llama3-8b has 8\.03B parameters: verify builds it whole", bound=10),
    cli("verify-nproc-beyond-weights", "verify mlp --nproc 100000", r"tp=100000 is more ranks .*largest dimension is 512", bound=10),
    # ---- command line: model specs
    cli("hf-unknown-model-type", "plan hf:lamma", r"unknown Hugging Face model type 'lamma'.*did you mean hf:llama"),
    cli("hf-config-missing", "plan ./nope/config.json", r"no Hugging Face config at 'nope/config\.json'"),
    cli("hf-config-not-json", "plan broken.json", r"cannot load Hugging Face config 'broken\.json'",
        files={"broken.json": '{"model_type": "llama", "hidden_size": 64,\n'}),
    cli("hf-config-negative-heads", "plan cfg/config.json --mesh tp=2 --no-explain", r"config num_attention_heads is -4",
        files={"cfg/config.json": NEG_HEADS}),
    cli("spec-module-missing", "plan nosuchmod_xyz:build", r"nosuchmod_xyz:build: cannot import module 'nosuchmod_xyz'"),
    cli("spec-syntax-error", "plan bi_syntax:build", r"module 'bi_syntax' has a syntax error at \S*bi_syntax\.py:{line:def build\(:}",
        files={"bi_syntax.py": SYNTAX_ERROR}),
    cli("spec-syntax-error-relative-path", "plan bi_syntax:build", r"syntax error at bi_syntax\.py:{line:def build\(:}",
        files={"bi_syntax.py": SYNTAX_ERROR}),
    cli("spec-raises-at-import", "plan bi_import:build",
        r"importing module 'bi_import' raised KeyError: 'depth' at \S*bi_import\.py:{line:CONFIG\[\"depth\"\]}",
        files={"bi_import.py": IMPORT_RAISES}),
    cli("spec-callable-raises", "plan bi_builders:raises",
        r"calling raises\(\) raised RuntimeError: builder exploded: width 'sixty-four' at \S*bi_builders\.py:{line:raise RuntimeError}",
        files=B),
    cli("spec-callable-raises-relative-path", "plan bi_builders:raises", r" at bi_builders\.py:{line:raise RuntimeError}",
        files=B),
    cli("spec-callable-sys-exit-0", "plan bi_builders:exits", r"calling exits\(\) raised SystemExit: 0", files=B),
    proc("spec-callable-os-exit", "plan bi_builders:hard_exit", r"bi_builders:hard_exit", files=B),
    cli("spec-returns-non-module", "plan bi_builders:returns_dict",
        r"returns_dict\(\) returned a dict object; expected a torch\.nn\.Module", files=B),
    cli("spec-not-callable", "plan bi_builders:NOT_CALLABLE", r"NOT_CALLABLE is a int, not a callable", files=B),
    cli("spec-no-such-attribute", "plan bi_builders:nosuch", r"module 'bi_builders' has no attribute 'nosuch'", files=B),
    cli("spec-needs-arguments", "plan bi_builders:needs_args", r"calling needs_args\(\) raised TypeError: .*'width'", files=B),
    cli("spec-without-colon", "plan mymodels.build", r"unknown model 'mymodels\.build': expected a preset name"),
    cli("spec-empty-module", "plan :build", r"model spec ':build' is not 'package\.module:callable'"),
    cli("spec-empty", ["plan", ""], r"model ''|empty"),
    cli("spec-model-without-parameters", "plan bi_builders:Empty", r"Empty has no parameters: there is nothing to shard",
        files=B),
    cli("spec-data-dependent-branch", "plan bi_builders:Branchy --mesh tp=2",
        r"control flow depends on tensor values at \w+ (\(.*\) )?\(data-dependent branch\)", files=B),
    proc("proc-usage-error-exit-status", "plan", r"the following arguments are required: MODEL", bound=10),
    proc("proc-huge-tp-exit-status", "plan llama3-405b --mesh tp=2147483648", r"tp=2147483648 is more ranks", bound=20),
    # ---- API: plan_model
    api("api-mesh-tp-0", lambda fx: shardplan.plan_model(mlp(), {"tp": 0}), ValueError,
        r"mesh axis sizes must be positive integers.*\{'tp': 0\}"),
    api("api-mesh-tp-true", lambda fx: shardplan.plan_model(mlp(), {"tp": True}), ValueError, r"\{'tp': True\}"),
    api("api-mesh-tp-float", lambda fx: shardplan.plan_model(mlp(), {"tp": 2.0}), ValueError, r"\{'tp': 2\.0\}"),
    api("api-mesh-empty", lambda fx: shardplan.plan_model(mlp(), {}), ValueError, r"mesh axis sizes .*got \{\}"),
    api("api-mesh-not-a-mesh", lambda fx: shardplan.plan_model(mlp(), 8), ValueError,
        r"mesh must be a DeviceMesh or axis sizes like \{'tp': 8\}; got int"),
    api("api-mesh-string", lambda fx: shardplan.plan_model(mlp(), "tp=8"), ValueError, r"got str"),
    api("api-unknown-option", lambda fx: shardplan.plan_model(mlp(), {"tp": 2}, batch=4), ValueError,
        r"unknown plan_model option\(s\) \['batch'\]"),
    api("api-example-inputs-wrong-shape",
        lambda fx: shardplan.plan_model(mlp(), {"tp": 2}, example_inputs=(torch.zeros(2, 7, device="meta"),)), TraceError,
        r"could not compute the shape of .*layers\.0.*\[2, 7\]"),
    api("api-tp-axis-not-an-axis", lambda fx: shardplan.plan_model(mlp(), {"dp": 2, "tp": 2}, tp_axis="model"), ValueError,
        r"tp_axis 'model' is not a mesh axis; the mesh has \['dp', 'tp'\]"),
    api("api-dtype-unknown", lambda fx: shardplan.plan_model(mlp(), {"tp": 2}, dtype="fp13"), ValueError, r"unknown dtype 'fp13'"),
    api("api-hardware-unknown", lambda fx: shardplan.plan_model(mlp(), {"tp": 2}, hardware="tpu"), ValueError,
        r"unknown hardware profile 'tpu'"),
    api("api-memory-budget-unparseable", lambda fx: shardplan.plan_model(mlp(), {"tp": 2}, memory_budget="80XB"), ValueError,
        r"cannot parse byte size '80XB'"),
    api("api-memory-budget-negative", lambda fx: shardplan.plan_model(mlp(), {"tp": 2}, memory_budget=-5), ValueError,
        r"memory.budget.*-5"),
    api("api-optimizer-unknown", lambda fx: shardplan.plan_model(mlp(), {"tp": 2}, optimizer="lion"), ValueError,
        r"optimizer[\s\S]*'lion'"),
    api("api-batch-size-0", lambda fx: shardplan.plan_model(mlp(), {"tp": 2}, batch_size=0), ValueError, r"batch_size.*\b0\b"),
    api("api-model-not-a-module", lambda fx: shardplan.plan_model("mlp", {"tp": 2}), ValueError, r"nn\.Module.*str|str.*nn\.Module"),
    api("api-cannot-infer-inputs", lambda fx: shardplan.plan_model(builders.ConvOnly(), {"tp": 2}), ValueError,
        r"cannot infer example inputs for ConvOnly: it starts with a Conv1d \(4 channels\), whose input size it does "
        r"not say; pass example_inputs=\(tensor, \.\.\.\)"),
    api("api-no-parameters", lambda fx: shardplan.plan_model(builders.Empty(), {"tp": 2},
                                                             example_inputs=(torch.zeros(2, 4),)),
        ValueError, r"Empty has no parameters"),
    api("api-data-dependent-branch", lambda fx: shardplan.plan_model(builders.Branchy(), {"tp": 2}), TraceError,
        r"control flow depends on tensor values"),
    # ---- API: apply_plan / auto_parallelize
    api("api-auto-parallelize-needs-device-mesh", lambda fx: shardplan.auto_parallelize(mlp(), {"tp": 2}), ValueError,
        r"auto_parallelize needs a DeviceMesh to shard on; got dict"),
    api("api-apply-plan-mesh-none", lambda fx: shardplan.apply_plan(mlp(), None, fx.plan("mlp")), ValueError,
        r"apply_plan needs a DeviceMesh; got NoneType"),
    api("api-apply-plan-not-a-plan", lambda fx: on_fake_mesh({"tp": 2}, lambda mesh: shardplan.apply_plan(
        mlp(), mesh, fx.plan("mlp").to_data())), ValueError, r"apply_plan needs a shardplan Plan; got dict"),
    api("api-apply-plan-not-a-module", lambda fx: on_fake_mesh({"tp": 2}, lambda mesh: shardplan.apply_plan(
        "mlp", mesh, fx.plan("mlp"))), ValueError, r"apply_plan needs an nn\.Module; got str"),
    api("api-apply-plan-twice", apply_twice, ValueError, r"MLP is already parallelized \('layers\.0\.weight' is a DTensor\)"),
    api("api-apply-plan-for-another-model", lambda fx: apply_on_cpu_mlp({"tp": 2}, fx.plan("llama")), ValueError,
        r"this plan was made for a Transformer with fingerprint sha256:\w+, but the model given is a MLP"),
    api("api-apply-plan-tp-mismatch", lambda fx: apply_on_cpu_mlp({"tp": 4}, fx.plan("mlp")), ValueError,
        r"the plan was made for tp=2 but the mesh's tp axis has 4 ranks"),
    api("api-make-mesh-wrong-world-size", lambda fx: on_fake_mesh({"tp": 2}, lambda mesh: make_mesh({"tp": 4})), ValueError,
        r"mesh axes \{'tp': 4\} have product 4, but the world size is 2"),
    # ---- API: price_styles
    api("api-price-styles-unknown-style", lambda fx: shardplan.price_styles(mlp(), {"tp": 2}, {"layers.0": "colwize"}),
        ValueError, r"'layers\.0' is pinned to 'colwize', which is not a style"),
    api("api-price-styles-pin-matches-nothing", lambda fx: shardplan.price_styles(mlp(), {"tp": 2}, {"layers.9": "colwise"}),
        ValueError, r"'layers\.9' matches no module of MLP"),
    api("api-price-styles-not-divisible", lambda fx: shardplan.price_styles(mlp(), {"tp": 3}, {"layers.0": "colwise"}),
        PlanningError, r"'layers\.0' cannot take style 'colwise' at tp=3"),
    api("api-price-styles-infeasible", lambda fx: shardplan.price_styles(
        llama(), {"tp": 2}, {"layers.*.attention.wq": "colwise", "layers.*.attention.wo": "colwise"},
        example_inputs=llama_inputs()),  # wq splits the heads, which wo would need whole
        PlanningError, r"no valid tensor-parallel plan at tp=2"),
    api("api-price-styles-bad-layout", lambda fx: shardplan.price_styles(
        mlp(), {"tp": 2}, {"layers.0": ("colwise", {"input": "bogus"})}), ValueError, NOT_DIVISIBILITY + r"'bogus'"),
    api("api-price-styles-bad-layout-key", lambda fx: shardplan.price_styles(
        mlp(), {"tp": 2}, {"layers.0": ("colwise", {"inptu": "R"})}), ValueError, NOT_DIVISIBILITY + r"'inptu'"),
    # ---- API: plan files
    api("api-load-plan-missing", lambda fx: shardplan.load_plan("missing.yaml"), PlanFileError,
        r"cannot read plan file 'missing\.yaml': No such file or directory"),
    api("api-load-plan-directory", lambda fx: shardplan.load_plan("plans"), PlanFileError,
        r"cannot read plan file 'plans'", files={"plans": DIR}),
    api("api-from-yaml-garbage", lambda fx: shardplan.Plan.from_yaml("}{ not: [a plan", source="g.yaml"), PlanFileError,
        r"g\.yaml:1: not valid YAML"),
    api("api-from-yaml-required-keys", lambda fx: shardplan.Plan.from_yaml("version: 1\n", source="v.yaml"), PlanFileError,
        r"v\.yaml:1: model: this key is required"),
    api("api-explain-no-rule", lambda fx: fx.plan("mlp").explain("layers.9"), ValueError,
        r"no rule in this plan covers 'layers\.9'"),
    api("api-explain-no-decisions", lambda fx: fx.plan("mlp").explain("layers.0"), ValueError,
        r"the plan records no decision for 'layers\.0' \(it was written without explanations\)"),
    api("api-parse-mesh", lambda fx: parse_mesh("tp:8"), ValueError,
        r"bad --mesh 'tp:8'"),
]
