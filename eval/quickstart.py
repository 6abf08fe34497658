"""Quickstart: the repo's main job, end to end on the embedded tiny defaults.

    python -m eval.quickstart                 # 2-4 minutes on 2 CPU cores (see README)
    python -m eval.quickstart --retrain-base  # first re-pretrain the tiny bases (~30 more minutes)

1. generates the shapes data (out/data: train / val / test, images + LLaVA JSON),
2. loads the committed tiny dense VLM (Qwen3-VL), tiny MoE-VLM (Qwen3-VL-MoE) and tiny chat
   VLM (the dense one continued on the MoD prompt shapes) through the same loader a real
   checkpoint takes (or retrains them with --retrain-base),
3. evaluates them on the test split next to the best-constant-answer baseline ("majority"),
4. runs each method's toy reproduction in quick mode (MoD, RoleMerge, MoLE, where present)
   into out/quickstart/<method> (a full `python -m eval.toy_<method>` run in out/<method>
   is never touched),
5. writes out/quickstart/report.json (a list of rows: model, family, metric, value, ci_low,
   ci_high, n) and out/quickstart/report.md.
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import time

import torch

from common import backbone as bb
from common import data
from common.cli import fail, number

METHODS = ("mod", "rolemerge", "mole")


def write_report(rows, out_dir, timings):
    """report.json (list of rows) + report.md (a per-family table per metric), atomically."""
    os.makedirs(out_dir, exist_ok=True)
    data.atomic_write_text(os.path.join(out_dir, "report.json"), json.dumps(rows, indent=1))
    lines = ["# Quickstart report", "", "Accuracy on the shapes test split (95% bootstrap CI).", ""]
    for metric in sorted({r["metric"] for r in rows}):
        sub = [r for r in rows if r["metric"] == metric]
        fams = list(dict.fromkeys(r["family"] for r in sub))
        models = list(dict.fromkeys(r["model"] for r in sub))
        lines += [f"## {metric}", "", "| model | " + " | ".join(fams) + " |", "|---" * (len(fams) + 1) + "|"]
        for m in models:
            cell = {r["family"]: r for r in sub if r["model"] == m}
            fmt = lambda r: "" if r is None else (f"{r['value']:.3f}" if r.get("ci_low") is None else
                                                  f"{r['value']:.3f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]")
            lines.append(f"| {m} | " + " | ".join(fmt(cell.get(f)) for f in fams) + " |")
        lines.append("")
    lines += ["## Wall time (s)", ""] + [f"- {k}: {v:.1f}" for k, v in timings.items()]
    data.atomic_write_text(os.path.join(out_dir, "report.md"), "\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/quickstart", help="report directory (each method's quick run in OUT/<method>)")
    p.add_argument("--data", default="out/data", help="shapes data directory (generated if missing)")
    p.add_argument("--n-test", type=number(min=1), default=500, help="test examples to evaluate")
    p.add_argument("--retrain-base", action="store_true",
                   help="re-pretrain the tiny bases into common/tiny/ first (slow, see README)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma list of method toy reproductions to run in quick mode ('' for none)")
    p.add_argument("--batch-size", type=number(min=1), default=100, help="generation batch size")
    a = p.parse_args(argv)
    from eval import evaluate as ev
    methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        p.error(f"unknown method(s) {bad}; choose from {','.join(METHODS)}")
    timings, rows, t0 = {}, [], time.time()

    # 1. data
    data.ensure_splits(a.data, {"train": 2000, "val": 500, "test": a.n_test})
    timings["data"] = time.time() - t0
    test = data.read_llava_json(os.path.join(a.data, "test.json"))[: a.n_test]

    # 2. bases
    if a.retrain_base:  # the README's two commands, side by side (one thread each)
        t = time.time()
        procs = [subprocess.Popen([sys.executable, "-m", "common.pretrain", "--arch", arch, "--out", bb.TINY[name],
                                   "--steps", "6000", "--stop-at", "3500", "--threads", "1", "--fresh"])
                 for arch, name in (("qwen3_vl", "tiny-dense"), ("qwen3_vl_moe", "tiny-moe"))]
        if any(p.wait() != 0 for p in procs):
            fail("base pretraining failed (see its output above)")
        chat = subprocess.run([sys.executable, "-m", "common.pretrain", "--init", bb.TINY["tiny-dense"],
                               "--chat-mix", "1,1,2,1,1", "--wrong-priors", "0", "--steps", "800", "--batch-size", "16", "--lr", "1e-3",
                               "--out", bb.TINY["tiny-chat"], "--threads", "1", "--fresh"])
        if chat.returncode != 0:
            fail("chat-base pretraining failed (see its output above)")
        timings["retrain bases"] = time.time() - t

    # 3. evaluate bases next to the best constant answer
    rows += ev.majority_rows(test)
    for name in ("tiny-dense", "tiny-moe", "tiny-chat"):
        t = time.time()
        model, proc = bb.load_backbone(name)
        with torch.inference_mode():
            res = ev.evaluate(model, proc, test, batch_size=a.batch_size, desc=f"eval {name}")
        rows += ev.family_rows(name, res)
        timings[f"eval {name}"] = time.time() - t

    # 4. each method's toy reproduction, quick mode
    for m in methods:
        path = os.path.join(os.path.dirname(__file__), f"toy_{m}.py")
        if not os.path.exists(path):
            print(f"[quickstart] eval/toy_{m}.py not present: skipping {m}")
            continue
        t = time.time()
        rows += importlib.import_module(f"eval.toy_{m}").run(quick=True, data_dir=a.data,
                                                             out_dir=os.path.join(a.out, m))
        timings[m] = time.time() - t

    timings["total"] = time.time() - t0
    write_report(rows, a.out, timings)
    print(open(os.path.join(a.out, "report.md")).read())
    print(f"wrote {a.out}/report.json and report.md in {timings['total'] / 60:.1f} min")


if __name__ == "__main__":
    try:
        main()
    except (data.DataError, bb.BackboneError) as e:
        fail(e)
