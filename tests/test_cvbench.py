"""CV-Bench: eval.convert's cvbench converter on synthetic rows in the dataset's public schema
(nyu-visionx/CV-Bench test.jsonl / parquet exported to JSON) and eval.scores.score_cvbench,
whose 2D / 3D numbers are means of per-source accuracies (the dataset card's script)."""
import base64
import io
import json

import pytest
from PIL import Image

from common.data import read_any
from eval.convert import convert
from eval.scores import benchmark_scores, score_cvbench


def png(colour):
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, "PNG")
    return buf.getvalue()


def row(idx, kind, source, task, answer, n_choices=4, image=True):
    """One CV-Bench row as the hub's test.parquet holds it (exported to JSON by `datasets`)."""
    choices = [str(k) for k in range(n_choices)]
    prompt = f"How many cars are in the image? Select from the following choices.\n" + \
             "\n".join(f"({'ABCDE'[k]}) {c}" for k, c in enumerate(choices))
    r = {"idx": idx, "type": kind, "task": task, "source": source, "prompt": prompt, "choices": choices,
         "answer": f"({answer})", "question": "How many cars are in the image?", "source_dataset": source.lower(),
         "filename": f"img/{kind}/{task.lower()}/{source.lower()}_{idx}.png"}
    if image:
        r["image"] = {"bytes": base64.b64encode(png("red")).decode(), "path": None}
    return r


def test_convert_writes_lmms_eval_prompt_letter_answer_and_source(tmp_path):
    rows = [row(0, "2D", "ADE20K", "Count", "C"), row(1, "2D", "COCO", "Relation", "B", n_choices=2),
            row(0, "3D", "Omni3D", "Depth", "A", n_choices=2, image=False)]  # same idx as row 0: ids differ by type
    (tmp_path / "img" / "3D" / "depth").mkdir(parents=True)
    (tmp_path / "img" / "3D" / "depth" / "omni3d_0.png").write_bytes(png("blue"))  # test.jsonl + img/ layout
    src = tmp_path / "test.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "bench" / "cvbench.jsonl")
    written = convert("cvbench", str(src), out)
    recs = read_any(out)
    assert [r["id"] for r in recs] == ["2D_0", "2D_1", "3D_0"]
    assert written[0]["question"] == ("Note: You only need to respond with A, B, C, D without providing any additional "
                                      "information.\n\n" + rows[0]["prompt"])
    assert written[1]["question"].startswith("Note: You only need to respond with A, B without")
    assert [r["answer"] for r in recs] == ["C", "B", "A"]
    assert recs[0]["options"] == [("A", "0"), ("B", "1"), ("C", "2"), ("D", "3")]
    assert [r["meta"]["source"] for r in recs] == ["ADE20K", "COCO", "Omni3D"]
    assert [r["meta"]["type"] for r in recs] == ["2D", "2D", "3D"]
    assert [r["category"] for r in recs] == ["Count", "Relation", "Depth"]
    assert recs[0]["benchmark"] == "cvbench" and recs[0]["answer_type"] == "letter"
    assert Image.open(recs[2]["image"]).getpixel((0, 0)) == (0, 0, 255)  # the filename path under the src folder


def items(spec):
    """[(record, pred)] from [(source, type, gold, pred)]."""
    return [({"id": str(i), "answer": gold, "category": "Count", "meta": {"source": s, "type": t}}, pred)
            for i, (s, t, gold, pred) in enumerate(spec)]


def test_score_composes_2d_and_3d_from_per_source_accuracies():
    # ADE20K 1/2, COCO 4/4, Omni3D 1/3 (hand-computed below)
    spec = [("ADE20K", "2D", "A", "A"), ("ADE20K", "2D", "B", "C"),
            ("COCO", "2D", "A", "(A) two"), ("COCO", "2D", "B", "B."), ("COCO", "2D", "C", "c"), ("COCO", "2D", "D", "D"),
            ("Omni3D", "3D", "A", "A"), ("Omni3D", "3D", "B", "A"), ("Omni3D", "3D", "A", "The answer is A")]
    s = score_cvbench(items(spec))
    assert s["sources"] == {"ADE20K": 0.5, "COCO": 1.0, "Omni3D": pytest.approx(1 / 3)}
    assert s["accuracy_2d"] == pytest.approx(0.75)          # (0.5 + 1.0) / 2, not the record mean 5/6
    assert s["accuracy_2d_micro"] == pytest.approx(5 / 6)
    assert s["accuracy_3d"] == pytest.approx(1 / 3)         # "The answer is A" reads as T: wrong, as in lmms-eval
    assert s["overall"] == pytest.approx((0.75 + 1 / 3) / 2)
    assert s["missing_sources"] == [] and s["n"] == 9


def test_score_with_a_missing_source_or_type():
    s = score_cvbench(items([("COCO", "2D", "A", "A"), ("COCO", "2D", "A", "B")]))
    assert s["accuracy_2d"] == 0.5 and s["missing_sources"] == ["ADE20K"]
    assert "accuracy_3d" not in s and "overall" not in s
    with pytest.raises(ValueError, match="meta.source"):
        score_cvbench([({"id": "x", "answer": "A"}, "A")])


def test_converted_file_scores_through_benchmark_scores(tmp_path):
    rows = [row(0, "2D", "ADE20K", "Count", "A"), row(1, "2D", "COCO", "Count", "B"),
            row(2, "3D", "Omni3D", "Distance", "A", n_choices=2)]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "cvbench.jsonl")
    convert("cvbench", str(src), out)
    recs = read_any(out)
    s = benchmark_scores(recs, ["A", "A", "<think>B?</think>A"])["cvbench"]
    assert (s["accuracy_2d"], s["accuracy_3d"], s["overall"]) == (0.5, 1.0, 0.75)


def test_readme_path_convert_evaluate_score_on_tiny_dense(tmp_path):
    """mole/README.md, "Reproducing the paper's table", the CV-Bench lines on the tiny dense base:
    eval.convert -> eval.evaluate (its "benchmarks" field) -> eval.scores on the saved predictions."""
    from eval import convert as C
    from eval import evaluate, scores
    rows = [row(0, "2D", "ADE20K", "Count", "A"), row(1, "2D", "COCO", "Relation", "B", n_choices=2),
            row(2, "3D", "Omni3D", "Depth", "A", n_choices=2)]
    src = tmp_path / "test.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = str(tmp_path / "bench" / "cvbench.jsonl")
    C.main(["--benchmark", "cvbench", "--src", str(src), "--out", data])
    out = str(tmp_path / "scores" / "cvbench.json")
    evaluate.main(["--model", "tiny-dense", "--data", data, "--max-new-tokens", "4", "--out", out, "--threads", "1"])
    got = json.loads(open(out).read())["benchmarks"]["cvbench"]
    assert set(got) >= {"accuracy_2d", "accuracy_3d", "overall", "sources"} and got["n"] == 3
    assert got == scores.main(["--data", data, "--preds", out])["model"]["cvbench"]
