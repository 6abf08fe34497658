"""Planning a merge: the settings (`MergeConfig`), K, the router operator, DeepSeek's routing
groups, and every MoE layer's groups, merge weights and diagnostics from the statistics
(paper §4.3, App. B.2-B.3). Tensors of the checkpoint are not read here (only the router rows
of the frequency baseline, through a callable).
"""
import math
import os
from dataclasses import dataclass

from rolemerge import baselines as bl
from rolemerge import comparators
from rolemerge import model as rm
from rolemerge import stats as st
from rolemerge.blocks import MergeError


@dataclass
class MergeConfig:
    """The settings of one merge, as `python -m rolemerge.merge` takes them: every field is the
    dest of the flag of that name (`--in-memory` -> in_memory; tested), filled from argparse in
    one place (`merge.config_from_args`) and passed whole to `run_merge` and `make_plan`.

    model: checkpoint directory (or tiny-moe); stats: stats file(s) of rolemerge.calibrate;
    out: output directory; rho (retention ratio in (0, 1]) or k (experts kept per layer):
    exactly one; method: an `all_methods()` name; router: "bound" / "average" / None (the
    method's official operator); distance: HC-SMoE's; adaptive: M-SMoE's layer-adaptive counts;
    lam: mean collision weight lambda; linkage: group dissimilarity; seed: of the permuted /
    kmeans controls; in_memory: load the model instead of streaming the shards; overwrite:
    replace a previous output; dtype: load dtype of the in-memory merge ("auto": the
    checkpoint's own); threads: CPU threads (None: the library's default)."""
    model: str = None
    stats: list = None
    out: str = None
    rho: float = None
    k: int = None
    method: str = "rolemerge"
    router: str = None
    distance: str = "euclidean"
    adaptive: bool = False
    lam: float = 0.03
    linkage: str = "single"
    seed: int = 0
    in_memory: bool = False
    overwrite: bool = False
    dtype: str = "auto"
    threads: int = None

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
    (blocks.model_info or shards.streaming_info)."""
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
    zero = float((st.total_counts(stats) == 0).double().mean())
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


def all_methods():
    """Every `--method`: rolemerge, its controls and baselines (rolemerge.model.METHODS) and the comparators."""
    return tuple(rm.METHODS) + tuple(m for m in comparators.COMPARATORS if m not in rm.METHODS)


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


def check_config(cfg):
    """Raise MergeError for settings no merge can run with (before anything is loaded): an
    unknown linkage, method, router operator or distance, layer-adaptive counts outside M-SMoE
    with the bound router, a lambda that is not a finite number >= 0. Returns the router
    operator (`router_operator`)."""
    if cfg.linkage not in rm.LINKAGES:   # every method
        raise MergeError(f"unknown linkage {cfg.linkage!r}; choose from {rm.LINKAGES}")
    if cfg.method not in all_methods():
        raise MergeError(f"unknown method {cfg.method!r}; choose from {all_methods()}")
    op = router_operator(cfg.method, cfg.router)
    if cfg.distance not in bl.DISTANCES:
        raise MergeError(f"unknown distance {cfg.distance!r}; choose from {bl.DISTANCES}")
    if cfg.adaptive and (cfg.method != "msmoe" or op != "bound"):
        raise MergeError("layer-adaptive expert counts are M-SMoE's (--method msmoe) and need --router bound: a "
                         "transformers config holds one expert count for all layers, so only N bound slots with "
                         "K_l unique experts per layer can express them")
    if not (cfg.lam >= 0 and math.isfinite(cfg.lam)):
        raise MergeError(f"lambda={cfg.lam} must be a finite number >= 0 (paper: 0.03)")
    return op


def needs_features(method):
    """True for the methods that group from calibration features (`calibrate --features`):
    M-SMoE, HC-SMoE, REAP and the comparators."""
    return method in rm.FEATURE_METHODS or method in comparators.COMPARATORS


def make_plan(stats, K, cfg=None, routers=None, features=None, routing=(1, {})):
    """Groups, weights and diagnostics for every MoE layer.

    stats: `stats.load_stats` output; K: experts kept per layer; cfg: the MergeConfig (method,
    lam, linkage, seed, router, distance, adaptive; default MergeConfig()); routers: callable ->
    list of [N, H] router weights (only called for the frequency baseline); features: per-layer
    features (`calibrate --features`, `rolemerge.baselines.collect_features`; for msmoe /
    hcsmoe / reap and the comparators); routing: routing_groups' (blocks, config fields),
    ignored by the bound router operator (it keeps N expert slots and the router). A comparator
    (rolemerge/comparators.py) returns its groups while merging: its plan has groups None until
    `finish_plan` runs after the merge. Returns a dict with 'groups' [L][G][members], 'weights'
    [L][G][w], 'layers' (per-layer diagnostics), 'routing' (config fields rewritten), 'router',
    summary ACR / MI retention, and the internal '_mass' [L, N] / '_features' (never written to
    the report). Raises MergeError (`check_config`, missing features)."""
    cfg = cfg or MergeConfig()
    method, op = cfg.method, check_config(cfg)
    if op == "bound":
        routing = (1, {})
    counts = st.total_counts(stats).double()                    # [L, B, N]
    own = method in comparators.COMPARATORS
    if needs_features(method):
        if features is None:
            raise MergeError(f"method {method!r} needs the calibration features (rolemerge.calibrate --features)")
        _, info = rm.plan(counts, K, "prune", cfg.lam, cfg.linkage, cfg.seed, blocks=routing[0])   # kappa / lambda / tau only
        groups = None if own else bl.plan_groups(method, features, K, routing[0], cfg.distance, cfg.adaptive)
    else:
        groups, info = rm.plan(counts, K, method, cfg.lam, cfg.linkage, cfg.seed,
                               routers() if method == "frequency" else None, blocks=routing[0])
    plan = {"method": method, "K": K, "N": stats["num_experts"], "lambda": cfg.lam, "linkage": cfg.linkage,
            "seed": cfg.seed, "router": op, "routing": routing[1], "groups": groups, "info": info,
            "_mass": counts.sum(1), "_features": features}
    if method == "hcsmoe":
        plan["distance"] = cfg.distance
    if cfg.adaptive:
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


def load_method_features(stats_paths, method):
    """The features `rolemerge.calibrate --features` wrote next to each stats file, summed.
    Raises MergeError naming the calibrate flag when one is missing or unreadable."""
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
