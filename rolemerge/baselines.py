"""The RoleMerge paper's comparison methods, each with its own published criterion.

RoleMerge (arXiv 2608.04454) compares against expert-merging methods and, in App. D.1,
REAP pruning. Here, under the same harness (same calibration examples, same K per layer, same
merge operator `rolemerge.merge.merge_model`):

- **M-SMoE** (Li et al., "Merge, Then Compress: Demystify Efficient SMoE with Hints from Its
  Routing Policy", arXiv 2310.01334, §3.1-3.2): the K most frequently activated experts of a
  layer are *dominant*; every other expert joins the dominant expert whose **router logits**
  over the calibration tokens are most similar (cosine of the logit columns, their default
  similarity); each group is merged with activation-frequency weights. M-SMoE's neuron
  permutation alignment before merging and its layer-adaptive dominant count are not applied
  (one K for all layers, like every arm here).
- **HC-SMoE** (Chen et al., "Retraining-Free Merging of Sparse Mixture-of-Experts via
  Hierarchical Clustering", arXiv 2410.08589, §3): each expert is represented by its **output
  averaged over all calibration tokens** (every expert is run on every token, independent of
  routing); agglomerative clustering with **average linkage** on the cosine distance of those
  vectors down to K clusters; frequency-weighted merging.
- **REAP** (Lasby et al., "REAP the Experts: Why Pruning Prevails for One-Shot MoE
  Compression", arXiv 2510.13999, eq. 5): saliency
      S_j = (1 / |X_j|) sum_{x in X_j} g_j(x) * ||f_j(x)||_2,
  X_j the calibration tokens that route to j (top-k), g_j(x) the gate value the model applies
  (Qwen3-MoE: top-k softmax renormalised), f_j(x) expert j's output; the K most salient experts
  are kept, the rest pruned (router rows removed).
- *frequency pruning* (control, `rolemerge.model.prune_groups`): keep the K most used experts.

`collect_features` gathers, in one pass over calibration examples, everything the three
criteria need per MoE layer (no per-token storage):
  count [N]       tokens that route to e (top-k)
  logit_gram [N,N] sum_t z_t z_t^T of the router logits z_t = W_router x_t
  out_sum [N, H]  sum_t f_e(x_t) over all tokens (every expert on every token)
  reap_sum [N]    sum_{t: e in topk(t)} g_e(t) ||f_e(x_t)||_2
  tokens          number of tokens
"""
import math

import numpy as np
import torch

BASELINES = ("msmoe", "hcsmoe", "reap")


# ----------------------------------------------------------------------------- criteria (pure)

def cosine_matrix(x):
    """Row-wise cosine similarity of x [N, F] -> [N, N] float64 (a zero row has similarity 0)."""
    x = torch.as_tensor(x, dtype=torch.float64)
    n = x.norm(dim=-1, keepdim=True)
    y = torch.where(n > 0, x / n.clamp_min(1e-300), torch.zeros_like(x))
    return y @ y.T


def msmoe_groups(count, logit_gram, K):
    """M-SMoE grouping (arXiv 2310.01334 §3.1-3.2).

    count [N]: calibration activation frequency; logit_gram [N, N]: sum_t z_t z_t^T of the
    router logits, so cos(z_:,i, z_:,j) = G_ij / sqrt(G_ii G_jj) is the cosine of expert i's and
    j's logit columns over the calibration tokens. The K most frequent experts (ties: lower
    index) are dominant; every other expert joins the most similar dominant expert (ties:
    lower dominant index). Returns K sorted groups, ordered by smallest index."""
    count = torch.as_tensor(count, dtype=torch.float64)
    N = count.numel()
    if not 1 <= K <= N:
        raise ValueError(f"K={K} must be in [1, N={N}]")
    G = torch.as_tensor(logit_gram, dtype=torch.float64)
    d = G.diagonal().clamp_min(0).sqrt()
    sim = torch.where((d[:, None] > 0) & (d[None, :] > 0), G / (d[:, None] * d[None, :]).clamp_min(1e-300),
                      torch.zeros_like(G))
    dominant = sorted(sorted(range(N), key=lambda e: (-float(count[e]), e))[:K])
    groups = {a: [a] for a in dominant}
    for e in range(N):
        if e not in groups:
            s = sim[e, dominant]
            groups[dominant[int(s.argmax())]].append(e)   # argmax returns the first maximum
    return sorted(sorted(g) for g in groups.values())


def hcsmoe_groups(out_mean, K, linkage="average"):
    """HC-SMoE grouping (arXiv 2410.08589 §3): hierarchical clustering of the experts' mean
    outputs out_mean [N, H] with distance 1 - cos, Lance-Williams `linkage` ("average", the
    paper's choice; "single", "complete"), merging the closest pair until K clusters remain
    (exact ties: lower sorted member list). Returns K sorted groups."""
    from rolemerge.model import LINKAGES, lance_williams
    if linkage not in LINKAGES:
        raise ValueError(f"unknown linkage {linkage!r}; choose from {LINKAGES}")
    D = (1.0 - cosine_matrix(out_mean)).cpu().numpy()   # numpy: the loop of small ops shared with agglomerate
    N = D.shape[0]
    if not 1 <= K <= N:
        raise ValueError(f"K={K} must be in [1, N={N}]")
    members = {i: [i] for i in range(N)}
    size = np.ones(N)
    active = np.ones(N, dtype=bool)
    upper = np.triu(np.ones((N, N), dtype=bool), 1)
    for _ in range(N - K):
        Dm = np.where(upper & active[:, None] & active[None, :], D, math.inf)
        cand = np.argwhere(Dm == Dm.min()).tolist()
        a, b = min(cand, key=lambda ij: sorted(members[ij[0]] + members[ij[1]]))
        lance_williams(D, a, b, size, linkage)
        members[a] = sorted(members[a] + members.pop(b))
        size[a] += size[b]
        active[b] = False
    return sorted(members.values())


def reap_saliency(reap_sum, count):
    """REAP saliency S_j = reap_sum_j / count_j (arXiv 2510.13999 eq. 5): the mean over the
    tokens routed to j of g_j(x) ||f_j(x)||_2. reap_sum [N], count [N] -> [N] float64; an
    expert no token routes to has saliency 0."""
    s = torch.as_tensor(reap_sum, dtype=torch.float64)
    c = torch.as_tensor(count, dtype=torch.float64)
    return torch.where(c > 0, s / c.clamp_min(1e-300), torch.zeros_like(s))


def reap_groups(saliency, K):
    """REAP pruning: keep the K most salient experts (ties: lower index) as singleton groups."""
    s = torch.as_tensor(saliency, dtype=torch.float64)
    N = s.numel()
    if not 1 <= K <= N:
        raise ValueError(f"K={K} must be in [1, N={N}]")
    keep = sorted(range(N), key=lambda e: (-float(s[e]), e))[:K]
    return [[e] for e in sorted(keep)]


def slice_features(feats, ix):
    """One block of experts' features (for group-limited routing, `rolemerge.model.plan(blocks=)`):
    feats: a `collect_features` layer dict; ix: a slice of expert indices. count / reap_sum [n],
    logit_gram [n, n] (the block's rows and columns: cosines between its experts are unchanged),
    out_sum [n, H]; tokens unchanged."""
    return {"count": feats["count"][ix], "logit_gram": feats["logit_gram"][ix, ix],
            "out_sum": feats["out_sum"][ix], "reap_sum": feats["reap_sum"][ix], "tokens": feats["tokens"]}


def baseline_groups(method, feats, K, linkage="average"):
    """Groups of one layer for `method` in BASELINES from that layer's features (dict of
    `collect_features`). Raises ValueError for an unknown method."""
    if method == "msmoe":
        return msmoe_groups(feats["count"], feats["logit_gram"], K)
    if method == "hcsmoe":
        return hcsmoe_groups(feats["out_sum"] / max(float(feats["tokens"]), 1.0), K, linkage)
    if method == "reap":
        return reap_groups(reap_saliency(feats["reap_sum"], feats["count"]), K)
    raise ValueError(f"unknown baseline {method!r}; choose from {BASELINES}")


# ----------------------------------------------------------------------------- feature collection

def expert_outputs(experts, x):
    """Every expert on every token: x [T, H] -> [T, N, H] (float32), for the fused expert layout
    of transformers 5 (gate_up_proj [N, 2I, H], down_proj [N, H, I], act(gate) * up)."""
    gu = torch.einsum("th,nih->tni", x.float(), experts.gate_up_proj.float())
    g, u = gu.chunk(2, dim=-1)
    return torch.einsum("tni,nhi->tnh", experts.act_fn(g) * u, experts.down_proj.float())


class FeatureRecorder:
    """Forward hooks on every routed-expert block's `experts` module (inputs: hidden states
    [T, H], top_k_index [T, k], top_k_weights [T, k]) that accumulate the features of the
    module docstring over the tokens where `self.mask` ([T] bool, set per batch) is True."""

    def __init__(self, model):
        from rolemerge import calibrate as cal
        self.blocks = cal.moe_blocks(model)
        self.feats, self.mask, self.handles = [], None, []
        for i, (_, block) in enumerate(self.blocks):
            N, H = block.gate.weight.shape
            self.feats.append({"count": torch.zeros(N, dtype=torch.float64),
                               "logit_gram": torch.zeros(N, N, dtype=torch.float64),
                               "out_sum": torch.zeros(N, H, dtype=torch.float64),
                               "reap_sum": torch.zeros(N, dtype=torch.float64), "tokens": 0})
            self.handles.append(block.experts.register_forward_hook(self._hook(i, block)))

    def _hook(self, i, block):
        def fn(module, args, out):
            x, idx, w = args[0], args[1], args[2]
            if self.mask is not None:
                x, idx, w = x[self.mask], idx[self.mask], w[self.mask]
            f = self.feats[i]
            z = (x.float() @ block.gate.weight.float().T).double()               # router logits [T, N]
            y = expert_outputs(module, x)                                        # [T, N, H]
            norms = y.norm(dim=-1)                                               # [T, N]
            N = z.shape[1]
            f["count"] += torch.bincount(idx.reshape(-1), minlength=N).double()
            f["logit_gram"] += z.T @ z
            f["out_sum"] += y.double().sum(0)
            f["reap_sum"] += torch.zeros(N, dtype=torch.float64).index_add_(
                0, idx.reshape(-1), (w.double() * norms.gather(1, idx).double()).reshape(-1))
            f["tokens"] += x.shape[0]
        return fn

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def collect_features(model, batches):
    """Run `model` over `batches` (dicts of model inputs with an attention_mask [B, L]) and
    return the per-layer baseline features (list over MoE layers of dicts, see module doc),
    counted over the non-padding positions."""
    rec = FeatureRecorder(model)
    try:
        for b in batches:
            rec.mask = b["attention_mask"].reshape(-1).bool()
            model(**{k: v for k, v in b.items() if k != "labels"})
    finally:
        rec.remove()
    return rec.feats
