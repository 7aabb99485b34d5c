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

Before HiGHS sees it, the program is made smaller once, by reductions that hold for every
``upper`` a view can give (bounds only ever fall from 1 to 0): a row ``x_a - x_b = 0``
makes ``a`` and ``b`` one column (its cost and extra-row weights the sum, its bound the
smaller), and a row ``= 0`` whose columns all carry one sign holds only at zero. A
placement program is mostly such rows (a value's producer and consumers agree), so a
solve sees a fifth of the columns or fewer (qwen3_next: 140 of 3,104), and HiGHS's
presolve, most of each solve, has little left to do.
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
    _reduced: "_Reduced | None" = field(default=None, repr=False)

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

    def rows(self) -> list[dict[int, float]]:
        rows: list[dict[int, float]] = [{} for _ in range(self.num_rows)]
        for j in range(self.num_vars):
            for k in range(self.start[j], self.start[j + 1]):
                rows[self.index[k]][j] = float(self.value[k])
        return rows

    def reduced(self) -> "_Reduced":
        if self._reduced is None:
            self._reduced = _reduce(self)
        return self._reduced

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
        r = self.model.reduced()
        if r.infeasible:
            return None
        x = r.model.view(r.lift_upper(self.upper))._run(r.lift(c), tuple((r.lift(v), b) for v, b in extra))
        return None if x is None else r.expand(x)

    def _run(self, c: np.ndarray, extra: tuple[tuple[np.ndarray, float], ...]) -> np.ndarray | None:
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


@dataclass
class _Reduced:
    """A model's reduced program: ``group[j]`` is column ``j``'s column in ``model``, or -1
    where every solution has ``x_j = 0``; ``infeasible`` when no bounds admit a solution."""
    group: np.ndarray
    model: MilpModel
    infeasible: bool

    def lift(self, v: np.ndarray) -> np.ndarray:
        """A per-column vector summed per reduced column (in column order: no BLAS)."""
        keep = self.group >= 0
        return np.bincount(self.group[keep], weights=v[keep], minlength=self.model.num_vars)

    def lift_upper(self, upper: np.ndarray) -> np.ndarray:
        out = np.ones(self.model.num_vars)
        keep = self.group >= 0
        np.minimum.at(out, self.group[keep], upper[keep])
        return out

    def expand(self, x: np.ndarray) -> np.ndarray:
        return np.where(self.group >= 0, x[np.maximum(self.group, 0)], 0.0)


def _reduce(model: MilpModel) -> _Reduced:
    rows, n = model.rows(), model.num_vars
    parent, zero = list(range(n)), set()

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    changed = True
    while changed:  # merging can make another row a pair, or one sign
        changed = False
        for r, row in enumerate(rows):
            if model.lo[r] != 0.0 or model.hi[r] != 0.0:
                continue
            terms = _grouped(row, find, zero)
            if terms and (all(v > 0 for v in terms.values()) or all(v < 0 for v in terms.values())):
                zero.update(terms)
                changed = True
            elif len(terms) == 2 and sorted(terms.values()) == [-1.0, 1.0]:
                a, b = terms
                parent[a] = b
                changed = True
    return _rebuild(model, rows, [find(j) for j in range(n)], zero)


def _grouped(row: dict[int, float], find, zero: set[int]) -> dict[int, float]:
    """``row``'s terms by merged column, without columns fixed at zero or terms that cancel."""
    terms: dict[int, float] = {}
    for j, v in row.items():
        g = find(j)
        if g not in zero:
            terms[g] = terms.get(g, 0.0) + v
    return {g: v for g, v in terms.items() if v != 0.0}


def _rebuild(model: MilpModel, rows: list[dict[int, float]], root: list[int], zero: set[int]) -> _Reduced:
    ids: dict[int, int] = {}
    group = np.array([-1 if g in zero else ids.setdefault(g, len(ids)) for g in root], dtype=np.int64)
    new_rows, lo, hi, seen, infeasible = [], [], [], set(), False
    for r, row in enumerate(rows):
        terms = {ids[g]: v for g, v in _grouped(row, root.__getitem__, zero).items()}
        if not terms:
            infeasible |= not (model.lo[r] <= 0.0 <= model.hi[r])
            continue
        key = (tuple(sorted(terms.items())), float(model.lo[r]), float(model.hi[r]))
        if key not in seen:
            seen.add(key)
            new_rows.append(terms)
            lo.append(model.lo[r])
            hi.append(model.hi[r])
    integer = frozenset(int(group[j]) for j in model.integer if group[j] >= 0)  # a merged column is integer if any is
    small = MilpModel.from_rows(new_rows, lo, hi, num_vars=len(ids), integer=integer)
    return _Reduced(group, small, infeasible)
