"""Benchmark scores as each benchmark defines them, for records written by `eval.convert`.

`eval.evaluate` scores every record with the repo's generic reader (`eval.metrics.is_correct`,
per family); records that carry a "benchmark" field are also scored here, by the benchmark's
own rules, read from the lmms-eval task of the same name (EvolvingLMMs-Lab/lmms-eval,
`lmms_eval/tasks/<name>/utils.py`; MMLU from lm-evaluation-harness), so the numbers are the
ones a paper table reports. Each scorer takes the raw generated text: reasoning blocks
(`<think>...</think>`) are removed first, as lmms-eval's default `--reasoning_tags` does, and
nothing else is normalised unless the benchmark does it.

    benchmark_scores(records, preds) -> {benchmark: {metric: value, ..., "categories": {...}}}

    # score saved predictions of any entry point (eval.evaluate, mod.infer, mole.infer,
    # rolemerge.infer) against the converted benchmark file, matched by record id:
    python -m eval.scores --data bench/mme.jsonl --preds out/mod/infer.json [--method single]

Records without a "benchmark" field (any canonical JSONL, LLaVA JSON) are scored as `generic`:
the reading every entry point uses (`common.answers.score`), accuracy per family; `--benchmark
NAME` scores them by NAME's rules instead.

| benchmark | answer read as | score |
|---|---|---|
| mme | Otter's yes/no parse (`mme_answer`) | per subtask acc + acc+ per image pair (x100), perception / cognition sums |
| pope | lower-cased, stripped output == "yes"/"no" | per split accuracy, precision, recall, F1, yes-ratio |
| mmmu | MMMU's `parse_multi_choice_response` / `parse_open_response` | instance-level accuracy, per subject and domain |
| mmstar | lmms-eval's `extract_mcq_answer` | per l2-category mean; category and average = mean over l2 categories |
| scienceqa | LLaVA's exact letter / "X." rule | accuracy, per category |
| mmlu | `eval.metrics.extract` (letter) | accuracy (micro), per subject |
| infovqa | raw output | ANLS (lmms-eval's variant, `anls_lmms`) |
| ocrbench | gold substring of the output | points (one per item, 1000 on the full set), per question type |
| chartqa | raw output | relaxed accuracy (5% numeric tolerance), human / augmented splits |
| textvqa | EvalAI answer processor | VQA accuracy over the 10 answers |
| blink | leading letter (`blink_letter`) | accuracy, per subtask |
| vstar | lmms-eval's V* letter patterns (`vstar_letter`) | accuracy, per category |
| realworldqa | `extract_mcq_answer` for letter golds, else exact | exact match |
| cvbench | leading letter (lmms-eval's cv_bench reader, = `blink_letter`) | accuracy per source; 2D = mean of the ADE20K and COCO accuracies, 3D = Omni3D's (the dataset card's script) |

Accuracies are fractions in [0, 1]; MME scores are on its own scale (x100 per subtask, summed)
and OCRBench's are points.
"""
import json
import random
import re
import sys
from collections import defaultdict

import numpy as np

from common.answers import score as answer_score
from common.cli import add_overwrite, check_out_file, check_overwrite, entry_parser, run_cli
from common.data import atomic_write_text, read_any
from eval.metrics import _json_answer, extract, levenshtein, option_letters, option_pairs


def visible(text):
    """The answer text a benchmark reads: complete `<think>...</think>` blocks removed
    (lmms-eval's default reasoning-tag stripping), and for an output that is one JSON object
    with an "Answer" key (MoD's debate format, `{"Reasoning": ..., "Answer": ...}`) that value.
    Any other text is returned unchanged, whitespace included, because several benchmarks
    read the raw output."""
    t = text
    if "<think>" in t or "</think>" in t:
        t = re.sub(r"<think>.*?</think>", "", t, flags=re.DOTALL)
        if "</think>" in t:
            t = t.rsplit("</think>", 1)[1]
        t = t.split("<think>", 1)[0].strip()
    ans = _json_answer(t.strip())
    return t if ans is None else ans


def _mean(xs):
    return float(np.mean(xs)) if len(xs) else 0.0


def _by(items, key):
    """{key(record): [(record, pred), ...]} in first-seen order."""
    out = {}
    for r, p in items:
        out.setdefault(key(r), []).append((r, p))
    return out


def _gold(r):
    a = r["answer"]
    return a[0] if isinstance(a, list) else a


# ----------------------------------------------------------------------------- MME

MME_PERCEPTION = ("existence", "count", "position", "color", "posters", "celebrity", "scene", "landmark",
                  "artwork", "OCR")
MME_COGNITION = ("commonsense_reasoning", "numerical_calculation", "text_translation", "code_reasoning")


def mme_answer(pred):
    """MME's answer parse (from Otter's eval, as lmms-eval's `parse_pred_ans`): lower-case,
    strip, drop every "."; "yes" / "no" as is; a one-letter answer "y" / "n"; else "yes" if the
    first 4 characters contain "yes", "no" if they contain "no", else "other"."""
    s = pred.lower().strip().replace(".", "")
    if s in ("yes", "no"):
        return s
    if len(s) == 1:
        return {"y": "yes", "n": "no"}.get(s, "other")
    return "yes" if "yes" in s[:4] else "no" if "no" in s[:4] else "other"


def score_mme(items):
    """MME (Fu et al., "MME: A Comprehensive Evaluation Benchmark for Multimodal Large Language
    Models", arXiv 2306.13394): every image has two yes/no questions (records sharing
    meta["pair"]). Per subtask (record "category"):
        acc  = 100 * correct questions / questions      (mean over pairs of 100 * pair mean)
        acc+ = 100 * pairs with both right / pairs
        score = acc + acc+                               (0..200)
    perception = sum of the 10 perception subtask scores (max 2000), cognition = sum of the 4
    cognition ones (max 800). A pair cut by --limit (one question present) is left out and
    counted in "incomplete_pairs". Raises ValueError for a category MME does not have."""
    pairs = defaultdict(lambda: defaultdict(list))
    for r, p in items:
        cat = r.get("category")
        if cat not in MME_PERCEPTION + MME_COGNITION:
            raise ValueError(f"record {r['id']}: MME category {cat!r} is not one of {MME_PERCEPTION + MME_COGNITION}")
        gold = str(_gold(r)).lower().strip().replace(".", "")
        pairs[cat][r.get("meta", {}).get("pair", r["id"])].append(float(mme_answer(p) == gold))
    cats, incomplete = {}, 0
    for cat, by_pair in pairs.items():
        full = [s for s in by_pair.values() if len(s) == 2]
        incomplete += len(by_pair) - len(full)
        if full:
            cats[cat] = _mean([100.0 * sum(s) / 2 + 100.0 * (sum(s) == 2) for s in full])
    return {"perception": float(sum(v for c, v in cats.items() if c in MME_PERCEPTION)),
            "cognition": float(sum(v for c, v in cats.items() if c in MME_COGNITION)),
            "categories": cats, "incomplete_pairs": incomplete, "n": len(items)}


# ----------------------------------------------------------------------------- POPE

def score_pope(items):
    """POPE (Li et al., "Evaluating Object Hallucination in Large Vision-Language Models",
    arXiv 2305.10355), per split (record "category": adversarial / popular / random) and over
    all records, as lmms-eval's pope task reads answers: pred = output.lower().strip(), a hit
    only when it equals the gold "yes"/"no" exactly ("Yes." is neither).
        accuracy = mean(pred == gold)
        precision = TP / (TP + FP)      TP: gold yes & pred yes, FP: gold no & pred yes
        recall    = TP / (TP + FN)      FN: gold yes & pred "no" (an answer that is neither
                                         yes nor no counts in no denominator, as in lmms-eval)
        F1 = 2 P R / (P + R)
        yes_ratio = share of predictions that are "yes" (POPE's definition; lmms-eval's
                    pope_yes_ratio is the share of *gold* yes, given as gold_yes_ratio)
    0.0 where a denominator is 0."""
    def one(group):
        pred = [p.lower().strip() for _, p in group]
        gold = [str(_gold(r)).lower().strip() for r, _ in group]
        tp = sum(g == "yes" and q == "yes" for q, g in zip(pred, gold))
        fp = sum(g == "no" and q == "yes" for q, g in zip(pred, gold))
        fn = sum(g == "yes" and q == "no" for q, g in zip(pred, gold))
        prec = tp / (tp + fp) if tp + fp else 0.0
        rec = tp / (tp + fn) if tp + fn else 0.0
        return {"accuracy": _mean([q == g for q, g in zip(pred, gold)]), "precision": prec, "recall": rec,
                "f1": 2 * prec * rec / (prec + rec) if prec + rec else 0.0,
                "yes_ratio": _mean([q == "yes" for q in pred]), "gold_yes_ratio": _mean([g == "yes" for g in gold]),
                "n": len(group)}
    out = one(items)
    out["categories"] = {c: one(g) for c, g in _by(items, lambda r: r.get("category", "all")).items()}
    return out


# ----------------------------------------------------------------------------- MMMU

MMMU_DOMAINS = {
    "Art and Design": ["Art", "Art_Theory", "Design", "Music"],
    "Business": ["Accounting", "Economics", "Finance", "Manage", "Marketing"],
    "Science": ["Biology", "Chemistry", "Geography", "Math", "Physics"],
    "Health and Medicine": ["Basic_Medical_Science", "Clinical_Medicine", "Diagnostics_and_Laboratory_Medicine",
                            "Pharmacy", "Public_Health"],
    "Humanities and Social Science": ["History", "Literature", "Sociology", "Psychology"],
    "Tech and Engineering": ["Agriculture", "Architecture_and_Engineering", "Computer_Science", "Electronics",
                             "Energy_and_Power", "Materials", "Mechanical_Engineering"],
}


def mmmu_choice(response, options, seed_key=""):
    """MMMU's `parse_multi_choice_response` (Yue et al., arXiv 2311.16502; as in lmms-eval):
    options: the option texts, lettered A, B, ... Strip ,.!?;:' from both ends, pad with
    spaces, then the first rule that finds candidates:
      1. "(B)" anywhere;  2. "B " (letter then space);  3. "B.";
      4. (responses of more than 5 words) an option's text, case-insensitive.
    Several candidates: the one whose "(B)" / " B " / text occurs last (first on ties). No
    candidate: MMMU draws a random letter; we draw it from a generator seeded with
    `seed_key` (the record id), so a score is reproducible and has the same expectation."""
    letters = [chr(ord("A") + i) for i in range(len(options))]
    for ch in ",.!?;:'":
        response = response.strip(ch)
    response = f" {response} "
    cands = [L for L in letters if f"({L})" in response]
    brack, by_text = bool(cands), False
    if not cands:
        cands = [L for L in letters if f"{L} " in response]
    if not cands:
        cands = [L for L in letters if f"{L}." in response]
    if not cands and len(response.split()) > 5:
        cands = [L for L, t in zip(letters, options) if str(t).lower() in response.lower()]
        by_text = bool(cands)
    if not cands:
        return random.Random(str(seed_key)).choice(letters)
    if len(cands) == 1:
        return cands[0]
    if by_text:
        pos = [response.lower().rfind(str(options[ord(L) - 65]).lower()) for L in cands]
    else:
        pos = [response.rfind(f"({L})" if brack else f" {L} ") for L in cands]
    return cands[int(np.argmax(pos))]


_NUM_COMMAS = re.compile(r"-?\b\d{1,3}(?:,\d{3})+\b")
_NUM_SCI = re.compile(r"-?\d+(?:\.\d+)?[eE][+-]?\d+")
_NUM_SIMPLE = re.compile(r"-?(?:\d+\.\d+|\.\d+|\d+\b)(?![eE][+-]?\d+)(?![,\d])")


def mmmu_numbers(s):
    """MMMU's `extract_numbers`: numbers with thousands commas, then scientific, then simple."""
    return _NUM_COMMAS.findall(s) + _NUM_SCI.findall(s) + _NUM_SIMPLE.findall(s)


def mmmu_norm(s):
    """MMMU's `normalize_str`: a number -> [float rounded to 2 places]; a one-character string
    -> [" c", "c "] (no trivial substring hits); else [lower-cased string]."""
    s = s.strip()
    try:
        return [round(float(s.replace(",", "")), 2)]
    except ValueError:
        s = s.lower()
        return [" " + s, s + " "] if len(s) == 1 else [s]


def mmmu_open(response):
    """MMMU's `parse_open_response`: the response lower-cased, split into sentences; in each,
    the shortest tail after a key phrase ("could be ", "so ", "is ", "thus ", "therefore ",
    "final ", "answer ", "result ", and "=" in the last sentence); no tail anywhere -> the
    whole response. Those tails, plus every number in them, normalised (`mmmu_norm`)."""
    resp = response.strip().strip(".").lower()
    subs = re.split(r"\.\s(?=[A-Z])|\n", resp)
    keys = ["could be ", "so ", "is ", "thus ", "therefore ", "final ", "answer ", "result "]
    tails = []
    for i, sub in enumerate(subs):
        ks = keys + (["="] if i == len(subs) - 1 else [])
        best = None
        for k in ks:
            if k in sub:
                t = sub.split(k)[-1].strip()
                if best is None or len(t) < len(best):
                    best = t
        if best and best.strip() not in (":", ",", ".", "!", "?", ";", "'"):
            tails.append(best)
    tails = tails or [resp]
    preds = tails + [n for t in tails for n in mmmu_numbers(t)]
    return list({x for p in preds for x in mmmu_norm(p)})


def mmmu_open_correct(gold, preds):
    """MMMU's `eval_open`: a normalised gold string contained in a predicted string, or a gold
    number equal to a predicted number. gold: a string or a list of acceptable strings."""
    golds = [x for g in (gold if isinstance(gold, list) else [gold]) for x in mmmu_norm(str(g))]
    for p in preds:
        if isinstance(p, str):
            if any(isinstance(g, str) and g in p for g in golds):
                return True
        elif p in golds:
            return True
    return False


def score_mmmu(items):
    """MMMU: multiple-choice records (options) by `mmmu_choice`, open ones by `mmmu_open` /
    `mmmu_open_correct`. accuracy = correct / records (instance level), per subject (record
    "category") and per domain (`MMMU_DOMAINS`, instance level over its subjects)."""
    ok = []
    for r, p in items:
        if r.get("options"):
            texts = [t for _, t in option_pairs(r["options"])]
            golds = r["answer"] if isinstance(r["answer"], list) else [r["answer"]]
            ok.append(mmmu_choice(p, texts, r["id"]) in golds)
        else:
            ok.append(mmmu_open_correct(r["answer"], mmmu_open(p)))
    cats = defaultdict(list)
    for (r, _), c in zip(items, ok):
        cats[r.get("category", "all")].append(c)
    domains = {d: [c for s in subs for c in cats.get(s, [])] for d, subs in MMMU_DOMAINS.items()}
    return {"accuracy": _mean(ok), "n": len(ok), "categories": {c: _mean(v) for c, v in cats.items()},
            "domains": {d: _mean(v) for d, v in domains.items() if v}}


# ----------------------------------------------------------------------------- letter readers

_MCQ_PHRASES = ["the answer is", "answer is", "the correct answer is", "correct answer is", "the best answer is",
                "best answer is", "the correct option is", "correct option is", "the best option is",
                "best option is", "the choice is", "choice is", "the correct choice is", "correct choice is",
                "i choose", "i select", "i pick", "my answer is", "my choice is"]
_MCQ_RANK = {"start": 10, "end": 9, "phrase": 7, "parentheses": 6, "period": 5, "colon": 4, "right_paren": 3,
             "space": 2, "fallback": 0}


def mcq_letter(response, choices="ABCD"):
    """lmms-eval's `extract_mcq_answer` (used by MMStar and RealWorldQA): strip ,.!?;:'" from
    both ends and pad with spaces; candidates (letter, position, format) are "(B)", "B.",
    "B:", "B)", "B " (each at its last occurrence), a letter after an answer phrase ("the
    answer is", "i choose", ...: the first such letter after the phrase), the stripped text
    starting / ending with a standalone letter; if none, any occurrence of a letter. The
    candidate of the highest-ranked format wins (start > end > phrase > (B) > B. > B: > B) >
    "B " > any), the latest position within a format. "" if no letter appears."""
    if not response or not response.strip():
        return ""
    text = response.strip()
    for ch in ",.!?;:'\"":
        text = text.strip(ch)
    text = f" {text} "
    cands = []
    for fmt, pat in (("parentheses", "({})"), ("period", "{}."), ("colon", "{}:"), ("right_paren", "{})"),
                     ("space", "{} ")):
        cands += [(c, text.rfind(pat.format(c)), fmt) for c in choices if pat.format(c) in text]
    low = text.lower()
    for phrase in _MCQ_PHRASES:
        i = low.find(phrase)
        if i != -1:
            cands += [(c, text.find(c, i + len(phrase)), "phrase") for c in choices
                      if text.find(c, i + len(phrase)) != -1]
    s = text.strip()
    cands += [(c, 0, "start") for c in choices if s.startswith(c) and (len(s) == 1 or not s[1].isalpha())]
    cands += [(c, len(text) - 1, "end") for c in choices if s.endswith(c) and (len(s) == 1 or not s[-2].isalpha())]
    if not cands:
        cands = [(c, text.rfind(c), "fallback") for c in choices if c in text]
    if not cands:
        return ""
    return max(cands, key=lambda x: (_MCQ_RANK[x[2]], x[1]))[0]


def blink_letter(response):
    """lmms-eval's BLINK reader: the first letter of the stripped output after optional "("
    / spaces, upper-cased ("(b) cat" -> "B"; "The answer is A" -> "T", which scores wrong)."""
    m = re.match(r"[\(\s]*([A-Z])[\)\.\s]*", response.strip(), flags=re.IGNORECASE)
    return m.group(1).upper() if m else ""


_VSTAR = [r"^([A-D])\s*[\.)\]]*", r"(?:THE\s+)?(?:ANSWER|CHOICE|OPTION)(?:\s+IS)?[\s:]+([A-D])", r"\(([A-D])\)",
          r"([A-D])\s*(?:\.|\)|])", r"(?:^|\s)([A-D])(?:\s|$)"]


def vstar_letter(response):
    """lmms-eval's V* reader on the stripped, upper-cased output: the first of these patterns
    that matches: a leading letter; "ANSWER/CHOICE/OPTION (IS) B"; "(B)"; "B." / "B)" / "B]";
    a standalone letter; else the only A-D letter in the text; else a leading A-D; else None."""
    s = response.strip().upper()
    for pat in _VSTAR:
        m = re.search(pat, s)
        if m:
            return m.group(1)
    letters = re.findall(r"[A-D]", s)
    if len(letters) == 1:
        return letters[0]
    return s[0] if s and s[0] in "ABCD" else None


CVBENCH_SOURCES = {"2D": ("ADE20K", "COCO"), "3D": ("Omni3D",)}


def score_cvbench(items):
    """CV-Bench (Tong et al., "Cambrian-1", arXiv 2406.16860) as its dataset card's evaluation
    script composes it (nyu-visionx/CV-Bench; lmms-eval's cv_bench default aggregate is the
    same formula). hit = `blink_letter(pred)` (lmms-eval's cv_bench reader: the leading letter)
    equals the gold letter. Then
        acc(source)  = mean hit over the records of that source (meta["source"])
        accuracy_2d  = (acc(ADE20K) + acc(COCO)) / 2        (a mean of sources, not of records)
        accuracy_3d  = acc(Omni3D)
        overall      = (accuracy_2d + accuracy_3d) / 2       (the card's "CV-Bench Accuracy")
    MoLE's table (Mixture of Latent Experts) reports accuracy_2d and accuracy_3d separately.
    A type's sources are read from the records (meta["type"], "2D" / "3D"); a source missing
    from a run (--limit) is left out of its type's mean and listed in "missing_sources"; a type
    with no records is absent, and so is overall. Also: accuracy_2d_micro / accuracy_3d_micro
    (plain accuracy over that type's records, lmms-eval's cv_bench_2d / cv_bench_3d tasks),
    per-task accuracy ("categories": Count, Relation, Depth, Distance) and per-source "sources".
    Raises ValueError for a record without meta["source"] (not written by eval.convert)."""
    by_src, by_type, by_task, types = defaultdict(list), defaultdict(list), defaultdict(list), {}
    for r, p in items:
        meta = r.get("meta") or {}
        if "source" not in meta:
            raise ValueError(f"record {r['id']}: no meta.source; convert CV-Bench with eval.convert --benchmark cvbench")
        hit = blink_letter(p) == str(_gold(r)).strip("()").upper()
        kind = str(meta.get("type") or ("3D" if meta["source"] in CVBENCH_SOURCES["3D"] else "2D"))
        by_src[meta["source"]].append(hit)
        by_type[kind].append(hit)
        by_task[r.get("category", "all")].append(hit)
        types.setdefault(kind, set()).add(meta["source"])
    src_acc = {s: _mean(v) for s, v in by_src.items()}
    out = {"n": len(items), "sources": src_acc}
    missing = []
    for kind in ("2D", "3D"):
        if kind not in types:
            continue
        expected = CVBENCH_SOURCES[kind]
        present = [s for s in expected if s in src_acc] + sorted(types[kind] - set(expected))
        missing += [s for s in expected if s not in src_acc]
        out[f"accuracy_{kind.lower()}"] = _mean([src_acc[s] for s in present])
        out[f"accuracy_{kind.lower()}_micro"] = _mean(by_type[kind])
    if "accuracy_2d" in out and "accuracy_3d" in out:
        out["overall"] = (out["accuracy_2d"] + out["accuracy_3d"]) / 2
    out["missing_sources"] = missing
    out["categories"] = {c: _mean(v) for c, v in by_task.items()}
    return out


def _accuracy_by_category(items, ok):
    cats = defaultdict(list)
    for (r, _), c in zip(items, ok):
        cats[r.get("category", "all")].append(c)
    return {"accuracy": _mean(ok), "n": len(ok), "categories": {c: _mean(v) for c, v in cats.items()}}


def score_mmstar(items):
    """MMStar (Chen et al., "Are We on the Right Way for Evaluating Large Vision-Language
    Models?", arXiv 2403.20330) as lmms-eval aggregates it: hit = `mcq_letter(pred, "ABCD")`
    equals the gold letter; per l2 category (meta["l2_category"]) the mean; each of the 6
    categories = the mean of its l2 categories' means; "average" = the mean over all l2
    categories present (not over records)."""
    l2 = defaultdict(list)
    cat_of = {}
    for r, p in items:
        k = r.get("meta", {}).get("l2_category", r.get("category", "all"))
        cat_of[k] = r.get("category", "all")
        l2[k].append(float(mcq_letter(p, "ABCD") == str(_gold(r)).strip().upper()))
    l2m = {k: _mean(v) for k, v in l2.items()}
    cats = defaultdict(list)
    for k, v in l2m.items():
        cats[cat_of[k]].append(v)
    return {"average": _mean(list(l2m.values())), "n": len(items), "categories": {c: _mean(v) for c, v in cats.items()},
            "l2_categories": l2m}


def score_scienceqa(items):
    """ScienceQA as lmms-eval (LLaVA's rule) reads it: the stripped output equals the gold
    letter (any case), or it starts with an upper-case letter and "." ("B. cat") and that
    letter is the gold; anything else is wrong. Accuracy, per category."""
    ok = []
    for r, p in items:
        gold, s = str(_gold(r)).strip().lower(), p.strip()
        ok.append(s.lower() == gold or (len(s) >= 2 and s[0].isupper() and s[1] == "." and s[0].lower() == gold))
    return _accuracy_by_category(items, ok)


def score_mmlu(items):
    """MMLU (Hendrycks et al., arXiv 2009.03300), generative: the letter read by
    `eval.metrics.extract(.., "letter")` over the record's options equals the gold letter.
    Accuracy over records (micro, as lm-evaluation-harness aggregates the mmlu group), per
    subject (record "category")."""
    ok = []
    for r, p in items:
        golds = r["answer"] if isinstance(r["answer"], list) else [r["answer"]]
        ok.append(extract(p, "letter", option_letters(r.get("options"), golds), r.get("options")) in golds)
    return _accuracy_by_category(items, ok)


def score_blink(items):
    """BLINK (Fu et al., arXiv 2404.12390): `blink_letter(pred)` equals the gold letter.
    Accuracy over records (lmms-eval's blink group), per subtask (record "category")."""
    return _accuracy_by_category(items, [blink_letter(p) == str(_gold(r)).strip("()") for r, p in items])


def score_vstar(items):
    """V* Bench (Wu & Xie, "V*: Guided Visual Search as a Core Mechanism in Multimodal LLMs",
    arXiv 2312.14135): `vstar_letter(pred)` equals the gold letter. Accuracy (a fraction;
    lmms-eval prints it x100), per category (direct_attributes / relative_position)."""
    return _accuracy_by_category(items, [vstar_letter(p) == str(_gold(r)).strip().upper() for r, p in items])


def score_realworldqa(items):
    """RealWorldQA as lmms-eval scores it: a gold A-D -> `mcq_letter(pred, "ABCD")` equals it;
    any other gold (a number, a word) -> pred.lower().strip().rstrip(".") equals gold.lower()."""
    ok = []
    for r, p in items:
        g = str(_gold(r)).strip()
        ok.append(mcq_letter(p, "ABCD") == g.upper() if g.upper() in ("A", "B", "C", "D")
                  else p.lower().strip().rstrip(".") == g.lower())
    return _accuracy_by_category(items, ok)


# ----------------------------------------------------------------------------- text answers

def anls_lmms(pred, golds, threshold=0.5):
    """InfoVQA / DocVQA ANLS as lmms-eval computes it (its `anls` metric, from Qwen-VL's
    infographicsvqa_eval): for each gold g, NL = levenshtein(norm(g), norm(pred)) /
    max(len(g.upper()), len(pred.upper())) with norm = strip, lower-case, collapse spaces:
    the lengths are those of the *unnormalised, upper-cased* strings, as lmms-eval writes
    them, so a character that upper-cases to two ("ß" -> "SS") counts twice ("Großstrasse"
    vs "Großstraße": distance 2 / 12 -> 0.8333); s = 1 - min NL; s = 0 if s < threshold.
    Differs from `eval.metrics.anls_score` only at NL = 0.5 exactly (kept here, 0 there)
    and in the lengths used."""
    golds = golds if isinstance(golds, list) else [golds]
    nls = []
    for g in golds:
        g = str(g)
        a, b = " ".join(g.strip().lower().split()), " ".join(pred.strip().lower().split())
        n = max(len(g.upper()), len(pred.upper()))  # lmms-eval's lengths (upper case, unnormalised)
        nls.append(0.0 if n == 0 else levenshtein(a, b) / n)
    s = 1 - min(nls)
    return 0.0 if s < threshold else s


def score_infovqa(items):
    """InfographicVQA (Mathew et al., arXiv 2104.12756): mean `anls_lmms` over records."""
    return {"anls": _mean([anls_lmms(p, r["answer"]) for r, p in items]), "n": len(items)}


def relaxed_correct(pred, gold, tol=0.05):
    """ChartQA's relaxed accuracy (Masry et al., arXiv 2203.10244, end of sec. 5.1; lmms-eval's
    `relaxed_correctness`): both parse as floats ("12%" -> 0.12) and the gold is non-zero ->
    |pred - gold| / |gold| <= tol; else case-insensitive exact match of the strings."""
    def num(s):
        try:
            return float(s.rstrip("%")) / 100.0 if s.endswith("%") else float(s)
        except ValueError:
            return None
    p, g = num(pred), num(gold)
    if p is not None and g:
        return abs(p - g) / abs(g) <= tol
    return pred.lower() == gold.lower()


def score_chartqa(items):
    """ChartQA: mean `relaxed_correct(pred, gold)`; relaxed_overall and per split
    (record "category": human_test -> relaxed_human_split, else relaxed_augmented_split)."""
    ok = [relaxed_correct(p, str(_gold(r))) for r, p in items]
    hum = [c for (r, _), c in zip(items, ok) if r.get("category") == "human_test"]
    aug = [c for (r, _), c in zip(items, ok) if r.get("category") != "human_test"]
    out = {"relaxed_overall": _mean(ok), "n": len(ok)}
    if hum:
        out["relaxed_human_split"] = _mean(hum)
    if aug:
        out["relaxed_augmented_split"] = _mean(aug)
    return out


def ocrbench_point(pred, golds, dataset=""):
    """OCRBench (Liu et al., arXiv 2305.07895) as lmms-eval scores an item: 1 if any gold is a
    substring of the prediction, else 0. HME100k (handwritten maths): every space removed
    from both; other sources: fullwidth ASCII folded to ASCII, lower-cased, stripped,
    newlines -> spaces."""
    golds = golds if isinstance(golds, list) else [golds]
    pred = pred.strip()
    if dataset == "HME100k":
        squash = lambda s: s.strip().replace("\n", " ").replace(" ", "")
        return int(any(squash(str(g)) in squash(pred) for g in golds))
    fold = lambda s: "".join(chr(ord(c) - 0xFEE0) if 0xFF01 <= ord(c) <= 0xFF5E else " " if c == "\u3000" else c
                             for c in s).lower().strip().replace("\n", " ")
    return int(any(fold(str(g)) in fold(pred) for g in golds))


OCRBENCH_RECOGNITION = ("Regular Text Recognition", "Irregular Text Recognition", "Artistic Text Recognition",
                        "Handwriting Recognition", "Digit String Recognition", "Non-Semantic Text Recognition")


def score_ocrbench(items):
    """OCRBench: points = sum of `ocrbench_point` (out of 1000 on the full set; lmms-eval
    reports points / 1000), per question type (record "category") and "Text Recognition" =
    the six recognition types summed."""
    cats = defaultdict(int)
    for r, p in items:
        cats[r.get("category", "all")] += ocrbench_point(p, r["answer"], r.get("meta", {}).get("dataset", ""))
    cats = dict(cats)
    return {"points": sum(cats.values()), "n": len(items), "text_recognition":
            sum(v for c, v in cats.items() if c in OCRBENCH_RECOGNITION), "categories": cats}


_CONTRACTIONS = dict(x.split("=", 1) for x in (
    "aint=ain't arent=aren't cant=can't couldve=could've couldnt=couldn't couldn'tve=couldn't've "
    "couldnt've=couldn't've didnt=didn't doesnt=doesn't dont=don't hadnt=hadn't hadnt've=hadn't've "
    "hadn'tve=hadn't've hasnt=hasn't havent=haven't hed=he'd hed've=he'd've he'dve=he'd've hes=he's howd=how'd "
    "howll=how'll hows=how's Id've=I'd've I'dve=I'd've Im=I'm Ive=I've isnt=isn't itd=it'd itd've=it'd've "
    "it'dve=it'd've itll=it'll let's=let's maam=ma'am mightnt=mightn't mightnt've=mightn't've "
    "mightn'tve=mightn't've mightve=might've mustnt=mustn't mustve=must've neednt=needn't notve=not've "
    "oclock=o'clock oughtnt=oughtn't ow's'at='ow's'at 'ows'at='ow's'at 'ow'sat='ow's'at shant=shan't "
    "shed've=she'd've she'dve=she'd've she's=she's shouldve=should've shouldnt=shouldn't shouldnt've=shouldn't've "
    "shouldn'tve=shouldn't've somebody'd=somebodyd somebodyd've=somebody'd've somebody'dve=somebody'd've "
    "somebodyll=somebody'll somebodys=somebody's someoned=someone'd someoned've=someone'd've "
    "someone'dve=someone'd've someonell=someone'll someones=someone's somethingd=something'd "
    "somethingd've=something'd've something'dve=something'd've somethingll=something'll thats=that's thered=there'd "
    "thered've=there'd've there'dve=there'd've therere=there're theres=there's theyd=they'd theyd've=they'd've "
    "they'dve=they'd've theyll=they'll theyre=they're theyve=they've twas='twas wasnt=wasn't wed've=we'd've "
    "we'dve=we'd've weve=we've werent=weren't whatll=what'll whatre=what're whats=what's whatve=what've "
    "whens=when's whered=where'd wheres=where's whereve=where've whod=who'd whod've=who'd've who'dve=who'd've "
    "wholl=who'll whos=who's whove=who've whyll=why'll whyre=why're whys=why's wont=won't wouldve=would've "
    "wouldnt=wouldn't wouldnt've=wouldn't've wouldn'tve=wouldn't've yall=y'all yall'll=y'all'll y'allll=y'all'll "
    "yall'd've=y'all'd've y'alld've=y'all'd've y'all'dve=y'all'd've youd=you'd youd've=you'd've you'dve=you'd've "
    "youll=you'll youre=you're youve=you've ").split())
_VQA_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?",
              "!"]
_VQA_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
                "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
_COMMA_STRIP = re.compile(r"(?<=\d)(\,)+(?=\d)")


def vqa_normalize(s):
    """The VQA / EvalAI answer processor (as lmms-eval's `EvalAIAnswerProcessor`): lower-case;
    drop "," and "?", "'s" -> " 's"; whitespace to spaces; each punctuation mark removed when it
    touches a space (or the text has a digit,digit comma) else replaced by a space; periods not
    next to a digit removed (the first 32, as the original's count argument does); number words
    zero..ten / none to digits; articles dropped; contractions restored ("dont" -> "don't")."""
    s = s.lower().replace(",", "").replace("?", "").replace("'s", " 's").strip()
    s = s.replace("\n", " ").replace("\t", " ").strip()
    out = s
    for p in _VQA_PUNCT:
        if p + " " in s or " " + p in s or _COMMA_STRIP.search(s):
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    out = _PERIOD_STRIP.sub("", out, 32)
    words = [_VQA_NUMBERS.get(w, w) for w in out.lower().split()]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words if w not in ("a", "an", "the"))


def vqa_accuracy(pred, answers):
    """VQA accuracy (Antol et al. 2015; TextVQA, Singh et al. arXiv 1904.08920): with the
    annotators' answers a_1..a_n (10 in TextVQA) and p the prediction, all through
    `vqa_normalize`: mean over i of min(1, #{j != i: a_j == p} / 3)."""
    answers = [vqa_normalize(str(a)) for a in (answers if isinstance(answers, list) else [answers])]
    p = vqa_normalize(pred)
    return _mean([min(1.0, sum(a == p for j, a in enumerate(answers) if j != i) / 3) for i in range(len(answers))])


def score_textvqa(items):
    """TextVQA: mean `vqa_accuracy` over records (needs the 10 answers in the record)."""
    return {"vqa_accuracy": _mean([vqa_accuracy(p, r["answer"]) for r, p in items]), "n": len(items)}


# ----------------------------------------------------------------------------- report

GENERIC = "generic"   # records of no benchmark: the repo's own reading (`common.answers.score`), as eval.evaluate
SCORERS = {"mme": score_mme, "pope": score_pope, "mmmu": score_mmmu, "mmstar": score_mmstar,
           "scienceqa": score_scienceqa, "mmlu": score_mmlu, "infovqa": score_infovqa, "ocrbench": score_ocrbench,
           "chartqa": score_chartqa, "textvqa": score_textvqa, "blink": score_blink, "vstar": score_vstar,
           "realworldqa": score_realworldqa, "cvbench": score_cvbench}
# the headline number of each benchmark, in the order a paper table prints them
HEADLINE = {"mme": ("perception", "cognition"), "pope": ("f1", "accuracy"), "mmmu": ("accuracy",),
            "mmstar": ("average",), "scienceqa": ("accuracy",), "mmlu": ("accuracy",), "infovqa": ("anls",),
            "ocrbench": ("points",), "chartqa": ("relaxed_overall",), "textvqa": ("vqa_accuracy",),
            "blink": ("accuracy",), "vstar": ("accuracy",), "realworldqa": ("accuracy",),
            "cvbench": ("accuracy_2d", "accuracy_3d", "overall"), GENERIC: ("accuracy",)}


def score_generic(items):
    """Any canonical record, scored the way every entry point scores it (`common.answers.score`:
    the record's answer type, family or options decide the reading; README "Scoring"):
    accuracy, per family. For data of no public benchmark (the shapes world, your own records)."""
    ok = [answer_score(r, p)["correct"] for r, p in items]
    return _accuracy_by_category([(dict(r, category=r.get("family", "unlabelled")), p) for r, p in items], ok)


def benchmark_scores(records, preds, default=None):
    """{benchmark: scores} for the records that carry a "benchmark" field (`eval.convert`),
    each scored by `SCORERS[benchmark]` on its generated text (`visible`). records and preds
    are parallel lists (preds: raw generated strings). Records without a benchmark are
    scored as `default` (a SCORERS name, or GENERIC: `score_generic`) when given, else
    skipped; an unknown benchmark name raises ValueError listing the known ones."""
    if len(records) != len(preds):
        raise ValueError(f"benchmark_scores: {len(records)} records vs {len(preds)} predictions")
    groups = {}
    for r, p in zip(records, preds):
        b = r.get("benchmark") or default
        if b:
            groups.setdefault(b, []).append((r, visible(p)))
    unknown = sorted(set(groups) - set(SCORERS) - {GENERIC})
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; scored benchmarks: {', '.join(SCORERS)}")
    return {b: (score_generic if b == GENERIC else SCORERS[b])(items) for b, items in groups.items()}


def format_scores(scores):
    """One line per benchmark: its headline numbers, then its categories."""
    lines = []
    for b, s in scores.items():
        head = ", ".join(f"{k} {s[k]:.3f}" if isinstance(s[k], float) else f"{k} {s[k]}"
                         for k in HEADLINE[b] if k in s)
        lines.append(f"{b} (n={s['n']}): {head}")
        for c, v in s.get("categories", {}).items():
            v = v.get(HEADLINE[b][0], v.get("accuracy")) if isinstance(v, dict) else v
            lines.append(f"  {c}: {v:.3f}" if isinstance(v, float) else f"  {c}: {v}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- saved predictions

def load_predictions(path, method=None):
    """{method: {id: generated text}} from a predictions file of any entry point:
    eval.evaluate ({"results": [...]}), mod.infer ({"results": {method: [...]}}), mole.infer
    ([...]) and rolemerge.infer ({"predictions": [...]}); each row has "id" and "pred".
    `method` picks one of mod.infer's methods. Raises ValueError for another layout or an
    unknown method."""
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if isinstance(obj, dict) and obj.get("complete") is False:   # mod.infer stopped between methods
        print(f"warning: {path} is an unfinished run (\"complete\": false): it holds "
              f"{', '.join(obj.get('results', {})) or 'no method'} only; finish it with the same command and "
              f"--resume", file=sys.stderr)
    if isinstance(obj, dict) and isinstance(obj.get("results"), dict):
        runs = obj["results"]
    elif isinstance(obj, dict) and isinstance(obj.get("results", obj.get("predictions")), list):
        runs = {"model": obj.get("results", obj.get("predictions"))}
    elif isinstance(obj, list):
        runs = {"model": obj}
    else:
        raise ValueError(f"{path}: not a predictions file of eval.evaluate, mod.infer, mole.infer or rolemerge.infer")
    if method is not None:
        if method not in runs:
            raise ValueError(f"{path}: no method {method!r}; it has {', '.join(runs)}")
        runs = {method: runs[method]}
    bad = [m for m, rows in runs.items() if not all(isinstance(r, dict) and "id" in r and "pred" in r for r in rows)]
    if bad:
        raise ValueError(f"{path}: rows of {bad} lack 'id' / 'pred'")
    return {m: {str(r["id"]): r["pred"] for r in rows} for m, rows in runs.items()}


def main(argv=None):
    p = entry_parser(__spec__.name, "Score saved predictions the way each benchmark defines it.")
    p.add_argument("--data", required=True,
                   help="the records the predictions answer: a converted benchmark JSONL (python -m eval.convert) or "
                        "any canonical JSONL / LLaVA JSON")
    p.add_argument("--preds", required=True, help="predictions JSON of eval.evaluate / mod.infer / mole.infer / "
                                                  "rolemerge.infer")
    p.add_argument("--benchmark", default=None, choices=sorted(SCORERS) + [GENERIC],
                   help="score the records that have no \"benchmark\" field by this benchmark's rules (default: "
                        f"{GENERIC}, the reading every entry point uses: accuracy per family)")
    p.add_argument("--method", default=None, help="one method of a mod.infer file (default: every method in it)")
    p.add_argument("--image-root", default=None, help="as for the entry point that made --preds (images are not read)")
    p.add_argument("--out", default=None, help="also write {method: scores} as JSON here")
    add_overwrite(p)
    a = p.parse_args(argv)
    if a.out:  # before anything is read
        check_out_file(a.out)
        check_overwrite(a.out, a.overwrite)
    records = read_any(a.data, image_root=a.image_root, check_images=False)
    if not all(r.get("benchmark") for r in records) and not a.benchmark:
        print(f"note: {sum(not r.get('benchmark') for r in records)} record(s) of {a.data} have no \"benchmark\" "
              f"field: scored as {GENERIC} (accuracy per family, as eval.evaluate); --benchmark NAME applies a "
              f"benchmark's own rules to them")
    out = {}
    for m, preds in load_predictions(a.preds, a.method).items():
        have = [r for r in records if r["id"] in preds]
        if not have:
            raise ValueError(f"{a.preds}: no prediction of {m!r} matches a record id of {a.data}")
        if len(have) < len(records):
            print(f"note: {m}: {len(records) - len(have)} of {len(records)} records have no prediction (--limit?); "
                  f"scored the {len(have)} that do")
        out[m] = benchmark_scores(have, [preds[r["id"]] for r in have], a.benchmark or GENERIC)
        print(f"{m}:\n{format_scores(out[m])}")
    if a.out:
        atomic_write_text(a.out, json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    run_cli(main)  # ValueError / OSError: `error: ...`, exit status 2
