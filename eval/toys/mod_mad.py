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
import time

import torch

from common.data import atomic_write_text
from eval.metrics import bootstrap_ci
from mod.infer import mod_debate, multi_agent_debate, summarize
from mod.model import load_adapters

DEFAULT_ADAPTER = os.path.join("debate", "lr", "MoD_lr0.01_steps500_s0")   # the main setting's MoD, seed 0


def order(rounds, mod_rounds=(1, 2)):
    """The interleaved method order: MoD-Single, then MAD k and MoD-Multi k alternating."""
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
    a MoD adapter folder (default OUT/debate/lr/MoD_lr0.01_steps500_s0). Raises FileNotFoundError
    naming the folder when it holds no adapter."""
    import copy
    import numpy as np
    from eval.toys.mod_debate import load_data, SETTINGS
    adapter = adapter or os.path.join(out_dir, DEFAULT_ADAPTER)
    if not os.path.exists(os.path.join(adapter, "adapter_model.safetensors")):
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
    for name in order(tuple(rounds)):
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
