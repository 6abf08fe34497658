"""RoleMerge pure functions against hand-computed values (rolemerge/model.py)."""
import math

import pytest
import torch

from helpers import tol
from rolemerge import baselines as bl
from rolemerge import model as rm

# 4 experts, 3 phases (image, question, answer); see the comments for the hand computation
COUNTS = torch.tensor([[2., 2., 0., 0.],    # image    -> p = (.5, .5, 0, 0)
                       [0., 2., 2., 0.],    # question -> p = (0, .5, .5, 0)
                       [0., 0., 1., 3.]])   # answer   -> p = (0, 0, .25, .75)


def test_phase_distributions_and_rrp():
    p = rm.phase_distributions(COUNTS)
    assert torch.allclose(p[2], torch.tensor([0, 0, .25, .75], dtype=torch.float64))
    P_e, q = rm.role_profiles(p)
    # P(e) = sum_b p_b(e) / 3
    assert torch.allclose(P_e, torch.tensor([1 / 6, 1 / 3, 1 / 4, 1 / 4], dtype=torch.float64))
    assert torch.allclose(q, torch.tensor([[1, 0, 0], [.5, .5, 0], [0, 2 / 3, 1 / 3], [0, 0, 1]], dtype=torch.float64))
    assert float(P_e.sum()) == pytest.approx(1.0)


def test_pair_loss_hand_values():
    P_e, q = rm.role_profiles(rm.phase_distributions(COUNTS))
    d = rm.pair_loss(P_e, q)
    # (0,1): m = (2/3, 1/3, 0); 1/6 log(3/2) + 1/3 (.5 log(3/4) + .5 log(3/2)) = log(1.6875)/6
    assert float(d[0, 1]) == pytest.approx(math.log(1.6875) / 6)
    # (0,3): disjoint supports -> (P0 + P3) * H(.4, .6) = log(2.5)/6 + log(5/3)/4
    assert float(d[0, 3]) == pytest.approx(math.log(2.5) / 6 + math.log(5 / 3) / 4)
    assert torch.equal(d, d.T) and float(d.diagonal().abs().sum()) == 0
    # (1,3): m = (1/6, 1/6, 1/4)/(7/12) = (2/7, 2/7, 3/7); 1/3 log(7/4) + 1/4 log(7/3)
    assert float(d[1, 3]) == pytest.approx(math.log(7 / 4) / 3 + math.log(7 / 3) / 4)
    dn = rm.normalise_by_max(d)
    assert float(dn.max()) == pytest.approx(1.0)
    assert float(dn[0, 1]) == pytest.approx(float(d[0, 1] / d.max()))
    assert torch.equal(rm.normalise_by_max(torch.zeros(3, 3, dtype=torch.float64)), torch.zeros(3, 3, dtype=torch.float64))


def test_collision_tau_kappa_hand_values():
    p_ans = rm.phase_distributions(COUNTS)[2]
    assert rm.collision(p_ans, [3]) == 0.0                      # singleton
    assert rm.collision(p_ans, [0, 1]) == 0.0                   # zero-mass group
    assert rm.collision(p_ans, [2, 3]) == pytest.approx(1 / 3)  # 1 / .75 - 1
    assert rm.collision(p_ans, [1, 2, 3]) == pytest.approx(1 / 3)
    assert rm.collision_increment(p_ans, [2], [3]) == pytest.approx(1 / 3)
    # signed: merging {2,3} with {1} adds no collision; {0,2} with {3} -> R = 1/3 - 0 - 0
    exact = tol(torch.float64, 16, 1.0)   # float64 distributions over 4 experts, a few ratios and logs
    assert rm.collision_increment(p_ans, [2, 3], [1]) == pytest.approx(0.0, abs=exact)
    # only singleton pair (2,3) has a positive increment -> tau = 1/3; none -> 1
    assert rm.collision_scale(p_ans) == pytest.approx(1 / 3)
    assert rm.collision_scale(torch.tensor([1., 0, 0], dtype=torch.float64)) == 1.0
    H = -(.25 * math.log(.25) + .75 * math.log(.75))
    assert rm.answer_concentration(p_ans) == pytest.approx(1 - H / math.log(4))
    assert rm.answer_concentration(torch.full((4,), .25, dtype=torch.float64)) == pytest.approx(0.0, abs=exact)
    lams = rm.layer_lambdas([0.2, 0.6, 0.0], lam=0.03)
    assert sum(lams) / 3 == pytest.approx(0.03)
    assert lams[1] / lams[0] == pytest.approx(3.0) and lams[2] > 0     # floor keeps it positive


def test_rolemerge_grouping_on_example():
    p = rm.phase_distributions(COUNTS)
    P_e, q = rm.role_profiles(p)
    dn = rm.normalise_by_max(rm.pair_loss(P_e, q))
    # smallest d_EP is (0,1); with lambda=0 that pair merges first
    assert rm.agglomerate(dn, p[2], 3, lam=0.0) == [[0, 1], [2], [3]]
    groups, info = rm.plan(COUNTS[None], 3)
    assert groups[0] == [[0, 1], [2], [3]] and info[0]["tau"] == pytest.approx(1 / 3)
    # a huge collision weight forbids putting the two answer carriers 2 and 3 together
    assert [2, 3] not in rm.agglomerate(dn, p[2], 2, lam=100.0, tau=1 / 3)


def test_tie_breaking_order():
    d = torch.full((4, 4), 0.5, dtype=torch.float64).fill_diagonal_(0)
    p_ans = torch.tensor([.5, .5, 0, 0], dtype=torch.float64)
    # lambda = 0: every J ties; (0,1) has dR = 1 > 0, the other pairs dR = 0 -> indices pick (0,2)
    assert rm.agglomerate(d, p_ans, 3, lam=0.0) == [[0, 2], [1], [3]]
    # next step: ({0,2},{3}) and ({1},{3}) tie on d and dR = 0; the smaller merged size wins
    assert rm.agglomerate(d, p_ans, 2, lam=0.0) == [[0, 2], [1, 3]]
    # all else equal (zero answer mass): lowest expert indices
    assert rm.agglomerate(d, torch.zeros(4, dtype=torch.float64), 3) == [[0, 1], [2], [3]]
    # deterministic
    assert rm.agglomerate(d, p_ans, 2) == rm.agglomerate(d.clone(), p_ans.clone(), 2)


def test_linkages():
    # chain 0-1-2 close, 3 far: single linkage joins the chain, complete linkage is pulled apart
    d = torch.tensor([[0, .1, .5, 1], [.1, 0, .2, 1], [.5, .2, 0, .45], [1, 1, .45, 0]], dtype=torch.float64)
    z = torch.zeros(4, dtype=torch.float64)
    assert rm.agglomerate(d, z, 2, linkage="single") == [[0, 1, 2], [3]]
    assert rm.agglomerate(d, z, 2, linkage="complete") == [[0, 1], [2, 3]]
    assert rm.agglomerate(d, z, 2, linkage="average") == [[0, 1, 2], [3]]  # (.5+.2)/2 = .35 < .45
    with pytest.raises(ValueError):
        rm.agglomerate(d, z, 2, linkage="ward")
    with pytest.raises(ValueError):
        rm.agglomerate(d, z, 0)


def test_zero_mass_expert_and_group():
    counts = torch.tensor([[3., 1, 0, 0], [1, 3, 0, 0], [2, 2, 4, 0]])
    P_e, q = rm.role_profiles(rm.phase_distributions(counts))
    assert float(P_e[3]) == 0 and torch.equal(q[3], torch.zeros(3, dtype=torch.float64))
    d = rm.pair_loss(P_e, q)
    assert float(d[3].abs().sum()) == 0 and float(d[:, 3].abs().sum()) == 0
    assert not torch.isnan(d).any()
    groups, _ = rm.plan(counts[None], 3)
    assert sum(len(g) for g in groups[0]) == 4
    mass = counts.sum(0)                                       # (6, 6, 4, 0)
    assert rm.merge_weights(mass, [[0, 1], [2, 3]]) == [[.5, .5], [1.0, 0.0]]
    assert rm.merge_weights(torch.tensor([0., 0, 5]), [[0, 1], [2]]) == [[.5, .5], [1.0]]   # zero-mass group
    assert rm.acr(rm.phase_distributions(counts)[2], [[0, 1], [2, 3]]) == pytest.approx(.25 + .5)


def test_non_identifiability_app_a1():
    """App. A.1: equal global statistics, different phase profiles."""
    sep = torch.tensor([[2., 0], [0, 2]])     # expert 0 only in phase 0, expert 1 only in phase 1
    mix = torch.tensor([[1., 1], [1, 1]])     # both experts in both phases
    assert torch.equal(sep.sum(0), mix.sum(0))                 # global frequency identical
    P_s, q_s = rm.role_profiles(rm.phase_distributions(sep))
    P_m, q_m = rm.role_profiles(rm.phase_distributions(mix))
    assert torch.equal(P_s, P_m) and not torch.equal(q_s, q_m)
    exact = tol(torch.float64, 16, 1.0)   # float64 distributions over 2 x 2 cells, a log per cell
    assert rm.mutual_information(P_s, q_s) == pytest.approx(math.log(2))       # I_separated = log 2
    pooled = sep.sum(0, keepdim=True).expand(2, 2)
    P_p, q_p = rm.role_profiles(rm.phase_distributions(pooled))
    assert rm.mutual_information(P_p, q_p) == pytest.approx(0.0, abs=exact)    # I_pooled = 0
    assert float(rm.pair_loss(P_s, q_s)[0, 1]) == pytest.approx(math.log(2))   # phase split sees the loss
    assert float(rm.pair_loss(P_m, q_m)[0, 1]) == pytest.approx(0.0, abs=exact)
    r = torch.eye(2)
    assert rm.frequency_groups(sep.sum(0), r, 1) == rm.frequency_groups(mix.sum(0), r, 1)  # baseline blind
    assert rm.mi_retention([sep], [[0, 1]]) == pytest.approx(0.0, abs=exact)
    assert rm.mi_retention([sep], [[0], [1]]) == pytest.approx(1.0)


def test_controls_and_baselines():
    torch.manual_seed(0)
    counts = torch.randint(0, 50, (2, 3, 8)).double()
    router = [torch.randn(8, 5) for _ in range(2)]
    z = [torch.randn(6, 8).double() for _ in range(2)]   # baseline features (rolemerge/baselines.py)
    feats = [{"count": counts[l].sum(0), "logit_gram": z[l].T @ z[l], "out_sum": torch.randn(8, 5).double(),
              "reap_sum": torch.rand(8).double(), "tokens": 6} for l in range(2)]
    def plan(method):
        if method in rm.FEATURE_METHODS:
            return bl.plan_groups(method, feats, 4), None
        return rm.plan(counts, 4, method=method, routers=router, seed=1)
    for method in rm.METHODS:
        g, info = plan(method)
        for layer in g:
            assert len(layer) == 4
            flat = sorted(e for grp in layer for e in grp)
            assert flat == (sorted(flat) if method in ("prune", "reap") else list(range(8)))
        assert g == plan(method)[0]   # deterministic
    g, info = rm.plan(counts, 4, method="lambda0")
    assert all(i["lambda"] == 0 for i in info)
    g, _ = rm.plan(counts, 4, method="prune")
    mass = counts[0].sum(0)
    kept = [grp[0] for grp in g[0]]
    assert min(mass[kept]) >= max(mass[[e for e in range(8) if e not in kept]])
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(5))
    assert rm.kmeans_groups(x, 4, seed=3) == rm.kmeans_groups(x.clone(), 4, seed=3)
    assert len(rm.kmeans_groups(torch.zeros(6, 3), 3)) == 3             # duplicates still give K groups
    with pytest.raises(ValueError):
        rm.plan(counts, 4, method="frequency")                          # needs routers
