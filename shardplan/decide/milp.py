"""MILP: the HiGHS backend of :mod:`.solve`, one instance per program.

Contract
--------
``MilpModel(rows, lo, hi, num_vars=..., integer=...)`` holds a program's constraint rows
(``lo <= A x <= hi``) and which columns are integer; nothing about ops or styles.
``model.view(upper)`` is one solve's columns: upper bounds of 1, or 0 where a forced style
excludes the column. ``view.minimize(c, extra)`` returns the optimal ``x`` (zero gap) under
those bounds and ``extra`` dense rows ``(vector, upper bound)``, or None when none exists.
The HiGHS instance is made once per model (costs, bounds and the extra rows change per
solve) and starts each solve from no basis, so no result depends on the solves before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["MilpModel", "MilpView"]

# feasibility jump (a primal heuristic) took half of each solve on these small programs and
# found nothing the root LP missed; one thread keeps a solve deterministic
_OPTIONS = (("output_flag", False), ("mip_rel_gap", 0.0), ("presolve", "on"), ("threads", 1),
            ("mip_heuristic_run_feasibility_jump", False))


@dataclass
class MilpModel:
    """The constraint matrix column by column (HiGHS's colwise format: column ``j``'s rows are
    ``index[start[j]:start[j + 1]]``), built with numpy alone: scipy's import would cost a
    quarter of a second of every command."""
    start: np.ndarray
    index: np.ndarray
    value: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    num_vars: int
    integer: frozenset[int]
    _solver: Any = field(default=None, repr=False)

    @classmethod
    def from_rows(cls, rows: list[dict[int, float]], lo: list[float], hi: list[float], *, num_vars: int,
                  integer: frozenset[int]) -> "MilpModel":
        r_idx = np.array([r for r, row in enumerate(rows) for _ in row], dtype=np.int32)
        c_idx = np.array([col for row in rows for col in row], dtype=np.int32)
        vals = np.array([v for row in rows for v in row.values()], dtype=np.float64)
        order = np.lexsort((r_idx, c_idx))  # by column, then row: each (row, column) once
        start = np.searchsorted(c_idx[order], np.arange(num_vars + 1)).astype(np.int32)
        return cls(start, r_idx[order], vals[order], np.array(lo, dtype=np.float64), np.array(hi, dtype=np.float64),
                   num_vars, integer)

    @property
    def num_rows(self) -> int:
        return len(self.lo)

    def view(self, upper: np.ndarray) -> "MilpView":
        return MilpView(self, upper)

    def solver(self) -> Any:
        """highspy's own ``Highs`` class prints a banner to the process's stdout when made (a
        plan printed as JSON would not parse); its ``_Highs`` base is the same solver
        without that logging callback."""
        if self._solver is None:
            from highspy import HighsLp, HighsVarType, MatrixFormat, _Highs

            n = self.num_vars
            lp = HighsLp()
            lp.num_col_, lp.num_row_ = n, self.num_rows
            lp.col_cost_, lp.col_lower_, lp.col_upper_ = np.zeros(n), np.zeros(n), np.ones(n)
            lp.row_lower_, lp.row_upper_ = self.lo, self.hi
            lp.a_matrix_.format_ = MatrixFormat.kColwise
            lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = self.start, self.index, self.value
            lp.integrality_ = [HighsVarType.kInteger if i in self.integer else HighsVarType.kContinuous for i in range(n)]
            self._solver = _Highs()
            for key, value in _OPTIONS:
                self._solver.setOptionValue(key, value)
            self._solver.passModel(lp)
        return self._solver


@dataclass
class MilpView:
    """One solve's columns: the model's, bounded above by ``upper``."""
    model: MilpModel
    upper: np.ndarray

    def scaled(self, v: np.ndarray) -> np.ndarray:
        """``v`` scaled so its largest allowed entry is 1e3 (HiGHS's tolerances are absolute)."""
        top = float(np.max(np.abs(v[self.upper > 0]))) if v.size else 0.0
        return v / top * 1e3 if top > 0 else v

    def minimize(self, c: np.ndarray, extra: tuple[tuple[np.ndarray, float], ...] = ()) -> np.ndarray | None:
        from highspy import HighsModelStatus

        h, n = self.model.solver(), self.model.num_vars
        columns = np.arange(n, dtype=np.int32)
        h.clearSolver()
        h.changeColsBounds(n, columns, np.zeros(n), self.upper)
        h.changeColsCost(n, columns, c)
        for v, bound in extra:
            nonzero = np.flatnonzero(v).astype(np.int32)
            h.addRow(0.0, bound, len(nonzero), nonzero, v[nonzero])
        try:
            h.run()
            optimal = h.getModelStatus() == HighsModelStatus.kOptimal
            return np.array(h.getSolution().col_value) if optimal else None
        finally:
            if extra:
                first = self.model.num_rows
                h.deleteRows(len(extra), np.arange(first, first + len(extra), dtype=np.int32))
