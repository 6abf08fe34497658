"""Benchmark readers: every evaluation file becomes the same list of record dicts.

Two on-disk formats:

  canonical JSONL (one record per line, images in a folder next to it or under image_root):
      {"id": "q1", "image": "images/q1.png", "question": "Is there a dog?", "answer": "yes",
       "family": "existence",                      # optional, default "all"
       "options": ["cat", "dog", "cow", "pig"]}    # optional, multiple choice
  LLaVA conversation JSON/JSONL (`common.data.read_llava_json`), what `common.data` writes.

Both give dicts {id, image (absolute path), question, target, answer, family, conversations}
(the keys of `read_llava_json`); canonical records with options also carry
"options": [(letter, text), ...]. `read_any` picks the reader from the file's content.

Several acceptable answers (DocVQA / VQAv2 style): "answer": ["1986", "1986."] stays a list;
`eval.metrics.is_correct` accepts any of them and ANLS takes the best. Training needs one
target: "target" is the first gold.

Multiple choice: options are lettered A, B, C, ... in order. If the question does not
already list them, " A. cat B. dog ... Answer with the letter." is appended (the shapes
world's format, which the tiny models know). A gold answer given as an option's text is
turned into its letter.
"""
import os
import re

from common.data import DataError, check_image, load_records, read_llava_json

REQUIRED = ("id", "image", "question", "answer")
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


def _golds(path, rid, answer):
    """A record's gold answers as a list of non-empty strings: one answer (text or number) or
    a list of acceptable ones. Raises DataError for anything else (an object, a nested list,
    an empty string in the list)."""
    items = answer if isinstance(answer, list) else [answer]
    if any(isinstance(a, (dict, list, bool)) or a is None or not str(a).strip() for a in items):
        raise DataError(f"{path}: record {rid}: 'answer' must be a text (or number) or a list of acceptable "
                        f"texts, got {answer!r:.60} (write yes/no answers as text)")
    return [str(a).strip() for a in items]


def read_jsonl(path, image_root=None, check_images=True):
    """Read a canonical benchmark JSONL (module docstring) -> list of record dicts.

    image paths are relative to image_root (default: the file's folder) unless absolute.
    Raises DataError naming the record for a non-object line, missing/empty required
    fields (id, image, question, answer), an 'answer' that is not a text / number / list of
    them (`_golds`), an 'image' that is not one path (a list: one image
    per record), duplicate ids, fewer than 2 options, an answer
    that is neither a letter nor an option's text, and (check_images) missing, empty, unreadable
    or oversized image files (`common.data.check_image`)."""
    root = image_root or os.path.dirname(os.path.abspath(path))
    out, seen = [], set()
    for i, r in enumerate(load_records(path)):
        if not isinstance(r, dict):
            raise DataError(f"{path}: record #{i} is not a JSON object")
        rid = r.get("id", f"#{i}")
        missing = [k for k in REQUIRED if r.get(k) in (None, "") or r.get(k) == []]
        if missing:
            raise DataError(f"{path}: record {rid} lacks required field(s) {missing} "
                            f"(canonical JSONL needs {list(REQUIRED)})")
        rid = str(rid)
        if rid in seen:
            raise DataError(f"{path}: record {rid}: duplicate id")
        seen.add(rid)
        if isinstance(r["image"], list):
            raise DataError(f"{path}: record {rid} has {len(r['image'])} images ('image' is a list): one image per "
                            f"record is supported; split it into one record per image")
        if not isinstance(r["image"], str):
            raise DataError(f"{path}: record {rid}: 'image' must be a file path (text), got "
                            f"{type(r['image']).__name__} {r['image']!r:.40}")
        image = r["image"] if os.path.isabs(r["image"]) else os.path.join(root, r["image"])
        if check_images:
            if not os.path.exists(image):
                raise DataError(f"{path}: record {rid}: image {image} not found (set image_root / --image-root)")
            check_image(image, rid)  # header only: an empty / non-image / oversized file fails here
        q, golds = str(r["question"]).strip(), _golds(path, rid, r["answer"])
        rec = {"id": rid, "image": image, "question": q, "target": golds[0],
               "answer": golds if isinstance(r["answer"], list) else golds[0], "family": r.get("family") or "all"}
        if r.get("options") is not None:
            opts = r["options"]
            if not isinstance(opts, list) or len(opts) < 2 or len(opts) > 26:
                raise DataError(f"{path}: record {rid}: 'options' must be a list of 2-26 strings")
            opts = [(chr(ord("A") + j), str(t)) for j, t in enumerate(opts)]
            if not parse_options(q):
                q = f"{q} {' '.join(f'{L}. {t}' for L, t in opts)} Answer with the letter."
            letters = [L for L, _ in opts]
            by_text = {t.strip().lower(): L for L, t in opts}
            for a in golds:
                if a not in letters and a.lower() not in by_text:
                    raise DataError(f"{path}: record {rid}: answer {a!r} is neither an option letter "
                                    f"{letters} nor an option's text")
            golds = [a if a in letters else by_text[a.lower()] for a in golds]
            rec.update(question=q, target=golds[0], answer=golds if isinstance(r["answer"], list) else golds[0],
                       options=opts)
        rec["conversations"] = [{"from": "human", "value": f"<image>\n{rec['question']}"},
                                {"from": "gpt", "value": rec["target"]}]
        out.append(rec)
    return out


def read_any(path, image_root=None, check_images=True):
    """Read a benchmark file of either format, decided by content: records with
    "conversations" -> `read_llava_json`, records with "question" -> `read_jsonl`.
    Raises DataError for an empty file or records of neither kind."""
    records = load_records(path)
    if not records:
        raise DataError(f"{path}: no records")
    first = records[0]
    if isinstance(first, dict) and "conversations" in first:
        return read_llava_json(path, image_root=image_root, check_images=check_images)
    if isinstance(first, dict) and "question" in first:
        return read_jsonl(path, image_root=image_root, check_images=check_images)
    raise DataError(f"{path}: first record has neither 'conversations' (LLaVA JSON) nor 'question' "
                    f"(canonical JSONL); keys: {sorted(first) if isinstance(first, dict) else type(first).__name__}")
