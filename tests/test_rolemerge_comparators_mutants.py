"""Hand-computed cases for the comparators' equations in rolemerge/comparators.py (NAMEx's Nash
bargaining weights first), written for the mutation pass (`python -m eval.tools.mutation --target
rolemerge/comparators.py --equations`; see eval/logs/mutation.md). Every expected number is worked
out in the comment above it."""
import math

import pytest
import torch

from rolemerge.comparators import nash_weights


def test_nash_weights_orthogonal_directions_closed_form():
    # M diagonal: (M a)_i = 1 / a_i gives a_i = 1 / sqrt(M_ii): diag(4, 1) -> [.5, 1], returned
    # without a Newton step (max_iter 0), in float64 also for a list input
    a = nash_weights([[4.0, 0.0], [0.0, 1.0]], ridge=0.0, max_iter=0)
    assert a.dtype == torch.float64 and a.tolist() == [0.5, 1.0]
    # the ridge is relative to the mean diagonal: diag(1, 3), ridge 1 -> diag(1 + 2, 3 + 2) -> [1/sqrt 3, 1/sqrt 5]
    a = nash_weights(torch.tensor([[1.0, 0.0], [0.0, 3.0]], dtype=torch.float64), ridge=1.0)
    assert a.tolist() == pytest.approx([1 / math.sqrt(3), 1 / math.sqrt(5)], abs=1e-12)


def test_nash_weights_correlated_directions():
    # M = [[2, 1], [1, 2]]: by symmetry a_1 = a_2 = a with 3 a = 1 / a, a = 1 / sqrt 3 (Newton from 1 / sqrt 2);
    # a list input is solved in float64 too
    a = nash_weights([[2.0, 1.0], [1.0, 2.0]], ridge=0.0)
    assert a.dtype == torch.float64
    assert a.tolist() == pytest.approx([1 / math.sqrt(3)] * 2, abs=1e-12)
    # an asymmetric Gram: the defining equation a_i (M a)_i = 1 holds to the solver's tolerance, a > 0
    M = torch.tensor([[1.0, 0.5, 0.2], [0.5, 2.0, -0.3], [0.2, -0.3, 0.5]], dtype=torch.float64)
    a = nash_weights(M, ridge=0.0)
    assert bool((a > 0).all()) and float((a * (M @ a) - 1).abs().max()) < 1e-12


def test_nash_weights_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"^a domain vector is zero \(an expert identical to its base\): its "
                                         r"bargaining utility is undefined$"):
        nash_weights([[1.0, 0.0], [0.0, 0.0]])
    # correlated directions and no Newton step: a = 1 / sqrt 2 each, a (M a) = 1.5, not converged
    with pytest.raises(ValueError, match=r"^Nash bargaining solve did not converge$"):
        nash_weights([[2.0, 1.0], [1.0, 2.0]], ridge=0.0, max_iter=0)
