"""Hand-computed cases for the comparators in rolemerge/comparators.py (NAMEx's Nash bargaining
weights first), written for the mutation pass (`python -m eval.tools.mutation --target
rolemerge/comparators.py`, `--equations` for the equations alone; see eval/logs/mutation.md). Every
expected number is worked out in the comment above it; where a case instead compares `merge_layer`
with the functions it calls, or pins what a seed draws, the comment says so."""
import math

import pytest
import torch

from helpers import tiny_qwen3_moe
from rolemerge import baselines, blocks, comparators
from rolemerge.comparators import (NEEDS, ComparatorRecorder, _unit_rows, collect, expert_hidden, frequency_weights,
                                   hartigan, kmeans, kmeans_plusplus, linear_assignment, lloyd, merge_layer,
                                   mergemoe_down, namex_merge, nash_weights, ream_distance, ream_groups, ream_saliency,
                                   ream_weight_features, submoe_groups, submoe_similarity, svd_merge)


def test_nash_weights_orthogonal_directions_closed_form():
    # M diagonal: (M a)_i = 1 / a_i gives a_i = 1 / sqrt(M_ii): diag(4, 1) -> [.5, 1], returned
    # without a Newton step (max_iter 0), in float64 also for a list input
    a = nash_weights([[4.0, 0.0], [0.0, 1.0]], ridge=0.0, max_iter=0)
    assert a.dtype == torch.float64 and a.tolist() == [0.5, 1.0]
    # the ridge is relative to the mean diagonal: diag(1, 3), ridge 1 -> diag(1 + 2, 3 + 2) -> [1/sqrt 3, 1/sqrt 5]
    a = nash_weights(torch.tensor([[1.0, 0.0], [0.0, 3.0]], dtype=torch.float64), ridge=1.0)
    assert a.tolist() == pytest.approx([1 / math.sqrt(3), 1 / math.sqrt(5)], abs=1e-12)
    # ridge .1: diag(1.2, 3.2), in float64 (.2 in float32 would move a by 1e-9)
    a = nash_weights(torch.tensor([[1.0, 0.0], [0.0, 3.0]], dtype=torch.float64), ridge=0.1)
    assert a.tolist() == pytest.approx([1 / math.sqrt(1.2), 1 / math.sqrt(3.2)], rel=1e-14)


def test_nash_weights_correlated_directions():
    # M = [[2, 1], [1, 2]]: by symmetry a_1 = a_2 = a with 3 a = 1 / a, a = 1 / sqrt 3 (Newton from 1 / sqrt 2);
    # a list input is solved in float64 too
    a = nash_weights([[2.0, 1.0], [1.0, 2.0]], ridge=0.0)
    assert a.dtype == torch.float64
    assert a.tolist() == pytest.approx([1 / math.sqrt(3)] * 2, abs=1e-12)
    # nearly parallel directions, M = [[1, .99], [.99, 1]]: a = 1 / sqrt 1.99 each (the solve halves steps near
    # the optimum, where round-off makes the objective flat)
    a = nash_weights([[1.0, 0.99], [0.99, 1.0]], ridge=0.0)
    assert a.tolist() == pytest.approx([1 / math.sqrt(1.99)] * 2, abs=1e-12)
    # directions of very different lengths, M = [[1, 10], [10, 101]] (tau_1 = [1, 0], tau_2 = [10, 1]):
    # a (M a) = 1, a > 0
    M = torch.tensor([[1.0, 10.0], [10.0, 101.0]], dtype=torch.float64)
    a = nash_weights(M, ridge=0.0)
    assert bool((a > 0).all()) and float((a * (M @ a) - 1).abs().max()) < 1e-12
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


def test_ream_saliency_hand_computed():
    # sums [2, 0, 3, 1] over counts [4, 0, 2, .5]: [.5, 0 (never routed), 1.5, 2.0]; the zero becomes
    # min(.5, smallest positive .5) = .5; float64 from lists
    s = ream_saliency([2.0, 0.0, 3.0, 1.0], [4.0, 0.0, 2.0, 0.5])
    assert s.dtype == torch.float64 and s.tolist() == [0.5, 0.5, 1.5, 2.0]
    # smallest positive 2 > .5: zeros become .5; a sum without a routed token counts as 0
    assert ream_saliency([2.0, 0.0, 3.0], [1.0, 0.0, 1.0]).tolist() == [2.0, 0.5, 3.0]
    assert ream_saliency([1.0, 2.0], [0.0, 1.0]).tolist() == [0.5, 2.0]
    # nothing routed: all 1 (uniform)
    assert ream_saliency([0.0, 0.0], [0.0, 0.0]).tolist() == [1.0, 1.0]


def test_ream_distance_hand_computed():
    # outputs [.5, 0], [0, .5], [.5, .5] (norms below 1): cos_out (0,1) 0, (0,2) = (1,2) = 1/sqrt 2.
    # logit Gram with norms [.5, .25, .5] and cos_z (0,2) .5, others 0; zn = 1 (to 2e-8), so
    # dz = sqrt(2 - 2 cos_z): (0,1) sqrt 2, (0,2) 1, (1,2) sqrt 2; s_gate = 1 - dz / sqrt 2: 0, 1 - 1/sqrt 2, 0.
    # d = 1 - ((1 + cos_out) / 2 + s_gate) / 2:
    #   (0,1) 1 - (.5 + 0) / 2 = .75; (0,2) 1 - ((1 + r) / 2 + 1 - r) / 2 = .25 + r / 4 (r = 1/sqrt 2);
    #   (1,2) 1 - (1 + r) / 4 = .75 - r / 4
    r = 1 / math.sqrt(2)
    o = [[0.5, 0.0], [0.0, 0.5], [0.5, 0.5]]
    G = [[0.25, 0.0, 0.125], [0.0, 0.0625, 0.0], [0.125, 0.0, 0.25]]
    d = ream_distance(o, G)
    assert d.dtype == torch.float64
    want = [[0.0, 0.75, 0.25 + r / 4], [0.75, 0.0, 0.75 - r / 4], [0.25 + r / 4, 0.75 - r / 4, 0.0]]
    assert torch.allclose(d, torch.tensor(want, dtype=torch.float64), atol=1e-7, rtol=0)


def test_ream_distance_tiny_router_norms_hand_computed():
    # logit Gram diag(1, 4, 9) e-16: norms gn = [1, 2, 3] e-8, so the 1e-8 of normalize_rows matters:
    # zn = gn / (gn + 1e-8) = [1/2, 2/3, 3/4], cos_z = 0 off the diagonal, dz_ij = sqrt(zn_i^2 + zn_j^2):
    # (0,1) 5/6, (0,2) sqrt 13 / 4, (1,2) sqrt 145 / 12 (the max). Orthogonal outputs: cos_out = 0, so
    # d = .75 - s_gate / 2 = .25 + dz / (2 max): (0,1) .25 + 5 / sqrt 145, (0,2) .25 + 1.5 sqrt(13 / 145), (1,2) .75
    G = [[1e-16, 0.0, 0.0], [0.0, 4e-16, 0.0], [0.0, 0.0, 9e-16]]
    d = ream_distance(torch.eye(3).tolist(), G)
    assert d[0, 1].item() == pytest.approx(0.25 + 5 / math.sqrt(145), abs=1e-9)
    assert d[0, 2].item() == pytest.approx(0.25 + 1.5 * math.sqrt(13 / 145), abs=1e-9)
    assert d[1, 2].item() == pytest.approx(0.75, abs=1e-9)
    # two experts, diag(1, 4) e-16: dz (0,1) = sqrt(1/4 + 4/9) = 5/6 is the max (below 1): s_gate 0, d = .75
    d = ream_distance(torch.eye(2).tolist(), [[1e-16, 0.0], [0.0, 4e-16]])
    assert d[0, 1].item() == pytest.approx(0.75, abs=1e-9)
    # a zero Gram: every dz is 0, s_gate = 1 (no 0 / 0): d = 1 - (.5 + 1) / 2 = .25
    d = ream_distance(torch.eye(2).tolist(), [[0.0, 0.0], [0.0, 0.0]])
    assert d.tolist() == [[0.0, 0.25], [0.25, 0.0]]


def test_namex_merge_hand_computed():
    # one member: the base itself, in the input's dtype
    th = torch.tensor([[1.0, 2.0]])
    merged, c = namex_merge(th, 0, [1.0])
    assert merged.dtype == torch.float32 and merged.tolist() == [1.0, 2.0] and c.tolist() == [1.0]
    # tau = [1, 0], freq of the other 1: eps = 1, alpha = 1 / sqrt(1 + 1e-9), merged = base + tau = [1, 0],
    # c = [0, 1]
    merged, c = namex_merge(torch.tensor([[0.0, 0.0], [1.0, 0.0]]), 0, [0.0, 1.0])
    assert merged.tolist() == pytest.approx([1.0, 0.0]) and c.tolist() == pytest.approx([0.0, 1.0])
    # the other members never routed (eps = 0): the base, even when a member equals it (no Nash solve)
    merged, c = namex_merge(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), 0, [1.0, 0.0])
    assert merged.dtype == torch.float32 and merged.tolist() == [1.0, 0.0] and c.tolist() == [1.0, 0.0]
    # ridge reaches the Nash solve: taus [1, 0], [0, 2], Gram diag(1, 4), ridge 1 (x mean diag 2.5):
    # alpha = [1/sqrt 3.5, 1/sqrt 6.5], Delta = [alpha_1, 2 alpha_2], eps = |.5 tau_1 + .5 tau_2| = sqrt 1.25
    th = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    merged, _ = namex_merge(th, 0, [0.0, 0.5, 0.5], ridge=1.0)
    delta = torch.tensor([1 / math.sqrt(3.5), 2 / math.sqrt(6.5)], dtype=torch.float64)
    assert torch.allclose(merged, math.sqrt(1.25) * delta / delta.norm(), atol=1e-12)


def test_submoe_similarity_hand_computed():
    # cosine sums over 4 tokens: [[4, 2], [2, 4]] / 4 -> [[1, .5], [.5, 1]]; float64 from lists
    S = submoe_similarity([[4.0, 2.0], [2.0, 4.0]], 4)
    assert S.dtype == torch.float64 and S.tolist() == [[1.0, 0.5], [0.5, 1.0]]
    # no token: divided by 1, not 0 (diagonal 1 by definition)
    assert submoe_similarity([[0.0, 0.3], [0.3, 0.0]], 0).tolist() == [[1.0, 0.3], [0.3, 1.0]]


def test_svd_merge_full_rank_is_the_weighted_sum():
    # two 1x2 matrices [1, 2] and [3, 4], weights [1, 3] -> w = [.25, .75]: [2.5, 3.5] exactly, in the
    # input's dtype, whether rank is None or the full rank min(r, n c) = 1
    mats = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    for rank in (None, 1):
        out = svd_merge(mats, [1.0, 3.0], rank=rank)
        assert out.dtype == torch.float32 and out.tolist() == [[2.5, 3.5]]
    # a truncated merge keeps the dtype too: 2x1 matrices [[1], [0]] and [[0], [1]], rank 1 of 2
    mats = torch.tensor([[[1.0], [0.0]], [[0.0], [1.0]]])
    assert svd_merge(mats, [1.0, 1.0], rank=1).dtype == torch.float32


def test_frequency_weights_fractional_and_zero_counts():
    # counts [.2, .6] (total below 1): [.25, .75]; no member routed: uniform 1/3
    assert frequency_weights([0.2, 0.6], [0, 1]) == pytest.approx([0.25, 0.75])
    assert frequency_weights([0.0, 0.0, 0.0], [0, 1, 2]) == [1 / 3, 1 / 3, 1 / 3]


def test_svd_merge_at_full_rank_takes_the_exact_sum():
    # rank = min(r, n c) keeps every triplet: the merge is sum_i w_i W_i exactly (no SVD round-off)
    g = torch.Generator().manual_seed(0)
    mats = torch.randn(3, 4, 2, generator=g, dtype=torch.float64)
    w = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    assert torch.equal(svd_merge(mats, w, rank=4), torch.einsum("n,nrc->rc", w, mats))


def test_inputs_are_read_in_float64():
    # values that float32 cannot hold (.1, .4): every result equals its float64 closed form
    a = nash_weights([[0.1, 0.0], [0.0, 0.4]], ridge=0.0)
    assert a.tolist() == pytest.approx([1 / math.sqrt(0.1), 1 / math.sqrt(0.4)], rel=1e-14)
    assert ream_saliency([0.1], [1.0]).tolist() == [0.1]
    assert ream_saliency([1.0], [0.1]).tolist() == [1.0 / 0.1]
    # a zero Gram (s_gate = 1) and outputs [.1, .2], [.3, .1]: cos = .05 / sqrt(.05 * .1) = 1/sqrt 2,
    # d = 1 - ((1 + cos) / 2 + 1) / 2 = .25 - cos / 4
    d = ream_distance([[0.1, 0.2], [0.3, 0.1]], [[0.0, 0.0], [0.0, 0.0]])
    assert d[0, 1].item() == pytest.approx(0.25 - 1 / (4 * math.sqrt(2)), rel=1e-14)


def test_mergemoe_down_default_ridge_hand_computed():
    # tests/test_rolemerge_comparators.py's case (H = I = 1, identity activation, w = [.5, .5], x = [1, 2]):
    # h' = 4 x^2 = [4, 16], target 7 x^2 = [7, 28]: P = 272, Q = 476, average down .5 (1 + 2) = 1.5.
    # Default ridge 1e-3: lam = 1e-3 * 272 / 1 = .272, d' = (476 + .272 * 1.5) / (272 + .272) = 1.74975025
    gate, up = torch.tensor([[[1.0]], [[3.0]]]), torch.tensor([[[2.0]], [[2.0]]])
    down, x = torch.tensor([[[1.0]], [[2.0]]]), torch.tensor([[1.0], [2.0]])
    _, _, d2 = mergemoe_down(gate, up, down, [0.5, 0.5], x, lambda t: t)
    assert float(d2) == pytest.approx((476 + 0.272 * 1.5) / (272 + 0.272), rel=1e-6)


# M = 4 [[1, 1], [1, 1]] (two equal directions of length 2): a_1 = a_2 = s by symmetry, f = 8 s^2 - 2 log s,
# a (M a) = 8 s^2, optimum s = 1/sqrt 8. Start s_0 = 1/sqrt 4 = .5 (exact, residual 8/4 - 1 = 1 exactly).
# Along [1, 1] the Newton matrix M + diag(1 / s^2) acts as 8 + 1 / s^2 and the gradient is 8 s - 1 / s, so
# s' = s - (8 s - 1/s) / (8 + 1/s^2) = 2 s / (8 s^2 + 1): s = p/q -> 2pq / (8p^2 + q^2), the Pell convergents
# 1/2, 1/3, 6/17, 204/577, 235416/665857 (q^2 - 8 p^2 = +-1, residual 8 s^2 - 1 = -+1/q^2: 1/9, 1/289,
# 3.0e-6, 2.3e-12). f falls at each of these full steps (s rises towards 1/sqrt 8 from below after s_1).
_NASH_PARALLEL = [[4.0, 4.0], [4.0, 4.0]]


def test_nash_weights_tolerance_is_a_strict_bound_on_the_residual():
    # tol = 1: s_0's residual is exactly 1 (not < 1), so one Newton step: s_1 = 1/3, residual 1/9 < 1, returned.
    # (Testing a / (M a) - 1 = 1/8 - 1, a (M a) - 2 = 0 or <= would return s_0 = .5; never returning, s* = .354.)
    a = nash_weights(_NASH_PARALLEL, ridge=0.0, tol=1.0)
    assert a.tolist() == pytest.approx([1 / 3, 1 / 3], abs=1e-15)


def test_nash_weights_takes_full_newton_steps():
    # 3 steps reach 204/577 (residual 3.0e-6 >= 1e-8: not converged); 4 reach 235416/665857 (2.3e-12 < 1e-8,
    # accepted by the final check), which differs from 1/sqrt 8 by 4.0e-13: the 4th Newton iterate exactly
    with pytest.raises(ValueError, match=r"^Nash bargaining solve did not converge$"):
        nash_weights(_NASH_PARALLEL, ridge=0.0, max_iter=3)
    a = nash_weights(_NASH_PARALLEL, ridge=0.0, max_iter=4)
    assert a.tolist() == pytest.approx([235416 / 665857] * 2, rel=1e-15)


def test_nash_weights_default_budget_is_200_newton_steps(monkeypatch):
    # tol = -1 accepts no residual inside the loop, so the default max_iter Newton systems are solved (200),
    # then the final 1e-8 check returns the closed form of diag(4, 1): [.5, 1] (every step is 0 there)
    calls = []
    solve = torch.linalg.solve
    monkeypatch.setattr(torch.linalg, "solve", lambda A, b: calls.append(1) or solve(A, b))
    assert nash_weights([[4.0, 0.0], [0.0, 1.0]], ridge=0.0, tol=-1.0).tolist() == [0.5, 1.0]
    assert len(calls) == 200


def test_nash_weights_halves_a_feasible_step_that_raises_f_far_from_the_optimum(monkeypatch):
    # M = [[1, 0], [1, 2]] (asymmetric; f sees its symmetric part): a_0 = [1, 1/sqrt 2], M a_0 = [1, 1 + sqrt 2],
    # gradient [0, 1], Newton matrix [[2, 0], [1, 4]], step [0, 1/4], Newton decrement^2 = 1/4 >= 1/16: the
    # damped phase. The full step a = [1, .45711] is feasible but raises f (a^T M a = a_1^2 + a_1 a_2 + 2 a_2^2:
    # f 1.70012 -> .93750 + .78284 = 1.72034), t = 1/2 lowers it (a_2 = .58211: 1.12990 + .54111 = 1.67101).
    # So the second Newton matrix is M + diag(1 / a_1^2) with a_1 = [1, 1/sqrt 2 - 1/8]
    # (a full step would give 2 + 1 / .45711^2 = 6.7857 there)
    mats = []
    solve = torch.linalg.solve
    monkeypatch.setattr(torch.linalg, "solve", lambda A, b: mats.append(A.clone()) or solve(A, b))
    nash_weights([[1.0, 0.0], [1.0, 2.0]], ridge=0.0)
    assert float(mats[1][1, 1]) == pytest.approx(2 + 1 / (1 / math.sqrt(2) - 1 / 8) ** 2, rel=1e-12)


def test_nash_weights_halves_a_step_that_leaves_the_positive_orthant():
    # an asymmetric M = [[1, 0], [3, 1]] (f sees its symmetric part, the gradient M a - 1/a the matrix):
    # a_0 = [1, 1], M a_0 = [1, 4], gradient [0, 3], Newton matrix M + I = [[2, 0], [3, 2]], step [0, 1.5]:
    # a_0 - step = [1, -.5] is infeasible, t = .5 gives [1, .25] (f: 2.5 -> .906 + log 4 = 2.29, lower).
    # Solution: a_1 a_1 = 1 -> a_1 = 1; a_2 (3 + a_2) = 1 -> a_2 = (sqrt 13 - 3) / 2.
    # (Taking the infeasible step, or testing a + t step, ends at a_2 = -3.30 or stalls.)
    a = nash_weights([[1.0, 0.0], [3.0, 1.0]], ridge=0.0)
    assert a.tolist() == pytest.approx([1.0, (math.sqrt(13) - 3) / 2], abs=1e-12)


def test_nash_weights_stall_message():
    # M = [[1, q], [q, 4]], q = -4 - d, d = 2^-30 (indefinite: no Gram has it, but nothing stops a caller).
    # a_0 = [1, .5], gradient M a_0 - 1/a_0 = [q/2, q], Newton matrix [[2, q], [q, 8]] maps a_0 to
    # (2 + q/2) [1, 2], so the step is q / (4 + q) a_0 = (4 + d)/d a_0 = 4294967297 a_0: every trial point is
    # lam a_0 with lam = 1 - t (4 + d)/d. lam <= 0 is infeasible; for 0 < lam < 1,
    # f(lam a_0) = lam^2 (2 + q) / 2 - 2 log lam + const falls as lam grows, so f > f(a_0). At t = 2^-66, the
    # last t >= 1e-20, lam = 1 - 5.8e-11 (f higher by about 2.3e-10, far above its rounding), so the halving
    # runs out: "stalled".
    q = -4.0 - 2.0 ** -30
    with pytest.raises(ValueError, match=r"^Nash bargaining solve stalled$"):
        nash_weights([[1.0, q], [q, 4.0]], ridge=0.0)


def test_nash_weights_converges_on_nearly_opposite_directions():
    # A reported bug: the line search compared f values inside their rounding error, rejected the last
    # Newton steps at residual 1e-8 and raised "did not converge" on this well-posed Gram (default ridge too).
    # tau_1 = [1, 0], tau_2 = [-10, 1] (cosine -.995): M = [[1, -10], [-10, 101]], positive definite (det 1),
    # so the minimiser exists. a_1 (a_1 - 10 a_2) = 1 and a_2 (101 a_2 - 10 a_1) = 1; subtracting, a_1^2 =
    # 101 a_2^2, so a_1 = sqrt 101 a_2 and a_2^2 (101 - 10 sqrt 101) = 1: a = [14.1950258, 1.4124579].
    a2 = 1 / math.sqrt(101 - 10 * math.sqrt(101))
    a = nash_weights([[1.0, -10.0], [-10.0, 101.0]], ridge=0.0)
    assert a.tolist() == pytest.approx([math.sqrt(101) * a2, a2], rel=1e-10)
    # the default ridge 1e-9 (of the mean diagonal 51) solves its own M to the 1e-12 tolerance
    b = nash_weights([[1.0, -10.0], [-10.0, 101.0]])
    M = torch.tensor([[1.0, -10.0], [-10.0, 101.0]], dtype=torch.float64) + 51e-9 * torch.eye(2, dtype=torch.float64)
    assert float((b * (M @ b) - 1).abs().max()) < 1e-12


def test_mergemoe_down_ridge_identity_in_float64():
    # the default-ridge case above with ridge 1.0002116e-3: lam = 272 * 1.0002116e-3 = .2720575552,
    # d' = (476 + 1.5 lam) / (272 + lam) = 1.74975019695590, 2.2e-11 above the float32 midpoint
    # 1.74975019693375 between 1.7497501373291016 and 1.7497502565383911, so the float32 output is the upper one.
    # lam rounded to float32 (+7.9e-9) in the denominator alone moves d' by -1.75 * 7.9e-9 / 272.27 = -5.1e-11,
    # below the midpoint.
    gate, up = torch.tensor([[[1.0]], [[3.0]]]), torch.tensor([[[2.0]], [[2.0]]])
    down, x = torch.tensor([[[1.0]], [[2.0]]]), torch.tensor([[1.0], [2.0]])
    _, _, d2 = mergemoe_down(gate, up, down, [0.5, 0.5], x, lambda t: t, ridge=1.0002116e-3)
    lam = 272 * 1.0002116e-3
    assert (476 + 1.5 * lam) / (272 + lam) - (1.7497501373291016 + 1.7497502565383911) / 2 == pytest.approx(2.2e-11,
                                                                                                         rel=0.05)
    assert float(d2) == 1.7497502565383911


def _hartigan(xs, labels, K):
    return hartigan(torch.tensor([[v] for v in xs], dtype=torch.float64), torch.tensor(labels), K).tolist()


def test_hartigan_passes_until_none_moves():
    # x = [1, 5, 0], clusters 0 = {5, 0} (c 2.5), 1 = {1}. Pass 1: 5 moves to cluster 1
    # (n_b/(n_b+1) d_b = 16/2 = 8 < n_a/(n_a-1) d_a = 2 * 6.25): centres 0 and 3. Pass 2: 1 moves to
    # cluster 0 (.5 * 1 = .5 < 2 * 4 = 8): centres .5 and 5. Pass 3 moves nothing: [0, 1, 0].
    # (Stopping after the first pass with a move gives [1, 1, 0].)
    assert _hartigan([1.0, 5.0, 0.0], [1, 0, 0], 2) == [0, 1, 0]


def test_hartigan_updates_both_counts():
    # x = [0, 0, 2, 1], clusters 0 = {x_1 = 0, 2} (c 1), 1 = {x_0 = 0, 1} (c .5). x_1 moves to cluster 1
    # (2/3 * .25 < 2 * 1): n = [1, 3], c = [2, 1/3]. x_3 = 1 then moves to cluster 0 (1/2 * 1 = .5 <
    # 3/2 * 4/9 = 2/3: n_a = 3 read after the update): c = [1.5, 0]; pass 2 moves nothing: [1, 1, 0, 0]
    assert _hartigan([0.0, 0.0, 2.0, 1.0], [1, 0, 0, 1], 2) == [1, 1, 0, 0]
    # x = [1, 3, 1, 0], clusters 0 = {x_2 = 1}, 1 = {1, 3, 0} (c 4/3). Pass 1: x_0 -> 0 (0 < 3/2 * 1/9),
    # n = [2, 2]; x_1 = 3 -> 0 (2/3 * 4 < 2 * 2.25), n = [3, 1], c = [5/3, 0]; x_2 -> 1 (1/2 * 1 <
    # 3/2 * 4/9), n = [2, 2], c = [2, .5]. Pass 2: x_0 -> 1 (2/3 * .25 < 2 * 1), c = [3, 2/3]. Pass 3: none.
    assert _hartigan([1.0, 3.0, 1.0, 0.0], [1, 1, 0, 1], 2) == [1, 0, 1, 1]


def test_hartigan_needs_a_strict_gain():
    # x = [1, 0, 0], clusters 0 = {1, 0} (c .5), 1 = {0}: moving x_0 = 1 to cluster 1 costs 1/2 * 1 = .5,
    # exactly what leaving saves (2 * .25): an exact tie, no move (the 1 - 1e-12 margin). x_2 = 0 then moves
    # to cluster 1 (0 < .5): [0, 1, 1]. (A margin 1 + 1e-12 moves x_0 first: [1, 0, 0].)
    assert _hartigan([1.0, 0.0, 0.0], [0, 1, 0], 2) == [0, 1, 1]
    # a zero gain: x = [0, 0, 0, 1], clusters 0 = {x_0}, 1 = {x_2, x_3}, 2 = {x_1}. x_2 moves to cluster 0
    # (0 < 2 * .25): n = [2, 1, 1], c = [0, 1, 0]. Pass 2: x_0 could join cluster 2 at cost 0, saving
    # 2 * 0 = 0: not a gain, it stays (with <= it would move): [0, 2, 0, 1]
    assert _hartigan([0.0, 0.0, 0.0, 1.0], [0, 2, 1, 1], 3) == [0, 2, 0, 1]


def test_kmeans_draws_only_from_its_own_generator():
    # the seed's generator makes every draw, also the uniform candidates of identical rows (potential 0):
    # the global generator is untouched (torch.rand after kmeans equals torch.rand right after the seed)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    kmeans([[1.0, 2.0]] * 4, 2)
    kmeans([[0.0], [1.0], [5.0], [6.0]], 2)
    assert torch.equal(torch.rand(3), expected)


def _layer(N, I, H, seed):
    g = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(N, I, H, generator=g), "up": torch.randn(N, I, H, generator=g),
            "down": torch.randn(N, H, I, generator=g), "router": torch.randn(N, H, generator=g)}


KEYS = {"gate", "up", "down", "groups", "weights", "router", "bias", "info"}


def test_merge_layer_namex_passes_its_options_and_reports_the_bases():
    # counts [2, 2, 1, 5, 1]: group {0, 1, 2} ties between 0 and 1, so the base is the lower index 0; group
    # {3, 4}: base 3. ridge .5 reaches nash_weights (two task vectors: it moves alpha and the merge).
    W = _layer(5, 2, 3, 0)
    feats = {"count": torch.tensor([2.0, 2.0, 1.0, 5.0, 1.0]), "logit_gram": torch.eye(5, dtype=torch.float64)}
    out = merge_layer("namex", W, feats, 2, groups=[[0, 1, 2], [3, 4]], ridge=0.5)
    assert set(out) == KEYS and out["router"] is None and out["bias"] is None
    assert out["groups"] == [[0, 1, 2], [3, 4]] and out["info"] == {"base": [0, 3]}
    for gi, (g, base) in enumerate([([0, 1, 2], 0), ([3, 4], 0)]):
        n = len(g)
        flat = torch.cat([W["gate"][g].reshape(n, -1), W["up"][g].reshape(n, -1), W["down"][g].reshape(n, -1)], 1)
        m, c = namex_merge(flat, base, frequency_weights(feats["count"], g), 0.5)
        assert torch.equal(out["gate"][gi].reshape(-1), m[:6]) and torch.equal(out["down"][gi].reshape(-1), m[12:])
        assert out["weights"][gi] == c.tolist()
    flat = torch.cat([W["gate"][:3].reshape(3, -1), W["up"][:3].reshape(3, -1), W["down"][:3].reshape(3, -1)], 1)
    assert not torch.equal(namex_merge(flat, 0, frequency_weights(feats["count"], [0, 1, 2]), 0.5)[0],
                           namex_merge(flat, 0, frequency_weights(feats["count"], [0, 1, 2]))[0])


def test_merge_layer_mergemoe_passes_its_options_and_counts_fit_tokens():
    # explicit groups {0, 1, 2}, {3}: the first is fitted on the sampled tokens routed to it with ridge .5,
    # the singleton is copied (0 fit tokens); weights are the frequency weights of each group
    W = _layer(4, 2, 3, 1)
    g = torch.Generator().manual_seed(1)
    x, top = torch.randn(12, 3, generator=g), torch.randint(0, 4, (12, 2), generator=g)
    count = torch.bincount(top.reshape(-1), minlength=4).double()
    feats = {"count": count, "tokens": 12, "out_sum": torch.randn(4, 3, generator=g, dtype=torch.float64),
             "x_sample": x, "x_sample_topk": top}
    out = merge_layer("mergemoe", W, feats, 2, groups=[[0, 1, 2], [3]], ridge=0.5)
    rows = torch.isin(top, torch.tensor([0, 1, 2])).any(1)
    assert set(out) == KEYS and out["router"] is None and out["bias"] is None
    assert out["info"] == {"fit_tokens": [int(rows.sum()), 0]}
    assert out["weights"] == [frequency_weights(count, [0, 1, 2]), frequency_weights(count, [3])]
    w = frequency_weights(count, [0, 1, 2])
    _, _, d2 = mergemoe_down(W["gate"][:3], W["up"][:3], W["down"][:3], w, x[rows], torch.nn.functional.silu, 0.5)
    assert torch.equal(out["down"][0], d2) and torch.equal(out["down"][1], W["down"][3])
    _, _, d_default = mergemoe_down(W["gate"][:3], W["up"][:3], W["down"][:3], w, x[rows], torch.nn.functional.silu)
    assert not torch.equal(d2, d_default)
    # without the option: MergeMoE's default ridge 1e-3 (mergemoe_down's own default)
    assert torch.equal(merge_layer("mergemoe", W, feats, 2, groups=[[0, 1, 2], [3]])["down"][0], d_default)


def test_merge_layer_mergemoe_passes_the_linkage():
    # mean outputs on a line, 0, 1, 2.6, 4.5 (tokens 1): the first merge is {0, 1} (distance 1). Then single
    # linkage joins 2.6 to it (1.6 < 1.9), average linkage joins 2.6 and 4.5 (1.9 < (2.6 + 1.6) / 2 = 2.1)
    W = _layer(4, 2, 3, 2)
    out_sum = torch.tensor([[0.0, 0, 0], [1.0, 0, 0], [2.6, 0, 0], [4.5, 0, 0]], dtype=torch.float64)
    feats = {"count": torch.ones(4, dtype=torch.float64), "tokens": 1, "out_sum": out_sum,
             "x_sample": torch.zeros(0, 3), "x_sample_topk": torch.zeros(0, 2, dtype=torch.long)}
    assert merge_layer("mergemoe", W, feats, 2, linkage="single")["groups"] == [[0, 1, 2], [3]]
    assert merge_layer("mergemoe", W, feats, 2)["groups"] == [[0, 1], [2, 3]]


def _cos_sums(seed):
    # a symmetric [8, 8] similarity sum (tokens 1) drawn from a seed: Sub-MoE's k-means on its rows
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(8, 8, generator=g, dtype=torch.float64)
    return {"out_cos_sum": (A + A.T) / 4, "tokens": 1, "count": torch.ones(8, dtype=torch.float64)}


def test_merge_layer_submoe_passes_rank_and_keeps_singletons():
    # rank 1 truncates the 2-member group's joint SVD; the singleton is copied as it is (not truncated)
    W = _layer(3, 2, 3, 3)
    feats = {"out_cos_sum": torch.eye(3, dtype=torch.float64), "tokens": 1, "count": torch.tensor([1.0, 3.0, 2.0])}
    out = merge_layer("submoe", W, feats, 2, groups=[[0, 1], [2]], rank=1)
    assert set(out) == KEYS and out["router"] is None and out["bias"] is None and out["info"] == {"rank": 1}
    w = frequency_weights(feats["count"], [0, 1])
    assert torch.equal(out["up"][0], svd_merge(W["up"][[0, 1]], w, 1))
    assert not torch.equal(out["up"][0], svd_merge(W["up"][[0, 1]], w))
    assert torch.equal(out["up"][1], W["up"][2]) and not torch.equal(svd_merge(W["up"][[2]], [1.0], 1), W["up"][2])


def test_submoe_seed_and_restarts_reach_the_clustering():
    # cases where the seed (seed 28's sums: 42, 43 and 7 give different groups) and the number of restarts
    # (seed 9's sums: 1 restart differs from 10) change Sub-MoE's k-means groups; the defaults are 42 and 10
    W = _layer(8, 2, 3, 4)
    f28, f9 = _cos_sums(28), _cos_sums(9)
    assert submoe_groups(f28, 3) == submoe_groups(f28, 3, 42, 10) != submoe_groups(f28, 3, 43, 10)
    assert submoe_groups(f28, 3, 7, 10) != submoe_groups(f28, 3, 42, 10)
    D = 1.0 - submoe_similarity(f28["out_cos_sum"], 1)
    assert torch.equal(kmeans(D, 3), kmeans(D, 3, seed=42)) and not torch.equal(kmeans(D, 3), kmeans(D, 3, seed=43))
    assert merge_layer("submoe", W, f28, 3)["groups"] == submoe_groups(f28, 3, 42, 10)
    assert merge_layer("submoe", W, f28, 3, seed=7)["groups"] == submoe_groups(f28, 3, 7, 10)
    assert submoe_groups(f9, 3, 42, 1) != submoe_groups(f9, 3, 42, 10)
    assert merge_layer("submoe", W, f9, 3, n_init=1)["groups"] == submoe_groups(f9, 3, 42, 1)


def test_merge_layer_checks_options_shapes_and_k_bounds():
    W = _layer(4, 2, 3, 5)
    feats = {"count": torch.ones(4), "logit_gram": torch.eye(4, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"^namex: unknown option\(s\) \['rank'\]; it takes \['act', 'groups', "
                                         r"'ridge'\]$"):
        merge_layer("namex", W, feats, 2, rank=3)
    with pytest.raises(ValueError, match=r"^W lacks 'router': give gate \[N,I,H\], up \[N,I,H\], down \[N,H,I\], "
                                         r"router \[N,H\]$"):
        merge_layer("namex", {k: v for k, v in W.items() if k != "router"}, feats, 2)
    with pytest.raises(ValueError, match=r"^W\['bias'\] has shape \(3,\), expected \(4,\)"):
        merge_layer("namex", dict(W, bias=torch.zeros(3)), feats, 2)
    # K = 1 (one group of all) and K = N (every expert alone) are both allowed
    assert merge_layer("namex", W, feats, 1)["groups"] == [[0, 1, 2, 3]]
    assert merge_layer("namex", W, feats, 4)["groups"] == [[0], [1], [2], [3]]


def _ream_feats(seed):
    g = torch.Generator().manual_seed(seed)
    return {"count": torch.tensor([2.0, 2.0, 2.0, 2.0]), "logit_gram": torch.eye(4, dtype=torch.float64),
            "ream_out_sum": torch.randn(4, 3, generator=g, dtype=torch.float64),
            "ream_sal_sum": torch.tensor([4.0, 4.0, 2.0, 6.0]), "x_sample": torch.randn(5, 3, generator=g)}


def test_merge_layer_ream_outputs_bias_weights_and_centroids():
    # saliency = sal_sum / count = [2, 2, 1, 3]; explicit groups {0, 1, 2}, {3}: the first group's centroid
    # is the most salient member, the lower index of the tie 0 / 1 -> 0; weights sal / group sum =
    # [.4, .4, .2] and [1]; the router rows and the bias entries are the centroids' (0 and 3)
    W = dict(_layer(4, 2, 3, 6), bias=torch.tensor([0.5, 1.5, 2.5, 3.5]))
    out = merge_layer("ream", W, _ream_feats(0), 2, groups=[[0, 1, 2], [3]])
    assert set(out) == KEYS and out["info"] == {"centroids": [0, 3], "saliency": [2.0, 2.0, 1.0, 3.0]}
    assert out["weights"] == [[0.4, 0.4, 0.2], [1.0]]
    assert out["bias"].tolist() == [0.5, 3.5] and torch.equal(out["router"], W["router"][[0, 3]])
    # merging avg_freq: no alignment, the saliency-weighted sum of the members as they are (I = 2 != H = 3)
    out = merge_layer("ream", W, _ream_feats(0), 2, groups=[[0, 1, 2], [3]], merging="avg_freq")
    w = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    assert torch.allclose(out["down"][0].double(), torch.einsum("n,nhi->hi", w, W["down"][:3].double()), atol=1e-6)
    # the other merging names are accepted, each with its own features
    for merging in ("logits", "weights"):
        assert merge_layer("ream", W, _ream_feats(0), 2, groups=[[0, 1, 2], [3]], merging=merging)["groups"]


def test_ream_groups_default_group_size_is_16():
    # 17 experts into K = 1 group of at most 16: the message names the bound (group_size 17 would fit)
    with pytest.raises(ValueError, match=r"^REAM group_size=16 with K=1 can hold only 16 of the 17 experts; "
                                         r"use a larger group_size$"):
        ream_groups(torch.ones(17), torch.zeros(17, 17), 1)
    W = _layer(17, 1, 2, 7)
    feats = {"count": torch.ones(17), "logit_gram": torch.eye(17, dtype=torch.float64),
             "ream_out_sum": torch.ones(17, 2, dtype=torch.float64), "ream_sal_sum": torch.ones(17),
             "x_sample": torch.ones(2, 2)}
    with pytest.raises(ValueError, match=r"group_size=16 with K=1"):
        merge_layer("ream", W, feats, 1)


def test_linear_assignment_reads_float64_and_names_a_non_square_matrix():
    # costs [[1 + 2e-9, 1], [1 + 1e-9, 1]]: the identity costs 2 + 2e-9, the swap 2 + 1e-9, so [1, 0]
    # (in float32 every entry is 1.0 and the swap is not seen)
    assert linear_assignment([[1 + 2e-9, 1.0], [1 + 1e-9, 1.0]]).tolist() == [1, 0]
    with pytest.raises(ValueError, match=r"^cost matrix must be square, got \(2, 3\)$"):
        linear_assignment(torch.zeros(2, 3))


def test_kmeans_keeps_the_first_of_equal_restarts():
    # two clear triples: every restart reaches the same inertia (4), the labels only name the clusters
    # differently; the first run's labels are kept (with seed 0, a later run numbers them the other way)
    X = [[0.0], [1.0], [2.0], [10.0], [11.0], [12.0]]
    assert kmeans(X, 2, seed=0).tolist() == kmeans(X, 2, seed=0, n_init=1).tolist() == [0, 0, 0, 1, 1, 1]


def test_kmeans_plusplus_is_scale_free():
    # P(x) ~ D(x)^2 / sum D^2 does not change when X is scaled: the same draws whether the potential is
    # below 1 (x = 0, .01, .03, .1, .2) or above (100 times that)
    X = torch.tensor([[0.0], [0.01], [0.03], [0.1], [0.2]], dtype=torch.float64)
    for seed in range(5):
        small = kmeans_plusplus(X, 3, torch.Generator().manual_seed(seed))
        large = kmeans_plusplus(100 * X, 3, torch.Generator().manual_seed(seed))
        assert torch.allclose(100 * small, large, rtol=1e-12)


def test_ream_groups_order_bounds_and_float64():
    # saliency [1, 3], K = 2: centroid order 1, 0, returned by smallest member: ([[0], [1]], [0, 1]); K = N is allowed
    assert ream_groups([1.0, 3.0], torch.zeros(2, 2), 2) == ([[0], [1]], [0, 1])
    with pytest.raises(ValueError, match=r"^K=3 must be in \[1, N=2\]$"):
        ream_groups([1.0, 3.0], torch.zeros(2, 2), 3)
    # a list saliency is read in float64: 1 + 1e-9 > 1 makes expert 1 the centroid (float32 would tie: 0)
    assert ream_groups([1.0, 1.0 + 1e-9], torch.zeros(2, 2), 1, group_size=2) == ([[0, 1]], [1])


def test_merge_layer_act_dtype_and_finite_message():
    W = _layer(4, 2, 3, 8)
    g = torch.Generator().manual_seed(8)
    x, top = torch.randn(10, 3, generator=g), torch.randint(0, 4, (10, 2), generator=g)
    feats = {"count": torch.bincount(top.reshape(-1), minlength=4).double(), "tokens": 10,
             "out_sum": torch.randn(4, 3, generator=g, dtype=torch.float64), "x_sample": x, "x_sample_topk": top}
    relu = torch.nn.functional.relu
    out = merge_layer("mergemoe", W, feats, 1, act=relu)
    w = frequency_weights(feats["count"], [0, 1, 2, 3])
    assert torch.equal(out["down"][0], mergemoe_down(W["gate"], W["up"], W["down"], w, x, relu)[2])
    assert not torch.equal(out["down"][0], merge_layer("mergemoe", W, feats, 1)["down"][0])
    # the merged experts come back in W's dtype (float64 here)
    out = merge_layer("mergemoe", {k: v.double() for k, v in W.items()}, feats, 1)
    assert out["gate"].dtype == out["up"].dtype == out["down"].dtype == torch.float64
    with pytest.raises(ValueError, match=r"^namex: the merged experts are not finite \(check the inputs for nan / "
                                         r"inf\)$"):
        merge_layer("namex", dict(W, up=torch.full((4, 2, 3), float("inf"))), {"count": torch.ones(4),
                    "logit_gram": torch.eye(4, dtype=torch.float64)}, 4)


def test_recorder_features_per_method_and_its_seeded_sample():
    # one MoE layer, one batch of 10 tokens. Each method recorded alone gets its own features, equal bit for bit
    # to those of a recording of all four (the output sums are not skipped for Sub-MoE or MergeMoE alone), and
    # nothing else (no token sample for Sub-MoE or NAMEx); counts are float64.
    model = tiny_qwen3_moe(N=4, layers=1)
    batch = [{"input_ids": torch.tensor([[(3 * i + 1) % 32 for i in range(10)]]),
              "attention_mask": torch.ones(1, 10, dtype=torch.long)}]
    torch.manual_seed(0)
    expected_rand = torch.rand(2)
    torch.manual_seed(0)
    full = collect(model, batch, sample_tokens=4)[0]
    assert full["count"].dtype == torch.float64
    for method, names in NEEDS.items():
        alone = collect(model, batch, methods=(method,), sample_tokens=4)[0]
        assert set(alone) - {"x_sample_topk", "x_sample_key"} == (names | {"count", "tokens"}) - {"x_sample_topk"}
        for name in names:
            assert torch.equal(torch.as_tensor(alone[name]), torch.as_tensor(full[name])), (method, name)
    # the sample is drawn from the recorder's own generator (the global one is untouched): seed s gives the
    # tokens with the 4 smallest of torch.rand(10, float64) keys from manual_seed(s), in arrival order;
    # the recorder's default seed is 0
    assert torch.equal(torch.rand(2), expected_rand)
    hidden = []
    h = blocks.moe_blocks(model)[0][1].experts.register_forward_hook(lambda m, a, o: hidden.append(a[0].detach()))
    with torch.no_grad():
        model(**batch[0])
    h.remove()
    for seed in (0, 1):
        keys = torch.rand(10, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        keep = keys.argsort()[:4].sort().values
        rec = ComparatorRecorder(model, ("mergemoe",), 4, **({} if seed == 0 else {"seed": seed}))
        feats = baselines.run_recorder(rec, model, batch)[0]
        assert torch.equal(feats["x_sample"], hidden[0][keep].float())
        assert torch.equal(feats["x_sample_key"], keys[keep])


def test_ream_weight_features_scale_by_singular_values_below_one():
    # two neurons (N = 2, I = 1, H = 1), rows [gate | up | down] = [1, 0, 0] and [.6, .8, 0] (unit already):
    # centred rows -+[.2, -.4, 0], Gram [[.08, -.16, 0], [-.16, .32, 0], 0] with eigenvalues .4, 0, 0.
    # Feature 1 = row . v sqrt .4 with v = [1, -2, 0] / sqrt 5: |.2 + .8| / sqrt 5 * sqrt .4 = sqrt .08
    # (a singular value below 1 is kept, not floored); the zero-eigenvalue features are 0
    gate, up, down = torch.tensor([[[1.0]], [[0.6]]]), torch.tensor([[[0.0]], [[0.8]]]), torch.zeros(2, 1, 1)
    f = ream_weight_features(gate, up, down)
    assert f.shape == (2, 1, 3)
    assert f[:, 0, 0].abs().tolist() == pytest.approx([math.sqrt(0.08)] * 2, rel=1e-7)
    assert f[:, 0, 1:].abs().max() < 1e-7
    # the default keeps 64 principal axes (3 H = 66 here)
    assert ream_weight_features(torch.zeros(1, 1, 22), torch.zeros(1, 1, 22), torch.zeros(1, 22, 1)).shape == (1, 1, 64)


def test_ream_unit_rows_and_pca_dim_option():
    # rows divided by their norm + 1e-8: [3, 4] -> [3, 4] / (5 + 1e-8)
    a = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    assert torch.equal(_unit_rows(a), a / (5.0 + 1e-8))
    # pca_dim reaches the weight features: 1 axis aligns neurons differently from all 9 here
    # (compared with merge_layer's own default, found by trying seeds: seed 0 already differs)
    W, feats = _layer(4, 3, 3, 0), _ream_feats(0)
    one = merge_layer("ream", W, feats, 2, groups=[[0, 1], [2, 3]], merging="weights", pca_dim=1)
    assert not torch.equal(one["gate"], merge_layer("ream", W, feats, 2, groups=[[0, 1], [2, 3]],
                                                    merging="weights")["gate"])
    nine = merge_layer("ream", W, feats, 2, groups=[[0, 1], [2, 3]], merging="weights", pca_dim=9)
    assert torch.equal(nine["gate"], merge_layer("ream", W, feats, 2, groups=[[0, 1], [2, 3]],
                                                 merging="weights")["gate"])


def test_kmeans_reads_a_list_in_float64():
    # x = 0, 1 + 1e-9, 2, K = 2: {1 + 1e-9, 2} has inertia (1 - 1e-9)^2 / 2, below {0, 1 + 1e-9}'s
    # (1 + 1e-9)^2 / 2, so the middle point joins 2 (in float32 it is exactly 1, a tie)
    labels = kmeans([[0.0], [1.0 + 1e-9], [2.0]], 2).tolist()
    assert labels[1] == labels[2] != labels[0]


def test_ream_activation_features_unit_rows_only_with_two_samples_or_more():
    # group {0, 1} (saliency 2 and 2: weights .5, .5, centroid 0): member 1's neurons are permuted by the optimal
    # assignment on the cdist of the neurons' activations over the sampled tokens, raw for one token and
    # unit rows for two or more (compared with that transcription; seed 3 is a layer where both rules
    # give different permutations, found by trying seeds)
    W, g = _layer(4, 3, 3, 3), torch.Generator().manual_seed(3)
    x1, x2 = torch.randn(1, 3, generator=g), torch.randn(2, 3, generator=g)
    gate = W["gate"].double()

    def merged(x, unit):
        act = expert_hidden(gate, W["up"].double(), x.double(), torch.nn.functional.silu).transpose(1, 2)
        act = _unit_rows(act) if unit else act
        return (0.5 * gate[0] + 0.5 * gate[1][linear_assignment(torch.cdist(act[0], act[1]))]).float()

    for x, unit in ((x1, False), (x2, True)):
        out = merge_layer("ream", W, dict(_ream_feats(0), x_sample=x), 2, groups=[[0, 1], [2, 3]], merging="logits")
        assert torch.equal(out["gate"][0], merged(x, unit)) and not torch.equal(merged(x, unit), merged(x, not unit))


def test_recorder_takes_no_sample_from_padding_only():
    # every position padding: no token reaches the sums or the sample (no x_sample entry at all)
    model = tiny_qwen3_moe(N=4, layers=1)
    batch = [{"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.zeros(1, 3, dtype=torch.long)}]
    feats = collect(model, batch, methods=("mergemoe",), sample_tokens=2)[0]
    assert feats["tokens"] == 0 and "x_sample" not in feats and float(feats["count"].sum()) == 0.0


def test_linear_assignment_of_equal_costs_is_the_identity():
    # every matching of an all-zero cost is optimal; the first of equal minima is kept at every step, so the
    # identity comes back (REAM's avg_freq relies on it: its cost is all zeros)
    for n in range(1, 9):
        assert linear_assignment(torch.zeros(n, n)).tolist() == list(range(n))


def test_hartigan_never_moves_a_singleton():
    # x = [.1, .7, 1], clusters 0 = {.1, .7} (c .4), 1 = {1}: .7 moves to cluster 1 (1/2 * .09 < 2 * .09).
    # Cluster 0's centre becomes (2 * .4 - .7) / 1 = .09999999999999998 in float64, not .1: .1 is then a
    # singleton a rounding error from its centre, and must stay (moving it would empty cluster 0): [0, 1, 1]
    assert _hartigan([0.1, 0.7, 1.0], [0, 0, 1], 2) == [0, 1, 1]


def test_lloyd_steps_and_stop_rule():
    # x = 0, 1, 2, 6 from centres 0, 1 (K = 2). Step 1: {0} and {1, 2, 6} -> centres 0, 3, squared shift
    # 0 + 2^2 = 4. Step 2: {0, 1} and {2, 6} (2 is 1 from 3, 2 from 0) -> .5, 4, shift .5^2 + 1^2 = 1.25.
    # Step 3: {0, 1, 2} (2 is 1.5 from .5, 2 from 4) and {6} -> 1, 6, shift .25 + 4 = 4.25. Step 4: the
    # same assignment, the end. So: a bound of 0 -> [1, 6]; max_iter 1, 2 -> [0, 3], [.5, 4]; the shift is
    # compared with the bound by <=: a bound of 4 ends after step 1 (a cubed shift, 0 + 8, would not), 1.25
    # after step 2 (with < it would run to [1, 6]; the sum of the centres, 0 + 3, 0 + 4 squared = 16, then
    # .25 + 49, would never end it), 1.2499 runs on to [1, 6].
    X = torch.tensor([[0.0], [1.0], [2.0], [6.0]], dtype=torch.float64)
    C = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    ends = [lloyd(X, C, 2, max_iter, stop).flatten().tolist()
            for max_iter, stop in ((300, 0.0), (1, 0.0), (2, 0.0), (300, 4.0), (300, 3.99), (300, 1.25), (300, 1.2499))]
    assert ends == [[1.0, 6.0], [0.0, 3.0], [0.5, 4.0], [0.0, 3.0], [0.5, 4.0], [0.5, 4.0], [1.0, 6.0]]


def test_kmeans_passes_lloyd_tol_times_the_mean_feature_variance(monkeypatch):
    # a spy on the arguments kmeans passes to lloyd (this pins a default and a formula whose effect Hartigan's
    # refinement hides in small cases). X = [[0, 0], [2, 4]]: biased column variances 1 and 4, mean 2.5, so
    # stop = 1e-4 * 2.5 = 2.5e-4 (all four entries: 2.75; unbiased columns: 2, 8 -> 5; rows: 0, 1 -> .5);
    # max_iter 300, once per restart (10 by default)
    seen = []
    real = comparators.lloyd
    monkeypatch.setattr(comparators, "lloyd", lambda X, C, K, max_iter, stop: seen.append((max_iter, stop))
                        or real(X, C, K, max_iter, stop))
    kmeans([[0.0, 0.0], [2.0, 4.0]], 2)
    assert len(seen) == 10 and {m for m, _ in seen} == {300}
    assert [s for _, s in seen] == pytest.approx([2.5e-4] * 10, rel=1e-12)
    seen.clear()
    kmeans([[0.0, 0.0], [2.0, 4.0]], 2, n_init=2, max_iter=7, tol=0.1)
    assert [m for m, _ in seen] == [7, 7] and [s for _, s in seen] == pytest.approx([0.25, 0.25], rel=1e-12)


def test_kmeans_and_submoe_seed_ten_restarts_by_default(monkeypatch):
    # a spy counting the k-means++ seedings: one per restart, 10 by default in kmeans, submoe_groups and
    # merge_layer("submoe") (Sub-MoE's KMeans(n_init=10)); n_init=3 gives 3
    calls = []
    real = comparators.kmeans_plusplus
    monkeypatch.setattr(comparators, "kmeans_plusplus", lambda X, K, g: calls.append(K) or real(X, K, g))
    counts = []
    for run in (lambda: kmeans([[0.0], [1.0], [5.0]], 2), lambda: kmeans([[0.0], [1.0], [5.0]], 2, n_init=3),
                lambda: submoe_groups(_cos_sums(0), 3),
                lambda: merge_layer("submoe", _layer(8, 2, 3, 4), _cos_sums(0), 3)):
        calls.clear()
        run()
        counts.append(len(calls))
    assert counts == [10, 3, 10, 10]


def test_kmeans_keeps_the_first_of_equal_restarts_at_a_large_inertia():
    # the case of test_kmeans_keeps_the_first_of_equal_restarts times 1000 (k-means++ draws the same centres,
    # test_kmeans_plusplus_is_scale_free; Lloyd's stop scales with the variance): every restart reaches
    # inertia 4e6, and 4e6 - 1e-12 == 4e6 in float64, so only a strict `<` keeps the first restart's
    # labels; `<=` would take each later equal one, and the last (10th) restart with seed 0 numbers the
    # clusters the other way, [1, 1, 1, 0, 0, 0] (the restarts' labels listed by a float64 script)
    assert 4e6 - 1e-12 == 4e6
    X = [[0.0], [1000.0], [2000.0], [10000.0], [11000.0], [12000.0]]
    assert kmeans(X, 2, seed=0).tolist() == [0, 0, 0, 1, 1, 1]


def test_ream_default_pca_dim_reaches_the_weight_features(monkeypatch):
    # a spy on the pca_dim merge_layer("ream") passes: 64 without the option (the official default), the
    # option's value with it
    seen = []
    real = comparators.ream_weight_features
    monkeypatch.setattr(comparators, "ream_weight_features", lambda *a: seen.append(a[3]) or real(*a))
    W, feats = _layer(4, 3, 3, 0), _ream_feats(0)
    merge_layer("ream", W, feats, 2, groups=[[0, 1], [2, 3]], merging="weights")
    merge_layer("ream", W, feats, 2, groups=[[0, 1], [2, 3]], merging="weights", pca_dim=5)
    assert seen == [64, 5]


# 101 points between ten 0s and ten 100s, placed so that Hartigan's moves (K = 2) take them from the right
# cluster to the left one, one per pass (constructed with a small numpy script: a fixed point putting each
# c_{j+1} midway between consecutive boundaries, rounded to .1; every margin is >= .08 after rounding).
_HARTIGAN_CHAIN = [26.9, 28.1, 29.3, 30.4, 31.4, 32.2, 33.1, 33.8, 34.5, 35.2, 35.8, 36.4, 36.9, 37.4, 37.9, 38.4,
                   38.8, 39.3, 39.7, 40.1, 40.5, 40.8, 41.2, 41.6, 41.9, 42.2, 42.6, 42.9, 43.2, 43.5, 43.8, 44.1,
                   44.4, 44.7, 44.9, 45.2, 45.5, 45.8, 46.0, 46.3, 46.5, 46.8, 47.1, 47.3, 47.6, 47.8, 48.1, 48.3,
                   48.6, 48.8, 49.1, 49.3, 49.6, 49.8, 50.1, 50.3, 50.6, 50.8, 51.1, 51.3, 51.6, 51.8, 52.1, 52.4,
                   52.6, 52.9, 53.2, 53.5, 53.7, 54.0, 54.3, 54.6, 54.9, 55.2, 55.5, 55.9, 56.2, 56.5, 56.9, 57.2,
                   57.6, 58.0, 58.4, 58.8, 59.2, 59.7, 60.1, 60.6, 61.1, 61.7, 62.2, 62.8, 63.5, 64.1, 64.9, 65.7,
                   66.5, 67.4, 68.5, 69.6, 70.9]


def test_hartigan_default_runs_100_passes():
    # x = ten 0s, the chain c_101 > ... > c_1 (indices 10-110, c_1 = 26.9 last), ten 100s; clusters 0 = the 0s,
    # 1 = the rest. With the 0s and c_1..c_j in cluster 0 (centre m_0), a point x of cluster 1 (centre m_1)
    # gains by moving iff n_0/(n_0+1) (x - m_0)^2 < n_1/(n_1-1) (x - m_1)^2, i.e. left of a boundary b_j that
    # lies strictly between c_{j+1} and c_{j+2} (j = 0: m_0 = 0, m_1 = (4951.9 + 1000) / 111 = 53.62, and
    # sqrt(10/11) b_0 = sqrt(111/110) (53.62 - b_0) gives b_0 = 27.51, between 26.9 and 28.1); no point of
    # cluster 0 gains by moving back (margin >= .08 too). Points are visited in index order, so c_{j+2} (a lower
    # index) is checked before c_{j+1} moves and stays: exactly one move per pass. The default 100 passes leave
    # c_101 = 70.9 (index 10) in cluster 1 (b_99 = 70.20 < 70.9 < b_100 = 71.55); 101 passes move it too.
    x = torch.tensor([[0.0]] * 10 + [[c] for c in _HARTIGAN_CHAIN[::-1]] + [[100.0]] * 10, dtype=torch.float64)
    labels = torch.tensor([0] * 10 + [1] * 111)
    moved = [int((hartigan(x, labels, 2, max_pass=t)[10:111] == 0).sum()) for t in (1, 2, 100, 101, 102)]
    assert moved == [1, 2, 100, 101, 101]
    assert hartigan(x, labels, 2).tolist() == [0] * 10 + [1] + [0] * 100 + [1] * 10
