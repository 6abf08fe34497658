"""MoD end-to-end debate part with headroom (design in eval/logs/mod.md).

Differences from the e2e toy in `eval/toys/mod.py`, each answering a point of the review:
  * responses are sampled on the JSON prompt (`mod.data.single_prompt`), where `tiny-chat` errs
    (0.787 on the test questions, below the 0.85 headroom bar), K = 8 per question;
  * the category mix is drawn with quotas (`balanced_mix`): each category's count is its share
    of `--ratios`, questions drawn among those that can form it, so the realised mix is the asked
    one (printed, stored) instead of 87 / 7.5 / 6 %;
  * misled **in distribution**: the prior is one of the base's own wrong answers to that test
    question (sampled the same way), scored on the questions that have one; out of distribution:
    another scene's response (`mod.data.wrong_response`), as before;
  * MoE-LoRA routes per token (the paper's baseline); MoD-Multi with 2 (and 3) rounds;
  * the data-mix ablation of the paper's Table 2 on MoD: T_pos only / T_pos + T_rev / all three
    (the subsets of the one 1:1:1 sample set, same steps).

Every (arm, seed) writes OUT/debate/<arm>_s<seed>/scores.json atomically after training and
scoring, and is skipped when present: an interrupted run resumes where it stopped; MoD-Multi
rounds missing from a MoD folder are scored from its saved adapters. The report (results.json,
figures) covers every (arm, seed) on disk: per seed, and the mean over seeds with paired
comparisons (`report`).

    python -m eval.toys.mod --part debate --threads 1
    python -m eval.toys.mod --part debate --threads 1 --debate-arms MoD,MoE-LoRA --debate-seeds 2 \
        --debate-rounds 2,3

Per-arm learning rate (`run_lr`, after the above): MoD and MoE-LoRA token each train at every
lr of a small grid (seed 0), are scored on validation questions of the shapes "val" split
(`val_questions`), the lr with the best mean of validation single-round and misled-in-distribution
accuracy is picked (`pick_lr`), then the seeds train / score at the picks on the test questions
-> OUT/debate/lr/results.json and figures:

    python -m eval.toys.mod --part debate-lr --debate-seeds 0,1,2 --threads 1
"""
import copy
import json
import os
import random
import time
from collections import Counter

import numpy as np
import torch

from common import shapes
from common.backbone import load_backbone
from common.cli import late
from common.data import atomic_write_text, read_llava_json
from eval.evaluate import family_rows
from eval.metrics import bootstrap_ci, paired_bootstrap, two_level_bootstrap
from eval.metrics import verdict as verdict_rule
from eval.plots import bar_ci_png, line_png
from eval.toys.mod_claims import save_runs
from mod import data as vs
from mod.infer import misled, mod_debate, plain, run_rounds, _results, summarize
from mod.model import AdapterConfig, attach, load_adapters, num_trainable, save_adapters
from mod.train import TrainConfig, fit

# arm -> (folder name under OUT/debate, AdapterConfig kwargs); parameter counts as the e2e toy's
MOELORA = dict(method="moelora", num_experts=4, expert_rank=4, r=2, lora_alpha=4.0)
# An optional third entry restricts the training data to those categories of the 1:1:1 mix
# (the paper's Table 2 ablation: T_pos only, T_pos + T_rev, all three = the "MoD" arm).
ARMS = {"MoD": ("MoD", dict(method="mod")),
        "MoE-LoRA token": ("MoE-LoRA", MOELORA),
        "LoRA r=17 (matched)": ("LoRA", dict(method="lora", r=17, lora_alpha=34.0)),
        # LoRA at MoD's rank r (top-r = 4 rank-1 experts per pool), alpha / r = 2 as every arm: 14,336 params
        "LoRA r=4 (rank r)": ("LoRA_r4", dict(method="lora", r=4, lora_alpha=8.0)),
        "MoD shared router": ("MoD_shared", dict(method="mod", shared_router=True)),
        "MoE-LoRA window": ("MoE-LoRA_window", dict(MOELORA, granularity="window")),
        "MoD T_pos only": ("MoD_pos", dict(method="mod"), ("pos",)),
        "MoD T_pos+T_rev": ("MoD_pos_rev", dict(method="mod"), ("pos", "rev"))}
SLUGS = {v[0]: k for k, v in ARMS.items()}
# arms / seeds: what `run` trains and scores when missing (None = every arm; every (arm, seed)
# already on disk is reported either way); rounds: MoD-Multi rounds scored for the "MoD" arm.
SETTINGS = dict(n_train=200, n_test=300, k=8, n_samples=600, ratios=(1.0, 1.0, 1.0), max_priors=2, steps=300,
                batch_size=8, lr=2e-3, seeds=(0,), arms=None, rounds=(2,), max_new_tokens=96)
METRICS = ("single", "misled_own", "misled_ood")



def cached(path, fn):
    """json.load(path) if it exists (a finished step of a resumable run), else fn()'s result,
    written to path atomically first."""
    if os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    res = fn()
    atomic_write_text(path, json.dumps(res))
    return res

def balanced_mix(records, pools, n_samples, ratios, max_priors, seed=0):
    """LLaVA-format training records whose category counts follow `ratios` exactly (up to
    rounding): category c gets round(n_samples * ratio_c / sum) samples, each from a question
    drawn uniformly among those that can form c (T_rev / T_rob need a wrong response).
    Returns (records, Counter). Raises ValueError when a category with weight > 0 has no question."""
    rng, out, counts = random.Random(seed), [], Counter()
    total = sum(ratios)
    for cat, w in zip(vs.CATEGORIES, ratios):
        able = [i for i, (_, neg) in enumerate(pools) if vs.feasible(cat, neg, 0, max_priors)]
        n = round(n_samples * w / total)
        if n and not able:
            raise ValueError(f"no question can form T_{cat} (no wrong sample); lower its ratio")
        for j in range(n):
            i = rng.choice(able)
            r, (pos, neg) = records[i], pools[i]
            priors, target = vs.make_sample(rng, cat, pos, neg, 0, max_priors)
            counts[cat] += 1
            out.append({"id": f"{r['id']}_{cat}{j}", "image": r["image"], "family": r["family"], "answer": r["answer"],
                        "category": cat, "n_priors": len(priors),
                        "conversations": [{"from": "human", "value": "<image>\n" + vs.debate_prompt(r["question"], priors)},
                                          {"from": "gpt", "value": target}]})
    rng.shuffle(out)
    return out, counts


def json_samples(base, proc, records, k, seed):
    """K temperature-1 samples per record on the JSON prompt (where the base errs)."""
    asked = [dict(r, question=vs.single_prompt(r["question"])) for r in records]
    return vs.sample_responses(base, proc, asked, k=k, temperature=1.0, batch_size=80, seed=seed)


@torch.no_grad()
def misled_own(model, proc, records, wrong, batch_size=64, max_new_tokens=96):
    """One debate round whose only prior is the base's own wrong answer `wrong[id]` (debate JSON)."""
    t0 = time.time()
    recs = [r for r in records if r["id"] in wrong]
    fn = lambda r, h: vs.debate_prompt(r["question"], [wrong[r["id"]]])
    hist, toks = run_rounds(model, proc, recs, [fn], batch_size, max_new_tokens)
    return _results(recs, [h[-1] for h in hist], toks), time.time() - t0


def prepare(root, base, proc, train, test, S, log=print):
    """The debate part's data, made once and kept in root/prep.json: K = S["k"] JSON-prompt samples
    per training question (seed 0) -> P+ / P- pools -> the quota mix of S["n_samples"] samples
    (`balanced_mix`); 4 JSON-prompt samples per test question (seed 1), the first wrong one being
    that question's "own wrong answer" (misled in distribution). The test samples depend on the
    test set, so prep.json records its size: a prep.json made for fewer test questions than
    `test` raises ValueError (naming the fix) instead of silently scoring misled-own on a subset."""
    prep_f = os.path.join(root, "prep.json")
    if os.path.exists(prep_f):
        with open(prep_f) as f:
            prep = json.load(f)
        have = prep.get("n_test", SETTINGS["n_test"])   # prep.json files written before n_test was recorded: 300
        if have < len(test):
            raise ValueError(f"{prep_f} holds the base's own wrong answers for the first {have} test questions, "
                             f"{len(test)} asked: move it away to make a new one for {len(test)}, or pass "
                             f"--debate-test {have}")
    else:
        t = time.time()
        samples = json_samples(base, proc, train, S["k"], 0)
        pools, n_gold = vs.build_pools(train, samples)
        recs, counts = balanced_mix(train, pools, S["n_samples"], S["ratios"], S["max_priors"])
        test_samples = json_samples(base, proc, test, 4, 1)
        own_wrong = {}
        for r, ss in zip(test, test_samples):
            bad = [s for s in ss if not vs.is_correct_for(r, s)]
            if bad:
                own_wrong[r["id"]] = vs.to_json_response(bad[0])
        n_ok = sum(vs.is_correct_for(r, s) for r, ss in zip(train, samples) for s in ss)
        prep = {"train_vs": recs, "mix": {f"T_{c}": counts[c] for c in vs.CATEGORIES},
                "mix_share": {f"T_{c}": counts[c] / max(1, sum(counts.values())) for c in vs.CATEGORIES},
                "gold_filled": n_gold, "json_sample_accuracy": n_ok / (S["k"] * len(train)),
                "own_wrong": own_wrong, "n_test": len(test), "wall_s": time.time() - t}
        atomic_write_text(prep_f, json.dumps(prep))
    log(f"debate data: mix {prep['mix']} (shares {', '.join(f'{k} {v:.3f}' for k, v in prep['mix_share'].items())}), "
        f"base JSON-prompt sample accuracy {prep['json_sample_accuracy']:.3f}, gold-filled {prep['gold_filled']}, "
        f"test questions with an own wrong answer {len(prep['own_wrong'])}/{len(test)}")
    return prep


def load_data(data_dir, base_name, S):
    """The start both debate parts share: the shapes splits (generated when missing), the first
    S["n_train"] training and S["n_test"] test questions, and the frozen base.
    Returns (train, test, base, proc)."""
    shapes.ensure_splits(data_dir, {"train": max(S["n_train"], 2000), "test": max(S["n_test"], 600)})
    train = read_llava_json(os.path.join(data_dir, "train.json"))[:S["n_train"]]
    test = read_llava_json(os.path.join(data_dir, "test.json"))[:S["n_test"]]
    return train, test, *load_backbone(base_name)


def arm_records(root, prep, arm):
    """The arm's training records, written to root/train_vs[_<slug>].json and read back as
    LLaVA records: prep.json's 1:1:1 mix, or only the categories a data-mix arm names (the
    third entry of its ARMS row; the paper's Table 2 ablation)."""
    cats = (ARMS[arm] + (None,))[2]
    sub = [r for r in prep["train_vs"] if not cats or r["category"] in cats]
    path = os.path.join(root, f"train_vs_{ARMS[arm][0]}.json" if cats else "train_vs.json")
    atomic_write_text(path, json.dumps(sub))
    return read_llava_json(path)


def score_test(model, proc, test, own, base=False, metrics=METRICS):
    """The test metrics of the debate parts (`metrics`, default all three), in this order: single
    round on MoD-Single's JSON prompt (`mod_debate` with 0 rounds; the frozen base (`base`) through
    `plain` on the same prompt), misled by the base's own wrong answer `own[id]`, misled by another
    scene. Raises ValueError for a metric not in METRICS."""
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise ValueError(f"unknown test metric(s) {bad}; choose from {list(METRICS)}")
    fns = {"single": lambda: (plain(model, proc, test, json_prompt=True) if base
                              else mod_debate(model, proc, test, rounds=0))[0],
           "misled_own": lambda: misled_own(model, proc, test, own)[0], "misled_ood": lambda: misled(model, proc, test)[0]}
    with torch.inference_mode():
        return {m: fns[m]() for m in METRICS if m in metrics}


def score_rounds(load, proc, test, res, rounds, path, log=print):
    """MoD-Multi (Alg. 2) with k debate rounds for every k of `rounds` that res["results"] lacks:
    added as "multi<k>" (its wall time under "wall_s_multi"), res written to `path` atomically
    after each. `load()` returns the model with the adapters; called once, only when a k is missing."""
    todo = [k for k in rounds if f"multi{k}" not in res["results"]]
    model = load() if todo else None
    for k in todo:
        t = time.time()
        with torch.inference_mode():
            res["results"][f"multi{k}"] = mod_debate(model, proc, test, rounds=k)[0]
        res.setdefault("wall_s_multi", {})[f"multi{k}"] = time.time() - t
        atomic_write_text(path, json.dumps(res))
        log(f"  {os.path.dirname(path)}: multi{k} {summarize('m', res['results'][f'multi{k}'], 0)['accuracy']:.3f}")


def run(data_dir="out/data", out_dir="out/mod", base_name="tiny-chat", S=SETTINGS, log=print):
    """Run (or resume) the debate part -> out_dir/debate/results.json. Returns that dict."""
    t0 = time.time()
    root = os.path.join(out_dir, "debate")
    os.makedirs(root, exist_ok=True)
    train, test, base, proc = load_data(data_dir, base_name, S)
    prep = prepare(root, base, proc, train, test, S, log)
    own = prep["own_wrong"]

    def scored(name, fn):
        return cached(os.path.join(root, name, "scores.json"), fn)

    results = {"base": scored("base", lambda: {"results": score_test(base, proc, test, own, base=True),
                                               "trainable": 0})}
    arms = [SLUGS[x] for x in S["arms"]] if S.get("arms") else list(ARMS)
    for seed in S["seeds"]:
        for arm in arms:
            slug, kw = ARMS[arm][:2]
            name = f"{slug}_s{seed}"
            arm_recs = arm_records(root, prep, arm)

            def train_score(arm=arm, kw=kw, seed=seed, name=name, arm_recs=arm_recs):
                model = copy.deepcopy(base)
                torch.manual_seed(seed)
                attach(model, AdapterConfig(**kw))
                tr = fit(model, proc, arm_recs, os.path.join(root, name), TrainConfig(steps=S["steps"], batch_size=S["batch_size"],
                         lr=S["lr"], warmup=max(1, S["steps"] // 10), seed=seed), desc=f"train {name}", quiet=True)
                save_adapters(model, os.path.join(root, name))
                out = score_test(model.eval(), proc, test, own)
                log(f"  {name}: loss {tr['loss']:.3f}, " + ", ".join(
                    f"{k} {summarize(k, v, 0)['accuracy']:.3f}" for k, v in out.items()))
                return {"results": out, "trainable": num_trainable(model), "loss": tr["loss"], "wall_s": tr["wall_s"],
                        "n_train": len(arm_recs)}

            res = scored(name, train_score)
            if arm == "MoD":  # MoD-Multi rounds not scored yet: from the saved adapters
                def load(name=name):
                    model = copy.deepcopy(base)
                    load_adapters(model, os.path.join(root, name))
                    return model.eval()
                score_rounds(load, proc, test, res, S["rounds"], os.path.join(root, name, "scores.json"), log)
    for arm, v in ARMS.items():  # report every (arm, seed) on disk
        for d in sorted(os.listdir(root)):
            f = os.path.join(root, d, "scores.json")
            if d.startswith(v[0] + "_s") and d[len(v[0]) + 2:].isdigit() and os.path.exists(f):
                with open(f) as fh:
                    results[f"{arm}|{int(d[len(v[0]) + 2:])}"] = json.load(fh)
    return report(results, root, S, prep, own, t0, log)


def _paired(a, b, seeds):
    """Paired comparison of two arms' per-seed result lists (same items, in the same order) over
    `seeds`: eval.metrics.two_level_bootstrap (seeds, then items, resampled): diff [95% CI] of the
    seed mean, n items per seed, the per-seed differences and whether every seed has the sign of
    the mean (and none is 0)."""
    pb = two_level_bootstrap([[x["correct"] for x in a[s]] for s in seeds], [[x["correct"] for x in b[s]] for s in seeds])
    pb.update(n=len(a[seeds[0]]), seeds=list(seeds), seeds_agree=all(d * pb["diff"] > 0 for d in pb["per_seed"]))
    return pb


def report(results, root, S, prep, own, t0, log=print):
    """results {"base" or "arm|seed": scores} -> results.json (per arm, seed and metric; mean
    over seeds with paired comparisons) and the figures in root. Returns the dict."""
    table = {}
    for key, r in results.items():
        ref_key = f"MoE-LoRA token|{key.split('|')[1]}" if "|" in key else None
        for metric, res in r["results"].items():
            rows = family_rows(key, res)
            allrow = rows[-1]  # family "all" comes last
            ref = results[ref_key]["results"].get(metric) if ref_key in results else None
            pb = paired_bootstrap([x["correct"] for x in res], [x["correct"] for x in ref]) if ref else None
            table.setdefault(key, {})[metric] = {"accuracy": allrow["value"], "ci_low": allrow["ci_low"],
                                                 "ci_high": allrow["ci_high"], "n": allrow["n"], "diff_vs_moelora": pb,
                                                 "by_family": {x["family"]: x["value"] for x in rows}}
    # mean over seeds per arm and metric; paired comparisons over the seeds both arms have
    per = {}  # arm -> metric -> seed -> results
    for key, r in results.items():
        arm, seed = key.split("|") if "|" in key else (key, "0")
        for metric, res in r["results"].items():
            per.setdefault(arm, {}).setdefault(metric, {})[int(seed)] = res
    means = {}
    for arm, by_metric in per.items():
        for metric, by_seed in by_metric.items():
            seeds = sorted(by_seed)
            c = np.mean([[x["correct"] for x in by_seed[s]] for s in seeds], axis=0)
            lo, hi = bootstrap_ci(c)
            row = {"accuracy": float(c.mean()), "ci_low": lo, "ci_high": hi, "n": len(c), "seeds": seeds,
                   "per_seed": [float(np.mean([x["correct"] for x in by_seed[s]])) for s in seeds]}
            for ref_arm, ref_metric, field in (("MoE-LoRA token", metric, "vs_moelora"), ("MoD", metric, "vs_mod"),
                                               (arm, "single", "vs_single"), ("base", metric, "vs_base")):
                ref = per.get(ref_arm, {}).get(ref_metric)
                if ref is None or (ref_arm, ref_metric) == (arm, metric):
                    continue
                common = [s for s in seeds if s in ref] if ref_arm != "base" else seeds
                if ref_arm == "base":
                    ref = {s: ref[0] for s in seeds}
                if common and len(ref[common[0]]) == len(by_seed[common[0]]):
                    row[field] = _paired(by_seed, ref, common)
            means.setdefault(arm, {})[metric] = row
    out = {"partial": True, "settings": {**S, "ratios": list(S["ratios"])}, "mix": prep["mix"],
           "mix_share": prep["mix_share"], "json_sample_accuracy": prep["json_sample_accuracy"],
           "n_own_wrong": len(own), "table": table, "means": means,
           "trainable": {k: r["trainable"] for k, r in results.items()},
           "loss": {k: r.get("loss") for k, r in results.items()},
           "n_train": {k: r.get("n_train", len(prep["train_vs"])) for k, r in results.items() if k != "base"},
           "wall_s": time.time() - t0}
    out["figures"] = []

    def label(arm, v):  # bar label: the arm on two lines, then its number of seeds
        text = arm.replace(" (", "\n(").replace("MoE-LoRA ", "MoE-LoRA\n").replace("MoD ", "MoD\n", 1)
        n = len(v["seeds"])
        return text if arm == "base" else f"{text}\n{n} seed{'s' if n > 1 else ''}"
    for metric, title in (("single", "single round (JSON prompt)"), ("misled_own", "misled in distribution"),
                          ("misled_ood", "misled out of distribution")):
        bars = [(label(arm, d[metric]), d[metric]["accuracy"], d[metric]["ci_low"], d[metric]["ci_high"])
                for arm, d in means.items() if metric in d]
        out["figures"].append(bar_ci_png(bars, os.path.join(root, f"debate_{metric}.png"),
                                         f"debate part: accuracy, {title}, mean over seeds, 95% CI", "accuracy",
                                         width=max(640, 80 * len(bars))))
    if "MoD" in means:  # MoD-Single vs MoD-Multi by rounds
        rounds = sorted(int(m[5:]) for m in means["MoD"] if m.startswith("multi"))
        bars = [(f"{'Single' if k == 0 else f'Multi {k}'}\n{len(means['MoD'][m]['seeds'])} seeds",
                 means["MoD"][m]["accuracy"], means["MoD"][m]["ci_low"], means["MoD"][m]["ci_high"])
                for k, m in [(0, "single")] + [(k, f"multi{k}") for k in rounds]]
        out["figures"].append(bar_ci_png(bars, os.path.join(root, "debate_rounds.png"),
                                         "MoD: accuracy by debate rounds (JSON prompt), mean over seeds, 95% CI",
                                         "accuracy"))
    atomic_write_text(os.path.join(root, "results.json"), json.dumps(out, indent=1))
    for arm, d in means.items():
        log(f"  {arm:22s} " + "  ".join(f"{m} {v['accuracy']:.3f} [{v['ci_low']:.2f}, {v['ci_high']:.2f}] "
                                         f"({len(v['seeds'])}s)" for m, v in d.items()))
    return out


# ---- per-arm learning rate on a validation split (the fair-baseline rule) ----
# arms of the main claim, the lr grid, the validation questions and the selection metric are
# pre-registered in eval/logs/mod.md ("Debate part: per-arm learning rate").
# train: False = report what is on disk (nothing trained or scored; a missing sweep point is an error);
# tag: suffix of the report's files (results<tag>.json, debate_lr<tag>_*.png), e.g. for a second grid;
# picks: {arm: lr} given = no sweep (e.g. the picks of the 300-step sweep for a run with other steps)
# rounds: MoD-Multi rounds scored on the MoD arm at its pick (test only); metrics: the test metrics
# scored at the picks (default all three; e.g. ("single",) when only MoD-Multi vs MoD-Single is asked)
LR_SETTINGS = dict(lr_arms=("MoD", "MoE-LoRA token"), lrs=(2e-3, 5e-3, 1e-2), n_val=150, val_k=4, val_seed=2,
                   select=("single", "misled_own"), train=True, tag="", picks=None, rounds=(), metrics=METRICS)


def _pair_key(r):
    """The content of an (image, question) pair: the question turn and the target (the marked
    scene text, which lists every object, and the answer)."""
    c = r["conversations"]
    return c[0]["value"].removeprefix("<image>\n"), c[1]["value"]


def val_questions(data_dir, n_val, *others):
    """`n_val` records of the shapes "val" split (`common.shapes.generate_split`, made the same
    way as the test split: its own seed and hash bucket), generated if missing: the first ones
    in file order that share no id, image or question-and-target text with a record of `others`
    (e.g. the training and test questions). The text check also drops near twins the split's
    hash keeps apart: one-object scenes that differ only in the object's size (not in the text).
    Returns (records, ids dropped). Raises ValueError when fewer than n_val are left."""
    shapes.ensure_splits(data_dir, {"val": max(n_val, 500)})
    seen = {x for recs in others for r in recs for x in (("id", r["id"]), ("image", r["image"]), _pair_key(r))}
    val, dropped = [], []
    for r in read_llava_json(os.path.join(data_dir, "val.json")):
        if len(val) == n_val:
            break
        (dropped if {("id", r["id"]), ("image", r["image"]), _pair_key(r)} & seen else val).append(r)
    if len(val) < n_val:
        raise ValueError(f"{data_dir}/val.json has {len(val)} records not in the training / test questions, "
                         f"{n_val} asked; remove it to regenerate a larger one, or ask for fewer")
    return val, [r["id"] for r in dropped]


def selection_score(row, metrics=LR_SETTINGS["select"]):
    """The pre-registered lr-selection metric: the unweighted mean of the validation accuracies
    `row[m]` over `metrics` (default: single round and misled in distribution)."""
    return sum(row[m] for m in metrics) / len(metrics)


def pick_lr(grid, metrics=LR_SETTINGS["select"]):
    """grid {lr: {metric: validation accuracy}} -> the lr with the highest `selection_score`;
    ties (equal to 1e-9) go to the smaller lr. Raises ValueError on an empty grid."""
    if not grid:
        raise ValueError("no learning rate scored on the validation split")
    return min(grid, key=lambda lr: (-round(selection_score(grid[lr], metrics), 9), lr))


def verdict(pb, sign=1):
    """The verdict rule of every toy (eval.metrics.verdict) on a `_paired` comparison: "supported"
    when its two-level CI excludes 0 in the predicted direction (`sign` +1 / -1) and every seed's
    difference has that sign; "contradicted" when both hold in the other direction; else
    "inconclusive"."""
    return verdict_rule(pb, sign)


def verdict_over(pb, min_seeds=3):
    """`verdict` (direction +1) when the comparison `pb` (`_paired`) covers at least `min_seeds`
    seeds, else "partial (n seeds)": fewer seeds than pre-registered get no verdict."""
    n = len(pb["seeds"])
    return verdict(pb, +1) if n >= min_seeds else f"partial ({n} seed{'s' if n > 1 else ''})"


def compare_arms(per, ref="MoD", other="MoE-LoRA token", min_seeds=3):
    """The other arms at their picks (pre-registered in eval/logs/mod.md): per {arm: {metric: {seed: [{"correct": ...}, ...]}}} -> {arm: {metric: {"vs_<ref>": pb,
    "vs_<other>": pb}}} for every arm but `ref` and `other`, each `_paired` over the seeds both have.
    vs ref: ref minus arm (hypothesis ref > arm), "verdict" by the 3-seed criterion (`verdict`);
    vs other: arm minus other, no direction predicted: "higher" / "lower" by the same rule, else
    "not resolved". Fewer than `min_seeds` common seeds: "partial (n seeds)", no verdict."""
    out = {}
    for arm, by_metric in per.items():
        if arm in (ref, other):
            continue
        for metric, res in by_metric.items():
            row = {}
            for name, directed in ((ref, True), (other, False)):
                theirs = per.get(name, {}).get(metric, {})
                common = sorted(set(res) & set(theirs))
                if not common:
                    continue
                pb = _paired(theirs, res, common) if directed else _paired(res, theirs, common)
                v = verdict_over(pb, min_seeds)
                pb["verdict"] = v if directed else {"supported": "higher", "contradicted": "lower",
                                                    "inconclusive": "not resolved"}.get(v, v)
                row[f"vs_{name}"] = pb
            out.setdefault(arm, {})[metric] = row
    return out


def run_lr(data_dir="out/data", out_dir="out/mod", base_name="tiny-chat", S=SETTINGS, L=LR_SETTINGS, log=print,
           deadline=None):
    """Per-arm lr for the arms L["lr_arms"]: train each lr of L["lrs"] at seed 0 on the debate
    part's 600 samples (`prepare`: prep.json, made when missing; a data-mix arm trains on its
    categories of them), score validation single round and misled in distribution, pick per arm
    (`pick_lr`; or take L["picks"], no sweep), then train / score S["seeds"] at the picks on the
    first S["n_test"] test questions (single, misled own wrong answer, misled other scene; MoD-Multi
    L["rounds"] on the MoD arm) and the frozen base on the same. The lr S["lr"] at the default
    steps reuses the debate part's own folders <slug>_s<seed>. Everything per (arm, lr, steps,
    seed) is written atomically under OUT/debate/lr/ and skipped when present; a scores file
    for another test-set size raises ValueError; one made for fewer of L["metrics"] gets the others
    from its adapters. L["per_question"] (a path, or None): every scored (arm, seed) is also kept
    there (`save_per_question`). -> OUT/debate/lr/results<tag>.json, table<tag>.md.
    deadline (`late`, --max-minutes): no new training or test scoring starts after it; an
    unfinished sweep returns None before any pick, else the report covers what is on disk."""
    t0 = time.time()
    root = os.path.join(out_dir, "debate")
    lroot = os.path.join(root, "lr")
    os.makedirs(lroot, exist_ok=True)
    train, test, base, proc = load_data(data_dir, base_name, S)
    if len(test) < S["n_test"]:
        raise ValueError(f"{data_dir}/test.json has {len(test)} questions, --debate-test asks {S['n_test']}")
    val, dropped = val_questions(data_dir, L["n_val"], train, read_llava_json(os.path.join(data_dir, "test.json")))
    prep = prepare(root, base, proc, train, test, S, log)
    own = prep["own_wrong"]
    # test scores of another test-set size than the default live in their own file
    sfile = "scores.json" if S["n_test"] == SETTINGS["n_test"] else f"scores_test{S['n_test']}.json"

    def val_prep():
        t = time.time()
        own_val = {}
        for r, ss in zip(val, json_samples(base, proc, val, L["val_k"], L["val_seed"])):
            bad = [s for s in ss if not vs.is_correct_for(r, s)]
            if bad:
                own_val[r["id"]] = vs.to_json_response(bad[0])
        return {"own_wrong": own_val, "n_val": len(val), "val_ids": [r["id"] for r in val], "dropped": dropped,
                "wall_s": time.time() - t}
    own_val = cached(os.path.join(lroot, "val_prep.json"), val_prep)["own_wrong"]
    log(f"lr sweep: {len(val)} validation questions ({len(dropped)} skipped as twins of a training / test "
        f"question: {dropped}), {len(own_val)} with an own wrong answer")

    def val_scores(model):
        with torch.inference_mode():
            return {"single": mod_debate(model, proc, val, rounds=0)[0], "misled_own": misled_own(model, proc, val, own_val)[0]}
    base_val = cached(os.path.join(lroot, "base_val.json"), lambda: {
        "single": plain(base, proc, val, json_prompt=True)[0], "misled_own": misled_own(base, proc, val, own_val)[0]})

    steps = "" if S["steps"] == SETTINGS["steps"] else f"_steps{S['steps']}"

    def folder(arm, lr, seed):  # the debate part's own folder for its lr and steps, else one under lr/
        slug = ARMS[arm][0]
        if lr == S["lr"] and not steps:
            return os.path.join(root, f"{slug}_s{seed}")
        return os.path.join(lroot, f"{slug}_lr{lr:g}{steps}_s{seed}")

    def trained(arm, lr, seed):
        """(model with the adapters of (arm, lr, seed), training info), training when missing."""
        d, kw = folder(arm, lr, seed), ARMS[arm][1]
        model = copy.deepcopy(base)
        info_f = os.path.join(d, "train.json")
        if os.path.exists(os.path.join(d, "adapter_model.safetensors")) and (
                os.path.exists(info_f) or os.path.exists(os.path.join(d, "scores.json"))):
            load_adapters(model, d)
            src = info_f if os.path.exists(info_f) else os.path.join(d, "scores.json")
            with open(src) as fh:
                info = json.load(fh)
            with open(os.path.join(d, "log.jsonl")) as fh:
                step0 = json.loads(fh.readline())["loss"]
            return model.eval(), {"loss": info["loss"], "wall_s": info["wall_s"], "step0_loss": step0}
        torch.manual_seed(seed)
        attach(model, AdapterConfig(**kw))
        recs = arm_records(root, prep, arm)
        tr = fit(model, proc, recs, d, TrainConfig(steps=S["steps"], batch_size=S["batch_size"], lr=lr,
                 warmup=max(1, S["steps"] // 10), seed=seed, save_every=100, resume=True), desc=f"train {d}", quiet=True)
        info = {"loss": tr["loss"], "wall_s": tr["wall_s"], "step0_loss": tr["log"][0]["loss"], "lr": lr,
                "trainable": num_trainable(model), "n_train": len(recs)}
        save_adapters(model, d)
        atomic_write_text(info_f, json.dumps(info))
        log(f"  trained {d}: loss {info['loss']:.4f} (step 0 {info['step0_loss']:.7f}), {info['wall_s']:.0f} s")
        return model.eval(), info

    # 1. the sweep: every lr at seed 0, scored on the validation questions
    grid, unfinished = {}, False
    for arm in L["lr_arms"] if not L.get("picks") else ():
        for lr in L["lrs"]:
            vf = os.path.join(lroot, f"{ARMS[arm][0]}_lr{lr:g}{steps}_s0", "val.json")
            if not os.path.exists(vf):
                if not L.get("train", True):
                    raise ValueError(f"{vf} missing: the sweep is not finished; run without --debate-no-train")
                if late(deadline):
                    log(f"  --max-minutes reached: sweep {arm} lr {lr:g} not run")
                    unfinished = True
                    continue
                model, info = trained(arm, lr, 0)
                t = time.time()
                res = dict(val_scores(model), train=info)
                res["wall_s_score"] = time.time() - t
                atomic_write_text(vf, json.dumps(res))
            with open(vf) as fh:
                res = json.load(fh)
            row = {m: summarize(m, res[m], 0)["accuracy"] for m in L["select"]}
            row.update(n={m: len(res[m]) for m in L["select"]}, loss=res["train"]["loss"],
                       step0_loss=res["train"]["step0_loss"], selection=selection_score(row, L["select"]))
            grid.setdefault(arm, {})[lr] = row
            log(f"  val {arm} lr {lr:g}: " + ", ".join(f"{m} {row[m]:.3f}" for m in L["select"])
                + f", selection {row['selection']:.4f}, loss {row['loss']:.4f}")
    if unfinished:
        log("  the sweep is not finished: no pick, no test scores (rerun the same command to continue)")
        return None
    picks = dict(L["picks"]) if L.get("picks") else {arm: pick_lr(g, L["select"]) for arm, g in grid.items()}
    log(f"  picked lr: {picks}")
    out = lr_report(root, S, L, grid, picks, base_val, {}, t0, log)

    # 2. test scores at the picks: seed 0 first (the sweep's adapters), then the other seeds
    scores = {("base", 0): cached(os.path.join(lroot, f"base_test{len(test)}.json"),
                                  lambda: {"results": score_test(base, proc, test, own, base=True)})}
    for seed in S["seeds"]:
        for arm in L["lr_arms"]:
            d = folder(arm, picks[arm], seed)
            if not os.path.exists(os.path.join(d, sfile)) and (not L.get("train", True) or late(deadline)):
                log(f"  {arm} seed {seed} at lr {picks[arm]:g}: not run"
                    + (" (--max-minutes reached)" if L.get("train", True) else ""))
                continue

            def score(arm=arm, seed=seed, d=d):
                model, info = trained(arm, picks[arm], seed)
                t = time.time()
                out = score_test(model, proc, test, own, metrics=L.get("metrics") or METRICS)
                log(f"  test {d}: " + ", ".join(f"{k} {summarize(k, v, 0)['accuracy']:.3f}" for k, v in out.items()))
                return {"results": out, "trainable": num_trainable(model), **info, "wall_s_score": time.time() - t}
            res = scores[(arm, seed)] = cached(os.path.join(d, sfile), score)
            if {len(v) for k, v in res["results"].items() if k != "misled_own"} != {len(test)}:
                raise ValueError(f"{os.path.join(d, sfile)} was scored on another test set than the {len(test)} "
                                 "questions asked: move it away to rescore")
            todo = [m for m in L.get("metrics") or METRICS if m not in res["results"]]
            if todo and not late(deadline):   # a scores file made for fewer metrics: the rest from its adapters
                t = time.time()
                res["results"].update(score_test(trained(arm, picks[arm], seed)[0], proc, test, own, metrics=todo))
                res.setdefault("wall_s_added", {})[",".join(todo)] = time.time() - t
                atomic_write_text(os.path.join(d, sfile), json.dumps(res))
                log(f"  test {d}: added " + ", ".join(f"{k} {summarize(k, res['results'][k], 0)['accuracy']:.3f}"
                                                      for k in todo))
            missing = [k for k in L.get("rounds", ()) if f"multi{k}" not in res["results"]]
            if arm == "MoD" and missing and late(deadline):
                log(f"  MoD seed {seed}: MoD-Multi rounds {missing} not run (--max-minutes reached)")
            elif arm == "MoD":   # MoD-Multi, Alg. 2: from the adapters
                score_rounds(lambda: trained(arm, picks[arm], seed)[0], proc, test, res, L.get("rounds", ()),
                             os.path.join(d, sfile), log)
            with open(os.path.join(d, "log.jsonl")) as fh:
                res.setdefault("step0_loss", json.loads(fh.readline())["loss"])
            if L.get("per_question"):
                save_per_question(L["per_question"], arm, seed, picks[arm], res, S)
            out = lr_report(root, S, L, grid, picks, base_val, scores, t0, log)
    return out


def save_per_question(path, arm, seed, lr, res, S):
    """Every test metric of one (arm, seed) scores file `res` into the per-question file `path`
    (`eval.toys.mod_claims.save_runs`): per metric the 0/1 correctness in question order; ids
    "test" (the first S["n_test"] test questions: single round, misled other scene, MoD-Multi k
    rounds) or "misled_own" (those with an own wrong answer). Also the step-0 loss (the data check)."""
    ids, runs = {}, []
    for metric, recs in res["results"].items():
        key = "misled_own" if metric == "misled_own" else "test"
        ids[key] = [x["id"] for x in recs]
        runs.append({"arm": arm, "seed": seed, "metric": metric, "lr": lr, "steps": S["steps"], "ids": key,
                     "step0_loss": res.get("step0_loss"), "scores": [int(x["correct"]) for x in recs]})
    header = {"part": "main", "items": "per test question (ids: the shapes test split's ids, in scoring order): "
              "1 = correct; metrics: single round, misled_own (the base's own wrong answer as the prior), misled_ood "
              "(another scene's), multi<k> (MoD-Multi, k debate rounds)",
              "source": "python -m eval.toys.mod --part rerun --threads 1 (each (arm, seed) one debate-lr call at "
                        "its pick, 500 steps, the first 600 test questions)"}
    save_runs(path, header, ids, runs)


def _reference(root, S, L):
    """Test results at the debate part's own lr S["lr"] of the arms L["lr_arms"], every seed of
    S["seeds"] on disk: {(arm, seed): scores} (the figures' reference bars)."""
    ref = {}
    for arm in L["lr_arms"]:
        for seed in S["seeds"]:
            f = os.path.join(root, f"{ARMS[arm][0]}_s{seed}", "scores.json")
            if os.path.exists(f):
                with open(f) as fh:
                    ref[(arm, seed)] = json.load(fh)
    return ref


def paper_table(test):
    """The paper's main-table layout as markdown: one row per method (and MoD-Multi k rounds),
    one column per question family plus "all", each cell the mean over seeds ± the half-width of
    its 95% bootstrap CI; `test` is lr_report's out["test"] ({arm: {metric: {"accuracy", "ci_low",
    "ci_high", "seeds", "by_family": {family: ...}}}}). Rows: single round; misled rows below."""
    rows = []
    for metric, what in (("single", ""), ("multi2", "MoD-Multi, 2 rounds"), ("multi3", "MoD-Multi, 3 rounds"),
                         ("misled_own", "misled, own wrong answer"), ("misled_ood", "misled, other scene")):
        for arm, t in test.items():
            if metric in t:
                name = what if metric.startswith("multi") else f"{arm}{', ' + what if what else ''}"
                rows.append((name, t[metric]))
    fams = sorted({f for _, r in rows for f in r["by_family"]})
    cell = lambda r: f"{r['accuracy']:.3f} ± {(r['ci_high'] - r['ci_low']) / 2:.3f}"
    out = ["| method | seeds | " + " | ".join(fams) + " | all |", "|---|---|" + "---|" * (len(fams) + 1)]
    out += [f"| {name} | {len(r['seeds'])} | " + " | ".join(cell(r["by_family"][f]) if f in r["by_family"] else ""
                                                        for f in fams) + f" | {cell(r)} |" for name, r in rows]
    return "\n".join(out) + "\n"


def lr_report(root, S, L, grid, picks, base_val, scores, t0, log=print):
    """The lr part's results.json and figures (OUT/debate/lr/): the validation grid, the picks,
    test accuracy per arm at its pick (mean over seeds [95% CI], per seed, final training loss)
    and MoD minus MoE-LoRA token paired over the seeds both have, with the 3-seed verdicts."""
    lroot = os.path.join(root, "lr")
    out = {"settings": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in L.items()},
                        "steps": S["steps"], "batch_size": S["batch_size"], "seeds": list(S["seeds"])},
           "val_base": {m: summarize(m, base_val[m], 0)["accuracy"] for m in L["select"]},
           "val": {arm: {f"{lr:g}": row for lr, row in g.items()} for arm, g in grid.items()},
           "picks": {arm: lr for arm, lr in picks.items()}, "test": {}, "compare": {}, "figures": []}
    ref = _reference(root, S, L)

    def acc_ci(c):
        lo, hi = bootstrap_ci(c)
        return {"accuracy": float(np.mean(c)), "ci_low": lo, "ci_high": hi, "n": len(c)}

    def summary(scores, lr_of):
        per = {}  # arm -> metric -> seed -> results (metrics: METRICS, plus multi<k> for MoD)
        for (arm, seed), r in scores.items():
            for metric, res in r["results"].items():
                if metric in METRICS or metric.startswith("multi"):
                    per.setdefault(arm, {}).setdefault(metric, {})[seed] = res
        table = {}
        for arm, by_metric in per.items():
            seeds = sorted(s for (a, s) in scores if a == arm)
            table[arm] = {"lr": lr_of(arm), "seeds": seeds, "loss": [scores[(arm, s)].get("loss") for s in seeds],
                          "trainable": scores[(arm, seeds[0])].get("trainable", 0)}
            for metric, by_seed in by_metric.items():
                seeds_m = sorted(by_seed)   # multi<k> may be scored on fewer seeds than the arm has
                c = np.mean([[x["correct"] for x in by_seed[s]] for s in seeds_m], axis=0)
                fam = [x["family"] for x in by_seed[seeds_m[0]]]   # same items, same order, every seed
                table[arm][metric] = dict(acc_ci(c), seeds=seeds_m, per_seed=[
                    float(np.mean([x["correct"] for x in by_seed[s]])) for s in seeds_m], by_family={
                    f: acc_ci(c[[i for i, g in enumerate(fam) if g == f]]) for f in sorted(set(fam))})
        return per, table
    per, out["test"] = summary(scores, lambda arm: picks.get(arm))
    for arm in out["test"]:
        out["test"][arm]["step0_loss"] = [scores[(arm, s)].get("step0_loss") for s in out["test"][arm]["seeds"]]
    _, out["reference"] = summary(ref, lambda arm: S["lr"])
    base = per.pop("base", None)
    if base:   # every arm minus the frozen base (its single round is on the same JSON prompt)
        for arm, by_metric in per.items():
            for metric, by_seed in by_metric.items():
                if metric in base:
                    out["test"][arm][metric]["vs_base"] = _paired(by_seed, {s: base[metric][0] for s in by_seed},
                                                                  sorted(by_seed))
    a, b = (tuple(L["lr_arms"]) + (None, None))[:2]   # the two references (a run may have one arm)
    if a in per and b in per:
        for metric in per[a]:
            common = sorted(set(per[a][metric]) & set(per[b].get(metric, {})))
            if common:
                pb = _paired(per[a][metric], per[b][metric], common)
                pb["verdict"] = verdict(pb, +1)   # H-e1 / H-e2 / out of distribution: MoD > MoE-LoRA
                out["compare"][metric] = pb
    out["compare_arms"] = compare_arms(per, a, b)
    # MoD-Multi k rounds minus MoD-Single (H: more rounds help), paired over the seeds scored
    out["rounds"] = {m: dict(pb, verdict=verdict_over(pb)) for m, by_seed in per.get("MoD", {}).items()
                     if m.startswith("multi") for pb in [_paired(by_seed, per["MoD"]["single"], sorted(by_seed))]}
    # the data-mix ablation's second contrast (MoD minus each data-mix arm is in compare_arms)
    hi, lo_ = "MoD T_pos+T_rev", "MoD T_pos only"
    out["data_mix"] = {}
    for metric in per.get(hi, {}):
        common = sorted(set(per[hi][metric]) & set(per.get(lo_, {}).get(metric, {})))
        if common:
            pb = _paired(per[hi][metric], per[lo_][metric], common)
            pb["verdict"] = verdict_over(pb)
            out["data_mix"][f"{hi} minus {lo_}|{metric}"] = pb
    tag = L.get("tag", "")
    atomic_write_text(os.path.join(lroot, f"table{tag}.md"), paper_table(out["test"]))
    line = {arm: [(lr, row["selection"]) for lr, row in sorted(g.items())] for arm, g in grid.items()}
    if line:
        out["figures"].append(line_png(line, os.path.join(lroot, f"debate_lr{tag}_val.png"),
                                       "lr sweep (seed 0): validation selection metric (mean of single, misled own)",
                                       "learning rate (log2)", "selection metric", logx=True))
    for metric, title in (("single", "single round"), ("misled_own", "misled in distribution"),
                          ("misled_ood", "misled out of distribution")):
        bars = [(arm.replace(" (", "\n(").replace("MoE-LoRA ", "MoE-LoRA\n") + f"\nlr {t['lr']:g}{note}"
                 + f"\n{len(t['seeds'])} seeds"
                 + (f", {S['steps']} steps" if note == " (picked)" and S["steps"] != SETTINGS["steps"] else ""),
                 t[metric]["accuracy"], t[metric]["ci_low"], t[metric]["ci_high"])
                for arm in L["lr_arms"]   # per arm: the one-lr bar, then the bar at its pick
                for tab, note in ((out["reference"], " (one lr)"), (out["test"], " (picked)"))
                for t in [tab.get(arm, {})] if metric in t]
        if bars:
            out["figures"].append(bar_ci_png(bars, os.path.join(lroot, f"debate_lr{tag}_{metric}.png"),
                                             f"at the per-arm lr: accuracy, {title}, mean over seeds, 95% CI",
                                             "accuracy", width=max(640, 110 * len(bars))))
    if out["rounds"]:
        md = out["test"]["MoD"]
        bars = [(f"{'Single' if m == 'single' else f'Multi {m[5:]}'}\n{len(md[m]['seeds'])} seeds", md[m]["accuracy"],
                 md[m]["ci_low"], md[m]["ci_high"]) for m in ["single"] + sorted(out["rounds"])]
        out["figures"].append(bar_ci_png(bars, os.path.join(lroot, f"debate_lr{tag}_rounds.png"),
                                         "MoD at its pick: accuracy by debate rounds, mean over seeds, 95% CI", "accuracy"))
    out["wall_s"] = time.time() - t0
    atomic_write_text(os.path.join(lroot, f"results{tag}.json"), json.dumps(out, indent=1))
    lines = [(f"{a} minus {b}, {m}", pb) for m, pb in out["compare"].items()]
    lines += [(f"MoD-Multi {m[5:]} rounds minus MoD-Single", pb) for m, pb in out["rounds"].items()]
    lines += [(k.replace("|", ", "), pb) for k, pb in out["data_mix"].items()]
    for what, pb in lines:
        log(f"  {what} at the picks: {pb['diff']:+.3f} [{pb['ci_low']:+.3f}, {pb['ci_high']:+.3f}] "
            f"per seed {[round(x, 3) for x in pb['per_seed']]} -> {pb['verdict']}")
    for arm, by_metric in out["compare_arms"].items():
        for metric, row in by_metric.items():
            for name, pb in row.items():
                lhs, rhs = (name[3:], arm) if name == f"vs_{a}" else (arm, name[3:])
                log(f"  {lhs} minus {rhs} at the picks, {metric}: {pb['diff']:+.3f} [{pb['ci_low']:+.3f}, "
                    f"{pb['ci_high']:+.3f}] per seed {[round(x, 3) for x in pb['per_seed']]} -> {pb['verdict']}")
    return out
