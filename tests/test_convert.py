"""eval.convert: each benchmark's converter on a tiny synthetic file in that benchmark's public
schema (JSON / JSONL exports; parquet when pyarrow is installed), read back by the readers."""
import base64
import io
import json
import os

import pytest
from PIL import Image

from common.data import read_any
from eval.convert import ConvertError, concat_images, convert, main, read_rows


def png(colour, size=(8, 8)):
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def hf_image(colour, size=(8, 8)):
    """An image cell as `datasets` exports it to JSON: {"bytes": base64, "path": name}."""
    return {"bytes": base64.b64encode(png(colour, size)).decode(), "path": None}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def conv(tmp_path, bench, rows, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = write_jsonl(tmp_path / f"{bench}_src.jsonl", rows)
    out = str(tmp_path / "out" / f"{bench}.jsonl")
    written = convert(bench, src, out, **kw)
    return written, read_any(out), out


def test_scienceqa_with_and_without_image(tmp_path):
    rows = [{"image": hf_image("red"), "question": "Which is a mammal?", "choices": ["cat", "trout"], "answer": 0,
             "hint": "Look at the picture.", "subject": "natural science"},
            {"image": None, "question": "Which word is a noun?", "choices": ["run", "dog", "blue"], "answer": 1,
             "hint": "", "subject": "language science"}]
    written, recs, out = conv(tmp_path, "scienceqa", rows)
    assert written[0]["question"] == ("Context: Look at the picture.\nWhich is a mammal?\nA. cat\nB. trout\n"
                                      "Answer with the option's letter from the given choices directly.")
    assert recs[0]["answer"] == "A" and recs[0]["options"] == [("A", "cat"), ("B", "trout")]
    assert recs[0]["question"] == written[0]["question"]          # a benchmark prompt is kept verbatim
    assert os.path.isfile(recs[0]["image"]) and Image.open(recs[0]["image"]).size == (8, 8)
    assert recs[1]["images"] == [] and recs[1]["answer"] == "B" and "Context" not in recs[1]["question"]
    _, only, _ = conv(tmp_path / "img", "scienceqa", rows, require_image=True)
    assert [r["id"] for r in only] == ["0"]
    assert recs[1]["category"] == "language science" and recs[1]["benchmark"] == "scienceqa"
    assert recs[1]["answer_type"] == "letter"


def test_mmmu_multiple_choice_open_and_multi_image(tmp_path):
    rows = [{"id": "validation_Art_Theory_1", "question": "Compare <image 1> and <image 2>.",
             "options": "['left', 'right', 'both']", "answer": "C", "question_type": "multiple-choice",
             "image_1": hf_image("red"), "image_2": hf_image("blue"), "image_3": None},
            {"id": "validation_Math_2", "question": "<image 1> What is x?", "options": "[]", "answer": "12",
             "question_type": "open", "image_1": hf_image("green"), "image_2": None}]
    written, recs, _ = conv(tmp_path, "mmmu", rows)
    assert len(recs[0]["images"]) == 2 and recs[0]["category"] == "Art_Theory" and recs[0]["answer"] == "C"
    assert written[0]["question"].endswith("A. left\nB. right\nC. both\n\nAnswer with the option's letter from the "
                                           "given choices directly.")
    assert "<image 1>" in recs[0]["question"]                      # lmms-eval keeps the tags in the text
    assert recs[1]["answer"] == "12" and recs[1]["answer_type"] == "text" and "options" not in recs[1]
    assert recs[1]["meta"] == {"question_type": "open"} and recs[1]["category"] == "Math"
    _, one, _ = conv(tmp_path / "c", "mmmu", rows, multi_image="concat")
    assert len(one[0]["images"]) == 1 and Image.open(one[0]["image"]).size == (16, 8)


def test_mmmu_test_split_is_refused(tmp_path):
    rows = [{"id": "test_Art_1", "question": "q", "options": "['a', 'b']", "answer": "?",
             "question_type": "multiple-choice", "image_1": hf_image("red")}]
    with pytest.raises(ConvertError, match="withheld"):
        conv(tmp_path, "mmmu", rows)


def test_mmstar_pope_mme(tmp_path):
    _, recs, _ = conv(tmp_path, "mmstar", [{"index": 7, "question": "What?\nOptions: A: x, B: y", "answer": "B",
                                            "category": "math", "l2_category": "geometry", "image": hf_image("red")}])
    assert recs[0]["id"] == "7" and recs[0]["meta"] == {"l2_category": "geometry"} and recs[0]["answer"] == "B"
    assert recs[0]["question"].endswith("Answer with the option's letter from the given choices directly")
    rows = [{"question_id": 1, "question": "Is there a dog in the image?", "answer": "Yes", "category": c,
             "image": hf_image("red")} for c in ("adversarial", "random")]
    _, recs, out = conv(tmp_path, "pope", rows)
    assert [r["id"] for r in recs] == ["adversarial_1", "random_1"] and recs[0]["answer"] == "yes"
    assert len(os.listdir(out[:-6] + "_images")) == 1               # the same image is written once
    mme = [{"question_id": "count/0001.png", "question": "Are there two dogs? Please answer yes or no.",
            "answer": "Yes", "category": "count", "image": hf_image("red")},
           {"question_id": "count/0001.png", "question": "Are there three dogs? Please answer yes or no.",
            "answer": "No", "category": "count", "image": hf_image("red")}]
    written, recs, _ = conv(tmp_path, "mme", mme)
    assert [r["id"] for r in recs] == ["count/0001.png#1", "count/0001.png#2"]
    assert written[0]["meta"] == {"pair": "count/0001.png"} and recs[0]["meta"] == {"pair": "count/0001.png"}
    assert recs[0]["question"] == "Are there two dogs?\nAnswer the question using a single word or phrase."
    assert recs[0]["image"] == recs[1]["image"]


def test_mmlu_is_text_only(tmp_path):
    rows = [{"question": "What is 2+2?", "subject": "elementary_mathematics", "choices": ["3", "4", "5", "6"],
             "answer": 1}]
    _, recs, _ = conv(tmp_path, "mmlu", rows)
    assert recs[0]["images"] == [] and recs[0]["answer"] == "B" and recs[0]["category"] == "elementary_mathematics"
    assert recs[0]["question"].startswith("The following are multiple choice questions (with answers) about "
                                          "elementary mathematics.\n\nWhat is 2+2?\nA. 3\nB. 4")


def test_infovqa_ocrbench_chartqa_textvqa_answers(tmp_path):
    _, recs, _ = conv(tmp_path, "infovqa", [{"questionId": 65, "question": "What year?", "answers": ["1986", "1986."],
                                             "image": hf_image("red")}])
    assert recs[0]["answer"] == ["1986", "1986."] and recs[0]["id"] == "65"
    _, recs, _ = conv(tmp_path, "ocrbench", [{"question": "what is written in the image?", "answer": ["STOP"],
                                              "question_type": "Regular Text Recognition", "dataset": "IIIT5K",
                                              "image": hf_image("red")}])
    assert recs[0]["category"] == "Regular Text Recognition" and recs[0]["meta"] == {"dataset": "IIIT5K"}
    _, recs, _ = conv(tmp_path, "chartqa", [{"question": "How many?", "answer": "12", "type": "human_test",
                                             "image": hf_image("red")}])
    assert recs[0]["question"] == "How many?\nAnswer the question with a single word."
    assert recs[0]["category"] == "human_test"
    ten = ["stop"] * 7 + ["stop sign"] * 3
    _, recs, _ = conv(tmp_path, "textvqa", [{"question_id": 3, "question": "what does the sign say?", "answers": ten,
                                             "image": hf_image("red")}])
    assert recs[0]["answer"] == ten                                  # all 10, duplicates kept, for VQA accuracy
    assert recs[0]["question"].startswith("What does the sign say?\n")


def test_blink_multi_image_and_vstar_realworldqa(tmp_path):
    rows = [{"idx": "val_Jigsaw_1", "question": "Which piece fits?", "sub_task": "Jigsaw", "choices": ["A", "B"],
             "answer": "(B)", "prompt": "Which piece fits?\nSelect from the following choices.\n(A) left\n(B) right",
             "image_1": hf_image("red"), "image_2": hf_image("green"), "image_3": hf_image("blue"), "image_4": None}]
    written, recs, _ = conv(tmp_path, "blink", rows)
    assert len(recs[0]["images"]) == 3 and recs[0]["answer"] == "B" and recs[0]["category"] == "Jigsaw"
    assert written[0]["image"] == ["blink_images/val_Jigsaw_1_1.png", "blink_images/val_Jigsaw_1_2.png",
                                   "blink_images/val_Jigsaw_1_3.png"]
    assert recs[0]["question"].startswith("Note: You only need to respond with A, B without providing any additional "
                                          "information.\nWhich piece fits?")
    assert recs[0]["question"] == written[0]["question"]   # "(A) left" options: not listed again by the reader
    _, recs, _ = conv(tmp_path, "vstar", [{"question_id": 0, "text": "What colour is the cup? (A) red (B) blue",
                                           "label": "A", "category": "direct_attributes", "image": hf_image("red")}])
    assert recs[0]["question"] == ("What colour is the cup?\nA. red\nB. blue\nAnswer with the option's letter from "
                                   "the given choices directly.")
    assert recs[0]["options"] == [("A", "red"), ("B", "blue")]
    rows = [{"question": "Which way?\nA. left\nB. right\nPlease answer directly with only the letter of the correct "
                         "option and nothing else.", "answer": "B", "image": hf_image("red")},
            {"question": "How many cars?", "answer": "3", "image": hf_image("blue")}]
    _, recs, _ = conv(tmp_path, "realworldqa", rows)
    assert recs[0]["answer_type"] == "letter" and recs[0]["options"] == [("A", "left"), ("B", "right")]
    assert recs[1]["answer_type"] == "text" and recs[1]["answer"] == "3"


def test_image_paths_base64_and_errors(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png("red"))
    rows = [{"question": "q?", "answer": "1", "type": "human_test", "image": "a.png"},
            {"question": "r?", "answer": "2", "type": "human_test", "image": base64.b64encode(png("blue", (9, 9))).decode()}]
    _, recs, out = conv(tmp_path, "chartqa", rows, image_dir=str(tmp_path / "imgs"))
    assert Image.open(recs[0]["image"]).size == (8, 8) and Image.open(recs[1]["image"]).size == (9, 9)
    before = open(out).read()
    with pytest.raises(ConvertError, match="exists; pass --overwrite"):
        convert("chartqa", str(tmp_path / "chartqa_src.jsonl"), out, image_dir=str(tmp_path / "imgs"))
    assert open(out).read() == before
    convert("chartqa", str(tmp_path / "chartqa_src.jsonl"), out, image_dir=str(tmp_path / "imgs"), overwrite=True,
            limit=1)
    assert len(read_any(out)) == 1
    two = str(tmp_path / "two.jsonl")
    convert("chartqa", [str(tmp_path / "chartqa_src.jsonl")] * 2, two, image_dir=str(tmp_path / "imgs"))
    assert len(read_any(two)) == 4                                   # several --src files, in order
    with pytest.raises(ConvertError, match="missing column"):
        conv(tmp_path / "m", "pope", [{"question": "q"}])
    with pytest.raises(ConvertError, match="not a file under"):
        conv(tmp_path / "n", "chartqa", [{"question": "q", "answer": "1", "image": "nope.png"}])
    bad = {"bytes": base64.b64encode(b"not an image " * 10).decode(), "path": None}
    with pytest.raises(ConvertError, match="not a readable image"):
        conv(tmp_path / "b", "chartqa", [{"question": "q", "answer": "1", "image": bad}])
    assert not os.path.exists(tmp_path / "b" / "out" / "chartqa.jsonl")
    with pytest.raises(ConvertError, match="duplicate id"):
        conv(tmp_path / "d", "textvqa", [{"question_id": 1, "question": "q", "answers": ["a"]}] * 2)


def test_cli_errors_exit_2(tmp_path, capsys):
    src = write_jsonl(tmp_path / "s.jsonl", [{"question": "q", "answer": "1", "image": hf_image("red")}])
    out = str(tmp_path / "o.jsonl")
    assert len(main(["--benchmark", "chartqa", "--src", src, "--out", out])) == 1
    from common.cli import run_cli
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--benchmark", "chartqa", "--src", src, "--out", out])
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err


def test_read_rows_shapes(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps({"p1": {"question": "a"}, "p2": {"question": "b"}}))
    assert read_rows(str(tmp_path / "d.json")) == [{"id": "p1", "question": "a"}, {"id": "p2", "question": "b"}]
    (tmp_path / "e.json").write_text(json.dumps({"data": [{"question": "c"}]}))
    assert read_rows(str(tmp_path / "e.json")) == [{"question": "c"}]
    assert concat_images([Image.new("RGB", (2, 3)), Image.new("RGB", (4, 1))]).size == (6, 3)


def test_parquet_needs_pyarrow_or_says_so(tmp_path):
    p = tmp_path / "x.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        p.write_bytes(b"PAR1")
        with pytest.raises(ConvertError, match="pip install pyarrow"):
            read_rows(str(p))
        pytest.skip("pyarrow is not installed (optional): parquet reading checked only for its error")
    rows = [{"question_id": 1, "question": "Is there a cat?", "answer": "no", "category": "random",
             "image": {"bytes": png("red"), "path": "x.png"}}]
    pq.write_table(pa.Table.from_pylist(rows), str(p))
    out = str(tmp_path / "pope.jsonl")
    convert("pope", str(p), out)
    recs = read_any(out)
    assert recs[0]["answer"] == "no" and Image.open(recs[0]["image"]).size == (8, 8)
