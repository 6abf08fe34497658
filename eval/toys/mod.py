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

One command drives every part (`--part`, below); the resumable parts reuse everything on disk, so
a stopped run resumes with the same command, and `--max-minutes N` starts no training or scoring
after N minutes (rerun to continue):

    python -m eval.toys.mod --quick      # main rows only, ~1-3 CPU minutes
    python -m eval.toys.mod --part e2e   # the pipeline above -> out/mod/results.json (~20 CPU minutes)
    python -m eval.toys.mod --part mechanism   # frozen single-layer mechanism experiments -> out/mod/mechanism/
    python -m eval.toys.mod --part debate      # end to end with headroom, one lr -> out/mod/debate/
    python -m eval.toys.mod --part debate-lr   # per-arm lr on a validation split -> out/mod/debate/lr/
    python -m eval.toys.mod                    # mechanism, debate and e2e; out/mod/results.json lists every part's report
    python -m eval.toys.mod --part main-a & python -m eval.toys.mod --part main-b   # the main setting, two processes
    python -m eval.toys.mod --part main-report # its report: 600 questions, 500 steps, seeds 0-2, per-arm lr
    python -m eval.toys.mod --part paper-rounds --threads 1   # MoD-Multi with one debate round, MAD by rounds
    python -m eval.toys.mod --part rerun --threads 1          # main setting + paper rounds, per-question outputs kept
    python -m eval.toys.mod --part mad-rounds  # MAD 1-3 debate rounds beside MoD: tokens, wall time -> out/mod/mad_rounds.json
    python -m eval.toys.mod --part mad-protocols --debate-seeds 0,1,2 --debate-test 64 --batch1-test 16 --threads 1
    python -m eval.toys.mod --part results     # eval/results/mod/paper_rounds.json, mad_rounds.json, mad_protocols.json
    python -m eval.toys.mod --part claims      # eval/results/mod/claims.json from the committed per-question files

`run(quick, data_dir, out_dir)` is what `python -m eval.quickstart` calls; it returns
report rows {"model","family","metric","value","ci_low","ci_high","n"}.
"""
import argparse
import copy
import json
import os
import time

import torch

from common import shapes
from common.backbone import load_backbone
from common.cli import add_threads, entry_parser, fail, late, number, set_threads
from common.data import atomic_write_text, read_llava_json
from eval.evaluate import family_rows
from eval.metrics import paired_bootstrap
from eval.toys import mod_claims
from eval.toys import mod_debate as toy_debate
from eval.toys import mod_mad as toy_mad
from eval.toys import mod_mechanism as toy_mechanism
from mod import data as vs
from mod.infer import (heatmap_png, misled, mod_debate, multi_agent_debate, plain, routing_trace,
                       self_correction, summarize, usage_entropy)
from mod.model import AdapterConfig, attach, num_trainable, save_adapters
from mod.train import TrainConfig, fit

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
    res = fit(model, proc, recs, os.path.join(out_dir, name), TrainConfig(steps=steps, batch_size=batch_size, lr=2e-3,
              warmup=max(1, steps // 10), aux_coef=cfg.aux_coef), desc=f"train {name}")
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


# ---- the main setting and the paper-rounds runs (pre-registered in eval/logs/mod.md) ----
# Every (arm, seed) is one debate-lr call at a fixed lr on the first 600 test questions, 500 steps.
MAIN = dict(n_test=600, steps=500, seeds=(0, 1, 2))
MAIN_A = [[("MoD", 1e-2, s), ("MoE-LoRA", 5e-3, s), ("LoRA", 5e-3, s)] for s in MAIN["seeds"]]   # per seed
MAIN_B = [("LoRA_r4", 1e-2), ("MoD_shared", 1e-2)]
MIX_ARMS = ("MoD_pos", "MoD_pos_rev")    # the data-mix arms: lr from their own sweep (`_mix_sweep`)
PAPER_ROUNDS_MAD_TEST = 64               # MAD by debate rounds: the first 64 test questions (one batch)
PARTS = {
    "all": "mechanism, debate and e2e (--quick: e2e only)",
    "mechanism": "frozen single-layer experiments (eval/toys/toy_mechanism.py, -> OUT/mechanism/; per-token "
                 "errors -> --results/mechanism_per_question/, then the claims part)",
    "debate": "end to end with headroom (eval/toys/toy_debate.py, -> OUT/debate/)",
    "debate-lr": "per-arm lr of the --debate-arms (default MoD,MoE-LoRA; the first two are the references every "
                 "further arm is compared with) picked on the val split, then --debate-seeds at the picks "
                 "(-> OUT/debate/lr/; makes the debate data when missing)",
    "e2e": "the shapes-world pipeline of this module's docstring (-> OUT/results.json)",
    "mad-rounds": "MAD with --mad-rounds debate rounds beside MoD-Single / MoD-Multi 1 and 2 rounds on the first "
                  "--debate-test questions, tokens and wall time per question (eval/toys/toy_mad.py, "
                  "-> OUT/mad_rounds.json)",
    "mad-protocols": "MoD-Single / MoD-Multi of each --debate-seeds MoD adapter (trained when missing) against MAD "
                     "Du and MAD Liang on the first --debate-test questions, batch 64 and 1 (eval/toys/toy_mad.py, "
                     "-> OUT/protocols/runs/)",
    "main-a": "the main setting, first process: MoD, MoE-LoRA token and LoRA r=17 per seed 0-2, MoD-Multi 2 and "
              "3 rounds, MoE-LoRA window (waits for main-b's validation scores)",
    "main-b": "the main setting, second process: the data-mix lr sweep, the data-mix arms, LoRA r=4 and MoD "
              "shared router, seeds 0-2",
    "main-report": "the main setting's report over what is on disk, trains nothing (-> OUT/debate/lr/results_main.json, "
                   "table_main.md, figures)",
    "paper-rounds": "MoD at 1e-2 per seed 0-2, single round and MoD-Multi 1 round, then MAD 1-3 rounds beside MoD "
                    "(mad-rounds on the first 64 questions) and MoD-Multi 2 rounds (-> "
                    "OUT/debate/lr/results_paper_rounds.json, OUT/mad_rounds.json)",
    "rerun": "the two-level rerun: main-setting and paper-rounds (arm, seed) calls at the committed picks, MoD "
             "seeds 0-2 first (single, misled, MoD-Multi 1-3 rounds), per-question scores -> "
             "--results/main_per_question/main.json, then the claims part",
    "results": "write --results/paper_rounds.json, mad_rounds.json and mad_protocols.json from what is on disk",
    "claims": "rebuild --results/claims.json and main_setting.json's comparisons and arm rows from the committed "
              "per-question files (--results/*_per_question/, two-level bootstrap, eval.toys.mod_claims) and rerun_check.json; "
              "trains nothing",
}
RESUMABLE = ("debate-lr", "mad-rounds", "mad-protocols", "main-a", "main-b", "paper-rounds", "rerun")   # take --max-minutes


def lr_settings(arms=(), seeds=(0,), n_test=300, rounds=None, steps=0, lrs=(), n_val=150, tag="", picks=None,
                metrics=(), train=True, per_question=None):
    """(S, L) of one debate-lr call (`eval.toys.mod_debate.run_lr`) from the --debate-* values: arms / picks by
    folder name (`eval.toys.mod_debate.SLUGS`; picks {name: lr} fixes the lr, no sweep, and gives the arms
    in its order), rounds None = no MoD-Multi, steps / lrs / metrics empty = the defaults; per_question: the
    per-question file every scored (arm, seed) at the picks goes to (None: none)."""
    slugs = toy_debate.SLUGS
    S = dict(toy_debate.SETTINGS, arms=list(arms) or None, seeds=tuple(seeds), n_test=n_test,
             rounds=tuple(rounds) if rounds is not None else toy_debate.SETTINGS["rounds"])
    S["steps"] = steps or S["steps"]
    picks = {slugs[x]: lr for x, lr in (picks or {}).items()}
    lr_arms = tuple(picks) or tuple(slugs[x] for x in arms) or toy_debate.LR_SETTINGS["lr_arms"]
    L = dict(toy_debate.LR_SETTINGS, lrs=tuple(lrs) or toy_debate.LR_SETTINGS["lrs"], n_val=n_val, lr_arms=lr_arms,
             train=train, tag=tag, picks=picks or None, rounds=tuple(rounds or ()),
             metrics=tuple(metrics) or toy_debate.METRICS, per_question=per_question)
    return S, L


def _clock(deadline, log):
    """The drivers' `one(a, arm, lr, seed, ...)`: one `run_lr` call for `arm` at the fixed `lr` and
    `seed` (an int or a tuple) in the main setting (600 questions, 500 steps), logged with the
    minutes since the start; skipped with a note once `deadline` has passed. Returns run_lr's
    report, None when skipped."""
    t0 = time.time()

    def one(a, arm, lr, seed, tag="_step", rounds=None, train=True, **kw):
        if late(deadline):
            log(f"--max-minutes reached: {arm}={lr:g} seed {seed} not run")
            return None
        log(f"[{(time.time() - t0) / 60:.0f} min] {arm}={lr:g} seed {seed}" + (f", rounds {rounds}" if rounds else ""))
        S, L = lr_settings(seeds=(seed,) if isinstance(seed, int) else seed, n_test=MAIN["n_test"],
                           steps=MAIN["steps"], picks={arm: lr}, tag=tag, rounds=rounds, train=train,
                           per_question=os.path.join(a.results, mod_claims.MAIN), **kw)
        return toy_debate.run_lr(a.data, a.out, a.model, S=S, L=L, log=log, deadline=deadline)
    return one


def mix_picks(out_dir):
    """{folder name: lr} of the data-mix arms, picked by main-b's sweep (OUT/debate/lr/results_mix_sweep.json).
    Raises FileNotFoundError naming the part to run first."""
    f = os.path.join(out_dir, "debate", "lr", "results_mix_sweep.json")
    if not os.path.exists(f):
        raise FileNotFoundError(f"{f} missing: the data-mix sweep of --part main-b is not finished")
    with open(f) as fh:
        picks = json.load(fh)["picks"]
    return {x: picks[toy_debate.SLUGS[x]] for x in MIX_ARMS}


def run_main(a, deadline=None, log=print):
    """The main setting (eval/logs/mod.md), `a.part` main-a / main-b / main-report: each (arm, seed)
    one `run_lr` call at its validated lr (600 questions, 500 steps); main-a waits for main-b's
    validation scores (OUT/debate/lr/base_val.json). No call starts after `deadline`."""
    one = _clock(deadline, log)
    lroot = os.path.join(a.out, "debate", "lr")
    if a.part == "main-a":
        while not os.path.exists(os.path.join(lroot, "base_val.json")):   # main-b makes prep.json and the val scores
            if late(deadline):
                log("--max-minutes reached before main-b's validation scores: nothing run")
                return
            time.sleep(20)
        for per_seed in MAIN_A:
            for arm, lr, seed in per_seed:
                one(a, arm, lr, seed)
        for seed in MAIN["seeds"]:
            one(a, "MoD", 1e-2, seed, rounds=(2, 3))
        for seed in MAIN["seeds"]:
            one(a, "MoE-LoRA_window", 5e-3, seed)
    elif a.part == "main-b":
        if late(deadline):
            log("--max-minutes reached: the data-mix sweep not run")
            return
        S, L = lr_settings(arms=MIX_ARMS, n_test=MAIN["n_test"], tag="_mix_sweep")
        if toy_debate.run_lr(a.data, a.out, a.model, S=S, L=L, log=log, deadline=deadline) is not None:
            mix = mix_picks(a.out)
            for seed in MAIN["seeds"]:
                for arm in MIX_ARMS:
                    one(a, arm, mix[arm], seed)
        for arm, lr in MAIN_B:
            for seed in MAIN["seeds"]:
                one(a, arm, lr, seed)
    else:
        picks = {"MoD": 1e-2, "MoE-LoRA": 5e-3, "LoRA": 5e-3, "LoRA_r4": 1e-2, "MoE-LoRA_window": 5e-3,
                 "MoD_shared": 1e-2, **mix_picks(a.out)}
        S, L = lr_settings(seeds=MAIN["seeds"], n_test=MAIN["n_test"], steps=MAIN["steps"], picks=picks,
                           tag="_main", rounds=(2, 3), train=False,
                           per_question=os.path.join(a.results, mod_claims.MAIN))
        toy_debate.run_lr(a.data, a.out, a.model, S=S, L=L, log=log)
        mod_claims.rebuild(a.results, log)


def run_rerun(a, deadline=None, log=print):
    """The two-level rerun (eval/logs/mod.md, 2026-12-02): the main setting's and the paper-rounds
    (arm, seed) calls at the committed picks, in the paper-rounds order first: MoD seeds 0-2
    (single, misled own, misled other scene, MoD-Multi 1, 2, 3 rounds), then main-a's order for the
    rest (MoE-LoRA token and LoRA r=17 per seed, MoE-LoRA window), then main-b's. Every scored
    (arm, seed) goes to --results/main_per_question/main.json; claims.json is rebuilt at the end
    (`eval.toys.mod_claims`). Nothing new starts after `deadline`; rerun to continue."""
    one = _clock(deadline, log)
    for seed in MAIN["seeds"]:
        one(a, "MoD", 1e-2, seed, rounds=(1, 2, 3))
    for per_seed in MAIN_A:
        for arm, lr, seed in per_seed[1:]:
            one(a, arm, lr, seed)
    for seed in MAIN["seeds"]:
        one(a, "MoE-LoRA_window", 5e-3, seed)
    if not late(deadline):
        run_main(argparse.Namespace(**{**vars(a), "part": "main-b"}), deadline, log)
    mod_claims.rebuild(a.results, log)


def run_paper_rounds(a, deadline=None, log=print):
    """MoD-Multi as the paper defines it (eval/logs/mod.md): MoD at 1e-2 per seed 0-2 (600 questions,
    500 steps) scored on the single round and MoD-Multi 1 round (-> results_paper_rounds.json);
    then MAD with 1-3 debate rounds beside MoD-Single / MoD-Multi of seed 0 on the first
    `PAPER_ROUNDS_MAD_TEST` questions (`eval.toys.mod_mad.run`); then MoD-Multi 2 rounds on the seeds
    trained; last the report over everything on disk. Nothing new starts after `deadline`."""
    one = _clock(deadline, log)
    kw = dict(tag="_paper_rounds", metrics=("single",))
    done = [s for s in MAIN["seeds"] if one(a, "MoD", 1e-2, s, rounds=(1,), **kw) is not None]
    if late(deadline):
        log("--max-minutes reached: MAD by rounds and MoD-Multi 2 rounds not run")
    else:
        toy_mad.run(a.data, a.out, a.model, PAPER_ROUNDS_MAD_TEST, (1, 2, 3), log=log, deadline=deadline)
        if done:
            one(a, "MoD", 1e-2, tuple(done), rounds=(1, 2), train=False, **kw)
    S, L = lr_settings(seeds=MAIN["seeds"], n_test=MAIN["n_test"], steps=MAIN["steps"], picks={"MoD": 1e-2},
                       rounds=(1, 2), train=False, per_question=os.path.join(a.results, mod_claims.MAIN), **kw)
    toy_debate.run_lr(a.data, a.out, a.model, S=S, L=L, log=log)
    mod_claims.rebuild(a.results, log)


def _ints(p, flag, text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag} takes comma-separated integers, e.g. 0,1,2")


def main(argv=None):
    p = entry_parser(__spec__.name, "Toy reproduction of Mixture of Debaters on the shapes world: every MoD "
                     "experiment of eval/results/mod/ is one --part.")
    p.add_argument("--part", default="all", choices=list(PARTS),
                   help="; ".join(f"{k}: {v}" for k, v in PARTS.items()))
    p.add_argument("--quick", action="store_true", help="main rows only (~3 CPU minutes)")
    p.add_argument("--data", default="out/data", help="shapes data directory (generated if missing)")
    p.add_argument("--out", default="out/mod", help="output directory (results.json, adapters, heatmaps)")
    p.add_argument("--model", default="tiny-chat", help="frozen base model: checkpoint dir or tiny-chat")
    add_threads(p)
    p.add_argument("--max-minutes", type=number(float, above=0), default=None,
                   help=f"--part {', '.join(RESUMABLE)}: start no training or scoring after this many minutes "
                        "(what is done is reported; rerun the same command to continue)")
    p.add_argument("--debate-arms", default="", help="debate part: arms to train / score when missing, comma "
                   "separated folder names (default: all; every arm on disk is reported)")
    p.add_argument("--debate-seeds", default="0", help="debate, debate-lr, mad-protocols: training seeds, comma "
                   "separated")
    p.add_argument("--debate-rounds", default=None, help="MoD-Multi rounds scored on the MoD arm's adapters, comma "
                   "separated (default: 2 in the debate part, none in debate-lr)")
    p.add_argument("--debate-test", type=int, default=300, help="debate parts, mad-rounds, mad-protocols: test "
                   "questions (the first N of the shapes test split, default 300; in debate-lr other sizes are "
                   "scored into scores_test<N>.json)")
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
    p.add_argument("--batch1-test", type=number(min=1), default=None, help="mad-protocols part: at batch 1 only the "
                   "first N of the --debate-test questions (per-question cost; default: all)")
    p.add_argument("--results", default="eval/results/mod", help="results and claims parts: where the result files "
                   "go (rewritten); every part that scores test runs keeps their per-question scores in "
                   "<RESULTS>/<part>_per_question/ (eval.toys.mod_claims)")
    p.add_argument("--mechanism-lr", default="sweep", choices=("sweep", "committed"), help="mechanism part: pick "
                   "each arm's lr on validation (sweep) or train the test seeds at the registered run's picks "
                   "(committed: eval.toys.mod_mechanism.COMMITTED_PICKS)")
    p.add_argument("--overwrite", action="store_true", help="mechanism part: replace a run in its per-question "
                   "file that holds other scores for it (default: error)")
    a = p.parse_args(argv)
    SLUGS = toy_debate.SLUGS
    arms = [x.strip() for x in a.debate_arms.split(",") if x.strip()]
    if [x for x in arms if x not in SLUGS]:
        p.error(f"--debate-arms: unknown {[x for x in arms if x not in SLUGS]}; choose from {sorted(SLUGS)}")
    seeds = _ints(p, "--debate-seeds", a.debate_seeds)
    rounds = _ints(p, "--debate-rounds", a.debate_rounds or "")
    if not seeds or any(k < 1 for k in rounds) or a.debate_test < 1:
        p.error("--debate-seeds needs at least one seed; --debate-rounds values and --debate-test must be >= 1")
    try:
        lrs = tuple(float(x) for x in a.debate_lrs.split(",") if x.strip())
    except ValueError:
        p.error("--debate-lrs takes comma-separated numbers, e.g. 2e-3,5e-3,1e-2")
    if any(x <= 0 for x in lrs) or a.debate_val < 1:
        p.error("--debate-lrs values must be > 0 and --debate-val >= 1")
    picks = {}
    for item in [x.strip() for x in a.debate_picks.split(",") if x.strip()]:
        slug, _, lr = item.partition("=")
        try:
            SLUGS[slug.strip()]
            picks[slug.strip()] = float(lr)
        except (KeyError, ValueError):
            p.error(f"--debate-picks: {item!r} is not ARM=LR with ARM in {sorted(SLUGS)}, "
                    "e.g. MoD=1e-2,MoE-LoRA=5e-3")
    if a.debate_steps < 0 or any(v <= 0 for v in picks.values()):
        p.error("--debate-steps must be >= 1 (0 = the default 300) and --debate-picks lrs > 0")
    metrics = tuple(x.strip() for x in a.debate_metrics.split(",") if x.strip())
    if [m for m in metrics if m not in toy_debate.METRICS]:
        p.error(f"--debate-metrics: choose from {','.join(toy_debate.METRICS)}")
    mad_rounds = tuple(_ints(p, "--mad-rounds", a.mad_rounds))
    if not mad_rounds or min(mad_rounds) < 1:
        p.error("--mad-rounds needs at least one value, each >= 1")
    if a.max_minutes is not None and a.part not in RESUMABLE:
        p.error(f"--max-minutes goes with --part {', '.join(RESUMABLE)}")
    deadline = None if a.max_minutes is None else time.time() + 60 * a.max_minutes   # a run-length limit
    set_threads(a.threads, a.model)
    try:
        if a.part == "results":
            toy_mad.write_results(a.out, a.results)
        elif a.part == "claims":
            mod_claims.rebuild(a.results)
        elif a.part == "mad-rounds":
            toy_mad.run(a.data, a.out, a.model, a.debate_test, mad_rounds, a.mad_adapter or None, deadline=deadline)
        elif a.part == "mad-protocols":
            toy_mad.run_protocols(a.data, a.out, a.model, a.debate_test, tuple(seeds), batch1_test=a.batch1_test,
                                  deadline=deadline)
        elif a.part in ("main-a", "main-b", "main-report"):
            run_main(a, deadline)
        elif a.part == "paper-rounds":
            run_paper_rounds(a, deadline)
        elif a.part == "rerun":
            run_rerun(a, deadline)
        elif a.part == "debate-lr":
            S, L = lr_settings(arms, seeds, a.debate_test, rounds if a.debate_rounds is not None else None,
                               a.debate_steps, lrs, a.debate_val, a.debate_lr_tag, picks, metrics,
                               not a.debate_no_train)
            toy_debate.run_lr(a.data, a.out, a.model, S=S, L=L, deadline=deadline)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    if a.part in ("all", "mechanism") and not a.quick:
        try:
            toy_mechanism.run(os.path.join(a.out, "mechanism"), overwrite=a.overwrite,
                              picks=toy_mechanism.COMMITTED_PICKS if a.mechanism_lr == "committed" else None,
                              per_question=os.path.join(a.results, mod_claims.MECH))
            mod_claims.rebuild(a.results)
        except ValueError as e:
            fail(str(e))
    if a.part in ("all", "debate") and not a.quick:
        S, _ = lr_settings(arms, seeds, a.debate_test, rounds if a.debate_rounds is not None else None)
        toy_debate.run(a.data, a.out, a.model, S=S)
    if a.part not in ("all", "e2e"):
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
