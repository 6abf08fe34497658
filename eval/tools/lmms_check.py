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
   (mole.train), merges tiny-moe with RoleMerge (calibrate + merge, rho 0.5), and saves a tiny
   random LLaVA-NeXT and Gemma3 (`tests/test_families.py`'s `llava_next_vicuna`: Vicuna tokenizer
   and template; `gemma3`: Gemma tokenizer and template; as `save_pretrained` writes them; the end
   token's output row made to win where the token it generates most would, so that stopping is
   exercised);
4. scores each with our own entry points (mod.infer, mole.infer, eval.evaluate, and
   eval.evaluate.score_options for option log-likelihood) and with lmms-eval
   (`python -m eval.lmms --model mod|mole ...`, lmms-eval's stock `qwen3_vl` and `huggingface`
   classes on the merged checkpoint, its stock `llava_hf` and `gemma3` classes on the LLaVA-NeXT
   and Gemma3 ones, which `eval.evaluate --prompt-settings lmms-eval --batch-size 1` scores,
   Gemma3 in bf16 as the class loads it), on the same records; for
   LLaVA-NeXT it also compares, record by record, the prompt ids and pixels that `llava_hf`
   builds (its own code, called in its venv) with those of eval.evaluate;
5. prints both scores per run, the number of records whose verdict and whose generated text
   differ, and exits with 1 if any score differs or an lmms-eval run fails (2 for a setup
   error). Without torchvision (--torch cpu) the stock-class runs are skipped, not failed.

Measured (mod/README.md, "lmms-eval"; eval/README.md for llava): with --torch cpu every
comparison is equal; with --torch pypi ours are equal too, the stock llava_hf class gives the
LLaVA-NeXT checkpoint the same prompt ids, pixels and texts as eval.evaluate, and both stock
classes fail on the tiny merged checkpoint (qwen3_vl: patch 16 assumed, our tiny bases have 14;
huggingface: `audios=` refused by transformers 5), so `--runs merged` exits 1.

--runs picks which of mod, mole, merged, llava, gemma3 run (default all). Every step's output stays in
--out; a rerun redoes only what is missing (--overwrite redoes all).
Runs one thread per process (`--threads`); about 10 minutes on a busy 2-core CPU after the venv.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import time

# deferred: common.cli (it loads torch; the check starts from the standard library alone and makes its own venv)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PINS = ("torch", "transformers", "tokenizers", "safetensors", "pillow", "tqdm", "numpy")
DEFAULT_MAX_NEW_TOKENS = 48  # the generation budget of `eval.lmms make-task` and eval.evaluate
RUNS = ("mod", "mole", "merged", "llava", "gemma3")
# lmms-eval's stock classes: they need torchvision (AutoProcessor's video processors, qwen_vl_utils) and
# decord (imported at the top of their modules), so only a --torch pypi venv runs them
STOCK = ("merged qwen3_vl", "merged hf", "llava_hf", "gemma3")

# a tiny random checkpoint of a family of tests/test_families.py in its real format (llava_next_vicuna:
# llava-v1.6-vicuna-hf; gemma3: gemma-3-it). Random weights never pick the end token, so stopping would go
# untested: its output row copies that of the token the model generates most on three test prompts
# (times 1.001), so every time that token would win, the end token wins and generation stops, at a
# different step per record.
LLAVA_SNIPPET = """
import os, shutil, sys
from collections import Counter
import torch
sys.path.insert(0, "tests")
from test_families import build_family
from common.backbone import VLProcessor, generate
from common.data import load_image, read_any
model, hf = build_family({family!r})
proc = VLProcessor(hf, model.config, model.generation_config)
recs = read_any({test!r})[:3]
batch = proc.encode([load_image(r["image"]) for r in recs], [r["question"] for r in recs])
with torch.no_grad():
    out = model.generate(**batch, max_new_tokens=48, do_sample=False, eos_token_id=proc.stop_ids,
                         pad_token_id=proc.pad_token_id)[:, batch["input_ids"].shape[1]:]
tok = Counter(out.flatten().tolist()).most_common(1)[0][0]
eos = proc.eos_token_id  # the end token the template writes after an answer (</s>, <end_of_turn>)
with torch.no_grad():
    w = model.get_output_embeddings().weight
    w[eos] = w[tok] * 1.001
shutil.rmtree({tmp!r}, ignore_errors=True)
model.save_pretrained({tmp!r})
hf.save_pretrained({tmp!r})
os.replace({tmp!r}, {path!r})
"""

# for the records whose texts differ under lmms-eval's gemma3 (simple) class: its inputs built by its own
# steps (simple/gemma3.py:243-292: system turn, JPEG data URL, the processor's apply_chat_template), with
# and without its pad_to_multiple_of=8, generated as it does (:320-329) and decoded as it does (:331)
GEMMA_PAD_SNIPPET = """
import json, os, torch
torch.set_num_threads({threads})
from transformers import AutoProcessor, Gemma3ForConditionalGeneration
from lmms_eval.models.model_utils.media_encoder import encode_image_to_data_url
from common.backbone import load_backbone
from common.data import load_image, read_any
from eval.evaluate import apply_prompt_settings
ours_text = {{r["id"]: r["pred"] for r in json.load(open({ours!r}))["results"]}}
model = Gemma3ForConditionalGeneration.from_pretrained({path!r}, torch_dtype=torch.bfloat16).eval()
processor = AutoProcessor.from_pretrained({path!r}, max_pixels=1605632, min_pixels=256 * 28 * 28)
_, proc = load_backbone({path!r}, dtype=torch.bfloat16)
apply_prompt_settings(model, proc, "lmms-eval")
out = {{}}
for r in read_any({test!r}):
    if r["id"] not in {ids!r}:
        continue
    im = load_image(r["image"])
    url = encode_image_to_data_url(im, image_format="JPEG", mime_type="image/jpeg", convert_rgb=True, quality=85)
    msgs = [[{{"role": "system", "content": [{{"type": "text", "text": "You are a helpful assistant."}}]}},
             {{"role": "user", "content": [{{"type": "image", "image": url}}, {{"type": "text", "text": r["question"]}}]}}]]
    build = lambda **kw: processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                       return_tensors="pt", **kw).to("cpu", dtype=torch.bfloat16)
    padded, plain = build(processor_kwargs={{"padding": True, "pad_to_multiple_of": 8}}), build()
    ours = proc.encode([im], [r["question"]])
    def text(b):
        with torch.no_grad():
            g = model.generate(**b, do_sample=False, max_new_tokens={max_new_tokens})[:, b["input_ids"].shape[1]:]
        return processor.batch_decode(g, skip_special_tokens=True, clean_up_tokenization_spaces=False)[0]
    out[r["id"]] = {{"pad_tokens": int((padded["attention_mask"][0] == 0).sum()),
                    "ids_equal_unpadded": plain["input_ids"].tolist() == ours["input_ids"].tolist(),
                    "pixels_equal_unpadded": torch.equal(plain["pixel_values"], ours["pixel_values"].to(torch.bfloat16)),
                    "unpadded_text_equals_ours": text(plain) == ours_text[r["id"]],
                    "padded_text_equals_ours": text(padded) == ours_text[r["id"]]}}
json.dump(out, open({out!r} + ".tmp", "w"), indent=1)
os.replace({out!r} + ".tmp", {out!r})
"""

# the prompt ids and pixels of lmms-eval's llava_hf (chat) class, built by its own code
# (models/chat/llava_hf.py:48-68: the task's auto messages, the processor's template, the processor
# call), against eval.evaluate's (load_backbone + apply_prompt_settings + VLProcessor.encode)
LLAVA_IDS_SNIPPET = """
import json, os, torch
torch.set_num_threads({threads})
from lmms_eval.api.task import ConfigurableMessagesTask
from lmms_eval.models.chat.llava_hf import LlavaHf
from lmms_eval.protocol import ChatMessages
from common.backbone import load_backbone
from common.data import load_image, read_any
from eval.evaluate import apply_prompt_settings
lm = LlavaHf(pretrained={path!r}, device="cpu", device_map="cpu")
model, proc = load_backbone({path!r})
apply_prompt_settings(model, proc, "lmms-eval")
rows = []
for r in read_any({test!r}):
    im = load_image(r["image"])
    msgs = ChatMessages(messages=ConfigurableMessagesTask._build_user_turn([im], r["question"]))
    visual, _, _ = msgs.extract_media()
    text = lm._image_processor.apply_chat_template(msgs.model_dump()["messages"], tokenize=False,
                                                   add_generation_prompt=True)
    theirs = lm._image_processor(images=visual, text=text, return_tensors="pt")
    ours = proc.encode([im], [r["question"]])
    rows.append({{"id": r["id"], "ids_equal": ours["input_ids"].tolist() == theirs["input_ids"].tolist(),
                 "pixels_equal": torch.equal(ours["pixel_values"], theirs["pixel_values"].to(ours["pixel_values"].dtype)),
                 "image_sizes_equal": torch.equal(ours["image_sizes"], theirs["image_sizes"]),
                 "prompt": text, "n_ids": len(theirs["input_ids"][0])}})
json.dump(rows, open({out!r} + ".tmp", "w"), indent=1)
os.replace({out!r} + ".tmp", {out!r})
"""


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
    (--log_samples). Samples name documents by their index in the task's JSONL (doc_id). The text
    is the raw generation, "resps": lmms-eval scores and logs it stripped ("filtered_resps",
    api/reasoning.py:35) and leaves "resps" out of a sample where the two are equal
    (loggers/evaluation_tracker.py:280)."""
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
                    t = s.get("resps", s["filtered_resps"])
                    while isinstance(t, list):
                        t = t[0]
                    text[k] = t
        out[task] = (metrics[key], per, text)
    return out


def compare(rows, name, ref, got):
    """Append a comparison row: ref and got are (score, {id: 0/1}, {id: text}); equal means equal
    scores, verdicts and texts."""
    (a, pa, ta), (b, pb, tb) = ref, got
    differ = sum(1 for k in pa if k in pb and bool(pa[k]) != bool(pb[k]))
    texts = sum(1 for k in ta if k in tb and ta[k] != tb[k]) if ta and tb else None
    rows.append((name, a, b, differ, texts, abs(a - b) < 1e-9 and differ == 0 and not texts and len(pa) == len(pb)))


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
                   help="torch of a new venv: cpu = our local CPU wheel (no torchvision: lmms-eval's stock classes "
                        "cannot run), pypi = the index's build of the same version + torchvision (~3 GB)")
    p.add_argument("--runs", default=",".join(RUNS),
                   help=f"comma-separated comparisons to run, of {', '.join(RUNS)} (default all)")
    p.add_argument("--overwrite", dest="fresh", action="store_true",
                   help="redo every step (not the venv; default: continue, skipping the steps done)")
    a = p.parse_args(argv)
    want = [r.strip() for r in a.runs.split(",") if r.strip()]
    if not want or set(want) - set(RUNS):
        p.error(f"--runs {a.runs!r}: choose from {', '.join(RUNS)}")
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
        run([py, "-m", "common.shapes", "--out", data, "--n-train", "300", "--n-val", "40", "--n-test", str(a.n),
             "--overwrite"], env, "shapes data")
    test = os.path.join(data, "test.json")
    tasks = os.path.join(out, "tasks")
    run([py, "-m", "eval.lmms", "make-task", "--data", test, "--out", tasks, "--overwrite"], env, "lmms-eval task")

    # the checkpoints
    mod_dir, mole_dir = os.path.join(out, "mod"), os.path.join(out, "mole")
    rm = os.path.join(out, "rolemerge")
    # lmms-eval's qwen3_vl class picks the MoE model class from the *path* (regex "A<n>B", as in
    # Qwen3-VL-30B-A3B): a merged checkpoint's folder must keep that pattern in its name.
    merged = os.path.join(rm, "tiny-moe-A1B-rho0.5")
    llava = os.path.join(out, "llava_next")
    gemma = os.path.join(out, "gemma3")
    if "mod" in want and not os.path.exists(os.path.join(mod_dir, "adapter_config.json")):
        run([py, "-m", "mod.train", "--model", "tiny-chat", "--data", os.path.join(data, "train.json"), "--out",
             mod_dir, "--steps", "30", "--warmup-steps", "20", "--batch-size", "8", "--lr", "5e-3", "--overwrite"] + T, env, "MoD adapter")
    if "mole" in want and not os.path.exists(os.path.join(mole_dir, "state.json")):
        run([py, "-m", "mole.train", "--data", data, "--out", mole_dir, "--max-steps", "30", "--batch-size", "8",
             "--overwrite", "--quiet"] + T, env, "MoLE checkpoint")
    if "merged" in want and not os.path.exists(os.path.join(merged, "config.json")):
        stats = os.path.join(rm, "stats.safetensors")
        run([py, "-m", "rolemerge.calibrate", "--model", "tiny-moe", "--data", os.path.join(data, "val.json"),
             "--limit", "20", "--out", stats, "--overwrite"] + T, env, "RoleMerge calibration")
        run([py, "-m", "rolemerge.merge", "--model", "tiny-moe", "--stats", stats, "--rho", "0.5", "--out", merged,
             "--overwrite"] + T, env, "RoleMerge merge")
    if "llava" in want and has_tv and not os.path.exists(os.path.join(llava, "config.json")):
        run([py, "-c", LLAVA_SNIPPET.format(family="llava_next_vicuna", test=test, tmp=llava + ".tmp", path=llava)],
            env, "tiny LLaVA-NeXT checkpoint (random weights, Vicuna tokenizer and template)")
    if "gemma3" in want and has_tv and not os.path.exists(os.path.join(gemma, "config.json")):
        run([py, "-c", LLAVA_SNIPPET.format(family="gemma3", test=test, tmp=gemma + ".tmp", path=gemma)],
            env, "tiny Gemma3 checkpoint (random weights, Gemma tokenizer and template)")

    # our own scores
    ref = os.path.join(out, "ref")
    os.makedirs(ref, exist_ok=True)
    refs = {}

    def per(results):
        return (sum(r["correct"] for r in results) / len(results), {r["id"]: r["correct"] for r in results},
                {r["id"]: r["pred"] for r in results if "pred" in r and r["pred"] is not None and "scores" not in r})

    done = lambda path: os.path.exists(path)  # each reference run writes its file last (atomically)
    if "mod" in want:
        f = os.path.join(ref, "mod.json")
        done(f) or run([py, "-m", "mod.infer", "--model", "tiny-chat", "--adapter", mod_dir, "--data", test, "--methods",
             "single,multi", "--rounds", "1", "--max-new-tokens", "96", "--batch-size", B, "--out", f] + T, env,
            "ours: mod.infer single,multi")
        with open(f) as fh:
            r = json.load(fh)["results"]
        refs["mod single"], refs["mod multi"] = per(r["single"]), per(r["multi"])
    if "mole" in want:
        f = os.path.join(ref, "mole.json")
        done(f) or run([py, "-m", "mole.infer", "--ckpt", mole_dir, "--data", test, "--batch-size", B, "--out", f] + T,
                       env, "ours: mole.infer")
        with open(f) as fh:
            refs["mole"] = per(json.load(fh))
    if "merged" in want:
        f = os.path.join(ref, "merged.json")
        done(f) or run([py, "-m", "eval.evaluate", "--model", merged, "--data", test, "--batch-size", "1", "--dtype",
                        "bfloat16", "--out", f] + T, env, "ours: eval.evaluate on the merged checkpoint (bf16 and one "
                                                          "record at a time, as lmms-eval's stock classes run it)")
        with open(f) as fh:
            refs["merged"] = per(json.load(fh)["results"])
    if "llava" in want and has_tv:  # (only the stock llava_hf class is compared with it)
        f = os.path.join(ref, "llava.json")
        done(f) or run([py, "-m", "eval.evaluate", "--model", llava, "--data", test, "--batch-size", "1",
                        "--prompt-settings", "lmms-eval", "--out", f] + T, env,
                       "ours: eval.evaluate --prompt-settings lmms-eval on the LLaVA-NeXT checkpoint (one record at a "
                       "time, as lmms-eval's llava_hf runs it)")
        with open(f) as fh:
            refs["llava_hf"] = per(json.load(fh)["results"])
    if "gemma3" in want and has_tv:
        f = os.path.join(ref, "gemma3.json")
        done(f) or run([py, "-m", "eval.evaluate", "--model", gemma, "--data", test, "--batch-size", "1",
                        "--dtype", "bfloat16", "--prompt-settings", "lmms-eval", "--out", f] + T, env,
                       "ours: eval.evaluate --prompt-settings lmms-eval on the Gemma3 checkpoint (bf16, one record at "
                       "a time, as lmms-eval's gemma3 runs it)")
        with open(f) as fh:
            refs["gemma3"] = per(json.load(fh)["results"])
    if "mod" in want or "mole" in want:
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
out = {{}}
if {"mod" in want}:
    model, proc = load_backbone("tiny-chat"); load_adapters(model, {mod_dir!r})
    out["mod"] = [{{"id": r["id"], "correct": r["correct"]}} for r in score_options(model, proc, recs, batch_size={B})]
if {"mole" in want}:
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
        if done(f):
            with open(f) as fh:
                if not all(m in json.load(fh) for m in ("mod", "mole") if m in want):
                    os.remove(f)
        done(f) or run([py, "-c", snippet], env,
                       "ours: option log-likelihood (eval.evaluate.score_options; MoLE: eval.lmms.loglik_mole)")
        with open(f) as fh:
            ll = json.load(fh)
        for m in ("mod", "mole"):
            if m in ll:
                refs[f"{m} mc"] = per(ll[m])

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
             ["--batch_size", "1"]),
            # lmms-eval's stock llava_hf (its chat class: the processor's template; batch size 1 only)
            ("llava_hf", "llava_hf", f"pretrained={llava},device_map=cpu", "shapes", ["--batch_size", "1"]),
            # lmms-eval's stock gemma3 (simple class: system turn, JPEG data URLs, bf16)
            ("gemma3", "gemma3", f"pretrained={gemma},device_map=cpu", "shapes", ["--batch_size", "1"])]
    failed, skipped = [], []
    ids_check = None
    os.makedirs(os.path.join(out, "lmms"), exist_ok=True)
    for name, model, margs, task_list, extra in runs:
        if name.split()[0].replace("llava_hf", "llava") not in want:
            continue
        if name in STOCK and not has_tv:
            skipped.append((name, model, "not run: lmms-eval's stock classes need torchvision (AutoProcessor's video "
                                        "processors, qwen_vl_utils) and decord, which cannot load beside torch "
                                        "2.13.0+cpu; rerun with --torch pypi --venv ANOTHER_VENV"))
            continue
        if name == "llava_hf":
            f = os.path.join(ref, "llava_ids.json")
            done(f) or run([py, "-c", LLAVA_IDS_SNIPPET.format(threads=a.threads, path=llava, test=test, out=f)], env,
                           "prompt ids and pixels: lmms-eval's llava_hf vs eval.evaluate")
            with open(f) as fh:
                ids_rows = json.load(fh)
            ids_check = {k: sum(not r[k] for r in ids_rows) for k in ("ids_equal", "pixels_equal", "image_sizes_equal")}
            ids_check = {"n": len(ids_rows), **{k.replace("_equal", "_differ"): v for k, v in ids_check.items()},
                         "prompt_example": ids_rows[0]["prompt"]}
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
    padding = None
    if "gemma3" in got:  # why gemma3's texts differ, if they do: its padding to a multiple of 8?
        ta, tb = refs["gemma3"][2], got["gemma3"][2]
        differ = sorted(k for k in ta if k in tb and ta[k] != tb[k])
        if differ:
            f = os.path.join(ref, "gemma3_padding.json")
            run([py, "-c", GEMMA_PAD_SNIPPET.format(threads=a.threads, path=gemma, test=test, ids=differ, out=f,
                                                    ours=os.path.join(ref, "gemma3.json"),
                                                    max_new_tokens=DEFAULT_MAX_NEW_TOKENS)],
                env, "gemma3: the differing records again, with and without its pad_to_multiple_of=8")
            with open(f) as fh:
                padding = json.load(fh)
    n = len(next(iter(refs.values()))[1]) if refs else 0
    print(f"\nlmms-eval vs ours on the same records (shapes test split, n={n})")
    print(f"{'run':16s} {'ours':>7s} {'lmms-eval':>9s} {'verdicts differ':>15s} {'texts differ':>12s}  equal")
    for name, x, y, d, t, ok in rows:
        print(f"{name:16s} {x:7.4f} {y:9.4f} {d:15d} {'-' if t is None else t:>12}  {'yes' if ok else 'NO'}")
    if ids_check:
        print(f"llava_hf inputs: of {ids_check['n']} records, prompt ids differ in {ids_check['ids_differ']}, pixels "
              f"in {ids_check['pixels_differ']}, image sizes in {ids_check['image_sizes_differ']}; its prompt: "
              f"{ids_check['prompt_example']!r}")
    if padding:
        print(f"gemma3, the {len(padding)} records whose texts differ: without its padding to a multiple of 8 the class's "
              f"inputs give our text in {sum(v['unpadded_text_equals_ours'] for v in padding.values())} (ids equal in "
              f"{sum(v['ids_equal_unpadded'] for v in padding.values())}, pixels in "
              f"{sum(v['pixels_equal_unpadded'] for v in padding.values())}), with it in "
              f"{sum(v['padded_text_equals_ours'] for v in padding.values())}")
    for name, model, why in failed + skipped:
        print(f"{name:16s} lmms-eval --model {model}: {why}")
    for n_ in notes:
        print(f"venv: {n_}")
    with open(os.path.join(out, "summary.json"), "w") as fh:
        json.dump({"rows": rows, "inputs": ids_check, "gemma3_padding": padding, "failed": failed,
                   "skipped": skipped, "notes": notes}, fh, indent=1)
    bad = [r for r in rows if not r[5]] or failed or (ids_check and (ids_check["ids_differ"] or ids_check["pixels_differ"]))
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
