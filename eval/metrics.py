"""Answer extraction and metrics: accuracy, POPE precision/recall/F1, ANLS, bootstrap CIs.

Pure functions over strings and 0/1 vectors; no model code. Used by `eval.evaluate` and the
toy reproductions of each paper.

    extract("tl red circle, ... Answer: (B)", "letter")   -> "B"
    extract("<think>maybe A</think>\\n\\n**E.** blue", "letter", "ABCDE") -> "E"
    is_correct("... Answer: three", "3", "count")          -> True
    is_correct("1986", ["1986", "1986."], "all")           -> True   (any acceptable gold)
    bootstrap_ci([1, 0, 1, 1])                             -> (lo, hi)   95% percentile CI
    paired_bootstrap(correct_a, correct_b)                 -> {"diff", "ci_low", "ci_high", "n"}

Answer types (`common.data.ANSWER_TYPE` maps each shapes family to one):
    letter  option letter (A.. the record's last option)  "B", "(B)", "E. cat", "**Answer:** B"
    yesno   "yes" / "no"             first standalone yes/no word of the answer
    number  canonical digits         first number, digits or a word ("three" -> "3")
    word    normalised short text    lower case, punctuation and articles removed
    text    same as word (free-form answers; ANLS is the softer metric for those)

The conventions (what is read, in what order, what counts as a yes) are stated in the
README, "Data formats and scoring", and in `short_answer` / `extract`; each rule is a row of
tests/test_extraction.py.
"""
import json
import re
import string

import numpy as np

from common.data import ANSWER_TYPE, ANSWER_TYPES
# VQAv2's answer processor maps "none" and zero..ten to digits; we continue to twenty.
NUMBER_WORDS = {"none": "0", **{w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}}
# a number (MMMU's extract_numbers: "1,000" with thousands commas, 2.5, -3; digits glued to letters,
# like the shapes marks "1tl" or "3rd", are not numbers) or a number word
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w])|\b(?:"
                     + "|".join(NUMBER_WORDS) + r")\b")
_PUNCT = re.compile("[" + re.escape(string.punctuation) + "]")
LETTERS = "ABCD"  # option letters assumed when neither the options nor a letter gold says more


# ----------------------------------------------------------------------------- extraction

_WRAP = " \t\r\n*_`\"'\u201c\u201d\u2018\u2019$#>"  # markdown bold/italic/code/heading/quote, quotes, $
# "Answer", "answer is", "Answer:", "**Answer:**", "Final answer:", "The correct answer is" ...
_MARKER = re.compile(r"\banswer\b(?:[\s*_]*(?:is\b|[:\uff1a]))?", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def strip_reasoning(text):
    """The visible answer of an output, reasoning blocks removed.

    lmms-eval (`--reasoning_tags`, default `<think>...</think>`) removes every complete
    `<think>...</think>` block before scoring; we do the same. When only a closing
    `</think>` is left (thinking chat templates put the opening tag in the prompt:
    Qwen3-VL-Thinking, DeepSeek-R1) the text after the last one is the answer. An opening
    `<think>` that is never closed means generation stopped inside the reasoning: the
    output has no answer and "" is returned (raise the generation budget)."""
    t = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL)
    if "</think>" in t:
        t = t.rsplit("</think>", 1)[1]
    if "<think>" in t:
        t = t.split("<think>", 1)[0]
    return t.strip()


def _unwrap(s):
    """`s` without the wrappers around a short answer: whitespace, markdown (** __ ` # >),
    quotes, $, a leading ':' / '=' / '- ', trailing '.,;!}'. '**D**' -> 'D', ': "Yes".' -> 'Yes'."""
    prev = None
    while s != prev:
        prev = s
        s = re.sub(r"^[-\u2013\u2014]\s+", "", s.strip(_WRAP).lstrip(":\uff1a=")).rstrip(".,;!}")
    return s


def _first_line(s):
    """The first line of `s` that is not empty once unwrapped ("" if none)."""
    for line in s.splitlines():
        line = _unwrap(line)
        if line:
            return line
    return ""


def _json_answer(t):
    """The "Answer"/"answer" value of a JSON object output (optionally in a ``` fence), else None."""
    if t.startswith("```"):
        t = t.strip("`").removeprefix("json").strip()
    if not t.startswith("{"):
        return None
    try:
        obj = json.loads(t)
    except json.JSONDecodeError:
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k.lower() == "answer":
                return str(v)
    return None


def short_answer(text):
    """The answer part of a generated turn, unwrapped (see `_unwrap`). In this order:

      1. reasoning blocks are removed (`strip_reasoning`);
      2. a JSON object with an "Answer"/"answer" key (the MoD debate format
         '{"Reasoning": ..., "Answer": ...}', optionally in a ``` fence) gives that value;
      3. else the last `\\boxed{...}` (the reasoning-model convention);
      4. else the first non-empty line after the last answer marker ("Answer", "Answer:",
         "**Answer:**", "the answer is", case-insensitive) that has one:
         'Answer: **D**' -> 'D', 'Answer:\\nB' -> 'B';
      5. else the first non-empty line: '\\nYes' -> 'Yes'.
    Quotes are never a cut: 'I would say "Yes".' -> 'I would say "Yes'. A truncated JSON
    object ('{"Reasoning": "..", "Answer": "yes"') falls to rule 4 -> 'yes'."""
    t = strip_reasoning(text)
    value = _json_answer(t)
    if value is not None:
        return _unwrap(value)
    boxed = _BOXED.findall(t)
    if boxed:
        return _unwrap(boxed[-1])
    for m in reversed(list(_MARKER.finditer(t))):
        span = _first_line(t[m.end():])
        if span:
            return span
    return _first_line(t)


def normalize(text):
    """VQAv2 / SQuAD-style normalisation: lower case, punctuation -> space, articles (a/an/the)
    dropped, number words to digits (`NUMBER_WORDS`, as VQAv2's answer processor does),
    whitespace collapsed. 'The Red circle.' -> 'red circle', 'Two dogs' -> '2 dogs'."""
    words = _PUNCT.sub(" ", text.lower()).split()
    return " ".join(NUMBER_WORDS.get(w, w) for w in words if w not in ("a", "an", "the"))


def option_pairs(options):
    """[(letter, text), ...] from a record's options: (letter, text) pairs as the readers give
    them, or plain texts (lettered A, B, ...); [] for None."""
    if not options:
        return []
    return [tuple(o) if isinstance(o, (list, tuple)) else (chr(ord("A") + i), str(o)) for i, o in enumerate(options)]


def gold_list(gold):
    """Acceptable gold answers as a list of strings: a list/tuple (DocVQA / VQAv2 style,
    '["1986", "1986."]') element-wise, any other value as one string."""
    return [str(g) for g in gold] if isinstance(gold, (list, tuple)) else [str(gold)]


def option_letters(options=None, golds=()):
    """The option letters a record can be answered with: its options' letters when known,
    else A..D widened to the latest single-letter gold ("E" -> "ABCDE"), so a 5-option
    record is scored right even by a caller that does not pass its options."""
    pairs = option_pairs(options)
    if pairs:
        return "".join(L for L, _ in pairs)
    last = max([LETTERS[-1]] + [m.group(1) for g in golds if (m := re.fullmatch(r"\(?([A-Z])\)?\.?", g.strip()))])
    return string.ascii_uppercase[:ord(last) - ord("A") + 1]


def _lone_word(toks, i):
    """True if toks[i] ("A" or "I") is the English word: followed by a lower-case word."""
    return toks[i] in ("A", "I") and i + 1 < len(toks) and toks[i + 1][:1].islower()


def _letter_at_start(s, letters, pairs):
    """Rules 1-3 of `extract`'s letter reading on an answer span, or None."""
    L = f"[{letters}]"
    m = re.fullmatch(rf"[(\[]?({L}|[{letters.lower()}])[)\]]?", s)        # "B", "(B)", "b"
    if m:
        return m.group(1).upper()
    m = re.match(rf"[(\[]?({L})(?:[.):\],]|$)", s)                         # "E. blue square", "(B) cat", "C)"
    if m:
        return m.group(1)
    m = re.match(rf"({L})\s+(\S+)", s)                                      # "B cat", "C is right"
    if m and not _lone_word([m.group(1), m.group(2)], 0):
        return m.group(1)
    if m:  # "A red circle": the article, unless it is option A's own text
        text = dict(pairs).get(m.group(1))
        if text and s[1:].strip().lower().startswith(text.strip().lower()):
            return m.group(1)
    return None


def _letter_anywhere(s, letters, pairs):
    """Rules 4-7 of `extract`'s letter reading on any text, or None."""
    L = f"[{letters}]"
    found = re.findall(rf"\(({L})\)", s)                                     # "(C)", the last one
    if found:
        return found[-1]
    found = re.findall(rf"(?i:answer|option|choice)(?:\s+is)?[\s:*]*[(\[]?({L})(?![A-Za-z])", s)
    if found:
        return found[-1]                                                     # "option C", "answer is D"
    low = s.lower()
    hits = [Lt for Lt, text in pairs if text.strip() and text.strip().lower() in low]
    if len(hits) == 1:                                                       # one option's text
        return hits[0]
    toks = re.sub(r"[.()\[\],:;!*#{}]", " ", s).split()
    cands = {t for i, t in enumerate(toks) if len(t) == 1 and t in letters and not _lone_word(toks, i)}
    return cands.pop() if len(cands) == 1 else None                          # one standalone letter


def extract(text, answer_type, letters=None, options=None):
    """Normalised short answer of `answer_type` from a model output (or a gold answer).

    Reads `short_answer(text)` (the answer span) first; letter / yesno / number fall back
    to the whole output with reasoning blocks removed when the span has none.
      letter  (`letters`: the allowed capitals, default `option_letters(options)`, A-D when
              unknown; `options`: [(letter, text)] or texts, for rules 3 and 6), the rules
              of MMMU's parse_multi_choice_response and VLMEvalKit's can_infer_option /
              can_infer_text, in this order:
              span: 1. the whole span is a letter: "B", "(B)", a lone lower-case "b";
                    2. it starts with a letter and '.', ')', ':', ']' or ',': "E. blue square";
                    3. it starts with a letter and a word: "B cat" (not "A"/"I" before a
                       lower-case word: the article / pronoun, "A red circle", "I think");
              span, then whole output:
                    4. the last "(B)"; 5. the last "answer/option/choice (is) B";
                    6. exactly one option's text appears -> its letter;
                    7. exactly one standalone allowed letter among the words (after
                       replacing .()[],:;!*#{} by spaces, as VLMEvalKit does).
      yesno   the first standalone "yes" / "no" (any case) in the span; else, in the
              whole output, VLMEvalKit's YOrN_Extraction rule: "yes" if the words contain
              "yes" and not "no", "no" if "no" and not "yes". Nothing else counts
              ("not", "true", "correct" are not answers) -> "yes" / "no".
      number  the first number in the span, else the last in the whole output: digits
              ("3", "1,000" -> "1000", "2.0" -> "2", "-4", "0.5") or a word zero..twenty /
              "none" (`NUMBER_WORDS`) -> canonical digits.
      word / text: `normalize(span)`.
    When nothing of the type is found the normalised span is returned, so a wrong-format
    answer simply does not match. Raises ValueError on an unknown answer_type."""
    if answer_type not in ANSWER_TYPES:
        raise ValueError(f"unknown answer_type {answer_type!r}; choose one of {ANSWER_TYPES}")
    span = short_answer(text)
    if answer_type == "letter":
        pairs = option_pairs(options)
        letters = letters or option_letters(pairs)
        got = (_letter_at_start(span, letters, pairs) or _letter_anywhere(span, letters, pairs)
               or _letter_anywhere(strip_reasoning(text), letters, pairs))
        return got or normalize(span)
    if answer_type == "yesno":
        m = re.search(r"\b(yes|no)\b", span.lower())
        if m:
            return m.group(1)
        words = set(_PUNCT.sub(" ", strip_reasoning(text).lower()).split())
        if ("yes" in words) != ("no" in words):
            return "yes" if "yes" in words else "no"
        return normalize(span)
    if answer_type == "number":
        found = _NUMBER.findall(span.lower()) or _NUMBER.findall(strip_reasoning(text).lower())[-1:]
        if not found:
            return normalize(span)
        s = found[0]
        if s in NUMBER_WORDS:
            return NUMBER_WORDS[s]
        x = float(s.replace(",", ""))
        return str(int(x)) if x == int(x) else str(x)
    return normalize(span)


def answer_type_of(family):
    """Answer type of a family (`common.data.ANSWER_TYPE`); "text" for unknown families."""
    return ANSWER_TYPE.get(family, "text")


def record_answer_type(record):
    """Answer type of a record: its own "answer_type" (benchmark records from `eval.convert`),
    else its family's (`answer_type_of`)."""
    return record.get("answer_type") or answer_type_of(record["family"])


def is_correct(pred_text, gold, family, options=None, answer_type=None):
    """True if the extracted answer of `pred_text` equals the extracted answer of any gold.

    gold: one answer or a list of acceptable answers (`gold_list`). Both sides are read with
    the family's answer type (unknown family -> normalised exact match); letters range over
    the record's options when given, else A..D widened to a letter gold (`option_letters`).
    answer_type, when given, overrides the family's (a benchmark record's own type)."""
    t = answer_type or answer_type_of(family)
    golds = gold_list(gold)
    letters = option_letters(options, golds) if t == "letter" else None
    pred = extract(pred_text, t, letters, options)
    return any(pred == extract(g, t, letters, options) for g in golds)


# ----------------------------------------------------------------------------- metrics

def accuracy(correct):
    """Mean of a 0/1 (or bool) sequence; 0.0 for an empty one."""
    return float(np.mean(np.asarray(correct, dtype=np.float64))) if len(correct) else 0.0


def pope_prf(preds, golds):
    """POPE metrics with "yes" as the positive class.

    preds, golds: sequences of extracted answers ("yes"/"no"). A prediction other than
    "yes" counts as a negative (unlike the official POPE script, which maps any answer
    without "no"/"not" to yes; we extract first, see `extract(.., "yesno")`).
        precision = TP / (TP + FP)   recall = TP / (TP + FN)   F1 = 2PR / (P + R)
        yes_ratio = share of "yes" predictions (POPE reports it to expose yes-bias)
    Returns dict(precision, recall, f1, accuracy, yes_ratio, n); 0.0 where a denominator is 0.
    Raises ValueError on length mismatch."""
    if len(preds) != len(golds):
        raise ValueError(f"pope_prf: {len(preds)} predictions vs {len(golds)} gold answers")
    p = np.array([x == "yes" for x in preds])
    g = np.array([x == "yes" for x in golds])
    tp, fp, fn = int((p & g).sum()), int((p & ~g).sum()), int((~p & g).sum())
    prec = tp / (tp + fp) if tp + fp else 0.0
    rec = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    acc = float((p == g).mean()) if len(p) else 0.0
    return {"precision": prec, "recall": rec, "f1": f1, "accuracy": acc,
            "yes_ratio": float(p.mean()) if len(p) else 0.0, "n": len(p)}


def levenshtein(a, b):
    """Edit distance (insert / delete / substitute, each cost 1) between two strings."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def anls_score(pred, golds, threshold=0.5):
    """ANLS of one answer (ST-VQA, Biten et al. 2019; DocVQA):
        NL(g, p) = levenshtein(g, p) / max(|g|, |p|)     (strings lower-cased, spaces collapsed)
        s = max over gold answers g of (1 - NL if NL < threshold else 0)
    golds: a string or a list of acceptable answers. threshold 0.5 is the standard tau."""
    golds = [golds] if isinstance(golds, str) else list(golds)
    p = " ".join(pred.lower().split())
    best = 0.0
    for g in golds:
        g = " ".join(str(g).lower().split())
        nl = levenshtein(g, p) / max(len(g), len(p)) if (g or p) else 0.0
        best = max(best, 1.0 - nl if nl < threshold else 0.0)
    return best


def anls(preds, golds, threshold=0.5):
    """Mean `anls_score` over items; golds[i] is a string or a list of strings."""
    if len(preds) != len(golds):
        raise ValueError(f"anls: {len(preds)} predictions vs {len(golds)} gold answers")
    return float(np.mean([anls_score(p, g, threshold) for p, g in zip(preds, golds)])) if preds else 0.0


# ----------------------------------------------------------------------------- bootstrap

def _resampled_means(x, n_resamples, seed, chunk_elems=4_000_000):
    """Means of `n_resamples` bootstrap resamples (rows drawn with replacement) of x [n].
    Vectorised in chunks of resamples so memory stays ~chunk_elems indices. -> [n_resamples]."""
    n = len(x)
    rng = np.random.default_rng(seed)
    per = max(1, chunk_elems // max(n, 1))
    out = []
    for start in range(0, n_resamples, per):
        idx = rng.integers(0, n, size=(min(per, n_resamples - start), n))  # [b, n]
        out.append(x[idx].mean(axis=1))
    return np.concatenate(out)


def bootstrap_ci(correct, n_resamples=10_000, seed=0, level=0.95):
    """Percentile bootstrap CI of the mean of `correct` (0/1 per item).

    Draws n_resamples resamples of size n with replacement (numpy, seeded), takes each
    resample's mean, returns the (1-level)/2 and (1+level)/2 percentiles as (lo, hi).
    An empty input gives (0.0, 0.0)."""
    x = np.asarray(correct, dtype=np.float64)
    if not len(x):
        return 0.0, 0.0
    m = _resampled_means(x, n_resamples, seed)
    a = (1 - level) / 2 * 100
    return float(np.percentile(m, a)), float(np.percentile(m, 100 - a))


def paired_bootstrap(correct_a, correct_b, n_resamples=10_000, seed=0, level=0.95):
    """Paired bootstrap of the accuracy difference of system A over system B on the same items.

    d_i = a_i - b_i; the same resampled item indices are used for both systems (that is the
    pairing), so the CI is the percentile CI of mean(d) over resamples. A CI that excludes 0
    means the difference is significant at 1 - level.
    Returns dict(diff = mean(a) - mean(b), ci_low, ci_high, n). Raises ValueError on a
    length mismatch."""
    a = np.asarray(correct_a, dtype=np.float64)
    b = np.asarray(correct_b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired_bootstrap: {a.shape} vs {b.shape}; both systems must score the same items")
    d = a - b
    lo, hi = bootstrap_ci(d, n_resamples, seed, level)
    return {"diff": float(d.mean()) if len(d) else 0.0, "ci_low": lo, "ci_high": hi, "n": len(d)}


# ----------------------------------------------------------------------------- per-family tables

def by_family(results, key="correct"):
    """{family: [result[key], ...]} in first-seen order, plus "all" (every result) last."""
    out = {}
    for r in results:
        out.setdefault(r["family"], []).append(r[key])
    out["all"] = [r[key] for r in results]
    return out


def format_table(rows, metric="accuracy"):
    """Markdown table of report rows ({"model","family","metric","value","ci_low","ci_high","n"}):
    one line per family, one column per model, "value [ci_low, ci_high]" cells."""
    rows = [r for r in rows if r["metric"] == metric]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fams = list(dict.fromkeys(r["family"] for r in rows))
    fams = [f for f in fams if f != "all"] + (["all"] if "all" in fams else [])
    cell = {(r["model"], r["family"]): r for r in rows}
    lines = ["| family | n | " + " | ".join(models) + " |", "|---|---:|" + "---:|" * len(models)]
    for f in fams:
        n = next(cell[m, f]["n"] for m in models if (m, f) in cell)
        vals = []
        for m in models:
            r = cell.get((m, f))
            vals.append("" if r is None else f"{r['value']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]")
        lines.append(f"| {f} | {n} | " + " | ".join(vals) + " |")
    return "\n".join(lines)
