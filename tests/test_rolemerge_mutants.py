"""Hand-computed cases for RoleMerge's scoring equations in rolemerge/model.py, written for the
mutants the other RoleMerge tests let through (`python -m eval.tools.mutation --target
rolemerge/model.py --equations`; see eval/logs/mutation.md). Every expected number is worked out
in the comment above it."""

import pytest
import torch

from rolemerge.model import (_pair_collision, acr, agglomerate, answer_concentration, collision_increment, collision_scale,
                             layer_lambdas, merge_weights, normalise_by_max, phase_distributions, role_profiles)


def test_collision_increment_subtracts_both_parts():
    # p_ans = [.5, .3, .2], G = {0}, H = {1, 2}: R(H) = .5 / .3 - 1 = 2/3, R(G) = 0,
    # R(G u H) = 1 / .5 - 1 = 1; Delta R = 1 - 0 - 2/3 = 1/3 (adding R(H) would give 5/3)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    assert collision_increment(p, [0], [1, 2]) == pytest.approx(1 / 3)
    assert collision_increment(p, [1, 2], [0]) == pytest.approx(1 / 3)


def test_collision_increment_passes_eps_to_every_term():
    # eps = .1. G = {0}, H = {1}, p = [.5, .5]: R(G u H) = 1 / (.5 + .1) - 1 = 2/3 (eps 1e-12: 1);
    # the singletons are 0 either way
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert collision_increment(p, [0], [1], eps=0.1) == pytest.approx(2 / 3)
    # G = {0, 1}, H = {2}, p = [.4, .4, .2]: R(G) = .8 / .5 - 1 = .6 (eps 1e-12: 1.0), R(H) = 0,
    # R(G u H) = 1 / .5 - 1 = 1; Delta R = .4 in either order
    p = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    assert collision_increment(p, [0, 1], [2], eps=0.1) == pytest.approx(0.4)
    assert collision_increment(p, [2], [0, 1], eps=0.1) == pytest.approx(0.4)


def test_merge_weights_fractional_and_zero_mass():
    # masses [.2, .6] (below 1 in total): omega = [.2, .6] / .8 = [.25, .75]
    assert merge_weights(torch.tensor([0.2, 0.6]), [[0, 1]])[0] == pytest.approx([0.25, 0.75])
    # a zero-mass group of three: uniform 1/3, computed in float64 (float32 would give .33333334)
    w = merge_weights([0.0, 0.0, 0.0, 5.0], [[0, 1, 2], [3]])
    assert w == [[1 / 3, 1 / 3, 1 / 3], [1.0]]


def test_empty_grouping():
    # no group: no weights, nothing recovered
    assert merge_weights([1.0, 2.0], []) == []
    assert acr([0.5, 0.5], []) == 0.0


def test_acr_sums_in_float64():
    # p = [.1, .2] as a list, two singletons: ACR = .1 + .2 in float64 = 0.30000000000000004
    # (float32 would give 0.30000001192092896)
    assert acr([0.1, 0.2], [[0], [1]]) == 0.1 + 0.2


def test_answer_concentration_hand_computed():
    # kappa = 1 - H(p) / log N. N = 2, p = [1, 0]: H = 0 -> 1.0; N = 4, p = [.5, .5, 0, 0]:
    # H = ln 2, log N = ln 4 -> .5
    assert answer_concentration(torch.tensor([1.0, 0.0], dtype=torch.float64)) == pytest.approx(1.0)
    assert answer_concentration(torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)) == pytest.approx(0.5)
    # N = 1 (log N = 0) and an all-zero distribution: 0 by definition
    assert answer_concentration(torch.tensor([1.0], dtype=torch.float64)) == 0.0
    assert answer_concentration(torch.zeros(3, dtype=torch.float64)) == 0.0


def test_layer_lambdas_default_and_floor():
    # equal kappas: every lambda is the mean, lam = .03 by default
    assert layer_lambdas([0.5, 0.5]) == pytest.approx([0.03, 0.03])
    # kappa 0 is floored at 1e-3: k = [.001, .002], mean .0015 -> .03 * k / mean = [.02, .04]
    assert layer_lambdas([0.0, 0.002]) == pytest.approx([0.02, 0.04])


def test_pair_collision_subtracts_both_groups_R():
    # G = {.4, .4}: sum .8, max .4, R = 1; H = {.1, .1}: sum .2, max .1, R = 1;
    # R(G u H) = 1 / .4 - 1 = 1.5; Delta R = 1.5 - 1 - 1 = -.5 (= collision_increment)
    t = lambda v: torch.tensor([v], dtype=torch.float64)
    d = _pair_collision(t(0.8), t(0.2), t(0.4), t(0.1), t(1.0), t(1.0))
    assert d.item() == pytest.approx(-0.5)
    p = torch.tensor([0.4, 0.4, 0.1, 0.1], dtype=torch.float64)
    assert collision_increment(p, [0, 1], [2, 3]) == pytest.approx(-0.5)


def test_collision_scale_is_the_median_of_the_positive_singleton_increments():
    # Delta R({i}, {j}) = (p_i + p_j) / max(p_i, p_j) - 1 = min / max (eps 1e-12 aside).
    f = lambda *v: torch.tensor(v, dtype=torch.float64) / sum(v)
    # 3 pairs of [5, 3, 2]: 3/5, 2/5, 2/3 -> sorted [.4, .6, .667], median .6
    assert collision_scale(f(5, 3, 2)) == pytest.approx(0.6)
    # 6 pairs of [5, 3, 2, 1]: .6 .4 .2 .667 .333 .5 -> sorted [.2 .333 .4 .5 .6 .667], median (.4 + .5) / 2
    assert collision_scale(f(5, 3, 2, 1)) == pytest.approx(0.45)
    # 15 pairs of [6, 5, 4, 3, 2, 1]: a/b for a < b <= 6, sorted 1/6 1/5 1/4 1/3 2/6 2/5 1/2 [2/4] 3/6 ...:
    # the 8th of 15 is .5
    assert collision_scale(f(6, 5, 4, 3, 2, 1)) == pytest.approx(0.5)
    # eps .1 reaches every term: [.5, .3, .2] -> (.8 / .6 - 1, .7 / .6 - 1, .5 / .4 - 1) = (1/3, 1/6, 1/4),
    # median 1/4
    assert collision_scale(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), eps=0.1) == pytest.approx(0.25)


def test_role_profiles_prior_over_the_phases_that_were_reached():
    # one non-empty phase of two: pi = [0, 1], so P(e) = p[1, e] = [.25, .75] and q_e = [0, 1]
    # (the paper's 1/B over both phases would give P = [.125, .375])
    p = torch.tensor([[0.0, 0.0], [0.25, 0.75]], dtype=torch.float64)
    P_e, q = role_profiles(p)
    assert P_e.tolist() == [0.25, 0.75] and q.tolist() == [[0.0, 1.0], [0.0, 1.0]]
    # no phase reached: everything is zero (no 0 / 0)
    P_e, q = role_profiles(torch.zeros(3, 2, dtype=torch.float64))
    assert P_e.tolist() == [0.0, 0.0] and q.tolist() == [[0.0] * 3, [0.0] * 3]


def test_role_profiles_prior_in_float64():
    # p = identity (expert e only in phase e), prior [.1, .9] as a list: P(e) = prior exactly in
    # float64 (float32 would give 0.10000000149)
    P_e, q = role_profiles(torch.eye(2, dtype=torch.float64), prior=[0.1, 0.9])
    assert P_e.tolist() == [0.1, 0.9] and q.tolist() == [[1.0, 0.0], [0.0, 1.0]]


def test_phase_distributions_of_fractional_counts():
    # counts may be any non-negative numbers: [.25, .5] (total .75) -> [1/3, 2/3]; [0, 0] stays zero
    p = phase_distributions([[0.25, 0.5], [0.0, 0.0]])
    assert p[0].tolist() == pytest.approx([1 / 3, 2 / 3]) and p[1].tolist() == [0.0, 0.0]


def test_normalise_by_max_of_one_expert():
    # N = 1: no pair u != v, so no maximum: the result is zero whatever the (diagonal) entry
    assert normalise_by_max(torch.tensor([[0.5]], dtype=torch.float64)).tolist() == [[0.0]]
    assert normalise_by_max(torch.zeros(1, 1, dtype=torch.float64)).tolist() == [[0.0]]


def _four():
    # d_norm: d01 .1, d23 .2, d02 = d13 .3, d03 = d12 .9; p_ans [.4, .4, .1, .1].
    # Singleton Delta R = min / max: (0,1) 1, (2,3) 1, every other pair .25.
    d = torch.tensor([[0.0, 0.1, 0.3, 0.9], [0.1, 0.0, 0.9, 0.3], [0.3, 0.9, 0.0, 0.2], [0.9, 0.3, 0.2, 0.0]],
                     dtype=torch.float64)
    return d, torch.tensor([0.4, 0.4, 0.1, 0.1], dtype=torch.float64)


def test_agglomerate_collision_term_hand_computed():
    d, p = _four()
    # lam = 0: single linkage alone merges (0,1) at .1, then (2,3) at .2
    assert agglomerate(d, p, 2) == [[0, 1], [2, 3]]
    # c = lam / tau = 1: J = d + Delta R. Step 1: (0,1) 1.1, (2,3) 1.2, (0,2) = (1,3) .55, (0,3) = (1,2) 1.15:
    # the tie (0,2) / (1,3) goes to the smaller members, {0, 2} (sum .5, max .4, R .25). Step 2:
    # ({0,2},1): d .1, Delta R = (.9 / .4 - 1) - .25 = 1 -> 1.1; ({0,2},3): d .2, Delta R = (.6 / .4 - 1) - .25
    # = .25 -> .45; (1,3): .3 + .25 = .55 -> {0, 2, 3}
    assert agglomerate(d, p, 2, lam=1.0, tau=1.0) == [[0, 2, 3], [1]]
    # c = .5 / 2 = .25: step 1: (0,1) .1 + .25 = .35, (0,2) = (1,3) .3625, (2,3) .45 -> {0, 1} (R 1). Step 2:
    # ({0,1},2) = ({0,1},3): d .3, Delta R = (.9 / .4 - 1) - 1 = .25 -> .3625 each; (2,3): .2 + .25 = .45;
    # the tie goes to members [0, 1, 2] -> {0, 1, 2}
    assert agglomerate(d, p, 2, lam=0.5, tau=2.0) == [[0, 1, 2], [3]]


def test_agglomerate_bounds_and_messages():
    d, p = _four()
    assert agglomerate(d, p, 4) == [[0], [1], [2], [3]]   # K = N: nothing merged
    with pytest.raises(ValueError, match=r"^K=5 must be in \[1, N=4\]$"):
        agglomerate(d, p, 5)
    with pytest.raises(ValueError, match=r"^unknown linkage 'ward'"):
        agglomerate(d, p, 2, linkage="ward")
