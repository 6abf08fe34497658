"""The readers every entry point uses, and atomic writes.

Records come as LLaVA-style conversation JSON / JSONL (`{"id","image","conversations":[...]}`,
the format real instruction data and the shapes world use) or canonical benchmark JSONL
(`{"id","image"?,"question","answer","family"?,"options"?}`); `read_any` reads either and
returns one record shape. Every image is decoded once at read time (`check_record_images`:
a truncated file fails before any model loads, every bad record named at once) and again,
to RGB, by `load_image` when a batch needs it.
Errors are `DataError` with the record id and what to change. The atomic writes
(`atomic_target`, `atomic_write_text`) live in `common/files.py` and are importable from here.
"""
import json
import os
import re
import sys
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image, ImageOps
from tqdm import tqdm

from common.answers import ANSWER_TYPES, UNLABELLED, final_answer, parse_options  # noqa: F401  (common.data.parse_options)
from common.files import atomic_target, atomic_write_text, follow_umask, name_path  # noqa: F401  (common.data.*)


class DataError(ValueError):
    """A record or image in a dataset file is unusable; the message names the record."""


def load_records(path):
    """A data file's records: a JSON list (text starting with "[") or JSONL (one JSON value
    per non-empty line). Raises DataError for a missing file, a directory, a file that is not
    UTF-8 text, and invalid JSON, naming the line (JSONL: the file's line number). A UTF-8
    byte-order mark (as some Windows editors write) is skipped."""
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found; check the path (the toy shapes data, if that is what you want, "
                        f"is made by `python -m common.shapes --out DIR`)")
    if os.path.isdir(path):
        have = [f for f in ("train.json", "train.jsonl", "val.json", "test.json")
                if os.path.isfile(os.path.join(path, f))]
        raise DataError(f"{path} is a directory; pass the JSON/JSONL file (e.g. "
                        f"{os.path.join(path, have[0] if have else 'train.json')})")
    if path.lower().endswith((".csv", ".tsv", ".parquet", ".xlsx")):
        raise DataError(f"{path}: a {path.rsplit('.', 1)[1].upper()} file; records are read from a JSON list or JSONL "
                        f"(`python -m eval.convert` turns public benchmark files into canonical JSONL)")
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a UTF-8 text file; expected a JSON list or JSONL of records") from None
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                            f"expected a list of records") from None
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {i} is not valid JSON ({e.msg}, column {e.colno}); a JSONL file "
                                f"holds one record per line, a JSON file a list [{{...}}, ...]") from None
    return out


# ----------------------------------------------------------------------------- records
#
# Every reader returns the same record dicts (README, "Records"):
#   id        str
#   images    list of absolute image paths, in order ([] for a text-only record)
#   image     images[0], or None for a text-only record
#   question  the last human turn (single-image records: "<image>" placeholders removed;
#             multi-image records keep one "<image>" per image, in order)
#   target    the last gpt turn (the training target)
#   answer    the gold answer of the last turn (the record's "answer" field, else
#             `final_answer(target)`); a list of acceptable answers stays a list
#   history   earlier (question, target) pairs of a multi-turn conversation, [] otherwise
#   family    the record's "family", default "unlabelled" (`_family`; "all" names the aggregate row)
#   conversations  the human / gpt turns (user / assistant renamed to them, system turns left out)
#   options   [(letter, text), ...] for canonical multiple-choice records only
# Relative image paths resolve against `image_root` when given (--image-root), else the data
# file's folder; absolute paths are used as they are.

IMAGE_ROOT_HELP = ("folder that relative image paths in --data are resolved against (default: the data file's "
                   "folder); absolute paths are used as they are")


def _image_paths(value, root, path, rid):
    """The absolute image paths of a record's "image" field: None / "" -> [], a path -> [it],
    a list of paths -> them in order. Raises DataError naming the record for other types; the
    files themselves are checked by `check_record_images`, every record at once."""
    if value in (None, "", []):
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) and v for v in items):
        raise DataError(f"{path}: record {rid}: 'image' must be a file path or a list of file paths (text), got "
                        f"{type(value).__name__} {value!r:.40}")
    return [v if os.path.isabs(v) else os.path.join(root, v) for v in items]


def _strip_image(text, n_images):
    """A human turn without its "<image>" placeholders (kept when the record has several images)."""
    return text.strip() if n_images > 1 else text.replace("<image>\n", "").replace("<image>", "").strip()


# The reader contract (README "Records", "One reader contract"): every reader reads both role
# vocabularies, refuses duplicate ids (item ids of multi-turn records included), refuses a gold
# answer that is not text, and says on stderr what it changed, with a count.
ROLES = {"human": "human", "user": "human", "gpt": "gpt", "assistant": "gpt"}   # LLaVA / ShareGPT names
DROPPED_ROLES = ("system",)   # left out with a note: the checkpoint's own chat template sets the system turn


def item_ids(r):
    """The ids a record answers under: its own and, for a multi-turn record with n pairs, the
    evaluation items `rid#1` .. `rid#n` (`expand_turns`)."""
    n = len(r.get("history") or [])
    return [r["id"]] + ([f"{r['id']}#{k}" for k in range(1, n + 2)] if n else [])


def check_unique_ids(records, path):
    """Raise DataError naming both records when two records share an id, or when a record's id
    equals an item id `rid#k` of a multi-turn record (`item_ids`): results, resumes and
    `mod.infer --methods misled`'s priors are keyed by id, so one record would take another's."""
    seen = {}
    for r in records:
        for i in item_ids(r):
            if i in seen:
                what = "duplicate id" if i == r["id"] and i == seen[i] else f"item id {i!r} is taken twice"
                raise DataError(f"{path}: record {r['id']}: {what} (also record {seen[i]}; multi-turn records "
                                f"answer as 'id#1', 'id#2', ...); give every record its own id")
            seen[i] = r["id"]
    return records


def note_changes(path, counts):
    """Print one `note:` line on stderr per change a reader made to the records of `path`
    (counts: {what: how many}, zero counts skipped)."""
    for what, n in counts.items():
        if n:
            print(f"note: {path}: {n} {what}", file=sys.stderr)


def _placeholder_notes(counts, text, n_images):
    """Count the "<image>" placeholders `_strip_image` removes beyond one per image."""
    n = text.count("<image>")
    if n_images == 0 and n:
        counts["text-only record(s) with '<image>' placeholders: removed (there is no image to show)"] += 1
    elif n_images == 1 and n > 1:
        counts["record(s) with one image but several '<image>' placeholders: all removed, the image is shown "
               "once before the question"] += 1


def read_llava_json(path, image_root=None, check_images=True, skip_bad=False):
    """Read LLaVA-style conversation JSON (a list) or JSONL into record dicts (the keys above).

    `image` may be one path, a list of paths (one "<image>" placeholder per image in the human
    turns) or absent (a text-only record). Conversations alternate human / gpt turns (user /
    assistant are read as human / gpt; system turns are left out, with a note); every pair is
    kept (`history` holds all but the last). An optional "answer" beside the conversation is
    the gold answer (`gold_answers`'s rules), else the last gpt turn's `final_answer`.
    Raises DataError for a file without records and, naming the record, for malformed turns,
    an unknown role, a non-text gold answer, duplicate ids (`check_unique_ids`), a conversation that does not alternate human / gpt, a placeholder count that differs from
    the image count, and (check_images) every record whose image is missing or unusable, all
    in one message (`check_record_images`; skip_bad: those records are left out, with a note)."""
    records = load_records(path)
    if not records:
        raise DataError(f"{path}: no records (an empty file or list)")
    root = image_root or os.path.dirname(os.path.abspath(path))
    out, counts = [], Counter()
    for i, r in enumerate(records):
        rid = r.get("id", f"#{i}") if isinstance(r, dict) else f"#{i}"
        conv = r.get("conversations") if isinstance(r, dict) else None
        if not isinstance(conv, list) or not conv or not all(isinstance(t, dict) and "value" in t for t in conv):
            hint = ("; its turns are {'role','content'} (OpenAI chat format): rename each turn's 'role' / 'content' "
                    "to 'from' / 'value'" if isinstance(conv, list) and conv and all(
                        isinstance(t, dict) and "content" in t for t in conv) else "")
            raise DataError(f"{path}: record {rid} has no valid 'conversations' list of {{'from','value'}} turns{hint}")
        for k, t in enumerate(conv):
            if not isinstance(t["value"], str):
                raise DataError(f"{path}: record {rid}: turn {k} ('from': {t.get('from')!r}) has a 'value' of type "
                                f"{type(t['value']).__name__} ({t['value']!r:.40}); every turn's value must be text")
        unknown = [t.get("from") for t in conv if t.get("from") not in ROLES and t.get("from") not in DROPPED_ROLES]
        if unknown:
            raise DataError(f"{path}: record {rid}: turn role(s) {unknown} are not known; a turn's 'from' is "
                            f"human / gpt (LLaVA) or user / assistant (ShareGPT), or system (left out)")
        counts["'system' turn(s) left out (the model's chat template sets its own)"] += len(conv) - sum(
            t.get("from") in ROLES for t in conv)
        turns = [dict(t, **{"from": ROLES[t["from"]]}) for t in conv if t.get("from") in ROLES]
        roles = [t["from"] for t in turns]
        if "human" not in roles or "gpt" not in roles:
            raise DataError(f"{path}: record {rid} needs a 'human' (or 'user') turn and a 'gpt' (or 'assistant', the "
                            f"answer) turn")
        if roles != ["human", "gpt"] * (len(roles) // 2):
            raise DataError(f"{path}: record {rid}: turns go {roles}; a conversation alternates human, gpt, "
                            f"human, gpt, ... and ends with a gpt (answer) turn")
        images = _image_paths(r.get("image"), root, path, rid)
        n_ph = sum(t["value"].count("<image>") for t in turns if t["from"] == "human")
        if len(images) > 1 and n_ph != len(images):
            raise DataError(f"{path}: record {rid} has {len(images)} images but {n_ph} '<image>' placeholders in "
                            f"its human turns; put one placeholder per image, in order")
        if len(images) <= 1:
            _placeholder_notes(counts, "".join(t["value"] for t in turns if t["from"] == "human"), len(images))
        pairs = [(_strip_image(turns[k]["value"], len(images)), turns[k + 1]["value"]) for k in range(0, len(turns), 2)]
        q, target = pairs[-1]
        answer = final_answer(target)
        if "answer" in r:  # a gold answer given beside the conversation: the canonical rules (`gold_answers`)
            golds = gold_answers(path, rid, r["answer"])
            answer = golds if isinstance(r["answer"], list) else golds[0]
        out.append({"id": str(rid), "images": images, "image": images[0] if images else None, "question": q,
                    "target": target, "answer": answer,
                    "history": [list(p) for p in pairs[:-1]], "family": _family(r, path, rid),
                    "conversations": turns})
    check_unique_ids(out, path)
    note_changes(path, counts)
    return check_record_images(out, path, skip_bad) if check_images else out


def _family(r, path, rid):
    """A record's family: its "family" field, "unlabelled" (`UNLABELLED`) when it has none.
    Raises DataError for the family "all", the name of every report's aggregate row."""
    fam = r.get("family") or UNLABELLED
    if fam == "all":
        raise DataError(f"{path}: record {rid}: family 'all' is the name of the aggregate row of every report; "
                        f"give the family another name (records without a family are {UNLABELLED!r})")
    return fam


REQUIRED = ("id", "question", "answer")  # "image" is optional: a record without one is text-only


def gold_answers(path, rid, answer):
    """A record's gold answers as a list of non-empty strings: one answer (text or number) or
    a list of acceptable ones (DocVQA / VQAv2 style). Raises DataError for anything else (an
    object, a nested list, an empty string in the list)."""
    items = answer if isinstance(answer, list) else [answer]
    if any(isinstance(a, (dict, list, bool)) or a is None or not str(a).strip() for a in items):
        raise DataError(f"{path}: record {rid}: 'answer' must be a text (or number) or a list of acceptable "
                        f"texts, got {answer!r:.60} (write yes/no answers as text)")
    return [str(a).strip() for a in items]


BENCHMARK_FIELDS = ("benchmark", "category", "answer_type", "meta")


def _benchmark_fields(path, rid, r):
    """The optional fields `eval.convert` writes and `eval.scores` reads: "benchmark" (a name
    in `eval.scores.SCORERS`), "category" (subtask / split / subject), "answer_type" (one of
    ANSWER_TYPES; overrides the family's) and "meta" (an object of per-benchmark scoring
    fields, e.g. MME's image pair). Raises DataError for a wrong type."""
    out = {}
    for k in BENCHMARK_FIELDS:
        v = r.get(k)
        if v is None:
            continue
        if k == "meta" and not isinstance(v, dict) or k != "meta" and not isinstance(v, str):
            raise DataError(f"{path}: record {rid}: {k!r} must be {'an object' if k == 'meta' else 'a text'}, "
                            f"got {type(v).__name__}")
        if k == "answer_type" and v not in ANSWER_TYPES:
            raise DataError(f"{path}: record {rid}: answer_type {v!r} is not one of {', '.join(ANSWER_TYPES)}")
        out[k] = v
    return out


def read_jsonl(path, image_root=None, check_images=True, skip_bad=False):
    """Read a canonical benchmark JSONL -> record dicts (the keys above):
        {"id": "q1", "image": "images/q1.png", "question": "Is there a dog?", "answer": "yes",
         "family": "existence",                      # optional, default "unlabelled"
         "options": ["cat", "dog", "cow", "pig"]}    # optional, multiple choice
    "image" may be one path, a list of paths, or absent (a text-only record, ScienceQA / MMLU
    style). Multiple choice: options are lettered A, B, C, ...; if the question does not
    already list them, " A. cat B. dog ... Answer with the letter." is appended; a gold
    answer given as an option's text becomes its letter. Several acceptable answers
    ("answer": ["1986", "1986."]) stay a list: `eval.metrics.is_correct` accepts any of them and
    ANLS takes the best; training needs one target, so "target" is the first gold.
    Raises DataError naming the record for a non-object line, missing/empty required fields
    (id, question, answer), an 'answer' that is not a text / number / list of them (`gold_answers`),
    badly typed benchmark fields (`_benchmark_fields`: benchmark, category, answer_type, meta;
    a record with "benchmark" keeps its question verbatim, options included),
    an 'image' that is not a path or list of paths, duplicate ids (`check_unique_ids`),
    fewer than 2 options, an answer that is neither a letter nor an option's text, and
    (check_images) every record whose image file is missing, empty, unreadable, truncated or
    oversized, all in one message (`check_record_images`; skip_bad: left out, with a note)."""
    root = image_root or os.path.dirname(os.path.abspath(path))
    out, counts = [], Counter()
    for i, r in enumerate(load_records(path)):
        if not isinstance(r, dict):
            raise DataError(f"{path}: record #{i} is not a JSON object")
        rid = r.get("id", f"#{i}")
        missing = [k for k in REQUIRED if r.get(k) in (None, "") or r.get(k) == []]
        if missing:
            raise DataError(f"{path}: record {rid} lacks required field(s) {missing} "
                            f"(canonical JSONL needs {list(REQUIRED)}; 'image' is optional)")
        rid = str(rid)
        images = _image_paths(r.get("image"), root, path, rid)
        if len(images) <= 1:
            _placeholder_notes(counts, str(r["question"]), len(images))
        q, golds = _strip_image(str(r["question"]), len(images)), gold_answers(path, rid, r["answer"])
        keep = (lambda g: g) if isinstance(r["answer"], list) else (lambda g: g[0])  # a list stays a list
        rec = {"id": rid, "images": images, "image": images[0] if images else None, "question": q,
               "target": golds[0], "answer": keep(golds), "history": [], "family": _family(r, path, rid)}
        rec.update(_benchmark_fields(path, rid, r))
        if r.get("options") is not None:
            opts = r["options"]
            if not isinstance(opts, list) or len(opts) < 2 or len(opts) > 26:
                raise DataError(f"{path}: record {rid}: 'options' must be a list of 2-26 strings")
            opts = [(chr(ord("A") + j), str(t)) for j, t in enumerate(opts)]
            if not parse_options(q) and "benchmark" not in rec:  # a benchmark's own prompt is kept as written
                q = f"{q} {' '.join(f'{L}. {t}' for L, t in opts)} Answer with the letter."
            letters = [L for L, _ in opts]
            by_text = {t.strip().lower(): L for L, t in opts}
            for a in golds:
                if a not in letters and a.lower() not in by_text:
                    raise DataError(f"{path}: record {rid}: answer {a!r} is neither an option letter "
                                    f"{letters} nor an option's text")
            golds = [a if a in letters else by_text[a.lower()] for a in golds]
            rec.update(question=q, target=golds[0], answer=keep(golds), options=opts)
        head = "<image>\n" if len(images) == 1 else ""
        rec["conversations"] = [{"from": "human", "value": head + rec["question"]},
                                {"from": "gpt", "value": rec["target"]}]
        out.append(rec)
    check_unique_ids(out, path)
    note_changes(path, counts)
    return check_record_images(out, path, skip_bad) if check_images else out


def read_any(path, image_root=None, check_images=True, skip_bad=False, limit=0):
    """Read a data file of either format, decided by content: records with "conversations"
    -> `read_llava_json`, records with "question" -> `read_jsonl`. check_images: decode every
    image now (`check_record_images`), before any model loads; skip_bad: leave out the
    records whose image is unusable (a note on stderr says how many) instead of stopping;
    limit: the first N records only (0 = all), cut before any image is decoded.
    Raises DataError for an empty file or records of neither kind."""
    records = load_records(path)
    if not records:
        raise DataError(f"{path}: no records")
    first = records[0]
    if isinstance(first, dict) and "conversations" in first:
        out = read_llava_json(path, image_root=image_root, check_images=False)
    elif isinstance(first, dict) and "question" in first:
        out = read_jsonl(path, image_root=image_root, check_images=False)
    else:
        hint = (" ('messages' is the OpenAI chat format: rename it 'conversations' and each turn's 'role' / "
                "'content' to 'from' / 'value')" if isinstance(first, dict) and "messages" in first else "")
        raise DataError(f"{path}: first record has neither 'conversations' (LLaVA JSON) nor 'question' "
                        f"(canonical JSONL){hint}; keys: {sorted(first) if isinstance(first, dict) else type(first).__name__}")
    out = out[:limit or None]   # before any image is decoded: a first look at a large file is quick
    return check_record_images(out, path, skip_bad) if check_images else out


def read_records(path, image_root=None, skip_bad=False, limit=0):
    """Records of a LLaVA JSON/JSONL or canonical JSONL file (`read_any`, every kept image decoded
    now; skip_bad: records with an unusable image left out, with a note; limit: the first N
    records only, 0 = all). Raises DataError."""
    return read_any(path, image_root=image_root, skip_bad=skip_bad, limit=limit)


SKIP_BAD_HELP = ("leave out the records whose image is missing or unusable (empty, truncated, corrupt, too large) "
                 "and say how many, instead of stopping with the list of them")


def expand_turns(records):
    """One evaluation item per (question, answer) pair: a multi-turn record `rid` with n pairs
    becomes items `rid#1` .. `rid#n`, item k asking question k with the k-1 earlier pairs (gold
    answers) as its `history`; single-turn records are returned unchanged."""
    out = []
    for r in records:
        if not r.get("history"):
            out.append(r)
            continue
        pairs = r["history"] + [[r["question"], r["target"]]]
        for k, (q, t) in enumerate(pairs, 1):
            last = k == len(pairs)
            out.append({**r, "id": f"{r['id']}#{k}", "question": q, "target": t, "history": pairs[:k - 1],
                        "answer": r["answer"] if last else final_answer(t)})
    return out


def check_support(records, entry, text_only=False, multi_image=False, multi_turn=False):
    """Refuse, before any model loads, the records `entry` (e.g. "mole.infer") cannot handle,
    with one message per kind shared by every entry point (README, "Records"):
    a text-only record unless `text_only`, several images unless `multi_image`, several
    question / answer turns unless `multi_turn`. Every kind found is named in the one
    DataError (up to three records each), so one fix of the data file is enough; a record
    of two kinds is named under both.
        mod.infer: 1 record(s) with several images, e.g. ['r1']: ...
          and 1 record(s) with several question/answer turns, e.g. ['r1']: ... (README, 'Records')"""
    kinds = []
    if not text_only:
        kinds.append((lambda r: not r["images"], "no image (a text-only record)",
                      "it needs one image per record; evaluate text-only records with eval.evaluate"))
    if not multi_image:
        kinds.append((lambda r: len(r["images"]) > 1, "several images",
                      "it takes one image per record; split such records into one record per image when each "
                      "question is about one of the images; a question about several images together cannot be "
                      "split: train and answer it with mole.train / mole.infer, which read every image of a record"))
    if not multi_turn:
        kinds.append((lambda r: bool(r.get("history")), "several question/answer turns",
                      "it takes single-turn records; split each conversation into one record per turn (write an "
                      "earlier turn a later question refers to into that question); eval.evaluate and "
                      "rolemerge.infer take the turns as they are"))
    found = []
    for bad_if, what, fix in kinds:
        bad = [r["id"] for r in records if bad_if(r)]
        if bad:
            found.append(f"{len(bad)} record(s) with {what}, e.g. {bad[:3]}: {fix}")
    if found:
        raise DataError(f"{entry}: " + "\n  and ".join(found) + " (README, 'Records')")


def check_training_records(records, path):
    """What training needs per record: a non-empty answer (an empty gpt turn would train only
    the end token). Raises DataError naming up to three bad records."""
    bad = [r["id"] for r in records if not str(r["target"]).strip()]
    bad += [f"{r['id']} (turn {k + 1})" for r in records for k, (_, t) in enumerate(r.get("history", []))
            if not str(t).strip()]
    if bad:
        raise DataError(f"{path}: {len(bad)} record(s) with an empty answer (gpt turn), e.g. {bad[:3]}; "
                        f"fix or drop them")


# Pixel bound of every image read: PIL's decompression-bomb threshold (~89 Mpx, e.g. 9459 x
# 9459). A small PNG can declare 10000 x 10000 pixels; decoding it costs 300 MB of RGB and
# more inside the processor, so larger images are refused before decoding.
MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485
MAX_ASPECT = 200  # Qwen-VL image processors refuse width / height ratios above 200


def _too_large(path, rid, detail):
    return DataError(f"record {rid}: image {path} is too large ({detail}), above the {MAX_PIXELS / 1e6:.0f} Mpx "
                     f"limit (a possible decompression bomb); downscale it first, the model's processor resizes "
                     f"to far fewer pixels anyway")


def _open_image(path, rid):
    """Image.open with our size limits applied to the header (before any pixel is decoded).
    PIL warns above MAX_PIXELS and raises its own DecompressionBombError above twice that;
    both become one DataError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(path)
    except Image.DecompressionBombError as e:
        px = re.search(r"\((\d+) pixels\)", str(e))
        raise _too_large(path, rid, f"{int(px.group(1)) / 1e6:.0f} Mpx" if px else "PIL refuses it") from None
    w, h = im.size
    if w * h > MAX_PIXELS:
        im.close()
        raise _too_large(path, rid, f"{w} x {h} = {w * h / 1e6:.0f} Mpx")
    if max(w, h) > MAX_ASPECT * min(w, h):
        im.close()
        raise DataError(f"record {rid}: image {path} is {w} x {h}, aspect ratio above {MAX_ASPECT}:1, which the "
                        f"Qwen-VL image processors refuse; crop or pad it")
    return im


def check_image(path, rid="?"):
    """Full check of one image file, pixels included: raises DataError naming the record for a
    missing, empty or non-image file, one cut short (truncated: its header is intact, the
    pixels are not) or otherwise undecodable, above MAX_PIXELS (before decoding) and above
    MAX_ASPECT. Every pixel is decoded (`Image.load`, what `load_image` then converts) and the
    EXIF block read (the orientation `load_image` applies), without `load_image`'s copies (a
    third of its cost); the image is closed at once, so checking a whole data file holds one
    decoded image per worker in memory."""
    if not os.path.exists(path):
        raise DataError(f"record {rid}: image {path} not found")
    if os.path.getsize(path) == 0:
        raise DataError(f"record {rid}: image {path} is an empty (0-byte) file; re-export or drop the record")
    try:
        im = _open_image(path, rid)
        try:
            im.load()
            im.getexif()
        finally:
            im.close()  # the pixels too, not only the file
    except DataError:
        raise
    except (OSError, ValueError, SyntaxError) as e:  # Pillow raises SyntaxError for some broken headers
        raise DataError(f"record {rid}: cannot read image {path} ({e.__class__.__name__}: {e})") from None


_NO_ID = "\0"


def _image_problem(path):
    """None for a usable image file, else what is wrong with it (`check_image`'s message
    without the record)."""
    if not os.path.exists(path):
        return (f"image {path} not found (relative paths resolve against --image-root, default the data "
                f"file's folder)")
    try:
        check_image(path, _NO_ID)
    except DataError as e:
        return str(e).removeprefix(f"record {_NO_ID}: ")
    return None


def check_record_images(records, path="data", skip_bad=False, workers=None, progress=True):
    """Decode every image of `records` now (`check_image`: pixels, not only the header), so a
    bad image stops a run before any model loads, never hours into it. Each distinct file is
    decoded once, `workers` at a time (default: the usable cores, at most 16; Pillow decodes
    without the Python lock), each image dropped as soon as it is checked; a progress bar from
    500 files on (progress=False: none).

    Returns `records`, or with skip_bad the records whose images are all usable (a note on
    stderr gives the count and lists each left-out record). Raises DataError listing EVERY
    record with a missing or unusable image (id, file, what is wrong) when skip_bad is off, and
    when skip_bad leaves no record. Cost: README "What happens when" (measured per image)."""
    files = list(dict.fromkeys(p for r in records for p in r["images"]))
    if not files:
        return records
    workers = workers or min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    with tqdm(total=len(files), desc="check images", unit="img", leave=False,
              disable=not progress or len(files) < 500) as bar:
        def one(p):
            out = _image_problem(p)
            bar.update(1)
            return out
        if workers > 1 and len(files) > 8:
            with ThreadPoolExecutor(workers) as ex:
                problems = dict(zip(files, ex.map(one, files)))
        else:
            problems = {p: one(p) for p in files}
    lines = [f"record {r['id']}: {problems[p]}" for r in records for p in r["images"] if problems[p]]
    if not lines:
        return records
    bad = [i for i, r in enumerate(records) if any(problems[p] for p in r["images"])]
    listing = "\n  ".join(lines)
    if not skip_bad:
        raise DataError(f"{path}: {len(bad)} of {len(records)} record(s) with a missing or unusable image; fix or "
                        f"remove them, or pass --skip-bad to leave them out:\n  {listing}")
    drop = set(bad)
    kept = [r for i, r in enumerate(records) if i not in drop]
    if not kept:
        raise DataError(f"{path}: every record ({len(records)}) has a missing or unusable image, nothing is left "
                        f"with --skip-bad:\n  {listing}")
    print(f"note: --skip-bad: left out {len(bad)} of {len(records)} record(s) of {path} with a missing or "
          f"unusable image:\n  {listing}", file=sys.stderr)
    return kept


def record_images(rec):
    """Image paths of a record: its "images" list (several images per question, LLaVA style)
    or [its "image"]."""
    return list(rec.get("images") or [rec["image"]])


def load_record_images(rec):
    """The record's images as a list of PIL images (`load_image`)."""
    return [load_image(p, rec["id"]) for p in record_images(rec)]


def load_image(path, rid="?"):
    """Open an image as 8-bit RGB; raises DataError naming the record when unreadable, too
    large or too elongated (`check_image`).
    16-bit and float greyscale (modes I;16, I, F) are rescaled to 0-255 first: Pillow's own
    convert("RGB") would clip them to black and white. Transparency (RGBA, LA, PA, palette or
    greyscale with a transparent colour) is composited over white, as transformers'
    `convert_to_rgb` does: a plain convert("RGB") would show whatever colour the invisible
    pixels happen to store. EXIF orientation is applied (`PIL.ImageOps.exif_transpose`), as every
    viewer and transformers' image loader do: a phone photo stored sideways with Orientation = 6
    reaches the model upright (an 84x56 file as 56x84)."""
    if not os.path.exists(path):
        raise DataError(f"record {rid}: image {path} not found")
    try:
        with _open_image(path, rid) as raw:
            im = ImageOps.exif_transpose(raw)
            if im.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
                a = np.asarray(im, dtype=np.float64)
                lo, hi = float(a.min()), float(a.max())
                a = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
                return Image.fromarray(a.astype(np.uint8)).convert("RGB")
            if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
                rgba = im.convert("RGBA")
                return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
            return im.convert("RGB")
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"record {rid}: cannot read image {path} ({e.__class__.__name__}: {e})") from None


class Batcher:
    """Turns training records into model batches; each image file is decoded once and kept.

    records: dicts with id, image (path, or None for a text-only record), question, target[,
    history]. Pixels come from `VLProcessor.vision` / `images`, the one image path of every
    entry point (the processor's resize rules; a torch fast path for images it keeps as they
    are). Raises DataError naming the record for a missing or unreadable image."""

    def __init__(self, proc, records):
        self.proc, self.records = proc, records
        first = {}  # image path -> id of the first record using it (for error messages)
        for r in records:
            if r.get("image"):
                first.setdefault(r["image"], r.get("id", "?"))
        self.slot = {p: i for i, p in enumerate(first)}
        self.images = [load_image(p, rid) for p, rid in first.items()]

    def image_list(self, recs):
        """The decoded image of each record, None for a text-only one."""
        return [self.images[self.slot[r["image"]]] if r.get("image") else None for r in recs]

    def encode(self, recs, answers=None, questions=None):
        """Model inputs for records; with answers: training batch (right padding, labels on
        every answer turn of a multi-turn record)."""
        questions = questions or [r["question"] for r in recs]
        return self.proc.encode(self.image_list(recs), questions, answers=answers,
                                history=[r.get("history", []) for r in recs])
