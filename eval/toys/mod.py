"""Toy reproduction of Mixture of Debaters on the shapes world.

Pipeline, all on the committed tiny chat VLM `tiny-chat` (frozen): `tiny-dense` continued on the
prompt shapes used here (JSON instruction, debate prompt with prior responses, self-correction
and multi-agent-debate turns; `eval.tools.pretrain.chat_example`), the stand-in for a real VLM's
instruction following:
  1. viewpoint-shift data (§3.2): K samples per training question from the base model,
     T_pos / T_rev / T_rob samples with the debate prompt and a JSON target,
  2. LoRA, MoE-LoRA and MoD trained on the same data with (about) the same number of
     trainable parameters,
  3. on the test questions: base (own prompt and the JSON prompt), LoRA, MoE-LoRA, MoD-Single, MoD-Multi (1 debate round),
     MAD (2 debaters + judge on the base) and self-correction (base): accuracy with 95%
     bootstrap CI, paired bootstrap difference vs MoE-LoRA, generated tokens per question,
     latency relative to the base model; and "misled" rows for base / LoRA / MoE-LoRA / MoD:
     one debate round whose only prior response is wrong (`mod.infer.misled`; paired vs
     MoE-LoRA misled),
  4. full mode only, ablations of MoD (one training run each): routing granularity
     token / region / window, W in {1, 4, 16, 32} (switch rate + accuracy), dual vs shared
     router, sqrt-product vs product vs mean, with vs without the aux loss (expert usage
     entropy), plus the router-A per-family heatmap.

    python -m eval.toys.mod --quick      # main rows only, ~1-3 CPU minutes
    python -m eval.toys.mod --part e2e   # the pipeline below -> out/mod/results.json (~20 CPU minutes)
    python -m eval.toys.mod --part mechanism   # frozen single-layer mechanism experiments -> out/mod/mechanism/
    python -m eval.toys.mod --part debate      # end to end with headroom, one lr -> out/mod/debate/
    python -m eval.toys.mod --part mad-rounds  # MAD 1-3 debate rounds beside MoD: tokens, wall time -> out/mod/mad_rounds.json
    python -m eval.toys.mod              # mechanism, debate and e2e; out/mod/results.json lists every part's report
    bash eval/toys/mod_main.sh a|b|report      # the debate part's main setting (per-arm lr, 600 questions, 3 seeds)

`run(quick, data_dir, out_dir)` is what `python -m eval.quickstart` calls; it returns
report rows {"model","family","metric","value","ci_low","ci_high","n"}.
"""
import argparse
import copy
import json
import os
import sys
import time

import torch

from common import data
from common import shapes
from common.backbone import load_backbone
from common.cli import add_threads, set_threads
from common.data import atomic_write_text, read_llava_json
from eval.evaluate import family_rows
from eval.metrics import paired_bootstrap
from mod import data as vs
from mod.infer import (heatmap_png, misled, mod_debate, multi_agent_debate, plain, routing_trace,
                       self_correction, summarize, usage_entropy)
from mod.model import AdapterConfig, attach, num_trainable, save_adapters
from mod.train import fit

# (about) equal trainable parameters on the tiny chat/dense base (hidden 128, 4 layers, q/k/v/o):
# MoD E=8 rank-1 experts per pool + 2 routers: 61,440; LoRA rank 17: 60,928;
# MoE-LoRA 4 experts of rank 4 + router, top-2, token-level routing: 65,536.
METHODS = {"lora": dict(method="lora", r=17, lora_alpha=34.0),
           "moelora": dict(method="moelora", num_experts=4, expert_rank=4, r=2, lora_alpha=4.0),
           "mod": dict(method="mod")}
ABLATIONS = {"token": dict(granularity="token"), "region": dict(granularity="region"),
             "W4": dict(window=4), "W32": dict(window=32), "shared_router": dict(shared_router=True),
             "product": dict(combine="product"), "mean": dict(combine="mean"), "no_aux": dict(aux_coef=0.0),
             # MoE-LoRA routes per token by default (the paper's baseline); its W=16 window variant:
             "moelora_window": dict(METHODS["moelora"], granularity="window")}
SETTINGS = {True: dict(n_train=120, n_test=80, k=2, steps=80, batch_size=8, max_priors=1),
            False: dict(n_train=600, n_test=300, k=4, steps=200, batch_size=8, max_priors=2,
                        ablation_steps=100, ablation_test=150)}


def ensure_data(data_dir, n_train, n_test):
    shapes.ensure_splits(data_dir, {"train": max(n_train, 2000), "test": max(n_test, 500)})
    train = read_llava_json(os.path.join(data_dir, "train.json"))[:n_train]
    test = read_llava_json(os.path.join(data_dir, "test.json"))[:n_test]
    return train, test


def viewpoint_data(base, proc, train, k, max_priors, out_dir, log):
    t = time.time()
    samples = vs.sample_responses(base, proc, train, k=k, temperature=1.0, batch_size=80)
    pools, n_gold = vs.build_pools(train, samples)
    recs, counts = vs.synthesize(train, pools, n_per_question=2, max_priors=max_priors)
    path = os.path.join(out_dir, "train_vs.json")
    atomic_write_text(path, json.dumps(recs))
    base_acc = sum(vs.is_correct_for(r, s) for r, ss in zip(train, samples) for s in ss)
    info = {"samples": len(recs), **{f"T_{c}": counts[c] for c in vs.CATEGORIES}, "gold_filled": n_gold,
            "base_sample_accuracy": base_acc / max(1, k * len(train)), "wall_s": time.time() - t}
    log(f"viewpoint-shift data: {info}")
    return read_llava_json(path), info


def train_adapter(base, proc, recs, cfg_kw, steps, batch_size, out_dir, name, log):
    model = copy.deepcopy(base)
    torch.manual_seed(0)
    cfg = AdapterConfig(**cfg_kw)
    attach(model, cfg)
    res = fit(model, proc, recs, os.path.join(out_dir, name), steps=steps, batch_size=batch_size, lr=2e-3,
              warmup=max(1, steps // 10), aux_coef=cfg.aux_coef, desc=f"train {name}")
    save_adapters(model, os.path.join(out_dir, name))
    res["trainable"] = num_trainable(model)
    log(f"{name}: {res['trainable']:,} trainable, loss {res['loss']:.3f} aux {res['aux']:.3f}, "
        f"{res['wall_s']:.0f} s")
    return model.eval(), res


def run(quick=True, data_dir="out/data", out_dir="out/mod", base_name="tiny-chat", log=print):
    """Run the toy reproduction; returns report rows (and writes out_dir/results.json)."""
    S = SETTINGS[bool(quick)]
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    train, test = ensure_data(data_dir, S["n_train"], S["n_test"])
    base, proc = load_backbone(base_name)
    recs, data_info = viewpoint_data(base, proc, train, S["k"], S["max_priors"], out_dir, log)

    results, summaries, training = {}, {}, {}

    def record(name, res_wall):
        res, wall = res_wall
        results[name], summaries[name] = res, summarize(name, res, wall)
        s = summaries[name]
        log(f"  {name:14s} acc {s['accuracy']:.3f}  tokens/q {s['tokens_per_q']:6.1f}  wall {wall:6.1f} s")

    with torch.inference_mode():
        record("base", plain(base, proc, test))
        record("base-json", plain(base, proc, test, json_prompt=True))  # the adapters' prompt, untrained
    models = {}
    for name, kw in METHODS.items():
        models[name], training[name] = train_adapter(base, proc, recs, kw, S["steps"], S["batch_size"], out_dir,
                                                     name, log)
    with torch.inference_mode():
        record("lora", plain(models["lora"], proc, test, json_prompt=True))
        record("moelora", plain(models["moelora"], proc, test, json_prompt=True))
        record("mod-single", mod_debate(models["mod"], proc, test, rounds=0))
        record("mod-multi", mod_debate(models["mod"], proc, test, rounds=1))
        record("mad", multi_agent_debate(base, proc, test, rounds=1))
        record("self-correction", self_correction(base, proc, test))
        # robustness: one debate round whose only prior response is wrong (what T_rev / T_rob teach)
        for name, m in (("base", base), ("lora", models["lora"]), ("moelora", models["moelora"]),
                        ("mod", models["mod"])):
            record(f"{name}-misled", misled(m, proc, test))
        diag = {"mod": routing_trace(models["mod"], proc, test)}

    ablations = {}

    def report(done):
        """Report rows of everything measured so far; results.json rewritten each time."""
        rows = []
        for name, res in results.items():
            rows += [r for r in family_rows(f"mod-toy/{name}", res) if not quick or r["family"] == "all"]
        base_wall = summaries["base"]["wall_s"]
        for name, s in summaries.items():
            ref = results["moelora-misled" if name.endswith("-misled") else "moelora"]
            pb = paired_bootstrap([r["correct"] for r in results[name]], [r["correct"] for r in ref])
            rows += [{"model": f"mod-toy/{name}", "family": "all", "metric": "diff_vs_moelora", "value": pb["diff"],
                      "ci_low": pb["ci_low"], "ci_high": pb["ci_high"], "n": pb["n"]},
                     {"model": f"mod-toy/{name}", "family": "all", "metric": "tokens_per_question",
                      "value": s["tokens_per_q"], "ci_low": None, "ci_high": None, "n": s["n"]},
                     {"model": f"mod-toy/{name}", "family": "all", "metric": "latency_vs_base",
                      "value": s["wall_s"] / base_wall, "ci_low": None, "ci_high": None, "n": s["n"]}]
        rows.append({"model": "mod-toy/mod-single", "family": "all", "metric": "switch_rate",
                     "value": diag["mod"]["switch_rate"], "ci_low": None, "ci_high": None, "n": len(test)})
        for name, (res, d, tr) in ablations.items():
            rows += [dict(r, model=f"mod-toy/ablation-{name}") for r in family_rows("x", res) if r["family"] == "all"]
            for metric, v in (("switch_rate", d["switch_rate"]), ("usage_entropy_A", usage_entropy(d["share_A"])),
                              ("usage_entropy_B", usage_entropy(d["share_B"]))):
                rows.append({"model": f"mod-toy/ablation-{name}", "family": "all", "metric": metric, "value": v,
                             "ci_low": None, "ci_high": None, "n": len(res)})
        # the other parts' reports on disk (per arm, seed, family and metric), relative to out_dir
        parts = {name: f for name, f in (("mechanism", "mechanism/mechanism.json"), ("debate", "debate/results.json"))
                 if os.path.exists(os.path.join(out_dir, f))}
        lr_dir = os.path.join(out_dir, "debate", "lr")
        if os.path.isdir(lr_dir):
            parts["debate_lr"] = sorted(f"debate/lr/{f}" for f in os.listdir(lr_dir) if f.startswith("results"))
        out = {"quick": bool(quick), "complete": done, "parts": parts, "settings": S, "data": data_info,
               "training": training,
               "summaries": summaries, "diagnostics": {"mod": diag["mod"]},
               "ablation_training": {k: v[2] for k, v in ablations.items()}, "rows": rows,
               "wall_s": time.time() - t0}
        atomic_write_text(os.path.join(out_dir, "results_quick.json" if quick else "results.json"),
                          json.dumps(out, indent=1))
        return rows

    rows = report(done=bool(quick))
    if not quick:
        heatmap_png(diag["mod"]["by_family_A"], os.path.join(out_dir, "heatmap_router_A.png"))
        heatmap_png(diag["mod"]["by_family_B"], os.path.join(out_dir, "heatmap_router_B.png"))
        # each ablation (and the default "window" for reference) is a shorter run, scored on fewer questions
        sub = test[:S["ablation_test"]]
        for name, kw in {"window": {}, **ABLATIONS}.items():
            m, tr = train_adapter(base, proc, recs, {**METHODS["mod"], **kw}, S["ablation_steps"], S["batch_size"],
                                  out_dir, f"mod_{name}", log)
            with torch.inference_mode():
                res, wall = mod_debate(m, proc, sub, rounds=0)
                d = routing_trace(m, proc, sub)
            ablations[name] = (res, d, tr)
            log(f"  ablation {name:13s} acc {summarize(name, res, wall)['accuracy']:.3f} "
                f"switch {d['switch_rate']:.3f} entropy A {usage_entropy(d['share_A']):.3f}")
            del m
            rows = report(done=name == list(ABLATIONS)[-1])
    log(f"toy MoD done in {(time.time() - t0) / 60:.1f} min -> {out_dir}")
    return rows


def main(argv=None):
    from common.cli import entry_parser
    p = entry_parser(__spec__.name, "Toy reproduction of Mixture of Debaters on the shapes world.")
    p.add_argument("--quick", action="store_true", help="main rows only (~3 CPU minutes)")
    p.add_argument("--data", default="out/data", help="shapes data directory (generated if missing)")
    p.add_argument("--out", default="out/mod", help="output directory (results.json, adapters, heatmaps)")
    p.add_argument("--model", default="tiny-chat", help="frozen base model: checkpoint dir or tiny-chat")
    add_threads(p)
    p.add_argument("--debate-arms", default="", help="debate part: arms to train / score when missing, comma "
                   "separated folder names (default: all; every arm on disk is reported)")
    p.add_argument("--debate-seeds", default="0", help="debate part: training seeds, comma separated")
    p.add_argument("--debate-rounds", default=None, help="MoD-Multi rounds scored on the MoD arm's adapters, comma "
                   "separated (default: 2 in the debate part, none in debate-lr)")
    p.add_argument("--debate-test", type=int, default=300, help="debate parts: test questions (the first N of the "
                   "shapes test split, default 300; other sizes are scored into scores_test<N>.json)")
    p.add_argument("--debate-lrs", default="", help="debate-lr part: the lr grid, comma separated (default "
                   "2e-3,5e-3,1e-2)")
    p.add_argument("--debate-val", type=int, default=150, help="debate-lr part: validation questions (the "
                   "shapes val split; default 150)")
    p.add_argument("--debate-lr-tag", default="", help="debate-lr part: suffix of the report's files "
                   "(OUT/debate/lr/results<TAG>.json, figures), e.g. _wide for a second grid; the (arm, lr, seed) "
                   "folders are shared")
    p.add_argument("--debate-steps", type=int, default=0, help="debate-lr part: training steps "
                   "(default 300; other steps train into their own folders, OUT/debate/lr/<arm>_lr<LR>_steps<N>_s<seed>)")
    p.add_argument("--debate-picks", default="", help="debate-lr part: fixed lr per arm, no sweep, e.g. "
                   "MoD=1e-2,MoE-LoRA=5e-3 (folder names as in --debate-arms)")
    p.add_argument("--debate-metrics", default="", help="debate-lr part: test metrics scored at the picks, comma "
                   "separated from single, misled_own, misled_ood (default: all three)")
    p.add_argument("--debate-no-train", action="store_true", help="debate-lr part: report what is on disk, "
                   "train and score nothing ((arm, seed) without scores are listed as not run)")
    p.add_argument("--mad-rounds", default="1,2,3", help="mad-rounds part: MAD debate rounds, comma separated")
    p.add_argument("--mad-adapter", default="", help="mad-rounds part: the MoD adapter folder of the MoD-Single / "
                   "MoD-Multi rows (default OUT/debate/lr/MoD_lr0.01_steps500_s0, the main setting's seed 0; none: MAD rows only)")
    p.add_argument("--part", default="all", choices=["all", "mechanism", "debate", "debate-lr", "e2e", "mad-rounds"],
                   help="mechanism: frozen single-layer experiments (eval/toys/mod_mechanism.py, -> OUT/mechanism/); "
                   "debate: end to end with headroom (eval/toys/mod_debate.py, -> OUT/debate/); "
                   "debate-lr: per-arm lr of the --debate-arms (default MoD,MoE-LoRA; the first two are the "
                   "references every further arm is compared with) picked on the val split, then --debate-seeds "
                   "at the picks (-> OUT/debate/lr/; makes the debate data when missing); "
                   "e2e: the shapes-world pipeline below; all: every part but debate-lr and mad-rounds (--quick runs "
                   "e2e only); mad-rounds: MAD with --mad-rounds debate rounds beside MoD-Single / MoD-Multi 1 and 2 "
                   "rounds on the first --debate-test questions, tokens and wall time per question "
                   "(eval/toys/mod_mad.py, -> OUT/mad_rounds.json)")
    a = p.parse_args(argv)
    from eval.toys import mod_debate as toy_mod_debate
    arms = [x.strip() for x in a.debate_arms.split(",") if x.strip()]
    if [x for x in arms if x not in toy_mod_debate.SLUGS]:
        p.error(f"--debate-arms: unknown {[x for x in arms if x not in toy_mod_debate.SLUGS]}; "
                f"choose from {sorted(toy_mod_debate.SLUGS)}")
    try:
        seeds = [int(x) for x in a.debate_seeds.split(",") if x.strip()]
        rounds = [int(x) for x in (a.debate_rounds or "").split(",") if x.strip()]
    except ValueError:
        p.error("--debate-seeds / --debate-rounds take comma-separated integers, e.g. 0,1,2")
    if not seeds or any(k < 1 for k in rounds) or a.debate_test < 1:
        p.error("--debate-seeds needs at least one seed; --debate-rounds values and --debate-test must be >= 1")
    debate = dict(toy_mod_debate.SETTINGS, arms=arms or None, seeds=tuple(seeds), n_test=a.debate_test,
                  rounds=tuple(rounds) if a.debate_rounds is not None else toy_mod_debate.SETTINGS["rounds"])
    try:
        lrs = tuple(float(x) for x in a.debate_lrs.split(",") if x.strip()) or toy_mod_debate.LR_SETTINGS["lrs"]
    except ValueError:
        p.error("--debate-lrs takes comma-separated numbers, e.g. 2e-3,5e-3,1e-2")
    if any(x <= 0 for x in lrs) or a.debate_val < 1:
        p.error("--debate-lrs values must be > 0 and --debate-val >= 1")
    lr_arms = tuple(toy_mod_debate.SLUGS[x] for x in arms) or toy_mod_debate.LR_SETTINGS["lr_arms"]
    picks = {}
    for item in [x.strip() for x in a.debate_picks.split(",") if x.strip()]:
        slug, _, lr = item.partition("=")
        try:
            picks[toy_mod_debate.SLUGS[slug.strip()]] = float(lr)
        except (KeyError, ValueError):
            p.error(f"--debate-picks: {item!r} is not ARM=LR with ARM in {sorted(toy_mod_debate.SLUGS)}, "
                    "e.g. MoD=1e-2,MoE-LoRA=5e-3")
    if a.debate_steps < 0 or any(v <= 0 for v in picks.values()):
        p.error("--debate-steps must be >= 1 (0 = the default 300) and --debate-picks lrs > 0")
    lr_arms = tuple(picks) or lr_arms
    metrics = tuple(x.strip() for x in a.debate_metrics.split(",") if x.strip()) or toy_mod_debate.METRICS
    if [m for m in metrics if m not in toy_mod_debate.METRICS]:
        p.error(f"--debate-metrics: choose from {','.join(toy_mod_debate.METRICS)}")
    lr_part = dict(toy_mod_debate.LR_SETTINGS, lrs=lrs, n_val=a.debate_val, lr_arms=lr_arms,
                   train=not a.debate_no_train, tag=a.debate_lr_tag, picks=picks or None, rounds=tuple(rounds),
                   metrics=metrics)
    try:
        mad_rounds = tuple(int(x) for x in a.mad_rounds.split(",") if x.strip())
    except ValueError:
        p.error("--mad-rounds takes comma-separated integers, e.g. 1,2,3")
    if not mad_rounds or min(mad_rounds) < 1:
        p.error("--mad-rounds needs at least one value, each >= 1")
    set_threads(a.threads, a.model)
    if a.part == "mad-rounds":
        from eval.toys import mod_mad
        try:
            mod_mad.run(a.data, a.out, a.model, a.debate_test, mad_rounds, a.mad_adapter or None)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2)
        return
    if a.part in ("all", "mechanism") and not a.quick:
        from eval.toys import mod_mechanism as toy_mod_mechanism
        toy_mod_mechanism.run(os.path.join(a.out, "mechanism"))
    if a.part in ("all", "debate") and not a.quick:
        toy_mod_debate.run(a.data, a.out, a.model, S=debate)
    if a.part == "debate-lr":
        try:
            toy_mod_debate.run_lr(a.data, a.out, a.model, S=dict(debate, steps=a.debate_steps or debate["steps"]),
                                  L=lr_part)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2)
    if a.part in ("mechanism", "debate", "debate-lr"):
        return
    rows = run(a.quick, a.data, a.out, a.model)
    main_rows = [r for r in rows if r["family"] == "all" and r["metric"] in ("accuracy", "tokens_per_question",
                                                                              "latency_vs_base")]
    by_model = {}
    for r in main_rows:
        by_model.setdefault(r["model"], {})[r["metric"]] = r
    print(f"\n{'model':32s} {'accuracy [95% CI]':24s} {'tok/q':>7s} {'latency':>8s}")
    for m, d in by_model.items():
        a_ = d.get("accuracy")
        acc = f"{a_['value']:.3f} [{a_['ci_low']:.2f}, {a_['ci_high']:.2f}]" if a_ else ""
        tok = f"{d['tokens_per_question']['value']:7.1f}" if "tokens_per_question" in d else ""
        lat = f"{d['latency_vs_base']['value']:7.2f}x" if "latency_vs_base" in d else ""
        print(f"{m:32s} {acc:24s} {tok:>7s} {lat:>8s}")


if __name__ == "__main__":
    main()
