"""Answer extraction: what a model's reply says, read the same way by every method and scorer.

Pure functions over strings; no model code. Methods score their own outputs with `is_correct`
(MoD's viewpoint-shift data, `mole.infer`, `rolemerge.infer`) and `eval.metrics` re-exports
these for the evaluation library, so a prediction is read the same way everywhere.

    final_answer('... Answer: yes')                       -> 'yes'
    extract("tl red circle, ... Answer: (B)", "letter")   -> "B"
    extract("<think>maybe A</think>\\n\\n**E.** blue", "letter", "ABCDE") -> "E"
    is_correct("... Answer: three", "3", "count")          -> True
    is_correct("1986", ["1986", "1986."], "unlabelled")    -> True   (any acceptable gold)

Answer types (`ANSWER_TYPE` maps each shapes family to one):
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

ANSWER_TYPE = {"existence": "yesno", "count": "number", "colour": "word", "spatial": "yesno", "mc": "letter"}
ANSWER_TYPES = ("letter", "yesno", "number", "word", "text")
UNLABELLED = "unlabelled"  # the family of a record that names none ("all" is the aggregate row of every table)


def final_answer(text):
    """Short answer of a turn: the JSON "Answer" value of a `{"Reasoning", "Answer"}` reply;
    else the rest of the line after the last "Answer" marker (stripped of the marker's colon /
    JSON quotes and trailing punctuation); else the whole text, stripped of surrounding white
    space only, so a free-form LLaVA answer such as `The sign says "STOP".` stays whole (it is
    the gold of a record without an "answer" field; `eval.metrics` normalises it when scoring).

        final_answer('... Answer: yes')                  -> 'yes'
        final_answer('{"Reasoning": "x", "Answer": "B"}') -> 'B'
        final_answer('The sign says "STOP".')            -> 'The sign says "STOP".'
    """
    t = text.strip()
    if t.startswith("{"):
        try:
            obj = json.loads(t)
            if isinstance(obj, dict) and "Answer" in obj:
                return str(obj["Answer"]).strip()
        except json.JSONDecodeError:
            pass
    if "Answer" not in t:
        return t
    t = t.rsplit("Answer", 1)[-1]
    return t.lstrip("\":' ").split("\"")[0].split("\n")[0].strip().rstrip(".}\"' ")

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
    """Answer type of a family (`ANSWER_TYPE`); "text" for unknown families."""
    return ANSWER_TYPE.get(family, "text")


def record_answer_type(record):
    """Answer type of a record, the one rule every scorer follows (generation, option
    log-likelihood, benchmark scores; README "Records" in eval/), first match wins:
    1. its own "answer_type" (benchmark records from `eval.convert`);
    2. its family's type when the family is a known one (`ANSWER_TYPE`);
    3. "letter" (multiple choice) when it has "options" (canonical JSONL);
    4. "text" (an unknown or unlabelled family without options).
    So {"options": [...]} without a family is multiple choice both when generated and when
    scored by log-likelihood (`is_multiple_choice`)."""
    if record.get("answer_type"):
        return record["answer_type"]
    if record.get("family") in ANSWER_TYPE:
        return ANSWER_TYPE[record["family"]]
    return "letter" if record.get("options") else "text"


def is_multiple_choice(record):
    """True if `record` is scored as multiple choice (`record_answer_type` is "letter") and
    has options to score (`options_of`): the records `eval.evaluate --loglik` scores."""
    return record_answer_type(record) == "letter" and bool(options_of(record))


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


_LISTED = re.compile(r"(?:^|\s)([A-Z])\. (.+?)(?=\s+[A-Z]\. |\s+Answer with|$)")


def parse_options(question):
    """Lettered options listed in a question, "... A. red circle B. blue square ..." ->
    [("A", "red circle"), ("B", "blue square"), ...] (letters must run A, B, C, ...);
    [] if fewer than two are found."""
    found = _LISTED.findall(question)
    letters = [L for L, _ in found]
    if len(found) < 2 or letters != [chr(ord("A") + i) for i in range(len(found))]:
        return []
    return [(L, t.strip()) for L, t in found]


def options_of(record):
    """[(letter, text), ...] of a multiple-choice record: its "options" field (canonical
    JSONL), else the lettered options listed in a letter-type family's question; [] if none."""
    if record.get("options"):
        return list(record["options"])
    return parse_options(record["question"]) if record_answer_type(record) == "letter" else []


def is_correct_for(record, text):
    """Whether `text` answers `record` correctly by the one rule of `score`: the record's own
    options and answer type (`record_answer_type`), as `eval.evaluate` and `eval.scores` read
    it. Every entry point that scores a reply to a record calls this (or `score`)."""
    return score(record, text)["correct"]


def score(record, text):
    """How a reply to `record` is read and scored, the same in every entry point:
    {"answer_type", "extracted" (the answer read from `text`), "correct" (bool)}. The record's
    own option letters are used for multiple choice (`options_of`: A..E for five options)."""
    opts, typ = options_of(record), record_answer_type(record)
    letters = option_letters(opts, gold_list(record["answer"])) if typ == "letter" else None
    return {"answer_type": typ, "extracted": extract(text, typ, letters, opts),
            "correct": is_correct(text, record["answer"], record["family"], opts, typ)}
