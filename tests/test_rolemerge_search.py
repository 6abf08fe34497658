"""Table 15 panel A's search-depth variants (rolemerge/model.py: mst_weight, partition_score,
swap_search, plan's greedy_1swap / greedy_swapc) against hand-computed cases."""
import itertools

import numpy as np
import pytest
import torch

from helpers import tol
from rolemerge import model as rm

# 5 experts; d_norm = integer matrix / 5; p_ans = (2, 1, 1, 1, 1) / 6; lambda / tau = 2, K = 3
D5 = torch.tensor([[0, 5, 4, 4, 4],
                   [5, 0, 4, 3, 4],
                   [4, 4, 0, 5, 4],
                   [4, 3, 5, 0, 1],
                   [4, 4, 4, 1, 0]], dtype=torch.float64) / 5
P5 = torch.tensor([2, 1, 1, 1, 1], dtype=torch.float64) / 6


def test_mst_weight_hand_values():
    d = D5.numpy()
    assert rm.mst_weight(d, [2]) == 0.0
    assert rm.mst_weight(d, [3, 4]) == pytest.approx(.2)
    # {0, 1, 2}: edges .8 (0-2), .8 (1-2), 1.0 (0-1) -> tree .8 + .8
    assert rm.mst_weight(d, [0, 1, 2]) == pytest.approx(1.6)
    # {0, 3, 4}: .2 (3-4) + .8 (0-3 or 0-4)
    assert rm.mst_weight(d, [4, 0, 3]) == pytest.approx(1.0)


def test_partition_score_hand_value():
    # R({0,1,2}) = (4/6) / (2/6) - 1 = 1; singletons 0 -> J = 1.6 + 2 * 1
    assert rm.partition_score(D5, P5, [[0, 1, 2], [3], [4]], lam=2.0) == pytest.approx(3.6)
    # tau divides the collision term only
    assert rm.partition_score(D5, P5, [[0, 1, 2], [3], [4]], lam=2.0, tau=4.0) == pytest.approx(1.6 + .5)
    # lam = 0: the single-linkage (MST) part alone
    assert rm.partition_score(D5, P5, [[0, 3, 4], [1], [2]], lam=0.0) == pytest.approx(1.0)


def test_greedy_then_one_swap_then_convergence_hand_case():
    # greedy (J = d + 2 dR): pairs with expert 0 cost d + 2 * .5 (p 2/6 vs 1/6), the others d + 2 * 1,
    # so (0,2) at .8 + 1 = 1.8 (ties (0,3), (0,4) broken by indices); then {0,2} + {1} at
    # min(1, .8) + 2 * (1 - .5) = 1.8 (ties with {3}, {4} broken by indices) -> [[0,1,2],[3],[4]], J = 3.6
    g = rm.agglomerate(D5, P5, 3, lam=2.0, tau=1.0)
    assert g == [[0, 1, 2], [3], [4]]
    # best single swap: 2 <-> 3 gives {0,1,3}: tree .6 (1-3) + .8 (0-3), R = 1 -> 3.4 (every other swap >= 3.6)
    g1, n1 = rm.swap_search(D5, P5, g, lam=2.0, tau=1.0, max_swaps=1)
    assert (g1, n1) == ([[0, 1, 3], [2], [4]], 1)
    assert rm.partition_score(D5, P5, g1, 2.0) == pytest.approx(3.4)
    # to convergence: then 1 <-> 4 gives {0,3,4}: tree .2 + .8, R = 1 -> 3.0, and no swap lowers it further
    gc, nc = rm.swap_search(D5, P5, g, lam=2.0, tau=1.0, max_swaps=None)
    assert (gc, nc) == ([[0, 3, 4], [1], [2]], 2)
    assert rm.partition_score(D5, P5, gc, 2.0) == pytest.approx(3.0)
    # it is the best of all 10 partitions with sizes (3, 1, 1)
    best = min(rm.partition_score(D5, P5, [list(t)] + [[e] for e in range(5) if e not in t], 2.0)
               for t in itertools.combinations(range(5), 3))
    assert best == pytest.approx(3.0)


def test_swaps_keep_group_sizes_and_never_raise_the_score():
    g = torch.Generator().manual_seed(0)
    for trial in range(5):
        d = torch.rand(8, 8, generator=g, dtype=torch.float64)
        d = rm.normalise_by_max((d + d.T).fill_diagonal_(0))
        p = torch.rand(8, generator=g, dtype=torch.float64)
        p = p / p.sum()
        g0 = rm.agglomerate(d, p, 4, lam=.5)
        s0 = rm.partition_score(d, p, g0, .5)
        for depth in (1, None):
            gs, n = rm.swap_search(d, p, g0, lam=.5, max_swaps=depth)
            assert sorted(map(len, gs)) == sorted(map(len, g0)) and sorted(sum(gs, [])) == list(range(8))
            # float64 scores of 8 experts (MST edges <= 1, collision terms): 64 steps of the score
            assert rm.partition_score(d, p, gs, .5) <= s0 + tol(torch.float64, 64, max(1.0, s0))
            assert n <= (1 if depth else 10 ** 6)


def test_without_collision_greedy_is_already_a_swap_optimum():
    # lambda = 0: single linkage stops at the minimum spanning forest with K trees, the optimum of the score
    d = D5.clone()
    g = rm.agglomerate(d, P5, 2, lam=0.0)
    assert rm.swap_search(d, P5, g, lam=0.0, max_swaps=None) == (g, 0)


def test_plan_dispatches_the_search_variants_and_reports_scores():
    counts = torch.tensor([[[5., 3, 0, 1, 0, 2], [1, 0, 4, 2, 0, 1], [0, 2, 1, 0, 6, 1]]] * 2)   # [L=2, B=3, N=6]
    base, _ = rm.plan(counts, 3, "rolemerge")
    for method, depth in (("greedy_1swap", 1), ("greedy_swapc", None)):
        groups, info = rm.plan(counts, 3, method)
        for l in range(2):
            p = rm.phase_distributions(counts[l])
            P_e, q = rm.role_profiles(p)
            d = rm.normalise_by_max(rm.pair_loss(P_e, q))
            tau = rm.collision_scale(p[-1])
            want, n = rm.swap_search(d, p[-1], base[l], info[l]["lambda"], tau, depth)
            assert groups[l] == want and info[l]["swaps"] == n
            assert info[l]["J_greedy"] == pytest.approx(rm.partition_score(d, p[-1], base[l], info[l]["lambda"], tau))
            assert info[l]["J"] == pytest.approx(rm.partition_score(d, p[-1], want, info[l]["lambda"], tau))
            assert info[l]["J"] <= info[l]["J_greedy"] + tol(torch.float64, 64, max(1.0, abs(info[l]["J_greedy"])))
            if depth is None:                                       # a local optimum: no swap lowers it further
                assert rm.swap_search(d, p[-1], groups[l], info[l]["lambda"], tau, None)[1] == 0
    assert "J" not in rm.plan(counts, 3, "rolemerge")[1][0]


def test_equal_swaps_break_to_the_smallest_expert_pair():
    # uniform p_ans: every pair has R = 1, so only the tree part changes. From [[0,1],[2],[3]] the swaps
    # 0<->2 and 0<->3 both replace d01 = 1 by d12 = d13 = .2 (delta -.8); 1<->2 / 1<->3 give d02 = d03 = .6
    d = torch.tensor([[0, 1, .6, .6], [1, 0, .2, .2], [.6, .2, 0, .5], [.6, .2, .5, 0]], dtype=torch.float64)
    p = torch.full((4,), .25, dtype=torch.float64)
    assert rm.partition_score(d, p, [[0, 1], [2], [3]], lam=1.0) == pytest.approx(2.0)
    g, n = rm.swap_search(d, p, [[0, 1], [2], [3]], lam=1.0, max_swaps=None)
    assert (g, n) == ([[0], [1, 2], [3]], 1)                 # (0, 2) before (0, 3); then no swap lowers 1.2
    assert rm.partition_score(d, p, g, lam=1.0) == pytest.approx(1.2)


def test_search_depths_of_the_two_variants():
    assert rm.SEARCH == {"greedy_1swap": 1, "greedy_swapc": None}
