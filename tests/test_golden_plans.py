"""Golden plans: ``plans/*.yaml`` are what ``shardplan plan`` writes today, byte for byte.

Each case regenerates its plan in this process through the command line's own code path
(``shardplan.cli.main([... "-o", tmpfile])``) and compares the bytes with the checked-in
file, so this is also the determinism check: same model, mesh and options -> the same file,
in another process, another day. On a mismatch the failure shows the first lines of a
unified diff and the command that regenerates the file.

When a planner change is *meant* to change plans, regenerate them all (one command, from
the repository root) and review the diff like any other change::

    python -m tests.test_golden_plans --regenerate
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"
DIFF_LINES = 40


class Golden(NamedTuple):
    file: str
    model: str
    mesh: str

    @property
    def argv(self) -> list[str]:
        return ["plan", self.model, "--mesh", self.mesh, "-o", f"plans/{self.file}", "--force"]

    @property
    def command(self) -> str:
        return "python -m shardplan " + " ".join(self.argv)


GOLDEN = [
    Golden("llama3-8b.tp8.yaml", "llama3-8b", "tp=8"),
    Golden("llama3-70b.tp8.yaml", "llama3-70b", "tp=8"),
    Golden("llama3-405b.tp8.yaml", "llama3-405b", "tp=8"),
    Golden("llama3-8b.dp8-tp8.yaml", "llama3-8b", "dp=8,tp=8"),
    Golden("llama3-70b.dp16-tp8.yaml", "llama3-70b", "dp=16,tp=8"),
    Golden("llama3-405b.dp16-tp8.yaml", "llama3-405b", "dp=16,tp=8"),
    Golden("gpt2.tp8.yaml", "gpt2", "tp=8"),
    Golden("mixtral.tp8.yaml", "hf:mixtral", "tp=8"),
]


def generate(golden: Golden, path: Path) -> None:
    """Write ``golden``'s plan to ``path`` exactly as its command does."""
    from shardplan.cli import main

    argv = golden.argv[:-2] + [str(path), "--force"]
    code = main(argv)
    if code != 0:
        raise RuntimeError(f"`{golden.command}` exited {code}")


@pytest.mark.parametrize("golden", GOLDEN, ids=lambda g: g.file.removesuffix(".yaml"))
def test_golden_plan_is_reproduced(golden: Golden, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if golden.model.startswith("hf:"):
        pytest.importorskip("transformers")
    checked_in = PLANS / golden.file
    assert checked_in.is_file(), f"plans/{golden.file} is missing; make it with:\n  {golden.command}"
    fresh = tmp_path / golden.file
    generate(golden, fresh)
    capsys.readouterr()
    want, got = checked_in.read_text(), fresh.read_text()
    if got != want:
        diff = list(difflib.unified_diff(want.splitlines(), got.splitlines(), f"plans/{golden.file} (checked in)",
                                         f"{golden.file} (regenerated now)", lineterm="", n=1))
        more = f"\n... ({len(diff) - DIFF_LINES} more diff lines)" if len(diff) > DIFF_LINES else ""
        pytest.fail(
            f"plans/{golden.file} is not what `shardplan plan` writes now:\n"
            + "\n".join(diff[:DIFF_LINES]) + more
            + f"\nIf the planner change is intended, regenerate it with:\n  {golden.command}\n"
            "or all golden plans with:\n  python -m tests.test_golden_plans --regenerate",
            pytrace=False,
        )


def test_readme_lists_every_golden_plan() -> None:
    readme = (PLANS / "README.md").read_text()
    for golden in GOLDEN:
        assert golden.command in readme, f"plans/README.md does not show how {golden.file} is made"
    listed = {p.name for p in PLANS.glob("*.yaml")}
    assert listed == {g.file for g in GOLDEN}, f"plans/ holds files no test checks: {sorted(listed - {g.file for g in GOLDEN})}"


def regenerate() -> int:
    """Rewrite every golden plan (run from anywhere; files land in plans/)."""
    for golden in GOLDEN:
        generate(golden, PLANS / golden.file)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        print("usage: python -m tests.test_golden_plans --regenerate", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(regenerate())
