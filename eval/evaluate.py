"""Evaluate a VLM on a benchmark file: batched greedy generation, per-family accuracy with
bootstrap CIs next to the best-constant-answer baseline, and multiple choice also scored by
option log-likelihood.

    python -m eval.evaluate --model tiny-dense --data out/data/val.json
    python -m eval.evaluate --model /path/to/Qwen2.5-VL-3B-Instruct --data bench.jsonl --limit 200

prints a table (model vs the best constant answer per family, fitted on the training split
next to the data file or on --reference, value [95% CI]) and writes out/eval/<model>_<data>.json:
{"model", "data", "rows": [report rows], "pope": {...}, "anls": {...}, "benchmarks": {...},
"results": [...], "loglik": [...], "wall_s"}. Records converted by `eval.convert` (a
"benchmark" field) are also scored the way their benchmark defines it (`eval.scores`: MME
perception / cognition, POPE per split, MMMU, ANLS, relaxed accuracy, ...), under "benchmarks". Report rows are {"model","family","metric","value","ci_low",
"ci_high","n"}, one per family plus "all", the format the quickstart report uses.

Multiple-choice log-likelihood (lm-eval-harness style, as for ARC / MMLU): for each option
the summed log-probability of its continuation given the context is computed in one
teacher-forced forward, and the argmax option is the prediction. Our models answer with the
option *letter* ("... Answer: B"), so the continuation is " B" (MMLU-style), not the option
text (ARC-style, for models that answer in words). The context is the prompt plus the
model's own greedy output up to its last "Answer:" (the shapes models first describe the
scene, then answer; scoring the letter right after the prompt would skip that look step
and be off-distribution). When the output has no "Answer:", the letter is scored at the
start of the assistant turn, as for an instruct model that replies with just the letter.
Single-letter continuations make length normalisation (acc_norm) moot.

Prompt settings (`--prompt-settings`): `lmms-eval` (default) applies lmms-eval 0.7.3's own
settings for the families it ships a model class for (`LMMS_EVAL`, `apply_prompt_settings`: a
system turn, image size bounds, JPEG re-encoding of each image, the stop id); `checkpoint` keeps
the checkpoint's own (its chat template, image processor and generation_config as saved). Either
way generation is greedy, as in lmms-eval's classes (temperature 0, one beam).
"""
import argparse
import difflib
import json
import os
import re
import time
from collections import Counter

import torch

from common.answers import (ANSWER_TYPE, UNLABELLED, is_multiple_choice,  # noqa: F401  (eval.evaluate.options_of)
                            options_of, score)
from common.backbone import TEXT_LMS, checkpoint_model_type, generate, load_backbone
from common.cli import (RunError, add_device_args, add_limit, add_overwrite, add_threads, check_out_file,
                        check_overwrite, entry_parser, load_kwargs, run_cli, set_threads)
from common.data import (IMAGE_ROOT_HELP, SKIP_BAD_HELP, DataError, atomic_write_text, check_record_images,
                         check_support, expand_turns, load_image, read_any)
from common.predictions import PredictionLog, fingerprint, model_digest
from eval.metrics import (accuracy, anls, bootstrap_ci, by_family, extract, format_table, gold_list, is_correct,
                          option_letters, pope_prf, record_answer_type, short_answer)
from eval.readers import parse_options
from eval.scores import SCORERS, benchmark_scores, format_scores

# lmms-eval 0.7.3's settings per model_type, where they differ from the checkpoint's own (file:line
# under lmms_eval/models/). `--model NAME` takes NAME's chat class where lmms-eval ships one
# (__init__.py:126-138 AVAILABLE_CHAT_TEMPLATE_MODELS: llava_hf, qwen2_5_vl, qwen3_vl; registry_v2.py:88-97
# takes chat_class_path first), else the simple class (qwen2_vl, gemma3). Keys (`apply_prompt_settings`):
#   system        a system turn written before the user turn (absent: only what the template adds)
#   images_kwargs image-processor settings on top of the saved ones (size bounds in pixels)
#   jpeg_quality  each image re-encoded as JPEG at this quality first (the simple classes send images
#                 as JPEG data URLs: _encode_image_data_url, quality=85)
#   pre_resize    (factor, min_pixels, max_pixels) of qwen_vl_utils' resize before the processor
#                 (process_vision_info -> fetch_image, vision_process.py:93-140; common.backbone.fit_to_grid)
#   stop          "tokenizer": generation stops at the tokenizer's eos id only (the class passes
#                 eos_token_id=tokenizer.eos_token_id to generate, which replaces generation_config's list)
#   patch_size    the vision patch the class assumes; a checkpoint with another keeps its own settings
# Every class decodes greedily (temperature 0, num_beams 1), as eval.evaluate does; the generation budget
# is the task's (ours: --max-new-tokens). The image goes before the question in the user turn everywhere.
LMMS_EVAL = {
    # simple/qwen2_vl.py:42-45 (max_pixels 602112, min_pixels 3136, system_prompt), :73 (processor bounds),
    # :252 (system turn), :290-296 (JPEG data URL, :173-180 quality 85), :414 (eos_token_id)
    "qwen2_vl": {"class": "qwen2_vl (simple)", "system": "You are a helpful assistant.", "jpeg_quality": 85,
                 "pre_resize": (28, 3136, 602112),
                 "images_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 602112}}, "stop": "tokenizer"},
    # chat/qwen2_5_vl.py:92 (the processor's template, no system turn of its own: Qwen2.5-VL's template adds
    # "You are a helpful assistant."), :93 (qwen_vl_utils resize, patch 14, its default bounds of 4 and 16384
    # tokens: vision_process.py:26-27,131-132), simple/qwen2_5_vl.py:44-45 + :91 (then the processor's
    # bounds 256*28*28..1605632), chat/qwen2_5_vl.py:142 (eos_token_id)
    "qwen2_5_vl": {"class": "qwen2_5_vl (chat)", "pre_resize": (28, 4 * 28 * 28, 16384 * 28 * 28),
                   "images_kwargs": {"size": {"shortest_edge": 256 * 28 * 28, "longest_edge": 1605632}},
                   "stop": "tokenizer"},
    # chat/qwen3_vl.py:50 (system turn, simple/qwen3_vl.py:91), :66-70 (qwen_vl_utils resize with
    # image_patch_size=16 and its default bounds of 4 and 16384 tokens), :86/:98 (then the processor with
    # do_resize=False: a patch other than 16 fails), simple/qwen3_vl.py:255 (eos_token_id)
    "qwen3_vl": {"class": "qwen3_vl (chat)", "system": "You are a helpful assistant.",
                 "pre_resize": (32, 4 * 32 * 32, 16384 * 32 * 32), "images_kwargs": {"do_resize": False},
                 "stop": "tokenizer", "patch_size": 16},
    # chat/llava_hf.py:62 (the processor's template, image then text), :97 (eos_token_id = tokenizer eos)
    "llava": {"class": "llava_hf (chat)", "stop": "tokenizer"},
    # simple/gemma3.py:50 + :243 (system turn), :261 (JPEG data URL, :185 quality 85); generate keeps
    # generation_config's stop ids (:320-329 passes no eos_token_id); the processor's own image size
    "gemma3": {"class": "gemma3 (simple)", "system": "You are a helpful assistant.", "jpeg_quality": 85},
}
LMMS_EVAL["qwen3_vl_moe"] = LMMS_EVAL["qwen3_vl"]  # the same class (simple/qwen3_vl.py:114: MoE picked by path)
LMMS_EVAL["llava_next"] = LMMS_EVAL["llava"]  # llava_hf serves both (simple/llava_hf.py:33-36)


def apply_prompt_settings(model, proc, which):
    """Set `proc` (a VLProcessor) to lmms-eval's settings for the model's family (`LMMS_EVAL`)
    when which == "lmms-eval", or back to the checkpoint's own when which == "checkpoint":
    proc.system (a system turn or None), proc.images_kwargs (image-processor settings),
    proc.jpeg_quality (JPEG re-encoding or None), proc.pre_resize (qwen_vl_utils' resize before
    the processor, or None) and proc.stop_ids (the tokenizer's eos id only,
    or generation_config's stop ids). A family lmms-eval does not ship, a text LM, or a
    checkpoint whose vision patch differs from the one the class assumes (`patch_size`: the
    tiny Qwen3-VL bases have 14, lmms-eval's qwen3_vl class needs 16) keeps its own.
    Returns the settings applied ({} for none)."""
    if not hasattr(proc, "checkpoint_stop_ids"):
        proc.checkpoint_stop_ids = list(proc.stop_ids)
    s = LMMS_EVAL.get(model.config.model_type, {}) if which == "lmms-eval" else {}
    if s and proc.image_processor is None:
        s = {}
    patch = getattr(getattr(model.config, "vision_config", None), "patch_size", None)
    if s.get("patch_size") not in (None, patch):
        print(f"note: lmms-eval's {s['class']} class assumes vision patch {s['patch_size']}, this checkpoint has "
              f"{patch}: its own prompt settings are kept")
        s = {}
    proc.system = s.get("system")
    proc.images_kwargs = dict(s.get("images_kwargs", {}))
    proc.jpeg_quality = s.get("jpeg_quality")
    proc.pre_resize = s.get("pre_resize")
    eos = proc.tokenizer.eos_token_id
    proc.stop_ids = [eos] if s.get("stop") == "tokenizer" and eos is not None else list(proc.checkpoint_stop_ids)
    return s


def _images(batch):
    """The image of each record, None for a text-only record (`check_support` refuses several)."""
    check_support(batch, "eval.evaluate", text_only=True, multi_turn=True)
    return [load_image(r["image"], r["id"]) if r["image"] else None for r in batch]


@torch.no_grad()
def evaluate(model, proc, records, batch_size=64, max_new_tokens=48, desc="eval", log=None):
    """Greedy generation on every record, scored with `is_correct` by family.

    records: dicts from `common.data.read_any` (after `expand_turns` for multi-turn records:
    a record's `history` goes into the prompt); text-only records (image None) are asked
    without an image. Returns one dict per record, in order: {id, family, pred (generated
    text), extracted (the answer read from it), answer (gold: a string or the list of
    acceptable answers), correct (bool), n_tokens (generated, incl. the end token)}.
    Multiple-choice records are read with their own option letters (`options_of`: A..E for
    five options). log: a `common.predictions.PredictionLog` that keeps each finished batch
    (phase "generate") and holds those of a resumed run. Raises DataError for an unreadable
    image or a record with several images."""
    was_training = model.training
    model.eval()

    def one(b):
        batch = records[b * batch_size:(b + 1) * batch_size]
        texts, lens = generate(model, proc, _images(batch), [r["question"] for r in batch], max_new_tokens,
                               history=[r.get("history", []) for r in batch])
        out = []
        for r, t, n in zip(batch, texts, lens):
            s = score(r, t)
            out.append({"id": r["id"], "family": r["family"], "pred": t, "answer_type": s["answer_type"],
                        "extracted": s["extracted"], "answer": r["answer"], "correct": s["correct"],
                        "n_tokens": n, **({"benchmark": r["benchmark"]} if r.get("benchmark") else {})})
        return out

    results = (log or PredictionLog(None, None)).run("generate", -(-len(records) // batch_size), one, desc)
    model.train(was_training)
    return results


# ----------------------------------------------------------------------------- multiple choice

def loglik_prefix(generated):
    """Assistant-turn context for option scoring: the generated text up to and including its
    last "Answer:", or "" when there is none (see module docstring)."""
    m = list(re.finditer(r"Answer:", generated))
    return generated[:m[-1].end()] if m else ""


@torch.no_grad()
def score_options(model, proc, records, prefixes=None, batch_size=32, desc="options", log=None):
    """Multiple choice by option log-likelihood.

    For record i with options [(L, text)] and assistant prefix p_i (prefixes[i], default ""),
    context = prompt(image, question) + p_i and each continuation c = " L" (or "L" when p_i
    is empty or ends in whitespace). Context and continuation are tokenised separately and
    concatenated (as lm-eval-harness does), one row per (record, option), right padded:
        score(L) = sum_t log softmax(logits[t-1])[ids[t]]   over the continuation positions t
    pred = argmax_L score(L) over every option the record has (A..E for five; `pick_option`).
    Returns per record {id, family, scores (list, option order), pred (letter), answer (gold
    letter, or the list of acceptable letters), correct}. log: a `PredictionLog` keeping
    each finished batch of option scores (phase "loglik"). Raises DataError for a record
    without options."""
    was_training = model.training
    model.eval()
    prefixes = prefixes if prefixes is not None else [""] * len(records)
    tok = lambda s: proc.text_ids(s) if s else []  # special-token strings escaped
    rows = []  # (record index, context ids, continuation ids), image pixels attached below
    for i, r in enumerate(records):
        opts = options_of(r)
        if not opts:
            raise DataError(f"record {r['id']}: no options to score (needs 'options' or lettered options "
                            f"'A. .. B. ..' in the question of a letter-type family)")
        sep = "" if not prefixes[i] or prefixes[i][-1].isspace() else " "
        for L, _ in opts:
            rows.append((i, tok(prefixes[i]), tok(sep + L)))
    dev = model.device

    def one(b):
        chunk = rows[b * batch_size:(b + 1) * batch_size]
        shown = [i for i, _, _ in chunk if records[i]["image"]]  # text-only rows: no pixels
        uniq = list(dict.fromkeys(shown))
        decoded = dict(zip(uniq, _images([records[i] for i in uniq])))
        # one image per row that has one, in row order (a record's image repeats for each option)
        vis, counts = proc.vision([decoded[i] for i in shown]) if shown else ({}, [])
        counts = iter(counts)
        n_img = [next(counts) if records[i]["image"] else 0 for i, _, _ in chunk]
        ids = [proc.prompt_ids(records[i]["question"], n_img[r], records[i].get("history", [])) + c + o
               for r, (i, c, o) in enumerate(chunk)]
        batch = proc.pad(ids, "right", vis)
        out = model(**{k: v.to(dev) for k, v in batch.items()})
        input_ids = batch["input_ids"]
        logp = torch.log_softmax(out.logits.float(), dim=-1)  # [R, T, V]
        got = []
        for row, (i, _, o) in enumerate(chunk):
            end = len(ids[row])
            pos = torch.arange(end - len(o), end, device=logp.device)  # continuation positions t
            tgt = input_ids[row, end - len(o):end].to(logp.device)
            got.append(float(logp[row, pos - 1, tgt].sum()))  # token t predicted at t-1
        return got

    flat = (log or PredictionLog(None, None)).run("loglik", -(-len(rows) // batch_size), one, desc)
    scores = [[] for _ in records]
    for (i, _, _), v in zip(rows, flat):
        scores[i].append(v)
    model.train(was_training)
    results = []
    for r, sc in zip(records, scores):
        pred, golds = pick_option(options_of(r), sc, r["answer"])
        results.append({"id": r["id"], "family": r["family"], "scores": sc, "pred": pred,
                        "answer": golds[0] if len(golds) == 1 else golds, "correct": pred in golds})
    return results


def pick_option(options, scores, gold):
    """(predicted letter, gold letters) of one multiple-choice record: the letter of the
    highest score (first on ties) among all of `options` ([(letter, text)]), and each gold
    (`gold_list`) read as a letter of those options (`eval.metrics.extract`)."""
    letters = "".join(L for L, _ in options)
    pred = letters[max(range(len(scores)), key=scores.__getitem__)]
    golds = list(dict.fromkeys(extract(g, "letter", letters, options) for g in gold_list(gold)))
    return pred, golds


# ----------------------------------------------------------------------------- report rows

def family_rows(model_name, results, metric="accuracy", n_resamples=10_000, seed=0):
    """Report rows {"model","family","metric","value","ci_low","ci_high","n"}: accuracy of
    results[*]["correct"] per family (first-seen order) and "all", with the 95% percentile
    bootstrap CI (`eval.metrics.bootstrap_ci`, 10,000 resamples, seeded)."""
    rows = []
    for fam, correct in by_family(results).items():
        lo, hi = bootstrap_ci(correct, n_resamples, seed)
        rows.append({"model": model_name, "family": fam, "metric": metric, "value": accuracy(correct),
                     "ci_low": lo, "ci_high": hi, "n": len(correct)})
    return rows


def _gold_set(r):
    """The extracted acceptable answers of a record (a set: one per gold in its list)."""
    t = record_answer_type(r)
    golds = gold_list(r["answer"])
    letters = option_letters(r.get("options"), golds) if t == "letter" else None
    return {extract(g, t, letters, r.get("options")) for g in golds}


def majority_answers(records):
    """{family: (constant answer, [correct per record])}: for each family the constant answer
    (gold answers normalised with the family's answer type) that maximises accuracy on these
    records, i.e. the answer acceptable for the most records (the most frequent gold when each
    record has one); ties go to the alphabetically first."""
    golds = {}
    for r in records:
        golds.setdefault(r["family"], []).append(_gold_set(r))
    out = {}
    for fam, g in golds.items():
        counts = Counter(x for s in g for x in s)
        best = max(sorted(counts), key=counts.__getitem__)
        out[fam] = (best, [best in s for s in g])
    return out


def majority_rows(records, reference, model="best constant (train)", n_resamples=10_000, seed=0):
    """Best-constant-answer baseline as report rows named `model`: per family, the constant
    that is most frequent among the *reference* records' gold answers (a training or other
    held-out split; never the evaluated records, where it would be fitted on the answers it is
    scored against: on one question it would score 1.0), scored on `records`; "all" =
    every family answered with its own constant. A family absent from the reference has no
    constant and scores 0. records, reference: lists of {family, answer}."""
    best = majority_answers(reference)
    results = [{"family": r["family"],
                "correct": r["family"] in best and best[r["family"]][0] in _gold_set(r)} for r in records]
    return family_rows(model, results, n_resamples=n_resamples, seed=seed)


def reference_split(data_path):
    """The training split next to a benchmark file, used to fit the best-constant baseline:
    `train.json` / `train.jsonl` in the same folder, if it exists and is not the file itself;
    else None."""
    folder = os.path.dirname(os.path.abspath(data_path))
    for name in ("train.json", "train.jsonl"):
        p = os.path.join(folder, name)
        if os.path.exists(p) and os.path.realpath(p) != os.path.realpath(data_path):
            return p
    return None


def extra_metrics(results):
    """POPE precision/recall/F1/yes-ratio for yes/no families (gold: the first acceptable
    answer) and ANLS for word/text families (best over the acceptable answers)
    -> ({family: pope dict}, {family: anls}). Results of benchmark records (a "benchmark"
    field) are left to `eval.scores.benchmark_scores`."""
    pope, soft = {}, {}
    results = [r for r in results if not r.get("benchmark")]  # scored by eval.scores, the benchmark's own way
    for fam in dict.fromkeys(r["family"] for r in results):
        rs = [r for r in results if r["family"] == fam]
        t = record_answer_type(rs[0])
        if t == "yesno":
            pope[fam] = pope_prf([r["extracted"] for r in rs], [extract(gold_list(r["answer"])[0], t) for r in rs])
        elif t in ("word", "text"):
            soft[fam] = anls([short_answer(r["pred"]) for r in rs], [gold_list(r["answer"]) for r in rs])
    return pope, soft


def main(argv=None):
    p = entry_parser(__spec__.name, "Evaluate a VLM on a benchmark file (LLaVA JSON or canonical "
                                    "JSONL): per-family accuracy vs the best constant answer.")
    p.add_argument("--model", required=True,
                   help="checkpoint directory (save_pretrained format) or tiny-dense / tiny-chat / tiny-moe")
    p.add_argument("--data", required=True, help="benchmark file: LLaVA JSON/JSONL or canonical JSONL")
    p.add_argument("--image-root", default=None, help=IMAGE_ROOT_HELP)
    add_limit(p)
    p.add_argument("--batch-size", type=int, default=64, help="records per generation batch")
    p.add_argument("--max-new-tokens", type=int, default=48,
                   help="generation budget (the shapes models need ~40 tokens: scene, then answer)")
    p.add_argument("--loglik", action=argparse.BooleanOptionalAction, default=True,
                   help="also score multiple-choice records by option log-likelihood")
    add_device_args(p, device_map=True)
    p.add_argument("--prompt-settings", default="lmms-eval", choices=["lmms-eval", "checkpoint"],
                   help="lmms-eval: lmms-eval 0.7.3's system turn, image size, JPEG re-encoding and stop id for the "
                        "families it ships (eval/README.md); checkpoint: the checkpoint's own chat template, image "
                        "processor and generation_config as saved")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow checkpoint-shipped code (off by default: it executes code from the checkpoint)")
    p.add_argument("--out", default=None, help="output JSON (default out/eval/<model>_<data>.json)")
    p.add_argument("--reference", default=None,
                   help="split the best-constant baseline is fitted on (default: train.json / train.jsonl next to "
                        "--data, if there is one; else the baseline row is left out)")
    p.add_argument("--skip-bad", action="store_true", help=SKIP_BAD_HELP)
    p.add_argument("--resume", action="store_true",
                   help="continue a stopped run from its last finished batch (OUT.partial; the same flags, model "
                        "and data)")
    add_overwrite(p)
    add_threads(p)
    a = p.parse_args(argv)
    set_threads(a.threads, a.model)
    for flag in ("batch_size", "max_new_tokens"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(a, flag)}")
    out = a.out or os.path.join("out", "eval", f"{os.path.basename(os.path.normpath(a.model))}_"
                                              f"{os.path.splitext(os.path.basename(a.data))[0]}.json")
    if os.path.realpath(out) == os.path.realpath(a.data):
        p.error(f"--out {out} is the data file; results would overwrite it")
    try:  # now, not after the whole evaluation
        check_out_file(out)
        check_overwrite(out, a.overwrite, a.resume)
    except RunError as e:
        p.error(str(e))

    t0 = time.time()
    if a.limit and not a.skip_bad:   # only the first N items are evaluated: only their images are decoded now
        records = expand_turns(read_any(a.data, image_root=a.image_root, check_images=False))[:a.limit]
        records = check_record_images(records, a.data)
    else:          # --skip-bad: the first N usable items (every image decoded)
        records = expand_turns(read_any(a.data, image_root=a.image_root, skip_bad=a.skip_bad, limit=a.limit))[:a.limit or None]
    check_support(records, "eval.evaluate", text_only=True, multi_turn=True)  # before the model loads
    shown = sum(bool(r["image"]) for r in records)
    if shown and checkpoint_model_type(a.model) in TEXT_LMS:
        raise DataError(f"{a.model} is a text model ({checkpoint_model_type(a.model)}); {shown} record(s) of {a.data} "
                        f"have an image: evaluate text-only records, or a VLM")
    bad = sorted({r["benchmark"] for r in records if r.get("benchmark")} - set(SCORERS))
    if bad:  # before the model loads, not after the whole evaluation
        raise DataError(f"{a.data}: unknown benchmark(s) {bad}; eval.scores scores {', '.join(SCORERS)}")
    unknown = sorted({r["family"] for r in records if record_answer_type(r) == "text" and not r.get("answer_type")}
                     - set(ANSWER_TYPE) - {UNLABELLED})  # records with options are multiple choice (record_answer_type)
    for fam in unknown:  # a typo ("Count", "colours") silently switches scoring to exact text match
        near = difflib.get_close_matches(fam.lower(), list(ANSWER_TYPE), n=1, cutoff=0.6)
        print(f"note: family {fam!r} is not one of {', '.join(ANSWER_TYPE)}: its answers are scored as free "
              f"text (normalised exact match)" + (f"; did you mean {near[0]!r}?" if near else ""))
    name = os.path.basename(os.path.normpath(a.model))
    fp = fingerprint(records, model=model_digest(a.model), batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                     prompt_settings=a.prompt_settings,
                     loglik=a.loglik, dtype=a.dtype, device=a.device)
    with PredictionLog(out, fp, a.resume) as log:  # each finished batch kept in OUT.partial; refusals before loading
        rows, loglik, results, extra = _run(a, records, name, log)
        atomic_write_text(out, json.dumps({"model": a.model, "data": a.data, "rows": rows, **extra,
                                           "wall_s": time.time() - t0, "results": results, "loglik": loglik}, indent=1))
        log.finish()
    print(f"wrote {out}")
    return rows


def _run(a, records, name, log):
    """The model part of `main`: (report rows, loglik results, results, {pope, anls, benchmarks})."""
    t0 = time.time()
    model, proc = load_backbone(a.model, **load_kwargs(a), trust_remote_code=a.trust_remote_code, text_lms=True)
    settings = apply_prompt_settings(model, proc, a.prompt_settings)
    results = evaluate(model, proc, records, a.batch_size, a.max_new_tokens, desc=f"eval {name}", log=log)
    rows = family_rows(name, results)
    ref = a.reference or reference_split(a.data)
    if ref:
        rows += majority_rows(records, read_any(ref, check_images=False), model=f"best constant ({os.path.basename(ref)})")
    else:
        print("note: no reference split (train.json next to --data, or --reference): the best-constant row is left out")
    loglik = []
    if a.loglik:
        mc = [(r, res) for r, res in zip(records, results) if is_multiple_choice(r)]  # as generation scores them
        if mc:
            loglik = score_options(model, proc, [r for r, _ in mc], [loglik_prefix(res["pred"]) for _, res in mc],
                                   batch_size=a.batch_size, log=log)
            rows += family_rows(name, loglik, metric="accuracy_loglik")
    pope, soft = extra_metrics(results)
    bench = benchmark_scores(records, [r["pred"] for r in results])
    wall = time.time() - t0

    print(f"{name} on {a.data}: {len(records)} records, {wall:.1f} s, "
          f"{sum(r['n_tokens'] for r in results) / max(len(results), 1):.1f} tokens/answer")
    print(format_table(rows))
    if loglik:
        print("\nmultiple choice by option log-likelihood:\n" + format_table(rows, "accuracy_loglik"))
    for fam, m in pope.items():
        print(f"POPE {fam}: precision {m['precision']:.3f} recall {m['recall']:.3f} F1 {m['f1']:.3f} "
              f"yes-ratio {m['yes_ratio']:.3f}")
    for fam, v in soft.items():
        print(f"ANLS {fam}: {v:.3f}")
    if bench:
        print("\nbenchmark scores (each benchmark's own definition, eval.scores):\n" + format_scores(bench))
    return rows, loglik, results, {"pope": pope, "anls": soft, "benchmarks": bench,
                                   "prompt_settings": {"name": a.prompt_settings, **settings}}


if __name__ == "__main__":
    run_cli(main)  # DataError, BackboneError, files: `error: ...`, exit status 2
