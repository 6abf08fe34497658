"""Merge the routed experts of an MoE checkpoint into a smaller one (paper §4.3-4.4, App. B.2).

    python -m rolemerge.merge --model tiny-moe --stats out/rolemerge/stats.safetensors \
        --rho 0.5 --out out/rolemerge/tiny-moe-rho0.5
    python -m rolemerge.merge ... --method hcsmoe      # a comparison method (needs calibrate --features)
    python -m rolemerge.merge ... --in-memory          # load the model instead of streaming the shards

Input: routing statistics (rolemerge.calibrate), a checkpoint directory and the retention
ratio rho (K = round(rho N) experts kept in every MoE layer) or K itself. Output: a
`save_pretrained` directory loadable with plain `from_pretrained`, the tokenizer / processor
files copied, and `rolemerge_report.json` (groups, weights, kappa / lambda / tau, ACR and
expert-phase MI retention per layer, parameter counts).

Every merged expert is  Theta_G = sum_{e in G} omega_e Theta_e. Two router operators:
- "average" (RoleMerge §4.4, the default of every method but M-SMoE / HC-SMoE): K experts, router
  row (and DeepSeek-V3's score-correction bias) r_G = sum_{e in G} omega_e r_e, config count K;
- "bound" (the official M-SMoE / HC-SMoE codes): all N router rows kept and every member slot of
  G holds Theta_G, so a token routes as in the original model and reaches its experts' merges;
  the checkpoint keeps N slots (file size and parameter count do not shrink; the report gives the
  unique parameters). This is the K-expert merge under `infer.oracle_routing` (tested).
Methods with their own merge operator (rolemerge/comparators.py) get each layer's expert tensors
in one canonical layout (`own_merge`); the result is written back in the checkpoint's layout and
dtype. Attention, shared experts, dense layers and the vision tower are untouched.

Two paths with identical output tensors (tested):
- streaming (default for a local checkpoint directory): read the safetensors headers, byte-copy
  untouched tensors, read only the expert tensors of one layer at a time (pread, no mmap) and
  write merged shards. Works for the per-expert on-disk layout (Qwen2/3-MoE, OLMoE, DeepSeek:
  experts.N.*_proj.weight; Mixtral: block_sparse_moe.experts.N.w1/w2/w3) and the fused one
  (Qwen3-VL-MoE: experts.gate_up_proj). Memory: one layer's merged experts plus one I/O buffer;
- in memory (--in-memory; `merge_model` for a model already loaded): replace the fused expert /
  router parameters, save_pretrained.

The groupings are planned all at once from the stats (all layers share lambda's mean); every
step is deterministic, so the same inputs give byte-identical tensors.
"""
import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from common.data import follow_umask, name_path
from rolemerge import calibrate as cal
from rolemerge import model as rm

REPORT = "rolemerge_report.json"
TMP_MARK = ".rolemerge-tmp"  # written first into `<out>.tmp`: a leftover temp folder is ours to delete

WEIGHT_FILES = re.compile(r".*\.safetensors$|.*\.safetensors\.index\.json$|.*\.bin$|.*\.bin\.index\.json$")


def _ours(path, marks):
    """True if nothing is at `path`, or it is a real directory that is empty or holds one of `marks`."""
    if not os.path.lexists(path):
        return True
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    names = os.listdir(path)
    return not names or any(m in names for m in marks)


def _start_tmp(tmp):
    """A fresh `<out>.tmp` (a killed earlier run's partial one is deleted: `run_merge` checked it is ours)
    holding TMP_MARK first, so that a kill from here on leaves a folder a rerun may delete."""
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    open(os.path.join(tmp, TMP_MARK), "w").close()


class MergeError(ValueError):
    """The merge cannot run as asked; the message says why."""


@contextmanager
def _no_tmp_after_io_error(tmp, out):
    """Around the writing part of `run_merge`: an I/O error (a full disk, `[Errno 27] File too
    large`, a read-only folder, no permission; safetensors' own I/O errors too) removes `tmp`
    (ours: `run_merge` checked it) and becomes a MergeError naming the file, so the command
    ends in `error: ...`, exit 2, with nothing at `out` and no temporary left."""
    try:
        yield
    except Exception as e:
        err = name_path(e, tmp)
        if not isinstance(err, OSError):
            raise
        if _ours(tmp, (TMP_MARK, REPORT)):
            shutil.rmtree(tmp, ignore_errors=True)
        raise MergeError(f"{err.filename}: {err.strerror or err} (errno {err.errno}) while merging into {out}; "
                         f"removed {tmp}, nothing was written to {out}: free space, or choose a --out on a disk "
                         f"you can write to") from None


def check_streamable(src, plan):
    """The streaming path's `cal.check_mergeable`: raise before anything is written unless
    config.json is a supported family with its expert-count field, every MoE layer found in the
    tensor names has one router weight [N, H] and all N experts (per-expert keys 0..N-1 or fused
    [N, ...] tensors), N equals the config's count and the plan has one layer per MoE layer
    (groups checked like check_mergeable). Raises CalibrationError / MergeError."""
    config = _streaming_config(src)
    sub = _expert_config(config)
    N = sub[next(f for f in cal.EXPERT_FIELDS if f in sub)]
    headers, where, layers = scan_checkpoint(src)
    rows = lambda k: headers[where[k]][0][k]["shape"][:1]                   # noqa: E731
    fam = f"{cal.SUPPORTED[config['model_type']]} [{config['model_type']}]"
    if plan.get("own") and plan.get("groups") is None:   # a comparator groups each layer while it merges
        return
    if len(layers) != len(plan["groups"]):
        raise MergeError(f"{fam}: the plan has {len(plan['groups'])} layers, the checkpoint {len(layers)} MoE layers")
    for lidx, lay in sorted(layers.items()):
        routers = [k for k in lay["router"] if k.endswith(".weight")]
        idx = {e for e, _ in lay["experts"].values() if e is not None}
        fused = [k for k, (e, _) in lay["experts"].items() if e is None] + list(lay["router"])
        if len(routers) != 1 or (idx and idx != set(range(N))) or any(rows(k) != [N] for k in fused):
            raise MergeError(f"{fam}: layer {lidx} has routers {routers} and experts {sorted(idx)}; the merge needs "
                             f"one `gate.weight` and experts 0..{N - 1} (config: {N})")
    for g in plan["groups"]:
        flat = [e for grp in g for e in grp]
        same_k = plan.get("router") == "bound" or len(g) == len(plan["groups"][0])   # bound: per-layer K may differ
        if not same_k or not all(g) or len(set(flat)) != len(flat) or not all(
                0 <= e < N for e in flat):
            raise MergeError(f"{fam}: the plan's groups must be non-empty, disjoint, in [0, {N}) and as many per layer")


# ----------------------------------------------------------------------------- planning

def target_k(n_experts, top_k, rho=None, k=None):
    """K from rho (round half up of rho N) or K itself. Raises MergeError for rho outside
    (0, 1], K outside [top_k, N] (a router cannot pick top_k of fewer than top_k experts)."""
    check_rho_k(rho, k)
    if rho is not None:
        k = int(math.floor(rho * n_experts + 0.5))
    if k > n_experts:
        raise MergeError(f"K={k} exceeds the {n_experts} experts per layer")
    if k < top_k:
        raise MergeError(f"K={k} is smaller than the model's top_k={top_k}: every token routes to {top_k} experts, "
                         f"so at least {top_k} must remain (use a larger rho)")
    return k


def check_rho_k(rho=None, k=None):
    """The checks on rho / K that need no model: exactly one given, rho in (0, 1], K >= 1."""
    if (rho is None) == (k is None):
        raise MergeError("give exactly one of rho and K")
    if rho is not None and not 0 < rho <= 1:   # also refuses nan
        raise MergeError(f"rho={rho} must be in (0, 1] (the fraction of experts kept per layer)")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise MergeError(f"K={k!r} must be one int for every layer: per-layer K is not supported "
                         f"(a transformers config holds a single expert count)")
    if k is not None and k < 1:
        raise MergeError(f"K={k} must be a positive number of experts")


def check_stats(stats, info):
    """Raise MergeError if the stats were recorded on another model than `info` describes
    (cal.model_info or the streaming equivalent)."""
    for key in ("model_type", "num_experts", "top_k", "layers", "fingerprint"):
        if stats[key] != info[key]:
            raise MergeError(f"statistics were recorded on a different model ({key}: stats {stats[key]!r} vs "
                             f"checkpoint {info[key]!r}; stats model {stats['model_id']!r}); recalibrate on this one")


SPARSE_EXPECTED = 10   # expected routed tokens per expert and phase below which the statistics are too thin


def sparse_calibration(stats, min_expected=SPARSE_EXPECTED):
    """A warning text when the statistics are too thin to merge on, else None: some phase bucket
    has so few tokens that an expert expects fewer than `min_expected` of them under uniform
    routing (top_k * tokens_b / N), e.g. one calibration record. The text gives that number per
    thin phase, the share of zero counts over (layer, phase, expert) and the fix."""
    tokens = sum(s["tokens"] for s in stats["sources"].values()).double()          # [B]
    expected = stats["top_k"] * tokens / stats["num_experts"]
    thin = [f"{b} {float(e):.1f}" for b, e in zip(stats["buckets"], expected) if e < min_expected]
    if not thin:
        return None
    zero = float((cal.total_counts(stats) == 0).double().mean())
    examples = sum(int(s["examples"]) for s in stats["sources"].values() if "examples" in s)
    return (f"warning: sparse calibration ({examples or '?'} example(s)): routed tokens expected per expert under "
            f"uniform routing: {', '.join(thin)} (below {min_expected}); {100 * zero:.0f}% of the routing counts are "
            f"zero, so the groups rest on little evidence; calibrate on more records (rolemerge.calibrate --limit, "
            f"default 128 per file)")


def routing_groups(model_type, tc, N, K, top_k):
    """Routing groups of the merged model under DeepSeek's group-limited routing.

    DeepSeek-V2 (`topk_method="group_limited_greedy"`) and V3 split the N experts into n_group
    contiguous equal groups, keep the topk_group best groups per token (V3 scores a group by
    the sum of its top-2 experts) and pick top_k experts inside them. A merged router is valid
    only if every merged expert stays inside one routing group, the groups stay equal (n_group
    divides K), V3 keeps >= 2 experts per group, and topk_group * K / n_group >= top_k (else
    top-k picks land in masked-out groups, or V3 crashes with "selected index k out of range").

    We keep n_group when possible and merge within each routing group; otherwise we take the
    largest n_group' dividing n_group (each new group is a union of old ones) that satisfies the
    above. topk_group' keeps at least the original fraction of groups and enough experts:
    min(n_group', max(ceil(topk_group n_group' / n_group), ceil(top_k n_group' / K))).
    tc: the text config as a dict. Returns (blocks, fields): blocks = n_group' for rm.plan,
    fields = the config values to write ({} when nothing changes or the model is not
    group-limited). Raises MergeError naming the valid K values when none works."""
    v3 = model_type == "deepseek_v3" or tc.get("topk_method") == "noaux_tc"     # (DeepSeek-VL2 base: noaux_tc)
    grouped = v3 or tc.get("topk_method") == "group_limited_greedy"
    if not grouped:
        return 1, {}
    n, tg = tc.get("n_group") or 1, tc.get("topk_group") or 1
    per_group = 2 if v3 else 1        # V3's group score sums its top-2 experts

    def fit(k):
        for n2 in sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True):
            if k % n2 or k // n2 < per_group:
                continue
            tg2 = min(n2, max(-(-tg * n2 // n), -(-top_k * n2 // k)))
            if tg2 * (k // n2) >= top_k:
                return n2, tg2
        return None

    got = fit(K)
    if got is None:
        ok = [k for k in range(1, N + 1) if fit(k)]
        raise MergeError(f"K={K} leaves no valid group-limited routing (n_group={n}, topk_group={tg}, "
                         f"top_k={top_k}{', >= 2 experts per group' if per_group == 2 else ''}); "
                         f"valid K: {ok or 'none'}")
    return got[0], ({} if got == (n, tg) else {"n_group": got[0], "topk_group": got[1]})


ROUTERS = ("bound", "average")
OFFICIAL_ROUTER = {"msmoe": "bound", "hcsmoe": "bound"}   # their official codes; every other method: average
PRUNING = ("prune", "reap")                                  # keep K experts, drop the others


def comparator_methods():
    """The method names of rolemerge/comparators.py (`COMPARATORS`), () while that module is absent."""
    try:
        from rolemerge import comparators
    except ImportError:
        return ()
    return tuple(getattr(comparators, "COMPARATORS", ()))


def all_methods():
    """Every `--method`: rolemerge, its controls and baselines (rolemerge.model.METHODS) and the comparators."""
    return tuple(rm.METHODS) + tuple(m for m in comparator_methods() if m not in rm.METHODS)


def router_operator(method, router=None):
    """The router operator of `method`: `router` when given ("bound" or "average"), else the
    method's official one (bound for M-SMoE / HC-SMoE, whose codes keep all N router rows and
    bind every member expert to its group's merged expert; average for the others). Raises
    MergeError for an unknown operator or bound with a pruning method (no group holds a dropped
    expert, so there is nothing to bind it to)."""
    op = router or OFFICIAL_ROUTER.get(method, "average")
    if op not in ROUTERS:
        raise MergeError(f"unknown router operator {op!r}; choose from {ROUTERS}")
    if op == "bound" and method in PRUNING:
        raise MergeError(f"--router bound binds every expert to its group's merge; {method!r} prunes experts "
                         f"(no group holds them): use --router average")
    return op


def make_plan(stats, K, method="rolemerge", lam=0.03, linkage="single", seed=0, routers=None, features=None,
              routing=(1, {}), router=None, distance="euclidean", adaptive=False):
    """Groups, weights and diagnostics for every MoE layer.

    stats: cal.load_stats output; routers: callable -> list of [N, H] router weights (only
    called for the frequency baseline); features: per-layer features (`calibrate --features`,
    `rolemerge.baselines.collect_features`; for msmoe / hcsmoe / reap and the comparators);
    routing: routing_groups' (blocks, config fields); router: the router operator
    (`router_operator`; bound keeps N expert slots and the router, so routing blocks and fields
    do not apply); distance: HC-SMoE's ("euclidean", official, or "cosine"); adaptive: M-SMoE's
    layer-adaptive counts (bound only). A comparator (rolemerge/comparators.py) returns its
    groups while merging: its plan has groups None until `finish_plan` runs after the merge.
    Returns a dict with 'groups' [L][G][members], 'weights' [L][G][w], 'layers' (per-layer
    diagnostics), 'routing' (config fields rewritten), 'router', summary ACR / MI retention,
    and the internal '_mass' [L, N] / '_features' (never written to the report)."""
    op = router_operator(method, router)
    if adaptive and (method != "msmoe" or op != "bound"):
        raise MergeError("layer-adaptive expert counts are M-SMoE's (--method msmoe) and need --router bound: a "
                         "transformers config holds one expert count for all layers, so only N bound slots with "
                         "K_l unique experts per layer can express them")
    if distance not in ("euclidean", "cosine"):
        raise MergeError(f"unknown distance {distance!r}; choose from ('euclidean', 'cosine')")
    if op == "bound":
        routing = (1, {})
    counts = cal.total_counts(stats).double()                    # [L, B, N]
    own = method in comparator_methods() and method not in rm.METHODS
    if method in rm.FEATURE_METHODS or own:
        if features is None:
            raise MergeError(f"method {method!r} needs the calibration features (rolemerge.calibrate --features)")
        _, info = rm.plan(counts, K, "prune", lam, linkage, seed, blocks=routing[0])   # kappa / lambda / tau only
        from rolemerge import baselines as bl
        groups = None if own else bl.plan_groups(method, features, K, routing[0], distance, adaptive)
    else:
        groups, info = rm.plan(counts, K, method, lam, linkage, seed, routers() if method == "frequency" else None,
                               features, blocks=routing[0])
    plan = {"method": method, "K": K, "N": stats["num_experts"], "lambda": lam, "linkage": linkage, "seed": seed,
            "router": op, "routing": routing[1], "groups": groups, "info": info,
            "_mass": counts.sum(1), "_features": features}
    if method == "hcsmoe":
        plan["distance"] = distance
    if adaptive:
        plan["adaptive"] = True
    if own:
        plan["own"] = True
        return plan
    return finish_plan(plan, stats)


def finish_plan(plan, stats):
    """The plan's merge weights and diagnostics (per-layer ACR, MI retention, K_l) from its groups."""
    groups, info, mass = plan["groups"], plan.pop("info"), plan["_mass"]
    weights = [rm.merge_weights(mass[l], g) for l, g in enumerate(groups)]
    records = [(n, s["counts"].double()) for n, s in stats["sources"].items()]
    layers, acrs, mi_num, mi_den = [], [], 0.0, 0.0
    covers = all(sum(len(x) for x in g) == stats["num_experts"] for g in groups)   # False for pruning
    for l, g in enumerate(groups):
        acr_l = {n: rm.acr(rm.phase_distributions(c[l])[-1], g) for n, c in records}
        acrs += list(acr_l.values())
        for _, c in records:
            P_e, q = rm.role_profiles(rm.phase_distributions(c[l]))
            mi_den += rm.mutual_information(P_e, q)
            mi_num += rm.mutual_information(P_e, q, g) if covers else 0.0
        layers.append(dict(info[l], name=stats["layer_names"][l], K=len(g), groups=g, weights=weights[l], acr=acr_l,
                           mi_retention=rm.mi_retention([c[l] for _, c in records], g) if covers else None))
    # MI retention compares groupings of all experts; pruning drops experts, so it has none
    mi = (mi_num / mi_den if mi_den > 0 else 1.0) if covers else None
    plan.update(weights=weights, layers=layers, acr_mean=sum(acrs) / len(acrs), mi_retention=mi)
    plan["slots"] = plan["N"] if plan.get("router") == "bound" else len(groups[0])
    return plan


# ----------------------------------------------------------------------------- tensor merge

def weighted_sum(tensors, weights, dtype, acc=None, out=None):
    """sum_i w_i t_i accumulated in float32 in the given order, cast to dtype. The one place
    both paths merge tensors, so their outputs agree bit for bit. acc (float32) and out
    (dtype): optional scratch tensors of the tensors' shape, reused by the streaming path
    (a fresh large allocation page-faults on every call); the result is out when given."""
    acc = torch.empty(tensors[0].shape, dtype=torch.float32) if acc is None else acc
    acc.copy_(tensors[0]).mul_(weights[0])
    for t, w in zip(tensors[1:], weights[1:]):
        acc.add_(t, alpha=w)                     # promotes t to float32 inside the kernel
    return acc.to(dtype) if out is None else out.copy_(acc)


def merge_stacked(x, groups, weights):
    """x [N, ...] (expert axis first) -> [G, ...] merged with the group weights."""
    return torch.stack([weighted_sum([x[e] for e in g], w, x.dtype) for g, w in zip(groups, weights)])


def slot_groups(groups, weights, N, router):
    """(groups, weights) of the output expert slots: the K groups themselves ("average"), or
    with the "bound" operator one slot per original expert e holding its group's merge (N slots,
    members of a group hold identical tensors). Raises MergeError if bound and a group misses an expert."""
    if router != "bound":
        return groups, weights
    of = {e: i for i, g in enumerate(groups) for e in g}
    if sorted(of) != list(range(N)):
        raise MergeError("the bound router operator needs groups that cover every expert")
    return [groups[of[e]] for e in range(N)], [weights[of[e]] for e in range(N)]


def own_merge(plan, li, W, K):
    """The hook for a method that produces its own tensors (rolemerge/comparators.py): layer li's
    canonical float32 tensors W (gate [N, I, H], up [N, I, H], down [N, H, I], router [N, H],
    optional bias [N]) -> `comparators.merge_layer(method, W, feats, K)` with that layer's
    features; the returned groups (and frequency weights from them) are stored in the plan.
    Returns the merged dict (gate / up / down [K, ...], router [K, H] or None, bias or None).
    Raises MergeError when the comparator returns the wrong number of groups or shapes."""
    from rolemerge import comparators
    feats = (plan.get("_features") or [None] * (li + 1))[li]
    out = comparators.merge_layer(plan["method"], W, feats, K)
    groups = sorted(sorted(int(e) for e in g) for g in out["groups"])
    if len(groups) != K or any(out[k].shape[0] != K for k in ("gate", "up", "down")):
        raise MergeError(f"comparator {plan['method']!r} returned {len(groups)} groups / "
                         f"{out['gate'].shape[0]} experts at layer {li}, expected K={K}")
    order = sorted(range(K), key=lambda i: sorted(out["groups"][i]))   # tensors follow the sorted groups
    res = {k: out[k][order] for k in ("gate", "up", "down")}
    for k in ("router", "bias"):
        res[k] = out.get(k)[order] if out.get(k) is not None else None
    if plan["groups"] is None:
        plan["groups"] = [None] * len(plan["info"])
        plan["weights"] = [None] * len(plan["info"])
    plan["groups"][li] = groups
    plan["weights"][li] = rm.merge_weights(plan["_mass"][li], groups)
    return res


@torch.no_grad()
def merge_block(block, groups, weights, routing=None, router="average", own=None):
    """One MoE block in place: its expert tensors, router rows (and router score-correction
    bias) become their group merges (groups [K] lists of expert indices, weights [K] lists of
    their merge weights; singleton groups with weight 1 prune), and the expert counts of the
    block's modules become K. routing: the plan's group-limited routing fields, if any.
    router "bound": the N expert slots stay, slot e holding the merge of e's group, and the
    router (N rows) is untouched (the M-SMoE / HC-SMoE codes' operator). own: a method's own
    merged tensors (`own_merge`: gate / up / down [K, ...] float32, router / bias or None ->
    the weighted average of the member rows), cast to the block's dtype."""
    N, dev = block.gate.weight.shape[0], block.gate.weight.device
    gu, down = block.experts.gate_up_proj, block.experts.down_proj
    if own is None:
        gu_m = merge_stacked(gu.detach().cpu(), groups, weights)
        down_m = merge_stacked(down.detach().cpu(), groups, weights)
    else:
        gu_m = torch.cat([own["gate"], own["up"]], 1).to(gu.dtype)
        down_m = own["down"].to(down.dtype)
    if router == "bound":
        sg, _ = slot_groups(groups, weights, N, router)
        lut = torch.tensor([groups.index(g) for g in sg])
        block.experts.gate_up_proj = torch.nn.Parameter(gu_m[lut].to(dev), requires_grad=False)
        block.experts.down_proj = torch.nn.Parameter(down_m[lut].to(dev), requires_grad=False)
        return
    K = len(groups)
    block.experts.gate_up_proj = torch.nn.Parameter(gu_m.to(dev), requires_grad=False)
    block.experts.down_proj = torch.nn.Parameter(down_m.to(dev), requires_grad=False)
    r = own.get("router") if own else None
    r = r.to(block.gate.weight.dtype) if r is not None else merge_stacked(block.gate.weight.detach().cpu(), groups,
                                                                         weights)
    block.gate.weight = torch.nn.Parameter(r.to(dev), requires_grad=False)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor):
        ob = own.get("bias") if own else None
        block.gate.e_score_correction_bias = (ob.to(bias.dtype) if ob is not None else
                                              merge_stacked(bias.cpu(), groups, weights)).to(dev)
    for mod in (block, block.gate, block.experts):
        for attr in cal.EXPERT_FIELDS:
            if isinstance(getattr(mod, attr, None), int):
                setattr(mod, attr, K)
    for attr, v in {"num_group": (routing or {}).get("n_group"),
                    "topk_group": (routing or {}).get("topk_group")}.items():
        if v is not None:
            setattr(block.gate, attr, v)


def canonical_block(block):
    """A loaded MoE block's tensors in the canonical float32 layout of `own_merge`."""
    gu = block.experts.gate_up_proj.detach().float().cpu()
    I = gu.shape[1] // 2
    W = {"gate": gu[:, :I], "up": gu[:, I:], "down": block.experts.down_proj.detach().float().cpu(),
         "router": block.gate.weight.detach().float().cpu()}
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor):
        W["bias"] = bias.detach().float().cpu()
    return W


@torch.no_grad()
def merge_model(model, plan):
    """In-memory merge: `merge_block` on every MoE block with the plan's groups and weights (a
    comparator's own tensors through `own_merge`) and router operator; update the expert counts
    in the config (unchanged with the bound operator: N slots). model is changed in place and
    returned. Raises CalibrationError (`cal.check_mergeable`) before any change when a block,
    router, expert-count field or the plan is not one the merge understands."""
    cal.check_mergeable(model, plan)
    K, op = plan.get("K") or len(plan["groups"][0]), plan.get("router", "average")
    for li, (name, block) in enumerate(cal.moe_blocks(model)):
        own = own_merge(plan, li, canonical_block(block), K) if plan.get("own") else None
        merge_block(block, plan["groups"][li], plan["weights"][li], plan.get("routing"), op, own)
    if op == "bound":
        return model
    tc = cal.text_config(model.config)
    setattr(tc, cal.expert_count_field(model.config), K)
    for f, v in plan.get("routing", {}).items():
        setattr(tc, f, v)
    return model


def copy_side_files(src, dst):
    """Copy tokenizer / processor / chat-template files (everything but weights and files
    already written to dst)."""
    for f in sorted(os.listdir(src)):
        s, d = os.path.join(src, f), os.path.join(dst, f)
        if os.path.isfile(s) and not WEIGHT_FILES.match(f) and not os.path.exists(d):
            shutil.copy2(s, d)


def load_model_for_merge(path, dtype=None):
    """The model alone (no processor) of a supported checkpoint, in eval mode; safetensors
    only, no checkpoint code (`cal.load_config` checks the directory first)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    config = cal.load_config(path)
    if config.model_type == "deepseek_vl_v2":
        from rolemerge import deepseek_vl2 as vl2
        try:
            return vl2.load(path, dtype)
        except vl2.VL2Error as e:
            raise MergeError(str(e)) from None
    vlm = config.model_type in cal.VLM_TYPES + ("deepseek_ocr2",)
    cls = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=dtype, trust_remote_code=False, use_safetensors=True).eval()


# ----------------------------------------------------------------------------- streaming I/O

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
FLOATS = ("F32", "F16", "BF16", "F64")
RE_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<rest>.+)$")
RE_FUSED = re.compile(r"^(?P<pre>.*\.experts)\.(?P<rest>gate_up_proj|down_proj)$")
RE_ROUTER = re.compile(r"^(?P<blk>.*)\.gate\.(?P<rest>weight|e_score_correction_bias)$")
CHUNK = 64 << 20


def read_header(path):
    """safetensors header -> ({name: {dtype, shape, data_offsets}}, data_start, metadata).
    Raises MergeError naming the file when it is truncated or corrupt (its size must match
    the header exactly), so no tensor is ever read past the end of a short file."""
    from common.checkpoint import CheckpointError, check_safetensors
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _HEADERS:                  # a run reads every header 2-3 times: parse it once
        try:
            if len(_HEADERS) > 1024:
                _HEADERS.clear()
            _HEADERS[key] = check_safetensors(path)
        except CheckpointError as e:
            raise MergeError(str(e)) from None
    return _HEADERS[key]


_HEADERS = {}


def read_tensor(path, start, entry, index=None):
    """Read one tensor (or row `index` of its first axis) with pread into fresh memory."""
    dt = DTYPES[entry["dtype"]]
    shape = list(entry["shape"])
    a, b = entry["data_offsets"]
    if index is not None:
        row = (b - a) // shape[0]
        a, b, shape = a + index * row, a + (index + 1) * row, shape[1:]
    buf = bytearray(b - a)
    with open(path, "rb") as f:
        f.seek(start + a)
        if f.readinto(buf) != len(buf):   # the file shrank after read_header checked it
            raise MergeError(f"{path}: short read ({len(buf)} bytes at {start + a}); the file is truncated")
    return torch.frombuffer(buf, dtype=torch.uint8).view(dt).reshape(shape) if buf else torch.empty(shape, dtype=dt)


def copy_bytes(src, dst_f, offset, n):
    """Copy n bytes of file src from offset into the open file dst_f (in-kernel when possible)."""
    with open(src, "rb") as f:
        left = n
        if hasattr(os, "copy_file_range"):
            dst_f.flush()
            while left:
                done = os.copy_file_range(f.fileno(), dst_f.fileno(), min(left, CHUNK), offset + n - left)
                if done == 0:
                    break
                left -= done
            dst_f.seek(0, os.SEEK_END)
        f.seek(offset + n - left)
        while left:
            chunk = f.read(min(left, CHUNK))
            if not chunk:                 # end of file: never loop forever or pad with nothing
                raise MergeError(f"{src}: ends {left} bytes early; the file is truncated")
            dst_f.write(chunk)
            left -= len(chunk)


def shard_files(path):
    """[(shard file name)] of a safetensors checkpoint directory (index or single file)."""
    from common.checkpoint import CheckpointError, safetensors_files
    try:
        files = safetensors_files(path)
    except CheckpointError as e:
        raise MergeError(str(e)) from None
    if not files:
        raise MergeError(f"{path}: no *.safetensors weights (streaming reads safetensors only; pickled .bin "
                         f"files are never loaded)")
    return [os.path.basename(f) for f in files]


def scan_checkpoint(path):
    """Headers of every shard and the MoE layout found in the tensor names.

    Returns (headers {shard: (entries, data_start)}, where {key: shard},
    layers {layer_index: {"experts": {key: (kind, e or None, rest)}, "router": [keys]}})."""
    headers, where = {}, {}
    for s in shard_files(path):
        entries, start, _ = read_header(os.path.join(path, s))
        headers[s] = (entries, start)
        for k in entries:
            where[k] = s
    layers = {}
    for k in where:
        m = RE_EXPERT.match(k) or RE_FUSED.match(k)
        if m:
            pre = m.group("pre")
            lay = layers.setdefault(pre[:-len(".experts")], {"experts": {}, "router": []})
            lay["experts"][k] = (int(m.group("e")) if "e" in m.groupdict() else None, m.group("rest"))
    for k in where:
        m = RE_ROUTER.match(k)
        if m and m.group("blk") in layers:
            layers[m.group("blk")]["router"].append(k)
    return headers, where, {cal.layer_index(b + "."): dict(v, block=b) for b, v in layers.items()}


def _expert_config(config):
    """The (sub-)dict of a config.json that holds the routed-expert count."""
    for sub in (config.get("text_config") or {}, config.get("language_config") or {}, config):
        if any(f in sub for f in cal.EXPERT_FIELDS):
            return sub
    raise MergeError(f"config.json ({config.get('model_type')}) has none of the expert-count fields {cal.EXPERT_FIELDS}")


def _streaming_config(path):
    """The checks of cal.load_config without transformers: config.json is JSON of a supported
    family and the safetensors shards are complete. Raises CalibrationError like it."""
    from types import SimpleNamespace
    from common.checkpoint import CheckpointError, checked_weights
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise cal.CalibrationError(f"{path}: cannot read its config.json ({e}); not a valid JSON file") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise cal.CalibrationError(f"{path}: cannot read its config.json (no model_type)")
    cal.check_supported(SimpleNamespace(model_type=config["model_type"]))
    try:
        checked_weights(path)
    except CheckpointError as e:
        raise cal.CalibrationError(str(e)) from None
    return config


def streaming_info(path, config):
    """The model description check_stats compares against, from files only."""
    headers, where, layers = scan_checkpoint(path)
    if not layers:
        raise MergeError(f"{path}: no routed-expert tensors found in the safetensors files")
    first = layers[min(layers)]
    rkey = [k for k in first["router"] if k.endswith(".weight")][0]
    entries, start = headers[where[rkey]]
    w = read_tensor(os.path.join(path, where[rkey]), start, entries[rkey])
    tc = _expert_config(config)
    return {"model_type": config["model_type"], "num_experts": int(w.shape[0]), "top_k": int(tc["num_experts_per_tok"]),
            "layers": sorted(layers), "fingerprint": cal.router_fingerprint(w)}


PARTS = {"gate_proj.weight": "gate", "up_proj.weight": "up", "down_proj.weight": "down",   # per-expert keys
         "w1.weight": "gate", "w3.weight": "up", "w2.weight": "down"}                        # Mixtral


def _fused_canonical(gu_shape, down_shape, H):
    """True if fused per-expert shapes are transformers 5's [2I, H] / [H, I] (the layout
    save_pretrained writes), False for the transposed [H, 2I] / [I, H] of some hub files."""
    if down_shape[0] != down_shape[1]:
        return down_shape[0] == H
    return gu_shape[1] == H


def _canonical_streams(streams, x, H):
    """Layer tensors read by _read_layer (expert streams only) -> canonical float32 W parts
    gate / up [N, I, H], down [N, H, I]. Raises MergeError for an expert tensor that is none
    of the known projections (the own-tensor hook needs to know every part)."""
    W = {}
    fused = {st[5]: (st, v) for st, v in zip(streams, x) if st[4] == "fused"}
    for st, v in zip(streams, x):
        if st[4] != "expert":
            continue
        if st[5] not in PARTS:
            raise MergeError(f"expert tensor {st[5]!r} is not a known projection {sorted(PARTS)}; methods with their "
                             f"own merge operator need gate / up / down projections")
        W[PARTS[st[5]]] = torch.stack([v[e].float() for e in range(len(v))])
    if fused:
        (gst, gv), (dst_, dv) = fused["gate_up_proj"], fused["down_proj"]
        canon = _fused_canonical(gst[2], dst_[2], H)
        gu = torch.stack([gv[e].float() if canon else gv[e].float().T for e in range(len(gv))])
        I = gu.shape[1] // 2
        W.update(gate=gu[:, :I], up=gu[:, I:],
                 down=torch.stack([dv[e].float() if canon else dv[e].float().T for e in range(len(dv))]))
    return W


def _own_tensor(st, merged, g):
    """Output tensor for slot group index g of one stream from a method's own merged tensors,
    in the stream's own layout (per-expert, fused canonical or transposed, router rows)."""
    kind, rest = st[4], st[5]
    if kind == "expert":
        return merged[PARTS[rest]][g]
    if kind == "fused":
        canon = st[6]
        t = torch.cat([merged["gate"][g], merged["up"][g]], 0) if rest == "gate_up_proj" else merged["down"][g]
        return t if canon else t.T
    return merged["router" if rest == "weight" else "bias"][g]


def merge_streaming(src, dst, plan):
    """Merge from the checkpoint files alone into dst (created if missing; holds nothing else yet).

    Output shard i holds the untouched tensors of input shard i (in-kernel byte copies of
    coalesced ranges, first) and then the merged experts / routers of every MoE layer whose
    router lives in shard i. One layer's expert bytes are read with a few large preads into a
    reused buffer while the previous layer merges (two buffers, one prefetch thread, one
    hand-off per layer); merging reuses one float32 accumulator (no fresh allocation per
    tensor). The "bound" router operator writes N expert slots (slot e = the merge of e's
    group) and copies the router untouched. A method with its own tensors (plan "own") gets each
    layer's tensors in the canonical layout through `own_merge`; they are written back in the
    file's layout and dtype. Raises MergeError for quantised or non-float expert tensors, and
    (`check_streamable`) before anything is written for a layout or plan it does not understand."""
    check_streamable(src, plan)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    headers, where, layers = scan_checkpoint(src)
    K, op, own = plan.get("K") or len(plan["groups"][0]), plan.get("router", "average"), plan.get("own", False)
    N = next(headers[where[k]][0][k]["shape"][0] for k in layers[min(layers)]["router"] if k.endswith(".weight"))
    S = N if op == "bound" else K                                  # expert slots written
    # --- plan every output: per home shard, the layers' streams; a stream is one merged tensor
    # family (per-expert `experts.{g}.{rest}`, or a fused [N, ...] tensor / router merged row-wise)
    # = (output [(name, shape)], dtype, input shape of one expert, {e: (key, row or None)}, kind, rest[, canonical])
    jobs = {s: [] for s in headers}
    merged_keys = set()
    routers = {}
    for li, lidx in enumerate(sorted(layers)):
        lay = layers[lidx]
        home = where[lay["router"][0]] if lay["router"] else where[next(iter(lay["experts"]))]
        per_rest, streams = {}, []
        for k, (e, rest) in lay["experts"].items():
            per_rest.setdefault(rest, {})[e] = k
        rkeys = {RE_ROUTER.match(k).group("rest"): k for k in lay["router"]}
        H = headers[where[rkeys["weight"]]][0][rkeys["weight"]]["shape"][1]
        fused = [(rest, by_e[None]) for rest, by_e in sorted(per_rest.items()) if None in by_e]
        fshape = {rest: headers[where[k]][0][k]["shape"][1:] for rest, k in fused}
        canon = _fused_canonical(fshape["gate_up_proj"], fshape["down_proj"], H) if len(fshape) == 2 else True
        for rest, by_e in sorted(per_rest.items()):
            if None not in by_e:
                ent = headers[where[by_e[0]]][0][by_e[0]]
                if ent["dtype"] not in FLOATS:
                    raise MergeError(f"{by_e[0]}: dtype {ent['dtype']} (quantised experts are not supported)")
                streams.append(([(f"{lay['block']}.experts.{g}.{rest}", ent["shape"]) for g in range(S)],
                                ent["dtype"], ent["shape"], {e: (k, None) for e, k in by_e.items()}, "expert", rest))
        for kind, rest, k in ([("fused", r, k) for r, k in fused] +
                              ([("router", RE_ROUTER.match(k).group("rest"), k) for k in lay["router"]] if op != "bound" else [])):
            ent = headers[where[k]][0][k]
            if ent["dtype"] not in FLOATS:
                raise MergeError(f"{k}: dtype {ent['dtype']} (quantised experts are not supported)")
            n_out = S if kind == "fused" else K
            streams.append(([(k, [n_out] + ent["shape"][1:])], ent["dtype"], ent["shape"][1:],
                            {e: (k, e) for e in range(ent["shape"][0])}, kind, rest, canon))
        merged_keys.update(k for st in streams for k, _ in st[3].values())
        if own:
            routers[li] = {("router" if r == "weight" else "bias"): k for r, k in rkeys.items()}
        jobs[home].append((li, streams))
    # --- write shards: header first (sizes are known), then the data in header order
    os.makedirs(dst, exist_ok=True)
    weight_map, total = {}, 0
    files = {s: open(os.path.join(src, s), "rb") for s in headers}
    bufs, acc = [None, None], [torch.empty(0), None]   # input buffers; float32 accumulator, output scratch
    try:
        with ThreadPoolExecutor(1) as pool:
            for s in sorted(headers):
                entries, start = headers[s]
                copies = sorted((k for k in entries if k not in merged_keys), key=lambda k: entries[k]["data_offsets"])
                if not copies and not jobs[s]:
                    continue
                hdr, off = {}, 0
                for name, dt, shape in ([(k, entries[k]["dtype"], entries[k]["shape"]) for k in copies] +
                                        [(n, st[1], sh) for _, streams in jobs[s] for st in streams
                                         for n, sh in st[0]]):
                    size = math.prod(shape) * DTYPES[dt].itemsize
                    hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + size]}
                    off += size
                    weight_map[name] = s
                total += off
                hb = json.dumps({"__metadata__": {"format": "pt"}, **hdr}, separators=(",", ":")).encode()
                hb += b" " * (-len(hb) % 8)
                with open(os.path.join(dst, s), "wb") as f:
                    f.write(len(hb).to_bytes(8, "little"))
                    f.write(hb)
                    nxt = pool.submit(_read_layer, files, headers, where, jobs[s][0][1], bufs, 0) if jobs[s] else None
                    for a, b in _coalesce([(start + entries[k]["data_offsets"][0], start + entries[k]["data_offsets"][1])
                                           for k in copies], gap=0):
                        _write_one(f, ("copy", os.path.join(src, s), a, b - a))
                    for i, (li, streams) in enumerate(jobs[s]):
                        inputs = nxt.result()
                        merged = None
                        if own:        # before the prefetch of the next layer reuses the other buffer
                            rt = {n: read_tensor(os.path.join(src, where[k]), headers[where[k]][1],
                                                 headers[where[k]][0][k]).float() for n, k in routers[li].items()}
                            W = dict(_canonical_streams(streams, inputs, rt["router"].shape[1]), **rt)
                            merged = own_merge(plan, li, W, K)
                        if i + 1 < len(jobs[s]):
                            nxt = pool.submit(_read_layer, files, headers, where, jobs[s][i + 1][1], bufs, (i + 1) % 2)
                        groups, weights = plan["groups"][li], plan["weights"][li]
                        sgroups, sweights = slot_groups(groups, weights, N, op)
                        gidx = [groups.index(g) for g in sgroups]
                        for st, x in zip(streams, inputs):
                            dt, shape, kind = st[1], st[2], st[4]
                            slots = list(zip(sgroups, sweights)) if kind != "router" else list(zip(groups, weights))
                            if merged is not None and kind != "router":
                                for g in gidx:
                                    _write_one(f, _own_tensor(st, merged, g).to(DTYPES[dt]))
                                continue
                            if merged is not None and merged["router" if st[5] == "weight" else "bias"] is not None:
                                for g in range(K):
                                    _write_one(f, _own_tensor(st, merged, g).to(DTYPES[dt]))
                                continue
                            n = math.prod(shape)
                            if acc[0].numel() < n:
                                acc[0], acc[1] = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float64)
                            a32, o = acc[0][:n].view(shape), acc[1].view(torch.uint8)[:n * DTYPES[dt].itemsize]
                            o = o.view(DTYPES[dt]).view(shape)
                            for grp, w in slots:
                                _write_one(f, weighted_sum([x[e] for e in grp], w, DTYPES[dt], acc=a32, out=o))
    finally:
        for fh in files.values():
            fh.close()
    # --- config, index, side files
    sub = _expert_config(config)
    if op != "bound":
        sub[next(f for f in cal.EXPERT_FIELDS if f in sub)] = K
        sub.update(plan.get("routing", {}))
    for f, v in sub.items():           # DeepSeek-VL2 configs may repeat language fields at the top level
        if sub is not config and f in cal.EXPERT_FIELDS + ("n_group", "topk_group") and f in config:
            config[f] = v
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    copy_side_files(src, dst)


def _coalesce(ranges, gap):
    """Sorted [(start, end)] byte ranges -> fewer ranges, joining neighbours at most `gap` apart."""
    out = []
    for a, b in sorted(ranges):
        if out and a - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _read_layer(files, headers, where, streams, bufs, slot, gap=1 << 20):
    """Read every expert input of one layer into the reused buffer bufs[slot] with one pread
    per run of nearby tensors (gaps <= 1 MiB are read through); returns, per stream, a dict
    {e: tensor view}. Runs in the prefetch thread, so reading overlaps merging and writing."""
    want = {}                                   # (key, row) -> (shard, start, end, dtype, shape)
    for _, dt, shape, src_of, *_ in streams:
        for key, row in src_of.values():
            entries, start = headers[where[key]]
            a, b = entries[key]["data_offsets"]
            if row is not None:
                n = (b - a) // entries[key]["shape"][0]
                a, b = a + row * n, a + (row + 1) * n
            want[key, row] = (where[key], start + a, start + b, DTYPES[dt], shape)
    runs = {}
    for shard in {v[0] for v in want.values()}:
        runs[shard] = _coalesce([(v[1], v[2]) for v in want.values() if v[0] == shard], gap)
    need = sum(b - a + 8 for r in runs.values() for a, b in r)
    if bufs[slot] is None or bufs[slot].numel() < need:
        bufs[slot] = None                       # drop the old buffer before allocating the new one
        bufs[slot] = torch.empty(need, dtype=torch.uint8)
    buf, pos, at = bufs[slot], 0, {}
    mv = memoryview(buf.numpy())
    for shard, rs in sorted(runs.items()):
        fd = files[shard].fileno()
        for a, b in rs:
            pos += (a - pos) % 8                # same alignment as in the file: dtype views stay aligned
            done = 0
            while done < b - a:
                n = os.preadv(fd, [mv[pos + done:pos + b - a]], a + done)
                if n == 0:
                    raise MergeError(f"{files[shard].name}: short read at {a + done}; the file is truncated")
                done += n
            at[shard, a, b] = pos
            pos += b - a
    starts = {shard: [a for a, _ in rs] for shard, rs in runs.items()}
    out = []
    for _, dt, shape, src_of, *_ in streams:
        views = {}
        for e, (key, row) in src_of.items():
            shard, a, b, dtype, shp = want[key, row]
            i = max(j for j, s0 in enumerate(starts[shard]) if s0 <= a)
            r0, r1 = runs[shard][i]
            p = at[shard, r0, r1] + a - r0
            raw = buf[p:p + b - a]
            if p % dtype.itemsize:               # a misaligned tensor in the file: copy it out
                raw = raw.clone()
            views[e] = raw.view(dtype).view(shp) if b > a else torch.empty(shp, dtype=dtype)
        out.append(views)
    return out


def _write_one(f, item):
    """Append one piece of output to the open shard f: ("copy", src file, offset, nbytes), a
    byte range copied in the kernel, or a merged tensor."""
    if isinstance(item, tuple):
        copy_bytes(item[1], f, item[2], item[3])
    elif item.numel():
        f.write(memoryview(item.contiguous().reshape(-1).view(torch.uint8).numpy()))


# ----------------------------------------------------------------------------- entry point

def load_method_features(stats_paths, method):
    """The features `rolemerge.calibrate --features` wrote next to each stats file, summed.
    Raises MergeError naming the calibrate flag when one is missing or unreadable."""
    from rolemerge import baselines as bl
    paths = [stats_paths] if isinstance(stats_paths, str) else list(stats_paths)
    fps = [bl.features_path(p) for p in paths]
    for sp, fp in zip(paths, fps):
        if not os.path.exists(fp):
            raise MergeError(f"method {method!r} needs calibration features (expert outputs, router logits) and "
                             f"{fp} is missing: rerun python -m rolemerge.calibrate ... --out {sp} --features")
    try:
        feats, meta = bl.load_features(fps)
    except (ValueError, OSError) as e:
        raise MergeError(f"{e}; rerun python -m rolemerge.calibrate ... --features") from None
    return feats, meta


def param_summary(path, plan):
    """Parameter counts of a merged checkpoint directory, from its safetensors headers:
    params (every tensor), expert_slots / unique_experts per layer (bound: N slots, K_l unique:
    file size and parameter count do not shrink) and unique_params (params minus the copies of
    bound slots: what a runtime that shares a group's slots would hold)."""
    headers, where, layers = scan_checkpoint(path)
    params = sum(math.prod(e["shape"]) for entries, _ in headers.values() for e in entries.values())
    dup = 0
    for li, lidx in enumerate(sorted(layers)):
        numel = sum(math.prod(headers[where[k]][0][k]["shape"]) for k in layers[lidx]["experts"])
        slots = plan["slots"]
        dup += (slots - len(plan["groups"][li])) * numel // slots
    return {"params": params, "unique_params": params - dup, "expert_slots": plan["slots"],
            "unique_experts": [len(g) for g in plan["groups"]]}


def run_merge(model_path, stats_paths, out, rho=None, k=None, method="rolemerge", lam=0.03, linkage="single",
              seed=0, streaming=None, force=False, dtype=None, features=None, router=None, distance="euclidean",
              adaptive=False):
    """Plan + merge + save + report. Returns the report dict. Raises MergeError / CalibrationError.

    streaming None (default): merge from the checkpoint files (`merge_streaming`) unless a load
    `dtype` is asked for; False loads the model (`merge_model` + save_pretrained); both write the
    same tensors. method: every name of `all_methods()`; the feature methods (msmoe, hcsmoe,
    reap, the comparators) read the features `rolemerge.calibrate --features` wrote next to the
    stats file(s) unless `features` is given. router / distance / adaptive: see `make_plan`.
    The output is written to `{out}.tmp` and renamed to `out` only when complete (report
    last), so a killed run never leaves a directory at `out`; a rerun starts the `.tmp` over
    and gives the same bytes. `force` replaces only a previous RoleMerge output (a directory
    holding rolemerge_report.json) or an empty directory, never other data; likewise a leftover
    `{out}.tmp` is deleted only if it holds TMP_MARK or the report, `{out}.old` only if it holds the report."""
    from common import backbone as bb
    src = bb.resolve(model_path)
    if not os.path.exists(os.path.join(src, "config.json")):
        raise MergeError(f"{src}: no config.json (not a save_pretrained checkpoint directory)")
    check_rho_k(rho, k)
    if linkage not in rm.LINKAGES:   # every method, before any loading
        raise MergeError(f"unknown linkage {linkage!r}; choose from {rm.LINKAGES}")
    if method not in all_methods():
        raise MergeError(f"unknown method {method!r}; choose from {all_methods()}")
    router = router_operator(method, router)
    if distance not in ("euclidean", "cosine"):
        raise MergeError(f"unknown distance {distance!r}; choose from ('euclidean', 'cosine')")
    if adaptive and (method != "msmoe" or router != "bound"):
        raise MergeError("layer-adaptive expert counts are M-SMoE's (--method msmoe) and need --router bound: a "
                         "transformers config holds one expert count for all layers")
    if not (lam >= 0 and math.isfinite(lam)):
        raise MergeError(f"lambda={lam} must be a finite number >= 0 (paper: 0.03)")
    if streaming is None:
        streaming = dtype is None
    if streaming and dtype is not None:
        raise MergeError("--dtype applies to the in-memory merge only (--in-memory); the streaming path keeps "
                         "every tensor's dtype from the checkpoint files")
    needs_features, fmeta = method in rm.FEATURE_METHODS or method in comparator_methods(), None
    out = out.rstrip("/") or out
    real_out, real_src = os.path.realpath(out), os.path.realpath(src)
    if real_out == real_src or os.path.commonpath([real_out, real_src]) == real_out:
        raise MergeError(f"--out {out} is the input checkpoint (or a folder holding it); write the merged model "
                         f"to a new directory")
    if os.path.lexists(out):
        if not force:
            raise MergeError(f"--out {out} already exists; pass --overwrite to replace it, or choose another --out")
        if not os.path.isdir(out) or os.path.islink(out) or (
                os.listdir(out) and not os.path.exists(os.path.join(out, REPORT))):
            raise MergeError(f"{out} exists and is not a RoleMerge output (no {REPORT}); refusing to delete it "
                             f"even with --overwrite: choose a new --out")
    tmp, old = out + ".tmp", out + ".old"
    if not _ours(tmp, (TMP_MARK, REPORT)):
        raise MergeError(f"{tmp} exists and is not a RoleMerge temp folder (no {TMP_MARK} or {REPORT}); refusing "
                         f"to delete it: move it away or choose a new --out")
    if force and os.path.lexists(out) and not _ours(old, (REPORT,)):
        raise MergeError(f"{old} exists and is not a previous RoleMerge output (no {REPORT}); refusing to delete "
                         f"it even with --overwrite: move it away or choose a new --out")
    # readable, supported family, complete safetensors shards (streaming: from config.json alone, so the
    # merge never imports transformers, whose import costs seconds)
    cal.load_config(src) if not streaming else _streaming_config(src)
    if needs_features and features is None:             # before the stats: names the calibrate flag
        features, fmeta = load_method_features(stats_paths, method)
    stats = cal.load_stats(stats_paths)
    thin = sparse_calibration(stats)
    if thin:
        print(thin, file=sys.stderr)
    if needs_features and fmeta is not None:
        if fmeta.get("fingerprint") != stats["fingerprint"] or len(features) != len(stats["layer_names"]):
            raise MergeError("the features file was recorded on a different model than the stats; recalibrate "
                             "with python -m rolemerge.calibrate ... --features")
    with _no_tmp_after_io_error(tmp, out):
        t0 = time.time()
        if streaming:
            with open(os.path.join(src, "config.json")) as f:
                config = json.load(f)
            info = streaming_info(src, config)
            check_stats(stats, info)
            K = target_k(info["num_experts"], info["top_k"], rho, k)
            routing = (1, {}) if router == "bound" else routing_groups(
                config["model_type"], _expert_config(config), info["num_experts"], K, info["top_k"])

            def routers():
                headers, where, layers = scan_checkpoint(src)
                out_r = []
                for lidx in sorted(layers):
                    key = [x for x in layers[lidx]["router"] if x.endswith(".weight")][0]
                    out_r.append(read_tensor(os.path.join(src, where[key]), headers[where[key]][1], headers[where[key]][0][key]))
                return out_r
            tp = time.time()
            plan = make_plan(stats, K, method, lam, linkage, seed, routers, features, routing, router, distance, adaptive)
            plan_s = time.time() - tp
            _start_tmp(tmp)
            merge_streaming(src, tmp, plan)
        else:
            model = load_model_for_merge(src, dtype)
            info = cal.model_info(model, model_path)
            check_stats(stats, info)
            K = target_k(info["num_experts"], info["top_k"], rho, k)
            routing = (1, {}) if router == "bound" else routing_groups(
                model.config.model_type, cal.text_config(model.config).to_dict(), info["num_experts"], K, info["top_k"])
            tp = time.time()
            plan = make_plan(stats, K, method, lam, linkage, seed,
                             lambda: [b.gate.weight.detach().float().cpu() for _, b in cal.moe_blocks(model)],
                             features, routing, router, distance, adaptive)
            plan_s = time.time() - tp
            merge_model(model, plan)
            _start_tmp(tmp)
            model.save_pretrained(tmp)
            copy_side_files(src, tmp)
        if plan.get("own"):                                   # a comparator's groups are known once merged
            finish_plan(plan, stats)
        report = dict({k: v for k, v in plan.items() if not k.startswith("_")}, model=str(model_path),
                      stats=list(stats_paths) if not isinstance(stats_paths, str) else [stats_paths], streaming=streaming,
                      merge_seconds=time.time() - t0, plan_seconds=plan_s, **param_summary(tmp, plan))
        with open(os.path.join(tmp, REPORT), "w") as f:      # last file: its presence marks a complete output
            json.dump(report, f, indent=1)
        os.remove(os.path.join(tmp, TMP_MARK))                # the report marks it from here on
        follow_umask(tmp)                                     # save_pretrained writes weights 0600
        if os.path.exists(out):                               # --overwrite over a previous output
            old = out + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    return report


def summary_line(rep, out):
    """The line `rolemerge.merge` prints for a `run_merge` report: sizes, time, ACR in % (1 decimal) and the
    expert-phase MI retention (3 decimals; pruning has none: it keeps no grouping of all experts)."""
    mi = rep["mi_retention"]
    mi = "n/a (pruning keeps no grouping of all experts)" if mi is None else f"{mi:.3f}"
    return (f"merged {rep['N']} -> {rep['K']} experts per layer ({rep['method']}) in {rep['merge_seconds']:.1f}s: "
            f"{out}; ACR {100 * rep['acr_mean']:.1f}%, expert-phase MI retention {mi}")


def main(argv=None):
    from common.cli import add_overwrite, entry_parser
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--model", required=True, help="checkpoint directory (or tiny-moe)")
    p.add_argument("--stats", nargs="+", required=True, help="stats file(s) from rolemerge.calibrate; all are summed")
    p.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--rho", type=float, help="expert retention ratio in (0, 1]; K = round(rho * N) per layer")
    g.add_argument("--k", type=int, help="experts kept per MoE layer (transformers configs hold one count for all layers)")
    p.add_argument("--method", default="rolemerge", choices=all_methods(),
                   help="rolemerge (paper); controls no_phase_split / lambda0 / permuted / kmeans / empirical_prior; "
                        "baselines frequency (global-frequency merging) / prune (frequency pruning); the papers' own "
                        "criteria msmoe / hcsmoe / reap and the comparators of rolemerge/comparators.py (these read "
                        "the features of rolemerge.calibrate --features next to --stats)")
    p.add_argument("--router", default=None, choices=ROUTERS,
                   help="router operator: bound (all N router rows kept, every member expert slot holds its group's "
                        "merge: the M-SMoE / HC-SMoE codes; checkpoint size does not shrink) or average (K rows, the "
                        "weighted average of the members' rows). Default: the method's official one (bound for "
                        "msmoe / hcsmoe, average otherwise)")
    p.add_argument("--distance", default="euclidean", choices=("euclidean", "cosine"),
                   help="HC-SMoE's distance between mean expert outputs (official: euclidean)")
    p.add_argument("--adaptive", action="store_true",
                   help="M-SMoE's layer-adaptive expert counts (global frequency threshold; needs --router bound)")
    p.add_argument("--lam", type=float, default=0.03, help="mean collision weight lambda over layers (paper .03)")
    p.add_argument("--linkage", default="single", choices=rm.LINKAGES, help="group dissimilarity (paper: single)")
    p.add_argument("--seed", type=int, default=0, help="seed of the permuted / kmeans controls")
    p.add_argument("--in-memory", action="store_true",
                   help="load the model and merge it in memory (default: stream from the safetensors shards without "
                        "loading the model; identical tensors, bounded memory)")
    p.add_argument("--streaming", action="store_true", help=argparse.SUPPRESS)   # the default; kept so older commands run
    add_overwrite(p, "output directory (a previous merge only, never other data)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="load dtype of --in-memory (auto: the checkpoint's own; streaming always keeps the "
                        "checkpoint's dtypes)")
    from common.cli import add_threads, fail, set_threads
    add_threads(p)
    a = p.parse_args(argv)
    if a.in_memory and a.streaming:
        fail("--in-memory and --streaming exclude each other (streaming is the default)")
    if a.dtype != "auto" and not a.in_memory:
        fail(f"--dtype applies to the in-memory merge only: add --in-memory (the streaming merge, the default, keeps "
             f"every tensor's dtype from the checkpoint files)")
    set_threads(a.threads, a.model)
    try:
        rep = run_merge(a.model, a.stats, a.out, a.rho, a.k, a.method, a.lam, a.linkage, a.seed, not a.in_memory,
                        a.overwrite, None if a.dtype == "auto" else getattr(torch, a.dtype), router=a.router,
                        distance=a.distance, adaptive=a.adaptive)
    except (MergeError, cal.CalibrationError, OSError) as e:
        fail(e)  # `error: ...`, exit status 2
    print(summary_line(rep, a.out))
    if rep["router"] == "bound":
        print(f"note: bound router: {rep['expert_slots']} expert slots per layer kept (the router keeps all rows), "
              f"{rep['unique_params']:,} unique of {rep['params']:,} parameters; the files do not shrink")
    if rep["routing"]:
        print(f"note: group-limited routing rewritten so K={rep['K']} is valid: {rep['routing']} (experts were merged "
              f"only within these routing groups)")


if __name__ == "__main__":
    main()
