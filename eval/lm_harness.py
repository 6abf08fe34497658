"""Text3 (ARC-Easy, PIQA, Winogrande) through the LM Evaluation Harness, and the same three
tasks scored by our own log-likelihood code.

RoleMerge's table ("Beyond Global Routing Aggregation: Phase-Aware Expert Merging for MoE
Vision-Language Models", App. C.2, Table 5) averages six tasks: MM3 (lmms-eval) and Text3 =
`arc_easy`, `piqa`, `winogrande` of the pinned LM Evaluation Harness (EleutherAI), 1,000
examples each (the first 1,000 of each task's evaluation split: `--limit`), scored as
"accuracy x 100", i.e. the harness's `acc` (argmax of the summed continuation log-likelihood;
`acc_norm`, the per-character normalised variant ARC and PIQA also report, is recorded
beside it but is not the paper's number). Text3 = the mean of the three `acc`, x 100.

    python -m eval.lm_harness --model /ckpt/Qwen3-VL-30B-A3B-Instruct --out scores/full/text3.json
    python -m eval.lm_harness --model merged/rho0.5 --out scores/rho0.5/text3.json --batch-size 8
    python -m eval.lm_harness --model tiny-moe --tasks arc_easy --limit 20 --out /tmp/t.json

lm-eval is not one of our requirements: run this from a venv that has it, e.g. the one
`python -m eval.tools.lm_harness_check` builds (requirements.txt + lm-eval[hf]==0.4.13 with
our pins held; `out/venv-lmeval/bin/python -m eval.lm_harness ...`). The harness downloads the
three datasets from the hub on first use (`allenai/ai2_arc`, `baber/piqa`,
`allenai/winogrande`); offline, fill the HF datasets cache elsewhere first.

The model. Any checkpoint we make or merge loads here: a plain causal LM (Qwen3-MoE, OLMoE,
Mixtral, Qwen2-MoE, DeepSeek-V2: `AutoModelForCausalLM`) or a VLM whose class is only an
image-text-to-text one (Qwen3-VL-MoE, Qwen3-VL, Qwen2.5-VL: `AutoModelForImageTextToText`,
called on text alone; the harness's stock `hf` class refuses those, its `AutoModelForCausalLM`
has no mapping for them). We load it ourselves (safetensors only, no checkpoint code unless
`--trust-remote-code`) and hand the module and its tokenizer to the harness's `HFLM`
(`lm_eval.models.huggingface.HFLM(pretrained=<model>, tokenizer=<tokenizer>, backend="causal")`),
so the requests, the tokenization and the metrics are the harness's own. DeepSeek-VL2 (remote
code only) is not covered.

The result file (`--out`, written atomically after each task; an interrupted run resumes at
the first unfinished task, whose answered requests come back from the harness's request cache
`<out>.cache_rank0.db`; the same `--out` with other settings is refused without `--overwrite`,
which also empties the cache): {"experiment": "text3", "source", "settings", "rows": [{"model", "task",
"metric", "value" (fraction), "score" (x 100), "stderr", "n", "paper": true for the metric the
paper reports}], "samples": {task: [{"doc" (index), "lls" (per choice), "acc"}]}}, plus a "text3" row (mean
`acc` of the three) once all three are done: the format `eval.report` renders tables from.

Our side (no lm-eval needed): `requests(task, doc)` mirrors each task's doc_to_text /
doc_to_choice / doc_to_target / target_delimiter (0.4.13's YAMLs), including Winogrande's
partial evaluation; `encode_pair` mirrors the harness's tokenization of a (context,
continuation) pair; `loglikelihoods` scores them; `score_docs` turns them into acc / acc_norm.
`eval.tools.lm_harness_check` runs both on synthetic documents and compares item by item.
"""
import json
import os
import sys
import time

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

from common.backbone import resolve
from common.checkpoint import CheckpointError, checked_weights
from common.cli import (add_device_args, add_threads, check_out_file, entry_parser, load_kwargs, number, run_cli,
                        set_threads)
from common.data import atomic_write_text
# deferred: lm_eval (optional, not in requirements.txt: the LM Evaluation Harness, in its own venv)

LM_EVAL_VERSION = "0.4.13"
TEXT3 = ("arc_easy", "piqa", "winogrande")
METRICS = {"arc_easy": ("acc", "acc_norm"), "piqa": ("acc", "acc_norm"), "winogrande": ("acc",)}
PAPER_METRIC = "acc"          # Table 5: "Accuracy x 100" for all three
DEFAULT_LIMIT = 1000          # Table 5: n = 1,000 per task
VENV_HINT = ("python -m eval.tools.lm_harness_check (builds out/venv-lmeval with lm-eval[hf]==0.4.13 beside our "
             "pins; then run out/venv-lmeval/bin/python -m eval.lm_harness ...), or pip install 'lm-eval[hf]==0.4.13' "
             "in a venv of its own")


class HarnessError(ValueError):
    """A Text3 run cannot start or go on; the message says what to do."""


# ----------------------------------------------------------------------------- the tasks, mirrored (no lm-eval)

def requests(task, doc):
    """The harness's multiple-choice requests of one document, as 0.4.13's task YAMLs build them:
    (contexts, continuations, gold, choices), one (context, continuation) pair per choice, the
    continuation = target_delimiter " " + the choice text.

      arc_easy    context "Question: {question}\\nAnswer:", choices = choices.text,
                  gold = choices.label.index(answerKey)  (labels A-E or 1-5)
      piqa        context "Question: {goal}\\nAnswer:", choices = [sol1, sol2], gold = label
      winogrande  partial evaluation (Sakaguchi et al., arXiv 1907.10641; the harness's
                  preprocess_winogrande): the choices are the *contexts*, sentence up to "_"
                  with each option filled in; the one continuation is " " + the rest of the
                  sentence after "_" (stripped), so only the words after the blank are scored;
                  gold = {"1": 0, "2": 1}[answer]

    `choices` are the strings whose length normalises acc_norm (the harness's
    completion_len: len(choice) in characters). Raises HarnessError for a document missing
    its task's fields or whose gold is not among its choices."""
    try:
        if task == "arc_easy":
            texts, labels = list(doc["choices"]["text"]), list(doc["choices"]["label"])
            ctx = f"Question: {doc['question']}\nAnswer:"
            return [ctx] * len(texts), [" " + t for t in texts], labels.index(doc["answerKey"]), texts
        if task == "piqa":
            texts = [doc["sol1"], doc["sol2"]]
            ctx = f"Question: {doc['goal']}\nAnswer:"
            return [ctx] * 2, [" " + t for t in texts], int(doc["label"]), texts
        if task == "winogrande":
            i = doc["sentence"].index("_")
            ctxs = [doc["sentence"][:i] + o for o in (doc["option1"], doc["option2"])]
            cont = " " + doc["sentence"][i + 1:].strip()
            return ctxs, [cont, cont], {"1": 0, "2": 1}[str(doc["answer"])], ctxs
    except (KeyError, TypeError, ValueError) as e:
        raise HarnessError(f"{task} document {str(doc)[:120]}: {type(e).__name__} {e}: not in the task's schema") from None
    raise HarnessError(f"unknown task {task!r}; Text3 is {', '.join(TEXT3)}")


def encode_pair(tok, context, continuation):
    """(context ids, continuation ids) as lm-eval 0.4.13's HFLM tokenizes a loglikelihood
    request (`_encode_pair`, `tok_encode`, `loglikelihood`):
      - trailing spaces of the context move to the continuation;
      - continuation ids = tokenize(context + continuation)[len(tokenize(context)):], so a
        token that merges across the boundary is scored with the continuation;
      - tokenize = the tokenizer's own `encode` with its default special tokens (a Llama-style
        BOS is added, Qwen's tokenizers add none), except for a string that already starts
        with the prefix token's text;
      - an empty context becomes [prefix token] (BOS, else EOS) before the continuation
        encoded without special tokens (if the continuation already starts with that token,
        its first token is the context).
    Returns two lists of ints."""
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    bos_text = tok.decode(prefix) if prefix is not None else None

    def enc(s, **kw):
        if not kw and bos_text and s.startswith(bos_text):
            kw = {"add_special_tokens": False}
        return tok.encode(s, **kw)

    if context == "":
        cont = enc(continuation, add_special_tokens=False)
        return ([prefix], cont) if not cont or prefix != cont[0] else (cont[:1], cont[1:])
    n = len(context) - len(context.rstrip())
    if n:
        continuation, context = context[-n:] + continuation, context[:-n]
    whole, ctx = enc(context + continuation), enc(context)
    return ctx, whole[len(ctx):]


def loglikelihoods(model, tok, pairs, batch_size=16, max_length=None, desc="loglik"):
    """Summed log-probability of each continuation after its context, teacher-forced:

        ll = sum_t log softmax(logits[t-1])[ids[t]]   over the continuation positions t
        greedy = every continuation token is the argmax at its position

    pairs: [(context, continuation)], tokenized by `encode_pair`; the input is (context +
    continuation) without its last token, cut to the last `max_length` tokens (default the
    model's max_position_embeddings) as the harness cuts it. Right padding with an attention
    mask, one forward per batch, fp32 log-softmax; text only (a VLM is called without pixels).
    Returns [(ll, greedy)] in order. Raises HarnessError for an empty continuation."""
    cfg = getattr(model.config, "text_config", None) or model.config
    max_length = max_length or getattr(cfg, "max_position_embeddings", None) or 2048
    enc = []
    for ctx, cont in pairs:
        c, o = encode_pair(tok, ctx, cont)
        if not o:
            raise HarnessError(f"empty continuation {cont!r} after context {ctx[:60]!r}")
        enc.append(((c + o)[-(max_length + 1):][:-1], o))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    dev = next(model.parameters()).device
    out = []
    for s in tqdm(range(0, len(enc), batch_size), desc=desc, unit="batch", leave=False):
        chunk = enc[s:s + batch_size]
        T = max(len(x) for x, _ in chunk)
        ids = torch.tensor([x + [pad] * (T - len(x)) for x, _ in chunk], device=dev)
        mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x, _ in chunk], device=dev)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)  # [B, T, V]
        for row, (x, o) in enumerate(chunk):
            lp = logp[row, len(x) - len(o):len(x)]             # positions predicting the continuation tokens
            tgt = torch.tensor(o, device=lp.device)
            out.append((float(lp.gather(-1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all())))
    return out


def pick(lls, choices, gold):
    """{"acc", "acc_norm", "pred", "pred_norm"} of one document, as the harness's
    multiple_choice process_results: pred = argmax lls (first on ties), pred_norm = argmax
    lls / len(choice) (characters); acc = pred == gold."""
    pred = max(range(len(lls)), key=lambda i: lls[i])
    norm = [ll / max(len(c), 1) for ll, c in zip(lls, choices)]
    pred_norm = max(range(len(lls)), key=lambda i: norm[i])
    return {"acc": float(pred == gold), "acc_norm": float(pred_norm == gold), "pred": pred, "pred_norm": pred_norm}


def score_docs(model, tok, task, docs, batch_size=16):
    """Our score of `docs` of `task`: per document {"doc", "lls", "greedy", "gold", "pred",
    "acc", "acc_norm"}, and the task's metrics {metric: mean} (`METRICS[task]`)."""
    reqs = [requests(task, d) for d in docs]
    pairs = [(c, o) for ctxs, conts, _, _ in reqs for c, o in zip(ctxs, conts)]
    res = iter(loglikelihoods(model, tok, pairs, batch_size, desc=task))
    rows = []
    for i, (ctxs, _, gold, choices) in enumerate(reqs):
        got = [next(res) for _ in ctxs]
        lls = [ll for ll, _ in got]
        rows.append({"doc": i, "lls": lls, "greedy": [g for _, g in got], "gold": gold, **pick(lls, choices, gold)})
    metrics = {m: sum(r[m] for r in rows) / len(rows) for m in METRICS[task]} if rows else {}
    return rows, metrics


# ----------------------------------------------------------------------------- local copies of the tasks

def synthetic_docs(n=12):
    """{task: [doc]}: n short documents per task in each dataset's schema (ARC: choices
    {text, label} with letter and digit labels, 3-5 choices; PIQA: goal, sol1, sol2, label;
    Winogrande: sentence with one "_", option1, option2, answer "1"/"2"). Deterministic; for
    checking that two scorers agree, not for measuring a model."""
    words = ["red", "blue", "green", "circle", "square", "triangle", "left", "right", "top", "bottom"]
    docs = {"arc_easy": [], "piqa": [], "winogrande": []}
    for i in range(n):
        w = [words[(i * 3 + k) % len(words)] for k in range(5)]
        k = 3 + i % 3
        labels = list("ABCDE"[:k]) if i % 4 else [str(j + 1) for j in range(k)]
        docs["arc_easy"].append({"id": f"arc-{i}", "question": f"Which shape is {w[0]} and on the {w[1]}?",
                                 "choices": {"text": [f"the {w[(j + 2) % 5]} one" for j in range(k)], "label": labels},
                                 "answerKey": labels[i % k]})
        docs["piqa"].append({"goal": f"To move the {w[2]} {w[3]} to the {w[4]},", "sol1": f"push it {w[0]}.",
                             "sol2": f"lift the {w[1]} {w[2]} over it  .", "label": i % 2})
        docs["winogrande"].append({"sentence": f"The {w[0]} {w[3]} is left of the {w[1]} {w[4]} because _ is "
                                               f"{'bigger' if i % 2 else 'on the ' + w[2]} side.",
                                   "option1": f"the {w[0]} {w[3]}", "option2": f"the {w[1]} {w[4]}",
                                   "answer": str(1 + i % 2)})
    return docs


def local_task_yaml(harness_yaml, name, data_file):
    """The text of a copy of one of the harness's task YAMLs that reads `data_file` (JSONL)
    instead of the hub: `task:` renamed to `name`, `dataset_path: json` with the file as its
    only split "test", the original dataset / split / few-shot lines dropped; every other
    line (doc_to_text, doc_to_choice, doc_to_target, metric_list, !function references) kept
    as written. Only top-level keys are rewritten (lines without indentation)."""
    drop = ("task:", "dataset_path:", "dataset_name:", "dataset_kwargs:", "training_split:", "validation_split:",
            "test_split:", "fewshot_split:", "fewshot_config:", "tag:", "group:")
    out, skip = [], False
    for line in harness_yaml.splitlines():
        top = line[:1] not in (" ", "\t", "-", "")
        if top:
            skip = line.startswith(drop)
        if not skip:
            out.append(line)
    head = [f"task: {json.dumps(name)}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
            f"    test: {json.dumps(os.path.abspath(data_file))}", "test_split: test"]
    return "\n".join(head + out) + "\n"


# ----------------------------------------------------------------------------- loading a checkpoint

def load_lm(path, dtype=None, device="cpu", trust_remote_code=False, device_map=None):
    """(model in eval mode, tokenizer) of a local checkpoint for text scoring:
    `AutoModelForCausalLM` when transformers maps the config to one, else
    `AutoModelForImageTextToText` (Qwen-VL families: called on text alone). path: a
    save_pretrained directory or tiny-moe / tiny-dense / tiny-chat. Safetensors only.
    Raises HarnessError for a missing directory / config.json, pickle-only or truncated
    weights, and a family with neither class."""
    path = resolve(path)
    if not os.path.isdir(path):
        raise HarnessError(f"{path}: no such checkpoint directory (a save_pretrained folder, or tiny-moe)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise HarnessError(f"{path}: no config.json (point --model at the folder that holds config.json and "
                           f"*.safetensors)")
    try:
        checked_weights(path)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except CheckpointError as e:
        raise HarnessError(str(e)) from None
    except (OSError, ValueError) as e:
        raise HarnessError(f"{path}: cannot read its config.json ({str(e).splitlines()[0]}); checkpoints with their "
                           f"own code need --trust-remote-code (it runs that code)") from None
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or trust_remote_code:
        cls = AutoModelForCausalLM
    elif config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        cls = AutoModelForImageTextToText
    else:
        raise HarnessError(f"{path}: model_type {config.model_type!r} has neither a causal-LM nor an "
                           f"image-text-to-text class in transformers")
    model = cls.from_pretrained(path, dtype=dtype, device_map=device_map, trust_remote_code=trust_remote_code,
                                use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return (model if device_map is not None else model.to(device)).eval(), tok


# ----------------------------------------------------------------------------- the harness side (imports lm-eval)

def import_lm_eval():
    """The lm_eval module, or HarnessError naming the venv command when it is missing."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401
    except ImportError as e:
        raise HarnessError(f"eval.lm_harness needs lm-eval {LM_EVAL_VERSION} ({e}); it is not one of our "
                           f"requirements: {VENV_HINT}") from None
    return lm_eval


def harness_lm(model, tok, batch_size=16, device="cpu"):
    """The harness's HFLM around an already loaded model and tokenizer (backend "causal": the
    harness then scores it exactly as a checkpoint it loaded itself)."""
    import_lm_eval()
    from lm_eval.models.huggingface import HFLM
    return HFLM(pretrained=model, tokenizer=tok, backend="causal", batch_size=batch_size, device=device)


def run_harness(lm, tasks, limit=None, include_path=None, log_samples=True, cache=None):
    """lm_eval.simple_evaluate on `tasks` (names; `include_path` a folder of extra task YAMLs),
    zero-shot as the tasks define, the first `limit` documents of each; `cache` (a path
    prefix) keeps every answered request in the harness's sqlite cache (`use_cache`), so an
    interrupted task redoes only the requests it had not answered. Returns
    ({task: {metric: value, metric_stderr: value, "n": documents}}, {task: samples}), the
    samples as the harness logs them (doc_id, doc, resps, acc, ...)."""
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager
    tm = TaskManager(include_path=include_path) if include_path else TaskManager()
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=tm,
                                  log_samples=log_samples, bootstrap_iters=1000, use_cache=cache)
    metrics = {}
    for task, m in out["results"].items():
        vals = {k.split(",")[0]: v for k, v in m.items() if "," in k and isinstance(v, (int, float))}
        vals["n"] = int(out.get("n-samples", {}).get(task, {}).get("effective", len(out.get("samples", {}).get(task, []))))
        metrics[task] = vals
    return metrics, out.get("samples", {})


def harness_lls(samples):
    """{doc_id: [ll per choice]} of one task's logged samples (`resps`: per request a list
    holding one (ll, greedy) pair)."""
    return {int(s["doc_id"]): [float(r[0][0]) for r in s["resps"]] for s in samples}


def harness_args(sample):
    """The (context, continuation) pairs of one logged sample, in choice order."""
    return [tuple(a) for a in sample["arguments"]]


def compare(ours_rows, ours_metrics, theirs_lls, theirs_metrics, tol=1e-4):
    """One agreement row between our score and the harness's on the same documents:
    {"n", "max_abs_ll_diff" (over every choice of every document), "preds_differ" (documents
    whose argmax choice differs), metric_ours / metric_harness for each of our metrics,
    "equal": every ll within `tol` (absolute, nats), no prediction differs, the same
    documents, every metric equal}."""
    diffs, differ = [], 0
    for r in ours_rows:
        h = theirs_lls.get(r["doc"])
        if h is None or len(h) != len(r["lls"]):
            differ += 1
            diffs.append(float("inf"))
            continue
        diffs += [abs(a - b) for a, b in zip(r["lls"], h)]
        differ += max(range(len(h)), key=lambda i: h[i]) != r["pred"]
    row = {"n": len(ours_rows), "n_harness": len(theirs_lls), "max_abs_ll_diff": max(diffs) if diffs else None,
           "preds_differ": differ, "tol": tol}
    same = len(ours_rows) == len(theirs_lls) and differ == 0 and bool(diffs) and max(diffs) <= tol
    for m, v in ours_metrics.items():
        row[f"{m}_ours"], row[f"{m}_harness"] = v, theirs_metrics.get(m)
        same &= theirs_metrics.get(m) is not None and abs(v - theirs_metrics[m]) < 1e-9
    row["equal"] = bool(same)
    return row


# ----------------------------------------------------------------------------- the result file

def result_rows(model_name, task, metrics):
    """Report rows of one task: one per metric the task reports, {"model", "task", "metric",
    "value" (fraction), "score" (x 100, the paper's scale), "stderr", "n", "paper"}."""
    names = METRICS.get(task) or [m for m in ("acc", "acc_norm") if m in metrics]  # a task of --include-path
    return [{"model": model_name, "task": task, "metric": m, "value": metrics[m], "score": 100 * metrics[m],
             "stderr": metrics.get(f"{m}_stderr"), "n": metrics.get("n"), "paper": m == PAPER_METRIC}
            for m in names if m in metrics]


def text3_row(rows):
    """The Text3 row: mean `acc` over the three tasks (x 100 in "score"), or None until all
    three are in `rows`."""
    acc = {r["task"]: r["value"] for r in rows if r["metric"] == PAPER_METRIC and r["task"] in TEXT3}
    if set(acc) != set(TEXT3):
        return None
    v = sum(acc.values()) / 3
    return {"model": rows[0]["model"], "task": "text3", "metric": PAPER_METRIC, "value": v, "score": 100 * v,
            "stderr": None, "n": sum(r["n"] or 0 for r in rows if r["metric"] == PAPER_METRIC and r["task"] in TEXT3),
            "paper": True}


def load_result(path, settings, overwrite=False):
    """The rows and samples already in the result file `path` for these settings (a resumed
    run), or empty ones for a new file. Raises HarnessError when `path` holds a run with
    other settings (named) and `overwrite` is off, or is not a result file of this script."""
    if not os.path.exists(path) or overwrite:
        return [], {}
    try:
        with open(path) as f:
            old = json.load(f)
        saved = old["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        raise HarnessError(f"--out {path} exists and is not a result file of eval.lm_harness; pass --overwrite to "
                           f"replace it, or another --out") from None
    diff = [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in settings.items() if k != "tasks" and saved.get(k) != v]
    if diff:
        raise HarnessError(f"--out {path} holds a run with other settings ({'; '.join(diff)}); pass --overwrite to "
                           f"start over, or another --out")
    return [r for r in old["rows"] if r["task"] != "text3"], old.get("samples", {})


def write_result(path, settings, rows, samples, source):
    """Write the result file atomically (`common.data.atomic_write_text`), Text3 row last."""
    t3 = text3_row(rows)
    atomic_write_text(path, json.dumps({"experiment": "text3", "source": source, "settings": settings,
                                        "rows": rows + ([t3] if t3 else []), "samples": samples}, indent=1))


def main(argv=None):
    p = entry_parser(__spec__.name if __spec__ else "eval.lm_harness", __doc__)
    p.add_argument("--model", required=True, help="checkpoint directory (full or merged) or tiny-moe / tiny-dense")
    p.add_argument("--tasks", default=",".join(TEXT3), help="comma-separated harness tasks (Text3's three)")
    p.add_argument("--limit", type=number(min=0), default=DEFAULT_LIMIT,
                   help="first N documents of each task (0 = all; the paper: 1000)")
    p.add_argument("--batch-size", type=number(min=1), default=16, help="requests per forward")
    add_device_args(p, device_map=True)
    p.add_argument("--include-path", default=None, help="a folder of extra task YAMLs for the harness")
    p.add_argument("--out", default=None, help="result JSON (default out/lm_harness/<model>_text3.json)")
    p.add_argument("--overwrite", action="store_true", help="start over when --out holds a run")
    p.add_argument("--trust-remote-code", action="store_true", help="allow checkpoint-shipped code (runs it)")
    add_threads(p)
    a = p.parse_args(argv)
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in METRICS] if not a.include_path else []
    if bad:
        p.error(f"--tasks {','.join(bad)}: not a Text3 task ({', '.join(TEXT3)}); other tasks need --include-path")
    name = os.path.basename(os.path.normpath(a.model))
    out = a.out or os.path.join("out", "lm_harness", f"{name}_text3.json")
    check_out_file(out)
    lm_eval = import_lm_eval()  # before the model loads
    if lm_eval.__version__ != LM_EVAL_VERSION:
        print(f"note: lm-eval {lm_eval.__version__} is installed; the task definitions this was checked against are "
              f"{LM_EVAL_VERSION}'s (the result file records the version used)", file=sys.stderr)
    device = a.device
    set_threads(a.threads, a.model)
    settings = {"model": a.model, "limit": a.limit or None, "dtype": a.dtype, "lm_eval": lm_eval.__version__,
                "num_fewshot": 0, "tasks": tasks}
    rows, samples = load_result(out, settings, a.overwrite)
    cache = out + ".cache"  # the harness's request cache (sqlite, <out>.cache_rank0.db): resumes inside a task
    if a.overwrite:
        for f in (cache + "_rank0.db",):
            if os.path.exists(f):
                os.remove(f)
    todo = [t for t in tasks if t not in {r["task"] for r in rows}]
    if not todo:
        print(f"{out} already holds {', '.join(tasks)}; nothing to do (--overwrite starts over)")
        return rows
    model, tok = load_lm(a.model, **load_kwargs(a), trust_remote_code=a.trust_remote_code)
    lm = harness_lm(model, tok, a.batch_size, device)
    source = "python -m eval.lm_harness " + " ".join(sys.argv[1:] if argv is None else argv)
    for task in todo:
        t0 = time.time()
        metrics, logged = run_harness(lm, [task], a.limit or None, a.include_path, cache=cache)
        m = metrics[task]
        rows += result_rows(name, task, m)
        samples[task] = [{"doc": int(s["doc_id"]), "lls": [float(x[0][0]) for x in s["resps"]],
                          "acc": s.get("acc")} for s in logged.get(task, [])]
        write_result(out, settings, rows, samples, source)
        print(f"{task}: " + ", ".join(f"{k} {m[k]:.4f}" for k in ("acc", "acc_norm") if k in m)
              + f" (n={m['n']}, {time.time() - t0:.0f} s) -> {out}")
    t3 = text3_row(rows)
    if t3:
        print(f"Text3 (mean acc x 100): {t3['score']:.2f}")
    return rows


if __name__ == "__main__":
    run_cli(main)  # HarnessError, missing lm-eval, bad --out: `error: ...`, exit status 2
