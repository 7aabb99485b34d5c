"""The package's stages import one way: each layer only from layers below it, no cycles.

Every import counts, including the ones inside functions (a lazy import is still a
dependency). Layers, lowest first: the built-in models; analyze; plan (the data model, its
files, and validation against a model); decide; apply; api; interop; tools; cli on top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "shardplan"
LAYERS = {"models": 0, "analyze": 1, "plan": 2, "decide": 3, "apply": 4, "api": 5, "interop": 6, "tools": 7,
          "cli": 8, "__main__": 9, "__init__": 9}
TP_STYLE_MODULES = {"shardplan.apply.emit", "shardplan.apply.styles", "shardplan.apply.head_styles",
                    "shardplan.apply.attention_style", "shardplan.apply.experts_ep", "shardplan.apply.packed_colwise",
                    "shardplan.apply.dtensor_style", "shardplan.apply.listed_style", "shardplan.apply.token_style"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute shardplan modules that ``path`` imports, anywhere in the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("shardplan")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("shardplan"):
                continue
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names if (PACKAGE.parent / f"{mod}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                      or (PACKAGE.parent / f"{mod}.{a.name}".replace(".", "/")).is_dir()}
    return found - {name}


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for path in PACKAGE.rglob("*.py"):
        src = _module_name(path)
        g.add_node(src)
        for dst in _imports(path):
            g.add_edge(src, dst)
    return g


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS["__init__"] if len(parts) == 1 else LAYERS[parts[1]]


def _stage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_every_module_belongs_to_a_layer():
    assert all(len(m.split(".")) == 1 or m.split(".")[1] in LAYERS for m in _graph().nodes)


def test_imports_run_downward():
    upward = [f"{a} -> {b}" for a, b in _graph().edges
              if _stage(a) != _stage(b) and _layer(b) >= _layer(a) and b != "shardplan"]
    assert upward == []


def test_no_import_cycles():
    g = _graph()
    g.remove_nodes_from([n for n in list(g) if n == "shardplan"])  # the package root only re-exports
    assert list(nx.simple_cycles(g)) == []


def test_only_the_emitter_imports_torch_tp_styles():
    users = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed.tensor.parallel"):
                if {a.name for a in node.names} - {"loss_parallel"}:  # a context manager, not a style
                    users.add(_module_name(path))
    assert users and users <= TP_STYLE_MODULES, users - TP_STYLE_MODULES


def test_every_stage_states_its_contract():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) > 20, f"{init} needs a docstring stating what lives there and its contract"


def test_no_unused_imports_or_undefined_names():
    from pyflakes.api import checkPath
    from pyflakes.reporter import Reporter
    import io

    out = io.StringIO()
    problems = sum(checkPath(str(path), Reporter(out, out)) for path in sorted(PACKAGE.rglob("*.py")))
    assert problems == 0, out.getvalue()
