"""MAD by debate rounds beside MoD-Single / MoD-Multi: accuracy, generated tokens and wall time
per question on the same test questions (design in eval/logs/mod.md, "MoD-Multi as the paper
defines it").

The paper (Mixture of Debaters, arXiv 2606.29425, §4) compares MoD's latency and tokens with a
MAD of two debaters and a judge "for structured argumentation over multiple rounds"; our MAD
(`mod.infer.multi_agent_debate`) runs `rounds` debate rounds: 2 + 2 rounds + 1 generations per
question. This part scores MAD for each of `rounds` on the frozen base and, on the same
questions in the same process (one thread, batch 64), MoD-Single and MoD-Multi with 1 and 2
debate rounds from one saved MoD adapter, interleaved (Single, MAD 1, Multi 1, MAD 2, Multi 2,
MAD 3, ...). Each finished method is written to OUT/mad_rounds.json at once and skipped when
present (resumable).

    python -m eval.toys.mod --part mad-rounds --mad-rounds 1,2,3 --debate-test 200 --threads 1
"""
import json
import os
import sys
import time

import torch

from common.data import atomic_write_text
from eval.metrics import bootstrap_ci
from mod.infer import mod_debate, multi_agent_debate, summarize
from mod.model import load_adapters

DEFAULT_ADAPTER = os.path.join("debate", "lr", "MoD_lr0.01_steps500_s0")   # the main setting's MoD, seed 0


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
        adapter=None, batch_size=64, log=print):
    """Score every method of `order(rounds)` missing from OUT/mad_rounds.json on the first `n_test`
    shapes test questions -> that file: per method accuracy [95% bootstrap CI], tokens and wall
    seconds per question, generations per question, and ratios to MoD-Multi 1 round. `adapter`:
    a MoD adapter folder (default OUT/debate/lr/MoD_lr0.01_steps500_s0), "none": MAD rows only.
    Raises FileNotFoundError naming the folder when it holds no adapter."""
    import copy
    import numpy as np
    from eval.toys.mod_debate import load_data, SETTINGS
    adapter = adapter or os.path.join(out_dir, DEFAULT_ADAPTER)
    if adapter != "none" and not os.path.exists(os.path.join(adapter, "adapter_model.safetensors")):
        raise FileNotFoundError(f"{adapter} holds no MoD adapter: train it first (bash eval/toys/mod_paper_rounds.sh) "
                                "or pass --mad-adapter DIR")
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
        if name.startswith("mod") and tuned is None:
            tuned = copy.deepcopy(base)
            load_adapters(tuned, adapter)
            tuned.eval()
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
    import numpy as np
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
    label = lambda m: (f"MAD, {m[3:]} debate round{'s' if m[3:] != '1' else ''} (2 debaters + judge)"
                       if m.startswith("mad") else NAMES["single" if m == "mod_single" else m[4:]])
    return [{"kind": "mad_rounds", "method": label(m), "key": m, "n": v["n"], "value": round(v["accuracy"], 3),
             "ci_low": round(v["ci_low"], 3), "ci_high": round(v["ci_high"], 3),
             "generations_per_q": v["generations_per_q"], "tokens_per_q": round(v["tokens_per_q"], 1),
             "wall_per_q_s": round(v["wall_per_q"], 3), "tokens_vs_mod_multi1": round(v.get("tokens_vs_mod_multi1", 0), 2) or None,
             "wall_vs_mod_multi1": round(v.get("wall_vs_mod_multi1", 0), 2) or None,
             **({"tokens_vs_mad1": round(v["tokens_per_q"] / mad1["tokens_per_q"], 2),
                 "wall_vs_mad1": round(v["wall_per_q"] / mad1["wall_per_q"], 2)} if mad1 else {})}
            for m, v in d["methods"].items()], d["settings"]


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m eval.toys.mod_mad",
                                description="Write eval/results/mod/paper_rounds.json (and mad_rounds.json when "
                                            "OUT/mad_rounds.json exists) from the runs of eval/toys/mod_paper_rounds.sh.")
    p.add_argument("--out", default="out/mod", help="the toy's output directory")
    p.add_argument("--results", default="eval/results/mod", help="where the result files go (rewritten)")
    a = p.parse_args(argv)
    src = ("bash eval/toys/mod_paper_rounds.sh (eval/logs/mod.md, 'MoD-Multi as the paper defines it'): MoD at lr 1e-2, "
           "500 steps, the main setting's data (step-0 losses below), the first 600 shapes test questions, one thread; "
           "pooled = the seed-averaged item correctness with its 95% bootstrap CI; compare = paired bootstrap of the "
           "seed-averaged difference, verdict by eval.toys.mod_debate.verdict_over; then python -m eval.toys.mod_mad")
    try:
        rows = result_rows(a.out)
    except FileNotFoundError:
        rows = None
    if rows:
        atomic_write_text(os.path.join(a.results, "paper_rounds.json"),
                          json.dumps({"experiment": "mod_paper_rounds", "source": src, "rows": rows}, indent=1) + "\n")
        print(f"wrote {a.results}/paper_rounds.json")
    else:
        print("no MoD test scores of bash eval/toys/mod_paper_rounds.sh yet: paper_rounds.json not written")
    if os.path.exists(os.path.join(a.out, "mad_rounds.json")):
        rows, st = mad_rows(a.out)
        atomic_write_text(os.path.join(a.results, "mad_rounds.json"), json.dumps(
            {"experiment": "mod_mad_rounds", "source": f"python -m eval.toys.mod --part mad-rounds --mad-rounds "
             f"{','.join(map(str, st['rounds']))} --debate-test {st['n_test']}"
             + (" --mad-adapter none" if st["adapter"] == "none" else "") + " --threads 1 (eval/toys/mod_mad.py): the "
             + ("frozen base (MAD only, no MoD rows)" if st["adapter"] == "none" else
                f"frozen base (MAD) and the MoD adapter {st['adapter']} (MoD-Single / MoD-Multi)") + " on the same first "
             f"{st['n_test']} shapes test questions, batch {st['batch_size']}, one thread, one process, methods "
             "interleaved; wall time per question is load-dependent, tokens per question are not", "rows": rows},
            indent=1) + "\n")
        print(f"wrote {a.results}/mad_rounds.json")


if __name__ == "__main__":
    main()
