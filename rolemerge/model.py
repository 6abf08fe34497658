"""RoleMerge as pure functions on routing-count tensors (paper §3-4, App. A-B).

Everything here works on the phase-separated hard routing counts of ONE MoE layer,

    counts [B, N]   counts[b, e] = how often expert e was among the top-k of a token of phase b
                    (B = 3 buckets image / question / answer for a VLM, 2 for a text-only LM)

and returns groupings (lists of expert indices) plus diagnostics. No model weights, no
transformers: `rolemerge/merge.py` turns a grouping into a smaller checkpoint.

Pipeline for one layer (App. B.3):
    p      = phase_distributions(counts)          # p_{l,b}(e), each phase row sums to 1
    P, q   = role_profiles(p)                     # P(e) and the RRP q_e(b)        (§3.3)
    d      = normalise_by_max(pair_loss(P, q))    # d_EP(i,j) / max d_EP            (§3.4, §4.3)
    tau    = collision_scale(p_ans)               # median positive singleton dR  (App. B.2)
    groups = agglomerate(d, p_ans, K, lam, tau)   # greedy on J = d_role + lam dR / tau
    w      = merge_weights(counts.sum(0), groups) # pooled-count weights inside each group

All maths in float64; ties are exact float comparisons, broken by a fixed key, so a grouping
is a deterministic function of the counts.
"""
import math
import operator

import numpy as np
import torch

PHASES = ("image", "question", "answer")  # bucket order of every count tensor (text-only: question, answer)
EPS = 1e-12          # the eps of R(G) (eq. for R_ans): keeps R finite for zero-mass groups
KAPPA_FLOOR = 1e-3   # the eps of lambda_l ∝ max(kappa_l, eps); the paper leaves its value open
LINKAGES = ("single", "average", "complete")


# ----------------------------------------------------------------------------- phase statistics

def phase_distributions(counts):
    """counts [B, N] (any non-negative numbers) -> p [B, N] float64, each non-empty phase row
    normalised over experts (p_{l,b}(e) of §3.2); an all-zero row stays zero."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    tot = c.sum(-1, keepdim=True)
    return torch.where(tot > 0, c / tot.clamp_min(1e-300), torch.zeros_like(c))


def role_profiles(p, prior=None):
    """Balanced joint and Routing Role Profiles (§3.3).

    p [B, N] phase distributions. With the uniform phase prior pi(b) = 1/B (the paper's; or
    `prior` [B], non-negative, summing to 1, e.g. the empirical phase token shares):
    P(e, b) = pi(b) p[b, e], P(e) = sum_b P(e, b), q_e(b) = P(e, b) / P(e) (zero vector if P(e) = 0).
    An all-zero row (a phase this record never reached, e.g. the image bucket of a text-only
    source) is no distribution: the uniform prior is then 1/B' over the B' non-empty phases,
    so the joint still sums to 1 and the record's MI does not depend on an empty bucket.
    Returns (P_e [N], q [N, B]), float64."""
    B = p.shape[0]
    if prior is None:
        seen = (torch.as_tensor(p, dtype=torch.float64).sum(-1) > 0).double()        # [B]
        pi = seen / seen.sum() if seen.sum() > 0 else torch.full((B,), 1.0 / B, dtype=torch.float64)
    else:
        pi = torch.as_tensor(prior, dtype=torch.float64)
    joint = p.T * pi[None, :]                    # [N, B] = P(e, b)
    P_e = joint.sum(-1)                          # [N]
    q = torch.where(P_e[:, None] > 0, joint / P_e.clamp_min(1e-300)[:, None], torch.zeros_like(joint))
    return P_e, q


def _xlogy_ratio(a, b):
    """a * log(a / b) with 0 log 0 = 0 (elementwise, float64)."""
    return torch.where(a > 0, a * (a.clamp_min(1e-300).log() - b.clamp_min(1e-300).log()), torch.zeros_like(a))


def pair_loss(P_e, q):
    """Pairwise expert-phase information loss d_EP(i, j) (§3.4):

        m_ij = (P(i) q_i + P(j) q_j) / (P(i) + P(j))
        d_EP(i, j) = P(i) KL(q_i || m_ij) + P(j) KL(q_j || m_ij)

    P_e [N], q [N, B] -> d [N, N] float64, symmetric, zero diagonal. A zero-mass expert
    contributes zero (App. B.1); a pair of zero-mass experts has d = 0."""
    Pi, Pj = P_e[:, None, None], P_e[None, :, None]
    qi, qj = q[:, None, :], q[None, :, :]                         # [N, 1, B], [1, N, B]
    tot = Pi + Pj
    m = torch.where(tot > 0, (Pi * qi + Pj * qj) / tot.clamp_min(1e-300), torch.zeros_like(Pi * qi))  # [N, N, B]
    d = (Pi[..., 0] * _xlogy_ratio(qi, m).sum(-1) + Pj[..., 0] * _xlogy_ratio(qj, m).sum(-1))
    d = d.clamp_min(0.0)                                          # KL >= 0; remove -1e-17 round-off
    d.fill_diagonal_(0.0)
    return d


def normalise_by_max(d):
    """d [N, N] -> d / max_{u != v} d (§4.3, d_role's denominator); an all-zero matrix stays zero."""
    N = d.shape[0]
    off = d[~torch.eye(N, dtype=torch.bool)]
    mx = off.max() if off.numel() else torch.tensor(0.0, dtype=d.dtype)
    return d / mx if mx > 0 else torch.zeros_like(d)


def mutual_information(P_e, q, groups=None):
    """I_P(S; B) (groups None) or I_P(C; B) for a grouping (§3.4, App. A.2), in nats.

    P_e [N], q [N, B]; groups: list of lists of expert indices covering the experts to keep.
    I = sum_G P(G) KL(q_G || P(B)), q_G = sum_{e in G} P(e) q_e / P(G)."""
    joint = P_e[:, None] * q                                       # [N, B]
    if groups is not None:
        idx, gid = _group_index(groups)
        joint = torch.zeros(len(groups), joint.shape[1], dtype=joint.dtype).index_add_(0, gid, joint[idx])
    PB = joint.sum(0, keepdim=True)                                # [1, B]
    PG = joint.sum(1, keepdim=True)                                # [G, 1]
    return float(_xlogy_ratio(joint, PG * PB).sum())


# ----------------------------------------------------------------------------- answer-aware collision

def answer_concentration(p_ans):
    """kappa_l = 1 - H(p_ans) / log N (§4.3). p_ans [N]; 0 for N = 1 or an empty distribution."""
    N = p_ans.numel()
    if N < 2 or float(p_ans.sum()) <= 0:
        return 0.0
    H = -float(_xlogy_ratio(p_ans, torch.ones_like(p_ans)).sum())
    return 1.0 - H / math.log(N)


def layer_lambdas(kappas, lam=0.03, floor=KAPPA_FLOOR):
    """lambda_l ∝ max(kappa_l, floor), rescaled so that their mean over the merged layers is
    `lam` (§4.3). kappas: list of floats -> list of floats (all zero if lam == 0)."""
    k = [max(x, floor) for x in kappas]
    mean = sum(k) / len(k)
    return [lam * x / mean for x in k]


def collision(p_ans, group, eps=EPS):
    """R_ans(G) = [sum_{e in G} p_ans(e) / (max_{e in G} p_ans(e) + eps) - 1]_+ (§4.3).
    p_ans [N]; group: iterable of expert indices. 0 for singletons and zero-mass groups."""
    v = p_ans[list(group)]
    return max(float(v.sum() / (v.max() + eps)) - 1.0, 0.0)


def collision_increment(p_ans, G, H, eps=EPS):
    """Delta R(G, H) = R(G u H) - R(G) - R(H) (the signed collision adjustment of J, §4.3)."""
    return collision(p_ans, list(G) + list(H), eps) - collision(p_ans, G, eps) - collision(p_ans, H, eps)


def _pair_collision(s_i, s_j, m_i, m_j, r_i, r_j, eps=EPS):
    """Vectorised Delta R for all group pairs from per-group (sum, max, R) of p_ans."""
    r_u = ((s_i + s_j) / (torch.maximum(m_i, m_j) + eps) - 1.0).clamp_min(0.0)
    return r_u - r_i - r_j


def collision_scale(p_ans, eps=EPS):
    """tau_l = median of the strictly positive singleton-pair increments Delta R({i}, {j}),
    i < j; 1 if there are none (App. B.2). p_ans [N] -> float. (torch.median of an even count
    takes the lower middle value; we average the two middle values, the usual median.)"""
    N = p_ans.numel()
    z = torch.zeros_like(p_ans)
    dR = _pair_collision(p_ans[:, None], p_ans[None, :], p_ans[:, None], p_ans[None, :], z[:, None], z[None, :], eps)
    iu = torch.triu_indices(N, N, 1)
    v = dR[iu[0], iu[1]]
    v = v[v > 0].sort().values
    if v.numel() == 0:
        return 1.0
    n = v.numel()
    return float(v[n // 2]) if n % 2 else float((v[n // 2 - 1] + v[n // 2]) / 2)


# ----------------------------------------------------------------------------- grouping

def lance_williams(D, a, b, size, linkage):
    """Lance-Williams linkage update after merging group b into group a, in place: D [N, N]
    (numpy, symmetric group-to-group distances) gets the merged group's row and column
    (single: min, complete: max, average: size-weighted mean of rows a and b) and D[a, a] = 0;
    size [N] holds the group sizes before the merge (the caller updates it). Row / column b
    are left for the caller to retire."""
    if linkage == "single":
        row = np.minimum(D[a], D[b])
    elif linkage == "complete":
        row = np.maximum(D[a], D[b])
    else:
        row = (size[a] * D[a] + size[b] * D[b]) / (size[a] + size[b])
    D[a], D[:, a] = row, row
    D[a, a] = 0.0


def agglomerate(d_norm, p_ans, K, lam=0.0, tau=1.0, linkage="single"):
    """Greedy answer-aware agglomeration (§4.3, App. B.2).

    d_norm [N, N]: max-normalised d_EP (symmetric; the upper triangle is read); p_ans [N]: answer-phase distribution; K: groups to keep;
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
    if linkage not in LINKAGES:
        raise ValueError(f"unknown linkage {linkage!r}; choose from {LINKAGES}")
    # numpy, not torch: ~N steps of small [N, N] ops, where torch's per-op overhead dominates.
    # J changes only in the merged group's row / column, so each step recomputes one row.
    D = torch.as_tensor(d_norm, dtype=torch.float64).numpy()
    D = np.triu(D, 1) + np.triu(D, 1).T                                # group-to-group d_role (symmetric: upper triangle)
    p = torch.as_tensor(p_ans, dtype=torch.float64).numpy()
    s, m, r = p.copy(), p.copy(), np.zeros(N)                           # per-group sum, max, R of p_ans
    size = np.ones(N)
    members = {i: [i] for i in range(N)}
    c = lam / tau

    idx = np.arange(N)

    def dR_row(a):                        # Delta R(a, every group), R of the smaller index subtracted first
        ru = np.maximum((s[a] + s) / (np.maximum(m[a], m) + EPS) - 1.0, 0.0)
        return np.where(idx < a, ru - r - r[a], ru - r[a] - r)

    dR = np.maximum((s[:, None] + s[None, :]) / (np.maximum(m[:, None], m[None, :]) + EPS) - 1.0, 0.0) \
        - r[:, None] - r[None, :]
    J = D + c * dR
    np.fill_diagonal(J, math.inf)                                       # J is symmetric; inf = not a candidate
    for _ in range(N - K):
        best = J.min()
        ci, cj = np.divmod(np.flatnonzero(J == best), N)                # exact ties only
        up = ci < cj
        ci, cj = ci[up], cj[up]
        for key in (lambda: D[ci, cj], lambda: dR[ci, cj], lambda: size[ci] + size[cj]):   # tie-breaks
            if len(ci) > 1:
                k = key()
                ci, cj = ci[k == k.min()], cj[k == k.min()]
        a, b = min(zip(ci.tolist(), cj.tolist()), key=lambda ij: tuple(sorted(members[ij[0]] + members[ij[1]])))
        lance_williams(D, a, b, size, linkage)
        members[a] = sorted(members[a] + members.pop(b))
        s[a], m[a], size[a] = s[a] + s[b], max(m[a], m[b]), size[a] + size[b]
        r[a] = max(s[a] / (m[a] + EPS) - 1.0, 0.0)
        J[b, :], J[:, b] = math.inf, math.inf                           # b retires
        dR[a], dR[:, a] = (d := dR_row(a)), d
        live = np.isfinite(J[a])
        live[b] = False
        Ja = np.where(live, D[a] + c * d, math.inf)
        Ja[a] = math.inf
        J[a], J[:, a] = Ja, Ja
    return sorted(members.values())


# ----------------------------------------------------------------------------- search depth (App. F.3)
# Table 15 panel A keeps the answer-aware merge score and the retained expert count and searches
# deeper than the greedy pass. The paper names the variants (Greedy+1Swap, Greedy+SwapC) and
# reports the change of the merge score (Delta J) but gives neither the partition-level score nor
# the move set; our reading, used by both functions below: the score of a partition is the sum of
# J over the cheapest single-linkage merge sequence that builds it, and a move swaps two experts
# of different groups (group sizes, hence K, unchanged).

def mst_weight(d, members):
    """Weight of a minimum spanning tree of the complete graph on `members` with edge weights
    d[i, j] (numpy [N, N], symmetric): the smallest sum of single-linkage merge heights d_role
    that builds the group from singletons. 0 for a singleton. Prim's algorithm, O(|G|^2)."""
    m = list(members)
    if len(m) < 2:
        return 0.0
    sub = d[np.ix_(m, m)]
    best = sub[0].copy()                    # cheapest edge from the tree (vertex 0) to each vertex
    done = np.zeros(len(m), dtype=bool)
    done[0] = True
    total = 0.0
    for _ in range(len(m) - 1):
        cand = np.where(done, math.inf, best)
        v = int(cand.argmin())
        total += float(cand[v])
        done[v] = True
        best = np.minimum(best, sub[v])
    return total


def partition_score(d_norm, p_ans, groups, lam=0.0, tau=1.0):
    """Answer-aware merge score of a whole partition (our reading of App. F.3's J, see above):

        J(c) = sum_G [ MST_{d_norm}(G) + lam * R_ans(G) / tau ]

    i.e. the sum of the pairwise merge scores J(G, H) = d_role + lam * Delta R / tau over the
    cheapest single-linkage merge sequence building each group: the Delta R terms telescope to
    R_ans(G) (singletons have R = 0) and the d_role terms are at least the group's minimum
    spanning tree. d_norm [N, N] (max-normalised d_EP), p_ans [N], groups: list of lists of
    expert indices -> float."""
    D = torch.as_tensor(d_norm, dtype=torch.float64).numpy()
    D = np.triu(D, 1) + np.triu(D, 1).T
    p = torch.as_tensor(p_ans, dtype=torch.float64)
    return sum(mst_weight(D, g) + lam * collision(p, g) / tau for g in groups)


def swap_search(d_norm, p_ans, groups, lam=0.0, tau=1.0, max_swaps=None):
    """Local search after the greedy pass (Table 15 panel A): repeatedly apply the swap of two
    experts from different groups that lowers `partition_score` the most (strictly, by more than
    1e-12; ties: the smallest (i, j)), at most `max_swaps` times (None: until no swap lowers the
    score, a local optimum). max_swaps=1 is Greedy+1Swap, None Greedy+SwapC. Group sizes and the
    number of groups never change. Returns (groups sorted like `agglomerate`, swaps made)."""
    D = torch.as_tensor(d_norm, dtype=torch.float64).numpy()
    D = np.triu(D, 1) + np.triu(D, 1).T
    p = torch.as_tensor(p_ans, dtype=torch.float64)
    gs = [sorted(g) for g in groups]
    cost = lambda g: mst_weight(D, g) + lam * collision(p, g) / tau
    c = [cost(g) for g in gs]
    of = {e: k for k, g in enumerate(gs) for e in g}
    swaps = 0
    while max_swaps is None or swaps < max_swaps:
        best = (0.0, None)
        for i in sorted(of):
            for j in sorted(of):
                a, b = of[i], of[j]
                if j <= i or a == b:
                    continue
                ga = [e for e in gs[a] if e != i] + [j]
                gb = [e for e in gs[b] if e != j] + [i]
                delta = cost(ga) + cost(gb) - c[a] - c[b]
                if delta < best[0] - 1e-12:
                    best = (delta, (i, j, sorted(ga), sorted(gb)))
        if best[1] is None:
            break
        i, j, ga, gb = best[1]
        a, b = of[i], of[j]
        gs[a], gs[b], c[a], c[b] = ga, gb, cost(ga), cost(gb)
        of[i], of[j] = b, a
        swaps += 1
    return sorted(gs), swaps


def kmeans_groups(x, K, seed=0, iters=50):
    """k-means++ control (App. F.3): cluster the rows of x [N, F] (we use the RRPs q_e) into
    exactly K non-empty groups with squared Euclidean distance. Seeded k-means++ init
    (torch.Generator), Lloyd iterations; an emptied cluster is re-seeded with the point farthest
    from its centre among the clusters of two or more points (K <= N: one always exists).
    Returns sorted groups like `agglomerate`."""
    x = torch.as_tensor(x, dtype=torch.float64)
    N = x.shape[0]
    if not 1 <= K <= N:
        raise ValueError(f"K={K} must be in [1, N={N}]")
    g = torch.Generator().manual_seed(seed)
    centres = [int(torch.randint(N, (1,), generator=g))]
    for _ in range(K - 1):
        d2 = torch.cdist(x, x[centres]).pow(2).min(1).values
        d2[centres] = 0.0
        if float(d2.sum()) <= 0:   # duplicates only: take the lowest unused index
            nxt = next(i for i in range(N) if i not in centres)
        else:
            nxt = int(torch.multinomial(d2 / d2.sum(), 1, generator=g))
        centres.append(nxt)
    C = x[centres].clone()
    assign = None
    for _ in range(iters):
        dist = torch.cdist(x, C).pow(2)
        new = dist.argmin(1)
        for k in range(K):             # keep every cluster non-empty
            if not bool((new == k).any()):
                d = dist.gather(1, new[:, None])[:, 0].clone()
                d[torch.bincount(new, minlength=K)[new] < 2] = -1.0   # a point alone in its cluster stays there
                new[int(d.argmax())] = k
        if assign is not None and bool((new == assign).all()):
            break
        assign = new
        C = torch.stack([x[assign == k].mean(0) for k in range(K)])
    return sorted(sorted(int(i) for i in (assign == k).nonzero()[:, 0]) for k in range(K))


def frequency_groups(freq, router, K):
    """Global-frequency merging baseline (M-SMoE / HC-SMoE style, phase-blind): the K most
    used experts (pooled over all tokens; ties by index) become group anchors, every other
    expert joins the anchor whose router row is most cosine-similar (ties: lower anchor).
    freq [N], router [N, H] -> K sorted groups."""
    freq = torch.as_tensor(freq, dtype=torch.float64)
    N = freq.numel()
    order = sorted(range(N), key=lambda e: (-float(freq[e]), e))
    anchors = sorted(order[:K])
    w = torch.nn.functional.normalize(torch.as_tensor(router, dtype=torch.float64), dim=-1)
    sim = w @ w[anchors].T                                         # [N, K]
    groups = {a: [a] for a in anchors}
    for e in range(N):
        if e not in groups:
            groups[anchors[int(sim[e].argmax())]].append(e)
    return sorted(sorted(g) for g in groups.values())


def prune_groups(freq, K):
    """Frequency pruning baseline (REAP-style operator, with the calibration frequency as the
    saliency): keep the K most used experts as singleton groups, drop the rest (ties by index)."""
    freq = torch.as_tensor(freq, dtype=torch.float64)
    keep = sorted(range(freq.numel()), key=lambda e: (-float(freq[e]), e))[:K]
    return [[e] for e in sorted(keep)]


def _group_index(groups):
    """(member indices, group id of each) of a list of groups, as int64 tensors."""
    idx = torch.tensor([e for g in groups for e in g], dtype=torch.long)
    gid = torch.tensor([i for i, g in enumerate(groups) for _ in g], dtype=torch.long)
    return idx, gid


def merge_weights(mass, groups):
    """Within-group merge weights (§4.4, App. B.2): omega_e = mass_e / sum_{e' in G} mass_e',
    uniform only when the whole group has zero mass. mass [N] pooled counts -> list of lists of
    floats aligned with `groups` (each sums to 1)."""
    mass = torch.as_tensor(mass, dtype=torch.float64)
    idx, gid = _group_index(groups)
    m = mass[idx]
    tot = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, gid, m)[gid]
    size = torch.tensor([len(g) for g in groups], dtype=torch.float64)[gid]
    w = torch.where(tot > 0, m / tot.clamp_min(1e-300), 1.0 / size).tolist()
    out, i = [], 0
    for g in groups:
        out.append(w[i:i + len(g)])
        i += len(g)
    return out


# ----------------------------------------------------------------------------- diagnostics

def acr(p_ans_record, groups):
    """Answer-Carrier Recoverability of one task-layer record (§4.3, App. A.3):
    ACR_r = sum_G max_{e in G} p^A_r(e). p_ans_record [N] (normalised); 1.0 = nothing lost."""
    p = torch.as_tensor(p_ans_record, dtype=torch.float64)
    idx, gid = _group_index(groups)
    return float(torch.zeros(len(groups), dtype=torch.float64).scatter_reduce_(0, gid, p[idx], "amax").sum())


def mi_retention(record_counts, groups):
    """Expert-phase MI of the grouping over that of the experts, I(C;B) / I(S;B), summed over
    records (App. A.4 'EP ret.'). record_counts: list of [B, N] count tensors (task-layer
    records) -> float (1.0 when no record carries phase information)."""
    num = den = 0.0
    for c in record_counts:
        P_e, q = role_profiles(phase_distributions(c))
        den += mutual_information(P_e, q)
        num += mutual_information(P_e, q, groups)
    return num / den if den > 0 else 1.0


# ----------------------------------------------------------------------------- whole-model plan

METHODS = ("rolemerge", "no_phase_split", "lambda0", "permuted", "kmeans", "frequency", "prune",
           "msmoe", "hcsmoe", "reap", "empirical_prior", "greedy_1swap", "greedy_swapc")
SEARCH = {"greedy_1swap": 1, "greedy_swapc": None}   # method -> swap_search's max_swaps (Table 15 panel A)
FEATURE_METHODS = ("msmoe", "hcsmoe", "reap")   # need features: rolemerge.calibrate --features (or baselines.collect_features)


def plan(counts, K, method="rolemerge", lam=0.03, linkage="single", seed=0, routers=None, blocks=1):
    """Groupings for every MoE layer.

    counts [L, B, N]: phase-separated counts summed over sources; K: experts kept per layer;
    method: "rolemerge" (paper), controls "no_phase_split" (buckets pooled before grouping,
    so every RRP is the same and only the collision term on the pooled distribution acts),
    "lambda0", "permuted" (RRPs and p_ans shuffled across expert identities, seeded),
    "empirical_prior" (the RRPs with the layer's phase token shares as the prior pi(b) instead of
    the paper's uniform 1/B; merge weights unchanged),
    "kmeans" (k-means++ on RRPs, seeded), "greedy_1swap" / "greedy_swapc" (the greedy grouping,
    then `swap_search` with one swap / to convergence, per routing block; info gets the partition
    scores "J_greedy" and "J" and "swaps"), baselines "frequency" (needs routers: list of
    [N, H] router weights) and "prune". The papers' own criteria "msmoe", "hcsmoe", "reap"
    group from calibration features, not counts: `rolemerge.baselines.plan_groups`.
    linkage applies to the agglomerative methods (validated for every method).
    blocks: experts form `blocks` contiguous equal blocks (DeepSeek's routing groups) and every
    group stays inside one block, K / blocks groups per block (d_EP's max, kappa, lambda and tau
    stay per layer).
    Returns (groups: list over layers of list of groups, sorted by smallest index, so merged
    expert g lies in block g // (K / blocks); info: list of per-layer dicts).
    Raises ValueError for an unknown method or linkage, a feature method, a K that is not one
    int (per-layer K cannot be saved: transformers configs hold one expert count), missing
    routers, or blocks not dividing N and K."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if linkage not in LINKAGES:
        raise ValueError(f"unknown linkage {linkage!r}; choose from {LINKAGES}")
    K_in = K
    try:
        K = operator.index(K) if not isinstance(K, bool) else None
    except TypeError:
        K = None
    if K is None:
        raise ValueError(f"K must be one int for every layer, got {K_in!r}: per-layer K is not supported "
                         f"(a transformers config holds a single expert count)")
    if method in FEATURE_METHODS:
        raise ValueError(f"method {method!r} groups from calibration features, not counts: "
                         f"rolemerge.baselines.plan_groups")
    counts = torch.as_tensor(counts, dtype=torch.float64)
    L, B, N = counts.shape
    if N % blocks or K % blocks:
        raise ValueError(f"blocks={blocks} must divide N={N} and K={K}")
    nb, kb = N // blocks, K // blocks
    mass = counts.sum(1)                                           # [L, N] pooled over phases
    grouping_counts = counts
    if method == "no_phase_split":
        grouping_counts = mass[:, None, :].expand(L, B, N)
    elif method == "permuted":
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
        grouping_counts = counts[:, :, perm]
    ans = B - 1                                                    # the answer bucket is always last
    p_all = [phase_distributions(grouping_counts[l]) for l in range(L)]
    kappas = [answer_concentration(p[ans]) for p in p_all]
    lams = layer_lambdas(kappas, 0.0 if method == "lambda0" else lam)
    groups, info = [], []
    for l in range(L):
        p = p_all[l]
        prior = grouping_counts[l].sum(-1) / grouping_counts[l].sum() if method == "empirical_prior" else None
        P_e, q = role_profiles(p, prior)
        tau = collision_scale(p[ans])
        d = None if method in ("kmeans", "frequency", "prune") else normalise_by_max(pair_loss(P_e, q))
        g, search = [], {"J_greedy": 0.0, "J": 0.0, "swaps": 0}
        for s0 in range(0, N, nb):                                 # one routing group (block) at a time
            ix = slice(s0, s0 + nb)
            if method == "kmeans":
                gb = kmeans_groups(q[ix], kb, seed=seed)
            elif method == "frequency":
                if routers is None:
                    raise ValueError("method 'frequency' needs the router weights (routers=[...])")
                gb = frequency_groups(mass[l, ix], routers[l][ix], kb)
            elif method == "prune":
                gb = prune_groups(mass[l, ix], kb)
            else:
                gb = agglomerate(d[ix, ix], p[ans, ix], kb, lams[l], tau, linkage)
                if method in SEARCH:
                    search["J_greedy"] += partition_score(d[ix, ix], p[ans, ix], gb, lams[l], tau)
                    gb, n = swap_search(d[ix, ix], p[ans, ix], gb, lams[l], tau, SEARCH[method])
                    search["J"] += partition_score(d[ix, ix], p[ans, ix], gb, lams[l], tau)
                    search["swaps"] += n
            g += [[e + s0 for e in grp] for grp in gb]
        groups.append(g)
        info.append(dict({"kappa": kappas[l], "lambda": lams[l], "tau": tau}, **(search if method in SEARCH else {})))
    return groups, info
