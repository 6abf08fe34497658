"""MAD beside MoD-Single / MoD-Multi: accuracy, generated tokens and wall time per question on
the same test questions, in two parts (designs in eval/logs/mod.md).

The paper (Mixture of Debaters, arXiv 2606.29425, §4, App. B.4) compares MoD's latency and
tokens with Liang et al.'s MAD ("two debaters and one judge ... over multiple rounds").

**Both protocols** (`run_protocols`, "MoD-Multi against MAD as Liang et al.'s official
protocol"): each seed's MoD adapter (trained here when missing, the main setting's settings)
gives MoD-Single and MoD-Multi (1 debate round); MAD Du-style (`multi_agent_debate`, seed s) and
MAD Liang (`liang_debate`, greedy: one run for all seeds) run on the frozen base; every arm at
batch 64 and batch 1 -> OUT/protocols/runs/, then `protocol_rows` -> mad_protocols.json:

    python -m eval.toys.mod --part mad-protocols --debate-seeds 0,1,2 --debate-test 64 --batch1-test 16 --threads 1
    python -m eval.toys.mod --part results

**Du-style MAD by debate rounds** (`run`, "MoD-Multi as the paper defines it"):
`mod.infer.multi_agent_debate` runs `rounds` debate rounds: 2 + 2 rounds + 1 generations per
question. This part scores MAD for each of `rounds` on the frozen base and, on the same
questions in the same process (one thread, batch 64), MoD-Single and MoD-Multi with 1 and 2
debate rounds from one saved MoD adapter, interleaved (Single, MAD 1, Multi 1, MAD 2, Multi 2,
MAD 3, ...). Each finished method is written to OUT/mad_rounds.json at once and skipped when
present (resumable).

    python -m eval.toys.mod --part mad-rounds --mad-rounds 1,2,3 --debate-test 200 --threads 1

`write_results` (`python -m eval.toys.mod --part results`) turns these runs and the paper-rounds
runs (`--part paper-rounds`) into eval/results/mod/paper_rounds.json, mad_rounds.json and
mad_protocols.json.
"""
import copy
import glob
import json
import os

import numpy as np
import torch

from common.cli import late
from common.data import atomic_write_text
from eval.metrics import bootstrap_ci
from eval.toys.mod_debate import SETTINGS, _paired, arm_records, load_data, prepare, verdict_over
from mod.infer import liang_debate, mod_debate, multi_agent_debate, summarize
from mod.model import AdapterConfig, attach, load_adapters, save_adapters
from mod.train import TrainConfig, fit

DEFAULT_ADAPTER = os.path.join("debate", "lr", "MoD_lr0.01_steps500_s0")   # the main setting's MoD, seed 0


def _tuned(base, adapter_dir):
    """A deep copy of the frozen `base` with the MoD adapters of `adapter_dir`, in eval mode
    (loaded once per run, only when a MoD arm is still to run)."""
    tuned = copy.deepcopy(base)
    load_adapters(tuned, adapter_dir)
    return tuned.eval()


def order(rounds, mod_rounds=(1, 2)):
    """The interleaved method order: MoD-Single, then MAD k and MoD-Multi k alternating
    (mod_rounds None: MAD only)."""
    if mod_rounds is None:
        return [f"mad{k}" for k in rounds]
    out = ["mod_single"]
    for i in range(max(len(rounds), len(mod_rounds))):
        out += [f"mad{rounds[i]}"] if i < len(rounds) else []
        out += [f"mod_multi{mod_rounds[i]}"] if i < len(mod_rounds) else []
    return out


def run(data_dir="out/data", out_dir="out/mod", base_name="tiny-chat", n_test=200, rounds=(1, 2, 3),
        adapter=None, batch_size=64, log=print, deadline=None):
    """Score every method of `order(rounds)` missing from OUT/mad_rounds.json on the first `n_test`
    shapes test questions -> that file: per method accuracy [95% bootstrap CI], tokens and wall
    seconds per question, generations per question, and ratios to MoD-Multi 1 round. `adapter`:
    a MoD adapter folder (default OUT/debate/lr/MoD_lr0.01_steps500_s0), "none": MAD rows only.
    deadline (`late`, --max-minutes): no method starts after it (rerun to continue).
    Raises FileNotFoundError naming the folder when it holds no adapter."""
    adapter = adapter or os.path.join(out_dir, DEFAULT_ADAPTER)
    if adapter != "none" and not os.path.exists(os.path.join(adapter, "adapter_model.safetensors")):
        raise FileNotFoundError(f"{adapter} holds no MoD adapter: train it first (python -m eval.toys.mod --part "
                                "paper-rounds) or pass --mad-adapter DIR")
    _, test, base, proc = load_data(data_dir, base_name, dict(SETTINGS, n_test=n_test))
    path = os.path.join(out_dir, "mad_rounds.json")
    out = {"settings": {"n_test": len(test), "rounds": list(rounds), "adapter": adapter, "batch_size": batch_size,
                        "threads": torch.get_num_threads()}, "methods": {}}
    if os.path.exists(path):
        with open(path) as fh:
            out = json.load(fh)
        if out["settings"]["n_test"] != len(test) or out["settings"]["adapter"] != adapter:
            raise ValueError(f"{path} was made for {out['settings']['n_test']} questions / {out['settings']['adapter']}: "
                             "move it away to start over")
    tuned = None
    for name in order(tuple(rounds), None if adapter == "none" else (1, 2)):
        if name in out["methods"]:
            continue
        if late(deadline):
            log(f"  --max-minutes reached: {name} not run")
            continue
        if name.startswith("mod") and tuned is None:
            tuned = _tuned(base, adapter)
        with torch.inference_mode():
            if name == "mod_single":
                res, wall = mod_debate(tuned, proc, test, 0, batch_size)
                gens = 1
            elif name.startswith("mod_multi"):
                k = int(name[len("mod_multi"):])
                res, wall = mod_debate(tuned, proc, test, k, batch_size)
                gens = k + 1
            else:
                k = int(name[3:])
                res, wall = multi_agent_debate(base, proc, test, k, batch_size=batch_size)
                gens = 2 + 2 * k + 1
        s = summarize(name, res, wall)
        lo, hi = bootstrap_ci(np.array([r["correct"] for r in res], dtype=float))
        out["methods"][name] = {"accuracy": s["accuracy"], "ci_low": lo, "ci_high": hi, "n": s["n"],
                                "tokens_per_q": s["tokens_per_q"], "wall_s": wall, "wall_per_q": wall / len(test),
                                "generations_per_q": gens, "results": res}
        log(f"  {name:12s} acc {s['accuracy']:.3f} tokens/q {s['tokens_per_q']:6.1f} wall/q {wall / len(test):.3f} s")
        atomic_write_text(path, json.dumps(out))
    ref = out["methods"].get("mod_multi1")
    if ref:
        for m in out["methods"].values():
            m["tokens_vs_mod_multi1"] = m["tokens_per_q"] / ref["tokens_per_q"]
            m["wall_vs_mod_multi1"] = m["wall_per_q"] / ref["wall_per_q"]
    atomic_write_text(path, json.dumps(out))
    return out


# ---- MoD-Multi against both MAD protocols (eval/logs/mod.md, "MoD-Multi against MAD as Liang et al.'s ...") ----

PROTOCOL_STEPS, PROTOCOL_LR = 500, 1e-2   # the main setting's MoD: lr 1e-2, 500 steps, warm-up 50, batch 8
# interleaved per (seed, batch): MAD Liang is greedy (no seed enters it), so it runs at the first seed only
PROTOCOL_ARMS = ("mod_single", "mad_du", "mod_multi1", "mad_liang")
PROTOCOL_NAMES = {"mod_single": "MoD-Single", "mod_multi1": "MoD-Multi (1 round)", "mad_du": "MAD Du",
                  "mad_liang": "MAD Liang"}
PAPER_RATIOS = {"tokens": 0.13, "wall": 1 / 3.7}   # MoD over MAD: 87 % fewer tokens, 3.7x lower latency


def mod_folder(root, seed):
    """The folder of `seed`'s MoD adapter at the main setting's settings (`train_mod`)."""
    return os.path.join(root, f"MoD_lr{PROTOCOL_LR:g}_steps{PROTOCOL_STEPS}_s{seed}")


def train_mod(root, base, proc, prep, seed, log=print):
    """The MoD adapter of `seed` at the main setting's settings (`PROTOCOL_LR`, `PROTOCOL_STEPS`,
    batch 8, warm-up a tenth of the steps) on prep.json's 1:1:1 mix, in
    root/MoD_lr<LR>_steps<N>_s<seed> (resumable from its checkpoints; kept when finished).
    Returns (folder, {"loss", "wall_s", "step0_loss"})."""
    d = mod_folder(root, seed)
    info_f = os.path.join(d, "train.json")
    if os.path.exists(info_f) and os.path.exists(os.path.join(d, "adapter_model.safetensors")):
        with open(info_f) as fh:
            return d, json.load(fh)
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    attach(model, AdapterConfig(method="mod"))
    tr = fit(model, proc, arm_records(root, prep, "MoD"), d, TrainConfig(steps=PROTOCOL_STEPS, batch_size=8, lr=PROTOCOL_LR,
             warmup=max(1, PROTOCOL_STEPS // 10), seed=seed, save_every=100, resume=True), desc=f"train {d}", quiet=True)
    save_adapters(model, d)
    info = {"loss": tr["loss"], "wall_s": tr["wall_s"], "step0_loss": tr["log"][0]["loss"]}
    atomic_write_text(info_f, json.dumps(info))
    log(f"  trained {d}: loss {info['loss']:.4f} (step 0 {info['step0_loss']:.7f}), {info['wall_s']:.0f} s")
    return d, info


def run_protocols(data_dir="out/data", out_dir="out/mod", base_name="tiny-chat", n_test=64, seeds=(0, 1, 2),
                  batch_sizes=(64, 1), batch1_test=None, log=print, deadline=None):
    """MoD-Single / MoD-Multi (rounds=1) of each seed's MoD adapter (trained when missing, `train_mod`)
    and MAD Du (seed s) / MAD Liang on the frozen base, on the first `n_test` shapes test questions,
    at every batch size of `batch_sizes`, interleaved (`PROTOCOL_ARMS`). Each finished (arm, batch,
    seed) is written to OUT/protocols/runs/<arm>_b<batch>[_s<seed>].json at once and skipped when
    present (resumable): {"arm", "seed", "batch_size", "n", "wall_s", "threads", "results"}.
    batch1_test: at batch 1 only the first `batch1_test` of the questions (per-question cost; None =
    all). deadline (`late`, --max-minutes): no training and no (arm, batch, seed) run starts after
    it (rerun to continue)."""
    S = dict(SETTINGS, n_test=n_test)
    train, test, base, proc = load_data(data_dir, base_name, S)
    root = os.path.join(out_dir, "protocols")
    runs = os.path.join(root, "runs")
    os.makedirs(runs, exist_ok=True)
    prep = prepare(root, base, proc, train, test, S, log)   # the main setting's data (its training part)
    for seed in seeds:
        if not os.path.exists(os.path.join(mod_folder(root, seed), "train.json")) and late(deadline):
            log(f"  --max-minutes reached: MoD seed {seed} not trained, its runs not run")
            continue
        d, _ = train_mod(root, base, proc, prep, seed, log)
        tuned = None
        for b in batch_sizes:
            qs = test[:batch1_test] if b == 1 and batch1_test else test
            for arm in PROTOCOL_ARMS:
                f = os.path.join(runs, f"{arm}_b{b}.json" if arm == "mad_liang" else f"{arm}_b{b}_s{seed}.json")
                if os.path.exists(f):
                    continue
                if late(deadline):
                    log(f"  --max-minutes reached: seed {seed} batch {b} {arm} not run")
                    continue
                if arm.startswith("mod") and tuned is None:
                    tuned = _tuned(base, d)
                with torch.inference_mode():
                    if arm == "mod_single":
                        res, wall = mod_debate(tuned, proc, qs, 0, b)
                    elif arm == "mod_multi1":
                        res, wall = mod_debate(tuned, proc, qs, 1, b)
                    elif arm == "mad_du":
                        res, wall = multi_agent_debate(base, proc, qs, 1, batch_size=b, seed=seed)
                    else:
                        res, wall = liang_debate(base, proc, qs, batch_size=b)
                s = summarize(arm, res, wall)
                atomic_write_text(f, json.dumps({"arm": arm, "seed": seed, "batch_size": b, "n": len(res), "wall_s": wall,
                                                 "threads": torch.get_num_threads(), "results": res}))
                log(f"  seed {seed} batch {b:2d} {arm:10s} acc {s['accuracy']:.3f} tokens/q {s['tokens_per_q']:6.1f} "
                    f"wall/q {wall / len(res):.3f} s")


# ---- result files for eval/results/mod/ (the report format of eval/report.py) ----

NAMES = {"single": "MoD-Single", "multi1": "MoD-Multi (paper: 1 debate round)", "multi2": "MoD-Multi 2 debate rounds",
         "multi3": "MoD-Multi 3 debate rounds"}
MAIN_STEP0 = {0: 0.0548412, 1: 0.0604036, 2: 0.0168251}   # the main setting's step-0 losses (eval/logs/mod.md)


def result_rows(out_dir="out/mod", tag="_paper_rounds"):
    """Rows of eval/results/mod/paper_rounds.json from OUT/debate/lr/results<tag>.json and the per-seed
    score files: accuracy per method (pooled over the seeds scored, and per seed), generated tokens
    per question, the paired comparisons with MoD-Single (`rounds` of the lr report, with their
    verdicts), the step-0 losses against the main setting's. None when MoD has no test score yet.
    Raises FileNotFoundError without the report file."""
    lroot = os.path.join(out_dir, "debate", "lr")
    with open(os.path.join(lroot, f"results{tag}.json")) as fh:
        rep = json.load(fh)
    if "MoD" not in rep["test"]:
        return None
    mod = rep["test"]["MoD"]
    rows = []
    base = rep["test"].get("base", {}).get("single")
    if base:
        rows.append({"kind": "arm", "arm": "frozen base (JSON prompt)", "metric": "single", "seed": "pooled",
                     "value": round(base["accuracy"], 3), "ci_low": round(base["ci_low"], 3),
                     "ci_high": round(base["ci_high"], 3), "n": base["n"], "seeds": 1})
    for m in [x for x in ("single", "multi1", "multi2", "multi3") if x in mod]:
        t = mod[m]
        toks = []
        for s in t["seeds"]:
            with open(os.path.join(lroot, f"MoD_lr0.01_steps500_s{s}", "scores_test600.json")) as fh:
                toks.append(float(np.mean([r["n_tokens"] for r in json.load(fh)["results"][m]])))
        rows.append({"kind": "arm", "arm": NAMES[m], "metric": m, "seed": "pooled", "value": round(t["accuracy"], 3),
                     "ci_low": round(t["ci_low"], 3), "ci_high": round(t["ci_high"], 3), "n": t["n"],
                     "seeds": len(t["seeds"]), "tokens_per_q": round(float(np.mean(toks)), 1)})
        rows += [{"kind": "arm", "arm": NAMES[m], "metric": m, "seed": s, "value": round(v, 3), "n": t["n"],
                  "tokens_per_q": round(tk, 1)} for s, v, tk in zip(t["seeds"], t["per_seed"], toks)]
    for m, pb in rep["rounds"].items():
        hyp = ("H8 MoD-Multi (paper: 1 debate round) > MoD-Single" if m == "multi1" else
               f"H7 check: {NAMES[m]} > MoD-Single")
        rows.append({"kind": "compare", "hypothesis": hyp, "metric": "single", "value": round(pb["diff"], 3),
                     "ci_low": round(pb["ci_low"], 3), "ci_high": round(pb["ci_high"], 3), "n": pb["n"],
                     "seeds": len(pb["seeds"]), "per_seed": [round(x, 3) for x in pb["per_seed"]],
                     "verdict": pb["verdict"]})
    for s, v in zip(mod["seeds"], mod.get("step0_loss", [])):
        rows.append({"kind": "step0_loss", "seed": s, "value": round(v, 7), "main_setting": MAIN_STEP0.get(s),
                     "same_data": round(v, 7) == MAIN_STEP0.get(s)})
    return rows


def mad_rows(out_dir="out/mod"):
    """Rows of eval/results/mod/mad_rounds.json from OUT/mad_rounds.json (`run`)."""
    with open(os.path.join(out_dir, "mad_rounds.json")) as fh:
        d = json.load(fh)
    mad1 = d["methods"].get("mad1")
    label = lambda m: (f"MAD Du-style, {m[3:]} debate round{'s' if m[3:] != '1' else ''} (2 debaters + judge)"
                       if m.startswith("mad") else NAMES["single" if m == "mod_single" else m[4:]])
    return [{"kind": "mad_rounds", "method": label(m), "key": m, "n": v["n"], "value": round(v["accuracy"], 3),
             "ci_low": round(v["ci_low"], 3), "ci_high": round(v["ci_high"], 3),
             "generations_per_q": v["generations_per_q"], "tokens_per_q": round(v["tokens_per_q"], 1),
             "wall_per_q_s": round(v["wall_per_q"], 3), "tokens_vs_mod_multi1": round(v.get("tokens_vs_mod_multi1", 0), 2) or None,
             "wall_vs_mod_multi1": round(v.get("wall_vs_mod_multi1", 0), 2) or None,
             **({"tokens_vs_mad1": round(v["tokens_per_q"] / mad1["tokens_per_q"], 2),
                 "wall_vs_mad1": round(v["wall_per_q"] / mad1["wall_per_q"], 2)} if mad1 else {})}
            for m, v in d["methods"].items()], d["settings"]


def ratio_reading(ratios, paper):
    """The pre-registered reading of MoD-Multi / MAD ratios (one per seed) against the paper's
    ratio: "reproduced" if every ratio <= paper, "direction only" if every ratio < 1, else
    "not reproduced". Raises ValueError on no ratios."""
    if not ratios:
        raise ValueError("no ratio to read")
    if all(r <= paper for r in ratios):
        return "reproduced"
    return "direction only" if all(r < 1 for r in ratios) else "not reproduced"


def protocol_rows(out_dir="out/mod"):
    """Rows of eval/results/mod/mad_protocols.json from OUT/protocols/runs/ (`run_protocols`):
    per (arm, batch) the seed-averaged accuracy [95% bootstrap CI] and the mean tokens / wall
    seconds per question over the seeds run (Liang: one greedy run, paired with every seed; its
    rounds used, the shares the moderator ended and the judge decided); per (MAD protocol,
    batch) MoD-Multi / MAD token and wall ratios per seed with `ratio_reading` against the
    paper's; per MAD protocol the paired accuracy difference MoD-Multi minus MAD (batch 64, the
    toy's `verdict_over`). Returns (rows, settings); raises FileNotFoundError when nothing ran."""
    runs = {}
    for f in sorted(glob.glob(os.path.join(out_dir, "protocols", "runs", "*.json"))):
        with open(f) as fh:
            d = json.load(fh)
        runs[(d["arm"], d["batch_size"], None if d["arm"] == "mad_liang" else d["seed"])] = d
    if not runs:
        raise FileNotFoundError(f"{out_dir}/protocols/runs holds no run: python -m eval.toys.mod --part "
                                "mad-protocols first")
    seeds = sorted({s for (a, _, s) in runs if a == "mod_multi1"})
    sizes = sorted({b for (_, b, _) in runs}, reverse=True)
    get = lambda arm, b, s: runs.get((arm, b, None if arm == "mad_liang" else s))
    per_q = lambda d, key: float(np.mean([r[key] for r in d["results"]]))
    rows = []
    for b in sizes:
        for arm in PROTOCOL_ARMS:
            got = {s: get(arm, b, s) for s in seeds if get(arm, b, s)}
            if not got:
                continue
            uniq = list({id(d): d for d in got.values()}.values())   # Liang: one run for every seed
            corr = np.mean([[r["correct"] for r in d["results"]] for d in uniq], axis=0)
            lo, hi = bootstrap_ci(corr)
            row = {"kind": "protocol_arm", "arm": PROTOCOL_NAMES[arm], "key": arm, "batch_size": b,
                   "setting": f"batch {b}, {len(corr)} q.",
                   "seeds": "greedy, no seed" if arm == "mad_liang" else ",".join(map(str, got)),
                   "n": len(corr), "value": round(float(corr.mean()), 3), "ci_low": round(lo, 3), "ci_high": round(hi, 3),
                   "tokens_per_q": round(float(np.mean([per_q(d, "n_tokens") for d in uniq])), 1),
                   "wall_per_q_s": round(float(np.mean([d["wall_s"] / d["n"] for d in uniq])), 3)}
            if arm == "mad_liang":
                res = uniq[0]["results"]
                row.update(rounds_mean=round(per_q(uniq[0], "rounds"), 2),
                           moderator_share=round(float(np.mean([r["decided_by"] == "moderator" for r in res])), 3),
                           judged_share=round(float(np.mean([r["decided_by"] == "judge" for r in res])), 3))
            rows.append(row)
        for mad in ("mad_liang", "mad_du"):
            pairs = [(s, get("mod_multi1", b, s), get(mad, b, s)) for s in seeds]
            pairs = [(s, m, x) for s, m, x in pairs if m and x]
            if not pairs:
                continue
            rt = [per_q(m, "n_tokens") / per_q(x, "n_tokens") for _, m, x in pairs]
            rw = [(m["wall_s"] / m["n"]) / (x["wall_s"] / x["n"]) for _, m, x in pairs]
            for what, rs in (("tokens", rt), ("wall", rw)):
                rows.append({"kind": "protocol_ratio", "mad": PROTOCOL_NAMES[mad], "key": mad, "batch_size": b,
                             "what": what, "setting": f"batch {b}",
                             "row": f"{what}, vs {PROTOCOL_NAMES[mad]} (paper {PAPER_RATIOS[what]:.2f})", "seeds": ",".join(str(s) for s, _, _ in pairs),
                             "per_seed": [round(r, 3) for r in rs], "value": round(float(np.mean(rs)), 3),
                             "min": round(min(rs), 3), "max": round(max(rs), 3),
                             "paper": round(PAPER_RATIOS[what], 3),
                             "reading": ratio_reading(rs, PAPER_RATIOS[what]) + (
                                 f" ({len(rs)} seed{'s' if len(rs) > 1 else ''} of 3)" if len(rs) < 3 else "")})
    b = max(sizes)
    for mad in ("mad_liang", "mad_du"):
        common = [s for s in seeds if get("mod_multi1", b, s) and get(mad, b, s)]
        if not common:
            continue
        pb = _paired({s: get("mod_multi1", b, s)["results"] for s in common},
                     {s: get(mad, b, s)["results"] for s in common}, common)
        rows.append({"kind": "protocol_accuracy", "hypothesis": f"MoD-Multi > {PROTOCOL_NAMES[mad]}", "key": mad,
                     "batch_size": b, "value": round(pb["diff"], 3), "ci_low": round(pb["ci_low"], 3),
                     "ci_high": round(pb["ci_high"], 3), "n": len(get(mad, b, common[0])["results"]),
                     "seeds": ",".join(map(str, common)), "per_seed": [round(x, 3) for x in pb["per_seed"]],
                     "verdict": verdict_over(pb)})
    threads = sorted({d.get("threads") for d in runs.values()})
    return rows, {"seeds": seeds, "batch_sizes": sizes, "threads": threads}


def write_results(out_dir="out/mod", results_dir="eval/results/mod", log=print):
    """Write the committed result files (eval.report format) from what is on disk under `out_dir`:
    results_dir/paper_rounds.json (`result_rows`, when MoD has test scores), mad_rounds.json
    (`mad_rows`, when OUT/mad_rounds.json exists) and mad_protocols.json (`protocol_rows`, when
    OUT/protocols/runs exists); each file is rewritten atomically. Returns the names written."""
    written = []
    src = ("python -m eval.toys.mod --part paper-rounds --threads 1 (eval/logs/mod.md, 'MoD-Multi as the paper defines "
           "it'): MoD at lr 1e-2, 500 steps, the main setting's data (step-0 losses below), the first 600 shapes test "
           "questions, one thread; pooled = the seed-averaged item correctness with its 95% bootstrap CI; compare = "
           "paired bootstrap of the seed-averaged difference, verdict by eval.toys.mod_debate.verdict_over; then "
           "python -m eval.toys.mod --part results")
    try:
        rows = result_rows(out_dir)
    except FileNotFoundError:
        rows = None
    if rows:
        atomic_write_text(os.path.join(results_dir, "paper_rounds.json"),
                          json.dumps({"experiment": "mod_paper_rounds", "source": src, "rows": rows}, indent=1) + "\n")
        written.append("paper_rounds.json")
    else:
        log("no MoD test scores of --part paper-rounds yet: paper_rounds.json not written")
    if os.path.exists(os.path.join(out_dir, "mad_rounds.json")):
        rows, st = mad_rows(out_dir)
        atomic_write_text(os.path.join(results_dir, "mad_rounds.json"), json.dumps(
            {"experiment": "mod_mad_rounds", "source": f"python -m eval.toys.mod --part mad-rounds --mad-rounds "
             f"{','.join(map(str, st['rounds']))} --debate-test {st['n_test']}"
             + (" --mad-adapter none" if st["adapter"] == "none" else "") + " --threads 1 (eval/toys/mod_mad.py): the "
             + ("frozen base (MAD only, no MoD rows)" if st["adapter"] == "none" else
                f"frozen base (MAD) and the MoD adapter {st['adapter']} (MoD-Single / MoD-Multi)") + " on the same first "
             f"{st['n_test']} shapes test questions, batch {st['batch_size']}, one thread, one process, methods "
             "interleaved; wall time per question is load-dependent, tokens per question are not", "rows": rows},
            indent=1) + "\n")
        written.append("mad_rounds.json")
    if os.path.isdir(os.path.join(out_dir, "protocols", "runs")):
        rows, st = protocol_rows(out_dir)
        n = {r["batch_size"]: r["n"] for r in rows if r["kind"] == "protocol_arm"}
        n_test = max(n.values())
        batch1 = f" --batch1-test {n[1]}" if n.get(1, n_test) < n_test else ""
        atomic_write_text(os.path.join(results_dir, "mad_protocols.json"), json.dumps(
            {"experiment": "mod_mad_protocols", "source": "python -m eval.toys.mod --part mad-protocols --debate-seeds "
             f"{','.join(map(str, st['seeds']))} --debate-test {n_test}{batch1} --threads 1, then python -m "
             "eval.toys.mod --part results (eval/logs/mod.md, 'MoD-Multi against MAD as Liang et al.'s official "
             "protocol'): MoD adapters lr 1e-2, 500 steps, the main setting's data; the frozen tiny-chat base for MAD; "
             f"the first {n_test} shapes test questions, batch sizes {st['batch_sizes']}, threads {st['threads']}, one "
             "process, arms interleaved; accuracy = seed-averaged item correctness with its 95% bootstrap CI; ratios = "
             "MoD-Multi / MAD per seed (paper: 0.13 tokens, 0.27 wall); wall time per question is load-dependent, "
             "tokens per question are not", "rows": rows}, indent=1) + "\n")
        written.append("mad_protocols.json")
    for name in written:
        log(f"wrote {results_dir}/{name}")
    return written
