"""Hand-checked cases for the neuron assignment and the Nash solve of rolemerge/comparators.py, written
for the mutation pass (`python -m eval.tools.mutation --target rolemerge/comparators.py`; see
eval/logs/mutation.md): `_assign`'s scipy branch (run here with a stand-in `scipy.optimize`, since scipy
is optional and not installed with the project), `linear_assignment` on an empty cost, and damped Nash
steps whose trial point ties f(a) exactly in float64 (an asymmetric 2 x 2 M and a 5 x 5 Gram)."""
import math
import sys
import types

import numpy as np
import pytest
import torch

from rolemerge import comparators as cp

# scipy's own example: the 6 matchings of rows 0, 1, 2 to columns cost
# (0,1,2) 4+0+2 = 6, (0,2,1) 4+5+2 = 11, (1,0,2) 1+2+2 = 5, (1,2,0) 1+5+3 = 9, (2,0,1) 3+2+2 = 7, (2,1,0) 3+0+3 = 6:
# the unique optimum maps row i to column [1, 0, 2][i] (cost 5)
_COST = [[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]]


def _fake_scipy(monkeypatch, int_dtype):
    """Put a stand-in `scipy.optimize` into sys.modules whose linear_sum_assignment records what it gets and
    returns the optimum of _COST as (rows, cols) numpy arrays of `int_dtype`."""
    calls = []

    def linear_sum_assignment(cost):
        calls.append(cost)
        return np.arange(3, dtype=int_dtype), np.array([1, 0, 2], dtype=int_dtype)

    optimize = types.ModuleType("scipy.optimize")
    optimize.linear_sum_assignment = linear_sum_assignment
    scipy = types.ModuleType("scipy")
    scipy.optimize = optimize
    monkeypatch.setitem(sys.modules, "scipy", scipy)
    monkeypatch.setitem(sys.modules, "scipy.optimize", optimize)
    return calls


# scipy returns np.intp indices: int64 on 64-bit platforms, int32 on 32-bit ones
@pytest.mark.parametrize("int_dtype", [np.int32, np.int64])
def test_assign_returns_scipys_columns_as_long(monkeypatch, int_dtype):
    calls = _fake_scipy(monkeypatch, int_dtype)
    ours = []
    monkeypatch.setattr(cp, "linear_assignment", lambda cost: ours.append(cost) or torch.zeros(3, dtype=torch.long))
    col = cp._assign(torch.tensor(_COST, dtype=torch.float32))
    # scipy's column indices (its second array), as a long tensor whatever integer width scipy used
    assert col.dtype == torch.long and col.tolist() == [1, 0, 2]
    assert ours == []                                                  # the fallback is not run
    # scipy gets the cost's values once, as a float64 numpy array on the CPU
    assert len(calls) == 1
    assert isinstance(calls[0], np.ndarray) and calls[0].dtype == np.float64
    assert calls[0].tolist() == _COST


def test_assign_falls_back_to_linear_assignment_without_scipy(monkeypatch):
    # a None entry in sys.modules makes `from scipy.optimize import ...` raise ImportError (scipy installed or not)
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    seen = []
    solve = cp.linear_assignment
    monkeypatch.setattr(cp, "linear_assignment", lambda cost: seen.append(cost) or solve(cost))
    cost = torch.tensor(_COST, dtype=torch.float64)
    col = cp._assign(cost)
    assert col.dtype == torch.long and col.tolist() == [1, 0, 2]
    assert len(seen) == 1 and seen[0] is cost


def test_linear_assignment_of_an_empty_cost_is_an_empty_matching():
    # n = 0: no row to match, an empty long tensor (scipy returns empty arrays too). Row passes start at row 1:
    # 0 is the "no row" marker of p. (A pass for row 0 too would read row -1 of C here, which does not exist;
    # for n >= 1 such a pass writes only u[0] and v[0], which nothing reads, so it changes no matching.)
    col = cp.linear_assignment(torch.zeros(0, 0))
    assert col.dtype == torch.long and col.tolist() == []


def test_nash_weights_accepts_a_damped_step_that_ties_f_exactly(monkeypatch):
    # M = [[1, 0], [q, 16]] (asymmetric, as the other step-halving cases; f sees its symmetric part), ridge 0.
    # a_0 = [1, 1/4], M a_0 = [1, q + 4], gradient M a_0 - 1/a_0 = [0, q], Newton matrix [[2, 0], [q, 32]],
    # step [0, q/32], Newton decrement^2 q^2/32 = 5.93 >= 1/16: the damped phase. The full step leaves the orthant
    # (q/32 > 1/4); t = 1/2 gives a_2 = 1/4 - q/64 = (1 - x)/4 with x = q/16. f(a) = (a_1^2 + q a_1 a_2 +
    # 16 a_2^2)/2 - log a_1 - log a_2: f(a_0) = 1 + 2x + log 4 and f(trial) = 1 + x - 3x^2/2 + log 4 - log(1 - x),
    # equal where -x - 3x^2/2 = log(1 - x): x = .86092, q = 13.7747. Bisecting q and scanning the floats next to
    # the root: at q = 13.774670756165474 both f values round to the same float64 (4.108128205640575), a tie.
    # "f rose" is a strict test, so t = 1/2 is taken: the second Newton matrix is M + diag(1 / a_1^2) with
    # a_1 = [1, 1/4 - q/64] (a_2 = .0347708; t = 1/4 would give .1423854), and 6 full steps follow: 7 solves.
    # Solution: a_1^2 = 1 and a_2 (q + 16 a_2) = 1, so a = [1, (sqrt(q^2 + 64) - q)/32] = [1, .0673311].
    # (Halving at the tie instead goes to a_2 = .1423854, and two steps on it stalls: on an asymmetric M, M a - 1/a
    # is not f's gradient, and there every trial point raises f.)
    q = 13.774670756165474
    M = torch.tensor([[1.0, 0.0], [q, 16.0]], dtype=torch.float64)
    # the tie this case rests on, computed as nash_weights computes f and the step
    f = lambda a: 0.5 * float(a @ M @ a) - float(a.log().sum())
    a0 = torch.tensor([1.0, 0.25], dtype=torch.float64)
    step = torch.linalg.solve(M + torch.diag(1.0 / a0 ** 2), M @ a0 - 1.0 / a0)
    assert f(a0 - 0.5 * step) == f(a0) == 4.108128205640575
    mats = []
    solve = torch.linalg.solve
    monkeypatch.setattr(torch.linalg, "solve", lambda A, b: mats.append(A.clone()) or solve(A, b))
    a = cp.nash_weights(M, ridge=0.0)
    assert len(mats) == 7
    assert float(mats[1][1, 1]) == pytest.approx(16 + 1 / (0.25 - q / 64) ** 2, rel=1e-12)
    assert a.tolist() == pytest.approx([1.0, (math.sqrt(q * q + 64) - q) / 32], rel=1e-12)


# the upper triangle of a positive definite 5 x 5 Gram (eigenvalues .265 to 18.1): M = (1 - s) diag(G) + s G for
# G = T^T T, T a random 6 x 5 matrix, and s = .9959757921234775 found by bisecting s where the first damped
# step's f(a_0 - step) - f(a_0) changes sign, then scanning the floats next to the root for an exact 0
_TIE_GRAM = [[5.999680567030966, 2.90561498445202, 0.9623672644789273, -0.7641639731519587, -3.7338709159091983],
             [9.348381185073505, 2.9551164617382053, -2.9261990936674236, -0.3167298186086846],
             [3.4913094167773315, 3.2988214653774928, 3.364852209325538],
             [9.894158010270246, 5.724280429831928],
             [9.235444989795266]]


def test_nash_weights_takes_a_full_step_that_ties_f_on_a_gram(monkeypatch):
    # The same tie on a Gram, the input NAMEx passes (symmetric, so M a - 1/a is f's gradient). It needs more than
    # 2 players: for 2, scaled to unit diagonal, the iterates stay on a_1 = a_2, where a Newton step maps s to
    # s' = 2 s / (u + 1), u = (1 + M_12) s^2, and f(s') - f(s) = 4u / (u + 1)^2 - u + 2 log((u + 1) / 2) <= 0
    # (0 only at u = 1, the optimum). Here, from a_0 = 1/sqrt(diag M), the first step
    # is feasible, Newton decrement^2 1.83 >= 1/16 (damped), and f(a_0 - step) = f(a_0) = 9.325140192315263 in
    # float64 (computed below as nash_weights computes them; float64 script). f did not rise, so the full step
    # is taken: the second Newton matrix is M + diag(1 / (a_0 - step)^2), and 7 more steps reach the 1e-12
    # tolerance: 8 solves. (Halving at the tie would take 5 solves in all.)
    M = torch.zeros(5, 5, dtype=torch.float64)
    for i, row in enumerate(_TIE_GRAM):
        for j, m in enumerate(row, start=i):
            M[i, j] = M[j, i] = m
    f = lambda a: 0.5 * float(a @ M @ a) - float(a.log().sum())
    a0 = 1.0 / M.diagonal().sqrt()
    grad = M @ a0 - 1.0 / a0
    step = torch.linalg.solve(M + torch.diag(1.0 / a0 ** 2), grad)
    assert float(grad @ step) >= 1 / 16 and bool((a0 - step > 0).all())
    assert f(a0) == pytest.approx(9.325140192315263, rel=1e-14)
    if f(a0 - step) != f(a0):
        # the tie is one of float64 rounding: it holds with MKL's AVX-512 kernels (where s was found); with its
        # AVX2 or SSE kernels the same sums round one unit apart. The 2 x 2 case above ties on every kernel set.
        pytest.skip(f"no exact tie on this BLAS kernel set: f(a_0 - step) - f(a_0) = {f(a0 - step) - f(a0):.3g}")
    assert f(a0 - step) == f(a0) == 9.325140192315263
    mats = []
    solve = torch.linalg.solve
    monkeypatch.setattr(torch.linalg, "solve", lambda A, b: mats.append(A.clone()) or solve(A, b))
    a = cp.nash_weights(M, ridge=0.0)
    assert len(mats) == 8
    torch.testing.assert_close(mats[1].diagonal(), M.diagonal() + 1.0 / (a0 - step) ** 2, rtol=1e-12, atol=0)
    assert float((a * (M @ a) - 1.0).abs().max()) < 1e-12
