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
import dataclasses
import math
import os
import sys
import time

import torch

from common.cli import add_overwrite, add_threads, entry_parser, fail, set_threads
from common.tiny import TINY
from rolemerge import blocks as blk
from rolemerge import calibrate as cal
from rolemerge import deepseek_vl2 as vl2
from rolemerge import merging
from rolemerge import model as rm
from rolemerge import planning
from rolemerge import shards as sh
from rolemerge import stats as st
from rolemerge.blocks import CalibrationError, MergeError
from rolemerge.planning import MergeConfig

# deferred: transformers (about 2 s of CPU to import: the in-memory merge alone needs it, so the streaming
# merge, the default, never pays it)


def run_merge(cfg, features=None):
    """Plan + merge + save + report for the settings `cfg` (MergeConfig). Returns the report dict.
    Raises MergeError / CalibrationError.

    Streaming (default) merges from the checkpoint files (`merging.merge_streaming`);
    cfg.in_memory loads the model (`merging.merge_model` + save_pretrained); both write the
    same tensors. The feature methods (msmoe, hcsmoe, reap, the comparators) read the features
    `rolemerge.calibrate --features` wrote next to the stats file(s) unless `features` is given.
    The output is written to `{out}.tmp` and renamed to `out` only when complete (report
    last), so a killed run never leaves a directory at `out`; a rerun starts the `.tmp` over
    and gives the same bytes. cfg.overwrite replaces only a previous RoleMerge output (a directory
    holding rolemerge_report.json) or an empty directory, never other data (`shards.check_out`)."""
    out = cfg.out.rstrip("/") or cfg.out
    src = TINY.get(cfg.model, cfg.model)
    check_request(cfg, src, out)                                     # 1. refuse before anything is read
    stats, features = read_inputs(cfg, src, features)                # 2. scan: config, features, statistics
    tmp = out + ".tmp"
    with sh.no_tmp_after_io_error(tmp, out):
        t0 = time.time()
        merge = merge_in_memory if cfg.in_memory else merge_files    # 3. plan, merge every layer, write
        plan, plan_s = merge(cfg, src, stats, features, tmp)
        if plan.get("own"):                                          # a comparator's groups are known once merged
            planning.finish_plan(plan, stats)
        report = dict({k: v for k, v in plan.items() if not k.startswith("_")}, model=str(cfg.model),   # 4. report
                      stats=[cfg.stats] if isinstance(cfg.stats, str) else list(cfg.stats),
                      streaming=not cfg.in_memory, merge_seconds=time.time() - t0, plan_seconds=plan_s,
                      **param_summary(tmp, plan))
        sh.publish(tmp, out, report)
    return report


def check_request(cfg, src, out):
    """Every check that needs no file read: a checkpoint directory, rho / K, the settings
    (`planning.check_config`), --dtype only in memory, and an --out that is ours to write."""
    if not os.path.exists(os.path.join(src, "config.json")):
        raise MergeError(f"{src}: no config.json (not a save_pretrained checkpoint directory)")
    planning.check_rho_k(cfg.rho, cfg.k)
    planning.check_config(cfg)
    if not cfg.in_memory and cfg.dtype != "auto":
        raise MergeError("--dtype applies to the in-memory merge only (--in-memory); the streaming path keeps "
                         "every tensor's dtype from the checkpoint files")
    sh.check_out(out, src, cfg.overwrite)


def read_inputs(cfg, src, features=None):
    """The checkpoint's config checked (readable, a supported family, complete safetensors
    shards; streaming: from config.json alone, without transformers), the method's features
    (when it needs them and none are given) and the statistics. Returns (stats, features)."""
    if cfg.in_memory:
        cal.load_config(src)
    else:
        sh.streaming_config(src)
    fmeta = None
    if planning.needs_features(cfg.method) and features is None:      # before the stats: names the calibrate flag
        features, fmeta = planning.load_method_features(cfg.stats, cfg.method)
    stats = st.load_stats(cfg.stats)
    thin = planning.sparse_calibration(stats)
    if thin:
        print(thin, file=sys.stderr)
    if fmeta is not None and (fmeta.get("fingerprint") != stats["fingerprint"]
                              or len(features) != len(stats["layer_names"])):
        raise MergeError("the features file was recorded on a different model than the stats; recalibrate "
                         "with python -m rolemerge.calibrate ... --features")
    return stats, features


def merge_files(cfg, src, stats, features, tmp):
    """The streaming merge into `tmp`: plan from the statistics and the files' router rows, then
    `merging.merge_streaming`. Returns (plan, planning seconds)."""
    config = sh.read_config(src)
    info = sh.streaming_info(src, config)
    planning.check_stats(stats, info)
    K = planning.target_k(info["num_experts"], info["top_k"], cfg.rho, cfg.k)
    routing = (1, {}) if planning.router_operator(cfg.method, cfg.router) == "bound" else planning.routing_groups(
        config["model_type"], sh.expert_config(config), info["num_experts"], K, info["top_k"])
    tp = time.time()
    plan = planning.make_plan(stats, K, cfg, lambda: sh.router_weights(src), features, routing)
    plan_s = time.time() - tp
    sh.start_tmp(tmp)
    merging.merge_streaming(src, tmp, plan)
    return plan, plan_s


def merge_in_memory(cfg, src, stats, features, tmp):
    """The in-memory merge into `tmp`: load the model, plan, `merging.merge_model`,
    save_pretrained and the tokenizer / processor files. Returns (plan, planning seconds)."""
    model = load_model_for_merge(src, None if cfg.dtype == "auto" else getattr(torch, cfg.dtype))
    info = blk.model_info(model, cfg.model)
    planning.check_stats(stats, info)
    K = planning.target_k(info["num_experts"], info["top_k"], cfg.rho, cfg.k)
    routing = (1, {}) if planning.router_operator(cfg.method, cfg.router) == "bound" else planning.routing_groups(
        model.config.model_type, blk.text_config(model.config).to_dict(), info["num_experts"], K, info["top_k"])
    tp = time.time()
    plan = planning.make_plan(stats, K, cfg, lambda: [b.gate.weight.detach().float().cpu()
                                                      for _, b in blk.moe_blocks(model)], features, routing)
    plan_s = time.time() - tp
    merging.merge_model(model, plan)
    sh.start_tmp(tmp)
    model.save_pretrained(tmp)
    sh.copy_side_files(src, tmp)
    return plan, plan_s


def load_model_for_merge(path, dtype=None):
    """The model alone (no processor) of a supported checkpoint, in eval mode; safetensors
    only, no checkpoint code (`calibrate.load_config` checks the directory first)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    config = cal.load_config(path)
    if config.model_type == "deepseek_vl_v2":
        try:
            return vl2.load(path, dtype)
        except vl2.VL2Error as e:
            raise MergeError(str(e)) from None
    vlm = config.model_type in blk.VLM_TYPES + ("deepseek_ocr2",)
    cls = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=dtype, trust_remote_code=False, use_safetensors=True).eval()


def param_summary(path, plan):
    """Parameter counts of a merged checkpoint directory, from its safetensors headers:
    params (every tensor), expert_slots / unique_experts per layer (bound: N slots, K_l unique:
    file size and parameter count do not shrink) and unique_params (params minus the copies of
    bound slots: what a runtime that shares a group's slots would hold)."""
    headers, where, layers = sh.scan_checkpoint(path)
    params = sum(math.prod(e["shape"]) for entries, _ in headers.values() for e in entries.values())
    dup = 0
    for li, lidx in enumerate(sorted(layers)):
        numel = sum(math.prod(headers[where[k]][0][k]["shape"]) for k in layers[lidx]["experts"])
        slots = plan["slots"]
        dup += (slots - len(plan["groups"][li])) * numel // slots
    return {"params": params, "unique_params": params - dup, "expert_slots": plan["slots"],
            "unique_experts": [len(g) for g in plan["groups"]]}


def summary_line(rep, out):
    """The line `rolemerge.merge` prints for a `run_merge` report: sizes, time, ACR in % (1 decimal) and the
    expert-phase MI retention (3 decimals; pruning has none: it keeps no grouping of all experts)."""
    mi = rep["mi_retention"]
    mi = "n/a (pruning keeps no grouping of all experts)" if mi is None else f"{mi:.3f}"
    return (f"merged {rep['N']} -> {rep['K']} experts per layer ({rep['method']}) in {rep['merge_seconds']:.1f}s: "
            f"{out}; ACR {100 * rep['acr_mean']:.1f}%, expert-phase MI retention {mi}")


def parser():
    """The argparse parser of `python -m rolemerge.merge`; its dests are MergeConfig's fields."""
    p = entry_parser(__spec__.name if __spec__ else "rolemerge.merge", __doc__)
    p.add_argument("--model", required=True, help="checkpoint directory (or tiny-moe)")
    p.add_argument("--stats", nargs="+", required=True, help="stats file(s) from rolemerge.calibrate; all are summed")
    p.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--rho", type=float, help="expert retention ratio in (0, 1]; K = round(rho * N) per layer")
    g.add_argument("--k", type=int, help="experts kept per MoE layer (transformers configs hold one count for all layers)")
    p.add_argument("--method", default="rolemerge", choices=planning.all_methods(),
                   help="rolemerge (paper); controls no_phase_split / lambda0 / permuted / kmeans / empirical_prior; "
                        "baselines frequency (global-frequency merging) / prune (frequency pruning); the papers' own "
                        "criteria msmoe / hcsmoe / reap and the comparators of rolemerge/comparators.py (these read "
                        "the features of rolemerge.calibrate --features next to --stats)")
    p.add_argument("--router", default=None, choices=planning.ROUTERS,
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
    add_overwrite(p, "output directory (a previous merge only, never other data)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="load dtype of --in-memory (auto: the checkpoint's own; streaming always keeps the "
                        "checkpoint's dtypes)")
    add_threads(p)
    return p


def config_from_args(a):
    """The MergeConfig of parsed arguments: the one place the flags become settings."""
    return MergeConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(MergeConfig)})


def main(argv=None):
    cfg = config_from_args(parser().parse_args(argv))
    if cfg.dtype != "auto" and not cfg.in_memory:
        fail("--dtype applies to the in-memory merge only: add --in-memory (the streaming merge, the default, keeps "
             "every tensor's dtype from the checkpoint files)")
    set_threads(cfg.threads, cfg.model)
    try:
        rep = run_merge(cfg)
    except (MergeError, CalibrationError, OSError) as e:
        fail(e)  # `error: ...`, exit status 2
    print(summary_line(rep, cfg.out))
    if rep["router"] == "bound":
        print(f"note: bound router: {rep['expert_slots']} expert slots per layer kept (the router keeps all rows), "
              f"{rep['unique_params']:,} unique of {rep['params']:,} parameters; the files do not shrink")
    if rep["routing"]:
        print(f"note: group-limited routing rewritten so K={rep['K']} is valid: {rep['routing']} (experts were merged "
              f"only within these routing groups)")


if __name__ == "__main__":
    main()
