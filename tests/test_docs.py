"""The console examples in README.md and docs/*.md print what the docs say they print.

One test per console block, named by its file and line (``docs/cli.md:104``); a failure
shows the difference between the doc and the real output. The conventions (``$ `` lines,
``...``, what is normalised, directives) are in ``tests/docs_check.py``'s docstring. After an
intended change of output, regenerate and review:

    python -m tests.docs_check --update && git diff docs/ README.md

The blocks run in a thread pool (``DOCS_CHECK_JOBS``, default the CPU count, at most 4)
started by the first test; ``DOCS_CHECK_SKIP_SLOW=1`` skips blocks marked slow, and
``DOCS_CHECK_FRESH=1`` runs every command as a new process instead of forking a warm one.
"""

from __future__ import annotations

import os

import pytest

from tests import docs_check

BLOCKS = docs_check.collect_blocks()
SKIP_SLOW = os.environ.get("DOCS_CHECK_SKIP_SLOW", "") not in ("", "0")


def _skip_reason(block: docs_check.Block) -> str | None:
    return docs_check.skip_reason(block, skip_slow=SKIP_SLOW)


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest):
    """One pool for the module; every selected block is started at once, slow ones first."""
    pool = docs_check.Runner(docs_check.default_jobs())
    selected = [
        item.callspec.params["block"] for item in request.session.items
        if getattr(item, "path", None) == request.path and "block" in getattr(getattr(item, "callspec", None), "params", {})
    ]
    pool.submit([b for b in selected if _skip_reason(b) is None])
    yield pool
    pool.close()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_console_block(block: docs_check.Block, runner: docs_check.Runner) -> None:
    why = _skip_reason(block)
    if why:
        pytest.skip(why)
    result = runner.result(block)
    assert result.ok, (
        f"{block.id}: the output differs from the doc\n\n{result.report()}\n\n"
        "if the new output is right: python -m tests.docs_check --update, then review git diff"
    )


# --------------------------------------------------------------------------- the checker itself


def test_every_console_block_has_a_command() -> None:
    """A console block without a ``$ `` line would silently check nothing."""
    empty = [b.id for b in BLOCKS if not b.commands]
    assert not empty, f"console blocks without a `$ ` command: {empty}"


def test_docs_are_covered() -> None:
    files = {b.path.name for b in BLOCKS}
    assert {"README.md", "cli.md", "getting-started.md"} <= files
    assert "tp_demo.py" in docs_check.example_files()


def test_example_files_compile() -> None:
    for name, text in docs_check.example_files().items():
        compile(text, name, "exec")


@pytest.mark.parametrize(("expected", "actual", "ok"), [
    (["a", "b"], ["a", "b"], True),
    (["a", "b  "], ["a", "b"], True),                       # trailing whitespace
    (["a", "b", ""], ["a", "b"], True),                      # trailing blank lines
    (["a"], ["a", "b"], False),
    (["...", "c"], ["a", "b", "c"], True),
    (["a", "...", "c"], ["a", "c"], True),                   # ... matches no lines too
    (["a", "...", "c"], ["a", "b", "d"], False),
    (["..."], [], True),
    (["a ... c"], ["a b c"], False),                         # no elision inside a line
    (["16 of 21 parameters sharded; inputs 2x16; 2.8 s on the ranks"],
     ["16 of 21 parameters sharded; inputs 2x16; 14.1 s on the ranks"], True),
    (["peak memory per device: 26.65 GiB"], ["peak memory per device: 26.66 GiB"], False),
    (["│ output │ 8.34e-07 │ 1e-05 + 1e-05*max|ref| │"], ["│ output │ 5.96e-07 │ 1e-05 + 1e-05*max|ref| │"], True),
    (["│ output │ 8.34e-07 │ 1e-05 + 1e-05*max|ref| │"], ["│ output │ 8.34e-07 │ 1e-04 + 1e-05*max|ref| │"], False),
])
def test_matches(expected: list[str], actual: list[str], ok: bool) -> None:
    assert docs_check.matches(expected, actual) is ok


def test_updated_expected_keeps_elisions() -> None:
    expected = ["head", "...", "warnings (1):", "  old reason"]
    actual = ["head", "x", "y", "warnings (1):", "  new reason"]
    assert docs_check.updated_expected(expected, actual) == ["head", "...", "warnings (1):", "  new reason"]
    assert docs_check.updated_expected(["a", "b"], ["a", "c"]) == ["a", "c"]


def test_parse_commands_and_directives(tmp_path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- docs-check: slow, requires json -->\n"
        "```console\n"
        "$ echo one\n"
        "one\n"
        "$ python -c \"\n"
        "print(2)\n"
        "\"\n"
        "2\n"
        "```\n"
        "\n"
        "<!-- docs-check: skip (needs a GPU) -->\n"
        "```console\n"
        "$ nvidia-smi\n"
        "```\n"
        "```text\n"
        "not a transcript\n"
        "```\n"
    )
    first, second = docs_check.parse_file(doc)
    assert first.slow and first.requires == ("json",) and first.line == 2
    assert [c.text for c in first.commands] == ["echo one", 'python -c "\nprint(2)\n"']
    assert [c.expected for c in first.commands] == [["one"], ["2"]]
    assert second.skip == "needs a GPU"
    result = docs_check.run_block(first, examples={})
    assert result.ok, result.report()
