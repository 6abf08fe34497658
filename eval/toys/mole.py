"""Toy reproduction of MoLE on the shapes world, from the tiny dense base.

    python -m eval.toys.mole            # every row below, writes out/mole/results.json
    python -m eval.toys.mole --quick    # main rows only (SFT, plain latents, MoLE), ~3 CPU minutes
    python -m eval.toys.mole --part bottleneck --threads 1   # stage-1 bottleneck experiment (mole/README.md)
    python -m eval.toys.mole --part shift                    # answer CE: position shift vs latent content
    python -m eval.toys.mole --part headroom --threads 1     # the table on the size family (base not at ceiling)
    python -m eval.toys.mole --part control --threads 1      # stage-1 positive control (colour, answer only)
    python -m eval.toys.mole --phase lr --threads 1          # the table with a per-row lr picked on validation
    python -m eval.toys.mole --phase data; python -m eval.toys.mole --seeds 0 & python -m eval.toys.mole --seeds 1
                                                            # one process per seed (mole/README.md, "Wall time")

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
import json
import os
import re
import time

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

from common import backbone as bb
from common import data
from common import shapes as world
from common.cli import add_threads, entry_parser, late, number, set_threads
from eval.evaluate import evaluate as plain_evaluate
from eval.metrics import accuracy, bootstrap_ci, by_family, paired_bootstrap, two_level_bootstrap, verdict_text
from mole import train as mt
from mole.checkpoint import load_mole
from mole.diagnostics import latent_stats
from mole.infer import evaluate as mole_evaluate
from mole.model import ZSUM, ZVIS, MoLE, MoLEConfig, MoLEPass, topology_mask

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
# the two-stage table's main rows, in run order; sft_placeholders = the SFT control with the
# same 8 inert placeholder tokens where the latents sit (same M-RoPE position shift, no latents)
TABLE_MAIN = {"sft": MAIN["sft"], "sft_placeholders": ["--method", "sft", "--placeholders", "8"],
              "plain_latent": MAIN["plain_latent"], "mole": MAIN["mole"]}
QUICK = dict(n_train=480, n_test=200, batch_size=32)  # 15 steps per epoch, 45 steps per model
FULL = dict(n_train=1280, n_test=500, batch_size=32)  # 40 steps per epoch, 120 steps per model


def _acc(items):
    """Accuracy of a list of scored items ({"correct": bool, ...}), as eval.metrics.accuracy."""
    return accuracy([x["correct"] for x in items])


def _ensure_data(data_dir, n_train, n_test):
    world.ensure_splits(data_dir, {"train": n_train, "test": n_test})  # never overwrites existing files


def _table_one(name, flags, seed, cfg, test, data_dir, tab_dir, base, threads, mole_evaluate, plain_evaluate,
               lr=None, path=None):
    """Train one row of the two-stage table for one seed (resumable checkpoint in
    {tab_dir}/ckpt/{name}_seed{seed}), evaluate it on `test`, write {tab_dir}/{name}_seed{seed}.json
    (or `path`) atomically and return (result, net, stage). A result file that exists is
    returned as is (net None): the table resumes where it stopped. lr: passed as mole.train
    --lr (None: its toy default, TABLE_LR); a finished checkpoint is loaded, not retrained
    (mole.train --resume), and "steps_s" (the sum of its recorded step times) says what the
    training cost when it ran."""
    path = path or os.path.join(tab_dir, f"{name}_seed{seed}.json")
    if os.path.exists(path):
        return _json(path), None, None
    if lr is not None:
        flags = flags + ["--lr", f"{lr:g}"]
    t = time.time()
    net, proc, log = mt.main(["--model", base, "--data", data_dir, "--n-train", str(cfg["n_train"]),
                              "--batch-size", str(cfg["batch_size"]), "--device", "cpu", "--quiet",
                              "--seed", str(seed), "--save-every", "20", "--resume",
                              "--out", os.path.join(tab_dir, "ckpt", f"{name}_seed{seed}")] + flags +
                             (["--threads", str(threads)] if threads is not None else []))
    train_s = time.time() - t
    stage = 2 if log[-1]["stage"] == 2 else 1
    t = time.time()
    with torch.inference_mode():
        if "sft" in flags:
            res = plain_evaluate(net, proc, test, desc=f"eval {name}")
        else:
            res = mole_evaluate(net, test, stage=stage, desc=f"eval {name}")
    out = {"row": name, "seed": seed, "lr": lr if lr is not None else TABLE_LR, "train_s": train_s,
           "steps_s": sum(x["s"] for x in log), "infer_s": time.time() - t, "steps": len(log),
           "stage": stage, "ce_log": [[x["step"], x["stage"], x["ce"]] for x in log], "items": res}
    if "sft" not in flags:
        with torch.inference_mode():
            out["latent_sim_x100"], out["attn_kl_x100"] = latent_stats(net, test[:100], stage=stage)
    data.atomic_write_text(path, json.dumps(out))
    return out, net, stage


def _interventions(tab_dir, seed, net, stage, test, mole_evaluate):
    """MoLE of {tab_dir}/ckpt/mole_seed{seed} (`net` if already loaded) evaluated on `test` with
    each latent intervention (INTERVENTIONS); one atomic {tab_dir}/mole_{kind}_seed{seed}.json
    each, skipped when it exists."""
    for kind in INTERVENTIONS:
        path = os.path.join(tab_dir, f"mole_{kind}_seed{seed}.json")
        if os.path.exists(path):
            continue
        if net is None:
            net, _, stage = load_mole(os.path.join(tab_dir, "ckpt", f"mole_seed{seed}"))
        t = time.time()
        with torch.inference_mode():
            res = mole_evaluate(net, test, stage=stage, intervention=kind, desc=f"eval mole {kind}")
        data.atomic_write_text(path, json.dumps({"row": f"mole_{kind}", "seed": seed,
                                                 "infer_s": time.time() - t, "items": res}))
        print(f"[toy_mole] mole_{kind} seed {seed}: acc "
              f"{_acc(res):.3f}", flush=True)


def _base_row(tab_dir, base, test, plain_evaluate):
    """The untouched base evaluated on `test` ({tab_dir}/base.json, seed-independent; kept if it exists)."""
    base_path = os.path.join(tab_dir, "base.json")
    if os.path.exists(base_path):
        return
    model, proc = bb.load_backbone(base)
    t = time.time()
    with torch.inference_mode():
        res = plain_evaluate(model, proc, test, desc="eval base")
    data.atomic_write_text(base_path, json.dumps({"row": "base", "seed": None, "infer_s": time.time() - t,
                                                  "items": res}))


def run(quick, data_dir, out_dir, base="tiny-dense", threads=None, seeds=(0,), phase="all"):
    """Train and evaluate the rows of the two-stage table (quick: sft, plain_latent, mole, seed 0
    only; else TABLE_MAIN, the interventions, then the ablations) for every seed, each (row, seed)
    its own atomic result file under {out_dir}/table (table_quick), so a stopped run resumes.
    Order: for each seed the main rows and the interventions, then for each seed the ablations.
    Writes and returns the summary (`summarise_table`: {out_dir}/results.json, results_quick.json
    in quick mode, and the PNG figures).
    phase "data": only generate the data splits and the base row, return None. Then processes
    with disjoint --seeds may share one out_dir (one core each): every (row, seed) has its own
    result file and checkpoint, and every file is written atomically under a per-process
    temporary name; only the data images are written under a fixed temporary name, so two
    processes must not generate the data at the same time."""
    if threads:
        torch.set_num_threads(threads)
    cfg = QUICK if quick else FULL
    seeds = [0] if quick else list(seeds)
    _ensure_data(data_dir, cfg["n_train"], cfg["n_test"])
    test = data.read_llava_json(os.path.join(data_dir, "test.json"))[: cfg["n_test"]]
    tab_dir = os.path.join(out_dir, "table_quick" if quick else "table")
    os.makedirs(tab_dir, exist_ok=True)
    if not quick:
        _base_row(tab_dir, base, test, plain_evaluate)
    if phase == "data":
        return None
    main_rows = {k: MAIN[k] for k in ("sft", "plain_latent", "mole")} if quick else TABLE_MAIN
    runs = [(seed, name, flags) for seed in seeds for name, flags in main_rows.items()]
    if not quick:
        runs += [(seed, name, flags) for seed in seeds for name, flags in ABLATIONS.items()]
    for seed, name, flags in runs:
        r, net, stage = _table_one(name, flags, seed, cfg, test, data_dir, tab_dir, base, threads,
                                   mole_evaluate, plain_evaluate)
        print(f"[toy_mole] {name} seed {seed}: acc {_acc(r['items']):.3f} train {r.get('train_s', 0):.0f}s",
              flush=True)
        if name == "mole" and not quick:
            _interventions(tab_dir, seed, net, stage, test, mole_evaluate)
    return summarise_table(out_dir, quick, data_dir)


TABLE_ORDER = ["base", "sft", "sft_placeholders", "plain_latent", "mole", *ABLATIONS,
               *(f"mole_{k}" for k in INTERVENTIONS)]
# paired comparisons of the table: row -> the rows it is compared with
TABLE_REFS = {"sft_placeholders": ("sft",), "plain_latent": ("sft", "sft_placeholders"),
              "mole": ("sft", "sft_placeholders", "plain_latent"),
              **{k: ("mole",) for k in ABLATIONS}, **{f"mole_{k}": ("mole",) for k in INTERVENTIONS}}


def _ce_points(log):
    """Training CE of the assistant turn from a row's ce_log [[step, stage, ce], ...]: step 1,
    mean of the last 5 stage-1 steps, first stage-2 step, mean of the last 5 steps."""
    s1 = [c for _, st, c in log if st == 1]
    s2 = [c for _, st, c in log if st == 2]
    mean = lambda x: sum(x) / len(x) if x else None
    return {"step1": log[0][2], "end_stage1": mean(s1[-5:]), "start_stage2": s2[0] if s2 else None,
            "end": mean([c for _, _, c in log][-5:])}


def report_rows(summary):
    """The quickstart's report rows ({model, family, metric, value, ci_low, ci_high, n}) of a
    two-stage-table summary (`summarise_table`): accuracy of each row's first seed per family
    and overall ("all"), one row each, with its bootstrap CI and n (a summary written before
    family CIs were recorded gives None there)."""
    out = []
    for row in summary["rows"]:
        ps = row["per_seed"][str(row["seeds"][0])]
        for f, v in ps["family"].items():  # the test items' order, as the quickstart's other tables
            if f != "all":
                lo, hi = ps.get("family_ci", {}).get(f, (None, None))
                out.append({"model": row["row"], "family": f, "metric": "accuracy", "value": v, "ci_low": lo,
                            "ci_high": hi, "n": ps.get("family_n", {}).get(f)})
        out.append({"model": row["row"], "family": "all", "metric": "accuracy", "value": ps["acc"],
                    "ci_low": ps["ci_low"], "ci_high": ps["ci_high"], "n": ps["n"]})
    return out


def _summary_rows(res):
    """Rows of a two-stage-table summary from result files res {(row, seed): result} (seed None
    for the base): per row the accuracy per seed with its bootstrap CI, per-family accuracy,
    the mean over seeds with the bootstrap CI over items of the per-item seed mean, and for
    each reference row in TABLE_REFS the paired bootstrap of the difference per seed and the
    two-level bootstrap (seeds, then items) of the seed-averaged difference (seeds both rows
    have; "sd" = sd of the per-item difference of the seed means, "mdd" = 2.8 sd / sqrt(n), the
    difference an items-only test detects at alpha 0.05 two-sided with power 0.8; the two-level
    rule needs more, eval/logs/mole.md). Training CE points (`_ce_points`)."""
    corr = lambda r: [float(x["correct"]) for x in r["items"]]
    rows = []
    for name in [n for n in TABLE_ORDER if any(k[0] == n for k in res)]:
        seeds = sorted(k[1] for k in res if k[0] == name and k[1] is not None) or [None]
        row = {"row": name, "seeds": seeds, "per_seed": {}}
        for sd in seeds:
            r = res[(name, sd)]
            lo, hi = bootstrap_ci(corr(r))
            fams = {f: c for f, c in by_family(r["items"]).items() if f != "all"}
            ps = {"acc": sum(corr(r)) / len(corr(r)), "ci_low": lo, "ci_high": hi, "n": len(corr(r)),
                  "family": {f: sum(c) / len(c) for f, c in fams.items()},
                  "family_n": {f: len(c) for f, c in fams.items()},
                  "family_ci": {f: list(bootstrap_ci(c)) for f, c in fams.items()}}
            for k in ("train_s", "infer_s", "latent_sim_x100", "attn_kl_x100"):
                if k in r:
                    ps[k] = r[k]
            if "ce_log" in r:
                ps["ce"] = _ce_points(r["ce_log"])
            row["per_seed"][str(sd)] = ps
        mean_items = [sum(v) / len(v) for v in zip(*(corr(res[(name, sd)]) for sd in seeds))]
        lo, hi = bootstrap_ci(mean_items)
        row["mean"] = {"acc": sum(mean_items) / len(mean_items), "ci_low": lo, "ci_high": hi, "n_seeds": len(seeds)}
        for ref in TABLE_REFS.get(name, ()):
            both = [sd for sd in seeds if (ref, sd) in res]
            if not both:
                continue
            per = {str(sd): paired_bootstrap(corr(res[(name, sd)]), corr(res[(ref, sd)])) for sd in both}
            a = [sum(v) / len(v) for v in zip(*(corr(res[(name, sd)]) for sd in both))]
            b = [sum(v) / len(v) for v in zip(*(corr(res[(ref, sd)]) for sd in both))]
            m = two_level_bootstrap([corr(res[(name, sd)]) for sd in both], [corr(res[(ref, sd)]) for sd in both])
            d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
            m["sd"] = float(d.std())
            m["mdd"] = 2.8 * m["sd"] / len(a) ** 0.5
            row[f"vs_{ref}"] = {"per_seed": per, "mean": m, "seeds": both}
        rows.append(row)
    return rows


def summarise_table(out_dir, quick=False, data_dir=None):
    """Summary of whatever result files of the two-stage table exist (a partial run gives a
    partial summary). Per row: accuracy per seed with its bootstrap CI, per-family accuracy,
    the mean over seeds with the bootstrap CI over items of the per-item seed mean, and for
    each reference row in TABLE_REFS the paired bootstrap of the difference per seed and of
    the seed-averaged difference (seeds both rows have). Training CE points (`_ce_points`).
    Writes {out_dir}/results.json (results_quick.json) and {out_dir}/table_acc.png."""
    tab_dir = os.path.join(out_dir, "table_quick" if quick else "table")
    res = {}
    for f in sorted(os.listdir(tab_dir)):
        m = re.fullmatch(r"(.+)_seed(\d+)\.json|base\.json", f)
        if m:
            r = _json(os.path.join(tab_dir, f))
            res[(r["row"], r["seed"])] = r
    rows = _summary_rows(res)
    cfg = QUICK if quick else FULL
    out = {"quick": quick, "config": cfg, "rows": rows}
    data.atomic_write_text(os.path.join(out_dir, "results_quick.json" if quick else "results.json"),
                           json.dumps(out, indent=1))
    bars = [{"arm": r["row"], "seed": int(sd) if sd != "None" else 0,
             "acc": {"value": v["acc"], "ci_low": v["ci_low"], "ci_high": v["ci_high"]}}
            for r in rows for sd, v in r["per_seed"].items()]
    bar_png(bars, "acc", os.path.join(out_dir, "table_acc_quick.png" if quick else "table_acc.png"),
            "two-stage table: accuracy on the test items (all families)", w=1400, order=TABLE_ORDER, label=11)
    ckpt = os.path.join(tab_dir, "ckpt", "mole_seed0")
    if not quick and os.path.exists(os.path.join(ckpt, "state.json")) and ("mole", 0) in res:
        net, _, stage = load_mole(ckpt)
        dd = data_dir or os.path.join(out_dir, "data")
        rec = data.read_llava_json(os.path.join(dd, "test.json"))[0] if os.path.isdir(dd) else None
        if rec is not None:
            routing_png(net, rec, os.path.join(out_dir, "routing_table_mole_seed0.png"), stage=stage)
    return out


def table(summary):
    """Markdown table of the two-stage table summary: per row the accuracy per seed, the mean
    over seeds [95% CI], and the seed-averaged paired difference vs each reference row [95% CI]."""
    f = lambda v: f"{v['acc']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]"
    g = lambda d: f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
    lines = ["| row | seeds | acc per seed | mean [95% CI] | vs SFT | vs SFT + placeholders | vs plain latents | "
             "vs MoLE | step-1 CE per seed |", "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        per = " / ".join(f"{v['acc']:.3f}" for v in r["per_seed"].values())
        ce = " / ".join(f"{v['ce']['step1']:.3f}" for v in r["per_seed"].values() if "ce" in v)
        cmp_ = [g(r[f"vs_{k}"]["mean"]) if f"vs_{k}" in r else "" for k in ("sft", "sft_placeholders",
                                                                           "plain_latent", "mole")]
        seeds = ",".join(str(s) for s in r["seeds"] if s is not None) or "-"
        lines.append(f"| {r['row']} | {seeds} | {per} | {f(r['mean'])} | " + " | ".join(cmp_) + f" | {ce} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- per-row lr

TABLE_LR = 2e-3          # the lr of every row of the two-stage table (mole.train's toy default)
LR_GRID = (5e-4, 2e-3, 5e-3)
LR_SWEPT = tuple(TABLE_MAIN)  # swept rows; the ablations and interventions take MoLE's picked lr
N_VAL = 200              # validation items (the shapes "val" split: disjoint from train and test)


def lr_dir(out_dir, lr):
    """Folder of the two-stage table's result files and checkpoints at learning rate `lr`:
    {out_dir}/table for TABLE_LR (the table as first run), {out_dir}/table_lr{lr:g} otherwise.
    Each folder holds one lr only, so `summarise_table` of one folder never mixes lrs."""
    return os.path.join(out_dir, "table" if lr == TABLE_LR else f"table_lr{lr:g}")


def pick_lr(val_acc, prefer=TABLE_LR):
    """The learning rate a row runs at: the one with the highest validation accuracy in
    val_acc {lr: accuracy}; among exact ties `prefer` (the lr the table already ran at) if it
    is tied, else the lowest tied lr (pre-registered in eval/logs/mole.md).
    Raises ValueError for an empty sweep."""
    if not val_acc:
        raise ValueError("error: no lr sweep results to pick from; run --phase lr first")
    best = max(val_acc.values())
    tied = sorted(lr for lr, acc in val_acc.items() if acc == best)
    return prefer if prefer in tied else tied[0]


def read_sweep(out_dir):
    """{row: {lr: validation accuracy}} of the sweep result files in {out_dir}/lr_sweep."""
    sweep = {}
    d = os.path.join(out_dir, "lr_sweep")
    for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if re.fullmatch(r".+_lr[0-9.e-]+\.json", f):
            r = _json(os.path.join(d, f))
            sweep.setdefault(r["row"], {})[r["lr"]] = _acc(r["items"])
    return sweep


def shared_items(train, other):
    """Ids of the records of `other` that are also training records: the same question and
    target text *and* the same image pixels (the text does not name an object's size, so equal
    text alone can be two different images)."""
    def pixels(r):
        return data.load_image(r["image"], r["id"]).convert("RGB").tobytes()
    by_text = {}
    for r in train:
        by_text.setdefault((r["question"], r["target"]), []).append(r)
    out = []
    for r in other:
        same = by_text.get((r["question"], r["target"]), [])
        if same and any(pixels(t) == pixels(r) for t in same):
            out.append(r["id"])
    return out


def run_lr(data_dir, out_dir, base="tiny-dense", threads=None, seeds=(2, 0, 1), deadline=None):
    """The two-stage table with a per-row learning rate picked on a validation split
    (pre-registered in eval/logs/mole.md).

    1. sweep: each row of LR_SWEPT at each lr of LR_GRID, seed 0, the table's schedule on the
       same 1,280 training examples, scored by final-answer accuracy on N_VAL validation items
       ({out_dir}/lr_sweep/{row}_lr{lr}.json); the checkpoint is the row's seed-0 checkpoint at
       that lr ({lr_dir}/ckpt/{row}_seed0), so a picked lr's seed 0 costs inference only and
       the table's existing lr-2e-3 checkpoints are reused, not retrained.
    2. `pick_lr` per row; ablations and interventions take MoLE's pick.
    3. for each seed in `seeds` order: the main rows at their picked lr on the test split, and
       MoLE's interventions; then for each seed the ablations at MoLE's lr. Files that exist
       are kept (resumable; the lr-2e-3 results of the first run count as done).
    deadline: time.time() after which no new training starts (--max-minutes; what is done is summarised).
    Raises SystemExit (error) if a validation item is also a training item.
    Returns `summarise_lr`'s summary."""
    if threads:
        torch.set_num_threads(threads)
    cfg = FULL
    _ensure_data(data_dir, cfg["n_train"], cfg["n_test"])
    world.ensure_splits(data_dir, {"val": N_VAL})
    train = data.read_llava_json(os.path.join(data_dir, "train.json"))[: cfg["n_train"]]
    val = data.read_llava_json(os.path.join(data_dir, "val.json"))[:N_VAL]
    test = data.read_llava_json(os.path.join(data_dir, "test.json"))[: cfg["n_test"]]
    if shared_items(train, val):
        raise SystemExit(f"error: {data_dir}/val.json shares items with the training records; "
                         f"regenerate it (common.shapes.generate_split) so that it is disjoint")
    sweep_dir = os.path.join(out_dir, "lr_sweep")
    for name in LR_SWEPT:
        for lr in sorted(LR_GRID, key=lambda x: x != TABLE_LR):  # the reused lr-2e-3 checkpoint first (cheap)
            path = os.path.join(sweep_dir, f"{name}_lr{lr:g}.json")
            if not os.path.exists(path) and late(deadline):
                print(f"[toy_mole] --max-minutes reached: sweep {name} lr {lr:g} not run", flush=True)
                continue
            r, _, _ = _table_one(name, TABLE_MAIN[name], 0, cfg, val, data_dir, lr_dir(out_dir, lr), base, threads,
                                 mole_evaluate, plain_evaluate, lr=lr, path=path)
            print(f"[toy_mole] sweep {name} lr {lr:g}: val acc "
                  f"{_acc(r['items']):.3f} steps {r['steps_s']:.0f}s", flush=True)
    sweep = read_sweep(out_dir)
    if any(len(sweep.get(n, {})) < len(LR_GRID) for n in LR_SWEPT):
        print("[toy_mole] the sweep is incomplete: no row runs at a picked lr", flush=True)
        return summarise_lr(out_dir, data_dir)
    picked = {n: pick_lr(sweep[n]) for n in LR_SWEPT}
    print(f"[toy_mole] picked lr: {picked}", flush=True)
    for seed in seeds:
        for name in LR_SWEPT:
            tab_dir = lr_dir(out_dir, picked[name])
            if not os.path.exists(os.path.join(tab_dir, f"{name}_seed{seed}.json")) and late(deadline):
                print(f"[toy_mole] --max-minutes reached: {name} seed {seed} not run", flush=True)
                continue
            r, net, stage = _table_one(name, TABLE_MAIN[name], seed, cfg, test, data_dir, tab_dir, base, threads,
                                       mole_evaluate, plain_evaluate, lr=picked[name])
            print(f"[toy_mole] {name} lr {picked[name]:g} seed {seed}: acc "
                  f"{_acc(r['items']):.3f}", flush=True)
            if name == "mole":
                _interventions(tab_dir, seed, net, stage, test, mole_evaluate)
    tab_dir = lr_dir(out_dir, picked["mole"])
    for seed in seeds:
        for name, flags in ABLATIONS.items():
            if not os.path.exists(os.path.join(tab_dir, f"{name}_seed{seed}.json")) and late(deadline):
                print(f"[toy_mole] --max-minutes reached: {name} seed {seed} not run", flush=True)
                continue
            r, _, _ = _table_one(name, flags, seed, cfg, test, data_dir, tab_dir, base, threads,
                                 mole_evaluate, plain_evaluate, lr=picked["mole"])
            print(f"[toy_mole] {name} lr {picked['mole']:g} seed {seed}: acc "
                  f"{_acc(r['items']):.3f}", flush=True)
    return summarise_lr(out_dir, data_dir)


def run_fixed_lr(data_dir, out_dir, lr, rows, seeds, base="tiny-dense", threads=None):
    """Exploratory (not part of the pre-registered lr run): the main rows `rows` (names in
    TABLE_MAIN) at one learning rate `lr` for `seeds`, into lr_dir(out_dir, lr) (files that
    exist are kept), to compare rows at equal lr. Returns `_summary_rows` of those rows at that
    lr (their comparisons with each other as in TABLE_REFS)."""
    bad = [r for r in rows if r not in TABLE_MAIN]
    if bad:
        raise SystemExit(f"error: --rows takes main rows {list(TABLE_MAIN)}, got {bad}")
    if threads:
        torch.set_num_threads(threads)
    cfg = FULL
    _ensure_data(data_dir, cfg["n_train"], cfg["n_test"])
    test = data.read_llava_json(os.path.join(data_dir, "test.json"))[: cfg["n_test"]]
    tab_dir = lr_dir(out_dir, lr)
    res = {}
    for seed in seeds:
        for name in rows:
            r, _, _ = _table_one(name, TABLE_MAIN[name], seed, cfg, test, data_dir, tab_dir, base, threads,
                                 mole_evaluate, plain_evaluate, lr=lr)
            res[(name, seed)] = r
            print(f"[toy_mole] {name} lr {lr:g} seed {seed}: acc "
                  f"{_acc(r['items']):.3f}", flush=True)
    return _summary_rows(res)


def summarise_lr(out_dir, data_dir=None):
    """Summary of the per-row-lr table from whatever files exist: the sweep ({row: {lr: val
    acc}}), the picked lr per row, and `_summary_rows` over each row's result files at its
    picked lr only (main rows: their own pick; ablations and interventions: MoLE's; the base
    from {out_dir}/table/base.json), so no row mixes lrs and every "vs MoLE" comparison is at
    one lr. Writes {out_dir}/results_lr.json and {out_dir}/table_lr_acc.png; returns the summary."""
    sweep = read_sweep(out_dir)
    picked = {n: pick_lr(sweep[n]) for n in LR_SWEPT if len(sweep.get(n, {})) == len(LR_GRID)}
    res = {}
    base_path = os.path.join(out_dir, "table", "base.json")
    if os.path.exists(base_path):
        res[("base", None)] = _json(base_path)
    rows = _picked_rows(out_dir, res, picked, LR_SWEPT)
    out = {"config": FULL, "lr_grid": list(LR_GRID), "n_val": N_VAL,
           "sweep_val_acc": {n: {f"{lr:g}": a for lr, a in sorted(v.items())} for n, v in sweep.items()},
           "picked_lr": picked, "rows": rows}
    return _write_summary(out_dir, "results_lr.json", out, "table_lr_acc.png",
                          "two-stage table, per-row lr picked on validation: test accuracy per row and seed", 1400)


def _picked_rows(out_dir, res, picked, swept, skip=()):
    """`_summary_rows` of every table row at its picked lr: the result files {row}_seed{S}.json
    under lr_dir(out_dir, lr), added to `res` ({(row, seed): result}); a row not in `swept` takes
    MoLE's lr; rows without a picked lr or in `skip` are left out. Each row carries its "lr"."""
    lr_of = {}
    for name in TABLE_ORDER[1:]:
        lr = picked.get(name if name in swept else "mole")
        if lr is None or name in skip:
            continue
        lr_of[name] = lr
        d = lr_dir(out_dir, lr)
        for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            m = re.fullmatch(re.escape(name) + r"_seed(\d+)\.json", f)
            if m:
                res[(name, int(m.group(1)))] = _json(os.path.join(d, f))
    rows = _summary_rows(res)
    for row in rows:
        row["lr"] = lr_of.get(row["row"])
    return rows


def _write_summary(out_dir, name, out, png, title, w):
    """Write a per-row-lr summary `out` (rows from `_summary_rows`) as {out_dir}/{name} and its
    bar figure (test accuracy per row and seed) as {out_dir}/{png}; returns `out`."""
    os.makedirs(out_dir, exist_ok=True)
    data.atomic_write_text(os.path.join(out_dir, name), json.dumps(out, indent=1))
    bars = [{"arm": r["row"], "seed": int(sd) if sd != "None" else 0,
             "acc": {"value": v["acc"], "ci_low": v["ci_low"], "ci_high": v["ci_high"]}}
            for r in out["rows"] for sd, v in r["per_seed"].items()]
    if bars:
        bar_png(bars, "acc", os.path.join(out_dir, png), title, w=w, order=TABLE_ORDER, label=11)
    return out


def verdict(cmp, sign=1):
    """The verdict rule of every toy (eval.metrics.verdict) on one comparison `cmp` ({"per_seed":
    {seed: {diff, ...}}, "mean": the two-level bootstrap over the seeds, "seeds": [...]}, a row's
    "vs_<ref>" entry: row minus ref) for the claim "sign * (row - ref) > 0": "supported" /
    "contradicted" when the mean's 95 % CI lies above / below 0 (after the sign) and every seed's
    difference has that sign, else "inconclusive"; with one seed the verdict says that only the
    items were resampled."""
    m = dict(cmp["mean"], per_seed=[d["diff"] for d in cmp["per_seed"].values()], seeds=len(cmp["seeds"]))
    return verdict_text(m, sign)


# the pre-registered claims of the per-row-lr table: (label, row, ref, sign of row - ref)
ABLATION_PART = {"no_router": "the router (vs w/o router and L_div)", "no_esva": "ESVA",
                 "causal_mixing": "topological latent mixing (vs causal)",
                 "stage1_only": "stage 2 (vs stage 1 only, 3 epochs)",
                 "stage2_only": "the two-stage schedule (vs stage 2 only, 3 epochs)",
                 "no_moe_loss": "the MoE losses (balance + z)", "no_div_loss": "the diversity loss",
                 "s0": "Z_sum (vs S = 0, E = 8)"}
LR_CLAIMS = ([("Q1 the shift costs SFT: SFT minus SFT + 8 placeholders", "sft_placeholders", "sft", -1),
              ("Q2 MoLE minus SFT + 8 placeholders", "mole", "sft_placeholders", 1),
              ("Q3 MoLE minus plain latents", "mole", "plain_latent", 1)] +
             [(f"Q4 MoLE minus MoLE with latents {k}", f"mole_{k}", "mole", -1) for k in INTERVENTIONS] +
             [(f"{ABLATION_PART[k]} helps: MoLE minus {k}", k, "mole", -1) for k in ABLATIONS])


def lr_markdown(summary, claims=LR_CLAIMS):
    """Markdown of the per-row-lr table (`summarise_lr`, `summarise_headroom`): the sweep, every
    row (lr, seeds, accuracy per seed, mean [95% CI]), and each pre-registered claim in `claims` with its
    per-seed and seed-averaged difference [95% CI], the MDD and the verdict (`verdict`)."""
    f = lambda v: f"{v['acc']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]"
    g = lambda d, sg=1: (f"{sg * d['diff']:+.3f} [{min(sg * d['ci_low'], sg * d['ci_high']):+.3f}, "
                         f"{max(sg * d['ci_low'], sg * d['ci_high']):+.3f}]")
    grid = summary["lr_grid"]
    out = ["| row | " + " | ".join(f"val acc, lr {lr:g}" for lr in grid) + " | picked lr |",
           "|---|" + "---|" * (len(grid) + 1)]
    for n, v in summary["sweep_val_acc"].items():
        cells = " | ".join(f"{v[f'{lr:g}']:.3f}" if f"{lr:g}" in v else "not run" for lr in grid)
        picked = summary["picked_lr"].get(n)
        out.append(f"| {n} | {cells} | {f'{picked:g}' if picked else '-'} |")
    out += ["", "| row | lr | seeds | acc per seed | mean [95% CI] |", "|---|---|---|---|---|"]
    for r in summary["rows"]:
        seeds = ",".join(str(s) for s in r["seeds"] if s is not None) or "-"
        per = " / ".join(f"{v['acc']:.3f}" for v in r["per_seed"].values())
        lr = f"{r['lr']:g}" if r.get("lr") else "-"
        out.append(f"| {r['row']} | {lr} | {seeds} | {per} | {f(r['mean'])} |")
    out += ["", "| claim | seeds | seed-averaged [95% CI] | MDD | per seed | verdict |", "|---|---|---|---|---|---|"]
    rows = {r["row"]: r for r in summary["rows"]}
    for label, row, ref, sg in claims:
        c = rows.get(row, {}).get(f"vs_{ref}")
        if c is None:
            out.append(f"| {label} | - | not run | | | not run |")
            continue
        per = "; ".join(f"seed {sd}: {g(d, sg)}" for sd, d in c["per_seed"].items())
        out.append(f"| {label} | {','.join(map(str, c['seeds']))} | {g(c['mean'], sg)} | {c['mean']['mdd']:.3f} | "
                   f"{per} | {verdict(c, sg)} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- stage-1 bottleneck

BOTTLENECK_ARMS = {  # name -> mole.train flags; all at 8 latent tokens, stage 1 only
    "plain_latent": MAIN["plain_latent"],
    "mole": [],
    "no_esva": ["--no-esva"],
    "no_router": ["--no-router"],
    "causal_mixing": ["--latent-mixing", "causal"],
}
BOTTLENECK = dict(n_train=4800, n_val=150, n_test=500, batch_size=32, steps=100, sweep_steps=50,
                  sweep_lrs=(2e-3, 6e-3), seeds=(0, 1, 2), long_steps=300)
SWEPT = ("plain_latent", "mole")  # the ablations are MoLE minus one part: they take MoLE's lr
CELL_RE = re.compile(r"\b(" + "|".join(world.CELL_TAGS) + r") (empty|" + "|".join(world.OBJECT_NAMES) + r")\b")


def cells_of(text):
    """{cell tag: content} of a transcription "tl red circle + tc empty - ..." (first mention
    of each tag wins; tags that never appear are missing)."""
    out = {}
    for tag, content in CELL_RE.findall(text):
        out.setdefault(tag, content)
    return out


def cell_accuracy(pred, target, objects_only=False):
    """Fraction of the 9 cells whose content in `pred` equals the one in `target` (a missing
    cell counts as wrong). Both are assistant turns in the shapes format. objects_only: only
    the cells that hold an object in `target` (colour and shape must both be right)."""
    gold, got = cells_of(target), cells_of(pred)
    if objects_only:
        gold = {t: c for t, c in gold.items() if c != "empty"}
    return sum(got.get(t) == c for t, c in gold.items()) / max(len(gold), 1)


@torch.no_grad()
def cell_ce(net, recs, stage=1, batch_size=50):
    """Teacher-forced cross-entropy of the cell contents, per item: mean CE over the 9 cell
    content tokens (" empty" or an object name, one token each in the tiny tokenizer), and over
    the object cells only. Continuous, so it separates arms that greedy decoding ties (e.g. all
    writing "empty"). Returns two lists (all cells, object cells; nan for an item without objects)."""
    tok = net.proc.tokenizer
    empty = tok(" empty", add_special_tokens=False)["input_ids"]
    objs = {tok(" " + n, add_special_tokens=False)["input_ids"][0] for n in world.OBJECT_NAMES}
    assert len(empty) == 1, "cell contents must be single tokens"
    empty = empty[0]
    all_ce, obj_ce = [], []
    for i in range(0, len(recs), batch_size):
        chunk = recs[i:i + batch_size]
        imgs = [data.load_image(r["image"], r["id"]) for r in chunk]
        b = net.encode(imgs, [r["question"] for r in chunk], [r["target"] for r in chunk])
        logits = net(b, stage)["logits"][:, :-1].float()
        lab = b["labels"][:, 1:]
        ce = F.cross_entropy(logits.transpose(1, 2), lab.clamp(min=0), reduction="none")  # [B,L-1]
        is_obj = torch.zeros_like(lab, dtype=torch.bool)
        for o in objs:
            is_obj |= lab == o
        is_cell = is_obj | (lab == empty)
        for k in range(len(chunk)):
            all_ce.append(float(ce[k][is_cell[k]].mean()))
            obj_ce.append(float(ce[k][is_obj[k]].mean()) if is_obj[k].any() else float("nan"))
    return all_ce, obj_ce


def _json(path):
    with open(path) as f:
        return json.load(f)


def _bottleneck_one(name, lr, seed, steps, recs, data_dir, out_dir, base, threads, tag):
    """Train one arm in stage 1 only (resumable checkpoint), evaluate it with stage-1
    attention on `recs`, write {out_dir}/{tag}.json atomically and return it. A result
    file that exists is returned as is (the experiment resumes where it stopped)."""
    path = os.path.join(out_dir, f"{tag}.json")
    if os.path.exists(path):
        return _json(path)
    cfg = BOTTLENECK
    n_train = min(steps * cfg["batch_size"], cfg["n_train"])  # one epoch of fresh examples when they suffice
    epochs = steps * cfg["batch_size"] / n_train
    ckpt = os.path.join(out_dir, "ckpt", tag)
    t = time.time()
    net, proc, log = mt.main(["--model", base, "--data", data_dir, "--n-train", str(n_train),
                              "--batch-size", str(cfg["batch_size"]), "--device", "cpu", "--quiet",
                              "--stage1-epochs", f"{epochs:g}", "--stage2-epochs", "0", "--lr", str(lr),
                              "--seed", str(seed),
                              "--threads", str(threads or 0), "--save-every", "25", "--resume",
                              "--out", ckpt] + BOTTLENECK_ARMS[name])
    train_s = time.time() - t
    t = time.time()
    with torch.inference_mode():
        res = mole_evaluate(net, recs, stage=1, max_new_tokens=64, desc=f"eval {tag}")
    for r, rec in zip(res, recs):
        r["cell_acc"] = cell_accuracy(r["pred"], rec["target"])
        r["obj_acc"] = cell_accuracy(r["pred"], rec["target"], objects_only=True)
    with torch.inference_mode():
        for r, c, o in zip(res, *cell_ce(net, recs, stage=1)):
            r["cell_ce"], r["obj_ce"] = c, o
    out = {"arm": name, "lr": lr, "seed": seed, "steps": steps, "train_s": train_s, "infer_s": time.time() - t,
           "ce_log": [[x["step"], x["ce"]] for x in log], "items": res}
    data.atomic_write_text(path, json.dumps(out))
    return out


def run_bottleneck(data_dir, out_dir, base="tiny-dense", threads=None, seeds=None, arms=None, phase="all"):
    """The stage-1 bottleneck experiment (pre-registered in eval/logs/mole.md).

    1. lr sweep: every arm at each of BOTTLENECK["sweep_lrs"], seed 0, sweep_steps steps,
       scored by per-cell transcription accuracy on the validation split; the best lr per arm wins.
    2. every arm at its lr for each seed, `steps` steps of stage 1 (only Z_vis read the image),
       scored on the test split: per-cell transcription accuracy and final-answer accuracy.
    Each (arm, lr/seed) result is its own atomic JSON file, so a stopped run resumes.
    phase: "sweep" (step 1 only), "main" (step 2 only; the sweeps it needs must exist) or
    "all"; two processes may share the work when they get disjoint arms / phases.
    Only the arms in SWEPT are swept; the ablations use MoLE's lr.
    Returns the summary dict (also {out_dir}/bottleneck.json)."""
    if threads:
        torch.set_num_threads(threads)
    cfg = BOTTLENECK
    seeds = list(seeds if seeds is not None else cfg["seeds"])
    arms = list(arms or BOTTLENECK_ARMS)
    world.ensure_splits(data_dir, {"train": cfg["n_train"], "val": cfg["n_val"], "test": cfg["n_test"]})
    val = data.read_llava_json(os.path.join(data_dir, "val.json"))[: cfg["n_val"]]
    test = data.read_llava_json(os.path.join(data_dir, "test.json"))[: cfg["n_test"]]
    os.makedirs(out_dir, exist_ok=True)
    lr_of, sweep = {}, {}
    swept = [a for a in SWEPT if a in arms or (phase != "sweep" and a == "mole" and set(arms) - set(SWEPT))]
    if phase in ("main", "long"):  # read the sweep results, never train them here
        missing = [f"sweep_{n}_lr{lr:g}" for n in swept for lr in cfg["sweep_lrs"]
                   if not os.path.exists(os.path.join(out_dir, f"sweep_{n}_lr{lr:g}.json"))]
        if missing:
            raise SystemExit(f"error: --phase main needs the sweep results {missing}; run --phase sweep first")
    for name in swept:
        for lr in cfg["sweep_lrs"]:
            r = _bottleneck_one(name, lr, 0, cfg["sweep_steps"], val, data_dir, out_dir, base, threads,
                                f"sweep_{name}_lr{lr:g}")
            sweep.setdefault(name, {})[f"{lr:g}"] = sum(x["cell_acc"] for x in r["items"]) / len(r["items"])
            print(f"[bottleneck] sweep {name} lr {lr:g}: val cell acc {sweep[name][f'{lr:g}']:.3f}", flush=True)
        lr_of[name] = float(max(sweep[name], key=sweep[name].get))
    for name in arms:
        lr_of.setdefault(name, lr_of.get("mole"))
    if phase == "sweep":
        return sweep
    if phase == "long":  # exploratory: long_steps steps (epochs over the 4,800 training examples)
        for seed in seeds:
            for name in arms:
                r = _bottleneck_one(name, lr_of[name], seed, cfg["long_steps"], test, data_dir,
                                    os.path.join(out_dir, "long"), base, threads, f"{name}_seed{seed}")
                ce = [x["obj_ce"] for x in r["items"] if x["obj_ce"] == x["obj_ce"]]
                print(f"[bottleneck] long {name} seed {seed}: obj CE {sum(ce) / len(ce):.4f}", flush=True)
        return {}
    results = {}
    for seed in seeds:
        for name in arms:
            r = _bottleneck_one(name, lr_of[name], seed, cfg["steps"], test, data_dir, out_dir, base, threads,
                                f"{name}_seed{seed}")
            results[(name, seed)] = r
            acc = _acc(r["items"])
            cell = sum(x["cell_acc"] for x in r["items"]) / len(r["items"])
            print(f"[bottleneck] {name} seed {seed} lr {lr_of[name]:g}: cell {cell:.3f} answer {acc:.3f} "
                  f"train {r['train_s']:.0f}s", flush=True)
    return summarise_bottleneck(out_dir)


def summarise_bottleneck(out_dir):
    """Summary of whatever result files of the bottleneck experiment exist in `out_dir`
    (a partial run gives a partial summary): {out_dir}/bottleneck.json and the PNG figures."""
    sweep, lr_of, results = {}, {}, {}
    for f in sorted(os.listdir(out_dir)):
        if not re.fullmatch(r"(sweep_.*_lr[0-9.e-]+|.*_seed\d+)\.json", f):
            continue
        r = _json(os.path.join(out_dir, f))
        acc = sum(x["cell_acc"] for x in r["items"]) / len(r["items"])
        if f.startswith("sweep_"):
            sweep.setdefault(r["arm"], {})[f"{r['lr']:g}"] = acc
        else:
            results[(r["arm"], r["seed"])] = r
            lr_of[r["arm"]] = r["lr"]
    summary = bottleneck_summary(results, sweep, lr_of)
    data.atomic_write_text(os.path.join(out_dir, "bottleneck.json"), json.dumps(summary, indent=1))
    for m, what in (("cell_acc", "per-cell transcription accuracy"), ("obj_acc", "object-cell accuracy"),
                    ("answer_acc", "final-answer accuracy")):
        bar_png(summary["rows"], m, os.path.join(out_dir, f"bottleneck_{m}.png"), f"stage-1 bottleneck: {what}")
    ckpt = os.path.join(out_dir, "ckpt", "mole_seed0")
    if os.path.exists(os.path.join(ckpt, "state.json")) and os.path.exists(os.path.join(out_dir, "mole_seed0.json")):
        net, _, _ = load_mole(ckpt)
        dd = os.path.join(out_dir, "data")
        dd = dd if os.path.isdir(dd) else os.path.join(os.path.dirname(os.path.abspath(out_dir)), "data")
        rec = data.read_llava_json(os.path.join(dd, "test.json"))[0]
        routing_png(net, rec, os.path.join(out_dir, "routing_mole_seed0.png"))
    return summary


def bottleneck_summary(results, sweep, lr_of):
    """Per arm and seed: cell / answer accuracy with bootstrap CIs and the paired-bootstrap
    difference vs plain latents; per arm the mean over seeds and the range."""
    rows = []
    for (name, seed), r in results.items():
        row = {"arm": name, "seed": seed, "lr": lr_of[name], "train_s": r["train_s"]}
        for m, key in (("cell_acc", "cell_acc"), ("obj_acc", "obj_acc"), ("answer_acc", "correct"),
                       ("cell_ce", "cell_ce"), ("obj_ce", "obj_ce")):
            if key not in r["items"][0]:
                continue
            keep = [k for k, i in enumerate(r["items"]) if i[key] == i[key]]  # drop nan (no object cell)
            x = [float(r["items"][k][key]) for k in keep]
            lo, hi = bootstrap_ci(x)
            row[m] = {"value": sum(x) / len(x), "ci_low": lo, "ci_high": hi, "n": len(x)}
            for other, label in (("plain_latent", "plain"), ("mole", "mole")):
                ref = results.get((other, seed))
                if ref is None or name == other:
                    continue
                if key not in ref["items"][0]:
                    continue
                y = [float(ref["items"][k][key]) for k in keep]
                d = paired_bootstrap(x, y)
                d["sd"] = float(torch.tensor(x, dtype=torch.float64).sub(torch.tensor(y, dtype=torch.float64)).std())
                row[f"{m}_vs_{label}"] = d
        rows.append(row)
    return {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in BOTTLENECK.items()},
            "sweep_val_cell_acc": sweep, "lr": lr_of, "rows": rows}


def bar_png(rows, metric, path, title, w=640, h=360, order=None, label=14):
    """Accuracy per arm with 95% CIs (one bar per arm and seed, seeds side by side), drawn
    with Pillow. rows: [{"arm", "seed", metric: {"value","ci_low","ci_high"}}]; arms in
    `order` (default the bottleneck arms), names cut to `label` characters."""
    order = list(order or BOTTLENECK_ARMS)
    arms = sorted(dict.fromkeys(r["arm"] for r in rows), key=lambda a: order.index(a) if a in order else len(order))
    seeds = sorted({r["seed"] for r in rows})
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    left, right, top, bottom = 50, w - 10, 30, h - 40
    d.text((left, 8), title, fill="black")
    for k in range(0, 11, 2):  # y grid 0..1
        y = bottom - (bottom - top) * k / 10
        d.line([left, y, right, y], fill=(220, 220, 220))
        d.text((8, y - 6), f"{k / 10:.1f}", fill="black")
    slot = (right - left) / max(len(arms), 1)
    bw = slot * 0.8 / max(len(seeds), 1)
    shades = [(70, 110, 200), (120, 160, 230), (170, 200, 245)]
    for i, arm in enumerate(arms):
        d.text((left + i * slot + 2, bottom + 6), arm[:label], fill="black")
        for j, seed in enumerate(seeds):
            r = next((r for r in rows if r["arm"] == arm and r["seed"] == seed), None)
            if r is None:
                continue
            v = r[metric]
            x0 = left + i * slot + slot * 0.1 + j * bw
            y = lambda a: bottom - (bottom - top) * a
            d.rectangle([x0, y(v["value"]), x0 + bw - 2, bottom], fill=shades[j % len(shades)])
            xc = x0 + bw / 2 - 1
            d.line([xc, y(v["ci_low"]), xc, y(v["ci_high"])], fill="black", width=2)
    d.text((left, h - 18), "bars: seeds " + ", ".join(map(str, seeds)) + " (left to right); whiskers: 95% bootstrap CI",
           fill="black")
    with data.atomic_target(path) as tmp:
        img.save(tmp, format="PNG")


def image_dependence(out_dir, seeds=(0,), data_dir=None):
    """Does anything of the image pass the stage-1 bottleneck? For each trained arm and seed:
    teacher-forced cell / object-cell CE on the test items with their own image vs with the
    image of the next item (a wrong image of the same distribution), paired bootstrap of
    (wrong - own): > 0 with the CI above 0 means the cell predictions use the image.
    Writes {out_dir}/image_dependence.json; returns it."""
    cfg = BOTTLENECK
    test = data.read_llava_json(os.path.join(data_dir or os.path.join(out_dir, "data"), "test.json"))[: cfg["n_test"]]
    wrong = [dict(r, image=test[(i + 1) % len(test)]["image"]) for i, r in enumerate(test)]
    out = {}
    for name in BOTTLENECK_ARMS:
        for seed in seeds:
            tag = f"{name}_seed{seed}"
            if not os.path.exists(os.path.join(out_dir, f"{tag}.json")):
                continue
            net, _, _ = load_mole(os.path.join(out_dir, "ckpt", tag))
            with torch.inference_mode():
                own, wrong_ce = cell_ce(net, test), cell_ce(net, wrong)
            row = {}
            for k, label in ((0, "cell_ce"), (1, "obj_ce")):
                keep = [i for i, v in enumerate(own[k]) if v == v]
                row[label] = paired_bootstrap([wrong_ce[k][i] for i in keep], [own[k][i] for i in keep])
                row[label]["own"] = sum(own[k][i] for i in keep) / len(keep)
            out[tag] = row
            print(f"[image dependence] {tag}: obj CE own {row['obj_ce']['own']:.4f}, wrong - own "
                  f"{row['obj_ce']['diff']:+.4f} [{row['obj_ce']['ci_low']:+.4f}, {row['obj_ce']['ci_high']:+.4f}]",
                  flush=True)
    data.atomic_write_text(os.path.join(out_dir, "image_dependence.json"), json.dumps(out, indent=1))
    return out


@torch.no_grad()
def routing_png(net, rec, path, stage=1, cell=24):
    """One example's Z_vis routing over the image grid: the image (left), then one row per
    decoder layer and one column per visual expert, each a heat map over the merged visual
    tokens (3 x 3 for the 84-px shapes images) of that expert's attention (mean over heads;
    white = 0, black = the largest weight in the figure). Unrouted tokens get exactly 0."""
    img = data.load_image(rec["image"], rec["id"]).convert("RGB")
    b = net.encode([img], [rec["question"]])
    out = net(b, stage, record=True)
    st = out["pass"]
    vis = st.is_vis[0]
    gh, gw = (int(x) // net.proc.merge for x in b["image_grid_thw"][0, 1:])
    maps = [st.attn[layer][0].mean(0)[:, vis].reshape(-1, gh, gw) for layer in sorted(st.attn)]  # [E,gh,gw]
    top = max(float(m.max()) for m in maps) or 1.0
    E, n_layers = maps[0].shape[0], len(maps)
    side = gh * cell
    W = side + 20 + E * (gw * cell + 8) + 10
    H = max(side, n_layers * (side + 8)) + 40
    canvas = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(canvas)
    canvas.paste(img.resize((side, side)), (0, 30))
    d.text((0, 4), f"{rec['question'][:60]}  (rows: layers, cols: Z_vis experts)", fill="black")
    for layer, m in enumerate(maps):
        for e in range(E):
            x0, y0 = side + 20 + e * (gw * cell + 8), 30 + layer * (side + 8)
            for i in range(gh):
                for j in range(gw):
                    v = int(255 * (1 - float(m[e, i, j]) / top))
                    d.rectangle([x0 + j * cell, y0 + i * cell, x0 + (j + 1) * cell - 1, y0 + (i + 1) * cell - 1],
                                fill=(v, v, v), outline=(200, 200, 200))
    with data.atomic_target(path) as tmp:
        canvas.save(tmp, format="PNG")


def bottleneck_table(summary):
    """Markdown table of the bottleneck experiment: per arm and seed, cell and answer
    accuracy [95% CI] and the paired difference vs plain latents [95% CI]."""
    f = lambda v: f"{v['value']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]"
    g = lambda d: f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]" if d else ""
    lines = ["| arm | seed | lr | cell acc [CI] | object-cell acc [CI] | answer acc [CI] | cell vs plain [CI] | "
             "object-cell vs plain [CI] | answer vs plain [CI] | object-cell CE [CI] | object-cell CE vs plain [CI] |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(summary["rows"], key=lambda r: (list(BOTTLENECK_ARMS).index(r["arm"]), r["seed"])):
        lines.append(f"| {r['arm']} | {r['seed']} | {r['lr']:g} | {f(r['cell_acc'])} | {f(r['obj_acc'])} | "
                     f"{f(r['answer_acc'])} | {g(r.get('cell_acc_vs_plain'))} | {g(r.get('obj_acc_vs_plain'))} | "
                     f"{g(r.get('answer_acc_vs_plain'))} | {f(r['obj_ce']) if 'obj_ce' in r else ''} | "
                     f"{g(r.get('obj_ce_vs_plain'))} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- headroom setting (size family)

# The two-stage table on a task the base cannot already answer: the size family of the shapes
# world (`common.shapes.EXTRA_FAMILIES`: "Is the red circle big or small?", "How many big shapes
# are there?"), a detail the base's look step never transcribes. Same schedule, data sizes and
# per-row lr rule as the per-row-lr table; fewer rows and a two-point lr grid (budget).
HEADROOM = dict(families=("size",), n_train=FULL["n_train"], n_val=N_VAL, n_test=FULL["n_test"],
                base_max=0.70, sft_max=0.85)
HEADROOM_LOG = "eval/logs/mole.md#2026-12-02-a-mole-setting-with-headroom-size-family-and-a-stage-1-positive-control"
HEADROOM_LRS = (2e-3, 5e-3)   # the per-row-lr table's picks were all 2e-3 or 5e-3
HEADROOM_ROWS = ("sft", "plain_latent", "mole")
HEADROOM_ABLATIONS = ("no_router", "no_esva")
HEADROOM_CLAIMS = ([("H1 MoLE minus SFT (data-matched)", "mole", "sft", 1),
                    ("H2 MoLE minus plain latents (8 latents each)", "mole", "plain_latent", 1)] +
                   [(f"H3 MoLE minus MoLE with latents {k}", f"mole_{k}", "mole", -1) for k in INTERVENTIONS] +
                   [(f"{ABLATION_PART[k]} helps: MoLE minus {k}", k, "mole", -1) for k in HEADROOM_ABLATIONS])


def ensure_family_data(data_dir, sizes, families, look=True):
    """The shapes splits of `sizes` ({split: n}) drawn from `families` (answer-only targets
    unless `look`) that are missing in `data_dir`; existing split files are kept as they are."""
    for split, n in sizes.items():
        if not os.path.exists(os.path.join(data_dir, f"{split}.json")):
            world.generate_split(data_dir, split, n, families=families, look=look)


def _ci_of(items, key="correct"):
    """{"acc", "ci_low", "ci_high", "n"} of the items' `key` (bootstrap CI, eval.metrics)."""
    x = [float(i[key]) for i in items]
    lo, hi = bootstrap_ci(x)
    return {"acc": sum(x) / len(x), "ci_low": lo, "ci_high": hi, "n": len(x)}


def headroom_check(data_dir, out_dir, base="tiny-dense"):
    """The pre-registered headroom check on the validation split: the untouched base
    ({out_dir}/headroom_base_val.json, evaluated here if missing) and the SFT control at every lr
    of HEADROOM_LRS found in {out_dir}/lr_sweep; passes if the base's accuracy is at most
    HEADROOM["base_max"] and SFT's (at every lr) at most HEADROOM["sft_max"].
    Writes {out_dir}/headroom.json; returns it."""
    val = data.read_llava_json(os.path.join(data_dir, "val.json"))[: HEADROOM["n_val"]]
    path = os.path.join(out_dir, "headroom_base_val.json")
    if not os.path.exists(path):
        model, proc = bb.load_backbone(base)
        with torch.inference_mode():
            res = plain_evaluate(model, proc, val, desc="eval base (val)")
        data.atomic_write_text(path, json.dumps({"row": "base", "seed": None, "items": res}))
    out = {"base": _ci_of(_json(path)["items"]), "sft": {}, "bars": {k: HEADROOM[k] for k in ("base_max", "sft_max")}}
    for lr in HEADROOM_LRS:
        p = os.path.join(out_dir, "lr_sweep", f"sft_lr{lr:g}.json")
        if os.path.exists(p):
            out["sft"][f"{lr:g}"] = _ci_of(_json(p)["items"])
    out["passes"] = (out["base"]["acc"] <= HEADROOM["base_max"] and bool(out["sft"])
                     and all(v["acc"] <= HEADROOM["sft_max"] for v in out["sft"].values()))
    data.atomic_write_text(os.path.join(out_dir, "headroom.json"), json.dumps(out, indent=1))
    return out


def run_headroom(data_dir, out_dir, base="tiny-dense", threads=None, seeds=(0, 1, 2), deadline=None,
                 phase="all", arms=None):
    """The two-stage table on the size family (pre-registered in eval/logs/mole.md).

    phase "check": SFT at each lr of HEADROOM_LRS (seed 0, scored on the validation split) and
    `headroom_check`; nothing else. Otherwise:
    1. sweep: each row of HEADROOM_ROWS at each lr of HEADROOM_LRS, seed 0, scored on N_VAL
       validation items ({out_dir}/lr_sweep/{row}_lr{lr}.json; the checkpoint is the row's
       seed-0 checkpoint at that lr, so the picked lr's seed 0 costs inference only);
    2. `pick_lr` per row; the ablations and interventions take MoLE's;
    3. for each seed the main rows on the test split and MoLE's interventions, then for each
       seed the ablations HEADROOM_ABLATIONS; the base row on the test split.
    Every (row, lr, seed) is its own atomic file (resumable; files that exist are kept).
    arms: the rows and ablations of step 3 to run (default all; the sweep always covers every
    main row). deadline: time.time() after which no new training starts (--max-minutes). Returns `summarise_headroom`."""
    arms = list(arms or HEADROOM_ROWS + HEADROOM_ABLATIONS)
    bad = [x for x in arms if x not in HEADROOM_ROWS + HEADROOM_ABLATIONS]
    if bad:
        raise SystemExit(f"error: --arms takes {list(HEADROOM_ROWS + HEADROOM_ABLATIONS)} for --part headroom, got {bad}")
    if threads:
        torch.set_num_threads(threads)
    cfg = FULL
    ensure_family_data(data_dir, {"train": HEADROOM["n_train"], "val": HEADROOM["n_val"],
                                  "test": HEADROOM["n_test"]}, HEADROOM["families"])
    train = data.read_llava_json(os.path.join(data_dir, "train.json"))[: cfg["n_train"]]
    val = data.read_llava_json(os.path.join(data_dir, "val.json"))[: HEADROOM["n_val"]]
    test = data.read_llava_json(os.path.join(data_dir, "test.json"))[: HEADROOM["n_test"]]
    if shared_items(train, val):
        raise SystemExit(f"error: {data_dir}/val.json shares items with the training records; "
                         f"regenerate it (common.shapes.generate_split) so that it is disjoint")

    def one(name, flags, seed, recs, lr, path=None):
        tab = lr_dir(out_dir, lr)
        if not os.path.exists(path or os.path.join(tab, f"{name}_seed{seed}.json")) and late(deadline):
            print(f"[headroom] --max-minutes reached: {name} lr {lr:g} seed {seed} not run", flush=True)
            return None, None, None
        r, net, stage = _table_one(name, flags, seed, cfg, recs, data_dir, tab, base, threads,
                                   mole_evaluate, plain_evaluate, lr=lr, path=path)
        print(f"[headroom] {name} lr {lr:g} seed {seed} ({'val' if path else 'test'}): acc "
              f"{_acc(r['items']):.3f}", flush=True)
        return r, net, stage

    for name in ("sft",) if phase == "check" else HEADROOM_ROWS:
        for lr in HEADROOM_LRS:
            one(name, TABLE_MAIN[name], 0, val, lr, os.path.join(out_dir, "lr_sweep", f"{name}_lr{lr:g}.json"))
    if phase == "check":
        return headroom_check(data_dir, out_dir, base)
    sweep = read_sweep(out_dir)
    if any(len(sweep.get(n, {})) < len(HEADROOM_LRS) for n in HEADROOM_ROWS):
        print("[headroom] the sweep is incomplete: no row runs at a picked lr", flush=True)
        return summarise_headroom(out_dir)
    picked = {n: pick_lr(sweep[n]) for n in HEADROOM_ROWS}
    print(f"[headroom] picked lr: {picked}", flush=True)
    _base_row(lr_dir(out_dir, TABLE_LR), base, test, plain_evaluate)
    for seed in seeds:
        for name in [n for n in HEADROOM_ROWS if n in arms]:
            r, net, stage = one(name, TABLE_MAIN[name], seed, test, picked[name])
            if name == "mole" and r is not None:
                _interventions(lr_dir(out_dir, picked[name]), seed, net, stage, test, mole_evaluate)
    for seed in seeds:
        for name in [n for n in HEADROOM_ABLATIONS if n in arms]:
            one(name, ABLATIONS[name], seed, test, picked["mole"])
    return summarise_headroom(out_dir)


def summarise_headroom(out_dir):
    """Summary of the size-family table from whatever files exist, as `summarise_lr`: the sweep
    ({row: {lr: val acc}}), the picked lr per row, `_summary_rows` of each row at its picked lr
    (ablations and interventions at MoLE's; the base from {out_dir}/table/base.json) and the
    headroom check if it was run. Writes {out_dir}/results_headroom.json and the bar figure."""
    sweep = {n: v for n, v in read_sweep(out_dir).items() if n in HEADROOM_ROWS}
    picked = {n: pick_lr(v) for n, v in sweep.items() if len(v) == len(HEADROOM_LRS)}
    res = {}
    base_path = os.path.join(lr_dir(out_dir, TABLE_LR), "base.json")
    if os.path.exists(base_path):
        res[("base", None)] = _json(base_path)
    rows = _picked_rows(out_dir, res, picked, HEADROOM_ROWS, skip=("sft_placeholders",))
    check = os.path.join(out_dir, "headroom.json")
    out = {"config": dict(FULL, **{k: list(v) if isinstance(v, tuple) else v for k, v in HEADROOM.items()}),
           "lr_grid": list(HEADROOM_LRS), "n_val": HEADROOM["n_val"],
           "headroom_check": _json(check) if os.path.exists(check) else None,
           "sweep_val_acc": {n: {f"{lr:g}": a for lr, a in sorted(v.items())} for n, v in sweep.items()},
           "picked_lr": picked, "rows": rows}
    return _write_summary(out_dir, "results_headroom.json", out, "headroom_acc.png",
                          "size family, per-row lr picked on validation: test accuracy per row and seed", 1000)


# ----------------------------------------------------------------------------- positive control

# Stage 1 only, answer-only targets ("Answer: red") of the colour family: the answer needs one
# detail of the image (the colour of the named shape) and, in stage 1, can only get it through
# the latents. Long enough (CONTROL["steps"]) that at least one arm should leave the floor.
CONTROL = dict(families=("colour",), n_val=200, n_test=500, batch_size=32, steps=300, lrs=(6e-3,),
               seeds=(0, 1, 2), n_diag=100)
CONTROL_ARMS = {"plain_latent": MAIN["plain_latent"], "mole": [], "no_router": ABLATIONS["no_router"],
                "no_esva": ABLATIONS["no_esva"]}
CONTROL_SWEPT = ("plain_latent", "mole")   # the ablations take MoLE's lr


def swapped(recs):
    """The records with each one's image replaced by the next record's (a wrong image of the
    same distribution): the image-blind floor of a model that answers from the prior. Both
    fields are replaced, "image" and the "images" list that `mole.infer` reads."""
    out = []
    for i, r in enumerate(recs):
        nxt = recs[(i + 1) % len(recs)]
        out.append(dict(r, image=nxt["image"], images=list(nxt.get("images") or [nxt["image"]])))
    return out


@torch.no_grad()
def routing_entropy(net, recs, stage=1):
    """Mean router entropy over the visual tokens and the decoder layers, divided by log E
    (1 = uniform routing, 0 = one expert per token), of a MoLE with a router on `recs`;
    None without a router."""
    if net.routers is None:
        return None
    logits = []
    hooks = [r.register_forward_hook(lambda m, i, o: logits.append(o.float())) for r in net.routers]
    try:
        b = net.encode([data.load_image(r["image"], r["id"]) for r in recs], [r["question"] for r in recs])
        vis = net(b, stage, record=True)["pass"].is_vis  # [B,L]
    finally:
        for h in hooks:
            h.remove()
    ent = [-(p * p.clamp_min(1e-12).log()).sum(-1)[vis].mean() for p in (x.softmax(-1) for x in logits)]
    return float(torch.stack(ent).mean()) / float(torch.log(torch.tensor(float(net.cfg.n_vis))))


@torch.no_grad()
def answer_ce(net, recs, stage=1, batch_size=50):
    """Teacher-forced cross-entropy (nats) of the answer word of each record's target (its last
    token before the end token, one token for the colour words of the tiny tokenizer), per item:
    continuous, so it separates arms that all answer right (or all wrong)."""
    out = []
    for i in range(0, len(recs), batch_size):
        chunk = recs[i:i + batch_size]
        b = net.encode([data.load_image(r["image"], r["id"]) for r in chunk], [r["question"] for r in chunk],
                       [r["target"] for r in chunk])
        logits = net(b, stage)["logits"][:, :-1].float()
        lab = b["labels"][:, 1:]
        ce = F.cross_entropy(logits.transpose(1, 2), lab.clamp(min=0), reduction="none")  # [B,L-1]
        for k in range(len(chunk)):
            pos = (lab[k] != -100).nonzero().flatten()
            out.append(float(ce[k, pos[-2]]))  # the answer word; pos[-1] is the end token
    return out


def grad_norms(net, recs, stage=1):
    """Gradient norm of the training loss on `recs` (one batch) per parameter group: the
    latent embeddings, the routers, the ESVAs, the LoRA weights; and the latent rows' mean norm
    next to the token embeddings' (the init scale). The model is left as it was (eval mode,
    gradients cleared)."""
    groups = {"latent": lambda n: n == "latent", "router": lambda n: n.startswith("routers."),
              "esva": lambda n: n.startswith("esva."), "lora": lambda n: "lora_" in n}
    params = {n: p for n, p in net.named_parameters() if any(g(n) for g in groups.values())}
    was = {n: p.requires_grad for n, p in params.items()}
    for p in params.values():
        p.requires_grad_(True)
        p.grad = None
    net.train()
    try:
        b = net.encode([data.load_image(r["image"], r["id"]) for r in recs], [r["question"] for r in recs],
                       [r["target"] for r in recs])
        net(b, stage)["loss"].backward()
        out = {}
        for g, match in groups.items():
            gs = [p.grad.float().norm() ** 2 for n, p in params.items() if match(n) and p.grad is not None]
            out[g] = float(torch.stack(gs).sum().sqrt()) if gs else None
        table = net.model.get_input_embeddings().weight.detach().float()
        out["latent_row_norm"] = float(net.latent.detach().float().norm(dim=-1).mean())
        out["token_row_norm"] = float(table.norm(dim=-1).mean())
    finally:
        for n, p in params.items():
            p.grad = None
            p.requires_grad_(was[n])
        net.eval()
    return out


def _control_one(name, lr, seed, recs, split, data_dir, out_dir, base, threads, steps=None):
    """Train one arm of the positive control (stage 1 only, CONTROL["steps"] steps, resumable
    checkpoint {out_dir}/ckpt/{name}_lr{lr}_seed{seed}; a finished one is loaded, not retrained),
    evaluate it with stage-1 attention on `recs` with their own and with swapped images, and
    the diagnostics (latent similarity and attention KL x100, routing entropy, gradient norms)
    on the first CONTROL["n_diag"]; write {out_dir}/{split}_{name}_lr{lr}_seed{seed}.json
    atomically and return it (kept as is if it exists)."""
    path = os.path.join(out_dir, f"{split}_{name}_lr{lr:g}_seed{seed}.json")
    if os.path.exists(path):
        return _json(path)
    cfg = CONTROL
    steps = steps or cfg["steps"]
    t = time.time()
    net, _, log = mt.main(["--model", base, "--data", data_dir, "--n-train", str(steps * cfg["batch_size"]),
                           "--batch-size", str(cfg["batch_size"]), "--device", "cpu", "--quiet",
                           "--stage1-epochs", "1", "--stage2-epochs", "0", "--lr", f"{lr:g}", "--seed", str(seed),
                           "--threads", str(threads or 0), "--save-every", "50", "--resume",
                           "--out", os.path.join(out_dir, "ckpt", f"{name}_lr{lr:g}_seed{seed}")] + CONTROL_ARMS[name])
    train_s = time.time() - t
    t = time.time()
    with torch.inference_mode():
        own = mole_evaluate(net, recs, stage=1, max_new_tokens=8, desc=f"eval {name}")
        wrong = mole_evaluate(net, swapped(recs), stage=1, max_new_tokens=8, desc=f"eval {name} swapped")
    for r, w in zip(own, wrong):
        r["correct_swapped"], r["pred_swapped"] = w["correct"], w["pred"]
    with torch.inference_mode():
        for r, c, w in zip(own, answer_ce(net, recs), answer_ce(net, swapped(recs))):
            r["answer_ce"], r["answer_ce_swapped"] = c, w
    diag = recs[: cfg["n_diag"]]
    with torch.inference_mode():
        sim, kl = latent_stats(net, diag, stage=1)
        ent = routing_entropy(net, diag)
    out = {"arm": name, "lr": lr, "seed": seed, "split": split, "steps": len(log), "train_s": train_s,
           "steps_s": sum(x["s"] for x in log), "infer_s": time.time() - t,
           "ce_log": [[x["step"], x["ce"]] for x in log], "latent_sim_x100": sim, "attn_kl_x100": kl,
           "routing_entropy": ent, "grad_norms": grad_norms(net, diag[:32]), "items": own}
    data.atomic_write_text(path, json.dumps(out))
    return out


def run_control(data_dir, out_dir, base="tiny-dense", threads=None, seeds=None, arms=None, deadline=None, steps=None):
    """The MoLE positive control (pre-registered in eval/logs/mole.md): CONTROL_SWEPT at each lr
    of CONTROL["lrs"] (one lr, 6e-3: the stage-1 bottleneck sweep's pick for both), seed 0,
    scored on the validation split; the better lr per arm (`pick_lr`, ties to the lower lr) for
    every seed, the ablations at MoLE's; then each arm of `arms` and seed on the test split (the
    picked lr's seed-0 checkpoint is the sweep's, evaluated again).
    deadline: time.time() after which no new training starts (--max-minutes); steps: training steps (default
    CONTROL["steps"]; give another --out for another length). Returns `summarise_control`."""
    if threads:
        torch.set_num_threads(threads)
    cfg = CONTROL
    seeds = list(seeds if seeds is not None else cfg["seeds"])
    arms = list(arms or CONTROL_ARMS)
    if [a for a in arms if a not in CONTROL_ARMS]:
        raise SystemExit(f"error: --arms takes {list(CONTROL_ARMS)} for --part control, got {arms}")
    ensure_family_data(data_dir, {"train": cfg["steps"] * cfg["batch_size"], "val": cfg["n_val"],
                                  "test": cfg["n_test"]}, cfg["families"], look=False)
    val = data.read_llava_json(os.path.join(data_dir, "val.json"))[: cfg["n_val"]]
    test = data.read_llava_json(os.path.join(data_dir, "test.json"))[: cfg["n_test"]]
    os.makedirs(out_dir, exist_ok=True)

    def one(name, lr, seed, recs, split):
        ckpt_done = os.path.exists(os.path.join(out_dir, f"val_{name}_lr{lr:g}_seed{seed}.json"))
        if not os.path.exists(os.path.join(out_dir, f"{split}_{name}_lr{lr:g}_seed{seed}.json")) \
                and not ckpt_done and late(deadline):
            print(f"[control] --max-minutes reached: {name} lr {lr:g} seed {seed} not run", flush=True)
            return None
        r = _control_one(name, lr, seed, recs, split, data_dir, out_dir, base, threads, steps)
        print(f"[control] {split} {name} lr {lr:g} seed {seed}: acc {_acc(r['items']):.3f}, swapped images "
              f"{accuracy([x['correct_swapped'] for x in r['items']]):.3f}, train {r['train_s']:.0f}s", flush=True)
        return r

    sweep = {}
    for name in [a for a in CONTROL_SWEPT if a in arms or a == "mole"]:
        for lr in cfg["lrs"]:
            r = one(name, lr, 0, val, "val")
            if r is not None:
                sweep.setdefault(name, {})[lr] = _acc(r["items"])
    picked = {n: pick_lr(v, prefer=None) for n, v in sweep.items() if len(v) == len(cfg["lrs"])}
    if "mole" not in picked:
        print("[control] the sweep is incomplete: no arm runs at a picked lr", flush=True)
        return summarise_control(out_dir)
    for seed in seeds:
        for name in arms:
            one(name, picked.get(name, picked["mole"]), seed, test, "test")
    return summarise_control(out_dir)


def summarise_control(out_dir):
    """Summary of the positive control's result files that exist: the sweep (val accuracy per
    arm and lr), and per test arm and seed the accuracy with its own images and with swapped
    ones [95% CI], own minus swapped (paired bootstrap: > 0 with the CI above 0 = the arm leaves
    the image-blind floor), the difference vs plain latents, the diagnostics; per arm the seed
    mean. Writes {out_dir}/control.json; returns it."""
    sweep, res = {}, {}
    for f in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        m = re.fullmatch(r"(val|test)_(.+)_lr([0-9.e-]+)_seed(\d+)\.json", f)
        if not m:
            continue
        r = _json(os.path.join(out_dir, f))
        if m.group(1) == "val":
            sweep.setdefault(r["arm"], {})[f"{r['lr']:g}"] = _acc(r["items"])
        else:
            res[(r["arm"], r["seed"])] = r
    corr = lambda r, k="correct": [float(x[k]) for x in r["items"]]
    rows = []
    for (name, seed), r in sorted(res.items(), key=lambda kv: (list(CONTROL_ARMS).index(kv[0][0]), kv[0][1])):
        row = {"arm": name, "seed": seed, "lr": r["lr"], "steps": r["steps"], "train_s": r["train_s"],
               "own": _ci_of(r["items"]), "swapped": _ci_of(r["items"], "correct_swapped"),
               "own_minus_swapped": paired_bootstrap(corr(r), corr(r, "correct_swapped")),
               "answer_ce": _ci_of(r["items"], "answer_ce") if "answer_ce" in r["items"][0] else None,
               "ce_swapped_minus_own": paired_bootstrap(corr(r, "answer_ce_swapped"), corr(r, "answer_ce"))
               if "answer_ce" in r["items"][0] else None,
               "end_ce": sum(c for _, c in r["ce_log"][-10:]) / len(r["ce_log"][-10:])}
        for k in ("latent_sim_x100", "attn_kl_x100", "routing_entropy", "grad_norms"):
            row[k] = r.get(k)
        ref = res.get(("plain_latent", seed))
        if ref is not None and name != "plain_latent":
            row["vs_plain"] = paired_bootstrap(corr(r), corr(ref))
            if row["answer_ce"] is not None and "answer_ce" in ref["items"][0]:
                row["ce_vs_plain"] = paired_bootstrap(corr(r, "answer_ce"), corr(ref, "answer_ce"))
        rows.append(row)
    claims, claims_ce, floor = {}, {}, {}
    for name in CONTROL_ARMS:  # leaves the floor: own minus swapped images, per seed and seed-averaged
        seeds = sorted(sd for (n, sd) in res if n == name)
        if seeds:
            a = [sum(v) / len(v) for v in zip(*(corr(res[(name, sd)]) for sd in seeds))]
            b = [sum(v) / len(v) for v in zip(*(corr(res[(name, sd)], "correct_swapped") for sd in seeds))]
            m = two_level_bootstrap([corr(res[(name, sd)]) for sd in seeds],
                                    [corr(res[(name, sd)], "correct_swapped") for sd in seeds])
            d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
            m["sd"], m["mdd"] = float(d.std()), 2.8 * float(d.std()) / len(a) ** 0.5
            floor[name] = {"per_seed": {str(sd): next(x["own_minus_swapped"] for x in rows if x["arm"] == name
                                                      and x["seed"] == sd) for sd in seeds},
                           "mean": m, "seeds": seeds}
    for name in CONTROL_ARMS:
        if name == "plain_latent":
            continue
        for key, row_key, into in (("correct", "vs_plain", claims), ("answer_ce", "ce_vs_plain", claims_ce)):
            both = sorted(sd for (n, sd) in res if n == name and ("plain_latent", sd) in res
                          and key in res[(n, sd)]["items"][0] and key in res[("plain_latent", sd)]["items"][0])
            if not both:
                continue
            a = [sum(v) / len(v) for v in zip(*(corr(res[(name, sd)], key) for sd in both))]
            b = [sum(v) / len(v) for v in zip(*(corr(res[("plain_latent", sd)], key) for sd in both))]
            m = two_level_bootstrap([corr(res[(name, sd)], key) for sd in both],
                                    [corr(res[("plain_latent", sd)], key) for sd in both])
            d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
            m["sd"], m["mdd"] = float(d.std()), 2.8 * float(d.std()) / len(a) ** 0.5
            into[name] = {"per_seed": {str(sd): next(x[row_key] for x in rows if x["arm"] == name
                                                     and x["seed"] == sd) for sd in both},
                          "mean": m, "seeds": both}
    out = {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in CONTROL.items()},
           "sweep_val_acc": sweep, "rows": rows, "floor": floor, "vs_plain": claims, "ce_vs_plain": claims_ce}
    os.makedirs(out_dir, exist_ok=True)
    data.atomic_write_text(os.path.join(out_dir, "control.json"), json.dumps(out, indent=1))
    bars = [{"arm": r["arm"], "seed": r["seed"], "acc": {"value": r["own"]["acc"], "ci_low": r["own"]["ci_low"],
                                                        "ci_high": r["own"]["ci_high"]}} for r in rows]
    if bars:
        bar_png(bars, "acc", os.path.join(out_dir, "control_acc.png"),
                "positive control (stage 1, colour, answer only): test accuracy per arm and seed",
                order=list(CONTROL_ARMS))
    return out


def control_markdown(summary):
    """Markdown of the positive control (`summarise_control`): per arm and seed the accuracy with
    own / swapped images, own minus swapped, vs plain latents, and the diagnostics; then the
    seed-averaged comparison with plain latents and its verdict (`verdict`)."""
    f = lambda v: f"{v['acc']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]"
    g = lambda d: f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]" if d else ""
    n = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"
    h = lambda v: f"{v['acc']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]" if v else "-"
    out = ["| arm | seed | lr | acc, own image [CI] | acc, swapped image [CI] | own minus swapped [CI] | "
           "vs plain latents [CI] | answer-word CE [CI] | CE swapped minus own [CI] | CE vs plain [CI] | "
           "latent sim x100 | attn KL x100 | routing entropy / log E | grad norm latent / router / ESVA / LoRA |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        gn = r["grad_norms"] or {}
        grads = " / ".join("-" if gn.get(k) is None else f"{gn[k]:.2g}" for k in ("latent", "router", "esva", "lora"))
        out.append(f"| {r['arm']} | {r['seed']} | {r['lr']:g} | {f(r['own'])} | {f(r['swapped'])} | "
                   f"{g(r['own_minus_swapped'])} | {g(r.get('vs_plain'))} | {h(r.get('answer_ce'))} | "
                   f"{g(r.get('ce_swapped_minus_own'))} | {g(r.get('ce_vs_plain'))} | "
                   f"{n(r['latent_sim_x100'])} | {n(r['attn_kl_x100'])} | {n(r['routing_entropy'], 3)} | {grads} |")
    out += ["", "| claim | seeds | seed-averaged [95% CI] | MDD | verdict |", "|---|---|---|---|---|"]
    for name, c in summary["vs_plain"].items():
        out.append(f"| {name} minus plain latents | {','.join(map(str, c['seeds']))} | {g(c['mean'])} | "
                   f"{c['mean']['mdd']:.3f} | {verdict(c)} |")
    for name, c in summary.get("ce_vs_plain", {}).items():
        out.append(f"| answer CE: {name} minus plain latents (lower is better) | {','.join(map(str, c['seeds']))} | "
                   f"{g(c['mean'])} | {c['mean']['mdd']:.3f} | {verdict(c, -1)} |")
    return "\n".join(out)


def _verdict_words(cmp, sign=1):
    """(words, criterion) of one comparison for the result rows: both are the one verdict rule's
    word (`verdict`: two-level CI excludes 0 and every seed shares the sign)."""
    v = verdict(cmp, sign)
    return v, v


def majority_per_form(recs):
    """The image-blind answer to each record: the most frequent answer among the records of its
    question form (the question with every object name, colour and size word replaced by "X";
    ties to the answer seen first)."""
    words = sorted(world.OBJECT_NAMES + list(world.COLOURS) + list(world.SIZE_WORDS.values()) + list(world.SHAPES),
                   key=len, reverse=True)
    pat = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")s?\b")
    form = [pat.sub("X", r["question"]) for r in recs]
    counts = {}
    for f, r in zip(form, recs):
        counts.setdefault(f, {}).setdefault(r["answer"], 0)
        counts[f][r["answer"]] += 1
    best = {f: max(c, key=c.get) for f, c in counts.items()}
    return [best[f] for f in form]


SHORT_LABELS = {"plain_latent": "plain latents", "mole": "MoLE", "no_router": "w/o router", "no_esva": "w/o ESVA"}
ROW_LABELS = {"base": "base (untouched)", "sft": "SFT (LoRA, same data)", "plain_latent": "plain latents (8)",
              "mole": "MoLE (E = S = 4, K = 2)", "no_router": "w/o router (and L_div)", "no_esva": "w/o ESVA",
              "mole_random": "MoLE, latents random", "mole_shuffle": "MoLE, latents shuffled",
              "mole_mask": "MoLE, latent KV masked"}


def export_headroom(out_dir, results_dir, log_anchor):
    """The size-family table's committed result files from `summarise_headroom(out_dir)`:
    {results_dir}/headroom.json (eval.report rows: per row the seed-mean accuracy and each seed's,
    kind "acc"; each HEADROOM_CLAIMS comparison, kind "claim", with its verdict) and
    {results_dir}/headroom_per_question.json (per row and seed the per-item correctness on the
    test items, in the test split's order, for a seed + item bootstrap)."""
    s = summarise_headroom(out_dir)
    src = (f"python -m eval.toys.mole --part headroom --threads 1 (out/mole/headroom/results_headroom.json and "
           f"the per-row files; --phase summary rebuilds it)")
    rows = []
    for r in s["rows"]:
        lr = f"{r['lr']:g}" if r.get("lr") else "-"
        seeds = ",".join(str(x) for x in r["seeds"] if x is not None) or "-"
        rows.append({"kind": "acc", "row": r["row"], "label": ROW_LABELS.get(r["row"], r["row"]), "seed": "pooled",
                     "lr": lr, "seeds": seeds,
                     "value": r["mean"]["acc"], "ci_low": r["mean"]["ci_low"], "ci_high": r["mean"]["ci_high"],
                     "per_seed": " / ".join(f"{v['acc']:.3f}" for v in r["per_seed"].values())})
        for sd, v in r["per_seed"].items():
            rows.append({"kind": "acc", "row": r["row"], "seed": sd, "lr": lr, "value": v["acc"],
                         "ci_low": v["ci_low"], "ci_high": v["ci_high"], "n": v["n"]})
    by = {r["row"]: r for r in s["rows"]}
    for label, row, ref, sg in HEADROOM_CLAIMS:
        c = by.get(row, {}).get(f"vs_{ref}")
        if c is None:
            rows.append({"kind": "claim", "claim": label, "verdict": "not run", "seeds": 0, "log": log_anchor})
            continue
        words, crit = _verdict_words(c, sg)
        m = c["mean"]
        lo, hi = sorted((sg * m["ci_low"], sg * m["ci_high"]))
        rows.append({"kind": "claim", "claim": label, "verdict": words, "criterion_verdict": crit,
                     "effect": f"{sg * m['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]", "mdd": m["mdd"],
                     "seeds": len(c["seeds"]), "per_seed": "; ".join(
                         f"{sg * d['diff']:+.3f}" for d in c["per_seed"].values()), "log": log_anchor,
                     # the main registered claims (H1, H2) lead the top README's claims table
                     "method": "MoLE", "top": label.startswith(("H1 ", "H2 "))})
    hc = s.get("headroom_check") or {}
    for what, v in [("base", hc.get("base"))] + [(f"sft lr {lr}", x) for lr, x in hc.get("sft", {}).items()]:
        if v:
            rows.append({"kind": "headroom_check", "row": what, "value": v["acc"], "ci_low": v["ci_low"],
                         "ci_high": v["ci_high"], "n": v["n"]})
    test_path = os.path.join(out_dir, "data", "test.json")
    if os.path.exists(test_path):  # the image-blind reference: each question form's most frequent answer
        test = data.read_llava_json(test_path)[: HEADROOM["n_test"]]
        x = [float(r["answer"] == blind) for r, blind in zip(test, majority_per_form(test))]
        lo, hi = bootstrap_ci(x)
        rows.append({"kind": "acc", "row": "image_blind", "seed": "pooled", "lr": "-", "seeds": "-",
                     "label": "each question form's most frequent answer (image-blind)",
                     "value": sum(x) / len(x), "ci_low": lo, "ci_high": hi})
    for n, v in s["sweep_val_acc"].items():
        for lr, a in v.items():
            rows.append({"kind": "sweep", "row": n, "lr": lr, "value": a, "picked": s["picked_lr"].get(n) == float(lr)})
    os.makedirs(results_dir, exist_ok=True)
    data.atomic_write_text(os.path.join(results_dir, "headroom.json"), json.dumps(
        {"experiment": "MoLE two-stage table on the size family (headroom setting)", "source": src,
         "config": s["config"], "picked_lr": s["picked_lr"], "rows": rows}, indent=1) + "\n")
    per_q, ids = {}, None
    for (name, lr) in [(r["row"], r.get("lr")) for r in s["rows"]]:
        d = lr_dir(out_dir, lr) if lr else lr_dir(out_dir, TABLE_LR)
        for f in sorted(os.listdir(d)):
            m = re.fullmatch(re.escape(name) + r"_seed(\d+)\.json|base\.json" if name == "base" else
                             re.escape(name) + r"_seed(\d+)\.json", f)
            if m:
                items = _json(os.path.join(d, f))["items"]
                ids = ids or [x.get("id") for x in items]
                per_q[f"{name}/seed{m.group(1)}" if m.group(1) else name] = [int(x["correct"]) for x in items]
    data.atomic_write_text(os.path.join(results_dir, "headroom_per_question.json"), json.dumps(
        {"experiment": "MoLE size-family table: per-question correctness (test items, in order) per row and seed",
         "source": src, "rows": [{"arm": k, "accuracy": sum(v) / len(v), "n": len(v)} for k, v in per_q.items()],
         "ids": ids, "correct": per_q}) + "\n")
    return rows


def export_control(out_dir, results_dir, log_anchor):
    """The positive control's committed result files from `summarise_control(out_dir)`:
    {results_dir}/control.json (eval.report rows: per arm and seed the accuracy with own and
    swapped images, own minus swapped, vs plain latents and the diagnostics, kind "arm"; per
    non-plain arm the seed-averaged comparison with plain latents, kind "claim") and
    {results_dir}/control_per_question.json (per arm and seed the per-item correctness with own
    and with swapped images, test items in order)."""
    s = summarise_control(out_dir)
    steps = sorted({r["steps"] for r in s["rows"]})
    extra = "" if steps in ([], [CONTROL["steps"]]) else f" --steps {','.join(map(str, steps))} --out {out_dir}"
    src = (f"python -m eval.toys.mole --part control --threads 1{extra} ({out_dir}/control.json; --phase summary "
           f"rebuilds it)")
    f = lambda v: f"{v['acc']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]"
    g = lambda d: f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]" if d else None
    rows = []
    for r in s["rows"]:
        gn = r["grad_norms"] or {}
        rows.append({"kind": "arm", "arm": r["arm"], "label": ROW_LABELS.get(r["arm"], r["arm"]), "seed": r["seed"], "lr": f"{r['lr']:g}", "steps": r["steps"],
                     "own": f(r["own"]), "swapped": f(r["swapped"]), "own_minus_swapped": g(r["own_minus_swapped"]),
                     "leaves_floor": r["own_minus_swapped"]["ci_low"] > 0, "vs_plain": g(r.get("vs_plain")),
                     "value": r["own"]["acc"], "ci_low": r["own"]["ci_low"], "ci_high": r["own"]["ci_high"],
                     "end_ce": round(r["end_ce"], 3), "latent_sim_x100": r["latent_sim_x100"],
                     "answer_ce": f(r["answer_ce"]) if r.get("answer_ce") else None,
                     "ce_swapped_minus_own": g(r.get("ce_swapped_minus_own")), "ce_vs_plain": g(r.get("ce_vs_plain")),
                     "attn_kl_x100": r["attn_kl_x100"], "routing_entropy": r["routing_entropy"],
                     "grad": " / ".join("-" if gn.get(k) is None else f"{gn[k]:.2g}"
                                        for k in ("latent", "router", "esva", "lora")), **{f"grad_{k}": v for k, v in gn.items()}})
    for name, c in s.get("floor", {}).items():
        words, crit = _verdict_words(c)
        m = c["mean"]
        rows.append({"kind": "claim", "main": True, "claim": f"{SHORT_LABELS.get(name, name)} leaves the floor",
                     "verdict": words, "criterion_verdict": crit, "effect": g(m), "mdd": m["mdd"],
                     "seeds": len(c["seeds"]), "log": log_anchor})
    for name, c in s["vs_plain"].items():
        words, crit = _verdict_words(c)
        m = c["mean"]
        rows.append({"kind": "claim", "main": True, "claim": f"{SHORT_LABELS.get(name, name)} minus plain latents, accuracy",
                     "verdict": words, "criterion_verdict": crit, "effect": g(m), "mdd": m["mdd"],
                     "seeds": len(c["seeds"]), "log": log_anchor})
    for name, c in s.get("ce_vs_plain", {}).items():  # secondary: lower answer-word CE is better (sign -1)
        words, crit = _verdict_words(c, -1)
        m = c["mean"]
        rows.append({"kind": "claim", "main": False, "claim": f"{SHORT_LABELS.get(name, name)} minus plain latents, answer CE "
                                               f"(lower is better; secondary)",
                     "verdict": words, "criterion_verdict": crit, "effect": g(m) + " nats", "mdd": m["mdd"],
                     "seeds": len(c["seeds"]), "log": log_anchor})
    os.makedirs(results_dir, exist_ok=True)
    data.atomic_write_text(os.path.join(results_dir, "control.json"), json.dumps(
        {"experiment": f"MoLE stage-1 positive control (colour family, answer only, {'/'.join(map(str, steps))} steps)",
         "source": src,
         "config": s["config"], "sweep_val_acc": s["sweep_val_acc"], "rows": rows}, indent=1) + "\n")
    per_q, ids = {}, None
    for fn in sorted(os.listdir(out_dir)):
        m = re.fullmatch(r"test_(.+)_lr([0-9.e-]+)_seed(\d+)\.json", fn)
        if m:
            items = _json(os.path.join(out_dir, fn))["items"]
            ids = ids or [x.get("id") for x in items]
            per_q[f"{m.group(1)}/seed{m.group(3)}"] = {"own": [int(x["correct"]) for x in items],
                                                       "swapped": [int(x["correct_swapped"]) for x in items]}
    data.atomic_write_text(os.path.join(results_dir, "control_per_question.json"), json.dumps(
        {"experiment": "MoLE positive control: per-question correctness (test items, in order), own and swapped images",
         "source": src, "rows": [{"arm": k, "accuracy": sum(v["own"]) / len(v["own"]), "n": len(v["own"])}
                                 for k, v in per_q.items()], "ids": ids, "correct": per_q}) + "\n")
    return rows


# ----------------------------------------------------------------------------- position shift

@torch.no_grad()
def position_shift(data_dir, n=64, base="tiny-dense", stage=2, n_lat=8):
    """Answer cross-entropy of the untouched base on n validation items (stage-2 attention:
    every row may read the image) under four inputs, to separate the two effects of inserting
    n_lat untrained latent tokens before the assistant header:
      none      the plain prompt (no latents)
      latents   latents inserted (header and answer at positions shifted by n_lat)
      hidden    latents inserted but masked from every row after them (positions still shifted)
      kept_pos  latents inserted and visible, header and answer at their no-latent positions
    CE = mean over the assistant-turn tokens (answer + <|im_end|>), as in training.
    The latents are plain causal tokens (no router / ESVA), as in the plain-latent arm.
    Returns {condition: CE}."""
    model, proc = bb.load_backbone(base)
    model.eval()
    world.ensure_splits(data_dir, {"val": n})
    recs = data.read_llava_json(os.path.join(data_dir, "val.json"))[:n]
    imgs = [data.load_image(r["image"], r["id"]) for r in recs]
    qs, ts = [r["question"] for r in recs], [r["target"] for r in recs]
    out = {"none": float(model(**proc.encode(imgs, qs, ts)).loss)}
    mole = MoLE(model, proc, MoLEConfig(n_vis=n_lat, n_sum=0, router=False, esva=False, latent_mixing="causal"))
    batch = mole.encode(imgs, qs, ts)
    ids, am = batch["input_ids"], batch["attention_mask"]
    types = mole.token_types(ids, am)
    latent = (types == ZVIS) | (types == ZSUM)
    after = latent.long().cumsum(1).eq(n_lat) & ~latent  # rows after the last latent
    pos = mole.positions(batch)
    for cond in ("latents", "hidden", "kept_pos"):
        mask = topology_mask(types, stage, mole.cfg)
        p = pos
        if cond == "hidden":
            mask = mask & ~(after[:, None, :, None] & latent[:, None, None, :])
        if cond == "kept_pos":
            p = pos - n_lat * after[None].long()
        st = MoLEPass(mole, types, mole.zvis_positions(ids))
        logits = mole.model(inputs_embeds=mole.embed(ids), attention_mask=mask, position_ids=p,
                            pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                            mole=st).logits
        lab = batch["labels"][:, 1:]
        out[cond] = float(F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), lab.reshape(-1),
                                          ignore_index=-100))
    return out


def main(argv=None):
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--quick", action="store_true", help="main rows only, small budget (~3 CPU minutes)")
    p.add_argument("--part", default="full", choices=("full", "bottleneck", "shift", "headroom", "control"),
                   help="full: the two-stage table; bottleneck: the stage-1 bottleneck experiment (mole/README.md); "
                        "headroom: the two-stage table on the size family (--phase check: only the headroom check); "
                        "control: the stage-1 positive control (eval/logs/mole.md)")
    p.add_argument("--seeds", default="", help="comma-separated seeds (full: default 0,1; bottleneck: default 0,1,2)")
    p.add_argument("--arms", default="", help="bottleneck, headroom, control: comma-separated arms (default all)")
    p.add_argument("--phase", default="all",
                   choices=("all", "sweep", "main", "summary", "image", "long", "lr", "lr-summary", "lr-fixed", "data",
                            "check"),
                   help="bottleneck: lr sweep only, main runs only (sweeps must exist), both, or only summarise "
                        "the result files that exist (summary also for the full table); full: lr = the table "
                        "with a per-row lr picked on a validation split (sweep, then --seeds in that order, "
                        "default 2,0,1), lr-summary = only summarise it, data = only the data and the base row (then "
                        "one process per --seeds may share --out), lr-fixed = exploratory: --rows at one --lr)")
    p.add_argument("--lr", type=float, default=None, help="--phase lr-fixed: the learning rate of every row")
    p.add_argument("--rows", default="", help="--phase lr-fixed: comma-separated main rows (sft, sft_placeholders, "
                                              "plain_latent, mole)")
    p.add_argument("--max-minutes", type=number(float, above=0), default=None,
                   help="--phase lr, --part headroom / control: start no new training run after this many minutes "
                        "(what is done is summarised; rerun the same command to continue)")
    p.add_argument("--steps", type=number(min=1), default=None,
                   help="--part control: training steps (default 300); use another --out for another length")
    p.add_argument("--results", default=None,
                   help="--part headroom / control --phase summary: also write the committed result files "
                        "(eval.report format) into this folder, e.g. eval/results/mole")
    p.add_argument("--data", default="out/data", help="shapes data directory (generated if missing)")
    p.add_argument("--out", default="out/mole", help="output directory (results.json, checkpoints)")
    p.add_argument("--model", default="tiny-dense", help="base VLM (checkpoint directory or tiny-dense)")
    add_threads(p)
    a = p.parse_args(argv)
    threads = set_threads(a.threads, a.model)  # passed on to every mole.train run
    deadline = None if a.max_minutes is None else time.time() + 60 * a.max_minutes  # a run-length limit
    if a.max_minutes is not None and not (a.part in ("headroom", "control") or a.phase == "lr"):
        p.error("--max-minutes goes with --phase lr or --part headroom / control")
    if a.part == "shift":
        out = a.out if a.out != "out/mole" else "out/mole/bottleneck"
        dd = a.data if a.data != "out/data" else os.path.join(out, "data")
        res = position_shift(dd, base=a.model)
        data.atomic_write_text(os.path.join(out, "position_shift.json"), json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    if a.part in ("headroom", "control"):
        out = a.out if a.out != "out/mole" else f"out/mole/{a.part}"
        dd = a.data if a.data != "out/data" else os.path.join(out, "data")
        allowed = ("all", "check", "summary") if a.part == "headroom" else ("all", "summary")
        if a.phase not in allowed:
            p.error(f"--part {a.part} takes --phase {', '.join(allowed)}, got {a.phase}")
        seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else None
        if a.results and a.phase != "summary":
            p.error("--results goes with --phase summary")
        if a.results:  # the committed result files (eval/results/mole/), from the files that exist
            export = export_control if a.part == "control" else export_headroom
            export(out, a.results, HEADROOM_LOG)
        if a.part == "control":
            s = summarise_control(out) if a.phase == "summary" else run_control(
                dd, out, base=a.model, threads=threads, seeds=seeds, arms=a.arms.split(",") if a.arms else None,
                deadline=deadline, steps=a.steps)
            print(control_markdown(s))
            return
        if a.phase == "summary":
            s = summarise_headroom(out)
        else:
            s = run_headroom(dd, out, base=a.model, threads=threads, seeds=seeds or (0, 1, 2), deadline=deadline,
                             phase=a.phase, arms=a.arms.split(",") if a.arms else None)
        print(json.dumps(s, indent=1) if a.phase == "check" else lr_markdown(s, HEADROOM_CLAIMS))
        return
    if a.part == "bottleneck":
        out = a.out if a.out != "out/mole" else "out/mole/bottleneck"
        dd = a.data if a.data != "out/data" else os.path.join(out, "data")
        if a.phase in ("lr", "lr-summary", "lr-fixed", "data"):
            p.error(f"--phase {a.phase} is for the full table (--part full)")
        if a.phase == "summary":
            print(bottleneck_table(summarise_bottleneck(out)))
            return
        if a.phase == "image":  # exploratory: do the cell predictions depend on the image at all?
            image_dependence(out, seeds=[int(x) for x in a.seeds.split(",")] if a.seeds else (0,), data_dir=dd)
            return
        s = run_bottleneck(dd, out, base=a.model, threads=threads,
                           seeds=[int(x) for x in a.seeds.split(",")] if a.seeds else None,
                           arms=a.arms.split(",") if a.arms else None, phase=a.phase)
        print(bottleneck_table(s) if a.phase not in ("sweep", "long") else s)
        return
    if a.phase == "summary":
        print(table(summarise_table(a.out, a.quick, a.data)))
        return
    if a.phase == "lr-fixed":
        if a.lr is None or not a.rows or not a.seeds:
            p.error("--phase lr-fixed needs --lr, --rows and --seeds")
        rows = run_fixed_lr(a.data, a.out, a.lr, a.rows.split(","), [int(x) for x in a.seeds.split(",")],
                            base=a.model, threads=threads)
        print(json.dumps(rows, indent=1))
        return
    if a.phase in ("lr", "lr-summary"):
        if a.quick:
            p.error("--phase lr is the full table's lr sweep; it has no --quick mode")
        s = (summarise_lr(a.out, a.data) if a.phase == "lr-summary" else
             run_lr(a.data, a.out, base=a.model, threads=threads, deadline=deadline,
                    seeds=[int(x) for x in a.seeds.split(",")] if a.seeds else (2, 0, 1)))
        print(lr_markdown(s))
        return
    if a.phase not in ("all", "data"):
        p.error(f"--phase {a.phase} is for --part bottleneck; the full table takes all, data, summary, lr, lr-summary")
    s = run(a.quick, a.data, a.out, base=a.model, threads=threads, phase=a.phase,
            seeds=[int(x) for x in a.seeds.split(",")] if a.seeds else (0, 1))
    if s is None:
        print(f"[toy_mole] data in {a.data} and the base row in {a.out}/table are ready")
        return
    print(table(s))


if __name__ == "__main__":
    main()
