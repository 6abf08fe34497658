"""Convert a public benchmark export into this repo's canonical JSONL, images written beside it.

    python -m eval.convert --benchmark mme --src MME/test-00000-of-00004.parquet --out bench/mme.jsonl
    python -m eval.convert --benchmark blink --src BLINK/ --out bench/blink.jsonl --multi-image concat
    python -m eval.evaluate --model /ckpt/Qwen2.5-VL-7B-Instruct --data bench/mme.jsonl

`--src` is one or more files or folders of files (a folder: read in name order) in the
benchmark's public schema:
the hub dataset's parquet shards (`pyarrow` needed: `pip install pyarrow`), `datasets`' .arrow
cache files (same), or a JSON / JSONL export of the same rows (nothing extra), e.g.
`datasets.load_dataset(...)["test"].to_json("mme.jsonl")`. An image column may hold
{"bytes": ..., "path": ...} (parquet / arrow; in JSON the bytes base64-encoded), base64 text, or a
file path resolved against `--image-dir` (default: the source's folder).

Each row becomes one canonical record (README, "Records"; `common.data.read_jsonl`):
    {"id", "image": "<out>_images/<id>.png" | [paths] | absent, "question": the benchmark's own
     prompt (lmms-eval's default pre / post prompt), "answer", "options"?, "family": <benchmark>,
     "benchmark", "category"?, "answer_type", "meta"?}
`eval.evaluate` then reports the benchmark's own score (`eval.scores`) next to the generic
per-family accuracy. Image bytes are written unchanged (the same image twice: one file).

| --benchmark | dataset (split) | columns read | answer | category |
|---|---|---|---|---|
| scienceqa | lmms-lab/ScienceQA ScienceQA-IMG / -FULL (test), derek-thomas/ScienceQA | question, choices, answer (index), hint, image (may be null) | letter | subject |
| mmmu | MMMU/MMMU per subject, lmms-lab/MMMU (validation) | id, question, options (a list or its Python text), answer, question_type, image_1..image_7 | letter or open text | subject (from id) |
| mmstar | Lin-Chen/MMStar (val) | index, question (options inside), answer, category, l2_category, image | letter | category |
| pope | lmms-lab/POPE (test) | question_id, question, answer, category (adversarial/popular/random), image | yes/no | split |
| mme | lmms-lab/MME (test) | question_id (the image: two questions each), question, answer, category, image | yes/no | subtask |
| mmlu | cais/mmlu (test) | question, subject, choices, answer (index or letter); no image | letter | subject |
| infovqa | lmms-lab/DocVQA InfographicVQA (validation) | questionId, question, answers, image | list of answers | - |
| ocrbench | echo840/OCRBench (test) | question, answer (list), question_type, dataset, image | list of answers | question type |
| chartqa | lmms-lab/ChartQA (test) | question, answer, type (human_test/augmented_test), image | text | type |
| textvqa | lmms-lab/textvqa (validation) | question_id, question, answers (10), image | the 10 answers | - |
| blink | BLINK-Benchmark/BLINK, one config per subtask (val) | idx, prompt, choices, answer "(A)", sub_task, image_1..image_4 | letter | subtask |
| vstar | craigwu/vstar_bench, lmms-lab/vstar-bench (test) | question_id, text (options "(A) .."), label, category, image | letter | category |
| realworldqa | xai-org/RealworldQA, lmms-lab/RealWorldQA (test) | question (options inside), answer, image | letter or text | - |
| cvbench | nyu-visionx/CV-Bench test / test_2d / test_3d (parquet, or the .jsonl + img/ folder) | idx, type (2D/3D), task, source, prompt (options inside), choices, answer "(C)", image or filename | letter | task |

Splits whose answers are withheld (MMMU / BLINK test, TextVQA test) are refused: those are
scored by the benchmark's server. Several images per item (BLINK, some of MMMU) are kept as a
list (`--multi-image keep`, the default), which `eval.evaluate` and the method scripts refuse
today; `--multi-image concat` pastes them side by side into one image instead (as VLMEvalKit
does for single-image models), so every record has at most one image.
"""
import ast
import base64
import binascii
import glob
import hashlib
import io
import json
import os
import re

from PIL import Image

from common.cli import add_limit, entry_parser, run_cli
from common.data import (DataError, atomic_target, atomic_write_text, check_unique_ids, gold_answers, load_records,
                         note_changes)
# deferred: pyarrow (optional, not in requirements.txt: only parquet / arrow sources need it)

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MC_PROMPT = "Answer with the option's letter from the given choices directly."
SHORT_PROMPT = "Answer the question using a single word or phrase."


class ConvertError(DataError):
    """A source row or file cannot be converted; the message names it and the fix."""


# ----------------------------------------------------------------------------- reading sources

def _pyarrow(path):
    try:
        import pyarrow  # noqa: F401  (optional: only parquet / arrow sources need it)
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ConvertError(f"{path}: reading parquet / arrow needs pyarrow, which is not installed: "
                           f"pip install pyarrow (or export the rows to JSON / JSONL)") from None
    return pyarrow


def read_rows(path):
    """The rows (dicts) of a benchmark export: .parquet / .arrow (pyarrow), .json (a list, an
    object {"data": [...]} or an object of rows keyed by id, as ScienceQA's problems.json) or
    .jsonl; a folder: every such file in it, in name order. Raises ConvertError for a missing
    path, an empty folder, an unknown suffix, or pyarrow missing for parquet / arrow."""
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "*"))
                       if f.endswith((".parquet", ".arrow", ".json", ".jsonl")))
        if not files:
            raise ConvertError(f"{path}: no .parquet / .arrow / .json / .jsonl files in this folder")
        return [row for f in files for row in read_rows(f)]
    if not os.path.exists(path):
        raise ConvertError(f"{path}: not found")
    if path.endswith(".parquet"):
        return _pyarrow(path).parquet.read_table(path).to_pylist()
    if path.endswith(".arrow"):
        pa = _pyarrow(path)
        with open(path, "rb") as f:
            try:
                return pa.ipc.open_stream(f).read_all().to_pylist()  # datasets' cache files
            except pa.lib.ArrowInvalid:
                f.seek(0)
                return pa.ipc.open_file(f).read_all().to_pylist()
    if path.endswith((".json", ".jsonl")):
        with open(path, encoding="utf-8-sig") as f:
            head = f.read(4096).lstrip()
        rows = load_records(path)  # a JSON list or JSONL (DataError names a bad line)
        if path.endswith(".json") and head.startswith("{") and len(rows) == 1:  # one JSON object
            rows = rows[0]
        if isinstance(rows, dict):
            rows = rows.get("data", rows)
            if isinstance(rows, dict):  # {"id": {row}, ...}
                rows = [{"id": k, **v} for k, v in rows.items()]
        if not all(isinstance(r, dict) for r in rows):
            raise ConvertError(f"{path}: expected rows as JSON objects")
        return rows
    raise ConvertError(f"{path}: unknown file type; give .parquet, .arrow, .json or .jsonl (or a folder of them)")


def image_bytes(value, rid, roots):
    """Encoded image bytes of an image cell, or None for an empty one: {"bytes", "path"} (bytes
    or base64 text; bytes None -> the path), raw bytes, base64 text, or a file path tried
    against each folder in `roots`. Raises ConvertError naming the record when it is none of
    these or the file is missing."""
    if value is None or value == "":
        return None
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return image_bytes(value["bytes"], rid, roots)
        if value.get("path"):
            return image_bytes(value["path"], rid, roots)
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        for root in roots:
            p = os.path.join(root, value)
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    return f.read()
        if len(value) > 64:
            try:
                return base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                pass
        raise ConvertError(f"record {rid}: image {value!r:.80} is not a file under {roots} (pass --image-dir) "
                           f"nor base64 image data")
    raise ConvertError(f"record {rid}: cannot read an image from a {type(value).__name__}")


# ----------------------------------------------------------------------------- per benchmark

def _need(row, rid, *keys):
    missing = [k for k in keys if row.get(k) is None]
    if missing:
        raise ConvertError(f"record {rid}: missing column(s) {missing}; columns present: {sorted(row)} "
                           f"(is --benchmark right?)")


def _answer(row, rid, key, split_hint):
    a = row.get(key)
    if a is None or (isinstance(a, str) and a.strip() in ("", "?")) or a == []:
        raise ConvertError(f"record {rid}: no answer in {key!r}; {split_hint} (answers of a test split are withheld: "
                           f"convert the validation split)")
    return a


def _lettered(options):
    return "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))


def _index_answer(a, n, rid):
    """An answer given as an option index (0..n-1) or letter -> its letter."""
    if isinstance(a, int) or (isinstance(a, str) and a.strip().isdigit()):
        k = int(a)
        if not 0 <= k < n:
            raise ConvertError(f"record {rid}: answer index {k} is outside the {n} choices")
        return LETTERS[k]
    a = str(a).strip().strip("()")
    if a not in LETTERS[:n]:
        raise ConvertError(f"record {rid}: answer {a!r} is neither a choice index nor one of {list(LETTERS[:n])}")
    return a


def _list(v):
    """A list column as a list: JSON / Python list text ("['a', 'b']", MMMU's options) parsed."""
    if isinstance(v, str):
        try:
            v = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            return [v]
    return list(v) if isinstance(v, (list, tuple)) else [v]


def conv_scienceqa(row, i):
    rid = str(row.get("id", i))
    _need(row, rid, "question", "choices", "answer")
    choices = _list(row["choices"])
    hint = (row.get("hint") or "").strip()
    ctx = f"Context: {hint}\n" if hint else ""
    return {"id": rid, "images": [row.get("image")], "question": f"{ctx}{row['question']}\n{_lettered(choices)}\n{MC_PROMPT}",
            "answer": _index_answer(row["answer"], len(choices), rid), "options": choices,
            "category": row.get("subject") or row.get("category"), "answer_type": "letter"}


def _mmmu_subject(rid):
    m = re.match(r"^[^_]+_(.+?)_\d+$", rid)
    return m.group(1) if m else None


def conv_mmmu(row, i):
    rid = str(row.get("id", i))
    _need(row, rid, "question", "question_type")
    options = [str(o) for o in _list(row.get("options") or "[]")]
    mc = row["question_type"] == "multiple-choice" and len(options) >= 2
    answer = _answer(row, rid, "answer", "MMMU test answers are withheld")
    q = row["question"]
    if mc:
        q = f"{q}\n{_lettered(options)}\n\n{MC_PROMPT}"
        answer = [_index_answer(a, len(options), rid) for a in answer] if isinstance(answer, list) else \
            _index_answer(answer, len(options), rid)
    else:
        q = f"{q}\n\n{SHORT_PROMPT}"
    # lmms-eval's mmmu_doc_to_visual: the images the prompt names, "<image 3>" -> image_3, sorted
    names = sorted({t.strip("<>").replace(" ", "_") for t in re.findall(r"<image \d+>", q)})
    return {"id": rid, "images": [row.get(n) for n in names], "question": q, "answer": answer,
            "options": options if mc else None, "category": _mmmu_subject(rid), "answer_type": "letter" if mc else "text",
            "meta": {"question_type": row["question_type"]}}


def conv_mmstar(row, i):
    rid = str(row.get("index", row.get("id", i)))
    _need(row, rid, "question", "answer")
    return {"id": rid, "images": [row.get("image")], "answer": str(row["answer"]).strip(),
            "question": f"{row['question'].strip()}\nAnswer with the option's letter from the given choices directly",
            "category": row.get("category"), "answer_type": "letter",
            "meta": {"l2_category": row["l2_category"]} if row.get("l2_category") else None}


def conv_pope(row, i):
    qid = str(row.get("question_id", row.get("id", i)))
    cat = row.get("category")
    rid = f"{cat}_{qid}" if cat else qid  # question ids repeat across the three splits
    _need(row, rid, "question", "answer")
    return {"id": rid, "images": [row.get("image")], "question": f"{row['question'].strip()}\n{SHORT_PROMPT}",
            "answer": str(row["answer"]).strip().lower(), "category": cat, "answer_type": "yesno"}


def conv_mme(row, i):
    _need(row, f"#{i}", "question_id", "question", "answer", "category")
    q = row["question"].strip().replace(" Please answer yes or no.", "")  # lmms-eval swaps it for its post-prompt
    return {"id": row["question_id"], "images": [row.get("image")], "question": f"{q}\n{SHORT_PROMPT}",
            "answer": str(row["answer"]).strip(), "category": row["category"], "answer_type": "yesno",
            "meta": {"pair": row["question_id"]}}


def conv_mmlu(row, i):
    subject = row.get("subject") or "general"
    rid = str(row.get("id", f"{subject}_{i}"))
    _need(row, rid, "question", "choices", "answer")
    choices = [str(c) for c in _list(row["choices"])]
    head = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    return {"id": rid, "images": [], "question": f"{head}{row['question'].strip()}\n{_lettered(choices)}\n{MC_PROMPT}",
            "answer": _index_answer(row["answer"], len(choices), rid), "options": choices, "category": subject,
            "answer_type": "letter"}


def conv_infovqa(row, i):
    rid = str(row.get("questionId", row.get("id", i)))
    _need(row, rid, "question")
    answers = _answer(row, rid, "answers", "InfoVQA test answers are withheld")
    return {"id": rid, "images": [row.get("image")], "question": f"{row['question']}\n{SHORT_PROMPT}",
            "answer": [str(a) for a in _list(answers)], "answer_type": "text"}


def conv_ocrbench(row, i):
    rid = str(row.get("id", i))
    _need(row, rid, "question", "answer", "question_type")
    return {"id": rid, "images": [row.get("image")], "question": row["question"].strip(),
            "answer": [str(a) for a in _list(row["answer"])], "category": row["question_type"], "answer_type": "text",
            "meta": {"dataset": row.get("dataset", "")}}


def conv_chartqa(row, i):
    rid = str(row.get("id", i))
    _need(row, rid, "question", "answer")
    return {"id": rid, "images": [row.get("image")], "question": f"{row['question']}\nAnswer the question with a single word.",
            "answer": str(row["answer"]), "category": row.get("type"), "answer_type": "text"}


def conv_textvqa(row, i):
    rid = str(row.get("question_id", row.get("id", i)))
    _need(row, rid, "question")
    answers = _answer(row, rid, "answers", "TextVQA test answers are withheld")
    return {"id": rid, "images": [row.get("image")], "question": f"{row['question'].capitalize()}\n{SHORT_PROMPT}",
            "answer": [str(a) for a in _list(answers)], "answer_type": "text"}


def conv_blink(row, i):
    rid = str(row.get("idx", row.get("id", i)))
    _need(row, rid, "choices")
    choices = [str(c) for c in _list(row["choices"])]
    answer = _index_answer(_answer(row, rid, "answer", "BLINK test answers are withheld"), len(choices), rid)
    prompt = row.get("prompt") or (f"{row.get('question', '')}\nSelect from the following choices.\n"
                                   + "\n".join(f"({LETTERS[k]}) {c}" for k, c in enumerate(choices)))
    note = f"Note: You only need to respond with {', '.join(LETTERS[:len(choices)])} without providing any " \
           f"additional information.\n"
    names = sorted((k for k in row if re.fullmatch(r"image_\d+", k)), key=lambda k: int(k.split("_")[1]))
    return {"id": rid, "images": [row[k] for k in names if row[k] is not None], "question": note + prompt,
            "answer": answer, "options": choices, "category": row.get("sub_task"), "answer_type": "letter"}


def conv_vstar(row, i):
    rid = str(row.get("question_id", row.get("id", i)))
    _need(row, rid, "text", "label")
    text = row["text"]
    options = re.findall(r"\([A-D]\)\s*([^()]+?)(?=\s*\([A-D]\)|$)", text)  # lmms-eval's vstar_doc_to_text
    if options:
        text = text.split("(A)")[0].strip() + "\n" + "\n".join(f"{LETTERS[k]}. {o.strip()}"
                                                                for k, o in enumerate(options[:4]))
    return {"id": rid, "images": [row.get("image")], "question": f"{text}\n{MC_PROMPT}",
            "answer": str(row["label"]).strip().upper(), "options": [o.strip() for o in options[:4]] or None,
            "category": row.get("category"), "answer_type": "letter"}


def conv_realworldqa(row, i):
    rid = str(row.get("id", row.get("question_id", i)))
    _need(row, rid, "question", "answer")
    answer = str(row["answer"]).strip()
    letter = answer.upper() in ("A", "B", "C", "D")
    opts = [t.strip() for _, t in re.findall(r"\b([A-Z])\.\s+([^\n]*)", row["question"])] if letter else []
    return {"id": rid, "images": [row.get("image")], "question": row["question"].strip(),
            "answer": answer.upper() if letter else answer, "options": opts if len(opts) >= 2 else None,
            "answer_type": "letter" if letter else "text"}


def conv_cvbench(row, i):
    """CV-Bench (Tong et al., "Cambrian-1: A Fully Open, Vision-Centric Exploration of Multimodal
    LLMs", arXiv 2406.16860): the prompt as lmms-eval's cv_bench task builds it (its pre-prompt
    "Note: You only need to respond with A, B, ... without providing any additional
    information.", a newline, then the row's own "prompt", which already lists the choices as
    "(A) ..."). The image is the parquet "image" cell or, in test.jsonl, the "filename" path
    (img/2D/...) under --image-dir. The id is "<type>_<idx>", so test_2d and test_3d converted
    together cannot collide; meta keeps source (ADE20K / COCO / Omni3D) and type, which
    `eval.scores.score_cvbench` composes the 2D and 3D accuracies from."""
    rid = f"{row.get('type', '')}_{row.get('idx', i)}".lstrip("_")
    _need(row, rid, "prompt", "choices", "answer", "source")
    choices = [str(c) for c in _list(row["choices"])]
    kind = str(row.get("type") or ("3D" if row["source"] == "Omni3D" else "2D"))
    pre = f"Note: You only need to respond with {', '.join(LETTERS[:len(choices)])} without providing any " \
          f"additional information.\n"
    image = row.get("image")
    return {"id": rid, "images": [image if image not in (None, "") else row.get("filename")],
            "question": f"{pre}\n{row['prompt']}", "answer": _index_answer(row["answer"], len(choices), rid),
            "options": choices, "category": row.get("task"), "answer_type": "letter",
            "meta": {"source": str(row["source"]), "type": kind, "idx": row.get("idx", i)}}


CONVERTERS = {"scienceqa": conv_scienceqa, "mmmu": conv_mmmu, "mmstar": conv_mmstar, "pope": conv_pope,
              "mme": conv_mme, "mmlu": conv_mmlu, "infovqa": conv_infovqa, "ocrbench": conv_ocrbench,
              "chartqa": conv_chartqa, "textvqa": conv_textvqa, "blink": conv_blink, "vstar": conv_vstar,
              "realworldqa": conv_realworldqa, "cvbench": conv_cvbench}


# ----------------------------------------------------------------------------- images and output

def _decode(data, rid):
    """(PIL image, file suffix) of encoded bytes; ConvertError naming the record if unreadable."""
    try:
        im = Image.open(io.BytesIO(data))
        im.load()
    except Exception as e:  # PIL raises many types for bad data
        raise ConvertError(f"record {rid}: image data is not a readable image ({type(e).__name__}: {e})") from None
    fmt = (im.format or "PNG").lower()
    return im, {"jpeg": "jpg", "mpo": "jpg"}.get(fmt, fmt)


def concat_images(images):
    """PIL images side by side (tops aligned, black background), one RGB image: what
    `--multi-image concat` writes for an item with several images."""
    images = [im.convert("RGB") for im in images]
    out = Image.new("RGB", (sum(im.width for im in images), max(im.height for im in images)))
    x = 0
    for im in images:
        out.paste(im, (x, 0))
        x += im.width
    return out


def _safe(s):
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("._")[:80] or "item"


def convert(benchmark, src, out, image_dir=None, limit=None, overwrite=False, multi_image="keep",
            require_image=False):
    """Convert `src` (a file or folder, or a list of them, in `benchmark`'s public schema) to
    canonical JSONL `out` and its images under `<out without .jsonl>_images/`; rows without
    an image are dropped when `require_image` (e.g. ScienceQA's image questions only, for the
    scripts that need one image per record). Returns the records written.

    Refuses (ConvertError, before writing anything) an existing `out` or a non-empty image
    folder unless `overwrite`, an unknown benchmark, rows missing the benchmark's columns,
    withheld answers, a gold answer that is not text (`common.data.gold_answers`), duplicate
    ids (MME's two questions per image get "#1" / "#2") and unreadable images; rows dropped
    by `require_image` are counted in a note on stderr. Every file is written atomically (`common.data.atomic_target`); the
    JSONL last, so an interrupted run leaves no half file (only finished images)."""
    if benchmark not in CONVERTERS:
        raise ConvertError(f"unknown --benchmark {benchmark!r}; choose one of {', '.join(CONVERTERS)}")
    if multi_image not in ("keep", "concat"):
        raise ConvertError(f"--multi-image must be keep or concat, got {multi_image!r}")
    base = out[:-6] if out.endswith(".jsonl") else out
    img_dir = base + "_images"
    if not overwrite:
        if os.path.exists(out):
            raise ConvertError(f"--out {out} exists; pass --overwrite to replace it")
        if os.path.isdir(img_dir) and os.listdir(img_dir):
            raise ConvertError(f"image folder {img_dir} is not empty; pass --overwrite to replace its files")
    srcs = [src] if isinstance(src, str) else list(src)
    rows = [row for s in srcs for row in read_rows(s)]
    if not rows:
        raise ConvertError(f"{srcs}: no rows")
    roots = [image_dir] if image_dir else []
    roots += list(dict.fromkeys(s if os.path.isdir(s) else os.path.dirname(os.path.abspath(s)) for s in srcs))
    conv = CONVERTERS[benchmark]
    records, seen, written, dropped = [], {}, {}, 0  # written: image sha1 -> relative path
    out_folder = os.path.dirname(os.path.abspath(out))
    for i, row in enumerate(rows):
        if limit is not None and len(records) >= limit:
            break
        r = conv(row, i)
        if require_image and not any(v is not None and v != "" for v in r["images"]):
            dropped += 1
            continue
        gold_answers(srcs, r["id"], r["answer"])  # the readers' rule: text, a number or a list of them
        n = seen[r["id"]] = seen.get(r["id"], 0) + 1
        if n > 1:
            if benchmark != "mme":
                raise ConvertError(f"{srcs}: duplicate id {r['id']!r} (row {i})")
            r["id"] = f"{r['id']}#{n}"
            if n == 2:  # the first of the pair gets its "#1" too
                next(x for x in records if x["id"] == r["meta"]["pair"])["id"] = f"{r['meta']['pair']}#1"
        datas = [d for d in (image_bytes(v, r["id"], roots) for v in r.pop("images")) if d is not None]
        paths = []
        if multi_image == "concat" and len(datas) > 1:
            buf = io.BytesIO()
            concat_images([_decode(d, r["id"])[0] for d in datas]).save(buf, "PNG")
            datas = [buf.getvalue()]
        for k, data in enumerate(datas):
            key = hashlib.sha1(data).hexdigest()
            if key not in written:
                _, ext = _decode(data, r["id"])
                stem = _safe(os.path.splitext(r["meta"]["pair"])[0] if benchmark == "mme" else r["id"])
                name = f"{stem}_{k + 1}" if len(datas) > 1 else stem
                path = os.path.join(img_dir, f"{name}.{ext}")
                j = 1
                while os.path.relpath(path, out_folder) in written.values():  # two ids that sanitise alike
                    j += 1
                    path = os.path.join(img_dir, f"{name}-{j}.{ext}")
                with atomic_target(path) as tmp, open(tmp, "wb") as f:
                    f.write(data)
                written[key] = os.path.relpath(path, out_folder)
            paths.append(written[key])
        rec = {"id": r["id"]}
        if paths:
            rec["image"] = paths[0] if len(paths) == 1 else paths
        rec.update(question=r["question"], answer=r["answer"])
        if r.get("options"):
            rec["options"] = r["options"]
        rec.update(family=benchmark, benchmark=benchmark)
        if r.get("category"):
            rec["category"] = str(r["category"])
        rec["answer_type"] = r["answer_type"]
        if r.get("meta"):
            rec["meta"] = r["meta"]
        records.append(rec)
    check_unique_ids(records, out)
    note_changes(out, {"row(s) without an image left out (--require-image)": dropped})
    atomic_write_text(out, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in records))
    return records


def main(argv=None):
    p = entry_parser(__spec__.name, "Convert a public benchmark export (parquet / arrow / JSON / JSONL, "
                                    "the hub dataset's schema) to canonical JSONL with images beside it.")
    p.add_argument("--benchmark", required=True, choices=sorted(CONVERTERS), help="which schema --src is in")
    p.add_argument("--src", required=True, nargs="+",
                   help="one or more .parquet / .arrow / .json / .jsonl files, or folders of them (read in order)")
    p.add_argument("--out", required=True, help="canonical JSONL to write; images go to <out>_images/")
    p.add_argument("--image-dir", default=None,
                   help="folder that image file paths in --src are relative to (default: --src's folder)")
    add_limit(p)
    p.add_argument("--require-image", action="store_true",
                   help="drop rows without an image (ScienceQA's text-only questions, for mod / mole scripts)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out and its image files")
    p.add_argument("--multi-image", default="keep", choices=["keep", "concat"],
                   help="several images per item: keep them as a list (default) or paste them side by side into one")
    a = p.parse_args(argv)
    recs = convert(a.benchmark, a.src, a.out, a.image_dir, a.limit or None, a.overwrite, a.multi_image, a.require_image)
    n_img = sum(1 for r in recs if "image" in r)
    multi = sum(1 for r in recs if isinstance(r.get("image"), list))
    print(f"wrote {a.out}: {len(recs)} {a.benchmark} records ({n_img} with images, {multi} with several, "
          f"{len(recs) - n_img} text-only)")
    if multi:
        print("note: records with several images are refused by eval.evaluate and the method scripts; "
              "--multi-image concat pastes them into one")
    return recs


if __name__ == "__main__":
    run_cli(main)  # ConvertError / DataError / OSError: `error: ...`, exit status 2
