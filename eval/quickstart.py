"""Quickstart: the repo's main job, end to end on the embedded tiny defaults.

    python -m eval.quickstart                 # about 6 CPU-minutes on 2 cores (README)
    python -m eval.quickstart --retrain-base  # first re-pretrain the tiny bases (~30 more minutes)

1. generates the shapes data (out/data: train / val / test, images + LLaVA JSON),
2. loads the committed tiny dense VLM (Qwen3-VL), tiny MoE-VLM (Qwen3-VL-MoE) and tiny chat
   VLM (the dense one continued on the MoD prompt shapes) through the same loader a real
   checkpoint takes (or retrains them with --retrain-base),
3. evaluates them on the test split next to the best-constant-answer baseline ("majority"),
4. runs each method's toy reproduction in quick mode (MoD, RoleMerge, MoLE, where present)
   into out/quickstart/<method> (a full `python -m eval.toys.<method>` run in out/<method>
   is never touched),
5. writes out/quickstart/report.json (a list of rows: model, family, metric, value, ci_low,
   ci_high, n) and out/quickstart/report.md (accuracy first, one captioned table per metric,
   grouped by stage).

Every stage (data, each base's evaluation, each method) saves its rows to
out/quickstart/stages/<stage>.json when it finishes. Ctrl-C stops at the end of the current
training step and exits with 130 (Ctrl-C again stops at once); the interrupted stage reruns
from its start (a method stage first empties its OUT/<method> folder, so no earlier run's
files mix in), and a rerun skips the stages already done with the same settings and bases.
`--overwrite` deletes the earlier run's stage records and report before the first stage starts,
so an interrupted --overwrite run is continued by a plain rerun and never reports an earlier
run's rows.
"""
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import time

import torch

from common import backbone as bb
from common import data
from common import shapes as world
from common.cli import Interrupted, RunError, add_threads, entry_parser, fail, number, set_threads, sigterm_flag
from eval import evaluate as ev

METHODS = ("mod", "rolemerge", "mole")
BASES = ("tiny-dense", "tiny-moe", "tiny-chat")
CAPTIONS = {  # one line per metric, shown above its table in report.md
    "accuracy": "Accuracy on the shapes test split (greedy answers; 95% bootstrap CI).",
    "accuracy_loglik": "Multiple choice scored by option log-likelihood (95% bootstrap CI).",
    "diff_vs_moelora": "Accuracy difference vs MoE-LoRA, paired bootstrap [95% CI].",
    "diff_vs_sft": "Accuracy difference vs SFT, paired bootstrap [95% CI].",
    "diff_vs_best_baseline": "Accuracy difference vs the best baseline at the same rho, paired bootstrap [95% CI].",
    "tokens_per_question": "Generated tokens per question (all rounds).",
    "latency_vs_base": "Wall time per question relative to the base model.",
    "switch_rate": "Fraction of adjacent tokens whose top-1 expert differs (MoD routing).",
}


def fingerprint(paths):
    """sha1 over the bytes of the given files (the tiny bases' weights): a stage done on other
    bases is redone."""
    h = hashlib.sha1()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def fmt(v):
    """Report cell: integers as integers (8976680), other numbers with three decimals."""
    if v is None:
        return ""
    return f"{int(v)}" if float(v).is_integer() and abs(v) >= 1 else f"{v:.3f}"


def stage_tables(title, rows):
    """Markdown lines for one stage: its accuracy table first, then one captioned table per
    other metric, each row with its n."""
    metrics = sorted({r["metric"] for r in rows}, key=lambda m: (m != "accuracy", m != "accuracy_loglik", m))
    lines = [f"## {title}", ""]
    for metric in metrics:
        sub = [r for r in rows if r["metric"] == metric]
        fams = list(dict.fromkeys(r["family"] for r in sub))
        fams = [f for f in fams if f != "all"] + (["all"] if "all" in fams else [])
        lines += [f"**{metric}**: {CAPTIONS.get(metric, 'as the toy reproduction reports it (see the method README).')}",
                  "", "| model | n | " + " | ".join(fams) + " |", "|---|---:" + "|---:" * len(fams) + "|"]
        for m in dict.fromkeys(r["model"] for r in sub):
            cell = {r["family"]: r for r in sub if r["model"] == m}
            n = (cell.get("all") or max(cell.values(), key=lambda r: r.get("n") or 0)).get("n")
            show = lambda r: "" if r is None else (fmt(r["value"]) if r.get("ci_low") is None else
                                                   f"{r['value']:.3f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]")
            lines.append(f"| {m} | {'' if n is None else n} | " + " | ".join(show(cell.get(f)) for f in fams) + " |")
        lines.append("")
    return lines


METHOD_NAMES = {"mod": "MoD", "rolemerge": "RoleMerge", "mole": "MoLE"}   # as the README's claims table names them
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def readme_verdicts(method):
    """The rows of the README's claims table ("The claims, at toy scale") for `method`, read from
    the committed result files the table is built from (`eval/results/tables.json`, table
    "claims"): [(claim, verdict, effect, seeds)]. [] when the files are not there."""
    try:
        with open(os.path.join(RESULTS, "tables.json")) as f:
            spec = next(t for t in json.load(f)["tables"] if t["name"] == "claims")
        rows = []
        for name in spec["file"] if isinstance(spec["file"], list) else [spec["file"]]:
            with open(os.path.join(RESULTS, name)) as f:
                rows += json.load(f)["rows"]
    except (OSError, ValueError, KeyError, StopIteration):
        return []
    keep = [r for r in rows if all(r.get(k) == v for k, v in spec.get("where", {}).items())
            and r.get("method") == METHOD_NAMES.get(method)]
    return [(r["claim"], r["verdict"], r["effect"], r["seeds"]) for r in keep]


def method_note(method):
    """The lines report.md puts above a method's quick-mode rows: what they check, where the
    verdict is, and the README's verdict lines (`readme_verdicts`)."""
    lines = [f"These quick-mode rows check that {METHOD_NAMES.get(method, method)}'s code paths run end to end (a few "
             f"steps, one seed, a small split); they test no claim and can point either way. The verdicts are in "
             f"README.md, \"The claims, at toy scale\" (full toy runs, >= 3 seeds; {method}/README.md):", ""]
    lines += [f"- {claim}: **{verdict}**, effect {effect} ({seeds} seeds)"
              for claim, verdict, effect, seeds in readme_verdicts(method)] or ["- (no committed verdict found)"]
    return lines + [""]


def write_report(stages, out_dir, timings, notes=None):
    """report.json (every row, with its stage) + report.md (per stage: its note lines from
    `notes` {title: lines}, then accuracy first, then each metric with a caption), atomically.
    stages: {title: rows}."""
    rows = [dict(r, stage=t) for t, rs in stages.items() for r in rs]
    data.atomic_write_text(os.path.join(out_dir, "report.json"), json.dumps(rows, indent=1))
    lines = ["# Quickstart report", ""]
    for title, rs in stages.items():
        table = stage_tables(title, rs)
        lines += table[:2] + (notes or {}).get(title, []) + table[2:]
    lines += ["## Wall time (s)", ""] + [f"- {k}: {v:.1f}" for k, v in timings.items()]
    data.atomic_write_text(os.path.join(out_dir, "report.md"), "\n".join(lines) + "\n")


def run_stage(name, settings, out, fresh, fn):
    """(rows, seconds, reused) of a stage: read from OUT/stages/<name>.json when it finished before
    with the same settings (and not --overwrite; reused True, seconds of that earlier run), else
    computed by fn() and saved there atomically."""
    path = os.path.join(out, "stages", f"{name}.json")
    if not fresh and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("settings") == settings:
            print(f"[quickstart] {name}: done in an earlier run ({saved['seconds']:.0f} s), reusing its rows")
            return saved["rows"], saved["seconds"], True
    t = time.time()
    rows = fn()
    secs = time.time() - t
    data.atomic_write_text(path, json.dumps({"settings": settings, "rows": rows, "seconds": secs}))
    return rows, secs, False


def clear_stage_records(out):
    """--overwrite: delete OUT/stages (the stage records) and OUT/report.json / report.md of an
    earlier run, before the first stage starts. Only these quickstart paths are touched; each
    method's OUT/<method> folder is emptied when its stage runs (`main`)."""
    shutil.rmtree(os.path.join(out, "stages"), ignore_errors=True)
    for f in ("report.json", "report.md"):
        if os.path.exists(os.path.join(out, f)):
            os.remove(os.path.join(out, f))


def check_out(out):
    """Refuse an --out that holds anything but a quickstart run: a run replaces OUT/<method> and
    OUT/report.*, so a folder without the quickstart's own OUT/stages/ record (a project folder,
    the repository root) is never written into. Raises RunError naming a fix."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise RunError(f"--out {out} is a file, not a directory")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isdir(os.path.join(out, "stages")):
        raise RunError(f"--out {out} holds files but no quickstart run ({out}/stages/ is missing); the quickstart "
                       f"replaces {out}/<method> and {out}/report.*, so nothing was written: choose a new or empty "
                       f"--out")


def retrain_bases():
    """The README's three pretraining commands (the first two side by side, one thread each)."""
    procs = [subprocess.Popen([sys.executable, "-m", "eval.tools.pretrain", "--arch", arch, "--out", bb.TINY[name],
                               "--steps", "6000", "--stop-at", "3500", "--threads", "1", "--overwrite"])
             for arch, name in (("qwen3_vl", "tiny-dense"), ("qwen3_vl_moe", "tiny-moe"))]
    if any(p.wait() != 0 for p in procs):
        fail("base pretraining failed (see its output above)")
    chat = subprocess.run([sys.executable, "-m", "eval.tools.pretrain", "--init", bb.TINY["tiny-dense"],
                           "--chat-mix", "1,1,2,1,1", "--wrong-priors", "0", "--steps", "800", "--batch-size", "16",
                           "--lr", "1e-3", "--out", bb.TINY["tiny-chat"], "--threads", "1", "--overwrite"])
    if chat.returncode != 0:
        fail("chat-base pretraining failed (see its output above)")


def main(argv=None):
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--out", default="out/quickstart", help="report directory (each method's quick run in OUT/<method>)")
    p.add_argument("--data", default="out/data", help="shapes data directory (generated if missing)")
    p.add_argument("--n-test", type=number(min=1), default=500, help="test examples to evaluate")
    p.add_argument("--retrain-base", action="store_true",
                   help="re-pretrain the tiny bases into common/tiny/ first (slow, see README)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma list of method toy reproductions to run in quick mode ('' for none)")
    p.add_argument("--batch-size", type=number(min=1), default=100, help="generation batch size")
    p.add_argument("--overwrite", dest="fresh", action="store_true",
                   help="redo every stage: the earlier run's stage records and report are deleted first (default: "
                        "continue, reusing the stages an earlier, interrupted run finished)")
    add_threads(p)
    a = p.parse_args(argv)
    methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        p.error(f"unknown method(s) {bad}; choose from {','.join(METHODS)}")
    check_out(a.out)
    threads = set_threads(a.threads)
    print(f"[quickstart] {threads} CPU thread(s) (--threads)")
    if a.fresh:  # before any stage: an --overwrite run stopped midway must not leave the earlier run's records
        clear_stage_records(a.out)
    timings, stages, notes, t0 = {}, {}, {}, time.time()

    # 1. data
    world.ensure_splits(a.data, {"train": 2000, "val": 500, "test": a.n_test})
    timings["data"] = time.time() - t0
    test = data.read_llava_json(os.path.join(a.data, "test.json"))[: a.n_test]
    train = data.read_llava_json(os.path.join(a.data, "train.json"), check_images=False)

    # 2. bases
    if a.retrain_base:
        t = time.time()
        retrain_bases()
        timings["retrain bases"] = time.time() - t
    settings = {"n_test": a.n_test, "data": os.path.abspath(a.data), "batch_size": a.batch_size,
                "bases": fingerprint([os.path.join(bb.TINY[b], "model.safetensors") for b in BASES])}

    # 3. evaluate the bases next to the best constant answer (fitted on the training split),
    # 4. each method's toy reproduction in quick mode; every stage saved when it finishes
    todo = [(f"eval {b}", b) for b in BASES] + [(m, m) for m in methods]
    stage = None

    def base_rows(name):
        model, proc = bb.load_backbone(name)
        with torch.inference_mode():
            res = ev.evaluate(model, proc, test, batch_size=a.batch_size, desc=f"eval {name}")
        return ev.family_rows(name, res)

    def method_rows(m):
        toy = importlib.import_module(f"eval.toys.{m}")
        shutil.rmtree(os.path.join(a.out, m), ignore_errors=True)  # from its start: no earlier run's adapters or rows
        out = toy.run(quick=True, data_dir=a.data, out_dir=os.path.join(a.out, m))
        return toy.report_rows(out) if isinstance(out, dict) else out  # toy_mole returns its table summary

    bases_rows = ev.majority_rows(test, train, model="best constant (train)")
    try:
        with sigterm_flag("finishing the current stage, then stopping; a rerun continues from there") as flag:
            for stage, what in todo:
                if what in METHODS and not os.path.exists(os.path.join(os.path.dirname(__file__), "toys", f"{what}.py")):
                    print(f"[quickstart] eval/toys/{what}.py not present: skipping {what}")
                    continue
                fn = (lambda w=what: base_rows(w)) if what in BASES else (lambda w=what: method_rows(w))
                rows, secs, reused = run_stage(stage.replace(" ", "_"), settings, a.out, a.fresh, fn)
                timings[stage + (" (an earlier run)" if reused else "")] = secs
                if what in BASES:
                    bases_rows += rows
                else:
                    title = f"{what} (quick mode; {what}/README.md has the full toy)"
                    stages[title], notes[title] = rows, method_note(what)
                if flag["stop"]:
                    raise Interrupted(f"stopped after stage '{stage}' ({flag['stop']})", flag["signum"])
    except (Interrupted, KeyboardInterrupt) as e:  # ours after a stage, or a trainer's mid-stage, or a 2nd Ctrl-C
        where = (f"after stage '{stage}'" if isinstance(e, Interrupted) and str(e).startswith("stopped after")
                 else f"during stage '{stage}' (the quickstart reruns a stopped stage from its start; the "
                      f"trainer's checkpoint is not reused)")
        print(f"\n[quickstart] stopped {where}; finished stages are kept in {a.out}/stages: rerun the same "
              f"command to continue", file=sys.stderr)  # own line: not after a progress bar
        raise SystemExit(128 + getattr(e, "signum", 2))
    stages = {"bases (shapes test split)": bases_rows, **stages}
    wall = time.time() - t0
    timings["total of the stages"] = sum(timings.values())
    timings["this run (wall)"] = wall  # less than the total when stages were reused from an earlier run
    write_report(stages, a.out, timings, notes)
    print(open(os.path.join(a.out, "report.md")).read())
    print(f"wrote {a.out}/report.json and report.md in {wall / 60:.1f} min")


if __name__ == "__main__":
    try:
        main()
    except (data.DataError, bb.BackboneError, RunError) as e:
        fail(e)
