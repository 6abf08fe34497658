"""Hand-computed cases for rolemerge/model.py, written for the mutants the other RoleMerge tests
let through (`python -m eval.tools.mutation --target rolemerge/model.py`, `--equations` for the
scoring equations alone; see eval/logs/mutation.md): first the scoring equations, then the
grouping functions and `plan`. Every expected number is worked out in the comment above it; where
a case instead compares with the functions `plan` calls, or pins what a seed draws, the comment
says so."""

import math
import re

import numpy as np
import pytest
import torch

from rolemerge.model import (METHODS, _pair_collision, acr, agglomerate, answer_concentration, collision_increment,
                             collision_scale, frequency_groups, kmeans_groups, lance_williams, layer_lambdas,
                             merge_weights, mi_retention, normalise_by_max, pair_loss, partition_score,
                             phase_distributions, plan, prune_groups, role_profiles, swap_search)


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


# ----------------------------------------------------------------------------- the grouping functions
# (the rest of the file: `python -m eval.tools.mutation --target rolemerge/model.py` without --equations)

def test_prune_groups_ranks_in_float64():
    # freq [1, 1 + 1e-9] as Python floats: in float64 expert 1 is used more and is the one kept;
    # in float32 both round to 1.0, the tie goes to the lower index and expert 0 would be kept
    assert prune_groups([1.0, 1.0 + 1e-9], 1) == [[1]]


def test_lance_williams_zeroes_the_merged_diagonal():
    # complete linkage, merge b = 1 into a = 0: row = max(D[0], D[1]) = max([0, .2, .5], [.2, 0, .3])
    # = [.2, .2, .5]; D[0, 0] is then reset to 0, so row / column 0 read [0, .2, .5]
    D = np.array([[0.0, 0.2, 0.5], [0.2, 0.0, 0.3], [0.5, 0.3, 0.0]])
    lance_williams(D, 0, 1, np.ones(3), "complete")
    assert D[0].tolist() == [0.0, 0.2, 0.5]
    assert D[:, 0].tolist() == [0.0, 0.2, 0.5]


def test_mi_retention_sums_over_records():
    # groups {0, 1}, {2}; B = 2 phases, uniform prior 1/2.
    # record r2 = [[1, 1, 0], [0, 0, 2]]: p = [[.5, .5, 0], [0, 0, 1]], joint P(e, b) = [(.25, 0),
    # (.25, 0), (0, .5)], P(B) = (.5, .5): I(S;B) = .25 ln 2 + .25 ln 2 + .5 ln 2 = ln 2; grouped
    # {0, 1} = (.5, 0), {2} = (0, .5): I(C;B) = ln 2.
    # record r1 = [[1, 0, 0], [0, 1, 0]]: joint [(.5, 0), (0, .5), (0, 0)]: I(S;B) = ln 2; grouped
    # {0, 1} = (.5, .5): I(C;B) = 0.
    # Retention over [r2, r1] = (ln 2 + 0) / (ln 2 + ln 2) = .5 (keeping only the last record's
    # numerator: 0; only its denominator: 1)
    r2 = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    r1 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    assert mi_retention([r2, r1], [[0, 1], [2]]) == pytest.approx(0.5)


def test_mi_retention_without_phase_information_is_one():
    # every expert equally used in both phases: q_e = (.5, .5) = P(B), I(S;B) = 0, so the
    # denominator is 0 and the retention is defined as 1.0 (not 0 / 0)
    assert mi_retention([torch.ones(2, 2)], [[0, 1]]) == 1.0


def test_partition_score_defaults_and_float64():
    # default lam = 0: one group {0, 1}, d_01 = .25, p_ans = [.5, .5] (R = 1 / .5 - 1 = 1):
    # J = MST = .25, the collision term is off
    d = torch.tensor([[0.0, 0.25], [0.25, 0.0]], dtype=torch.float64)
    assert partition_score(d, torch.tensor([0.5, 0.5], dtype=torch.float64), [[0, 1]]) == 0.25
    # lists are read in float64: d_01 = .1 (float32 would give 0.10000000149), p = [.1, .7]:
    # R = .8 / (.7 + 1e-12) - 1 = 1/7 (float32: 0.14285718); J = .1 + 1/7
    J = partition_score([[0.0, 0.1], [0.1, 0.0]], [0.1, 0.7], [[0, 1]], lam=1.0)
    assert J == pytest.approx(0.1 + ((0.1 + 0.7) / (0.7 + 1e-12) - 1.0), rel=0, abs=1e-13)


def test_swap_search_default_lam_is_zero():
    # every d = 1, so every partition into pairs has MST 1 + 1; p = [.4, .4, .1, .1]: with the
    # collision term (lam = 1) swapping 0 and 2 would lower R from 1 + 1 to .25 + .25, but the
    # default lam is 0: no swap lowers J
    d = torch.ones(4, 4, dtype=torch.float64)
    p = torch.tensor([0.4, 0.4, 0.1, 0.1], dtype=torch.float64)
    assert swap_search(d, p, [[0, 1], [2, 3]]) == ([[0, 1], [2, 3]], 0)


def test_swap_search_divides_by_tau_and_subtracts_both_costs():
    # d: 0 inside {0, 1} and {2, 3}, .5 across; p = [.4, .4, .1, .1]; R({0, 1}) = R({2, 3}) = 1,
    # after swapping 0 and 2: R({1, 2}) = R({0, 3}) = .5 / .4 - 1 = .25.
    d = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.0, 0.0, 0.5, 0.5],
                      [0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    p = torch.tensor([0.4, 0.4, 0.1, 0.1], dtype=torch.float64)
    # tau = 1: delta J = (.5 + .25) + (.5 + .25) - 1 - 1 = -.5 -> one swap (0 <-> 2, the first
    # of the equal best swaps), after which no swap lowers J
    assert swap_search(d, p, [[0, 1], [2, 3]], lam=1.0, tau=1.0) == ([[0, 3], [1, 2]], 1)
    # tau = 4: delta J = 2 * .5 - 1.5 / 4 = .625 > 0 -> no swap (multiplying by tau: 1 - 6 < 0)
    assert swap_search(d, p, [[0, 1], [2, 3]], lam=1.0, tau=4.0) == ([[0, 1], [2, 3]], 0)


def test_swap_search_ties_keep_the_first_swap():
    # groups {0, 1}, {2}; lam = 0; d_01 = 1, d_02 = d_12 = .5. Swap (0, 2) -> {1, 2} (MST .5) and
    # swap (1, 2) -> {0, 2} (MST .5) both lower J by exactly .5: the first, (0, 2), is made
    d = torch.tensor([[0.0, 1.0, 0.5], [1.0, 0.0, 0.5], [0.5, 0.5, 0.0]], dtype=torch.float64)
    p = torch.zeros(3, dtype=torch.float64)
    assert swap_search(d, p, [[0, 1], [2]]) == ([[0], [1, 2]], 1)


def test_swap_search_reads_lists_in_float64():
    # d as Python floats: d_01 = d_02 = 1, d_12 = 1 - 1e-9: swapping 0 and 2 lowers J by 1e-9 >
    # 1e-12 in float64; in float32 d_12 rounds to 1 and no swap would be made
    d = [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0 - 1e-9], [1.0, 1.0 - 1e-9, 0.0]]
    assert swap_search(d, [0.0, 0.0, 0.0], [[0, 1], [2]]) == ([[0], [1, 2]], 1)
    # p as Python floats, every d = 1, lam = 1, p = [1, 1, 1 + 1e-9, 1 + 1e-9]:
    # R({0, 1}) = 2 / (1 + 1e-12) - 1 ~ 1, R({2, 3}) ~ 1; after 0 <-> 2 each group holds
    # (1, 1 + 1e-9): R = (2 + 1e-9) / (1 + 1e-9) - 1 ~ 1 - 1e-9, so J falls by ~2e-9 (one swap);
    # in float32 every p is 1 and nothing would change
    p = [1.0, 1.0, 1.0 + 1e-9, 1.0 + 1e-9]
    assert swap_search(np.ones((4, 4)), p, [[0, 1], [2, 3]], lam=1.0) == ([[0, 3], [1, 2]], 1)


def test_frequency_groups_anchors_are_the_most_used():
    # freq [1, 5, 3], K = 2: the most used are experts 1 and 2 (anchors), expert 0 joins the
    # anchor of higher cosine: r0 = (1, 0), r1 = (0, 1), r2 = (1, .1): cos(0, 1) = 0,
    # cos(0, 2) = 1 / sqrt(1.01) ~ .995 -> {0, 2}, {1}. (The least used as anchors, {0, 2}, would
    # give {0}, {1, 2}.)
    assert frequency_groups([1.0, 5.0, 3.0], [[1.0, 0.0], [0.0, 1.0], [1.0, 0.1]], 2) == [[0, 2], [1]]
    # freq [1, 5, 3] again with r0 = (1, 2), r1 = (0, 1), r2 = (1, 0): anchors {1, 2};
    # cos(0, 1) = 2 / sqrt 5 ~ .894 > cos(0, 2) = 1 / sqrt 5 -> {0, 1}, {2}. (The first K indices
    # as anchors, {0, 1}, would give {0, 2}, {1}: cos(2, 0) = .447 > cos(2, 1) = 0.)
    assert frequency_groups([1.0, 5.0, 3.0], [[1.0, 2.0], [0.0, 1.0], [1.0, 0.0]], 2) == [[0, 1], [2]]


def test_frequency_groups_uses_the_cosine_of_router_rows():
    # freq [3, 2, 1], K = 2: anchors 0 and 1. r0 = (10, 10) (long, 45 degrees), r1 = (1, .1),
    # r2 = (1, 0): cos(2, 0) = .707, cos(2, 1) = 1 / sqrt(1.01) ~ .995 -> {0}, {1, 2}.
    # A raw dot product (one norm for the whole matrix) gives 10 > 1 -> {0, 2}, {1}; columns
    # normalised instead of rows: w2 . w0 ~ .098 > w2 . w1 ~ .0098 -> {0, 2}, {1}
    assert frequency_groups([3.0, 2.0, 1.0], [[10.0, 10.0], [1.0, 0.1], [1.0, 0.0]], 2) == [[0], [1, 2]]


def test_frequency_groups_reads_lists_in_float64():
    # freq [2, 1, 1 + 1e-9]: in float64 the anchors are 0 and 2 (float32: 1 + 1e-9 = 1, the tie
    # goes to index 1); r0 = (1, 0), r1 = (2, 1), r2 = (0, 1): expert 1 joins 0 (cos 2 / sqrt 5 ~
    # .894 > 1 / sqrt 5) -> {0, 1}, {2} (with anchors 0 and 1, expert 2 would join 1: {0}, {1, 2})
    assert frequency_groups([2.0, 1.0, 1.0 + 1e-9], [[1.0, 0.0], [2.0, 1.0], [0.0, 1.0]], 2) == [[0, 1], [2]]
    # router as Python floats: anchors 0 and 1 (freq [3, 2, 1]), r0 = (1, 0), r1 = (0, 1),
    # r2 = (1, 1 + 1e-9): in float64 r2 is a hair closer to r1 -> {0}, {1, 2}; in float32 r2 =
    # (1, 1) ties and would go to the lower anchor 0
    assert frequency_groups([3.0, 2.0, 1.0], [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0 + 1e-9]], 2) == [[0], [1, 2]]


def test_kmeans_groups_k_bounds_and_message():
    # K = 1: one group of everything; K = N: singletons; K = 0 and K = N + 1 are refused
    x = torch.tensor([[0.0], [1.0], [2.0]], dtype=torch.float64)
    assert kmeans_groups(x, 1) == [[0, 1, 2]]
    assert kmeans_groups(x, 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match=r"^K=0 must be in \[1, N=3\]$"):
        kmeans_groups(x, 0)
    with pytest.raises(ValueError, match=r"^K=4 must be in \[1, N=3\]$"):
        kmeans_groups(x, 4)


def test_kmeans_groups_init_has_k_centres():
    # two pairs 100 apart, K = 2, one Lloyd step (iters=1: the groups are the Voronoi cells of
    # the k-means++ centres). The first centre lies in one pair; the second is drawn with
    # probability d^2: the other pair's points weigh ~1e4 each, the partner .01, so it lies in the
    # other pair (but for a 1-in-2e6 draw): groups {0, 1}, {2, 3} for every seed. (K + 2 centres
    # leave points in the extra cells out of the K groups; K - 1 centres put all four in one cell
    # and move only the farthest point out.)
    x = torch.tensor([[0.0], [0.1], [100.0], [100.1]], dtype=torch.float64)
    for seed in range(10):
        assert kmeans_groups(x, 2, seed=seed, iters=1) == [[0, 1], [2, 3]]


def test_kmeans_groups_seeding_draws_with_probability_d_squared():
    # x = 0, .1, .3, K = 2, iters=1. The groups are {0}, {1, 2} only when the centres are
    # {0, .1}: first centre 0 (p 1/3), d^2 = (0, .01, .09): .1 drawn with p .01 / .1 = 1/10;
    # first centre .1 (p 1/3), d^2 = (.01, 0, .04): 0 drawn with p .01 / .05 = 1/5; first
    # centre .3: never. P = (1/10 + 1/5) / 3 = .1, so ~100 of 1000 seeds (sd ~9.5).
    # With d^3: (1/28 + 1/9) / 3 = .049; the centres' own d set to 1 instead of 0: ~.3 (an
    # existing centre drawn again); the all-duplicates branch taken for sums <= 1: 2/3.
    x = torch.tensor([[0.0], [0.1], [0.3]], dtype=torch.float64)
    n = sum(kmeans_groups(x, 2, seed=s, iters=1) == [[0], [1, 2]] for s in range(1000))
    assert 70 <= n <= 130


def test_kmeans_groups_centres_are_their_cluster_means():
    # three pairs at the corners (0, 0), (10, 0), (0, 10) of a triangle, K = 3: k-means++ puts
    # one centre in each pair (the partner weighs .01 against ~100), each centre moves to its
    # pair's mean and the pairs are the fixed point. (Centres at the mean of the OTHER clusters
    # would pull (0, 0) and (0, .1) apart.)
    x = torch.tensor([[0.0, 0.0], [0.0, 0.1], [10.0, 0.0], [10.0, 0.1], [0.0, 10.0], [0.1, 10.0]],
                     dtype=torch.float64)
    for seed in range(5):
        assert kmeans_groups(x, 3, seed=seed) == [[0, 1], [2, 3], [4, 5]]


def test_kmeans_groups_default_seed_and_float64():
    # 1-d points 7.2, 4.7, 9.7, 3.1, 6.6, K = 2 end in different local optima for different
    # k-means++ draws: seed 0 gives {9.7} vs the rest, seed 1 {7.2, 9.7, 6.6} vs {4.7, 3.1};
    # the default seed is 0
    x = torch.tensor([[7.2], [4.7], [9.7], [3.1], [6.6]], dtype=torch.float64)
    assert kmeans_groups(x, 2) == kmeans_groups(x, 2, seed=0) == [[0, 1, 3, 4], [2]]
    assert kmeans_groups(x, 2, seed=1) == [[0, 2, 4], [1, 3]]
    # a list is read in float64: the same draws and groups as the float64 tensor (seed 3:
    # {7.2, 9.7} vs the rest); read in float32, the d^2 weights change and seed 3 draws the
    # centres of {9.7} vs the rest
    assert kmeans_groups(x.tolist(), 2, seed=3) == kmeans_groups(x, 2, seed=3) == [[0, 2], [1, 3, 4]]


def test_swap_search_needs_a_gain_above_1e12():
    # groups {0, 1}, {2}; d_01 = d_02 = 1e-12, d_12 = 0. Swap (0, 2) -> {1, 2}, {0}: J falls from
    # 1e-12 to 0, a gain of exactly 1e-12, which is not more than 1e-12: no swap
    d = torch.tensor([[0.0, 1e-12, 1e-12], [1e-12, 0.0, 0.0], [1e-12, 0.0, 0.0]], dtype=torch.float64)
    assert swap_search(d, torch.zeros(3, dtype=torch.float64), [[0, 1], [2]]) == ([[0, 1], [2]], 0)


# ----------------------------------------------------------------------------- plan

# one layer, B = 2 (question, answer), N = 3: expert 0 only in questions, 1 only in answers, 2 in both
TRIO = [[[2.0, 0.0, 1.0], [0.0, 2.0, 1.0]]]


def test_plan_messages():
    c = torch.tensor(TRIO)
    with pytest.raises(ValueError, match="^" + re.escape(f"unknown method 'nope'; choose from {METHODS}") + "$"):
        plan(c, 2, method="nope")
    with pytest.raises(ValueError, match=re.escape("unknown linkage 'ward'; choose from ('single', 'average', "
                                                   "'complete')")):
        plan(c, 2, linkage="ward")
    for K, shown in (([2, 2], "[2, 2]"), (True, "True"), (2.5, "2.5")):
        msg = (f"K must be one int for every layer, got {shown}: per-layer K is not supported "
               f"(a transformers config holds a single expert count)")
        with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
            plan(c, K)
    with pytest.raises(ValueError, match="^" + re.escape("method 'msmoe' groups from calibration features, not "
                                                         "counts: rolemerge.baselines.plan_groups") + "$"):
        plan(c, 2, method="msmoe")
    with pytest.raises(ValueError, match="^" + re.escape("method 'frequency' needs the router weights "
                                                         "(routers=[...])") + "$"):
        plan(c, 2, method="frequency")


def test_plan_hand_computed_layer_and_info():
    # p = [[2/3, 0, 1/3], [0, 2/3, 1/3]], uniform prior: q_0 = (1, 0), q_1 = (0, 1), q_2 = (.5, .5),
    # P(e) = 1/3 each; d(0, 1) is the largest (-> 1 after normalising), d(0, 2) = d(1, 2) by symmetry.
    # p_ans = (0, 2/3, 1/3): kappa = 1 - H / ln 3, H = -(2/3 ln 2/3 + 1/3 ln 1/3); singleton
    # Delta R: (1, 2): 1 / (2/3) - 1 = .5, the pairs with expert 0: (2/3 or 1/3) / (itself + 1e-12)
    # - 1 < 0 -> 0; tau = median of the positive ones = .5; one layer: lambda = .03 (the default).
    # J(0, 2) = d + (.03 / .5) * 0 < J(1, 2) = d + .06 * .5: experts 0 and 2 merge
    H = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    groups, info = plan(torch.tensor(TRIO), 2)
    assert groups == [[[0, 2], [1]]]
    assert info == [{"kappa": pytest.approx(1 - H / math.log(3)), "lambda": pytest.approx(0.03),
                     "tau": pytest.approx(0.5)}]
    # counts as Python floats are read in float64: expert masses 2 and 2 + 1e-9 (float32: a tie
    # that the lower index would win); pruning to one expert keeps expert 1
    assert plan([[[1.0, 1.0], [1.0, 1.0 + 1e-9]]], 1, method="prune")[0] == [[[1]]]


def test_plan_no_phase_split_pools_the_buckets():
    # TRIO pooled: every expert has mass 2 in each bucket, so every RRP is (.5, .5) and d = 0;
    # p_ans = (1/3, 1/3, 1/3): every pair has Delta R = (2/3) / (1/3) - 1 = 1 (tau = 1): all J tie,
    # and so do d, Delta R and the sizes: the lowest indices (0, 1) merge (with the split: {0, 2})
    assert plan(torch.tensor(TRIO), 2, method="no_phase_split")[0] == [[[0, 1], [2]]]


def test_plan_empirical_prior_uses_the_phase_token_shares():
    # counts [[2, 0, 1], [0, 4, 2]]: p is TRIO's, [[2/3, 0, 1/3], [0, 2/3, 1/3]], but there are 3
    # question and 6 answer tokens: prior (1/3, 2/3). P(e, b): e0 (2/9, 0), e1 (0, 4/9),
    # e2 (1/9, 2/9); P(e) = 2/9, 4/9, 3/9; q_0 = (1, 0), q_1 = (0, 1), q_2 = (1/3, 2/3).
    # d(1, 2): m = (1/7, 6/7); 4/9 ln(7/6) + 3/9 [1/3 ln(7/3) + 2/3 ln(7/9)] = .0685 + .0383 = .1068
    # d(0, 2): m = (3/5, 2/5); 2/9 ln(5/3) + 3/9 [1/3 ln(5/9) + 2/3 ln(5/3)] = .1135 + .0482 = .1617
    # d(0, 1): m = (1/3, 2/3); 2/9 ln 3 + 4/9 ln(3/2) = .2441 + .1802 = .4243 (the maximum)
    # normalised: d(1, 2) = .2517, d(0, 2) = .3811. p_ans, tau = .5 and lambda = .03 are TRIO's (c = .06):
    # J(1, 2) = .2517 + .06 * .5 = .2817 < J(0, 2) = .3811 + 0: {0}, {1, 2}. With the uniform prior
    # d(0, 2) = d(1, 2) and the collision term picks {0, 2} (as for TRIO).
    c = torch.tensor([[[2.0, 0.0, 1.0], [0.0, 4.0, 2.0]]])
    assert plan(c, 2, method="empirical_prior")[0] == [[[0], [1, 2]]]
    assert plan(c, 2)[0] == [[[0, 2], [1]]]


def test_plan_permuted_and_kmeans_use_the_seed():
    # permuted: the rolemerge plan of the counts with their expert columns permuted by
    # torch.randperm(N) under the seed (default 0); seeds 0 and 1 differ here
    c = torch.tensor([[[4.0, 6.0, 6.0, 6.0], [0.0, 2.0, 0.0, 3.0]]])
    for seed in (0, 1):
        perm = torch.randperm(4, generator=torch.Generator().manual_seed(seed))
        assert plan(c, 3, method="permuted", seed=seed)[0] == plan(c[:, :, perm], 3)[0]
    assert plan(c, 3, method="permuted")[0] == plan(c, 3, method="permuted", seed=0)[0] != \
        plan(c, 3, method="permuted", seed=1)[0]
    # kmeans: k-means++ on the RRPs with the plan's seed (seeds 0 and 1 differ here)
    c = torch.tensor([[[6.0, 3.0, 3.0, 5.0, 1.0, 2.0], [4.0, 5.0, 6.0, 5.0, 5.0, 2.0]]])
    q = role_profiles(phase_distributions(c[0]))[1]
    assert plan(c, 2, method="kmeans", seed=1)[0] == [kmeans_groups(q, 2, seed=1)]
    assert kmeans_groups(q, 2, seed=1) != kmeans_groups(q, 2, seed=0)


def test_plan_passes_the_linkage():
    # complete linkage gives another grouping than single here; plan's is agglomerate's
    c = torch.tensor([[[0.0, 3.0, 6.0, 4.0, 5.0], [0.0, 1.0, 5.0, 5.0, 6.0]]])
    p = phase_distributions(c[0])
    d = normalise_by_max(pair_loss(*role_profiles(p)))
    groups, info = plan(c, 3, linkage="complete")
    assert groups == [agglomerate(d, p[-1], 3, info[0]["lambda"], info[0]["tau"], "complete")]
    assert groups != plan(c, 3)[0]


def test_plan_search_depth_and_block_sums():
    # Greedy+1Swap stops after one swap where Greedy+SwapC makes two
    c = torch.tensor([[[2.0, 1.0, 1.0, 9.0, 2.0, 8.0, 5.0, 1.0, 6.0, 8.0],
                       [3.0, 0.0, 8.0, 8.0, 6.0, 6.0, 4.0, 0.0, 8.0, 5.0],
                       [5.0, 4.0, 9.0, 5.0, 1.0, 0.0, 5.0, 5.0, 5.0, 4.0]]])
    assert plan(c, 3, method="greedy_swapc", lam=1.0)[1][0]["swaps"] == 2
    assert plan(c, 3, method="greedy_1swap", lam=1.0)[1][0]["swaps"] == 1
    # two identical routing blocks (the same six experts twice): d between the copies repeats the
    # within-block values, so both blocks solve the same problem and info sums two equal halves:
    # swaps 1 + 1, J_greedy and J twice one block's
    one = torch.tensor([[[6.0, 7.0, 7.0, 9.0, 5.0, 8.0], [9.0, 9.0, 1.0, 9.0, 8.0, 8.0],
                         [7.0, 6.0, 7.0, 2.0, 6.0, 6.0]]])
    c = torch.cat([one, one], -1)
    groups, info = plan(c, 8, method="greedy_1swap", lam=1.0, blocks=2)
    p = phase_distributions(c[0])
    d = normalise_by_max(pair_loss(*role_profiles(p)))[:6, :6]
    lam, tau = info[0]["lambda"], info[0]["tau"]
    g0 = agglomerate(d, p[-1, :6], 4, lam, tau)
    g1, n = swap_search(d, p[-1, :6], g0, lam, tau, 1)
    assert n == 1 and info[0]["swaps"] == 2
    assert info[0]["J_greedy"] == pytest.approx(2 * partition_score(d, p[-1, :6], g0, lam, tau))
    assert info[0]["J"] == pytest.approx(2 * partition_score(d, p[-1, :6], g1, lam, tau))
    assert groups == [g1 + [[e + 6 for e in g] for g in g1]]


# ----------------------------------------------------------------------------- agglomerate

def _sym(n, pairs, fill):
    """[n, n] float64 with d[i, j] = d[j, i] = pairs[(i, j)] and `fill` on the other off-diagonal cells."""
    d = torch.full((n, n), fill, dtype=torch.float64)
    d.fill_diagonal_(0.0)
    for (i, j), v in pairs.items():
        d[i, j] = d[j, i] = v
    return d


def test_agglomerate_tie_breaks_size_then_members():
    # lam = 0 (J = d_role), p_ans = 0 (every Delta R = 0). d_23 = .1, every other pair .5.
    # Step 1 merges {2, 3}. Step 2: (0, 1), (0, {2, 3}), (1, {2, 3}) tie on d_role .5 and on
    # Delta R 0; sizes 2, 3, 3: (0, 1) merges (the size difference would pick (0, {2, 3}))
    assert agglomerate(_sym(4, {(2, 3): 0.1}, 0.5), torch.zeros(4, dtype=torch.float64), 2) == [[0, 1], [2, 3]]
    # d_03 = d_12 = .1, the rest .5, K = 3: (0, 3) and (1, 2) tie on d, Delta R and size; sorted
    # members [0, 3] < [1, 2]: {0, 3} merges (keying on the second group alone would pick {1, 2})
    d = _sym(4, {(0, 3): 0.1, (1, 2): 0.1}, 0.5)
    assert agglomerate(d, torch.zeros(4, dtype=torch.float64), 3) == [[0, 3], [1], [2]]


def test_agglomerate_merged_group_answer_mass():
    # p_ans = [.3, .1, .3, 0], lam = .12, tau = 1; d_01 = .1, d_02 = d_12 = .4, d_23 = .5,
    # d_03 = d_13 = .9.
    # Step 1: J(0, 1) = .1 + .12 * (.4 / .3 - 1) = .14, the smallest (J(1, 2) = .4 + .04, J(2, 3) = .5).
    # The merged group: s = .4, m = .3, R = 1/3.
    # Step 2: J({0, 1}, 2) = .4 + .12 * [(.7 / .3 - 1) - 1/3 - 0] = .4 + .12 * 1 = .52,
    # J(2, 3) = .5 + .12 * 0 = .5, J({0, 1}, 3) = .9: {2, 3} merges.
    # (A merged mass s = .3 - .1 = .2, R = 0, gives J({0, 1}, 2) = .4 + .12 * (.5 / .3 - 1) = .48
    # and merges 2 into {0, 1}; R's -1 written as -2 gives .4 + .12 * (1/3 - 1/3) = .4, the same.)
    d = _sym(4, {(0, 1): 0.1, (0, 2): 0.4, (1, 2): 0.4, (2, 3): 0.5}, 0.9)
    p = torch.tensor([0.3, 0.1, 0.3, 0.0], dtype=torch.float64)
    assert agglomerate(d, p, 2, lam=0.12, tau=1.0) == [[0, 1], [2, 3]]


def test_agglomerate_delta_r_row_eps_sign():
    # lam = 0, p_ans = [.5, 0, 0, 0, 0]; d_01 = d_34 = .1, d_02 = d_12 = d_23 = d_24 = .5, the rest .9.
    # Merges (0, 1) and (3, 4) (d .1); then ({0, 1}, 2) and (2, {3, 4}) tie on d .5. Delta R of
    # ({0, 1}, 2) = [.5 / (.5 + 1e-12) - 1]_+ - 0 - 0 = 0, as for (2, {3, 4}); sizes 3 and 3; members
    # [0, 1, 2] < [2, 3, 4]: {0, 1, 2}. (With .5 - 1e-12 in the denominator that Delta R is +2e-12
    # and (2, {3, 4}) would merge.)
    d = _sym(5, {(0, 1): 0.1, (3, 4): 0.1, (0, 2): 0.5, (1, 2): 0.5, (2, 3): 0.5, (2, 4): 0.5}, 0.9)
    p = torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert agglomerate(d, p, 2) == [[0, 1, 2], [3, 4]]


def test_agglomerate_default_tau_and_float64():
    # default tau = 1: lam = 1, p_ans = [.5, 0, .5]; d_01 = .7, d_02 = 0, d_12 = 1.
    # Delta R(0, 1) = [.5 / (.5 + 1e-12) - 1]_+ = 0, Delta R(0, 2) = 1 / .5 - 1 = 1:
    # J(0, 1) = .7 < J(0, 2) = 0 + 1 / 1 (tau 2 would give .5 < .7 and merge 0 with 2)
    d = _sym(3, {(0, 1): 0.7, (0, 2): 0.0, (1, 2): 1.0}, 0.0)
    assert agglomerate(d, torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64), 2, lam=1.0) == [[0, 1], [2]]
    # d as an int64 tensor, average linkage, p = 0, lam = 0: d_01 = 1, d_02 = 2, d_12 = 3,
    # d_03 = d_13 = 2, d_23 = 9. (0, 1) merge; then d({0, 1}, 2) = (2 + 3) / 2 = 2.5 and
    # d({0, 1}, 3) = (2 + 2) / 2 = 2: {0, 1, 3}. (Kept in int64, 2.5 is stored as 2, the tie goes
    # to the lower members and 2 would join.)
    d = torch.tensor([[0, 1, 2, 2], [1, 0, 3, 2], [2, 3, 0, 9], [2, 2, 9, 0]])
    assert agglomerate(d, torch.zeros(4, dtype=torch.float64), 2, linkage="average") == [[0, 1, 3], [2]]
    # p as a float32 tensor, lam = 1: p = [1, 2^-30, 2^-30, 0] (exact in float32); d_01 = .1,
    # d_02 = d_03 = d_12 = d_13 = .5, d_23 = .9. (0, 1) merge: s = 1 + 2^-30 in float64 (float32: 1).
    # Delta R({0, 1}, 2) = (s + 2^-30) / (1 + 1e-12) - 1 - R({0, 1}) ~ 2^-30 > 0 = Delta R({0, 1}, 3):
    # 3 joins. (Summed in float32 both are 0, the tie goes to the lower members and 2 would join.)
    d = _sym(4, {(0, 1): 0.1, (2, 3): 0.9}, 0.5)
    p = torch.tensor([1.0, 2.0 ** -30, 2.0 ** -30, 0.0], dtype=torch.float32)
    assert agglomerate(d, p, 2, lam=1.0) == [[0, 1, 3], [2]]


def test_agglomerate_delta_r_row_subtracts_both_groups_r():
    # lam = .1, tau = 1, p_ans = .2 on experts 0-3 and 0 on expert 4. A merged pair of .2's has
    # s = .4, m = .2, R = 1; two merged pairs: [.8 / .2 - 1] - 1 - 1 = 1.
    # d_01 = .1, d_23 = .05, d between {0, 1} and {2, 3} .3, d_04 = d_14 = .5, d_24 = d_34 = .6.
    # Step 1: J(2, 3) = .05 + .1 * 1 = .15 < J(0, 1) = .2. Step 2: J(0, 1) = .2 (J(0, {2, 3}) = .3 +
    # .1 * [(.6 / .2 - 1) - 0 - 1] = .4). Step 3, Delta R row of the merged {0, 1} (index 0) against
    # {2, 3} (index 2, to its right): J({0, 1}, {2, 3}) = .3 + .1 * 1 = .4 < J({0, 1}, 4) = .5 + .1 *
    # [(.4 / .2 - 1) - 1 - 0] = .5 < J({2, 3}, 4) = .6: {0, 1, 2, 3}, {4}. (Adding R of the right group
    # instead of subtracting it gives .6 and {0, 1, 4}.)
    p = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.0], dtype=torch.float64)
    cross = {(i, j): 0.3 for i in (0, 1) for j in (2, 3)}
    d = _sym(5, {(0, 1): 0.1, (2, 3): 0.05, **cross, (0, 4): 0.5, (1, 4): 0.5, (2, 4): 0.6, (3, 4): 0.6}, 0.0)
    assert agglomerate(d, p, 2, lam=0.1) == [[0, 1, 2, 3], [4]]
    # the same with d_01 = .1 = d_23 (the tie merges {0, 1} first, lower members), so the second
    # merge is {2, 3} (index 2) and its row reads {0, 1} to its left: the same 1 - 1 - 1, same groups
    d = _sym(5, {(0, 1): 0.1, (2, 3): 0.1, **cross, (0, 4): 0.5, (1, 4): 0.5, (2, 4): 0.6, (3, 4): 0.6}, 0.0)
    assert agglomerate(d, p, 2, lam=0.1) == [[0, 1, 2, 3], [4]]
    # a merged group with a singleton to its left: p_ans = [.2, 0, .2, .2], d_23 = .1, d_02 = d_03 =
    # .3, d_01 = .5, d_12 = d_13 = .9, lam = .1. Step 1: {2, 3} (J = .1 + .1 * 1 = .2). Step 2:
    # J(0, {2, 3}) = .3 + .1 * [(.6 / .2 - 1) - 0 - 1] = .4 < J(0, 1) = .5 + .1 * 0: {0, 2, 3}, {1}.
    # (Adding the merged group's R gives .3 + .1 * 3 = .6 and {0, 1}.)
    p = torch.tensor([0.2, 0.0, 0.2, 0.2], dtype=torch.float64)
    d = _sym(4, {(2, 3): 0.1, (0, 2): 0.3, (0, 3): 0.3, (0, 1): 0.5}, 0.9)
    assert agglomerate(d, p, 2, lam=0.1) == [[0, 2, 3], [1]]


def test_kmeans_groups_never_empties_a_cluster_on_duplicate_rows():
    """A bug the mutation pass found: an emptied cluster took the farthest point even when that
    point was alone in its own cluster, so duplicate rows (zero-mass experts share the all-zero
    profile) gave an empty group, e.g. [[5], [0], [0], [0]] with K = 3 and one iteration gave
    [[], [0], [1, 2, 3]]. Every result must be K non-empty groups covering 0..N-1 once."""
    cases = [([[5.0], [0.0], [0.0], [0.0]], 3, s, it) for s in range(20) for it in (1, 2, 50)]
    cases += [([[3.0], [3.0], [2.0], [3.0], [2.0], [1.0]], 5, s, it) for s in range(20) for it in (1, 50, 51)]
    cases += [([[0.0, 0.0]] * 4 + [[1.0, 1.0]], 4, s, 50) for s in range(10)]
    for x, K, seed, iters in cases:
        groups = kmeans_groups(x, K, seed=seed, iters=iters)
        assert len(groups) == K and all(groups), (x, K, seed, iters, groups)
        assert sorted(i for g in groups for i in g) == list(range(len(x))), (x, K, seed, iters, groups)


# 60 points between a block of ten 0s and a block of ten 100s, placed so that k-means (K = 2) moves
# exactly one of them from the right cluster to the left one per Lloyd step (constructed with a small
# numpy script: each point lies between two consecutive boundaries of the sequence below).
_KMEANS_CHAIN = [26.9, 28.3, 29.7, 30.9, 32.0, 33.0, 34.0, 34.9, 35.7, 36.5, 37.2, 37.9, 38.6, 39.2, 39.9, 40.5,
                 41.0, 41.6, 42.2, 42.7, 43.2, 43.7, 44.2, 44.7, 45.2, 45.7, 46.2, 46.7, 47.1, 47.6, 48.1, 48.6,
                 49.0, 49.5, 50.0, 50.5, 51.0, 51.5, 52.0, 52.5, 53.0, 53.5, 54.0, 54.6, 55.2, 55.8, 56.4, 57.0,
                 57.6, 58.3, 59.0, 59.8, 60.6, 61.4, 62.3, 63.3, 64.3, 65.5, 66.7, 68.1]


def test_kmeans_groups_default_runs_50_lloyd_steps():
    # x = ten 0s, the 60 chain points c_1 < ... < c_60, ten 100s (indices 0-9, 10-69, 70-79), K = 2.
    # With the 0s and c_1..c_j on the left and the rest on the right, the boundary
    # b_j = (mean left + mean right) / 2 lies strictly between c_{j+1} and c_{j+2} (margin >= .19 for
    # every j; e.g. j = 0: b_0 = (0 + (sum c + 1000) / 70) / 2 = 27.615, between 26.9 and 28.3), so each
    # Lloyd step moves exactly c_{j+1} to the left. Seed 0 draws index 44 (c_35 = 50.0) then index 1
    # (a 0; torch's generator, pinned): step 1 splits at 25, leaving only the 0s on the left, and step t
    # leaves the 0s and c_1..c_{t-1} there. The default 50 steps end at 10 + 49 = 59 points on the left
    # (51 would give 60); the assignment first repeats at step 62 (all 70 on the left).
    x = [[0.0]] * 10 + [[c] for c in _KMEANS_CHAIN] + [[100.0]] * 10
    assert kmeans_groups(x, 2) == [list(range(59)), list(range(59, 80))]
    assert [len(kmeans_groups(x, 2, iters=t)[0]) for t in (1, 2, 49, 51, 60, 61, 80)] == [10, 11, 58, 60, 69, 70, 70]


# Twelve points in 4-d (integers, found by maximising the smallest margin of the three steps below over
# the coordinates, then scaled by 200 and rounded) on which one Lloyd step moves EVERY point to another
# cluster. At the second iteration this cannot happen when the K seeds are distinct rows (exact arithmetic;
# the proof is in eval/logs/mutation.md, "kmeans_groups__mutmut_96 killed"), so the case needs three steps.
_KMEANS_ALL_MOVE = [[38, -70, 78, 38], [33, -86, 72, 25], [-169, -25, -59, 85], [30, -14, -11, -32],
                    [30, -14, -11, -32], [16, -27, 118, 69], [132, -71, 36, -41], [-50, 146, -12, -126],
                    [-25, 92, -110, -48], [75, -44, -44, 43], [-58, -2, -65, 146], [-52, 115, 9, -125]]


def test_kmeans_groups_stops_only_on_a_repeated_assignment():
    # K = 4, seed 63451: k-means++ draws x1, x0, x6, x5 (torch's generator, pinned; x_i is row i).
    # Step 1, nearest seed (every gap between the nearest and the next squared distance >= 186):
    #   labels [1, 0, 0, 0, 0, 3, 2, 3, 2, 1, 3, 1]; means c0 = (-19, -139/4, -9/4, 23/2) of x1-x4,
    #   c1 = (61/3, 1/3, 43/3, -44/3) of x0, x9, x11, c2 = (107/2, 21/2, -37, -89/2) of x6, x8,
    #   c3 = (-92/3, 39, 41/3, 89/3) of x5, x7, x10.
    # Step 2 (gaps >= 356): labels [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3]; means m0 = (-98/3, -181/3, 91/3,
    #   148/3), m1 = (76/3, -55/3, 32, 5/3), m2 = (33, 123/4, -65/2, -43), m3 = (-55, 113/2, -28, 21/2).
    # Step 3: every point is nearer another mean than its own (squared distances, own -> nearest):
    #   x0 0: 67390/9 = 7487.8 -> 1: 6266; x1 0: 7299.1 -> 1: 6782; x2 0: 29087.8 -> 3: 26149.5;
    #   x3, x4 1: 3023 -> 2: 2594.8; x5 1: 12092 -> 0: 11551.8; x6 2: 24850.3 -> 1: 15988;
    #   x7 2: 27480.8 -> 3: 26923.5; x8 2: 13146.8 -> 3: 12306.5; x9 2: 14879.8 -> 1: 10610;
    #   x10 3: 23160.5 -> 0: 22477.4; x11 3: 23160.5 -> 2: 22769.3.
    #   Labels [1, 1, 3, 2, 2, 0, 1, 3, 3, 1, 0, 2]: not a repeat, so the loop goes on (a loop that also
    #   stopped when every point moved would return step 2's groups here).
    # Steps 4-6 move x2, then x5 and x11, then x9; step 7 repeats step 6: {0, 1, 5, 6}, {2, 10}, {3, 4, 9},
    # {7, 8, 11}.
    x = [[float(v) for v in row] for row in _KMEANS_ALL_MOVE]
    assert kmeans_groups(x, 4, seed=63451, iters=1) == [[0, 9, 11], [1, 2, 3, 4], [5, 7, 10], [6, 8]]
    assert kmeans_groups(x, 4, seed=63451, iters=2) == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9], [10, 11]]
    assert kmeans_groups(x, 4, seed=63451, iters=3) == [[0, 1, 6, 9], [2, 7, 8], [3, 4, 11], [5, 10]]
    assert kmeans_groups(x, 4, seed=63451) == [[0, 1, 5, 6], [2, 10], [3, 4, 9], [7, 8, 11]]
