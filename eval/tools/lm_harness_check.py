"""Integration check (not CI): the LM Evaluation Harness and our own log-likelihood scorer
(`eval.lm_harness.score_docs`) give the same per-item log-likelihoods and accuracies on
Text3's three tasks, on our tiny checkpoints.

    python -m eval.tools.lm_harness_check --threads 1        # venv out/venv-lmeval, work in out/lm_harness_check
    python -m eval.tools.lm_harness_check --result eval/results/rolemerge/lm_harness_check.json

Needs only the standard library to start: it
1. makes its own venv (--venv) with requirements.txt, then lm-eval[hf]==--lm-eval-version (the
   extra brings accelerate and peft, which its HF model class imports) with our pins as pip
   constraints (the harness must not move torch / transformers);
2. writes synthetic documents in each task's schema (`eval.lm_harness.synthetic_docs`:
   ARC-Easy with letter and digit labels and 3-5 choices, PIQA, Winogrande sentences with a
   blank) and a local copy of each of the installed harness's own task YAMLs
   (`lm_eval/tasks/arc/arc_easy.yaml`, `piqa/piqa.yaml`, `winogrande/default.yaml` +
   `preprocess_winogrande.py`, its partial-evaluation functions) that reads those files
   instead of the hub (`eval.lm_harness.local_task_yaml`: only the dataset and split lines
   change; the hub cannot be reached here);
3. makes the checkpoints: tiny-moe (the committed Qwen3-VL-MoE), a RoleMerge merge of it
   (rolemerge.calibrate + rolemerge.merge, rho 0.5) and a random tiny Qwen3-MoE causal LM;
4. for each, runs the harness (`lm_eval.simple_evaluate`, --log_samples) on the local tasks
   and our scorer on the same documents, and compares: the harness's request strings with
   `eval.lm_harness.requests` (exact), every choice's log-likelihood (|diff| <= --tol nats),
   each document's predicted choice, and acc / acc_norm. The VLM checkpoints go to the
   harness as loaded modules (`eval.lm_harness.harness_lm`, what `python -m eval.lm_harness`
   does); the Qwen3-MoE also through the harness's stock `hf` class from its directory;
5. runs the entry point `python -m eval.lm_harness` on tiny-moe's local tasks and checks that its
   result file holds the harness's acc / acc_norm of step 4.
Exits 1 if any comparison differs, 2 for a setup error. Every step's output stays in --out; a
rerun redoes only what is missing (--overwrite redoes all). About 5 minutes on a busy 2-core CPU
after the venv (installing lm-eval and its dependencies takes longer).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

from eval.tools import lmms_check
# deferred: lm_eval, torch, transformers, eval.lm_harness (the check starts from the standard library
# alone and makes its own venv; these load only in the steps it runs inside that venv)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PINS = lmms_check.PINS
HARNESS_FILES = {"arc_easy": ("arc/arc_easy.yaml",), "piqa": ("piqa/piqa.yaml",),
                 "winogrande": ("winogrande/default.yaml", "winogrande/preprocess_winogrande.py")}


def log(msg):
    lmms_check.log(msg, "lm_harness_check")


def run(cmd, env, what, check=True):
    """Run a command in the repo root; on failure print its tail and exit 2 (check=True)."""
    return lmms_check.run(cmd, env, what, check, tool="lm_harness_check")


def ensure_venv(venv, version, env):
    """The venv's python (made on first use: requirements.txt, then lm-eval[hf]==version with
    our pins as constraints) and a line of the versions it holds."""
    venv = os.path.abspath(venv)  # a relative --venv (the default, under out/) stays valid in every subprocess
    py = os.path.join(venv, "bin", "python")
    pins = lmms_check.our_pins()
    have = os.path.exists(py) and subprocess.run([py, "-c", f"import lm_eval, lm_eval.models.huggingface, sys; sys.exit("
                                                        f"lm_eval.__version__ != {version!r})"], env=env, capture_output=True).returncode == 0
    if not have:
        py, cons = lmms_check.venv_with_pins(venv, env, pins, tool="lm_harness_check")
        run([py, "-m", "pip", "install", "-q", "-r", os.path.join(REPO, "requirements.txt")], env, "our requirements")
        p = run([py, "-m", "pip", "install", "-q", f"lm-eval[hf]=={version}", "-c", cons], env,
                f"lm-eval {version} (our pins as constraints)", check=False)
        if p.returncode != 0:
            sys.stderr.write((p.stdout + p.stderr)[-4000:])
            print(f"error: lm-eval {version} cannot be installed beside our pins ({', '.join(pins.values())}); the "
                  f"resolver's message is above. Try another --lm-eval-version.", file=sys.stderr)
            raise SystemExit(2)
    freeze = subprocess.run([py, "-m", "pip", "freeze"], env=env, capture_output=True, text=True).stdout
    vers = {l.split("==")[0].lower().replace("_", "-"): l.split("==")[1] for l in freeze.splitlines() if "==" in l}
    return py, ", ".join(f"{n} {vers.get(n, '-')}" for n in PINS + ("lm-eval", "datasets"))


# ----------------------------------------------------------------------------- inside the venv

def make_tasks(out_dir, n):
    """Synthetic documents (JSONL per task) and local copies of the installed harness's task
    YAMLs reading them: OUT/<task>_local.yaml. Returns {task: [doc]}."""
    import lm_eval
    from eval.lm_harness import local_task_yaml, synthetic_docs
    root = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
    docs = synthetic_docs(n)
    os.makedirs(out_dir, exist_ok=True)
    for task, files in HARNESS_FILES.items():
        data = os.path.join(out_dir, f"{task}.jsonl")
        with open(data, "w") as f:
            f.write("".join(json.dumps(d) + "\n" for d in docs[task]))
        with open(os.path.join(root, files[0])) as f:
            text = f.read()
        if any(l.startswith("include:") for l in text.splitlines()):
            raise SystemExit(f"error: {files[0]} includes another YAML; this check copies single-file tasks only")
        with open(os.path.join(out_dir, f"{task}_local.yaml"), "w") as f:
            f.write(local_task_yaml(text, f"{task}_local", data))
        for extra in files[1:]:
            shutil.copy(os.path.join(root, extra), out_dir)
    with open(os.path.join(out_dir, "docs.json"), "w") as f:
        json.dump(docs, f)
    return docs


def make_qwen3_moe(out_dir, tokenizer_dir):
    """A random tiny Qwen3-MoE causal LM (4 layers, 8 experts top-2, seed 0) with tiny-moe's
    tokenizer, saved with save_pretrained."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    Qwen3MoeForCausalLM(cfg).eval().save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def drive(model_path, name, stock, tasks_dir, batch_size, tol, out_file):
    """Harness and ours on one checkpoint: agreement rows written to `out_file`."""
    from lm_eval.models.huggingface import HFLM
    from eval import lm_harness as lh
    with open(os.path.join(tasks_dir, "docs.json")) as f:
        docs = json.load(f)
    model, tok = lh.load_lm(model_path)
    lm = HFLM(pretrained=model_path, backend="causal", batch_size=batch_size, device="cpu") if stock \
        else lh.harness_lm(model, tok, batch_size)
    metrics, samples = lh.run_harness(lm, [f"{t}_local" for t in lh.TEXT3], include_path=tasks_dir)
    rows = []
    for task in lh.TEXT3:
        ours, ours_m = lh.score_docs(model, tok, task, docs[task], batch_size)
        logged = samples[f"{task}_local"]
        row = lh.compare(ours, ours_m, lh.harness_lls(logged), metrics[f"{task}_local"], tol)
        mine = {i: list(zip(*lh.requests(task, d)[:2])) for i, d in enumerate(docs[task])}
        row["requests_equal"] = all([tuple(a) for a in lh.harness_args(s)] == [tuple(p) for p in mine[int(s["doc_id"])]]
                                    for s in logged)
        row["equal"] = row["equal"] and row["requests_equal"]
        rows.append({"model": name, "harness_model": "hf (stock, from the directory)" if stock else
                     "HFLM around the loaded module (eval.lm_harness)", "task": task, **row})
    with open(out_file + ".tmp", "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(out_file + ".tmp", out_file)


# ----------------------------------------------------------------------------- outside

def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eval.tools.lm_harness_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--venv", default="out/venv-lmeval", help="venv for lm-eval (made if missing)")
    p.add_argument("--lm-eval-version", default="0.4.13", help="lm-eval version to install (default 0.4.13)")
    p.add_argument("--out", default="out/lm_harness_check", help="working folder (default out/lm_harness_check)")
    p.add_argument("--n", type=int, default=12, help="synthetic documents per task (default 12)")
    p.add_argument("--batch-size", type=int, default=8, help="batch size, ours and the harness's (default 8)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest |log-likelihood difference| in nats (default 1e-4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--result", default=None, help="also write the rows as a result file here (eval.report format)")
    p.add_argument("--overwrite", dest="fresh", action="store_true",
                   help="redo every step (not the venv; default: continue, skipping the steps done)")
    p.add_argument("--driver", nargs=4, metavar=("MODEL", "NAME", "STOCK", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--make", nargs=2, metavar=("WHAT", "DIR"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    out = os.path.abspath(a.out)
    tasks = os.path.join(out, "tasks")
    if a.make:  # inside the venv
        if a.make[0] == "tasks":
            make_tasks(a.make[1], a.n)
        else:
            make_qwen3_moe(a.make[1], os.path.join(REPO, "common", "tiny", "moe"))
        return 0
    if a.driver:  # inside the venv
        import torch
        torch.set_num_threads(a.threads)
        model, name, stock, rows_file = a.driver
        drive(model, name, stock == "stock", tasks, a.batch_size, a.tol, rows_file)
        return 0

    if a.fresh:
        shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=os.path.join(out, "hf"),
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO)
    py, versions = ensure_venv(a.venv, a.lm_eval_version, env)
    log(f"venv: {versions}")
    me = [py, "-m", "eval.tools.lm_harness_check", "--out", out, "--n", str(a.n), "--batch-size", str(a.batch_size),
          "--tol", str(a.tol), "--threads", str(a.threads)]
    run(me + ["--make", "tasks", tasks], env, "synthetic documents and local copies of the harness's task YAMLs")
    T = ["--threads", str(a.threads)]
    rm = os.path.join(out, "rolemerge")
    merged = os.path.join(rm, "tiny-moe-rho0.5")
    if not os.path.exists(os.path.join(merged, "config.json")):
        data = os.path.join(out, "data")
        if not os.path.exists(os.path.join(data, "val.json")):
            run([py, "-m", "common.shapes", "--out", data, "--n-train", "20", "--n-val", "20", "--n-test", "4",
                 "--overwrite"], env, "shapes data (calibration)")
        stats = os.path.join(rm, "stats.safetensors")
        run([py, "-m", "rolemerge.calibrate", "--model", "tiny-moe", "--data", os.path.join(data, "val.json"),
             "--limit", "20", "--out", stats, "--overwrite"] + T, env, "RoleMerge calibration")
        run([py, "-m", "rolemerge.merge", "--model", "tiny-moe", "--stats", stats, "--rho", "0.5", "--out", merged,
             "--overwrite"] + T, env, "RoleMerge merge")
    qwen3 = os.path.join(out, "qwen3_moe")
    if not os.path.exists(os.path.join(qwen3, "config.json")):
        run(me + ["--make", "qwen3_moe", qwen3], env, "random tiny Qwen3-MoE")
    runs = [("tiny-moe", os.path.join(REPO, "common", "tiny", "moe"), "module"),
            ("tiny-moe RoleMerge rho 0.5", merged, "module"),
            ("tiny Qwen3-MoE (random)", qwen3, "module"),
            ("tiny Qwen3-MoE (random)", qwen3, "stock")]
    rows, failed = [], []
    for name, path, how in runs:
        f = os.path.join(out, f"rows_{name.split()[0]}_{os.path.basename(path)}_{how}.json")
        if not os.path.exists(f):
            pr = run(me + ["--driver", path, name, how, f], env, f"harness and ours: {name} ({how})", check=False)
            with open(f[:-5] + ".log", "w") as fh:
                fh.write(pr.stdout + pr.stderr)
            if pr.returncode != 0:
                tail = (pr.stdout + pr.stderr).strip().splitlines()[-3:]
                failed.append((name, how, " | ".join(tail)[-400:]))
                continue
        with open(f) as fh:
            rows += json.load(fh)
    # the entry point itself (python -m eval.lm_harness: result file, request cache) on tiny-moe's local tasks
    entry = os.path.join(out, "entry_point.json")
    if not os.path.exists(entry) or a.fresh:
        run([py, "-m", "eval.lm_harness", "--model", "tiny-moe", "--tasks", ",".join(f"{t}_local" for t in HARNESS_FILES),
             "--include-path", tasks, "--limit", "0", "--batch-size", str(a.batch_size), "--out", entry,
             "--overwrite"] + T, env, "python -m eval.lm_harness on tiny-moe (the local tasks)", check=False)
    if os.path.exists(entry):
        with open(entry) as fh:
            got = {(r["task"][:-len("_local")], r["metric"]): r["value"] for r in json.load(fh)["rows"]}
        for r in [r for r in rows if r["model"] == "tiny-moe"]:
            same = all(got.get((r["task"], m)) == r[f"{m}_harness"] for m in ("acc", "acc_norm") if f"{m}_harness" in r)
            rows.append({"model": "tiny-moe", "harness_model": "python -m eval.lm_harness (its result file)",
                         "task": r["task"], "n": r["n"], "acc_ours": r["acc_ours"], "acc_harness": got.get((r["task"], "acc")),
                         "acc_norm_harness": got.get((r["task"], "acc_norm")), "max_abs_ll_diff": None,
                         "preds_differ": None, "requests_equal": None, "equal": same})
    else:
        failed.append(("tiny-moe", "python -m eval.lm_harness", "no result file"))
    print(f"\nLM Evaluation Harness vs eval.lm_harness.score_docs ({a.n} synthetic documents per task, tol {a.tol:g})")
    print(f"{'model':28s} {'harness model':10s} {'task':11s} {'acc ours/harness':>17s} {'max |dll|':>10s} "
          f"{'preds differ':>12s} {'requests':>9s} equal")
    for r in rows:
        how = r["harness_model"]
        how = "stock hf" if how.startswith("hf") else "entry" if how.startswith("python") else "module"
        dll = "-" if r["max_abs_ll_diff"] is None else f"{r['max_abs_ll_diff']:.2e}"
        req = "-" if r["requests_equal"] is None else "same" if r["requests_equal"] else "DIFFER"
        print(f"{r['model']:28s} {how:10s} {r['task']:11s} {r['acc_ours']:8.4f}/{r['acc_harness'] or float('nan'):<8.4f} "
              f"{dll:>10s} {'-' if r['preds_differ'] is None else r['preds_differ']:>12} {req:>9s} "
              f"{'yes' if r['equal'] else 'NO'}")
    for name, how, why in failed:
        print(f"{name} ({how}): failed: {why}")
    print(f"venv: {versions}")
    summary = {"experiment": "lm_harness_check",
               "source": f"python -m eval.tools.lm_harness_check --threads {a.threads} --n {a.n} --batch-size "
                         f"{a.batch_size} --tol {a.tol:g} ({versions}; {a.n} synthetic documents per task, local "
                         f"copies of the installed harness's arc_easy / piqa / winogrande YAMLs)",
               "rows": rows, "failed": failed}
    with open(os.path.join(out, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    if a.result:
        os.makedirs(os.path.dirname(os.path.abspath(a.result)), exist_ok=True)
        with open(a.result + ".tmp", "w") as fh:
            fh.write(json.dumps(summary, indent=1) + "\n")
        os.replace(a.result + ".tmp", a.result)
        log(f"wrote {a.result}")
    raise SystemExit(1 if failed or not rows or not all(r["equal"] for r in rows) else 0)


if __name__ == "__main__":
    main()
