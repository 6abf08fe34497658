"""Toy reproduction of RoleMerge on the shapes world, from the tiny MoE-VLM base.

    python -m eval.toys.rolemerge            # every row below, writes out/rolemerge/results.json
    python -m eval.toys.rolemerge --quick    # rho = .5: full, RoleMerge, both baselines (~3 CPU minutes)

1. calibration: greedy decoding of the tiny Qwen3-VL-MoE (8 experts, top-2) on validation
   examples, one source per question family (the analogue of the paper's TCS task mix);
   routing counted per phase (image / question / answer), rolemerge/calibrate.py;
2. for rho in {.50, .625, .75} (K = 4, 5, 6 of 8) every variant is merged to a
   save_pretrained checkpoint (rolemerge/merge.py), reloaded with plain from_pretrained and
   evaluated on the test split with batched greedy decoding:
     rolemerge        the paper's method (single linkage, lambda = .03)
     controls         no_phase_split, lambda0, permuted (RRPs shuffled), average_link,
                      complete_link, kmeans (k-means++ on RRPs, seed 0)
     baselines        frequency (global-frequency merging, M-SMoE / HC-SMoE style),
                      prune (frequency pruning, REAP-style operator)
Per row: accuracy per family [95% bootstrap CI], macro average over families (MM-style),
paired-bootstrap difference vs the best baseline at the same rho, ACR (%), expert-phase MI
retention, parameter count, checkpoint bytes, load time, time to first token, decode tok/s.
Results are what this run measures; nothing is copied from the paper.

On the paper-structure bases (--paper BASES, eval/logs/rolemerge.md), --part picks the experiment:
table1 (Table 1 and its controls), sensitivity (Tables 3 / 14: lambda .01 / .10, five-seed
k-means++, linkages), search (Table 15 A: Greedy+1Swap, Greedy+SwapC), calibration (App. F: size
sweep and number of sources) and bootstrap (App. D.2 on committed per-question files, no runs).
"""
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from itertools import combinations

import numpy as np
import torch
from PIL import Image, ImageDraw

from common import backbone as bb
from common import data
from common import shapes
from common.cli import add_threads, entry_parser, late, number, set_threads
from eval.evaluate import evaluate, family_rows
from eval.metrics import bootstrap_ci, paired_bootstrap, two_level_bootstrap, two_level_task_equal_bootstrap
from eval.metrics import verdict as verdict_rule
from eval.tools.pretrain import LOOKS
from rolemerge import baselines as bl
from rolemerge import blocks as blk
from rolemerge import calibrate as cal
from rolemerge import comparators
from rolemerge import infer
from rolemerge import merge as mg
from rolemerge import model as rm
from rolemerge import stats as rstats
from rolemerge.planning import MergeConfig

VARIANTS = {  # name -> (method, linkage)
    "rolemerge": ("rolemerge", "single"),
    "no_phase_split": ("no_phase_split", "single"),
    "lambda0": ("lambda0", "single"),
    "permuted": ("permuted", "single"),
    "average_link": ("rolemerge", "average"),
    "complete_link": ("rolemerge", "complete"),
    "kmeans": ("kmeans", "single"),
    "frequency": ("frequency", "single"),
    "prune": ("prune", "single"),
}
BASELINES = ("frequency", "prune")
QUICK = dict(n_cal=12, n_test=150, rhos=(0.5,), variants=("rolemerge", "frequency", "prune"), speed_n=3)
FULL = dict(n_cal=48, n_test=500, rhos=(0.5, 0.625, 0.75), variants=tuple(VARIANTS), speed_n=8)
MAX_NEW = 48      # the tiny models describe the scene (~32 tokens), then answer; as eval.evaluate


def _ensure_data(data_dir, n_val, n_test):
    shapes.ensure_splits(data_dir, {"val": n_val, "test": n_test})  # never overwrites existing files


def _scalar(name, metric, value, n):
    return {"model": name, "family": "all", "metric": metric, "value": value, "ci_low": None, "ci_high": None, "n": n}


def _evaluate(name, path, test, cfg, extra):
    """Load a checkpoint with plain from_pretrained (timed), evaluate, measure speed.
    Returns (per-example results, scalar dict)."""
    model, proc, load_s = infer.load_timed(path)
    with torch.inference_mode():
        res = evaluate(model, proc, test, batch_size=50, max_new_tokens=MAX_NEW, desc=f"eval {name}")
        sp = infer.speed(model, proc, test, n=cfg["speed_n"])
    fam = {}
    for r in res:
        fam.setdefault(r["family"], []).append(r["correct"])
    macro = sum(sum(c) / len(c) for c in fam.values()) / len(fam)
    scal = dict(extra, macro_acc=macro, params=infer.param_count(model), ckpt_bytes=infer.checkpoint_bytes(path),
                load_s=load_s, **sp)
    return res, scal


def run(quick, data_dir, out_dir, base="tiny-moe", threads=None):
    """Calibrate, merge every (rho, variant), evaluate; return report rows and write
    {out_dir}/results.json (results_quick.json in quick mode)."""
    if threads:
        torch.set_num_threads(threads)
    cfg = QUICK if quick else FULL
    fams = shapes.FAMILIES
    _ensure_data(data_dir, 500, cfg["n_test"])
    test = data.read_llava_json(os.path.join(data_dir, "test.json"))[: cfg["n_test"]]
    val = data.read_llava_json(os.path.join(data_dir, "val.json"))
    sources = {f: [r for r in val if r["family"] == f][: cfg["n_cal"]] for f in fams}
    os.makedirs(out_dir, exist_ok=True)
    ck = os.path.join(out_dir, "ckpt_quick" if quick else "ckpt")
    t = time.time()
    model, proc = cal.load_model(base)
    stats = cal.calibrate(model, proc, sources, batch_size=16, max_new_tokens=MAX_NEW, model_id=base)
    stats_path = os.path.join(ck, "stats.safetensors")
    rstats.save_stats(stats, stats_path)
    del model
    tot = rstats.total_counts(stats)
    summary = {"calibration": {"seconds": time.time() - t, "examples": sum(len(s) for s in sources.values()),
                               "tokens": dict(zip(stats["buckets"], sum(s["tokens"] for s in stats["sources"].values()).tolist())),
                               "counts_per_layer": tot.tolist()}}
    print(f"[toy_rolemerge] calibrated {summary['calibration']['examples']} examples in "
          f"{summary['calibration']['seconds']:.0f}s: tokens {summary['calibration']['tokens']}", flush=True)
    rows, results = [], {}
    res, scal = _evaluate("full", bb.resolve(base), test, cfg, {})
    results["rolemerge/full"], summary["rolemerge/full"] = res, scal
    for rho in cfg["rhos"]:
        for v in cfg["variants"]:
            method, linkage = VARIANTS[v]
            path = os.path.join(ck, f"{v}_rho{rho}")
            t = time.time()
            rep = mg.run_merge(MergeConfig(model=base, stats=stats_path, out=path, rho=rho, method=method,
                                           linkage=linkage, overwrite=True))
            merge_s = time.time() - t
            name = f"rolemerge/{v}@{rho}"
            res, scal = _evaluate(name, path, test, cfg, {"K": rep["K"], "acr_pct": 100 * rep["acr_mean"],
                                                         "mi_retention": rep["mi_retention"], "merge_s": merge_s})
            results[name], summary[name] = res, scal
            print(f"[toy_rolemerge] {name}: K={rep['K']} acc {sum(r['correct'] for r in res) / len(res):.3f} "
                  f"macro {scal['macro_acc']:.3f} ACR {scal['acr_pct']:.1f}%", flush=True)
    # paired bootstrap vs the best baseline (by overall accuracy) at the same rho
    for rho in cfg["rhos"]:
        base_names = [f"rolemerge/{b}@{rho}" for b in BASELINES if f"rolemerge/{b}@{rho}" in results]
        best = max(base_names, key=lambda n: (sum(r["correct"] for r in results[n]), n))
        for v in cfg["variants"]:
            name = f"rolemerge/{v}@{rho}"
            d = paired_bootstrap([r["correct"] for r in results[name]], [r["correct"] for r in results[best]])
            summary[name]["vs_best_baseline"] = dict(d, baseline=best)
    for name, res in results.items():
        rows += family_rows(name, res)
        vs = summary[name].get("vs_best_baseline")
        if vs:
            rows.append({"model": name, "family": "all", "metric": "diff_vs_best_baseline", "value": vs["diff"],
                         "ci_low": vs["ci_low"], "ci_high": vs["ci_high"], "n": vs["n"]})
        for metric in ("macro_acc", "acr_pct", "mi_retention", "params", "ckpt_bytes", "load_s", "ttft_s",
                       "decode_tok_s"):
            if summary[name].get(metric) is not None:
                rows.append(_scalar(name, metric, summary[name][metric], len(res)))
    out = {"quick": quick, "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
           "base": base, "summary": summary, "rows": rows}
    data.atomic_write_text(os.path.join(out_dir, "results_quick.json" if quick else "results.json"),
                           json.dumps(out, indent=1))
    return rows


def table(out):
    """Markdown table of a results dict: per model accuracy by family, macro, diff vs best
    baseline [CI], ACR, MI retention, params, checkpoint MB, load s, TTFT ms, decode tok/s."""
    rows, summ = out["rows"], out["summary"]
    acc = {(r["model"], r["family"]): r["value"] for r in rows if r["metric"] == "accuracy"}
    fams = list(dict.fromkeys(r["family"] for r in rows if r["metric"] == "accuracy"))
    lines = ["| model | " + " | ".join(fams) + " | macro | diff vs best baseline [95% CI] | ACR % | MI ret. | params | "
             "ckpt MB | load s | TTFT ms | decode tok/s |", "|---" * (len(fams) + 10) + "|"]
    for m in dict.fromkeys(r["model"] for r in rows):
        s = summ[m]
        vs = s.get("vs_best_baseline")
        vs = f"{vs['diff']:+.3f} [{vs['ci_low']:+.3f}, {vs['ci_high']:+.3f}] vs {vs['baseline'].split('/')[1]}" if vs else ""
        f = lambda k, fmt: format(s[k], fmt) if s.get(k) is not None else "n/a"
        lines.append(f"| {m.split('/', 1)[1]} | " + " | ".join(f"{acc[(m, x)]:.3f}" for x in fams) +
                     f" | {s['macro_acc']:.3f} | {vs} | {f('acr_pct', '.1f')} | {f('mi_retention', '.3f')} | "
                     f"{s['params'] / 1e6:.2f}M | {s['ckpt_bytes'] / 1e6:.2f} | {s['load_s']:.2f} | "
                     f"{1e3 * s['ttft_s']:.1f} | {s['decode_tok_s']:.0f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- paper-structure experiment
# a base with the paper's structure (32 experts, top-4, 144 image tokens, short answers),
# the papers' own baselines, oracle routing; pre-registered in eval/logs/rolemerge.md.

PAPER_ARMS = {  # name -> (method, linkage, evaluate with oracle routing too, run_merge options)
    "rolemerge": ("rolemerge", "single", True, {}),
    "no_phase_split": ("no_phase_split", "single", True, {}),
    "lambda0": ("lambda0", "single", False, {}),
    "permuted": ("permuted", "single", False, {}),
    "average_link": ("rolemerge", "average", False, {}),
    # M-SMoE / HC-SMoE as their official codes run them: all N router rows kept, every member expert
    # bound to its group's merge (rolemerge.merge --router bound; the same function as the K-expert
    # merge under oracle routing, so their oracle accuracy is their accuracy); HC-SMoE on the
    # Euclidean distance of mean expert outputs. *_avg_router: K averaged router rows (the paper's
    # App. C.3 protocol, "translating the router to the reduced expert pool"); hcsmoe_cosine: 1 - cos.
    "msmoe": ("msmoe", "single", False, {"router": "bound"}),
    "msmoe_avg_router": ("msmoe", "single", True, {"router": "average"}),
    "hcsmoe": ("hcsmoe", "single", False, {"router": "bound", "distance": "euclidean"}),
    "hcsmoe_avg_router": ("hcsmoe", "single", True, {"router": "average", "distance": "euclidean"}),
    "hcsmoe_cosine": ("hcsmoe", "single", False, {"router": "bound", "distance": "cosine"}),
    "reap": ("reap", "single", False, {}),
    "prune": ("prune", "single", False, {}),
    "complete_link": ("rolemerge", "complete", False, {}),
    "kmeans": ("kmeans", "single", False, {}),
    "empirical_prior": ("empirical_prior", "single", False, {}),
}
PAPER_ARMS.update({c: (c, "single", False, {}) for c in comparators.COMPARATORS})   # Table 1's comparators
TABLE1_ARMS = tuple(PAPER_ARMS)   # the Table-1 experiment's arms (--part table1); the later parts add theirs below
BOUND_IS_ORACLE = True     # tests/test_rolemerge_comparators_cli.py: bound router == oracle routing of the merge
# H1 of the Table-1 pre-registration (eval/logs/rolemerge.md): RoleMerge against every comparator
PAPER_BASELINES = ("submoe", "namex", "msmoe", "hcsmoe", "mergemoe", "ream", "reap")
# The pre-registered claims: (row label, RoleMerge's arm, the other arm, field compared). Each row
# reads "RoleMerge-side minus other arm" on the same examples.
CLAIMS = [("H1a RoleMerge > Sub-MoE", "rolemerge", "submoe", "correct"),
          ("H1b RoleMerge > NAMEx (training-free adaptation)", "rolemerge", "namex", "correct"),
          ("H1c RoleMerge > M-SMoE (official: bound router)", "rolemerge", "msmoe", "correct"),
          ("H1d RoleMerge > HC-SMoE (official: bound router, Euclidean)", "rolemerge", "hcsmoe", "correct"),
          ("H1e RoleMerge > MergeMoE", "rolemerge", "mergemoe", "correct"),
          ("H1f RoleMerge > REAM (non-sequential)", "rolemerge", "ream", "correct"),
          ("H1g RoleMerge > REAP (pruning)", "rolemerge", "reap", "correct"),
          ("H1' RoleMerge > M-SMoE, K-row router (App. C.3)", "rolemerge", "msmoe_avg_router", "correct"),
          ("H1' RoleMerge > HC-SMoE, K-row router (App. C.3)", "rolemerge", "hcsmoe_avg_router", "correct"),
          ("RoleMerge > HC-SMoE on 1 - cos (the earlier variant)", "rolemerge", "hcsmoe_cosine", "correct"),
          ("RoleMerge > frequency pruning (control)", "rolemerge", "prune", "correct"),
          ("H2 phase split (vs no_phase_split)", "rolemerge", "no_phase_split", "correct"),
          ("H3 collision term (vs lambda0)", "rolemerge", "lambda0", "correct"),
          ("H4 role information (vs permuted)", "rolemerge", "permuted", "correct"),
          ("H5 single >= average linkage", "rolemerge", "average_link", "correct"),
          ("H5 single >= complete linkage", "rolemerge", "complete_link", "correct"),
          ("H7 uniform >= empirical prior", "rolemerge", "empirical_prior", "correct"),
          ("k-means (no hypothesis)", "rolemerge", "kmeans", "correct"),
          ("H6 oracle: RoleMerge vs M-SMoE grouping", "rolemerge", "msmoe", "oracle_correct"),
          ("H6 oracle: RoleMerge vs HC-SMoE grouping", "rolemerge", "hcsmoe", "oracle_correct")]
# Table 1's rows (the paper's methods, each by the arm that runs it as its official code does)
TABLE1 = [("Sub-MoE", "submoe"), ("NAMEx (training-free)", "namex"), ("M-SMoE / MC-SMoE", "msmoe"),
          ("HC-SMoE", "hcsmoe"), ("MergeMoE", "mergemoe"), ("REAM", "ream"), ("REAP", "reap"),
          ("RoleMerge", "rolemerge")]
PAPER = dict(n_cal=24, n_test=200, rhos=(0.5, 0.625, 0.75), max_new=8)
# The base with the paper's structure (rolemerge/README.md: one 5,500-step schedule per
# seed; the second recipe's 1,000 steps did not give a usable base): `--retrain-base DIR` runs
# `python -m eval.tools.pretrain {PAPER_RECIPE} --seed S --out DIR/seedS` (resuming DIR/seedS.ckpt).
PAPER_RECIPE = ("--arch qwen3_vl_moe --experts 32 --top-k 4 --expert-width 32 --patch-size 7 --merge-size 1 "
                "--look objects --steps 5500 --batch-size 16 --lr 2e-3 --eval-every 1000 --save-every 50").split()
MAX_NEW_BY_LOOK = {"none": 8, "objects": 32, "full": 64}   # new tokens by the base's look step (its longest turn fits)


def premise(stats):
    """Per-phase token shares and per-layer answer concentration kappa of calibration stats."""
    tok = sum(s["tokens"] for s in stats["sources"].values()).double()
    tot = rstats.total_counts(stats).double()
    return {"token_share": dict(zip(stats["buckets"], (tok / tok.sum()).tolist())),
            "tokens": dict(zip(stats["buckets"], tok.tolist())),
            "kappa": [rm.answer_concentration(rm.phase_distributions(tot[l])[-1]) for l in range(tot.shape[0])]}


def gold_turn(record, look):
    """The assistant turn a `look` base ("full" / "objects" / "none", eval.tools.pretrain.LOOKS) was
    trained to produce for a shapes record: its look step (from the raw record's "scene", or the
    part of `data.read_llava_json`'s "target" before " Answer:") + answer."""
    look = {True: "full", False: "none"}.get(look, look)
    scene = record["scene"] if "scene" in record else record.get("target", "").rsplit(" Answer:", 1)[0]
    if look == "full":
        return f"{scene} Answer: {record['answer']}"
    if look == "objects":
        return f"{shapes.short_look(scene)} Answer: {record['answer']}"
    if look == "none":
        return f"Answer: {record['answer']}"
    raise ValueError(f"unknown look {look!r}; choose from {LOOKS}")


def _eval_acc(model, proc, test, max_new, desc):
    with torch.inference_mode():
        res = evaluate(model, proc, test, batch_size=50, max_new_tokens=max_new, desc=desc)
    return [bool(r["correct"]) for r in res], [r["family"] for r in res]


def _base_run(base, out_dir, data_dir, cfg):
    """What every per-base run starts from: (base name, its result file {out_dir}/{name}.json,
    that file's contents or a fresh {"base", "config", "arms"}, the first cfg["n_test"] test
    records, the validation records); the shapes data is made first if missing."""
    name = os.path.basename(base.rstrip("/"))
    path = os.path.join(out_dir, f"{name}.json")
    res = json.load(open(path)) if os.path.exists(path) else {"base": base, "config": dict(cfg), "arms": {}}
    _ensure_data(data_dir, 500, cfg["n_test"])
    test = data.read_llava_json(os.path.join(data_dir, "test.json"))[: cfg["n_test"]]
    val = data.read_llava_json(os.path.join(data_dir, "val.json"))
    return name, path, res, test, val


def run_paper(base, data_dir, out_dir, cfg=PAPER, arms=TABLE1_ARMS, reuse=None):
    """One base: calibrate, collect baseline features, merge every (rho, arm), evaluate with the
    merged router and (merging arms) with oracle routing. Resumable: results are written to
    {out_dir}/{base name}.json after every arm and arms already there are skipped. reuse: a
    committed per-question file of this base whose grouping arms are kept where the calibration
    reproduces their groups (`_reuse`)."""
    name, path, res, test, val = _base_run(base, out_dir, data_dir, cfg)
    sources = {f: [r for r in val if r["family"] == f][: cfg["n_cal"]] for f in shapes.FAMILIES}
    look = json.load(open(os.path.join(base, "pretrain_log.json")))["args"].get("look", True) \
        if os.path.exists(os.path.join(base, "pretrain_log.json")) else True
    look = {True: "full", False: "none"}.get(look, look)
    cfg = dict(cfg, max_new=MAX_NEW_BY_LOOK[look], look=look)
    res["config"] = dict(res["config"], max_new=cfg["max_new"], look=look)
    ck = os.path.join(out_dir, "ckpt", name)
    stats_path = os.path.join(ck, "stats.safetensors")
    model, proc = cal.load_model(base)
    if not os.path.exists(stats_path) or not os.path.exists(bl.features_path(stats_path)):
        t = time.time()   # the baselines' features come from the same decoded tokens as the routing statistics
        stats = cal.calibrate(model, proc, sources, batch_size=16, max_new_tokens=cfg["max_new"], model_id=base,
                              features=True)
        feats = stats.pop("features")
        rstats.save_stats(stats, stats_path)
        bl.save_features(feats, bl.features_path(stats_path), {"fingerprint": stats["fingerprint"]})
        res["calibration_s"] = time.time() - t
    res["premise"] = premise(rstats.load_stats(stats_path))
    print(f"[paper] {name}: token shares {res['premise']['token_share']} kappa {res['premise']['kappa']}", flush=True)
    if reuse:
        kept, dropped = _reuse(res, reuse, stats_path, arms, cfg["rhos"])
        print(f"[paper] {name}: reused {len(kept)} arms of {reuse} (same groups); rerunning {dropped or 'none'}",
              flush=True)
    routers = [b.gate.weight.detach().clone() for _, b in blk.moe_blocks(model)]
    if "full" not in res["arms"]:
        acc, fam = _eval_acc(model, proc, test, cfg["max_new"], "full")
        res["arms"]["full"], res["families"] = {"correct": acc}, fam
    del model
    for rho in cfg["rhos"]:
        for arm in arms:
            key = f"{arm}@{rho}"
            if key in res["arms"]:
                continue
            _check_time(cfg, f"{name} {key}")
            method, linkage, oracle, opts = PAPER_ARMS[arm]
            res["arms"][key] = _cell(base, stats_path, os.path.join(ck, key), rho, method, linkage, opts, test,
                                     cfg["max_new"], routers if oracle else None, f"{name} {key}")
            data.atomic_write_text(path, json.dumps(res))
    data.atomic_write_text(path, json.dumps(res))
    return res


class TimeUp(Exception):
    """--max-minutes reached before a cell started; everything finished is on disk."""


def _check_time(cfg, what):
    """Raise TimeUp if cfg["deadline"] (seconds since the epoch, from --max-minutes; None = never)
    has passed, naming the cell `what` that would start next."""
    if late(cfg.get("deadline")):
        raise TimeUp(what)


def _cell(base, stats_path, out, rho, method, linkage, opts, test, max_new, routers=None, label=""):
    """Merge `base` with one (method, rho) into `out`, evaluate it on `test` (and, given the base's
    `routers`, with oracle routing), delete the checkpoint; returns the arm's result row (K, ACR,
    MI retention, groups, per-question correct, router; the search methods' partition scores)."""
    rep = mg.run_merge(MergeConfig(model=base, stats=stats_path, out=out, rho=rho, method=method, linkage=linkage,
                                   overwrite=True, **opts))
    m, p, _ = infer.load_timed(out)
    row = {"K": rep["K"], "acr": rep["acr_mean"], "mi_retention": rep["mi_retention"], "groups": rep["groups"]}
    row["correct"], _ = _eval_acc(m, p, test, max_new, label)
    row["router"] = rep["router"]
    if routers is not None:
        with infer.oracle_routing(m, routers, rep["groups"]):
            row["oracle_correct"], _ = _eval_acc(m, p, test, max_new, label + " oracle")
    elif rep["router"] == "bound" and BOUND_IS_ORACLE:
        row["oracle_correct"] = row["correct"]
    if "J" in rep["layers"][0]:          # greedy_1swap / greedy_swapc: the merge score before / after the search
        row.update({k: sum(x[k] for x in rep["layers"]) for k in ("J_greedy", "J", "swaps")})
    shutil.rmtree(out, ignore_errors=True)
    print(f"[paper] {label}: acc {sum(row['correct']) / len(test):.3f}" +
          (f" oracle {sum(row['oracle_correct']) / len(test):.3f}" if routers is not None else "") +
          f" ACR {row['acr']:.3f}", flush=True)
    return row


def pooled(results, key, field="correct"):
    """The per-example values of arm `key` concatenated over the bases (paired by (base, example))."""
    return sum((list(r["arms"][key][field]) for r in results), [])


def compare(results, ka, kb, field="correct"):
    """Arm `ka` minus arm `kb` over the bases in `results` (each base one seed): the two-level paired
    bootstrap of eval.metrics (bases with replacement, then examples within each base), with the
    per-base differences; one base: the examples-only bootstrap, and the result says so."""
    return two_level_bootstrap([r["arms"][ka][field] for r in results], [r["arms"][kb][field] for r in results])


def paper_report(results, out_dir):
    """Markdown tables + PNG figures from the per-base result dicts (pooled over bases: the
    examples of every base are concatenated, paired by (base, example))."""
    rhos = results[0]["config"]["rhos"]
    arms = [a for a in PAPER_ARMS if all(f"{a}@{rhos[0]}" in r["arms"] for r in results)]
    fams = list(dict.fromkeys(f for r in results for f in r["families"]))
    cat = lambda key, field="correct": pooled(results, key, field)
    lines = [f"Bases: {', '.join(os.path.basename(r['base'].rstrip('/')) for r in results)}; "
             f"{len(results[0]['arms']['full']['correct'])} test examples per base.", "",
             "| premise | " + " | ".join(os.path.basename(r["base"].rstrip("/")) for r in results) + " |",
             "|---" * (len(results) + 1) + "|"]
    for b in results[0]["premise"]["token_share"]:
        lines.append(f"| token share {b} | " + " | ".join(f"{r['premise']['token_share'][b]:.3f}" for r in results) + " |")
    lines.append("| kappa per layer | " + " | ".join(", ".join(f"{k:.2f}" for k in r["premise"]["kappa"]) for r in results) + " |")
    full = cat("full")
    lo, hi = bootstrap_ci(full)
    lines += ["", f"Full model: accuracy {sum(full) / len(full):.3f} [{lo:.3f}, {hi:.3f}].", "",
              "| arm | rho | K | acc [95% CI] | macro | oracle acc | RoleMerge - arm [95% CI] | ACR | MI ret. |",
              "|---|---|---|---|---|---|---|---|---|"]
    curves = {}
    for rho in rhos:
        for a in arms:
            key = f"{a}@{rho}"
            c = cat(key)
            lo, hi = bootstrap_ci(c)
            acc = sum(c) / len(c)
            curves.setdefault(a, []).append((rho, acc, lo, hi))
            fam_acc = {}
            for r in results:
                for ok, f in zip(r["arms"][key]["correct"], r["families"]):
                    fam_acc.setdefault(f, []).append(ok)
            macro = sum(sum(v) / len(v) for v in fam_acc.values()) / len(fam_acc)
            orc = results[0]["arms"][key].get("oracle_correct")
            orc = f"{sum(cat(key, 'oracle_correct')) / len(c):.3f}" if orc is not None else ""
            d = compare(results, f"rolemerge@{rho}", key) if a != "rolemerge" else None
            ds = f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]" if d else ""
            mi = [r["arms"][key]["mi_retention"] for r in results]
            mis = f"{sum(mi) / len(mi):.3f}" if None not in mi else "n/a"
            acr = sum(r["arms"][key]["acr"] for r in results) / len(results)
            lines.append(f"| {a} | {rho} | {results[0]['arms'][key]['K']} | {acc:.3f} [{lo:.3f}, {hi:.3f}] | "
                         f"{macro:.3f} | {orc} | {ds} | {acr:.3f} | {mis} |")
    lines += ["", "Per-family accuracy (pooled over bases):", "",
              "| arm | rho | " + " | ".join(fams) + " |", "|---" * (len(fams) + 2) + "|"]
    for key in ["full"] + [f"{a}@{rho}" for rho in rhos for a in arms]:
        by = {f: [] for f in fams}
        for r in results:
            for ok, f in zip(r["arms"][key]["correct"], r["families"]):
                by[f].append(ok)
        a, _, rho = key.partition("@")
        lines.append(f"| {a} | {rho} | " + " | ".join(f"{sum(v) / len(v):.2f}" if v else "" for v in by.values()) + " |")
    lines += ["", claim_table(results)]
    os.makedirs(out_dir, exist_ok=True)
    accuracy_png(curves, sum(full) / len(full), os.path.join(out_dir, "accuracy_vs_rho.png"))
    return "\n".join(lines)


def verdict(d):
    """The verdict rule of every toy (eval.metrics.verdict) on a comparison dict (`compare`): the CI
    entirely above 0 and every base's difference > 0 -> "supported", both below -> "contradicted",
    else "inconclusive"."""
    return verdict_rule(d)


def claim_table(results):
    """Markdown verdict table of CLAIMS x rho over the bases in `results` (`compare`: bases, then
    examples resampled, 10,000 resamples; `verdict`), then each base's own difference (last
    brackets, in the order of `results`), whose signs the verdict also requires to agree.
    Rows whose arms are missing are left out; "same groups" marks a cell where both arms chose
    identical groups on every base (for arms that differ only in grouping, e.g. lambda0 or the
    phase prior, the difference is then 0 by construction, not a finding). H1 counts as
    reproduced if supported against every baseline at >= 2 rhos (all rhos when fewer than 2)."""
    rhos = results[0]["config"]["rhos"]
    names = [os.path.basename(r["base"].rstrip("/")) for r in results]
    lines = [f"Verdicts (RoleMerge side minus arm; two-level bootstrap over {', '.join(names)}; per base in "
             "the last brackets):", "", "| claim | " + " | ".join(f"rho {rho}" for rho in rhos) + " |",
             "|---" * (len(rhos) + 1) + "|"]
    found = {}   # (arm, field, rho) -> pooled verdict, for the H1 rule below
    for label, a, b, field in CLAIMS:
        keys = [(f"{a}@{rho}", f"{b}@{rho}") for rho in rhos]
        if not all(ka in r["arms"] and kb in r["arms"] and r["arms"][ka].get(field) is not None
                   and r["arms"][kb].get(field) is not None for r in results for ka, kb in keys):
            continue
        cells = []
        for rho, (ka, kb) in zip(rhos, keys):
            d = compare(results, ka, kb, field)
            found[(b, field, rho)] = verdict(d)
            per = d["per_seed"]
            same = results[0]["arms"][ka].get("groups") is not None \
                and all(r["arms"][ka]["groups"] == r["arms"][kb].get("groups") for r in results)
            cells.append(f"{verdict(d)} ({d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
                         + ("; same groups" if same else "") + ")"
                         + (f" [{' / '.join(f'{x:+.3f}' for x in per)}]" if len(results) > 1 else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    h1 = [sum(found[(b, "correct", rho)] == "supported" for rho in rhos) >= min(2, len(rhos))
          for b in PAPER_BASELINES if (b, "correct", rhos[0]) in found]
    lines += ["", f"H1 reproduced (supported against every comparator at >= {min(2, len(rhos))} of the "
              f"{len(rhos)} rho): " + ("yes" if h1 and all(h1) else "no")]
    return "\n".join(lines)


def _name(r):
    return os.path.basename(r["base"].rstrip("/"))


def _seed(r):
    """'seed S' from the base's pretrain_log.json, else from a folder named seedS, else the folder name."""
    log = os.path.join(r["base"], "pretrain_log.json")
    s = json.load(open(log))["args"].get("seed") if os.path.exists(log) else None
    if s is None and re.fullmatch(r"seed\d+", _name(r)):   # a --rescore file whose base folder is elsewhere
        s = _name(r)[4:]
    return f"seed {s}" if s is not None else _name(r)


def _acc(r, key, field="correct"):
    v = r["arms"][key][field]
    return sum(v) / len(v)


def table1_rows(results):
    """The rows of the paper's Table 1 layout, pooled over the bases in `results` (examples
    concatenated): the full model, then each TABLE1 method present at every rho, with
    acc_K / ret_K (% of the full model kept) / lo_K, hi_K (95% bootstrap CI) / per_seed_K
    ("a / b / c", the bases in order) for K = round(1000 rho): field names without a dot."""
    rhos = results[0]["config"]["rhos"]
    full = pooled(results, "full")
    f = sum(full) / len(full) or float("nan")   # a pool that scores 0: % of full undefined, not an error
    rows = []
    for label, arm in [("full model", "full")] + TABLE1:
        keys = ["full" if arm == "full" else f"{arm}@{rho}" for rho in rhos]
        if not all(key in r["arms"] for r in results for key in keys):
            continue
        row = {"kind": "table1", "method": label, "arm": arm, "seeds": "+".join(_name(r) for r in results)}
        for rho, key in zip(rhos, keys):
            c = pooled(results, key)
            k = round(1000 * rho)
            row[f"acc_{k}"], row[f"ret_{k}"] = sum(c) / len(c), sum(c) / len(c) / f
            row[f"lo_{k}"], row[f"hi_{k}"] = bootstrap_ci(c)
            row[f"per_seed_{k}"] = " / ".join(f"{_acc(r, key):.3f}" for r in results)
        rows.append(row)
    return rows


def table1(results):
    """Markdown table in the layout of the paper's Table 1 (`table1_rows`): each method's
    accuracy at rho .5 / .625 / .75 and the % of the full model it keeps, pooled, then the
    bases' accuracies in brackets."""
    rhos = results[0]["config"]["rhos"]
    lines = ["| method | " + " | ".join(f"rho {rho}: acc (% of full)" for rho in rhos) + " |",
             "|---" * (len(rhos) + 1) + "|"]
    rows = table1_rows(results)
    f = rows[0][f"acc_{round(1000 * rhos[0])}"] or float("nan")   # the full model's accuracy
    for row in rows:
        if row["arm"] == "full":
            cells = [f"{f:.3f} (100%)" for _ in rhos]
        else:
            cells = [f"{row[f'acc_{k}']:.3f} ({100 * row[f'acc_{k}'] / f:.1f}%)"
                     + (f" [{row[f'per_seed_{k}']}]" if len(results) > 1 else "")
                     for k in (round(1000 * rho) for rho in rhos)]
        lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table1_png(results, path):
    """accuracy_png of Table 1's methods only (`table1_rows`: pooled, 95% bootstrap CIs)."""
    rhos = results[0]["config"]["rhos"]
    rows = table1_rows(results)
    curves = {row["method"]: [(rho, row[f"acc_{k}"], row[f"lo_{k}"], row[f"hi_{k}"])
                              for rho, k in ((rho, round(1000 * rho)) for rho in rhos)]
              for row in rows if row["arm"] != "full"}
    accuracy_png(curves, rows[0]["acc_" + str(round(1000 * rhos[0]))], path)


def _summary(verdicts, rhos):
    """["supported", "inconclusive", ...] per rho -> "supported at every rho" / "partial: ..."."""
    v = list(verdicts)
    if len(set(v)) == 1:
        return f"{v[0]} at every rho"
    by = {}
    for w, rho in zip(v, rhos):
        by.setdefault(w, []).append(f"{rho:g}".lstrip("0"))
    return "partial: " + ", ".join(f"{w} at {' and '.join(r)}" for w, r in by.items())


def result_rows(results, everyone, log):
    """Rows of the result file (eval/report.py format) for the Table-1 experiment: per-base
    accuracy and % of full per (arm, rho) for every base in `everyone`, and the pooled claims
    over `results` (the bases that passed the usability check). `log`: the log entry's link."""
    rhos = results[0]["config"]["rhos"]
    pool = "+".join(_name(r) for r in results)
    rows = []
    for r in everyone:
        f = _acc(r, "full") or float("nan")   # a base that scores 0: % of full undefined, not an error
        seed, base = _seed(r), _name(r)
        lo, hi = bootstrap_ci(r["arms"]["full"]["correct"])
        rows.append({"kind": "full", "seed": seed, "base": base, "value": f, "ci_low": lo, "ci_high": hi,
                     "n": len(r["arms"]["full"]["correct"]), "pooled": "yes" if r in results else "no (exploratory)"})
        for key in r["arms"]:
            if key == "full":
                continue
            arm, _, rho = key.partition("@")
            a = _acc(r, key)
            rows.append({"kind": "accuracy", "arm": arm, "rho": float(rho), "seed": seed, "base": base, "value": a,
                         "retained": a / f, "K": r["arms"][key]["K"], "n": len(r["arms"][key]["correct"])})
    rows += table1_rows(results)
    for label, a, b, field in CLAIMS:
        keys = [(f"{a}@{rho}", f"{b}@{rho}") for rho in rhos]
        if not all(ka in r["arms"] and kb in r["arms"] and r["arms"][ka].get(field) is not None
                   and r["arms"][kb].get(field) is not None for r in results for ka, kb in keys):
            continue
        ds = [compare(results, ka, kb, field) for ka, kb in keys]
        rows.append({"kind": "claim", "method": "RoleMerge", "claim": label, "arm": b, "field": field,
                     "verdict": _summary([verdict(d) for d in ds], rhos),
                     "effect": "; ".join(f"{rho:g}".lstrip("0") + f": {d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
                                         for rho, d in zip(rhos, ds)),
                     "per_seed": "; ".join(f"{rho:g}".lstrip("0") + ": " + " / ".join(
                         f"{x:+.3f}" for x in d["per_seed"]) for rho, d in zip(rhos, ds)),
                     "seeds": len(results), "bootstrap": ds[0]["bootstrap"], "pool": pool, "log": log,
                     "top": label.startswith(("H1a", "H1d", "H1g", "H2 ", "H3 ")),
                     "supported_at": sum(verdict(d) == "supported" for d in ds)})
    h1 = [r for r in rows if r["kind"] == "claim" and r["arm"] in PAPER_BASELINES and r["field"] == "correct"]
    if h1:   # the registered rule: supported against every comparator at >= 2 of the rhos; the main verdict, first
        need = min(2, len(rhos))
        fails = [r["claim"].split(" > ")[1].split(" (")[0] for r in h1 if r["supported_at"] < need]
        rows.insert(rows.index(h1[0]), {
            "kind": "claim", "method": "RoleMerge", "claim": "H1 as registered: beats every comparator "
            f"({len(h1)}) at >= {need} of {len(rhos)} rho", "arm": None, "field": "correct",
            "verdict": "reproduced" if not fails else f"not reproduced (fails against {', '.join(fails)})",
            "effect": f"supported at >= {need} rho against {len(h1) - len(fails)} of {len(h1)} comparators",
            "per_seed": "", "seeds": len(results), "bootstrap": h1[0]["bootstrap"], "pool": pool, "log": log,
            "top": True})
    return rows


PALETTE = [(220, 50, 47), (38, 139, 210), (133, 153, 0), (211, 54, 130), (42, 161, 152), (181, 137, 0),
           (108, 113, 196), (203, 75, 22), (88, 110, 117), (230, 159, 0), (150, 150, 150), (120, 60, 0)]


def accuracy_png(curves, full_acc, path, W=760, H=480):
    """Accuracy vs rho per method with 95% CI bars (the paper's main-figure layout), Pillow."""
    im = Image.new("RGB", (W, H), "white")
    dr = ImageDraw.Draw(im)
    L, R, T, B = 60, 200, 30, 50
    rhos = sorted({x[0] for c in curves.values() for x in c})
    X = lambda r: L + (r - rhos[0]) / max(rhos[-1] - rhos[0], 1e-9) * (W - L - R)
    Y = lambda a: T + (1 - a) * (H - T - B)
    dr.line([(L, T), (L, H - B), (W - R, H - B)], fill="black")
    for a in (0, .25, .5, .75, 1):
        dr.line([(L - 4, Y(a)), (W - R, Y(a))], fill=(230, 230, 230))
        dr.text((L - 40, Y(a) - 6), f"{a:.2f}", fill="black")
    for r in rhos:
        dr.text((X(r) - 12, H - B + 8), f"{r}", fill="black")
    dr.text(((W - R) // 2 - 20, H - 20), "rho (experts kept)", fill="black")
    dr.text((L, 8), "accuracy vs rho, 95% bootstrap CI", fill="black")
    dr.line([(L, Y(full_acc)), (W - R, Y(full_acc))], fill=(120, 120, 120), width=1)
    dr.text((L + 6, Y(full_acc) - 14), f"full model {full_acc:.3f}", fill=(120, 120, 120))
    for i, (name, pts) in enumerate(curves.items()):
        col = PALETTE[i % len(PALETTE)]
        off = (i - len(curves) / 2) * 3
        pts = sorted(pts)
        dr.line([(X(r) + off, Y(a)) for r, a, _, _ in pts], fill=col, width=2)
        for r, a, lo, hi in pts:
            dr.line([(X(r) + off, Y(lo)), (X(r) + off, Y(hi))], fill=col, width=1)
            dr.ellipse([X(r) + off - 3, Y(a) - 3, X(r) + off + 3, Y(a) + 3], fill=col)
        dr.rectangle([W - R + 10, T + 20 * i + 30, W - R + 22, T + 20 * i + 42], fill=col)
        dr.text((W - R + 28, T + 20 * i + 30), name, fill="black")
    im.save(path + ".tmp.png")
    os.replace(path + ".tmp.png", path)


def grouping_png(stats_path, groups_by_arm, layer, path):
    """One layer's grouping per arm: every expert a box, boxes of a group side by side, colour =
    the expert's phase role q_e (red = image, green = question, blue = answer share)."""
    stats = rstats.load_stats(stats_path)
    _, q = rm.role_profiles(rm.phase_distributions(rstats.total_counts(stats).double()[layer]))
    rows = list(groups_by_arm.items())
    N = q.shape[0]
    cell, gap = 18, 8
    W = 160 + N * cell + 40 * gap
    im = Image.new("RGB", (W, 40 + 40 * len(rows)), "white")
    dr = ImageDraw.Draw(im)
    dr.text((10, 8), f"layer {layer}: experts coloured by phase role (R image, G question, B answer; black = never routed); groups separated",
            fill="black")
    for i, (name, groups) in enumerate(rows):
        y = 36 + 40 * i
        dr.text((10, y + 4), name, fill="black")
        x = 160
        for g in sorted(groups, key=lambda g: (-len(g), g)):
            for e in g:
                c = tuple(int(255 * float(v)) for v in q[e])
                dr.rectangle([x, y, x + cell - 2, y + 22], fill=c, outline="black")
                x += cell
            x += gap
    im.save(path + ".tmp.png")
    os.replace(path + ".tmp.png", path)


# ----------------------------------------------------------------------------- the remaining rows
# Tables 3 / 14 (collision weight, grouping rule, five-seed k-means++), Table 15 panel A (search
# depth), App. F (calibration size, number of sources) and App. D.2 (per-task equal-weight paired
# bootstrap), on the paper-structure bases; pre-registered in eval/logs/rolemerge.md.

PAPER_ARMS.update({
    "lambda01": ("rolemerge", "single", False, {"lam": 0.01}),
    "lambda10": ("rolemerge", "single", False, {"lam": 0.10}),
    **{f"kmeans_s{s}": ("kmeans", "single", False, {"seed": s}) for s in range(1, 5)},
    "greedy_1swap": ("greedy_1swap", "single", False, {}),
    "greedy_swapc": ("greedy_swapc", "single", False, {}),
})
KMEANS_SEEDS = ("kmeans",) + tuple(f"kmeans_s{s}" for s in range(1, 5))   # k-means++ seeds 0-4
# Table 14's rows: (label, arm); the reference is single link, lambda = .03 (the rolemerge arm)
SENSITIVITY = [("lambda = 0", "lambda0"), ("lambda = .01", "lambda01"), ("lambda = .03 (ours)", "rolemerge"),
               ("lambda = .10", "lambda10"), ("average link", "average_link"), ("complete link", "complete_link"),
               ("k-means++ (5 seeds)", KMEANS_SEEDS), ("single link (ours)", "rolemerge")]
SEARCH_ROWS = [("Greedy", "rolemerge"), ("Greedy+1Swap", "greedy_1swap"), ("Greedy+SwapC", "greedy_swapc")]
PARTS = {  # --part -> the arms run on each base, most important first
    "table1": TABLE1_ARMS,
    "sensitivity": ("rolemerge", "lambda01", "lambda10") + KMEANS_SEEDS + ("lambda0", "average_link", "complete_link"),
    "search": ("rolemerge", "greedy_1swap", "greedy_swapc"),
    "calibration": (),     # run_calibration_audit
    "bootstrap": (),       # no runs: task_equal_bootstrap over committed per-question files (--from)
}
# App. F on our scale: 60 validation questions per family calibrated once in chunks of 6 (one
# source per chunk), so every size and every source subset is a sum of chunks of one decode.
AUDIT = dict(chunk=6, sizes=(6, 12, 24, 60), budget=60, rho=0.625)
EQUIV = 0.05   # the pre-registered margin of the "level" claims: the 95% CI inside [-.05, +.05]


def _reuse(res, reuse, stats_path, arms, rhos):
    """Copy into `res` the arms of `reuse` (a committed per-question file of the same base) that
    the current calibration reproduces: for each requested grouping arm (rolemerge.model methods
    without features), the groups are planned again from `stats_path` and the row is kept only if
    they are identical (same groups -> same checkpoint -> same greedy answers); the full model's
    row is kept with them. Returns (kept keys, dropped keys)."""
    old = json.load(open(reuse))
    counts = rstats.total_counts(rstats.load_stats(stats_path)).double()
    kept, dropped = [], []
    for arm in arms:
        method, linkage, _, opts = PAPER_ARMS[arm]
        if method in rm.FEATURE_METHODS or method in ("frequency",) or method not in rm.METHODS:
            continue
        for rho in rhos:
            key = f"{arm}@{rho}"
            row = old["arms"].get(key)
            if key in res["arms"] or row is None:
                continue
            groups, _ = rm.plan(counts, row["K"], method, opts.get("lam", 0.03), linkage, opts.get("seed", 0))
            if groups == row["groups"]:
                res["arms"][key] = row
                kept.append(key)
            else:
                dropped.append(key)
    if kept and "full" not in res["arms"]:
        res["arms"]["full"], res["families"] = old["arms"]["full"], old["families"]
    return kept, dropped


def _base_cfg(base, cfg):
    """cfg with the base's look step and its max new tokens (run_paper's rule)."""
    log = os.path.join(base, "pretrain_log.json")
    look = json.load(open(log))["args"].get("look", True) if os.path.exists(log) else True
    look = {True: "full", False: "none"}.get(look, look)
    return dict(cfg, max_new=MAX_NEW_BY_LOOK[look], look=look)


def audit_cells(families, audit=AUDIT, rhos=PAPER["rhos"]):
    """The calibration audit's cells, in run order: (key, {family: examples}, rhos). Size sweep:
    `size{n}` = n examples of every family, every rho (App. F Table 11); source count at a fixed
    budget of audit["budget"] examples, at audit["rho"] only (App. F.2): `src1:{f}` (all from one
    family), `src2:{f}+{g}` (half each); the five-source set is `size{budget / 5}`."""
    B = audit["budget"]
    cells = [(f"size{n}", {f: n for f in families}, tuple(rhos)) for n in audit["sizes"]]
    cells += [(f"src1:{f}", {f: B}, (audit["rho"],)) for f in families]
    cells += [(f"src2:{f}+{g}", {f: B // 2, g: B // 2}, (audit["rho"],)) for f, g in combinations(families, 2)]
    return cells


def subset_stats(stats, take, chunk):
    """Stats of the first take[f] examples of each family f from chunked stats (sources
    "{family}#{i}", `chunk` examples each): one source per family, counts and tokens summed over
    its first take[f] / chunk chunks. Raises ValueError if a count is not a multiple of `chunk`
    or needs more chunks than were calibrated."""
    out = {}
    for f, n in take.items():
        if n % chunk:
            raise ValueError(f"{n} examples of {f!r} is not a multiple of the chunk size {chunk}")
        parts = [stats["sources"].get(f"{f}#{i}") for i in range(n // chunk)]
        if None in parts:
            raise ValueError(f"{n} examples of {f!r} need {n // chunk} chunks; the stats have fewer")
        out[f] = {"counts": sum(p["counts"] for p in parts), "tokens": sum(p["tokens"] for p in parts),
                  "examples": sum(p["examples"] for p in parts)}
    return dict(stats, sources=out)


def run_source_audit(base, data_dir, out_dir, cfg=PAPER, rho=AUDIT["rho"]):
    """The source-count audit without a new calibration: the per-source statistics that run_paper
    saved (cfg["n_cal"] questions per family, one source per family) summed over one family
    (`src1:{f}`) or two (`src2:{f}+{g}`), RoleMerge merged and evaluated at `rho`; the five-source
    cell (`src5:all`) is run_paper's rolemerge arm on the same statistics. Not budget-matched: a
    set of s sources holds s * n_cal questions. Results in res["audit"]; resumable per cell.
    Raises ValueError if run_paper has not calibrated the base or run its rolemerge arm at rho."""
    name = os.path.basename(base.rstrip("/"))
    path = os.path.join(out_dir, f"{name}.json")
    ck = os.path.join(out_dir, "ckpt", name)
    stats_path = os.path.join(ck, "stats.safetensors")
    if not os.path.exists(path) or not os.path.exists(stats_path) or \
            f"rolemerge@{rho}" not in json.load(open(path))["arms"]:
        raise ValueError(f"{name}: the source audit reuses run_paper's calibration and rolemerge arm at rho {rho}; "
                         f"run --part sensitivity (or search) on it first")
    res = json.load(open(path))
    test = data.read_llava_json(os.path.join(data_dir, "test.json"))[: cfg["n_test"]]
    cfg = _base_cfg(base, cfg)
    stats = rstats.load_stats(stats_path)
    fams = list(stats["sources"])
    res["audit_meta"] = dict(res.get("audit_meta", {}), source_rho=rho, per_source=cfg["n_cal"], budget_matched=False)
    aud = res.setdefault("audit", {})
    aud[f"src5:all@{rho}"] = dict(res["arms"][f"rolemerge@{rho}"], examples={f: cfg["n_cal"] for f in fams})
    cells = [(f"src1:{f}", (f,)) for f in fams] + [(f"src2:{f}+{g}", (f, g)) for f, g in combinations(fams, 2)]
    for cell, keep in cells:
        key = f"{cell}@{rho}"
        if key in aud:
            continue
        _check_time(cfg, f"{name} audit {key}")
        sp = os.path.join(ck, "stats_" + cell.replace(":", "_").replace("+", "_") + ".safetensors")
        if not os.path.exists(sp):
            rstats.save_stats(dict(stats, sources={f: stats["sources"][f] for f in keep}), sp)
        aud[key] = dict(_cell(base, sp, os.path.join(ck, "audit"), rho, "rolemerge", "single", {}, test,
                              cfg["max_new"], None, f"{name} audit {key}"), examples={f: cfg["n_cal"] for f in keep})
        data.atomic_write_text(path, json.dumps(res))
    data.atomic_write_text(path, json.dumps(res))
    return res


def run_calibration_audit(base, data_dir, out_dir, cfg=PAPER, audit=AUDIT):
    """App. F on one base: calibrate max(sizes, budget) validation questions per family once, in
    chunks of audit["chunk"] (no features: only RoleMerge is merged), then merge RoleMerge (the
    paper's settings) with the statistics of every `audit_cells` cell and evaluate it on the test
    split. Results go to res["audit"][f"{cell}@{rho}"] of the base's run_paper file; resumable
    per cell."""
    name, path, res, test, val = _base_run(base, out_dir, data_dir, cfg)
    cfg = _base_cfg(base, cfg)
    c, n_max = audit["chunk"], max(max(audit["sizes"]), audit["budget"])
    fams = shapes.FAMILIES
    short = {f: len([r for r in val if r["family"] == f]) for f in fams}
    short = {f: n for f, n in short.items() if n < n_max}
    if short:
        raise ValueError(f"the calibration audit needs {n_max} validation questions per family; {data_dir}/val.json "
                         f"has {short}: generate a larger val split")
    ck = os.path.join(out_dir, "ckpt", name)
    chunk_path = os.path.join(ck, "stats_chunks.safetensors")
    if not os.path.exists(chunk_path):
        t = time.time()
        sources = {f"{f}#{i}": [r for r in val if r["family"] == f][i * c:(i + 1) * c]
                   for f in fams for i in range(n_max // c)}
        model, proc = cal.load_model(base)
        rstats.save_stats(cal.calibrate(model, proc, sources, batch_size=16, max_new_tokens=cfg["max_new"],
                                     model_id=base), chunk_path)
        del model
        res.setdefault("audit_meta", {})["calibration_s"] = time.time() - t
    stats = rstats.load_stats(chunk_path)
    res.setdefault("audit_meta", {}).update(chunk=c, budget=audit["budget"], rho=audit["rho"], sizes=list(audit["sizes"]),
                                            budget_matched=True)
    aud = res.setdefault("audit", {})
    for cell, take, rhos in audit_cells(fams, audit, cfg["rhos"]):
        sp = os.path.join(ck, "stats_" + cell.replace(":", "_").replace("+", "_") + ".safetensors")
        for rho in rhos:
            key = f"{cell}@{rho}"
            if key in aud:
                continue
            _check_time(cfg, f"{name} audit {key}")
            if not os.path.exists(sp):
                rstats.save_stats(subset_stats(stats, take, c), sp)
            aud[key] = dict(_cell(base, sp, os.path.join(ck, "audit"), rho, "rolemerge", "single", {}, test,
                                  cfg["max_new"], None, f"{name} audit {key}"), examples=take)
            data.atomic_write_text(path, json.dumps(res))
    if "full" not in res["arms"]:
        model, proc = cal.load_model(base)
        acc, fam = _eval_acc(model, proc, test, cfg["max_new"], "full")
        res["arms"]["full"], res["families"] = {"correct": acc}, fam
    data.atomic_write_text(path, json.dumps(res))
    return res


def task_equal_bootstrap(results, ka, kb, field="correct"):
    """App. D.2: arm `ka` minus arm `kb` over the bases in `results` (each base one seed) with every
    task (a base's `families`) weighted equally: eval.metrics.two_level_task_equal_bootstrap (bases
    with replacement, then each family's questions within each drawn base, the same questions for
    both arms), with the per-base effects; one base: questions only, and the result says so.
    Raises ValueError when the bases hold different families or an arm's list does not match them."""
    return two_level_task_equal_bootstrap([r["arms"][ka][field] for r in results],
                                          [r["arms"][kb][field] for r in results], [r["families"] for r in results])


def _level(d, margin=EQUIV):
    """The pre-registered equivalence reading: "level" if the 95% CI lies inside [-margin, +margin]."""
    return "level" if -margin < d["ci_low"] and d["ci_high"] < margin else "not shown level"


def _kmeans_mean(r, rho):
    """Per question: mean correctness over the five k-means++ seeds of one base."""
    vals = [r["arms"][f"{k}@{rho}"]["correct"] for k in KMEANS_SEEDS]
    return [sum(v) / len(v) for v in zip(*vals)]


def _arm_values(r, arm, rho):
    return _kmeans_mean(r, rho) if arm == KMEANS_SEEDS else list(r["arms"][f"{arm}@{rho}"]["correct"])


def _has(r, arm, rho):
    arms = arm if isinstance(arm, tuple) else (arm,)
    return all(f"{a}@{rho}" in r["arms"] for a in arms)


def sensitivity_rows(results, log=""):
    """Rows of Tables 3 / 14 at every rho (pooled over `results`; per base): accuracy of each
    setting, its difference to the reference (single link, lambda .03) with the two-level
    bootstrap's CI (lo, hi; bases, then questions) and the pooled-questions CI (qlo, qhi), and each
    base's accuracy; k-means++ as the mean over its five seeds (per question) with the std of the
    five seeds' pooled accuracies."""
    rhos = results[0]["config"]["rhos"]
    full = pooled(results, "full")
    f = sum(full) / len(full)
    rows, seeds = [], "+".join(_name(r) for r in results)
    for label, arm in SENSITIVITY:
        if not all(_has(r, arm, rho) and _has(r, "rolemerge", rho) for r in results for rho in rhos):
            continue
        row = {"kind": "sensitivity", "setting": label, "arm": "+".join(arm) if isinstance(arm, tuple) else arm,
               "seeds": seeds, "n": len(full), "log": log}
        for rho in rhos:
            k = round(1000 * rho)
            per_base = [_arm_values(r, arm, rho) for r in results]
            x = sum(per_base, [])
            row[f"acc_{k}"], row[f"ret_{k}"] = sum(x) / len(x), sum(x) / len(x) / f
            d, q = _versus(per_base, [_arm_values(r, "rolemerge", rho) for r in results])
            row[f"delta_{k}"], row[f"lo_{k}"], row[f"hi_{k}"] = d["diff"], d["ci_low"], d["ci_high"]
            row[f"qlo_{k}"], row[f"qhi_{k}"] = q["ci_low"], q["ci_high"]
            row[f"per_seed_{k}"] = " / ".join(f"{sum(v) / len(v):.3f}" for v in per_base)
            if arm == KMEANS_SEEDS:
                accs = [sum(pooled(results, f"{s}@{rho}")) / len(x) for s in KMEANS_SEEDS]
                row[f"std_{k}"] = statistics.stdev(accs)
                row[f"seed_accs_{k}"] = " / ".join(f"{v:.3f}" for v in accs)
        rows.append(row)
    rows += _sens_claims(results, rhos, log)
    return rows


def _tag(rho):
    return f"{rho:g}".lstrip("0")


def _effects(tags, ds):
    return "; ".join(f"{t}: {d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]" for t, d in zip(tags, ds))


def _claim(label, tags, ds, reading, results, log, pooled=None, read=None):
    """A claim row from two-level comparisons `ds` (one per tag, `eval.metrics.two_level_bootstrap`):
    effects "tag: diff [lo, hi]; ...", per-base differences "tag: a / b; ..." and the verdict
    `reading`. `pooled` (the same comparisons over the pooled questions, `paired_bootstrap`) adds
    the pre-registered questions-only reading beside it, read by `read`."""
    row = {"kind": "claim", "method": "RoleMerge", "claim": label, "verdict": reading, "effect": _effects(tags, ds),
           "per_seed": "; ".join(f"{t}: " + " / ".join(f"{v:+.3f}" for v in d["per_seed"]) for t, d in zip(tags, ds)),
           "bootstrap": ds[0]["bootstrap"], "seeds": len(results), "pool": "+".join(_name(r) for r in results),
           "log": log}
    if pooled is not None:
        row["pooled_effect"] = _effects(tags, pooled)
        row["pooled_verdict"] = "; ".join(f"{t}: {read(d)}" for t, d in zip(tags, pooled))
    return row


def _versus(per_base_a, per_base_b):
    """A minus B, one per-question list per base: the two-level comparison (the verdicts) and the
    pooled-questions one (the rule these rows were registered with, kept beside it)."""
    return (two_level_bootstrap(per_base_a, per_base_b),
            paired_bootstrap(sum(map(list, per_base_a), []), sum(map(list, per_base_b), [])))


def _diff_claim(results, rhos, a, b, label, log, rule):
    """Claim row for arm a minus arm b at every rho, read by `rule` ("greater": `verdict`, the CI
    and every base's sign; "level": `_level`) on the two-level bootstrap (bases, then questions)."""
    if not all(_has(r, x, rho) for r in results for rho in rhos for x in (a, b)):
        return []
    ds, qs = zip(*(_versus([_arm_values(r, a, rho) for r in results], [_arm_values(r, b, rho) for r in results])
                   for rho in rhos))
    read = verdict if rule == "greater" else _level
    tags = [_tag(rho) for rho in rhos]
    return [_claim(label, tags, ds, _summary([read(d) for d in ds], rhos), results, log, qs, read)]


def _sens_claims(results, rhos, log):
    rows = _diff_claim(results, rhos, "rolemerge", "lambda0", "S1 lambda .03 > 0", log, "greater")
    rows += _diff_claim(results, rhos, "rolemerge", "lambda01", "S2 lambda .03 level with .01", log, "level")
    rows += _diff_claim(results, rhos, "rolemerge", "lambda10", "S2 lambda .03 level with .10", log, "level")
    rows += _diff_claim(results, rhos, "rolemerge", KMEANS_SEEDS, "S3 single link > k-means++ (5 seeds)",
                        log, "greater")
    return rows


def search_rows(results, log=""):
    """Table 15 panel A at every rho: accuracy of Greedy, Greedy+1Swap, Greedy+SwapC (pooled; per
    base), the change of the partition merge score Delta J = J / J_greedy - 1 summed over layers
    and bases, swaps made, and each variant minus Greedy (two-level bootstrap: bases, then questions)."""
    rhos = results[0]["config"]["rhos"]
    rows = []
    for label, arm in SEARCH_ROWS:
        if not all(_has(r, arm, rho) for r in results for rho in rhos):
            continue
        row = {"kind": "search", "method": label, "arm": arm, "seeds": "+".join(_name(r) for r in results), "log": log}
        for rho in rhos:
            k, key = round(1000 * rho), f"{arm}@{rho}"
            x = pooled(results, key)
            row[f"acc_{k}"] = sum(x) / len(x)
            row[f"per_seed_{k}"] = " / ".join(f"{_acc(r, key):.3f}" for r in results)
            if arm != "rolemerge":
                d = compare(results, key, f"rolemerge@{rho}")
                row[f"delta_{k}"], row[f"lo_{k}"], row[f"hi_{k}"] = d["diff"], d["ci_low"], d["ci_high"]
                jg = sum(r["arms"][key]["J_greedy"] for r in results)
                row[f"dJ_{k}"] = sum(r["arms"][key]["J"] for r in results) / jg - 1 if jg > 0 else 0.0
                row[f"swaps_{k}"] = sum(r["arms"][key]["swaps"] for r in results)
            else:
                row[f"dJ_{k}"], row[f"swaps_{k}"] = 0.0, 0
        rows.append(row)
    found = {r["arm"]: r for r in rows}
    for a in ("greedy_1swap", "greedy_swapc"):
        if a in found:                      # T0: the search lowers the partition score at every rho
            dj = [found[a][f"dJ_{round(1000 * rho)}"] for rho in rhos]
            rows.append({"kind": "claim", "method": "RoleMerge", "claim": f"T0 {found[a]['method']} lowers J",
                         "verdict": "holds at every rho" if all(x < 0 for x in dj) else
                         f"fails at {', '.join(_tag(rho) for rho, x in zip(rhos, dj) if x >= 0)}",
                         "effect": "; ".join(f"{_tag(rho)}: Delta J {x:+.1%}" for rho, x in zip(rhos, dj)),
                         "per_seed": "", "seeds": len(results), "pool": "+".join(_name(r) for r in results), "log": log})
    t1 = []
    for a in ("greedy_1swap", "greedy_swapc"):
        t1 += _diff_claim(results, rhos, a, "rolemerge", f"T1 {dict((b, l) for l, b in SEARCH_ROWS)[a]} > Greedy",
                          log, "greater")
    rows += t1
    if len(t1) == 2:                        # the paper's reading of Table 15 A
        wins = {a: sum(verdict(compare(results, f"{a}@{rho}", f"rolemerge@{rho}")) == "supported"
                       for rho in rhos) for a in ("greedy_1swap", "greedy_swapc")}
        rows.append({"kind": "claim", "method": "RoleMerge", "claim": f"T2 no search variant ahead at >= 2 of {len(rhos)} rho",
                     "verdict": "reproduced" if all(w < min(2, len(rhos)) for w in wins.values()) else "not reproduced",
                     "effect": "; ".join(f"{dict((b, l) for l, b in SEARCH_ROWS)[a]} supported at {w} rho"
                                         for a, w in wins.items()),
                     "per_seed": "", "seeds": len(results), "pool": "+".join(_name(r) for r in results), "log": log})
    return rows


def audit_rows(results, log=""):
    """App. F rows: the size sweep (accuracy per rho and the mean over rho, pooled; per base) and
    the fixed-budget source-count audit at one rho (each source set; the one- and two-source
    means), with the pre-registered claims: sizes 12 and 60 level with 24 (mean over rho, within
    +-.05); one-source and two-source means level with the five-source set; two-level bootstrap: bases, then questions."""
    meta = dict(AUDIT, **results[0]["audit_meta"])
    rhos = results[0]["config"]["rhos"]
    seeds = "+".join(_name(r) for r in results)
    get = lambda key: sum((list(r["audit"][key]["correct"]) for r in results), [])
    have = lambda key: all(key in r.get("audit", {}) for r in results)
    rows = []
    for n in meta["sizes"]:
        keys = [f"size{n}@{rho}" for rho in rhos]
        if not all(have(k) for k in keys):
            continue
        row = {"kind": "cal_size", "examples_per_family": n, "seeds": seeds, "log": log}
        for rho, key in zip(rhos, keys):
            x = get(key)
            row[f"acc_{round(1000 * rho)}"] = sum(x) / len(x)
        mean = np.mean([get(k) for k in keys], 0)                     # per question, mean over rho
        row["mean"] = float(mean.mean())
        row["per_seed"] = " / ".join(f"{np.mean([r['audit'][k]['correct'] for k in keys]):.3f}" for r in results)
        rows.append(row)
    ref = [f"size24@{rho}" for rho in rhos]
    for n in (12, 60):
        keys = [f"size{n}@{rho}" for rho in rhos]
        if all(have(k) for k in keys + ref):
            d, q = _versus([np.mean([r["audit"][k]["correct"] for k in keys], 0) for r in results],
                           [np.mean([r["audit"][k]["correct"] for k in ref], 0) for r in results])
            rows.append(_claim(f"F1 size {n} level with 24 (mean over rho)", ["mean over rho"], [d], _level(d),
                               results, log, [q], _level))
    if meta.get("budget_matched", True):
        rho, B = meta["rho"], meta["budget"]
        five = f"size{B // 5}@{rho}"
    else:                          # run_source_audit: s sources hold s * per_source questions
        rho, B = meta["source_rho"], f"{meta['per_source']} per source"
        five = f"src5:all@{rho}"
    sets = {"one source": [k for k in results[0]["audit"] if k.startswith("src1:") and k.endswith(f"@{rho}")],
            "two sources": [k for k in results[0]["audit"] if k.startswith("src2:") and k.endswith(f"@{rho}")],
            "five sources": [five] if have(five) else []}
    for count, keys in sets.items():
        keys = [k for k in keys if have(k)]
        for k in keys:
            x = get(k)
            rows.append({"kind": "cal_sources", "sources": count, "set": k.split("@")[0].split(":")[-1]
                         if k.startswith(("src1:", "src2:")) else "all five", "examples": B, "rho": rho, "acc": sum(x) / len(x),
                         "per_seed": " / ".join(f"{_acc_a(r, k):.3f}" for r in results), "seeds": seeds, "log": log})
        if keys:
            m = np.mean([get(k) for k in keys], 0)
        if len(keys) > 1:
            rows.append({"kind": "cal_sources", "sources": count, "set": f"mean of {len(keys)}", "examples": B,
                         "rho": rho, "acc": float(m.mean()),
                         "per_seed": " / ".join(f"{np.mean([_acc_a(r, k) for k in keys]):.3f}" for r in results),
                         "seeds": seeds, "log": log})
        if keys and count != "five sources" and have(five):
            d, q = _versus([np.mean([r["audit"][k]["correct"] for k in keys], 0) for r in results],
                           [r["audit"][five]["correct"] for r in results])
            size = B if isinstance(B, str) else f"budget {B}"
            rows.append(_claim(f"F2 {count} level with five ({size})", [_tag(rho)], [d], _level(d),
                               results, log, [q], _level))
    return rows


def _acc_a(r, key):
    v = r["audit"][key]["correct"]
    return sum(v) / len(v)


def bootstrap_rows(results, log=""):
    """App. D.2 on the Table-1 arms: RoleMerge minus each comparator at every rho with the per-task
    equal-weight two-level bootstrap (`task_equal_bootstrap`: tasks = the five families, each base
    one seed), beside the per-question two-level bootstrap of the Table-1 verdicts (`compare`);
    both verdicts by eval.metrics.verdict (CI and every base's sign)."""
    rhos = results[0]["config"]["rhos"]
    rows = []
    for label, arm in TABLE1:
        if arm == "rolemerge" or not all(f"{arm}@{rho}" in r["arms"] for r in results for rho in rhos):
            continue
        for rho in rhos:
            ka, kb = f"rolemerge@{rho}", f"{arm}@{rho}"
            d, e = task_equal_bootstrap(results, ka, kb), compare(results, ka, kb)
            rows.append({"kind": "task_equal", "comparison": f"RoleMerge - {label}", "arm": arm, "rho": rho,
                         "diff": d["diff"], "ci_low": d["ci_low"], "ci_high": d["ci_high"], "verdict": verdict(d),
                         "per_seed": d["per_seed"], "per_base": " / ".join(f"{x:+.3f}" for x in d["per_seed"]),
                         "example_diff": e["diff"], "example_ci_low": e["ci_low"],
                         "example_ci_high": e["ci_high"], "example_verdict": verdict(e),
                         "example_per_seed": e["per_seed"], "n": d["n"], "tasks": d["tasks"],
                         "bootstrap": d["bootstrap"], "seeds": "+".join(_name(r) for r in results), "log": log})
    return rows


PART_ROWS = {"sensitivity": sensitivity_rows, "search": search_rows, "calibration": audit_rows,
             "bootstrap": bootstrap_rows}


def per_question_file(res, source):
    """A base's result dict as a committed per-question file (eval/report format: rows = each
    arm's and audit cell's accuracy)."""
    rows = [{"arm": k, "accuracy": sum(v["correct"]) / len(v["correct"]), "n": len(v["correct"])}
            for k, v in list(res["arms"].items()) + [(f"audit {k}", v) for k, v in res.get("audit", {}).items()]]
    return dict({"experiment": f"rolemerge remaining rows on {res['base']}: per-question correctness in 'arms' "
                 "and 'audit' (run_paper's result dict)", "source": source, "rows": rows}, **res)


def rest_markdown(rows):
    """Plain markdown of a part's result rows (one table per kind), for the log."""
    out, kinds = [], list(dict.fromkeys(r["kind"] for r in rows))
    for k in kinds:
        sel = [r for r in rows if r["kind"] == k]
        cols = [c for c in dict.fromkeys(c for r in sel for c in r) if c not in ("kind", "log", "seeds", "pool")]
        fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
        out += [f"{k}:", "", "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
        out += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in sel] + [""]
    return "\n".join(out)


def parser():
    """The command line (also used by the tests)."""
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--quick", action="store_true", help="rho=.5 with RoleMerge and the two baselines only")
    p.add_argument("--data", default="out/data", help="shapes data directory (val + test generated if missing)")
    p.add_argument("--out", default="out/rolemerge", help="output directory (results.json, merged checkpoints)")
    p.add_argument("--model", default="tiny-moe",
                   help="MoE-VLM to merge (tiny-moe = the committed tiny Qwen3-VL-MoE)")
    add_threads(p)
    p.add_argument("--paper", default="",
                   help="comma-separated base directories with the paper's structure (eval.tools.pretrain "
                        "--experts 32 --top-k 4 --patch-size 7 --merge-size 1 --look objects, PAPER_RECIPE): run the pre-registered "
                        "experiment of rolemerge/README.md on each and write {out}/paper/ tables + figures")
    p.add_argument("--max-minutes", type=number(float, above=0), default=None,
                   help="--paper: start no new cell (merge + evaluation) after this many minutes; every finished cell "
                        "is on disk and a rerun continues")
    p.add_argument("--part", default="table1", choices=list(PARTS),
                   help="--paper experiment: table1 (Table 1 and its controls), sensitivity (Tables 3 / 14: lambda "
                        ".01 / .10, five-seed k-means++, linkages), search (Table 15 A: Greedy+1Swap, Greedy+SwapC), "
                        "calibration (App. F: calibration size, number of sources), bootstrap (App. D.2 per-task "
                        "equal-weight bootstrap of the Table-1 arms, from --from files; no runs)")
    p.add_argument("--arms", default="", help="--paper arms, comma-separated (default: the --part's arms)")
    p.add_argument("--audit", default="chunked", choices=("chunked", "sources"),
                   help="--part calibration: chunked (a new calibration of 60 questions per family in chunks of 6: "
                        "size sweep and budget-matched source count) or sources (no new calibration: source subsets "
                        "of the sensitivity / search run's statistics, not budget-matched)")
    p.add_argument("--reuse", default="", metavar="FILES",
                   help="--paper: comma-separated committed per-question files of the same bases (matched by the "
                        "base's folder name); their grouping arms are kept where the new calibration gives the "
                        "same groups, instead of being merged and evaluated again")
    p.add_argument("--from", dest="from_files", default="", metavar="FILES",
                   help="--part bootstrap / sensitivity / search / calibration: the part's rows from these "
                        "comma-separated per-question files (one per base seed; what --per-question wrote), no runs")
    p.add_argument("--per-question", default="", metavar="DIR",
                   help="--part sensitivity / search / calibration: also write each base's per-question results "
                        "to DIR/{base}.json")
    p.add_argument("--limit", type=int, default=0,
                   help="--paper smoke runs: at most this many test examples and calibration records per family "
                        "(0: the pre-registered sizes)")
    p.add_argument("--rhos", default="", help="--paper retention ratios, comma-separated (default: .5, .625, .75)")
    p.add_argument("--retrain-base", default="", metavar="DIR",
                   help="first train the paper-structure base (PAPER_RECIPE, ~65-75 CPU minutes per seed) into "
                        "DIR/seed{S} for every --seeds (resuming a checkpoint), then run --paper on them")
    p.add_argument("--seeds", default="0", help="--retrain-base seeds, comma-separated")
    p.add_argument("--pool", default="",
                   help="--paper: comma-separated base names (folder names) that passed the usability check; the "
                        "verdicts pool these (default: every base)")
    p.add_argument("--results", default="", metavar="FILE",
                   help="--paper: also write the result rows (eval/report.py format: per-base accuracy, Table 1, "
                        "claims) to FILE")
    p.add_argument("--log", default="", help="--results: the experiment log entry the claim rows link to")
    p.add_argument("--rescore", default="", metavar="FILES",
                   help="comma-separated per-question result files of --paper (one {base}.json per base, e.g. "
                        "eval/results/rolemerge/table1_per_question/moe32.json): recompute the verdicts, Table 1 and "
                        "--results from them, without merging")
    return p


def _write_rows(a, argv, experiment, rows):
    """--results: the part's result rows (eval/report format), source = this command."""
    if a.results:
        data.atomic_write_text(a.results, json.dumps({
            "experiment": experiment, "source": "python -m eval.toys.rolemerge " + " ".join(
                argv if argv is not None else __import__("sys").argv[1:]), "rows": rows}, indent=1) + "\n")


def _rest_main(p, a, argv, bases, outp, cfg, arms, reuse):
    """--part sensitivity / search / calibration on every --paper base, then the part's rows."""
    src = "python -m eval.toys.rolemerge " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        if a.part == "calibration" and a.audit == "sources":
            every = [run_source_audit(b, a.data, outp, cfg) for b in bases]
        elif a.part == "calibration":
            every = [run_calibration_audit(b, a.data, outp, cfg) for b in bases]
        else:
            every = [run_paper(b, a.data, outp, cfg, arms, reuse.get(_name({"base": b}))) for b in bases]
    except (ValueError, OSError) as e:
        p.exit(2, f"error: {e}\n")
    names = [x for x in a.pool.split(",") if x]
    res = [r for r in every if not names or _name(r) in names]
    if a.per_question:
        os.makedirs(a.per_question, exist_ok=True)
        for r in every:
            data.atomic_write_text(os.path.join(a.per_question, f"{_name(r)}.json"),
                                   json.dumps(per_question_file(r, src)) + "\n")
    rows = PART_ROWS[a.part](res, a.log)
    _write_rows(a, argv, f"rolemerge_{a.part}", rows)
    md = rest_markdown(rows)
    data.atomic_write_text(os.path.join(outp, f"report_{a.part}.md"), md + "\n")
    print(md)


def _from_main(p, a, argv):
    """--from: a part's rows from committed per-question files (one per base; no runs). --part
    bootstrap always reads them; sensitivity / search / calibration read them instead of running."""
    files = [x for x in a.from_files.split(",") if x]
    if not files:
        p.error(f"--part {a.part} without --paper reads the per-question files of the bases: --from FILE,FILE,...")
    if a.paper or a.retrain_base:
        p.error("--from runs nothing; leave out --paper / --retrain-base")
    results = []
    for f in files:
        try:
            r = json.load(open(f))
            r["arms"], r["families"], r["config"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--from {f}: not a per-question result file with arms, families and config ({e})")
        results.append(r)
    try:
        rows = PART_ROWS[a.part](results, a.log)
    except KeyError as e:
        p.error(f"--from files lack {e} for --part {a.part}; pass the files its --per-question run wrote")
    if not rows:
        p.error(f"--from files hold no --part {a.part} arm at every rho of {results[0]['config']['rhos']}")
    _write_rows(a, argv, "rolemerge_task_equal_bootstrap" if a.part == "bootstrap" else f"rolemerge_{a.part}", rows)
    print(rest_markdown(rows))


def retrain_bases(root, seeds, threads):
    """Train (or resume) the pre-registered base for each seed; returns the base directories."""
    out = []
    for s in seeds:
        d = os.path.join(root, f"seed{s}")
        cmd = [sys.executable, "-m", "eval.tools.pretrain", *PAPER_RECIPE, "--seed", str(s), "--out", d]
        cmd += ["--threads", str(threads)] if threads is not None else []
        print("[paper] " + " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
        out.append(d)
    return out


def _write_results(path, argv, res, every, log):
    data.atomic_write_text(path, json.dumps({
        "experiment": "rolemerge_table1", "source": "python -m eval.toys.rolemerge " + " ".join(
            argv if argv is not None else __import__("sys").argv[1:]),
        "rows": result_rows(res, every, log)}, indent=1) + "\n")


def rescore(p, a, argv):
    """--rescore: the claim table, Table 1 and (--results) the result rows from finished per-base
    result files of --paper; exit 2 naming a file that is missing or is not one."""
    every = []
    for f in (x for x in a.rescore.split(",") if x):
        try:
            r = json.load(open(f))
            r["arms"]["full"]["correct"], r["config"]["rhos"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.exit(2, f"error: --rescore: {f} is not a per-base result file of --paper ({e}); pass the "
                      f"{{base}}.json files --paper writes\n")
        every.append(r)
    names = [x for x in a.pool.split(",") if x]
    unknown = [x for x in names if x not in [_name(r) for r in every]]
    if unknown:
        p.error(f"--pool names {unknown} are not among the --rescore bases {[_name(r) for r in every]}")
    res = [r for r in every if not names or _name(r) in names]
    if a.results:
        _write_results(a.results, argv, res, every, a.log)
    print(claim_table(res) + "\n\nTable 1 layout (pooled; per base in brackets):\n\n" + table1(res))


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    try:
        seeds = [int(x) for x in a.seeds.split(",") if x]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, got {a.seeds!r}")
    if a.part == "bootstrap" or a.from_files:
        if a.part not in PART_ROWS:
            p.error(f"--from belongs to --part {' / '.join(PART_ROWS)}, not {a.part} (that one is --rescore)")
        return _from_main(p, a, argv)
    if a.part != "table1" and not a.paper:
        p.error(f"--part {a.part} runs on the --paper bases; add --paper BASES")
    if (a.pool or a.results or a.log) and not (a.paper or a.retrain_base or a.rescore):
        p.error("--pool, --results and --log belong to the --paper experiment; add --paper BASES")
    if a.rescore:
        if a.paper or a.retrain_base:
            p.error("--rescore reads finished result files; leave out --paper and --retrain-base")
        return rescore(p, a, argv)
    if a.retrain_base and a.paper:
        p.error("--retrain-base trains the bases it evaluates; leave out --paper")
    if a.max_minutes is not None and not (a.paper or a.retrain_base):
        p.error("--max-minutes limits the --paper cells; add --paper BASES")
    set_threads(a.threads, a.paper.split(",")[0] if a.paper else a.model)
    if a.retrain_base:
        a.paper = ",".join(retrain_bases(a.retrain_base, seeds, a.threads))
    if a.paper:
        outp = os.path.join(a.out, "paper")
        arms = tuple(x for x in a.arms.split(",") if x) or PARTS[a.part]
        bad = [x for x in arms if x not in PAPER_ARMS]
        if bad:
            p.error(f"unknown arms {bad}; choose from {list(PAPER_ARMS)}")
        cfg = dict(PAPER)
        if a.limit < 0:
            p.error(f"--limit must be >= 0, got {a.limit}")
        if a.limit:
            cfg.update(n_test=min(cfg["n_test"], a.limit), n_cal=min(cfg["n_cal"], a.limit))
        if a.rhos:
            try:
                cfg["rhos"] = tuple(float(x) for x in a.rhos.split(",") if x)
            except ValueError:
                p.error(f"--rhos takes comma-separated numbers, got {a.rhos!r}")
            if not cfg["rhos"] or not all(0 < r < 1 for r in cfg["rhos"]):
                p.error(f"--rhos: each retention ratio must be in (0, 1), got {a.rhos!r}")
        bases = [b for b in a.paper.split(",") if b]
        missing = [b for b in bases if not os.path.isfile(os.path.join(b, "config.json"))]
        if missing:
            p.error(f"--paper: {missing} are not checkpoint directories (no config.json); pass the bases' folders")
        names = [x for x in a.pool.split(",") if x]
        have = [os.path.basename(b.rstrip("/")) for b in bases]
        unknown = [x for x in names if x not in have]
        if unknown:   # before hours of merging, not after
            p.error(f"--pool names {unknown} are not among the --paper bases {have}")
        reuse = {}
        for f in (x for x in a.reuse.split(",") if x):
            try:
                reuse[_name(json.load(open(f)))] = f
            except (OSError, ValueError, KeyError) as e:
                p.error(f"--reuse {f}: not a per-question result file ({e})")
        if a.max_minutes is not None:
            cfg["deadline"] = time.time() + 60 * a.max_minutes   # a run-length limit, checked before every cell
        try:
            if a.part != "table1":
                return _rest_main(p, a, argv, bases, outp, cfg, arms, reuse)
            every = [run_paper(b, a.data, outp, cfg, arms, reuse.get(_name({"base": b}))) for b in bases]
        except TimeUp as e:
            print(f"[paper] --max-minutes reached before {e}; every finished cell is on disk: rerun the same "
                  f"command to continue", flush=True)
            return
        except (ValueError, OSError) as e:   # e.g. a base without MoE layers: the library's message, no traceback
            p.exit(2, f"error: {e}\n")
        res = [r for r in every if not names or _name(r) in names]
        md = paper_report(res, outp) + "\n\nTable 1 layout (pooled; per base in brackets):\n\n" + table1(res)
        if len(res) < len(every):
            md += "\n\nEvery base, exploratory:\n\n" + table1(every)
        table1_png(res, os.path.join(outp, "accuracy_vs_rho_table1.png"))
        if a.results:
            _write_results(a.results, argv, res, every, a.log)
        r0 = res[0]
        groups = {k.split("@")[0]: r0["arms"][k]["groups"][0] for k in r0["arms"]
                  if k.endswith(f"@{cfg['rhos'][0]}") and k.split("@")[0] in ("rolemerge", "no_phase_split", "msmoe", "hcsmoe")}
        name = os.path.basename(r0["base"].rstrip("/"))
        grouping_png(os.path.join(outp, "ckpt", name, "stats.safetensors"), groups, 0, os.path.join(outp, "grouping_layer0.png"))
        data.atomic_write_text(os.path.join(outp, "report.md"), md + "\n")
        print(md)
        return
    run(a.quick, a.data, a.out, a.model)
    out = json.load(open(os.path.join(a.out, "results_quick.json" if a.quick else "results.json")))
    print(table(out))


if __name__ == "__main__":
    main()
