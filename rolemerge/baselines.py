"""The RoleMerge paper's comparison methods, each with its own published criterion.

RoleMerge (arXiv 2608.04454) compares against expert-merging methods and, in App. D.1,
REAP pruning. Here, under the same harness (same calibration examples, same K per layer, same
merge operator `rolemerge.merging.merge_model`):

- **M-SMoE** (Li et al., "Merge, Then Compress: Demystify Efficient SMoE with Hints from Its
  Routing Policy", arXiv 2310.01334, §3.1-3.2): the K most frequently activated experts of a
  layer are *dominant*; every other expert joins the dominant expert whose **router logits**
  over the calibration tokens are most similar (cosine of the logit columns, their default
  similarity); each group is merged with activation-frequency weights. M-SMoE's neuron
  permutation alignment before merging is not applied. Its layer-adaptive dominant count
  (`msmoe_layer_counts`: one global threshold on the per-layer normalised activation
  frequencies) is an option; since a transformers config holds one expert count, it is only
  expressible with the "bound" router operator (N slots kept, K_l unique experts per layer).
- **HC-SMoE** (Chen et al., "Retraining-Free Merging of Sparse Mixture-of-Experts via
  Hierarchical Clustering", arXiv 2410.08589, §3): each expert is represented by its **output
  averaged over all calibration tokens** (every expert is run on every token, independent of
  routing); agglomerative clustering with **average linkage** on the **Euclidean distance** of
  those vectors down to K clusters (the official code's `pairwise_distances` /
  `compute_distance`, and REAP's port run with `--distance_measure euclidean`); frequency-weighted
  merging. `distance="cosine"` (1 - cos) is kept as a named variant.
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
import json
import math
import os

import numpy as np
import torch
from safetensors import safe_open

from common.checkpoint import atomic_save_file
from rolemerge.blocks import moe_blocks
from rolemerge.model import LINKAGES, lance_williams

BASELINES = ("msmoe", "hcsmoe", "reap")
DISTANCES = ("euclidean", "cosine")   # HC-SMoE: official default first


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


def euclidean_matrix(x):
    """Pairwise Euclidean distances of the rows of x [N, F] -> [N, N] float64 (exact zeros on the
    diagonal)."""
    x = torch.as_tensor(x, dtype=torch.float64)
    return torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist").fill_diagonal_(0.0)


def hcsmoe_groups(out_mean, K, linkage="average", distance="euclidean"):
    """HC-SMoE grouping (arXiv 2410.08589 §3): hierarchical clustering of the experts' mean
    outputs out_mean [N, H], merging the closest pair of clusters until K remain.

    distance: "euclidean" ||o_i - o_j||_2 (the official code's default, `pairwise_distances`)
    or "cosine" 1 - cos(o_i, o_j) (a variant); linkage: Lance-Williams "average" (the paper's and
    the official code's choice: the mean pairwise distance between the two clusters), "single",
    "complete". Exact ties: lower sorted member list. Returns K sorted groups. Raises ValueError
    for an unknown linkage / distance or K outside [1, N]."""
    if linkage not in LINKAGES:
        raise ValueError(f"unknown linkage {linkage!r}; choose from {LINKAGES}")
    if distance not in DISTANCES:
        raise ValueError(f"unknown distance {distance!r}; choose from {DISTANCES}")
    D = euclidean_matrix(out_mean) if distance == "euclidean" else 1.0 - cosine_matrix(out_mean)
    D = D.cpu().numpy()   # numpy: the loop of small ops shared with agglomerate
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


def msmoe_layer_counts(counts, K):
    """M-SMoE's layer-adaptive group counts (arXiv 2310.01334 §3.2; official
    `_assign_num_groups_per_layer`): every layer's activation frequencies are normalised to sum
    to 1, each layer's most used expert is set to 1 (every layer keeps at least one group), all
    L N values are sorted in descending order and the value at position L K (L K - 1 when K = N)
    is a global threshold; layer l keeps K_l = #{e : f_le > threshold} groups, so sum_l K_l is
    about L K. counts: list over layers of [N] activation counts. Returns [K_l]. Raises
    ValueError when the threshold is 1 (K too large for the rule)."""
    freqs = []
    for c in counts:
        c = torch.as_tensor(c, dtype=torch.float64)
        f = c / c.sum() if float(c.sum()) > 0 else torch.zeros_like(c)
        f[int(torch.argmax(f))] = 1.0
        freqs.append(f)
    N, L = freqs[0].numel(), len(freqs)
    if not 1 <= K <= N:
        raise ValueError(f"K={K} must be in [1, N={N}]")
    total = L * K - (1 if K == N else 0)
    thr = float(torch.sort(torch.cat(freqs), descending=True).values[total])
    if thr == 1.0:
        raise ValueError(f"M-SMoE layer-adaptive counts: K={K} is too large for its threshold rule")
    return [int((f > thr).sum()) for f in freqs]


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


def baseline_groups(method, feats, K, linkage="average", distance="euclidean"):
    """Groups of one layer for `method` in BASELINES from that layer's features (dict of
    `collect_features`); linkage / distance apply to HC-SMoE. Raises ValueError for an unknown
    method."""
    if method == "msmoe":
        return msmoe_groups(feats["count"], feats["logit_gram"], K)
    if method == "hcsmoe":
        return hcsmoe_groups(feats["out_sum"] / max(float(feats["tokens"]), 1.0), K, linkage, distance)
    if method == "reap":
        return reap_groups(reap_saliency(feats["reap_sum"], feats["count"]), K)
    raise ValueError(f"unknown baseline {method!r}; choose from {BASELINES}")


def plan_groups(method, features, K, blocks=1, distance="euclidean", adaptive=False):
    """Groups of every layer for a BASELINES method: features is the list over MoE layers of
    `collect_features` dicts, K the experts (groups) per layer, blocks the number of contiguous
    routing blocks every group must stay inside (K / blocks groups per block). HC-SMoE always
    uses average linkage (its paper's and code's choice). adaptive (M-SMoE only): the per-layer
    counts of `msmoe_layer_counts` instead of one K (blocks must be 1). Returns [L][K_l][members]."""
    if adaptive:
        if method != "msmoe":
            raise ValueError(f"layer-adaptive expert counts are M-SMoE's rule, not {method!r}")
        if blocks != 1:
            raise ValueError("layer-adaptive counts need blocks=1 (the bound router keeps every routing group)")
        ks = msmoe_layer_counts([f["count"] for f in features], K)
        return [msmoe_groups(f["count"], f["logit_gram"], k) for f, k in zip(features, ks)]
    N = int(features[0]["count"].numel())
    if N % blocks or K % blocks:
        raise ValueError(f"blocks={blocks} must divide N={N} and K={K}")
    nb, kb = N // blocks, K // blocks
    out = []
    for f in features:
        g = []
        for s0 in range(0, N, nb):
            gb = baseline_groups(method, slice_features(f, slice(s0, s0 + nb)), kb, "average", distance)
            g += [[e + s0 for e in grp] for grp in gb]
        out.append(g)
    return out


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
    module docstring over the tokens where `self.mask` ([T] bool, set per call) is True. The
    all-experts pass runs over chunks of tokens (`chunk_bytes` of float32 activations), so its
    memory does not grow with the batch; the sums are kept on the CPU in float64."""

    chunk_bytes = 256 << 20     # every expert on every token is computed this many bytes of tokens at a time

    def __init__(self, model):
        self.blocks = moe_blocks(model)
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
            N, H = block.gate.weight.shape
            I2 = module.gate_up_proj.shape[1]
            step = max(1, self.chunk_bytes // (4 * N * (H + I2)))            # tokens per chunk: bounded memory
            for a in range(0, x.shape[0], step):
                xs, ids, ws = x[a:a + step], idx[a:a + step], w[a:a + step]
                z = (xs.float() @ block.gate.weight.float().T).double()       # router logits [t, N]
                y = expert_outputs(module, xs)                                # [t, N, H]
                norms = y.norm(dim=-1)                                        # [t, N]
                f["count"] += torch.bincount(ids.reshape(-1).cpu(), minlength=N).double()
                f["logit_gram"] += (z.T @ z).cpu()
                f["out_sum"] += y.double().sum(0).cpu()
                f["reap_sum"] += torch.zeros(N, dtype=torch.float64).index_add_(
                    0, ids.reshape(-1).cpu(), (ws.double() * norms.gather(1, ids).double()).reshape(-1).cpu())
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
    return run_recorder(FeatureRecorder(model), model, batches)


@torch.no_grad()
def run_recorder(rec, model, batches):
    """Run `model` over `batches` with recorder `rec` (FeatureRecorder, or any object with
    .mask / .feats / .remove()) counting the non-padding positions; the hooks are removed even
    on error. Returns rec.feats."""
    try:
        for b in batches:
            rec.mask = b["attention_mask"].reshape(-1).bool()
            model(**{k: v for k, v in b.items() if k != "labels"})
    finally:
        rec.remove()
    return rec.feats


# ----------------------------------------------------------------------------- feature files

FEATURES_KEY = "rolemerge_features"


def features_path(stats_path):
    """The features file `rolemerge.calibrate --features` writes next to a stats file:
    out/stats.safetensors -> out/stats.features.safetensors."""
    base = stats_path[:-len(".safetensors")] if stats_path.endswith(".safetensors") else stats_path
    return base + ".features.safetensors"


def save_features(feats, path, meta):
    """Write per-layer features (list over MoE layers of dicts name -> tensor or int) to a
    safetensors file: tensor `L/name` per entry (ints as 0-dim int64), metadata JSON with
    `meta` (model id, fingerprint, layer names), the layer count and which entries are ints."""
    tensors, ints = {}, []
    for l, f in enumerate(feats):
        for k, v in f.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{l}/{k}"] = v.detach().cpu().contiguous()
            else:
                tensors[f"{l}/{k}"] = torch.tensor(int(v), dtype=torch.int64)
                ints.append(f"{l}/{k}")
    atomic_save_file(tensors, path, metadata={FEATURES_KEY: json.dumps(dict(meta, n_layers=len(feats), ints=ints))})


def load_features(paths):
    """Read and merge the features files of `paths` (`merge_feature_dicts`: every sum over
    calibration tokens added, the comparators' token samples concatenated and re-sampled).
    Returns (feats list over layers, meta of the first file). Raises ValueError naming
    a missing or foreign file, or files of different models."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    feats, meta0 = None, None
    for p in paths:
        if not os.path.exists(p):
            raise ValueError(f"{p}: no features file")
        with safe_open(p, "pt") as f:
            md = f.metadata() or {}
            if FEATURES_KEY not in md:
                raise ValueError(f"{p}: not a RoleMerge features file (no '{FEATURES_KEY}' metadata)")
            meta = json.loads(md[FEATURES_KEY])
            cur = [{} for _ in range(meta["n_layers"])]
            for k in f.keys():
                l, name = k.split("/", 1)
                v = f.get_tensor(k)
                cur[int(l)][name] = int(v) if k in meta["ints"] else v
        if feats is None:
            feats, meta0 = cur, meta
            continue
        if meta.get("fingerprint") != meta0.get("fingerprint") or len(cur) != len(feats):
            raise ValueError(f"{p}: features of a different model than {paths[0]}")
        feats = [merge_feature_dicts(a, b) for a, b in zip(feats, cur)]
    return feats, meta0


SAMPLE_KEYS = ("x_sample", "x_sample_topk", "x_sample_key")   # comparators' token sample: rows, not sums


def merge_feature_dicts(a, b):
    """One layer's features of two calibration runs as if recorded in one: every sum is added;
    the token sample (`rolemerge.comparators`: x_sample [m, H], x_sample_topk [m, k],
    x_sample_key [m]) is never added row by row (that would sum two tokens' inputs and give
    expert ids up to 2(N-1)): both samples are concatenated and the rows with the smallest keys
    kept, m = the larger of the two sample sizes (bottom-m sampling, so the result is again a
    uniform sample of all tokens seen, in arrival order: a's rows, then b's). Names in only one
    dict are kept as they are."""
    out = {}
    for k in list(a) + [k for k in b if k not in a]:
        out[k] = a[k] + b[k] if k in a and k in b and k not in SAMPLE_KEYS else a[k] if k in a else b[k]
    if all(k in a and k in b for k in SAMPLE_KEYS):
        m = max(a["x_sample_key"].numel(), b["x_sample_key"].numel())
        keep = torch.cat([a["x_sample_key"], b["x_sample_key"]]).argsort(stable=True)[:m].sort().values
        for k in SAMPLE_KEYS:
            out[k] = torch.cat([a[k], b[k]])[keep]
    return out
