import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# A newcomer's first check (`python -m pytest -q -m quick`, about a minute on 2 cores): the
# cost model, the solver, the plan files, the CLI, explanations, propagation and the checked-in
# plans; no gloo ranks. The README's command runs everything.
QUICK_FILES = {"test_cost.py", "test_milp.py", "test_layers.py", "test_planfile.py", "test_cli.py", "test_explain.py",
               "test_propagation.py", "test_golden_plans.py"}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.path.name in QUICK_FILES:
            item.add_marker(pytest.mark.quick)
