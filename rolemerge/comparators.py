"""Four more comparison methods of RoleMerge's Table 1 (arXiv 2608.04454 §5.1, App. C.1, D.1).

RoleMerge compares against Sub-MoE and NAMEx on all three models and, on DeepSeek-VL2-Tiny,
also against MergeMoE and REAM (M-SMoE, HC-SMoE and REAP are in `rolemerge.baselines`). Each
method here has two halves:

    calibration   `ComparatorRecorder` (forward hooks on every MoE block's `experts` module)
                  accumulates, per MoE layer, the features of NEEDS[method]; `collect` runs it
    merging       `merge_layer(method, W, feats, K)` turns one layer's N experts into K

Features (per layer; T = calibration tokens where the recorder's mask is True; p = softmax of
the router logits z = W_router x over all N experts; f_e(x) the output of expert e, every
expert run on every token, as in `baselines.expert_outputs`):

    count [N]            tokens that route to e (the model's top-k)        = baselines' count
    tokens               T                                                 = baselines' tokens
    logit_gram [N, N]    sum_t z_t z_t^T                                   = baselines' logit_gram
    out_sum [N, H]       sum_t f_e(x_t)                                    = baselines' out_sum
    out_cos_sum [N, N]   sum_t cos(f_i(x_t), f_j(x_t))                     (Sub-MoE)
    ream_out_sum [N, H]  sum_t p_e(t) f_e(x_t)                             (REAM)
    ream_sal_sum [N]     sum_{t: e in top-k(t)} p_e(t) ||p_e(t) f_e(x_t)||  (REAM)
    x_sample [m, H]      a uniform sample (without replacement, seeded) of m calibration inputs
    x_sample_topk [m, k] their top-k expert indices                        (MergeMoE, REAM)
    x_sample_key [m]     the sample's priority keys (bottom-m sampling; keeps it mergeable)

The names shared with `baselines.FeatureRecorder` have its exact definitions, so the two dicts
can be merged either way round. Everything is a float64 sum except the token sample, which is
the one non-sum: MergeMoE's least-squares fit and REAM's neuron alignment need the experts'
intermediate activations on the same tokens under weights known only after grouping, which no
fixed-size sum holds. Memory per layer: N^2 (logit_gram) + N^2 (out_cos_sum) + 2 N H (out_sum,
ream_out_sum) + m (H + k + 1), m = 2048 by default; all far below N*H*I.

----------------------------------------------------------------------------------------------
Sub-MoE (Li et al., "Sub-MoE: Efficient Mixture-of-Expert LLMs Compression via Subspace Expert
Merging", arXiv 2506.23266, AAAI 2026)
  Definition: (1) adaptive expert clustering: similarity Sim(E_i, E_j) = (1/m) sum_l
  cos(E_i(x_l), E_j(x_l)) over calibration tokens x_l; K-means (k-means++) on the distance
  1 - Sim into K groups. (2) subspace merging: for each weight matrix, the group's experts are
  concatenated W = [W_1, ..., W_n] (along the input axis), joint SVD W = U S [V_1, ..., V_n]
  (shared U, expert blocks V_i), V_G = sum_i f_i V_i with the within-group activation
  frequencies f_i, W_G = U S V_G (eqs. 5-7).
  Official code followed: the public reproduction zhy617/SMoE (`calculate_expert_similarity_matrix`
  in src/qwen/analysis/direct_expert_similarity.py: per-token cosine averaged, diagonal 1;
  `cluster_experts_kmeans` in src/qwen/compress/kmeans_cluster.py: KMeans(k-means++, n_init=10,
  random_state=42) on the rows of 1 - Sim; `svd_subspace_alignment` / `get_cluster_relative_
  frequencies` in src/qwen/compress/merge_experts.py: concat along dim 1, column blocks of V^T,
  frequency weights, uniform when a group has no routed token; router rows averaged with the
  same weights, its default branch: the optional SVD router merge and ln f_k logit bias are
  not applied). The authors' code (lliai/MoERazor) is not public. REAP's port (CerebrasResearch/reap, `submoe` in src/reap/merge.py, k-means on
  distance rows in src/reap/cluster.py) was read too: its `V.reshape(n, r, -1)` does not cut
  V^T into the experts' column blocks, so we follow zhy617's block split, which matches eq. 6.
  Adapted: our own greedy k-means++ / Lloyd, scikit-learn's algorithm (scikit-learn is not a
  dependency; same n_init=10, seed 42 of our own generator, so not the same draws; empty clusters
  refilled with the farthest point; `eval.tools.kmeans_check` compares the inertias); similarity averaged over all tokens at
  once (zhy617 averages per example, then over examples). `rank` (default: full) truncates the
  joint SVD; note that at full rank U S V_G = sum_i f_i W_i exactly (W_i = U S V_i), so the
  untruncated merge equals frequency averaging (computed directly) and Sub-MoE differs from it
  by its grouping. Cost: one N^2 H product per token at calibration; with `rank`, one SVD of
  [I, nH] / [H, nI] per group and matrix.

NAMEx (Nguyen et al., "Expert Merging in Sparse Mixture of Experts with Nash Bargaining",
arXiv 2510.16138, ICLR 2026)
  Definition (verified from the abstract and public summaries; the method section and the code
  anh147/NAMEx were not reachable): each expert's "domain vector" tau_i = theta_i - theta_base
  (its deviation from a base expert) is a player's utility direction; the merge step is the Nash
  Bargaining Solution, which (Navon et al., "Multi-Task Learning as a Bargaining Game", arXiv
  2202.01017, Thm. 5.1, the formulation NAMEx builds on) is Delta = sum_i alpha_i tau_i with
  alpha > 0 solving (G^T G) alpha = 1 / alpha, G = [tau_1, ..., tau_n]; NAMEx adds complex
  momentum to propagate the base expert across layers during training (EP-CAMEx).
  Adapted (training-free, every choice named): groups and base experts from M-SMoE's rule (the
  K most frequent experts are bases, the rest join the base with the most similar router
  logits: `baselines.msmoe_groups`); base = the group's most frequent member; tau over all of
  an expert's weights (gate, up, down flattened); alpha by Newton's method on the strictly
  convex 1/2 a^T M a - sum log a (its stationary point is M a = 1/a; a 1e-9 relative ridge keeps
  M definite); the bargaining ball's radius is the length of the frequency-weighted merge's
  step, eps = ||sum_i f_i tau_i||, so theta_G = theta_base + eps Delta / ||Delta||. The complex
  momentum is not applied: it propagates a trained base expert from layer to layer, and a
  pretrained checkpoint has no such shared expert (its layers' experts are unrelated).
  Router rows: frequency-weighted average (the caller's default). Cost: an n x n Gram per group.

MergeMoE (Miao et al., "MergeMoE: Efficient Compression of MoE Models via Expert Output
Merging", arXiv 2510.14436)
  Definition (verified from the paper's opening sections and a public summary; the method
  section was not reachable, no code is public): the MoE output is Y mask_topK(softmax(W_r X))^T
  with Y = [E_1(X) ... E_N(X)]; merging N -> K inserts a summation matrix A [K, N] (A_ij = 1 if
  expert j is in group i) and a merging matrix B [N, K] (B_ji = w_j): Y B A mask(...)^T, so the
  merged expert should reproduce E'_G(x) ~ sum_{j in G} w_j E_j(x); the compression matrices are
  fitted by least squares on calibration data.
  Assumptions (not verifiable here; no MergeMoE code was found): groups from expert-output
  clustering, HC-SMoE's grouping as `baselines.hcsmoe_groups` runs it by default (average linkage
  on the Euclidean distance of the experts' mean outputs; `linkage` option); w_j = within-group activation
  frequency; W'_G, W'_U the w-weighted averages (the naive construction) and W'_D the ridge
  least-squares fit min ||W'_D h'(X_G) - sum_j w_j E_j(X_G)||^2 + lam ||W'_D - sum_j w_j W_Dj||^2
  over the sampled tokens X_G that route to a member of G, h'(x) = act(W'_G x) * (W'_U x),
  lam = ridge * tr(h' h'^T) / I (ridge 1e-3); a group no sampled token routes to keeps the
  averaged W'_D. Router rows: frequency-weighted average. Cost: an [I, I] solve per group.

REAM (Jha et al., "REAM: Merging Improves Pruning of Experts in LLMs", arXiv 2604.04356)
  Definition: saliency = REAP's router-weighted expert activation norm; the K most salient
  experts are centroids ("pseudo-pruning"); taken in order of decreasing saliency, each centroid
  takes the up to C - 1 (C = 16) still unassigned non-centroid experts closest to it under
  d_ij = 1 - (s_out + s_gate) / 2; each group is merged with saliency weights after aligning
  every member's neurons to the centroid's (Hungarian matching on activation + weight features);
  the merged expert keeps the centroid's router row.
  Official code followed (SamsungSAILMontreal/ream): `reap` (ream/saliency.py) on the outputs of
  `run_all_experts(gated_sim=True)` (ream/moe_utils.py), which are already multiplied by p, so
  the saliency is mean_{routed t} p_e ||p_e f_e|| (p the full softmax, not renormalised); zero
  saliency replaced by min(0.5, smallest positive) (`Merger.fit`); `pseudo_group` and
  `expert_similarity` (ream/ream.py): s_out = (1 + cos(mean_t p_i f_i, mean_t p_j f_j)) / 2,
  s_gate = 1 - ||z_i - z_j|| / max ||.|| with z_e the unit-normalised router-logit column
  (`dist2sim`, `normalize_rows`, ream/utils.py); `Merger._merge` (ream/merger.py, merging
  "logits+weights"): cost = cdist of unit-normalised neuron activation vectors + cdist of
  unit-normalised PCA-64 neuron weight features ([gate_i | up_i | down_:,i], rows normalised,
  `experts_weight_matrix` / `pca_reduce` in ream/weight_utils.py), `linear_sum_assignment`,
  `apply_perm_to_ffn`, weights = saliency / sum; router (and score-correction bias) rows of the
  centroids kept.
  Adapted: non-sequential (every layer's features from one pass of the original model; the
  official default re-runs each merged layer before the next; the RoleMerge port is
  non-sequential too, App. D.1); saliency = sum / count over all batches (official: mean of
  per-batch means); the activation features come from one token sample shared by all experts
  (official draws a different random subset of tokens for each expert inside
  `run_all_experts`, so its activation cost compares different tokens); exact PCA (eigh of the
  Gram) instead of the randomised `torch.pca_lowrank`; ties broken by lower index. Neuron
  matching uses scipy's `linear_sum_assignment` when scipy is installed, else the exact
  Hungarian `linear_assignment` below. Cost: one I x I assignment per merged member.
"""
import math

import numpy as np
import torch

from rolemerge import baselines as bl
from rolemerge.blocks import moe_blocks

# deferred: scipy (optional, not in requirements.txt: the Hungarian assignment falls back to our own without it)

COMPARATORS = ("submoe", "namex", "mergemoe", "ream")
NEEDS = {
    "submoe": {"count", "tokens", "out_cos_sum"},
    "namex": {"count", "logit_gram"},
    "mergemoe": {"count", "tokens", "out_sum", "x_sample", "x_sample_topk"},
    "ream": {"count", "logit_gram", "ream_out_sum", "ream_sal_sum", "x_sample"},
}
SAMPLE_TOKENS = 2048
OPTIONS = {"submoe": {"rank", "seed", "n_init"}, "namex": {"ridge"}, "mergemoe": {"ridge", "linkage"},
           "ream": {"group_size", "pca_dim", "merging"}}
COMMON_OPTIONS = {"act", "groups"}


# ----------------------------------------------------------------------------- calibration

def output_cosines(y):
    """sum_t cos(f_i(x_t), f_j(x_t)) of y [T, N, H] -> [N, N] float64 (a zero output has cosine 0)."""
    y = y.double()
    n = y.norm(dim=-1, keepdim=True)
    u = torch.where(n > 0, y / n.clamp_min(1e-300), torch.zeros_like(y))
    return torch.einsum("tih,tjh->ij", u, u)


def ream_sums(z, y, idx):
    """REAM's two sums for one batch: z [T, N] router logits, y [T, N, H] expert outputs, idx
    [T, k] top-k. p = softmax(z) (float32, as the official forward); returns (ream_out_sum
    [N, H] = sum_t p f, ream_sal_sum [N] = sum over routed (t, e) of p_e ||p_e f_e||)."""
    p = torch.softmax(z.float(), dim=-1).double()                     # [T, N]
    g = p[..., None] * y.double()                                     # gated outputs [T, N, H]
    routed = torch.zeros_like(p, dtype=torch.bool).scatter_(1, idx, True)
    sal = torch.where(routed, p * g.norm(dim=-1), torch.zeros_like(p)).sum(0)
    return g.sum(0), sal


class ComparatorRecorder:
    """Forward hooks on every routed-expert block's `experts` module (inputs: hidden states
    [T, H], top_k_index [T, k], top_k_weights [T, k]) that accumulate, over the tokens where
    `self.mask` ([T] bool, set by the caller per batch; None = all) is True, the features that
    `methods` need (module docstring). `.feats`: list over MoE layers (order of
    `rolemerge.blocks.moe_blocks`) of dicts name -> float64 sum tensor, int `tokens`, or the
    token sample (`x_sample` float32 [m, H], `x_sample_topk` int64 [m, k], `x_sample_key` [m]).
    Memory per layer <= 2 N^2 + 2 N H + m (H + k + 1) numbers, m = sample_tokens; no
    per-token storage beyond the fixed-size sample (seeded by `seed`: the same batches give the
    same sample). `.remove()` removes the hooks. Raises ValueError for an unknown method."""

    def __init__(self, model, methods=COMPARATORS, sample_tokens=SAMPLE_TOKENS, seed=0):
        unknown = [m for m in methods if m not in COMPARATORS]
        if unknown:
            raise ValueError(f"unknown comparator(s) {unknown}; choose from {COMPARATORS}")
        self.need = set().union(*(NEEDS[m] for m in methods)) | {"count", "tokens"}
        self.m = int(sample_tokens)
        self.gen = torch.Generator().manual_seed(seed)
        self.blocks = moe_blocks(model)
        self.feats, self.mask, self.handles = [], None, []
        for i, (_, block) in enumerate(self.blocks):
            N, H = block.gate.weight.shape
            f = {"count": torch.zeros(N, dtype=torch.float64), "tokens": 0}
            shapes = {"logit_gram": (N, N), "out_sum": (N, H), "out_cos_sum": (N, N),
                      "ream_out_sum": (N, H), "ream_sal_sum": (N,)}
            for name, shape in shapes.items():
                if name in self.need:
                    f[name] = torch.zeros(shape, dtype=torch.float64)
            self.feats.append(f)
            self.handles.append(block.experts.register_forward_hook(self._hook(i, block)))

    def _sample(self, f, x, idx):
        """Bottom-m sampling: every token gets a uniform random key, the m smallest keys stay
        (a uniform sample without replacement of all tokens seen, whatever the batching)."""
        key = torch.rand(x.shape[0], generator=self.gen, dtype=torch.float64)
        if "x_sample" in f:
            key = torch.cat([f["x_sample_key"], key])
            x = torch.cat([f["x_sample"], x.float()])
            idx = torch.cat([f["x_sample_topk"], idx])
        keep = key.argsort()[:self.m].sort().values                    # keep arrival order
        f["x_sample_key"], f["x_sample"], f["x_sample_topk"] = key[keep], x[keep].float(), idx[keep].long()

    def _hook(self, i, block):
        need = self.need

        def fn(module, args, out):
            x, idx = args[0], args[1]
            if self.mask is not None:
                x, idx = x[self.mask], idx[self.mask]
            f = self.feats[i]
            N = f["count"].numel()
            f["count"] += torch.bincount(idx.reshape(-1), minlength=N).double()
            f["tokens"] += x.shape[0]
            z = (x.float() @ block.gate.weight.float().T).double()           # router logits [T, N]
            if "logit_gram" in need:
                f["logit_gram"] += z.T @ z
            if need & {"out_sum", "out_cos_sum", "ream_out_sum", "ream_sal_sum"}:
                y = bl.expert_outputs(module, x)                              # [T, N, H]
                if "out_sum" in need:
                    f["out_sum"] += y.double().sum(0)
                if "out_cos_sum" in need:
                    f["out_cos_sum"] += output_cosines(y)
                if "ream_out_sum" in need:
                    o, s = ream_sums(z, y, idx)
                    f["ream_out_sum"] += o
                    f["ream_sal_sum"] += s
            if "x_sample" in need and x.shape[0]:
                self._sample(f, x.detach(), idx.detach())
        return fn

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def collect(model, batches, methods=COMPARATORS, sample_tokens=SAMPLE_TOKENS, seed=0):
    """Run `model` over `batches` (dicts of model inputs with an attention_mask [B, L]) and
    return the per-layer comparator features of `methods` (list over MoE layers of dicts, see
    the module docstring), counted over the non-padding positions."""
    return bl.run_recorder(ComparatorRecorder(model, methods, sample_tokens, seed), model, batches)


# ----------------------------------------------------------------------------- shared pieces

def frequency_weights(count, group):
    """Within-group activation frequencies count_e / sum (uniform when no member was routed)."""
    c = [float(count[e]) for e in group]
    s = sum(c)
    return [x / s for x in c] if s > 0 else [1.0 / len(group)] * len(group)


def expert_hidden(gate, up, x, act):
    """Intermediate activations act(gate x) * (up x): gate, up [n, I, H], x [T, H] -> [n, T, I]."""
    return act(torch.einsum("th,nih->nti", x, gate)) * torch.einsum("th,nih->nti", x, up)


def linear_assignment(cost):
    """Exact minimum-cost perfect matching of a square cost matrix [n, n] (Hungarian method with
    potentials, O(n^3), each step vectorised with numpy: about 3 s for n = 896 on one core).
    Returns col [n] long (row i -> column col[i]); ties between optimal matchings may be broken
    differently from scipy's. Raises ValueError for a non-square matrix."""
    C = np.asarray(torch.as_tensor(cost, dtype=torch.float64).cpu().numpy())
    n = C.shape[0]
    if C.shape != (n, n):
        raise ValueError(f"cost matrix must be square, got {C.shape}")
    u, v = np.zeros(n + 1), np.zeros(n + 1)                 # row / column potentials
    p = np.zeros(n + 1, dtype=np.int64)                     # p[j]: row matched to column j (1-based, 0 = none)
    way = np.zeros(n + 1, dtype=np.int64)
    for i in range(1, n + 1):
        p[0], j0 = i, 0
        minv = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        while True:                                         # grow the alternating tree until a free column
            used[j0] = True
            i0 = p[j0]
            free = ~used[1:]
            cur = C[i0 - 1] - u[i0] - v[1:]
            better = free & (cur < minv[1:])
            minv[1:][better] = cur[better]
            way[1:][better] = j0
            cand = np.where(free, minv[1:], np.inf)
            j1 = int(cand.argmin()) + 1
            delta = cand[j1 - 1]
            u[p[used]] += delta
            v[used] -= delta
            minv[1:][free] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:                                           # augment along the path
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
    col = np.empty(n, dtype=np.int64)
    col[p[1:] - 1] = np.arange(n)
    return torch.from_numpy(col)


def _assign(cost):
    """The optimal assignment of `cost` [n, n]: scipy's when it is installed (faster on large I), else
    `linear_assignment` (the same optimum)."""
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError:
        return linear_assignment(cost)
    return torch.as_tensor(linear_sum_assignment(cost.double().cpu().numpy())[1], dtype=torch.long)


def _groups_from_labels(labels, K):
    groups = [sorted(int(e) for e in (labels == c).nonzero().flatten()) for c in range(K)]
    return sorted(groups)


# ----------------------------------------------------------------------------- Sub-MoE

def submoe_similarity(out_cos_sum, tokens):
    """Sim(E_i, E_j) = (1/T) sum_t cos(E_i(x_t), E_j(x_t)) [N, N] with diagonal 1 (arXiv
    2506.23266 §3.1; zhy617/SMoE calculate_expert_similarity_matrix)."""
    S = torch.as_tensor(out_cos_sum, dtype=torch.float64) / max(float(tokens), 1.0)
    return S.fill_diagonal_(1.0)


def _fill_empty(labels, d, K):
    """Give every empty cluster the point farthest from its centre among clusters of >= 2 points
    (d [N, K] point-centre distances); labels changed in place."""
    for c in range(K):
        if not bool((labels == c).any()):
            size = torch.bincount(labels, minlength=K)
            own = d.gather(1, labels[:, None]).flatten()
            labels[int(torch.where(size[labels] > 1, own, torch.full_like(own, -1.0)).argmax())] = c
    return labels


def kmeans_plusplus(X, K, g):
    """Greedy k-means++ seeding (Arthur & Vassilvitskii 2007, as scikit-learn's `_kmeans_plusplus`):
    the first centre a uniform row of X [N, F]; each next one the best of 2 + floor(ln K) candidate
    rows drawn with P(x) ~ D(x)^2 (D = distance to the nearest centre so far), best = the lowest
    potential sum_x min(D(x)^2, ||x - c||^2). g: a torch.Generator. Returns the centres [K, F]."""
    N = X.shape[0]
    trials = 2 + int(math.log(K))
    idx = [int(torch.randint(N, (1,), generator=g))]
    d2 = (X - X[idx[0]]).pow(2).sum(1)                                   # [N] D(x)^2
    for _ in range(1, K):
        pot = float(d2.sum())
        cand = (torch.multinomial(d2 / pot, trials, replacement=True, generator=g) if pot > 0
                else torch.randint(N, (trials,), generator=g))
        new = torch.minimum(d2[None], torch.cdist(X[cand], X).pow(2))  # [trials, N] D^2 with each candidate
        best = int(new.sum(1).argmin())
        idx.append(int(cand[best]))
        d2 = new[best]
    return X[idx]


def hartigan(X, labels, K, max_pass=100):
    """Hartigan's single-point moves on a k-means partition (Hartigan & Wong 1979, Telgarsky &
    Vattani 2010): point x of cluster a (n_a > 1) moves to the cluster b minimising
    n_b / (n_b + 1) ||x - c_b||^2 when that is below n_a / (n_a - 1) ||x - c_a||^2, which lowers the
    inertia by the difference; centres updated after each move; passes until none moves. Every
    Hartigan optimum is a Lloyd optimum, not the reverse. X [N, F] float64, labels [N] with K
    non-empty clusters -> labels [N] (long)."""
    x = X.numpy()
    lab = labels.numpy().copy()
    n = np.bincount(lab, minlength=K).astype(np.float64)
    c = np.stack([x[lab == k].mean(0) for k in range(K)])
    for _ in range(max_pass):
        moved = False
        for i in range(len(x)):
            a = lab[i]
            if n[a] <= 1:
                continue
            d = ((c - x[i]) ** 2).sum(1)
            add = n / (n + 1) * d
            add[a] = np.inf
            b = int(add.argmin())
            if add[b] < n[a] / (n[a] - 1) * d[a] * (1 - 1e-12):
                c[a] = (n[a] * c[a] - x[i]) / (n[a] - 1)
                c[b] = (n[b] * c[b] + x[i]) / (n[b] + 1)
                n[a] -= 1
                n[b] += 1
                lab[i] = b
                moved = True
        if not moved:
            break
    return torch.from_numpy(lab)


def lloyd(X, C, K, max_iter, stop):
    """Lloyd iterations on the rows of X [N, F] (float64) from the centres C [K, F]: each step assigns
    every row to its nearest centre (an emptied cluster takes the point farthest from its centre,
    `_fill_empty`) and moves each centre to its cluster's mean. Stops after max_iter steps, when the
    assignment repeats the previous one, or when the squared centre shift sum_k ||c_k' - c_k||^2 of
    a step is at most `stop` (scikit-learn's `_kmeans_single_lloyd` rule; `kmeans` passes tol times
    the mean feature variance). Returns the last centres [K, F]."""
    labels = None
    for _ in range(max_iter):
        d = torch.cdist(X, C)
        new = _fill_empty(d.argmin(1), d, K)
        if labels is not None and torch.equal(new, labels):
            break                                                        # labels stable: converged
        labels = new
        newC = torch.stack([X[labels == c].mean(0) for c in range(K)])
        shift, C = float((newC - C).pow(2).sum()), newC
        if shift <= stop:
            break
    return C


def kmeans(X, K, n_init=10, seed=42, max_iter=300, tol=1e-4):
    """K-means of the rows of X [N, F] as scikit-learn's KMeans(init="k-means++", n_init) runs it:
    greedy k-means++ seeding (`kmeans_plusplus`), Lloyd iterations (`lloyd`) until the squared centre
    shift is at most tol times the mean feature variance or the labels stop changing, best of n_init by
    inertia; an emptied cluster takes the point farthest from its centre. One addition: each run's
    Lloyd optimum is refined by Hartigan's moves (`hartigan`), which only lower the inertia; our
    draws differ from scikit-learn's, and with the refinement the result is no worse than
    scikit-learn's in 27+ of 30 synthetic cases (`eval.tools.kmeans_check`). Returns labels [N]
    (long). Deterministic for a seed. Raises ValueError unless 1 <= K <= N."""
    X = torch.as_tensor(X, dtype=torch.float64)
    N = X.shape[0]
    if not 1 <= K <= N:
        raise ValueError(f"K={K} must be in [1, N={N}]")
    g = torch.Generator().manual_seed(seed)
    stop = tol * float(X.var(0, unbiased=False).mean())                  # scikit-learn's _tolerance
    best, best_inertia = None, math.inf
    for _ in range(n_init):
        C = lloyd(X, kmeans_plusplus(X, K, g), K, max_iter, stop)
        d = torch.cdist(X, C)
        labels = hartigan(X, _fill_empty(d.argmin(1), d, K), K)       # never raises the inertia
        inertia = float(sum((X[labels == c] - X[labels == c].mean(0)).pow(2).sum() for c in range(K)))
        if inertia < best_inertia - 1e-12:
            best, best_inertia = labels.clone(), inertia
    return best


def svd_merge(mats, weights, rank=None):
    """Sub-MoE subspace merge (arXiv 2506.23266 eqs. 5-7) of n matrices mats [n, r, c]:
    [W_1 ... W_n] = U S [V_1 ... V_n] (joint SVD of the column concatenation [r, n c]), merged
    U S sum_i w_i V_i (w normalised to sum 1), in float64. rank: keep the top `rank` singular
    triplets (None: all). The thin SVD is exact (W_i = U S V_i), so with all triplets the merge
    is sum_i w_i W_i, computed as such (the SVD of [I, nH] would cost minutes per layer).
    Returns [r, c] in mats' dtype."""
    n, r, c = mats.shape
    w = torch.as_tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    if rank is None or rank >= min(r, n * c):
        return torch.einsum("n,nrc->rc", w, mats.double()).to(mats.dtype)
    cat = mats.double().permute(1, 0, 2).reshape(r, n * c)                 # [W_1 ... W_n]
    U, S, Vt = torch.linalg.svd(cat, full_matrices=False)
    if rank is not None:
        U, S, Vt = U[:, :rank], S[:rank], Vt[:rank]
    V = Vt.reshape(Vt.shape[0], n, c)                                         # column blocks V_i
    merged = (U * S) @ torch.einsum("n,rnc->rc", w, V)
    return merged.to(mats.dtype)


def submoe_groups(feats, K, seed=42, n_init=10):
    """Sub-MoE grouping: K-means on the rows of 1 - Sim (zhy617/SMoE cluster_experts_kmeans)."""
    D = 1.0 - submoe_similarity(feats["out_cos_sum"], feats["tokens"])
    return _groups_from_labels(kmeans(D, K, n_init=n_init, seed=seed), K)


def _submoe(W, feats, K, groups, opts):
    rank = opts.get("rank")
    if groups is None:
        groups = submoe_groups(feats, K, opts.get("seed", 42), opts.get("n_init", 10))
    weights = [frequency_weights(feats["count"], g) for g in groups]
    out = {k: [] for k in ("gate", "up", "down")}
    for g, w in zip(groups, weights):
        for k in out:
            out[k].append(svd_merge(W[k][g], w, rank) if len(g) > 1 else W[k][g[0]].clone())
    return dict({k: torch.stack(v) for k, v in out.items()}, groups=groups, weights=weights, router=None,
                bias=None, info={"rank": rank})


# ----------------------------------------------------------------------------- NAMEx

def nash_weights(M, ridge=1e-9, tol=1e-12, max_iter=200):
    """Nash Bargaining weights alpha > 0 with (M alpha)_i = 1 / alpha_i, M = G^T G [n, n] the
    Gram of the players' utility directions (Navon et al., arXiv 2202.01017, Thm. 5.1): the
    unique minimiser of 1/2 a^T M a - sum_i log a_i, found by damped Newton steps that keep
    a > 0. ridge (relative to mean diag M) keeps M definite. M must be symmetric (NAMEx passes a
    Gram): for a non-symmetric M, M a - 1 / a is not f's gradient and the solve may not converge.
    Raises ValueError if M has a zero diagonal entry (a player with no direction) or the iteration
    does not converge."""
    M = torch.as_tensor(M, dtype=torch.float64)
    n = M.shape[0]
    d = M.diagonal()
    if bool((d <= 0).any()):
        raise ValueError("a domain vector is zero (an expert identical to its base): its bargaining utility "
                         "is undefined")
    M = M + ridge * float(d.mean()) * torch.eye(n, dtype=torch.float64)
    a = 1.0 / M.diagonal().sqrt()                         # exact when the directions are orthogonal
    f = lambda a: 0.5 * float(a @ M @ a) - float(a.log().sum())
    for _ in range(max_iter):
        grad = M @ a - 1.0 / a
        if float((a * (M @ a) - 1.0).abs().max()) < tol:
            return a
        step = torch.linalg.solve(M + torch.diag(1.0 / a ** 2), grad)
        # damped phase: halve until f decreases. Near the optimum (Newton decrement^2 = grad . step
        # in [0, 1/16)) f's decrease falls inside its rounding error, so there only a > 0 is kept:
        # pure Newton steps, quadratic convergence (Boyd & Vandenberghe 9.5.3)
        t, fa, damped = 1.0, f(a), not 0.0 <= float(grad @ step) < 1.0 / 16
        while bool(((a - t * step) <= 0).any()) or (damped and f(a - t * step) > fa):
            t *= 0.5
            if t < 1e-20:
                raise ValueError("Nash bargaining solve stalled")
        a = a - t * step
    if float((a * (M @ a) - 1.0).abs().max()) < 1e-8:
        return a
    raise ValueError("Nash bargaining solve did not converge")


def namex_merge(thetas, base, freq, ridge=1e-9):
    """NAMEx-style training-free merge of one group (see module docstring). thetas [n, P]
    flattened expert weights, base: index of the base expert, freq [n]: within-group
    frequencies. tau_i = theta_i - theta_base (i != base); alpha = nash_weights(tau tau^T);
    Delta = sum alpha_i tau_i; eps = ||sum_i freq_i tau_i||; merged = theta_base + eps Delta /
    ||Delta||. Returns (merged [P], coefficients [n] with merged = sum_i c_i theta_i)."""
    n = thetas.shape[0]
    th = thetas.double()
    others = [i for i in range(n) if i != base]
    c = torch.zeros(n, dtype=torch.float64)
    c[base] = 1.0
    if not others:
        return th[base].to(thetas.dtype), c
    tau = th[others] - th[base]                                          # [n-1, P]
    fw = torch.as_tensor(freq, dtype=torch.float64)[others]
    eps = float((fw @ tau).norm())
    if eps == 0.0:
        return th[base].to(thetas.dtype), c
    alpha = nash_weights(tau @ tau.T, ridge)
    delta = alpha @ tau
    s = eps / float(delta.norm())
    c[others] = s * alpha
    c[base] = 1.0 - float(c[others].sum())
    return (th[base] + s * delta).to(thetas.dtype), c


def _namex(W, feats, K, groups, opts):
    if groups is None:
        groups = bl.msmoe_groups(feats["count"], feats["logit_gram"], K)
    N, I, H = W["gate"].shape
    out, weights, bases = [], [], []
    for g in groups:                                   # one group's flattened experts at a time
        flat = torch.cat([W["gate"][g].reshape(len(g), -1), W["up"][g].reshape(len(g), -1),
                          W["down"][g].reshape(len(g), -1)], 1)
        base = max(g, key=lambda e: (float(feats["count"][e]), -e))
        m, c = namex_merge(flat, g.index(base), frequency_weights(feats["count"], g), opts.get("ridge", 1e-9))
        out.append(m)
        weights.append(c.tolist())
        bases.append(base)
    out = torch.stack(out)
    gate, up, down = out.split([I * H, I * H, H * I], 1)
    return dict(gate=gate.reshape(-1, I, H), up=up.reshape(-1, I, H), down=down.reshape(-1, H, I), groups=groups,
                weights=weights, router=None, bias=None, info={"base": bases})


# ----------------------------------------------------------------------------- MergeMoE

def mergemoe_down(gate, up, down, w, x, act, ridge=1e-3):
    """MergeMoE merged expert of one group (module docstring): gate, up [n, I, H], down [n, H, I],
    w [n] merge weights, x [T, H] calibration inputs routed to the group. W'_G = sum w_j W_Gj,
    W'_U = sum w_j W_Uj; W'_D = argmin ||W'_D h'(X) - sum_j w_j E_j(X)||^2 + lam ||W'_D - W_avg||^2,
    lam = ridge tr(h'^T h') / I: W'_D = (Q + lam W_avg)(P + lam 1)^-1 with P = h'^T h' [I, I],
    Q = Y^T h' [H, I]. Returns (gate' [I, H], up' [I, H], down' [H, I]) in float32."""
    w = torch.as_tensor(w, dtype=torch.float64)
    g2 = torch.einsum("n,nih->ih", w, gate.double())
    u2 = torch.einsum("n,nih->ih", w, up.double())
    avg = torch.einsum("n,nhi->hi", w, down.double())
    if x.shape[0] == 0:
        return g2.float(), u2.float(), avg.float()
    x = x.double()
    h2 = expert_hidden(g2[None], u2[None], x, act)[0]                   # [T, I]
    hj = expert_hidden(gate.double(), up.double(), x, act)               # [n, T, I]
    Y = torch.einsum("n,nti,nhi->th", w, hj, down.double())              # [T, H] target
    P, Q = h2.T @ h2, Y.T @ h2
    I = P.shape[0]
    lam = ridge * float(P.diagonal().sum()) / I
    A = P + lam * torch.eye(I, dtype=torch.float64)
    d2 = torch.linalg.solve(A, (Q + lam * avg).T).T                      # (Q + lam avg) A^-1, A symmetric
    return g2.float(), u2.float(), d2.float()


def _mergemoe(W, feats, K, groups, opts, act):
    if groups is None:
        groups = bl.hcsmoe_groups(feats["out_sum"] / max(float(feats["tokens"]), 1.0), K,
                                  opts.get("linkage", "average"))
    X, top = feats["x_sample"], feats["x_sample_topk"]
    out = {k: [] for k in ("gate", "up", "down")}
    weights, fitted = [], []
    for g in groups:
        w = frequency_weights(feats["count"], g)
        weights.append(w)
        if len(g) == 1:
            for k in out:
                out[k].append(W[k][g[0]].clone())
            fitted.append(0)
            continue
        rows = torch.isin(top, torch.tensor(g)).any(1)
        res = mergemoe_down(W["gate"][g], W["up"][g], W["down"][g], w, X[rows], act, opts.get("ridge", 1e-3))
        for k, t in zip(("gate", "up", "down"), res):
            out[k].append(t)
        fitted.append(int(rows.sum()))
    return dict({k: torch.stack(v) for k, v in out.items()}, groups=groups, weights=weights, router=None,
                bias=None, info={"fit_tokens": fitted})


# ----------------------------------------------------------------------------- REAM

def ream_saliency(ream_sal_sum, count):
    """REAM saliency (official `reap` on gated outputs): ream_sal_sum / count, experts never
    routed get 0, then zeros -> min(0.5, smallest positive) (`Merger.fit`), so that unused
    experts can still be merged. All zero -> all 1 (uniform weights)."""
    s = torch.as_tensor(ream_sal_sum, dtype=torch.float64)
    c = torch.as_tensor(count, dtype=torch.float64)
    s = torch.where(c > 0, s / c.clamp_min(1e-300), torch.zeros_like(s))
    if not bool((s > 0).any()):
        return torch.ones_like(s)
    return torch.where(s > 0, s, torch.full_like(s, min(0.5, float(s[s > 0].min()))))


def ream_distance(ream_out_sum, logit_gram):
    """REAM's expert distance d_ij = 1 - (s_out + s_gate) / 2 [N, N] (`pseudo_group`):
    s_out = (1 + cos(mean gated outputs)) / 2 (`expert_similarity`, eps 1e-8 like
    F.cosine_similarity), s_gate = 1 - ||z_i - z_j|| / max_kl ||z_k - z_l|| with z_e the
    unit-normalised router-logit columns (from the Gram: ||z_i - z_j||^2 = 2 - 2 cos_ij).
    Diagonal 0."""
    o = torch.as_tensor(ream_out_sum, dtype=torch.float64)
    n = o.norm(dim=-1)
    cos_out = (o @ o.T) / (n[:, None] * n[None, :]).clamp_min(1e-8)
    G = torch.as_tensor(logit_gram, dtype=torch.float64)
    gn = G.diagonal().clamp_min(0).sqrt()
    cos_z = G / ((gn[:, None] + 1e-8) * (gn[None, :] + 1e-8))
    zn = gn / (gn + 1e-8)                                                   # norms after normalize_rows
    dz = (zn[:, None] ** 2 + zn[None, :] ** 2 - 2 * cos_z).clamp_min(0).sqrt()
    s_gate = 1 - dz / dz.max() if float(dz.max()) > 0 else torch.ones_like(dz)
    d = 1 - ((1 + cos_out) / 2 + s_gate) / 2
    return d.fill_diagonal_(0.0)


def ream_groups(saliency, d, K, group_size=16):
    """REAM pseudo-grouping (`pseudo_group`): centroids = the K most salient experts (ties: lower
    index); in order of decreasing saliency each centroid takes itself plus the closest (ties:
    lower index) still unassigned non-centroids, up to group_size members; group_size 0: each
    non-centroid joins its nearest centroid (MC-SMoE style). Returns (groups sorted, centroid of
    each group). Raises ValueError when K * group_size < N (some expert would stay unassigned)."""
    s = torch.as_tensor(saliency, dtype=torch.float64)
    N = s.numel()
    if not 1 <= K <= N:
        raise ValueError(f"K={K} must be in [1, N={N}]")
    if group_size > 0 and K * group_size < N:
        raise ValueError(f"REAM group_size={group_size} with K={K} can hold only {K * group_size} of the {N} "
                         f"experts; use a larger group_size")
    cent = sorted(range(N), key=lambda e: (-float(s[e]), e))[:K]
    label = [-1] * N
    for c, e in enumerate(cent):
        label[e] = c
    if group_size > 0:
        for c, e in enumerate(cent):
            near = sorted(range(N), key=lambda j: (float(d[e, j]), j))
            taken = 1
            for j in near:
                if taken >= group_size:
                    break
                if j != e and label[j] == -1:
                    label[j] = c
                    taken += 1
            if all(x >= 0 for x in label):
                break
    else:
        for j in range(N):
            if label[j] == -1:
                label[j] = min(range(K), key=lambda c: (float(d[cent[c], j]), c))
    groups = [sorted(j for j in range(N) if label[j] == c) for c in range(K)]
    order = sorted(range(K), key=lambda c: groups[c])
    return [groups[c] for c in order], [cent[c] for c in order]


def ream_weight_features(gate, up, down, pca_dim=64):
    """Per-neuron weight features [N, I, r] (`experts_weight_matrix` + `pca_reduce`): rows
    [gate_i | up_i | down_:,i] (3H) unit-normalised (eps 1e-8), centred over all N I rows,
    projected on the top r = min(pca_dim, 3H) principal axes and scaled by the singular values
    (x V_r diag(s_r), as `pca_reduce`); exact PCA via eigh of the [3H, 3H] Gram."""
    N, I, H = gate.shape
    F = torch.cat([gate, up, down.transpose(1, 2)], 2).double()              # [N, I, 3H]
    F = F / (F.norm(dim=-1, keepdim=True) + 1e-8)
    X = F.reshape(N * I, 3 * H)
    X = X - X.mean(0, keepdim=True)
    evals, evecs = torch.linalg.eigh(X.T @ X)                              # ascending
    r = min(pca_dim, 3 * H)
    V, s = evecs[:, -r:].flip(1), evals[-r:].flip(0).clamp_min(0).sqrt()
    return (X @ (V * s)).reshape(N, I, r)


def _unit_rows(a):
    return a / (a.norm(dim=-1, keepdim=True) + 1e-8)


def _ream(W, feats, K, groups, opts, act):
    C = opts.get("group_size", 16)
    merging = opts.get("merging", "logits+weights")
    if merging not in ("logits+weights", "logits", "weights", "avg_freq"):
        raise ValueError(f"REAM merging={merging!r}; choose logits+weights (official default), logits, weights "
                         f"or avg_freq (no alignment)")
    sal = ream_saliency(feats["ream_sal_sum"], feats["count"])
    if groups is None:
        groups, cents = ream_groups(sal, ream_distance(feats["ream_out_sum"], feats["logit_gram"]), K, C)
    else:
        cents = [max(g, key=lambda e: (float(sal[e]), -e)) for g in groups]
    gate, up, down = W["gate"].double(), W["up"].double(), W["down"].double()
    act_feat = wfeat = None
    if "logits" in merging:
        act_feat = expert_hidden(gate, up, feats["x_sample"].double(), act).transpose(1, 2)   # [N, I, m]
        if act_feat.shape[-1] > 1:                                            # as `_merge`: one sample stays raw
            act_feat = _unit_rows(act_feat)
    if "weights" in merging:
        wfeat = _unit_rows(ream_weight_features(gate, up, down, opts.get("pca_dim", 64)))
    out = {k: [] for k in ("gate", "up", "down")}
    weights = []
    for g, c in zip(groups, cents):
        w = sal[g] / sal[g].sum()
        weights.append(w.tolist())
        mg, mu, md = (w[g.index(c)] * t[c] for t in (gate, up, down))
        for j, wj in zip(g, w):
            if j == c:
                continue
            perm = torch.arange(gate.shape[1])
            if merging != "avg_freq":
                cost = torch.zeros(gate.shape[1], gate.shape[1], dtype=torch.float64)
                if act_feat is not None:
                    cost += torch.cdist(act_feat[c], act_feat[j])
                if wfeat is not None:
                    cost += torch.cdist(wfeat[c], wfeat[j])
                perm = _assign(cost)
            mg, mu, md = mg + wj * gate[j][perm], mu + wj * up[j][perm], md + wj * down[j][:, perm]
        for k, t in zip(("gate", "up", "down"), (mg, mu, md)):
            out[k].append(t.float())
    bias = W.get("bias")
    return dict({k: torch.stack(v) for k, v in out.items()}, groups=groups, weights=weights,
                router=W["router"][cents].clone(), bias=None if bias is None else bias[cents].clone(),
                info={"centroids": cents, "saliency": sal.tolist()})


# ----------------------------------------------------------------------------- entry point

def _check(method, W, feats, K, opts):
    if method not in COMPARATORS:
        raise ValueError(f"unknown comparator {method!r}; choose from {COMPARATORS}")
    bad = set(opts) - OPTIONS[method] - COMMON_OPTIONS
    if bad:
        raise ValueError(f"{method}: unknown option(s) {sorted(bad)}; it takes {sorted(OPTIONS[method] | COMMON_OPTIONS)}")
    for k in ("gate", "up", "down", "router"):
        if k not in W:
            raise ValueError(f"W lacks {k!r}: give gate [N,I,H], up [N,I,H], down [N,H,I], router [N,H]")
    N, I, H = W["gate"].shape
    want = {"gate": (N, I, H), "up": (N, I, H), "down": (N, H, I), "router": (N, H)}
    if W.get("bias") is not None:
        want["bias"] = (N,)
    for k, s in want.items():
        if tuple(W[k].shape) != s:
            raise ValueError(f"W[{k!r}] has shape {tuple(W[k].shape)}, expected {s} (gate [N,I,H] = {(N, I, H)})")
    missing = sorted(n for n in NEEDS[method] if n not in feats)
    if missing:
        raise ValueError(f"{method}: features {missing} missing; record them with "
                         f"ComparatorRecorder(model, methods=({method!r},)) / collect()")
    if not 1 <= K <= N:
        raise ValueError(f"K={K} must be in [1, N={N}]")
    groups = opts.get("groups")
    if groups is not None:
        groups = sorted(sorted(int(e) for e in g) for g in groups)
        if len(groups) != K or sorted(e for g in groups for e in g) != list(range(N)):
            raise ValueError(f"groups must split the {N} experts into K={K} disjoint non-empty groups, got {groups}")
    return groups


def merge_layer(method, W, feats, K, **opts):
    """One MoE layer's N experts -> K with comparator `method` (module docstring per method).

    W: dict gate [N, I, H], up [N, I, H], down [N, H, I], router [N, H], optional bias [N]
    (float32; gate / up are the two halves of the fused gate_up_proj [N, 2I, H], gate first;
    expert(x) = down @ (act(gate x) * up x), act = SiLU unless opts['act'] is given). feats:
    that layer's feature dict (ComparatorRecorder, optionally merged with
    baselines.FeatureRecorder's). K: target experts. opts: act, groups (explicit groups: the
    method's merge operator on them), and per method: submoe rank / seed / n_init; namex ridge;
    mergemoe ridge / linkage; ream group_size / pca_dim / merging.
    Returns dict(groups = K sorted lists ordered by smallest member, gate [K, I, H], up [K, I, H],
    down [K, H, I] (same I: a dense merged expert), router [K, H] or None (None: the caller
    averages member rows with frequency weights), bias [K] or None, weights = per-group merge
    coefficients in group order, info = diagnostics). Raises ValueError naming the problem."""
    groups = _check(method, W, feats, K, opts)
    act = opts.get("act", torch.nn.functional.silu)
    with torch.no_grad():
        if method == "submoe":
            out = _submoe(W, feats, K, groups, opts)
        elif method == "namex":
            out = _namex(W, feats, K, groups, opts)
        elif method == "mergemoe":
            out = _mergemoe(W, feats, K, groups, opts, act)
        else:
            out = _ream(W, feats, K, groups, opts, act)
    for k in ("gate", "up", "down"):
        out[k] = out[k].to(W[k].dtype)
    if not all(bool(torch.isfinite(out[k]).all()) for k in ("gate", "up", "down")):
        raise ValueError(f"{method}: the merged experts are not finite (check the inputs for nan / inf)")
    return out
