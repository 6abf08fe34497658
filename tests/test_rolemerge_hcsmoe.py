"""HC-SMoE to its official definition (Chen et al., arXiv 2410.08589; code wazenmai/HC-SMoE,
`hcsmoe/merging/clustering.py`): Euclidean distance between mean expert outputs, average linkage,
cosine as a named variant; and M-SMoE's layer-adaptive group counts (arXiv 2310.01334; code
UNITES-Lab/MC-SMoE `_assign_num_groups_per_layer`)."""
import math

import pytest
import torch

from rolemerge import baselines as bl


def official_hierarchical(X, n_clusters):
    """A plain-loop transcription of the official `hierarchical_clustering(X, n, "average")`:
    `pairwise_distances` (Euclidean), then, while more than n clusters remain, `compute_distance`
    (the mean pairwise distance of every pair of cluster labels, labels in ascending order, the
    first minimum in row-major order wins) and `clusters[clusters == cj] = clusters[i]`."""
    n = len(X)
    pd = [[math.dist(X[i], X[j]) for j in range(n)] for i in range(n)]
    clusters = list(range(n))
    while len(set(clusters)) > n_clusters:
        labels = sorted(set(clusters))
        best = None
        for ii, ci in enumerate(labels):
            for jj, cj in enumerate(labels):
                if ii >= jj:
                    continue
                mi = [v for v in range(n) if clusters[v] == ci]
                mj = [v for v in range(n) if clusters[v] == cj]
                d = sum(pd[a][b] for a in mi for b in mj) / (len(mi) * len(mj))
                if best is None or d < best[0]:
                    best = (d, ci, cj)
        _, i, j = best
        cj = clusters[j]
        clusters = [clusters[i] if c == cj else c for c in clusters]
    groups = {}
    for e, c in enumerate(clusters):
        groups.setdefault(c, []).append(e)
    return sorted(groups.values())


def test_hand_computed_four_experts_euclidean_and_cosine():
    """o0 = (1, 0), o1 = (10, 0), o2 = (0, 1), o3 = (1, 1.2).
    Euclidean: d23 = 1.020 is the smallest -> {2, 3}; average to {2, 3}: from 0 (1.414 + 1.2) / 2
    = 1.307, from 1 (10.05 + 9.08) / 2 = 9.56; d01 = 9 -> {0, 2, 3}, {1}.
    Cosine (1 - cos): o0, o1 are parallel (distance 0) -> {0, 1}; then 1 - cos(2, 3) = 0.232 <
    mean(1 - cos({0,1}, 3)) = 0.360 -> {0, 1}, {2, 3}. The two distances disagree here."""
    X = torch.tensor([[1.0, 0.0], [10.0, 0.0], [0.0, 1.0], [1.0, 1.2]])
    assert bl.hcsmoe_groups(X, 2) == [[0, 2, 3], [1]]
    assert bl.hcsmoe_groups(X, 3) == [[0], [1], [2, 3]]
    assert bl.hcsmoe_groups(X, 2, distance="cosine") == [[0, 1], [2, 3]]
    D = bl.euclidean_matrix(X)
    assert D[2, 3].item() == pytest.approx(math.sqrt(1.04)) and D[0, 1].item() == 9.0 and D[1, 1].item() == 0.0


def test_partitions_equal_the_official_code_on_random_cases():
    """Our Lance-Williams average linkage on Euclidean distances = the official clustering code,
    transcribed above, on 40 random cases (N in 4..16, K in 1..N, H in 1..8)."""
    g = torch.Generator().manual_seed(0)
    for case in range(40):
        N = int(torch.randint(4, 17, (1,), generator=g))
        K = int(torch.randint(1, N + 1, (1,), generator=g))
        H = int(torch.randint(1, 9, (1,), generator=g))
        X = torch.randn(N, H, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g) * 3 + 0.1)
        assert bl.hcsmoe_groups(X, K) == official_hierarchical(X.tolist(), K), case


def test_cosine_variant_differs_from_the_official_distance_on_random_cases():
    """The bug: 1 - cos agreed with the official Euclidean partition in only a few random cases."""
    g = torch.Generator().manual_seed(1)
    same = 0
    for _ in range(20):
        X = torch.randn(12, 4, generator=g, dtype=torch.float64) + torch.randn(1, 4, generator=g, dtype=torch.float64)
        same += bl.hcsmoe_groups(X, 6, distance="cosine") == official_hierarchical(X.tolist(), 6)
    assert same < 10


def test_average_linkage_is_dispatched_not_single_or_complete():
    """A case where the three linkages give three partitions: the plan (and the default) must
    give average's, which equals the official transcription."""
    X = torch.tensor([[-1.0, 7], [-1, -5], [-7, -4], [-8, -1], [-4, -2], [7, -5]])
    avg = [[0, 1, 2, 3, 4], [5]]
    assert bl.hcsmoe_groups(X, 2, "single") == [[0], [1, 2, 3, 4, 5]]
    assert bl.hcsmoe_groups(X, 2, "complete") == [[0, 2, 3, 4], [1, 5]]
    assert bl.hcsmoe_groups(X, 2) == avg == official_hierarchical(X.tolist(), 2)
    feats = [{"count": torch.ones(6), "logit_gram": torch.eye(6), "out_sum": X.double() * 4, "reap_sum": torch.ones(6),
              "tokens": 4}]
    assert bl.plan_groups("hcsmoe", feats, 2) == [avg]
    from rolemerge import model as rm
    assert bl.plan_groups("hcsmoe", feats, 2) == [avg]


def test_unknown_distance_is_refused():
    with pytest.raises(ValueError, match="unknown distance"):
        bl.hcsmoe_groups(torch.eye(3), 2, distance="manhattan")


def test_msmoe_layer_adaptive_counts_hand_case():
    """Two layers of 4 experts, K = 2 on average (L K = 4 groups in all).
    Layer 0 counts (6, 2, 1, 1) -> f = (.6, .2, .1, .1), its max set to 1 -> (1, .2, .1, .1);
    layer 1 counts (3, 3, 2, 2) -> (1, .3, .2, .2). All 8 sorted: 1, 1, .3, .2, .2, .2, .1, .1;
    the value at index 4 is .2 -> K_0 = #{f > .2} = 1, K_1 = #{1, .3} = 2.
    Then K = 3 (index 6: .1): K_0 = 2 (1, .2), K_1 = 4."""
    counts = [torch.tensor([6.0, 2, 1, 1]), torch.tensor([3.0, 3, 2, 2])]
    assert bl.msmoe_layer_counts(counts, 2) == [1, 2]
    assert bl.msmoe_layer_counts(counts, 3) == [2, 4]
    # every layer keeps >= 1 group: flat (.25 x 4) and peaked (.7, .1, .1, .1) layers, K = 1: the values
    # 1, 1, .25, .25, .25, .1, .1, .1 put the threshold (index 2) at .25 -> [1, 1]; without setting each
    # layer's top expert to 1 the flat layer would get #{.25 > .25} = 0 groups
    assert bl.msmoe_layer_counts([torch.ones(4), torch.tensor([7.0, 1, 1, 1])], 1) == [1, 1]
    feats = [{"count": c, "logit_gram": torch.eye(4) + 0.1, "out_sum": torch.zeros(4, 2), "reap_sum": c, "tokens": 1}
             for c in counts]
    groups = bl.plan_groups("msmoe", feats, 2, adaptive=True)
    assert [len(g) for g in groups] == [1, 2] and groups[0] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="M-SMoE"):
        bl.plan_groups("hcsmoe", feats, 2, adaptive=True)
