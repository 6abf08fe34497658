"""Readers, batched evaluation, option log-likelihood scoring and the eval entry point on a
tiny random Qwen3-VL saved and reloaded through the real-checkpoint loader."""
import json
import os

import pytest
import torch

from common.backbone import build_tiny, load_backbone, save_backbone
from common.data import DataError, load_image
from common.shapes import generate_split
from helpers import logits_tol, tol
from eval.evaluate import (evaluate, family_rows, loglik_prefix, main, majority_answers, majority_rows, options_of,
                           score_options)
from eval.readers import parse_options, read_any, read_jsonl


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint dir, model loaded back with load_backbone, its proc, data dir)."""
    root = tmp_path_factory.mktemp("eval")
    model, proc = build_tiny("qwen3_vl", seed=0)
    ckpt = str(root / "tiny")
    save_backbone(model, proc, ckpt)
    loaded, lproc = load_backbone(ckpt)
    generate_split(str(root / "data"), "val", 8)
    # the loader round trip: identical logits on a real batch
    img = load_image(str(root / "data" / "images" / "val_000000.png"))
    batch = proc.encode([img, img], ["Is there a red circle?", "How many squares are there?"], ["yes", "2"])
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**lproc.encode(
            [img, img], ["Is there a red circle?", "How many squares are there?"], ["yes", "2"])).logits)
    return ckpt, loaded, lproc, str(root / "data")


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_readers(tmp_path, saved):
    _, _, _, data = saved
    llava = read_any(os.path.join(data, "val.json"))
    assert len(llava) == 8 and set(llava[0]) >= {"id", "image", "question", "target", "answer", "family",
                                                 "conversations"}
    img = llava[0]["image"]
    rows = [{"id": "q1", "image": img, "question": "Is there a dog?", "answer": "yes", "family": "existence"},
            {"id": "q2", "image": img, "question": "Which animal?", "answer": "dog", "options": ["cat", "dog"]},
            {"id": "q3", "image": img, "question": "Which? A. cat B. dog", "answer": "B", "options": ["cat", "dog"]}]
    _write_jsonl(tmp_path / "b.jsonl", rows)
    recs = read_any(str(tmp_path / "b.jsonl"))
    assert [r["id"] for r in recs] == ["q1", "q2", "q3"] and set(recs[0]) == set(llava[0])
    assert recs[0]["target"] == "yes" and recs[0]["conversations"][0]["value"] == "<image>\nIs there a dog?"
    q2 = recs[1]
    assert q2["family"] == "unlabelled" and q2["answer"] == "B"             # option text -> letter
    assert q2["question"] == "Which animal? A. cat B. dog Answer with the letter."
    assert q2["options"] == [("A", "cat"), ("B", "dog")] and recs[2]["question"] == "Which? A. cat B. dog"
    assert parse_options("Which is at the top? A. red circle B. blue square C. x D. y Answer with the letter.")[
        1] == ("B", "blue square")
    assert parse_options("Is the B. cat here? A. no") == []                # letters must run A, B, ...
    for bad, msg in [({"id": "q9", "image": img, "question": "?"}, r"record q9 lacks required field\(s\) \['answer'\]"),
                     ({"id": "q8", "image": "nope.png", "question": "?", "answer": "a"}, "record q8: image .*nope.png"),
                     ({"id": "q7", "image": img, "question": "?", "answer": "cow", "options": ["cat", "dog"]},
                      "record q7: answer 'cow'")]:
        _write_jsonl(tmp_path / "bad.jsonl", [bad])
        with pytest.raises(DataError, match=msg):
            read_jsonl(str(tmp_path / "bad.jsonl"))
    (tmp_path / "odd.jsonl").write_text('{"foo": 1}\n')
    with pytest.raises(DataError, match="neither 'conversations'"):
        read_any(str(tmp_path / "odd.jsonl"))


def test_evaluate_and_rows(saved):
    _, model, proc, data = saved
    recs = read_any(os.path.join(data, "val.json"))
    res = evaluate(model, proc, recs, batch_size=3, max_new_tokens=6)
    assert [r["id"] for r in res] == [r["id"] for r in recs]
    assert all(set(r) >= {"id", "family", "pred", "answer", "correct", "n_tokens"} for r in res)
    assert all(1 <= r["n_tokens"] <= 6 for r in res)
    # batching does not change greedy outputs
    assert [r["pred"] for r in evaluate(model, proc, recs[:3], batch_size=1, max_new_tokens=6)] == [
        r["pred"] for r in res[:3]]
    rows = family_rows("tiny", res)
    fams = list(dict.fromkeys(r["family"] for r in recs))
    assert [r["family"] for r in rows] == fams + ["all"] and rows[-1]["n"] == 8
    assert all(r["ci_low"] <= r["value"] <= r["ci_high"] for r in rows)


def test_majority_rows_hand_checked():
    recs = [{"family": "existence", "answer": a} for a in ("yes", "Yes", "no")] + \
           [{"family": "count", "answer": a} for a in ("3", "three", "2", "2")] + \
           [{"family": "colour", "answer": a} for a in ("Red", "red", "blue")]
    best = majority_answers(recs)
    assert best["existence"][0] == "yes" and best["colour"][0] == "red"
    assert best["count"][0] == "2"                                        # tie 2:2 with "3" -> alphabetical first
    # the constants are fitted on a reference split, never on the records scored: here the reference
    # says "no" / "3" and knows no colour, so the scored records (same as above) get other accuracies
    ref = [{"family": "existence", "answer": "no"}, {"family": "count", "answer": "three"}]
    rows = {r["family"]: r for r in majority_rows(recs, ref, model="best constant (train)")}
    assert all(r["model"] == "best constant (train)" and r["metric"] == "accuracy" for r in rows.values())
    assert rows["existence"]["value"] == pytest.approx(1 / 3) and rows["existence"]["n"] == 3
    assert rows["count"]["value"] == pytest.approx(2 / 4)
    assert rows["colour"]["value"] == 0                                     # no constant for colour
    assert rows["all"]["value"] == pytest.approx(3 / 10) and rows["all"]["n"] == 10
    one = majority_rows(recs[:1], ref)  # one question: not 1.000 (the old row was fitted on it)
    assert one[0]["value"] == 0


def test_score_options_matches_single_forward(saved):
    _, model, proc, data = saved
    recs = read_any(os.path.join(data, "val.json"))[:2]
    mc = [dict(r, family="mc", answer="B", question="Which object is at the top left? A. red circle "
               "B. blue square C. green triangle D. yellow circle Answer with the letter.") for r in recs]
    assert [L for L, _ in options_of(mc[0])] == list("ABCD")
    prefixes = [loglik_prefix("tl red circle, tc empty. Answer: B"), ""]
    assert prefixes[0] == "tl red circle, tc empty. Answer:"
    out = score_options(model, proc, mc, prefixes, batch_size=3)          # batches cut across records
    assert len(out[0]["scores"]) == 4 and out[0]["pred"] in "ABCD" and out[0]["answer"] == "B"
    # reference: option C of record 1 (empty prefix: continuation "C") in its own unpadded forward
    tok = lambda s: proc.tokenizer(s, add_special_tokens=False)["input_ids"]
    for i, sep in ((0, " "), (1, "")):
        pv, grid = proc.images([load_image(mc[i]["image"])])
        cont = tok(sep + "C")
        ids = proc.prompt_ids(mc[i]["question"], int(grid.prod()) // 4) + (tok(prefixes[i]) if prefixes[i] else [])
        ids = torch.tensor([ids + cont])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                           mm_token_type_ids=(ids == proc.image_token_id).long(), pixel_values=pv,
                           image_grid_thw=grid).logits
        logp = torch.log_softmax(logits.float(), -1)[0]
        L = ids.shape[1]
        ref = sum(float(logp[t - 1, ids[0, t]]) for t in range(L - len(cont), L))
        # two forwards of other shapes: each log-prob moves by at most 2 x the logits' error, plus the
        # log-softmax over the vocabulary and the sum over the continuation
        bound = (2 * len(cont) * logits_tol(model, L, logits)
                 + tol(torch.float32, logits.shape[-1] + len(cont), abs(ref)))
        assert out[i]["scores"][2] == pytest.approx(ref, rel=0, abs=bound)
    with pytest.raises(DataError, match="no options"):
        score_options(model, proc, [dict(recs[0], family="count")])


def test_score_options_can_pick_every_letter(saved):
    """A 5-option record is scored over all five letters and its gold E is E."""
    from eval.evaluate import pick_option
    _, model, proc, data = saved
    rec = dict(read_any(os.path.join(data, "val.json"))[0], family="mc", answer="E",
               options=[("A", "red circle"), ("B", "green square"), ("C", "red square"), ("D", "yellow circle"),
                        ("E", "blue square")])
    out = score_options(model, proc, [rec])[0]
    assert len(out["scores"]) == 5 and out["answer"] == "E" and out["correct"] == (out["pred"] == "E")
    opts = rec["options"]
    assert pick_option(opts, [-3.0, -2.0, -4.0, -5.0, -0.5], "E") == ("E", ["E"])
    assert pick_option(opts, [-3.0, -2.0, -4.0, -5.0, -2.5], ["E", "B"]) == ("B", ["E", "B"])
    assert pick_option(opts[:4], [-1.0, -1.0, -2.0, -3.0], "A") == ("A", ["A"])   # ties: first


def test_main_writes_table_and_json(saved, tmp_path, capsys):
    ckpt, _, _, data = saved
    recs = read_any(os.path.join(data, "val.json"))
    rows = [{"id": r["id"], "image": r["image"], "question": r["question"], "answer": r["answer"],
             "family": r["family"]} for r in recs[:4]]
    rows.append({"id": "o1", "image": recs[0]["image"], "question": "Which object is at the top left?",
                 "answer": "green triangle", "family": "mc",
                 "options": ["red circle", "blue square", "green triangle", "yellow circle"]})
    _write_jsonl(tmp_path / "bench.jsonl", rows)
    out = tmp_path / "res" / "e.json"
    ret = main(["--model", ckpt, "--data", str(tmp_path / "bench.jsonl"), "--max-new-tokens", "6",
                "--batch-size", "4", "--out", str(out), "--reference", os.path.join(data, "val.json")])
    printed = capsys.readouterr().out
    assert "| family | n | tiny | best constant (val.json) |" in printed and f"wrote {out}" in printed
    assert "option log-likelihood" in printed
    rep = json.loads(out.read_text())
    assert rep["rows"] == ret and len(rep["results"]) == 5 and len(rep["loglik"]) == sum(r["family"] == "mc" for r in rows)
    models = {(r["model"], r["metric"], r["family"]) for r in rep["rows"]}
    assert ("best constant (val.json)", "accuracy", "all") in models and ("tiny", "accuracy", "mc") in models
    assert ("tiny", "accuracy_loglik", "mc") in models
    assert rep["loglik"][-1]["id"] == "o1" and rep["loglik"][-1]["answer"] == "C"
    assert not any(p.name.startswith("e.json.tmp") for p in out.parent.iterdir())   # atomic write, no leftovers
