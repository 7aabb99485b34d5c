"""Model code no one on the project wrote: torchtitan 0.3.0's llama3, qwen3 and deepseek_v3
and torchtune 0.6.1's llama3, qwen2 and gemma (tiny configs, nothing downloaded), through
``benchmarks/ecosystem.py``.

* At tp=2 and tp=4 each plan is compared weight by weight with the library's own TP plan.
  Where they differ, both plans are priced by the same cost model (the library's pinned with
  ``price_styles``): shardplan's must be no slower with no more parameter bytes per device,
  or, given the library plan's peak memory as its budget, no slower than the library's.
* ``auto_parallelize``'s plan on 2 gloo ranks matches one process: outputs, every gradient
  and the weights after an optimizer step (``shardplan verify``).

Installed by the README's test command (``pip install --no-deps -r
tests/ecosystem-requirements.txt``); skipped, with the reason, where a library is missing.
"""

from __future__ import annotations

import pytest

from benchmarks import ecosystem as eco


def _spec(name: str) -> eco.Spec:
    spec = eco.SPECS[name]
    why = eco.library_missing(spec.library)
    if why:
        pytest.skip(why)
    return spec


@pytest.mark.parametrize("name", list(eco.SPECS))
def test_a_library_model_is_planned_as_its_authors_plan_it_or_cheaper(name: str) -> None:
    rows, unused = eco.measure(_spec(name), runs=1)
    for row in rows:
        assert not row.error, f"{name} tp={row.tp}: {row.error}"
        assert row.differ == 0 or row.justified, (
            f"{name} tp={row.tp}: shardplan {row.ours} vs library {row.lib} (at its memory {row.at_lib_memory}); "
            f"{row.lib_error}; differences {row.diffs}")


@pytest.mark.parametrize("name", list(eco.SPECS))
def test_a_library_model_matches_one_process_on_gloo(name: str) -> None:
    verdict = eco.numerics(_spec(name))
    assert verdict.startswith("PASS"), verdict
