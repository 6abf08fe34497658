"""Integration check (not CI): lmms-eval runs our models and scores them as we do.

    python -m eval.tools.lmms_check                       # venv out/venv-lmms, results in out/lmms_check
    python -m eval.tools.lmms_check --venv out/venv-lmms --n 100 --lmms-eval-version 0.7.3

Needs only the standard library to start: it
1. makes its own venv (--venv) with requirements.txt + lmms-eval, our pins held as pip
   constraints (lmms-eval must not move torch / transformers); a torchvision that cannot
   load beside our CPU torch is removed and reported (transformers then takes its PIL image
   processors, as in our own venv);
2. makes the shapes data (train / val / test) and, from the test split, an lmms-eval task
   folder (`python -m eval.lmms make-task`): `shapes` (greedy generation, scored by
   eval.metrics.is_correct) and `shapes_mc` (multiple choice by option log-likelihood);
3. trains a small MoD adapter (mod.train on tiny-chat) and a small MoLE checkpoint
   (mole.train), and merges tiny-moe with RoleMerge (calibrate + merge, rho 0.5);
4. scores each with our own entry points (mod.infer, mole.infer, eval.evaluate, and
   eval.evaluate.score_options for option log-likelihood) and with lmms-eval
   (`python -m eval.lmms --model mod|mole ...`, and lmms-eval's stock `qwen3_vl` class on
   the merged checkpoint), on the same records;
5. prints both scores per run, the number of records whose verdict and whose generated text
   differ, and exits with 1 if any score differs or an lmms-eval run fails (2 for a setup
   error). Without torchvision (--torch cpu) the stock-class runs are skipped, not failed.

Measured (mod/README.md, "lmms-eval"): with --torch cpu every comparison is equal; with
--torch pypi ours are equal too, and both stock classes fail on the tiny merged checkpoint
(qwen3_vl: patch 16 assumed, our tiny bases have 14; huggingface: `audios=` refused by
transformers 5), so that mode exits 1.

Every step's output stays in --out; a rerun redoes only what is missing (--overwrite redoes all).
Runs one thread per process (`--threads`); about 10 minutes on a busy 2-core CPU after the venv.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PINS = ("torch", "transformers", "tokenizers", "safetensors", "pillow", "tqdm", "numpy")


def log(msg, tool="lmms_check"):
    print(f"[{tool} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd, env, what, check=True, capture=False, tool="lmms_check"):
    """Run a command in the repo root; on failure print its tail and exit 2 (check=True).
    tool: the name in the log lines (eval.tools.lm_harness_check uses this too)."""
    log(f"{what}: {' '.join(c if chr(10) not in c else '<script>' for c in cmd)}", tool)
    p = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True)
    if p.returncode != 0 and check:
        sys.stderr.write((p.stdout + p.stderr)[-6000:])
        print(f"error: {what} failed (exit {p.returncode}); its output is above", file=sys.stderr)
        raise SystemExit(2)
    return p


def our_pins():
    """{name: "name==version"} of the PINS in requirements.txt (the constraints every check venv keeps)."""
    pins = {}
    with open(os.path.join(REPO, "requirements.txt")) as f:
        for line in f:
            name = line.split("#")[0].strip()
            if "==" in name and name.split("==")[0].lower() in PINS:
                pins[name.split("==")[0].lower()] = name
    return pins


def venv_with_pins(venv, env, pins, tool="lmms_check"):
    """Make `venv` unless it has a python already and write our pins as its constraints.txt,
    which every later install passes with -c (eval.tools.lm_harness_check uses this too).
    Returns (the venv's python, the constraints file)."""
    venv = os.path.abspath(venv)  # a relative --venv (the default, under out/) stays valid in every subprocess
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        run([sys.executable, "-m", "venv", venv], env, "make venv", tool=tool)
    cons = os.path.join(venv, "constraints.txt")
    with open(cons, "w") as f:
        f.write("\n".join(pins.values()) + "\n")
    return py, cons


def ensure_venv(venv, version, env, torch_source):
    """The venv's python, made on first use, and notes on what had to give way.

    torch_source "cpu": requirements.txt as our own venv has it (the local CPU torch wheel),
    then lmms-eval==version with our pins as constraints; the torchvision pip pulls in cannot
    load beside a CPU torch and is removed (our classes do not need it; lmms-eval's stock Qwen-VL
    classes do). torch_source "pypi": first torch at our pinned version from the package index
    (a CUDA build, ~3 GB with its nvidia-* wheels; runs on CPU too) with its matching
    torchvision, then the same; plus decord, which lmms-eval's qwen3_vl module imports but
    does not install."""
    py = os.path.join(venv, "bin", "python")
    notes = []
    pins = our_pins()
    ok = os.path.exists(py) and subprocess.run([py, "-c", "import lmms_eval"], env=env,
                                               capture_output=True).returncode == 0
    if not ok:
        py, cons = venv_with_pins(venv, env, pins)
        if torch_source == "pypi":  # the index's build, not the local CPU wheel that find-links offers
            run([py, "-m", "pip", "install", "-q", "--isolated", pins["torch"], "torchvision", "-c", cons],
                dict(env, PIP_FIND_LINKS=""), "torch + torchvision from the package index")
        run([py, "-m", "pip", "install", "-q", "-r", os.path.join(REPO, "requirements.txt")], env, "our requirements")
        # decord: lmms-eval's qwen3_vl module imports it at the top but lmms-eval does not require it;
        # filelock < 4: lmms-eval 0.7.3's evaluator imports filelock._api, which filelock 4 no longer has
        extra = ["filelock<4"] + (["decord"] if torch_source == "pypi" else [])
        p = run([py, "-m", "pip", "install", "-q", f"lmms-eval=={version}"] + extra + ["-c", cons], env,
                f"lmms-eval {version} (our pins as constraints)", check=False)
        if p.returncode != 0:
            sys.stderr.write((p.stdout + p.stderr)[-4000:])
            print(f"error: lmms-eval {version} cannot be installed beside our pins ({', '.join(pins.values())}); "
                  f"the resolver's message is above. Try another --lmms-eval-version.", file=sys.stderr)
            raise SystemExit(2)
    tv = subprocess.run([py, "-c", "import torchvision"], env=env, capture_output=True, text=True)
    if tv.returncode != 0 and "No module named" not in tv.stderr:
        why = (tv.stderr.strip().splitlines() or ["?"])[-1]
        run([py, "-m", "pip", "uninstall", "-y", "-q", "torchvision"], env, "remove the broken torchvision")
        notes.append(f"torchvision (pulled in by lmms-eval) cannot load beside this torch ({why[:120]}): removed")
    freeze = subprocess.run([py, "-m", "pip", "freeze"], env=env, capture_output=True, text=True).stdout
    vers = {l.split("==")[0].lower().replace("_", "-"): l.split("==")[1] for l in freeze.splitlines() if "==" in l}
    notes.append(", ".join(f"{n} {vers.get(n, '-')}" for n in PINS + ("torchvision", "lmms-eval", "decord")))
    has_tv = subprocess.run([py, "-c", "import torchvision"], env=env, capture_output=True).returncode == 0
    return py, notes, has_tv


def latest(pattern):
    """The newest file matching a glob pattern (lmms-eval names its outputs by date), or None."""
    files = sorted(glob.glob(pattern, recursive=True), key=os.path.getmtime)
    return files[-1] if files else None


def lmms_scores(out_dir, tasks_dir):
    """{task: (score, {doc id: 0/1}, {doc id: generated text})} from an lmms-eval output folder
    (--log_samples). Samples name documents by their index in the task's JSONL (doc_id)."""
    res = latest(os.path.join(out_dir, "**", "*_results.json"))
    if res is None:  # lmms-eval logs an evaluation error and still exits 0
        return None
    with open(res) as f:
        results = json.load(f)["results"]
    out = {}
    for task, metrics in results.items():
        key = "accuracy,none" if "accuracy,none" in metrics else "acc,none"
        with open(os.path.join(tasks_dir, f"{task}.jsonl")) as f:
            ids = [json.loads(line)["id"] for line in f]
        per, text = {}, {}
        samples = latest(os.path.join(os.path.dirname(res), f"*_samples_{task}.jsonl"))
        with open(samples) as f:
            for line in f:
                s = json.loads(line)
                k = ids[int(s["doc_id"])]
                per[k] = s.get("accuracy", s.get("acc"))
                if key == "accuracy,none":
                    t = s["filtered_resps"]
                    text[k] = t if isinstance(t, str) else t[0]
        out[task] = (metrics[key], per, text)
    return out


def compare(rows, name, ref, got):
    """Append a comparison row: ref and got are (score, {id: 0/1}, {id: text})."""
    (a, pa, ta), (b, pb, tb) = ref, got
    differ = sum(1 for k in pa if k in pb and bool(pa[k]) != bool(pb[k]))
    texts = sum(1 for k in ta if k in tb and ta[k] != tb[k]) if ta and tb else None
    rows.append((name, a, b, differ, texts, abs(a - b) < 1e-9 and differ == 0 and len(pa) == len(pb)))


def main(argv=None):
    from common.cli import entry_parser
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--venv", default="out/venv-lmms", help="venv for lmms-eval (made if missing)")
    p.add_argument("--lmms-eval-version", default="0.7.3", help="lmms-eval version to install")
    p.add_argument("--out", default="out/lmms_check", help="working folder (data, checkpoints, results)")
    p.add_argument("--n", type=int, default=60, help="test records in the task")
    p.add_argument("--batch-size", type=int, default=64, help="batch size, ours and lmms-eval's")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--torch", choices=["cpu", "pypi"], default="cpu",
                   help="torch of a new venv: cpu = our local CPU wheel (no torchvision: lmms-eval's stock Qwen-VL "
                        "classes cannot run), pypi = the index's build of the same version + torchvision (~3 GB)")
    p.add_argument("--overwrite", dest="fresh", action="store_true",
                   help="redo every step (not the venv; default: continue, skipping the steps done)")
    a = p.parse_args(argv)
    out = os.path.abspath(a.out)
    if a.fresh:
        shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=os.path.join(out, "hf"),
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", PYTHONPATH=REPO)
    py, notes, has_tv = ensure_venv(a.venv, a.lmms_eval_version, env, a.torch)
    for n in notes:
        log(f"venv: {n}")
    T = ["--threads", str(a.threads)]
    B = str(a.batch_size)

    # data and task
    data = os.path.join(out, "data")
    if not os.path.exists(os.path.join(data, "test.json")):
        run([py, "-m", "common.data", "--out", data, "--n-train", "300", "--n-val", "40", "--n-test", str(a.n),
             "--overwrite"], env, "shapes data")
    test = os.path.join(data, "test.json")
    tasks = os.path.join(out, "tasks")
    run([py, "-m", "eval.lmms", "make-task", "--data", test, "--out", tasks, "--overwrite"], env, "lmms-eval task")

    # the three checkpoints
    mod_dir, mole_dir = os.path.join(out, "mod"), os.path.join(out, "mole")
    rm = os.path.join(out, "rolemerge")
    # lmms-eval's qwen3_vl class picks the MoE model class from the *path* (regex "A<n>B", as in
    # Qwen3-VL-30B-A3B): a merged checkpoint's folder must keep that pattern in its name.
    merged = os.path.join(rm, "tiny-moe-A1B-rho0.5")
    if not os.path.exists(os.path.join(mod_dir, "adapter_config.json")):
        run([py, "-m", "mod.train", "--model", "tiny-chat", "--data", os.path.join(data, "train.json"), "--out",
             mod_dir, "--steps", "30", "--warmup-steps", "20", "--batch-size", "8", "--lr", "5e-3", "--overwrite"] + T, env, "MoD adapter")
    if not os.path.exists(os.path.join(mole_dir, "state.json")):
        run([py, "-m", "mole.train", "--data", data, "--out", mole_dir, "--max-steps", "30", "--batch-size", "8",
             "--overwrite", "--quiet"] + T, env, "MoLE checkpoint")
    if not os.path.exists(os.path.join(merged, "config.json")):
        stats = os.path.join(rm, "stats.safetensors")
        run([py, "-m", "rolemerge.calibrate", "--model", "tiny-moe", "--data", os.path.join(data, "val.json"),
             "--limit", "20", "--out", stats, "--overwrite"] + T, env, "RoleMerge calibration")
        run([py, "-m", "rolemerge.merge", "--model", "tiny-moe", "--stats", stats, "--rho", "0.5", "--out", merged,
             "--overwrite"] + T, env, "RoleMerge merge")

    # our own scores
    ref = os.path.join(out, "ref")
    os.makedirs(ref, exist_ok=True)
    refs = {}

    def per(results):
        return (sum(r["correct"] for r in results) / len(results), {r["id"]: r["correct"] for r in results},
                {r["id"]: r["pred"] for r in results if "pred" in r and r["pred"] is not None and "scores" not in r})

    f = os.path.join(ref, "mod.json")
    done = lambda path: os.path.exists(path)  # each reference run writes its file last (atomically)
    done(f) or run([py, "-m", "mod.infer", "--model", "tiny-chat", "--adapter", mod_dir, "--data", test, "--methods",
         "single,multi", "--rounds", "1", "--max-new-tokens", "96", "--batch-size", B, "--out", f] + T, env,
        "ours: mod.infer single,multi")
    with open(f) as fh:
        r = json.load(fh)["results"]
    refs["mod single"], refs["mod multi"] = per(r["single"]), per(r["multi"])
    f = os.path.join(ref, "mole.json")
    done(f) or run([py, "-m", "mole.infer", "--ckpt", mole_dir, "--data", test, "--batch-size", B, "--out", f] + T, env,
        "ours: mole.infer")
    with open(f) as fh:
        refs["mole"] = per(json.load(fh))
    f = os.path.join(ref, "merged.json")
    done(f) or run([py, "-m", "eval.evaluate", "--model", merged, "--data", test, "--batch-size", "1", "--dtype", "bfloat16",
         "--out", f] + T, env, "ours: eval.evaluate on the merged checkpoint (bf16 and one record at a time, as "
                               "lmms-eval's stock classes run it)")
    with open(f) as fh:
        refs["merged"] = per(json.load(fh)["results"])
    f = os.path.join(ref, "loglik.json")
    snippet = f"""
import json, torch
torch.set_num_threads({a.threads})
from common.backbone import load_backbone
from common.data import load_image, read_any
from eval.evaluate import options_of, score_options
from eval.lmms import loglik_mole
from mod.model import load_adapters
from mole.checkpoint import load_mole
recs = [r for r in read_any({test!r}) if options_of(r)]
model, proc = load_backbone("tiny-chat"); load_adapters(model, {mod_dir!r})
out = {{"mod": [{{"id": r["id"], "correct": r["correct"]}} for r in score_options(model, proc, recs, batch_size={B})]}}
mole, proc, stage = load_mole({mole_dir!r})
res = []
for r in recs:
    opts = options_of(r)
    lp = [x for x, _ in loglik_mole(mole, [(load_image(r["image"]), r["question"], L) for L, _ in opts], stage)]
    pred = opts[max(range(len(lp)), key=lp.__getitem__)][0]
    res.append({{"id": r["id"], "correct": pred == r["answer"]}})
out["mole"] = res
json.dump(out, open({f!r} + ".tmp", "w"))
import os; os.replace({f!r} + ".tmp", {f!r})
"""
    done(f) or run([py, "-c", snippet], env, "ours: option log-likelihood (eval.evaluate.score_options; MoLE: eval.lmms.loglik_mole)")
    with open(f) as fh:
        ll = json.load(fh)
    refs["mod mc"], refs["mole mc"] = per(ll["mod"]), per(ll["mole"])

    # lmms-eval's scores
    got = {}
    common_args = ["--include_path", tasks, "--log_samples", "--verbosity", "WARNING", "--device", "cpu"]
    runs = [("mod single", "mod", f"pretrained=tiny-chat,adapter={mod_dir},method=single,threads={a.threads}",
             "shapes,shapes_mc", ["--gen_kwargs", "max_new_tokens=96"]),
            ("mod multi", "mod", f"pretrained=tiny-chat,adapter={mod_dir},method=multi,rounds=1,threads={a.threads}",
             "shapes", ["--gen_kwargs", "max_new_tokens=96"]),
            ("mole", "mole", f"pretrained={mole_dir},threads={a.threads}", "shapes,shapes_mc", []),
            # lmms-eval's stock classes, on the merged RoleMerge checkpoint (a plain transformers folder):
            # qwen3_vl (the Qwen3-VL class), huggingface (AutoModelForImageTextToText + AutoProcessor)
            ("merged qwen3_vl", "qwen3_vl", f"pretrained={merged},device_map=cpu,system_prompt=,"
                                            f"min_pixels=3136,max_pixels=12544", "shapes", ["--batch_size", "1"]),
            ("merged hf", "huggingface", f"pretrained={merged},device_map=cpu", "shapes",
             ["--batch_size", "1"])]
    failed, skipped = [], []
    os.makedirs(os.path.join(out, "lmms"), exist_ok=True)
    for name, model, margs, task_list, extra in runs:
        if name.startswith("merged") and not has_tv:
            skipped.append((name, model, "not run: lmms-eval's stock Qwen-VL classes need torchvision (AutoProcessor's "
                                        "video processor, qwen_vl_utils), which cannot load beside torch 2.13.0+cpu; "
                                        "rerun with --torch pypi --venv ANOTHER_VENV"))
            continue
        o = os.path.join(out, "lmms", name.replace(" ", "_"))
        shutil.rmtree(o, ignore_errors=True)
        p = run([py, "-m", "eval.lmms", "--model", model, "--model_args", margs, "--tasks", task_list,
                 "--output_path", o] + common_args + (extra if "--batch_size" in extra else extra + ["--batch_size", B]),
                env, f"lmms-eval: {name}", check=False)
        with open(os.path.join(out, "lmms", name.replace(" ", "_") + ".log"), "w") as fh:
            fh.write(p.stdout + p.stderr)
        scores = lmms_scores(o, tasks) if p.returncode == 0 else None
        if scores is None:
            tail = [l for l in (p.stdout + p.stderr).splitlines() if "ERROR" in l or "Error" in l][-1:] or \
                (p.stdout + p.stderr).strip().splitlines()[-3:]
            failed.append((name, model, " | ".join(tail)[-400:]))
            continue
        for task, val in scores.items():
            got[name if task == "shapes" else name.split()[0] + " mc"] = val

    rows = []
    for name in got:
        compare(rows, name, refs["merged" if name.startswith("merged") else name], got[name])
    print("\nlmms-eval vs ours on the same records (shapes test split, n=%d; mc: %d records with options)"
          % (len(refs["mole"][1]), len(refs["mod mc"][1])))
    print(f"{'run':16s} {'ours':>7s} {'lmms-eval':>9s} {'verdicts differ':>15s} {'texts differ':>12s}  equal")
    for name, x, y, d, t, ok in rows:
        print(f"{name:16s} {x:7.4f} {y:9.4f} {d:15d} {'-' if t is None else t:>12}  {'yes' if ok else 'NO'}")
    for name, model, why in failed + skipped:
        print(f"{name:16s} lmms-eval --model {model}: {why}")
    for n in notes:
        print(f"venv: {n}")
    with open(os.path.join(out, "summary.json"), "w") as fh:
        json.dump({"rows": rows, "failed": failed, "skipped": skipped, "notes": notes}, fh, indent=1)
    bad = [r for r in rows if not r[5]] or failed
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
