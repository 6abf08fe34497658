"""rolemerge.model.agglomerate (numpy, one J row per step) against the straightforward
version it replaced (the whole [N, N] objective recomputed in torch at every step): identical
groupings, including exact ties."""
import math

import torch

from rolemerge import model as rm


def reference_agglomerate(d_norm, p_ans, K, lam=0.0, tau=1.0, linkage="single"):
    """Greedy answer-aware agglomeration (§4.3, App. B.2).

    d_norm [N, N]: max-normalised d_EP; p_ans [N]: answer-phase distribution; K: groups to keep;
    lam: lambda_l of this layer (0 = the lambda=0 control); tau: collision scale;
    linkage: "single" (paper default, d_role = min over member pairs), "average" or "complete".
    At each step merges the pair (G, H) minimising
        J(G, H) = d_role(G, H) + lam * Delta R(G, H) / tau,
    exact ties broken lexicographically by (d_role, Delta R, |G|+|H|, sorted expert indices).
    Returns K groups, each a sorted list of expert indices, ordered by their smallest index.
    Raises ValueError for K outside [1, N] or an unknown linkage."""
    N = d_norm.shape[0]
    if not 1 <= K <= N:
        raise ValueError(f"K={K} must be in [1, N={N}]")
    if linkage not in rm.LINKAGES:
        raise ValueError(f"unknown linkage {linkage!r}; choose from {rm.LINKAGES}")
    D = d_norm.clone().to(torch.float64)             # group-to-group d_role, indexed by group id
    p = torch.as_tensor(p_ans, dtype=torch.float64)
    s, m, r = p.clone(), p.clone(), torch.zeros(N, dtype=torch.float64)   # per-group sum, max, R of p_ans
    size = torch.ones(N, dtype=torch.float64)
    members = {i: [i] for i in range(N)}
    active = torch.ones(N, dtype=torch.bool)
    upper = torch.triu(torch.ones(N, N, dtype=torch.bool), 1)
    for _ in range(N - K):
        dR = rm._pair_collision(s[:, None], s[None, :], m[:, None], m[None, :], r[:, None], r[None, :])
        J = D + (lam / tau) * dR
        ok = upper & active[:, None] & active[None, :]
        Jm = torch.where(ok, J, torch.full_like(J, math.inf))
        best = Jm.min()
        cand = (Jm == best).nonzero().tolist()       # exact ties only
        a, b = min(cand, key=lambda ij: (float(D[ij[0], ij[1]]), float(dR[ij[0], ij[1]]),
                                         len(members[ij[0]]) + len(members[ij[1]]),
                                         tuple(sorted(members[ij[0]] + members[ij[1]]))))
        # Lance-Williams update of the linkage from the merged group u = a (b retires)
        if linkage == "single":
            row = torch.minimum(D[a], D[b])
        elif linkage == "complete":
            row = torch.maximum(D[a], D[b])
        else:
            row = (size[a] * D[a] + size[b] * D[b]) / (size[a] + size[b])
        D[a], D[:, a] = row, row
        D[a, a] = 0.0
        members[a] = sorted(members[a] + members.pop(b))
        s[a], m[a], size[a] = s[a] + s[b], torch.maximum(m[a], m[b]), size[a] + size[b]
        r[a] = ((s[a] / (m[a] + rm.EPS)) - 1.0).clamp_min(0.0)
        active[b] = False
    return sorted(members.values())



def test_fast_agglomerate_equals_reference_on_random_and_tied_counts():
    g = torch.Generator().manual_seed(1)
    n = 0
    for trial in range(24):
        N = [8, 16, 32, 64][trial % 4]
        c = (torch.rand(3, N, generator=g, dtype=torch.float64) ** 3 * 100).floor()
        if trial % 3 == 0:
            c[:, : N // 2] = c[:, :1]                       # many exactly tied experts
        if trial % 4 == 1:
            c[:, -3:] = 0                                   # zero-mass experts
        p = rm.phase_distributions(c)
        P_e, q = rm.role_profiles(p)
        d = rm.normalise_by_max(rm.pair_loss(P_e, q))
        tau = rm.collision_scale(p[-1])
        for linkage in rm.LINKAGES:
            for lam in (0.0, 0.03, 1.0):
                K = max(1, N // 3)
                assert rm.agglomerate(d, p[-1], K, lam, tau, linkage) == \
                    reference_agglomerate(d, p[-1], K, lam, tau, linkage), (trial, linkage, lam)
                n += 1
    assert n == 216


def test_exact_tie_in_J_is_broken_by_d_role_first():
    """J(0,1) = .5 + 0 and J(2,3) = d + dR with d + dR == .5 exactly but d < .5: the App. B.2
    key (d_role, Delta R, ...) picks {2, 3}; a key starting with Delta R would pick {0, 1}."""
    p = torch.tensor([0.0, 0.0, 0.3, 0.1], dtype=torch.float64)
    z = torch.zeros(1, dtype=torch.float64)
    dR23 = float(rm._pair_collision(p[2:3], p[3:4], p[2:3], p[3:4], z, z))
    d23 = 0.5 - dR23
    assert d23 + dR23 == 0.5 and 0 < d23 < 0.5
    D = torch.ones(4, 4, dtype=torch.float64)
    D.fill_diagonal_(0)
    D[0, 1] = D[1, 0] = 0.5
    D[2, 3] = D[3, 2] = d23
    assert rm.agglomerate(D, p, 3, lam=1.0, tau=1.0) == [[0], [1], [2, 3]]
    assert reference_agglomerate(D, p, 3, lam=1.0, tau=1.0) == [[0], [1], [2, 3]]
