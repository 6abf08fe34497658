"""Toy reproduction of MoLE (paper 002) on the shapes world, from the tiny dense base.

    python -m eval.toy_mole            # every row below, writes out/mole/results.json
    python -m eval.toy_mole --quick    # main rows only (SFT, plain latents, MoLE), ~3 CPU minutes

Rows (all trained with the same data, steps, optimiser and LoRA on the same base):
  base              the tiny dense Qwen3-VL, untouched
  sft               LoRA fine-tune on the same data (data-matched control; no latents)
  plain_latent      LIVR-like: E+S plain causal latent tokens (same budget, 8), same two-stage schedule
  mole              E=4, S=4, K=2, router + prior + ESVA + topological mixing, stage 1 then stage 2
  ablations         no_router, no_esva, causal_mixing, stage1_only, stage2_only, no_moe_loss,
                    no_div_loss, s0 (E=8, S=0)
  interventions     mole evaluated with latent values random / shuffled / latent KV masked
Per row: accuracy per family [95% bootstrap CI], paired-bootstrap difference vs SFT,
train and inference wall time, and for latent models the latent similarity / attention-KL
diagnostics (x100). Results are what this run measures; nothing is copied from the paper.
"""
import argparse
import json
import os
import time

import torch

from common import backbone as bb
from common import data

MAIN = {  # name -> extra mole.train flags
    "sft": ["--method", "sft"],
    "plain_latent": ["--n-vis", "8", "--n-sum", "0", "--no-router", "--no-esva", "--latent-mixing", "causal"],
    "mole": [],
}
ABLATIONS = {
    "no_router": ["--no-router"],
    "no_esva": ["--no-esva"],
    "causal_mixing": ["--latent-mixing", "causal"],
    "stage1_only": ["--stage1-epochs", "3", "--stage2-epochs", "0"],
    "stage2_only": ["--stage1-epochs", "0", "--stage2-epochs", "3"],
    "no_moe_loss": ["--lambda-balance", "0", "--lambda-z", "0"],
    "no_div_loss": ["--lambda-div", "0"],
    "s0": ["--n-vis", "8", "--n-sum", "0"],
}
INTERVENTIONS = ("random", "shuffle", "mask")
QUICK = dict(n_train=480, n_test=200, batch_size=32)  # 15 steps per epoch, 45 steps per model
FULL = dict(n_train=1280, n_test=500, batch_size=32)  # 40 steps per epoch, 120 steps per model


def _ensure_data(data_dir, n_train, n_test):
    data.ensure_splits(data_dir, {"train": n_train, "test": n_test})  # never overwrites existing files


def _rows(name, res, sft_res, extra):
    """Family accuracy rows + paired difference vs SFT + scalar rows (time, diagnostics)."""
    from eval.evaluate import family_rows
    from eval.metrics import by_family, paired_bootstrap
    rows = family_rows(name, res)
    if sft_res is not None:
        a, b = by_family(res), by_family(sft_res)
        for fam in a:
            d = paired_bootstrap(a[fam], b[fam])
            rows.append({"model": name, "family": fam, "metric": "diff_vs_sft", "value": d["diff"],
                         "ci_low": d["ci_low"], "ci_high": d["ci_high"], "n": len(a[fam])})
    for metric, v in extra.items():
        rows.append({"model": name, "family": "all", "metric": metric, "value": v, "ci_low": None,
                     "ci_high": None, "n": len(res)})
    return rows


def run(quick, data_dir, out_dir, base="tiny-dense", threads=None):
    """Train and evaluate the rows (quick: sft, plain_latent, mole; else all rows), return
    report rows, and write {out_dir}/results.json (results_quick.json in quick mode)."""
    from eval.evaluate import evaluate as plain_evaluate
    from mole import train as mt
    from mole.diagnostics import latent_stats
    from mole.infer import evaluate as mole_evaluate
    if threads:
        torch.set_num_threads(threads)
    cfg = QUICK if quick else FULL
    _ensure_data(data_dir, cfg["n_train"], cfg["n_test"])
    test = data.read_llava_json(os.path.join(data_dir, "test.json"))[: cfg["n_test"]]
    os.makedirs(out_dir, exist_ok=True)
    rows, summary, results = [], {}, {}
    common = ["--base", base, "--data", data_dir, "--n-train", str(cfg["n_train"]),
              "--batch-size", str(cfg["batch_size"]), "--device", "cpu"]

    if not quick:  # the untouched base (the quickstart already reports it)
        model, proc = bb.load_backbone(base)
        t = time.time()
        with torch.inference_mode():
            results["base"] = plain_evaluate(model, proc, test, desc="eval base")
        summary["base"] = {"infer_s": time.time() - t}
    specs = dict(MAIN) if quick else {**MAIN, **ABLATIONS}
    nets = {}
    for name, flags in specs.items():
        t = time.time()
        net, proc, log = mt.main(common + flags + ["--out", os.path.join(out_dir, "ckpt", name), "--overwrite"])
        train_s = time.time() - t
        stage = 2 if log[-1]["stage"] == 2 else 1
        t = time.time()
        with torch.inference_mode():
            if name == "sft":
                res = plain_evaluate(net, proc, test, desc="eval sft")
            else:
                res = mole_evaluate(net, test, stage=stage, desc=f"eval {name}")
        summary[name] = {"train_s": train_s, "infer_s": time.time() - t, "steps": len(log),
                         "final_ce": log[-1]["ce"], "train_step_s": sum(r["s"] for r in log) / len(log)}
        if name != "sft":
            sim, kl = latent_stats(net, test[:100], stage=stage)
            summary[name].update(latent_sim_x100=sim, attn_kl_x100=kl)
        results[name] = res
        nets[name] = (net, stage)
        print(f"[toy_mole] {name}: acc {sum(r['correct'] for r in res) / len(res):.3f} "
              f"train {train_s:.0f}s", flush=True)
    if not quick:
        net, stage = nets["mole"]
        for kind in INTERVENTIONS:
            t = time.time()
            with torch.inference_mode():
                results[f"mole_{kind}"] = mole_evaluate(net, test, stage=stage, intervention=kind,
                                                        desc=f"eval mole {kind}")
            summary[f"mole_{kind}"] = {"infer_s": time.time() - t}
    for name, res in results.items():
        extra = {k: v for k, v in summary[name].items() if k in ("train_s", "infer_s", "latent_sim_x100",
                                                                    "attn_kl_x100")}
        rows += _rows(f"mole/{name}", res, None if name == "sft" else results.get("sft"), extra)
    out = {"quick": quick, "config": cfg, "base": base, "summary": summary, "rows": rows}
    data.atomic_write_text(os.path.join(out_dir, "results_quick.json" if quick else "results.json"),
                           json.dumps(out, indent=1))
    return rows


def table(rows):
    """Markdown table: accuracy per family [CI] and diff vs SFT on all, per model."""
    acc = [r for r in rows if r["metric"] == "accuracy"]
    fams = list(dict.fromkeys(r["family"] for r in acc))
    models = list(dict.fromkeys(r["model"] for r in acc))
    cell = {(r["model"], r["family"], r["metric"]): r for r in rows}
    lines = ["| model | " + " | ".join(fams) + " | diff vs SFT (all) | train s |", "|---" * (len(fams) + 3) + "|"]
    for m in models:
        c = [f"{cell[(m, f, 'accuracy')]['value']:.3f}" if (m, f, "accuracy") in cell else "" for f in fams]
        d = cell.get((m, "all", "diff_vs_sft"))
        ds = f"{d['value']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]" if d else ""
        tr = cell.get((m, "all", "train_s"))
        lines.append(f"| {m} | " + " | ".join(c) + f" | {ds} | {tr['value']:.0f} |" if tr else
                     f"| {m} | " + " | ".join(c) + f" | {ds} | |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="main rows only, small budget (~3 CPU minutes)")
    p.add_argument("--data", default="out/data", help="shapes data directory (generated if missing)")
    p.add_argument("--out", default="out/mole", help="output directory (results.json, checkpoints)")
    p.add_argument("--base", default="tiny-dense", help="base VLM")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    a = p.parse_args(argv)
    rows = run(a.quick, a.data, a.out, base=a.base, threads=a.threads or None)
    print(table(rows))


if __name__ == "__main__":
    main()
