"""Toy reproduction of RoleMerge (paper 001) on the shapes world, from the tiny MoE-VLM base.

    python -m eval.toy_rolemerge            # every row below, writes out/rolemerge/results.json
    python -m eval.toy_rolemerge --quick    # rho = .5: full, RoleMerge, both baselines (~3 CPU minutes)

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
import time

import torch

from common import backbone as bb
from common import data

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
    data.ensure_splits(data_dir, {"val": n_val, "test": n_test})  # never overwrites existing files


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
    fams = data.FAMILIES
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="rho=.5 with RoleMerge and the two baselines only")
    p.add_argument("--data", default="out/data", help="shapes data directory (val + test generated if missing)")
    p.add_argument("--out", default="out/rolemerge", help="output directory (results.json, merged checkpoints)")
    p.add_argument("--base", default="tiny-moe", help="MoE-VLM to merge (tiny-moe = the committed tiny Qwen3-VL-MoE)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    a = p.parse_args(argv)
    run(a.quick, a.data, a.out, a.base, a.threads)
    out = json.load(open(os.path.join(a.out, "results_quick.json" if a.quick else "results.json")))
    print(table(out))


if __name__ == "__main__":
    main()
