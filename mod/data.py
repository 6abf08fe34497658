"""Viewpoint-shift data synthesis (MoD paper §3.2, App. B.2); the debate prompts are in `mod.prompts`.

For every training question (image V, question Q, gold answer A*):
  1. sample K responses from the frozen base model (temperature sampling),
  2. split them into a correct pool P+ and an incorrect pool P- (answers checked with
     `common.answers.is_correct`), every response rewritten in the debate format
     {"Reasoning": <scene description>, "Answer": <short answer>},
  3. build single-turn samples: the human turn holds Q, the debate prompt D and R prior
     responses; the target (gpt turn) is always drawn from P+. Three categories:
        T_pos  every prior is correct (R = 0 gives plain single-round SFT)
        T_rev  every prior is wrong: the target identifies the error and shifts its view
        T_rob  correct and wrong priors interleaved: the target keeps the right answer
               despite the misleading ones
     mixed by `--ratios pos,rev,rob` (categories a question cannot form are skipped and
     the ratio renormalised over the ones it can).

The paper's base models are strong, so P+ is rarely empty; a tiny base model is often wrong
on every sample. Then P+ receives the ground-truth response (scene description + gold
answer) so the target stays correct; how often that happened is printed and stored.

    python -m mod.data --model tiny-chat --data out/data/train.json --out out/mod/data/train_vs.json
"""
import argparse
import json
import math
import os
import random
from collections import Counter

import torch
from tqdm import tqdm

from common.backbone import generate, load_backbone
from common.cli import add_limit, add_threads, entry_parser, number, run_cli, set_threads
from common.cli import add_device_args, load_kwargs
from common.data import IMAGE_ROOT_HELP, SKIP_BAD_HELP
from common.data import DataError, atomic_write_text, check_support, check_training_records, load_image, read_records
from common.answers import final_answer, is_correct, is_correct_for  # noqa: F401  (the toys score with them)
# The prompt shapes live in common/ (the tiny chat base is pretrained on them too); mod.infer reads them here.
from mod.prompts import (ANSWER_SPACE, DEBATE_PROMPT, JSON_INSTRUCTION, debate_prompt,  # noqa: F401
                            debater_prompt, judge_prompt, review_prompt, single_prompt, to_json_response,
                            wrong_response)

CATEGORIES = ("pos", "rev", "rob")


def load_records(path, image_root=None, entry="mod.train", multi_turn=True, skip_bad=False):
    """Training records from LLaVA JSON/JSONL or canonical JSONL (`common.data.read_records`,
    relative image paths against `image_root`, default the file's folder), checked for what
    `entry` needs: at least one record, at most one image per record (`common.data.check_support`;
    text-only records, image None, are allowed, as in the paper's MMLU rows; multi-turn records
    only if `multi_turn`: mod.train trains on every gpt turn) and a non-empty answer
    (`common.data.check_training_records`); every image is decoded now (skip_bad: records with
    an unusable image are left out, with a note). Raises DataError."""
    records = read_records(path, image_root, skip_bad)
    check_support(records, entry, text_only=True, multi_turn=multi_turn)
    check_training_records(records, path)
    return records


def gold_response(record):
    """The ground-truth debate response of a shapes record (scene + gold answer)."""
    scene = record.get("scene") or record["target"].rsplit("Answer", 1)[0].strip().rstrip(".")
    return json.dumps({"Reasoning": scene, "Answer": str(record["answer"])}, ensure_ascii=False)


# ----------------------------------------------------------------------------- sampling

@torch.no_grad()
def sample_responses(model, proc, records, k=4, temperature=1.0, batch_size=64, max_new_tokens=64, seed=0):
    """K temperature samples of the base model per record, on the plain question.
    Returns list (per record) of K generated texts."""
    torch.manual_seed(seed)
    flat = [r for r in records for _ in range(k)]
    texts = []
    for i in tqdm(range(0, len(flat), batch_size), desc="sample K", leave=False):
        b = flat[i:i + batch_size]
        out, _ = generate(model, proc, [load_image(r["image"], r["id"]) if r.get("image") else None for r in b],
                          [r["question"] for r in b],
                          max_new_tokens, do_sample=True, temperature=temperature)
        texts += out
    return [texts[i * k:(i + 1) * k] for i in range(len(records))]


def build_pools(records, samples):
    """-> list of (P+, P-) per record: deduplicated debate-format responses. An empty P+
    gets the gold response. Returns (pools, n_gold_filled)."""
    pools, n_gold = [], 0
    for r, texts in zip(records, samples):
        pos, neg = [], []
        for t in texts:
            (pos if is_correct_for(r, t) else neg).append(to_json_response(t))
        pos, neg = list(dict.fromkeys(pos)), list(dict.fromkeys(neg))
        if not pos:
            pos, n_gold = [gold_response(r)], n_gold + 1
        pools.append((pos, neg))
    return pools, n_gold


def _fewest_priors(category, min_priors):
    return {"pos": min_priors, "rev": max(1, min_priors), "rob": max(2, min_priors)}[category]


def feasible(category, neg, min_priors, max_priors):
    """Can a question with incorrect pool `neg` form a sample of `category`?"""
    return _fewest_priors(category, min_priors) <= max_priors and (category == "pos" or bool(neg))


def make_sample(rng, category, pos, neg, min_priors, max_priors):
    """(prior responses, target) of one (feasible) category; R uniform in its allowed range."""
    R = rng.randint(_fewest_priors(category, min_priors), max_priors)
    if category == "pos":
        priors = [rng.choice(pos) for _ in range(R)]
    elif category == "rev":
        priors = [rng.choice(neg) for _ in range(R)]
    else:  # interleaved, starting with either side: both kinds present
        first = rng.random() < 0.5
        priors = [rng.choice(pos if (j % 2 == 0) == first else neg) for j in range(R)]
    return priors, rng.choice(pos)


def synthesize(records, pools, n_per_question=2, ratios=(1.0, 1.0, 1.0), min_priors=0, max_priors=2, seed=0):
    """LLaVA-format training records with the debate prompt and a JSON target.

    ratios: relative weights of (pos, rev, rob). Returns (records, Counter of categories)."""
    rng, out, counts = random.Random(seed), [], Counter()
    for r, (pos, neg) in zip(records, pools):
        for j in range(n_per_question):
            cats = [c for c, w in zip(CATEGORIES, ratios) if w > 0 and feasible(c, neg, min_priors, max_priors)]
            if not cats:
                continue
            cat = rng.choices(cats, weights=[ratios[CATEGORIES.index(c)] for c in cats])[0]
            priors, target = make_sample(rng, cat, pos, neg, min_priors, max_priors)
            counts[cat] += 1
            out.append({"id": f"{r['id']}_vs{j}", "image": r["image"], "family": r["family"], "answer": r["answer"],
                        "category": cat, "n_priors": len(priors),
                        "conversations": [{"from": "human", "value": ("<image>\n" if r.get("image") else "")
                                                    + debate_prompt(r["question"], priors)},
                                          {"from": "gpt", "value": target}]})
    return out, counts


def ratios_arg(text):
    """argparse type of --ratios: three finite weights >= 0 (pos,rev,rob), not all 0."""
    try:
        r = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three comma-separated numbers pos,rev,rob, got {text!r}")
    if len(r) != 3 or not all(math.isfinite(x) and x >= 0 for x in r) or sum(r) == 0:
        raise argparse.ArgumentTypeError(f"needs three weights >= 0 (pos,rev,rob), not all 0, got {text!r}")
    return r


def main(argv=None):
    p = entry_parser(__spec__.name, "MoD viewpoint-shift data synthesis (§3.2).")
    p.add_argument("--model", default="tiny-chat", help="base model: checkpoint dir or tiny-chat / tiny-dense")
    p.add_argument("--data", required=True,
                   help="training questions (LLaVA JSON/JSONL with answer + family, or canonical JSONL)")
    p.add_argument("--image-root", default=None, help=IMAGE_ROOT_HELP)
    p.add_argument("--out", required=True, help="output LLaVA JSON (image paths stay absolute)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--skip-bad", action="store_true", help=SKIP_BAD_HELP)
    p.add_argument("--num-return-sequences", dest="k", type=number(min=1), default=4,
                   help="answers sampled per question from the base model (the paper's K; transformers' name)")
    p.add_argument("--temperature", type=number(float, above=0), default=1.0, help="sampling temperature")
    p.add_argument("--ratios", type=ratios_arg, default=(1.0, 1.0, 1.0), help="relative weights of T_pos,T_rev,T_rob")
    p.add_argument("--min-priors", type=number(min=0), default=0, help="fewest prior responses R in a prompt")
    p.add_argument("--max-priors", type=number(min=0), default=2, help="most prior responses R in a prompt")
    p.add_argument("--n-per-question", type=number(min=1), default=2, help="training samples built per question")
    add_limit(p, what="questions")
    p.add_argument("--batch-size", type=number(min=1), default=64, help="generation batch size")
    p.add_argument("--max-new-tokens", type=number(min=1), default=64, help="length cap of each sampled response")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling and mixing")
    add_threads(p)
    add_device_args(p)
    args = p.parse_args(argv)
    set_threads(args.threads, args.model)
    if args.min_priors > args.max_priors:
        p.error(f"--min-priors {args.min_priors} exceeds --max-priors {args.max_priors}")
    if os.path.abspath(args.out) == os.path.abspath(args.data):
        p.error("--out is the --data file: it would replace the questions; choose another path")
    if os.path.exists(args.out) and not args.overwrite:
        p.error(f"--out {args.out} exists; pass --overwrite to replace it")
    run_cli(run, args)  # DataError, BackboneError, files: error: ...


def run(args):
    """The body of `main` for parsed flags (writes args.out atomically)."""
    records = load_records(args.data, args.image_root, "mod.data", multi_turn=False,
                           skip_bad=args.skip_bad)[:args.limit or None]  # LLaVA JSON/JSONL or canonical JSONL, checked
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # fail before the sampling
    model, proc = load_backbone(args.model, **load_kwargs(args))
    samples = sample_responses(model, proc, records, args.k, args.temperature, args.batch_size,
                               args.max_new_tokens, args.seed)
    pools, n_gold = build_pools(records, samples)
    out, counts = synthesize(records, pools, args.n_per_question, args.ratios, args.min_priors, args.max_priors,
                             args.seed)
    if not out:
        raise DataError(f"no sample could be formed with --ratios {args.ratios} (categories with weight > 0 need "
                        f"incorrect responses or more --max-priors); nothing written")
    atomic_write_text(args.out, json.dumps(out, indent=1))
    print(f"wrote {len(out)} samples to {args.out}: " + ", ".join(f"T_{c} {counts[c]}" for c in CATEGORIES)
          + f"; questions with no correct base sample (gold target used): {n_gold}/{len(records)}")


if __name__ == "__main__":
    main()
