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
"""
import argparse
import json
import os
import re
import shutil
import time

import torch

from common import backbone as bb
from common import data
from common import shapes
from eval.metrics import two_level_bootstrap
from eval.metrics import verdict as verdict_rule

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
    from eval.evaluate import evaluate
    from rolemerge import infer
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
    from eval.evaluate import family_rows
    from eval.metrics import paired_bootstrap
    from rolemerge import calibrate as cal
    from rolemerge import merge as mg
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
    cal.save_stats(stats, stats_path)
    del model
    tot = cal.total_counts(stats)
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
            rep = mg.run_merge(base, stats_path, path, rho=rho, method=method, linkage=linkage, force=True)
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
try:                       # the comparators of rolemerge/comparators.py, when that module provides them
    from rolemerge import comparators as _comparators
except ImportError:
    _comparators = None
if hasattr(_comparators, "COMPARATORS") and hasattr(_comparators, "merge_layer"):
    PAPER_ARMS.update({c: (c, "single", False, {}) for c in _comparators.COMPARATORS})
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
                "--look objects --steps 5500 --batch-size 16 --lr 2e-3 --eval-every 1000 --ckpt-every 50").split()
MAX_NEW_BY_LOOK = {"none": 8, "objects": 32, "full": 64}   # new tokens by the base's look step (its longest turn fits)


def premise(stats):
    """Per-phase token shares and per-layer answer concentration kappa of calibration stats."""
    from rolemerge import calibrate as cal
    from rolemerge import model as rm
    tok = sum(s["tokens"] for s in stats["sources"].values()).double()
    tot = cal.total_counts(stats).double()
    return {"token_share": dict(zip(stats["buckets"], (tok / tok.sum()).tolist())),
            "tokens": dict(zip(stats["buckets"], tok.tolist())),
            "kappa": [rm.answer_concentration(rm.phase_distributions(tot[l])[-1]) for l in range(tot.shape[0])]}


def gold_turn(record, look):
    """The assistant turn a `look` base ("full" / "objects" / "none", eval.tools.pretrain.LOOKS) was
    trained to produce for a shapes record: its look step (from the raw record's "scene", or the
    part of `data.read_llava_json`'s "target" before " Answer:") + answer."""
    from eval.tools.pretrain import LOOKS
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
    from eval.evaluate import evaluate
    with torch.inference_mode():
        res = evaluate(model, proc, test, batch_size=50, max_new_tokens=max_new, desc=desc)
    return [bool(r["correct"]) for r in res], [r["family"] for r in res]


def run_paper(base, data_dir, out_dir, cfg=PAPER, arms=tuple(PAPER_ARMS)):
    """One base: calibrate, collect baseline features, merge every (rho, arm), evaluate with the
    merged router and (merging arms) with oracle routing. Resumable: results are written to
    {out_dir}/{base name}.json after every arm and arms already there are skipped."""
    from rolemerge import calibrate as cal
    from rolemerge import infer
    from rolemerge import merge as mg
    name = os.path.basename(base.rstrip("/"))
    path = os.path.join(out_dir, f"{name}.json")
    res = json.load(open(path)) if os.path.exists(path) else {"base": base, "config": dict(cfg), "arms": {}}
    _ensure_data(data_dir, 500, cfg["n_test"])
    test = data.read_llava_json(os.path.join(data_dir, "test.json"))[: cfg["n_test"]]
    val = data.read_llava_json(os.path.join(data_dir, "val.json"))
    sources = {f: [r for r in val if r["family"] == f][: cfg["n_cal"]] for f in shapes.FAMILIES}
    look = json.load(open(os.path.join(base, "pretrain_log.json")))["args"].get("look", True) \
        if os.path.exists(os.path.join(base, "pretrain_log.json")) else True
    look = {True: "full", False: "none"}.get(look, look)
    cfg = dict(cfg, max_new=MAX_NEW_BY_LOOK[look], look=look)
    res["config"] = dict(res["config"], max_new=cfg["max_new"], look=look)
    ck = os.path.join(out_dir, "ckpt", name)
    stats_path = os.path.join(ck, "stats.safetensors")
    model, proc = cal.load_model(base)
    from rolemerge import baselines as bl
    if not os.path.exists(stats_path) or not os.path.exists(bl.features_path(stats_path)):
        t = time.time()   # the baselines' features come from the same decoded tokens as the routing statistics
        stats = cal.calibrate(model, proc, sources, batch_size=16, max_new_tokens=cfg["max_new"], model_id=base,
                              features=True)
        feats = stats.pop("features")
        cal.save_stats(stats, stats_path)
        bl.save_features(feats, bl.features_path(stats_path), {"fingerprint": stats["fingerprint"]})
        res["calibration_s"] = time.time() - t
    res["premise"] = premise(cal.load_stats(stats_path))
    print(f"[paper] {name}: token shares {res['premise']['token_share']} kappa {res['premise']['kappa']}", flush=True)
    routers = [b.gate.weight.detach().clone() for _, b in cal.moe_blocks(model)]
    if "full" not in res["arms"]:
        acc, fam = _eval_acc(model, proc, test, cfg["max_new"], "full")
        res["arms"]["full"], res["families"] = {"correct": acc}, fam
    del model
    for rho in cfg["rhos"]:
        for arm in arms:
            key = f"{arm}@{rho}"
            if key in res["arms"]:
                continue
            method, linkage, oracle, opts = PAPER_ARMS[arm]
            out = os.path.join(ck, key)
            rep = mg.run_merge(base, stats_path, out, rho=rho, method=method, linkage=linkage, force=True, **opts)
            m, p, _ = infer.load_timed(out)
            row = {"K": rep["K"], "acr": rep["acr_mean"], "mi_retention": rep["mi_retention"], "groups": rep["groups"]}
            row["correct"], _ = _eval_acc(m, p, test, cfg["max_new"], key)
            row["router"] = rep["router"]
            if oracle:
                with infer.oracle_routing(m, routers, rep["groups"]):
                    row["oracle_correct"], _ = _eval_acc(m, p, test, cfg["max_new"], key + " oracle")
            elif rep["router"] == "bound" and BOUND_IS_ORACLE:
                row["oracle_correct"] = row["correct"]
            res["arms"][key] = row
            shutil.rmtree(out, ignore_errors=True)
            print(f"[paper] {name} {key}: acc {sum(row['correct']) / len(test):.3f}" +
                  (f" oracle {sum(row['oracle_correct']) / len(test):.3f}" if oracle else "") +
                  f" ACR {row['acr']:.3f}", flush=True)
            data.atomic_write_text(path, json.dumps(res))
    data.atomic_write_text(path, json.dumps(res))
    return res


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
    from eval.metrics import bootstrap_ci
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
    from eval.metrics import bootstrap_ci
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
    from eval.metrics import bootstrap_ci
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
    from PIL import Image, ImageDraw
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
    from PIL import Image, ImageDraw
    from rolemerge import calibrate as cal
    from rolemerge import model as rm
    stats = cal.load_stats(stats_path)
    _, q = rm.role_profiles(rm.phase_distributions(cal.total_counts(stats).double()[layer]))
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


def parser():
    """The command line (also used by the tests)."""
    from common.cli import Deprecated, add_threads
    from common.cli import entry_parser
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--quick", action="store_true", help="rho=.5 with RoleMerge and the two baselines only")
    p.add_argument("--data", default="out/data", help="shapes data directory (val + test generated if missing)")
    p.add_argument("--out", default="out/rolemerge", help="output directory (results.json, merged checkpoints)")
    p.add_argument("--model", default="tiny-moe",
                   help="MoE-VLM to merge (tiny-moe = the committed tiny Qwen3-VL-MoE)")
    p.add_argument("--base", dest="model", action=Deprecated, new="--model", help=argparse.SUPPRESS)
    add_threads(p)
    p.add_argument("--paper", default="",
                   help="comma-separated base directories with the paper's structure (eval.tools.pretrain "
                        "--experts 32 --top-k 4 --patch-size 7 --merge-size 1 --no-look): run the pre-registered "
                        "experiment of rolemerge/README.md on each and write {out}/paper/ tables + figures")
    p.add_argument("--arms", default=",".join(PAPER_ARMS), help="--paper arms, comma-separated")
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


def retrain_bases(root, seeds, threads):
    """Train (or resume) the pre-registered base for each seed; returns the base directories."""
    import subprocess
    import sys
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
    from common.cli import set_threads
    p = parser()
    a = p.parse_args(argv)
    try:
        seeds = [int(x) for x in a.seeds.split(",") if x]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, got {a.seeds!r}")
    if (a.pool or a.results or a.log) and not (a.paper or a.retrain_base or a.rescore):
        p.error("--pool, --results and --log belong to the --paper experiment; add --paper BASES")
    if a.rescore:
        if a.paper or a.retrain_base:
            p.error("--rescore reads finished result files; leave out --paper and --retrain-base")
        return rescore(p, a, argv)
    if a.retrain_base and a.paper:
        p.error("--retrain-base trains the bases it evaluates; leave out --paper")
    set_threads(a.threads, a.paper.split(",")[0] if a.paper else a.model)
    if a.retrain_base:
        a.paper = ",".join(retrain_bases(a.retrain_base, seeds, a.threads))
    if a.paper:
        outp = os.path.join(a.out, "paper")
        arms = tuple(x for x in a.arms.split(",") if x)
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
        try:
            every = [run_paper(b, a.data, outp, cfg, arms) for b in bases]
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
