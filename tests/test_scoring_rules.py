"""Scoring edge cases and the data contract's scoring rule (eval/README.md, "Records").

Each test is a reported case: `pope_prf([], [])` raised a numpy TypeError; `anls_lmms` used
`len(s)` where lmms-eval uses `len(s.upper())`; a canonical record with options and no
family was free text in generation but multiple choice by log-likelihood; unlabelled records
were reported as the family "all", the aggregate row's name; a refusal named only the first
unsupported kind of a record."""
import json

import pytest

from common import data
from common.answers import UNLABELLED, is_multiple_choice, options_of, record_answer_type, score
from eval import scores as S
from eval.metrics import by_family, pope_prf


def test_pope_prf_of_nothing_is_zero():
    # was: TypeError: ufunc 'bitwise_and' not supported (np.array([]) is float64)
    assert pope_prf([], []) == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "accuracy": 0.0, "yes_ratio": 0.0,
                                "n": 0}
    m = pope_prf(["yes", "no", "yes"], ["yes", "yes", "no"])        # TP 1, FP 1, FN 1 (hand count)
    assert (m["precision"], m["recall"], m["f1"], m["n"]) == (0.5, 0.5, 0.5, 3)


def test_anls_lmms_uses_lmms_evals_upper_case_lengths():
    """lmms-eval (lmms_eval/api/metrics.py, `anls`, from Qwen-VL's infographicsvqa_eval):
    NL = levenshtein(norm(g), norm(p)) / max(len(g.upper()), len(p.upper())). "ß".upper() is
    "SS", so "Großstraße" is 12 long in the denominator: distance 2 (ss -> ß: one substitution,
    one deletion) / 12 -> 1 - 1/6 = 0.8333 (len() without upper(): 2 / 11 -> 0.8182)."""
    assert S.anls_lmms("Großstrasse", ["Großstraße"]) == pytest.approx(1 - 2 / 12)
    assert S.anls_lmms("Großstraße", "Großstrasse") == pytest.approx(1 - 2 / 12)   # symmetric in the lengths
    assert S.anls_lmms("hallo", ["Hello  "]) == pytest.approx(1 - 1 / 7)           # unnormalised length kept


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_one_rule_decides_the_answer_type(tmp_path):
    rows = [{"id": "o", "question": "Which animal barks?", "answer": "dog", "options": ["cat", "dog"]},
            {"id": "c", "question": "How many legs? ", "answer": "B", "options": ["2", "4"], "family": "count"},
            {"id": "t", "question": "Which animal?", "answer": "dog", "options": ["cat", "dog"],
             "answer_type": "text", "benchmark": "vqav2"},
            {"id": "f", "question": "Say hi", "answer": "hi"},
            {"id": "m", "question": "Which? A. cat B. dog", "answer": "A", "family": "mc"}]
    recs = {r["id"]: r for r in data.read_any(_jsonl(tmp_path / "a.jsonl", rows), image_root=str(tmp_path))}
    # 1. answer_type, 2. a known family, 3. options -> letter, 4. text
    assert {k: record_answer_type(r) for k, r in recs.items()} == {"o": "letter", "c": "number", "t": "text",
                                                                   "f": "text", "m": "letter"}
    # generation and log-likelihood agree: the records scored as letters are the ones --loglik scores
    assert [k for k, r in recs.items() if is_multiple_choice(r)] == ["o", "m"]
    o = recs["o"]
    assert score(o, "B. dog") == {"answer_type": "letter", "extracted": "B", "correct": True}   # was text: wrong
    assert score(o, "A") ["correct"] is False and options_of(o) == [("A", "cat"), ("B", "dog")]


def test_evaluate_scores_options_without_family_as_multiple_choice_both_ways(tmp_path):
    from eval import evaluate as ev
    rows = [{"id": "o1", "question": "Which animal barks?", "answer": "dog", "options": ["cat", "dog"]},
            {"id": "o2", "question": "Which is red?", "answer": "apple", "options": ["apple", "sky", "grass"]},
            {"id": "f1", "question": "Say hi", "answer": "hi"}]
    out = tmp_path / "r.json"
    ev.main(["--model", "tiny-dense", "--data", _jsonl(tmp_path / "a.jsonl", rows), "--max-new-tokens", "2",
             "--out", str(out), "--threads", "1"])
    saved = json.loads(out.read_text())
    types = {r["id"]: r["answer_type"] for r in saved["results"]}
    assert types == {"o1": "letter", "o2": "letter", "f1": "text"}
    assert [r["id"] for r in saved["loglik"]] == ["o1", "o2"]                       # the same records
    fams = {r["family"] for r in saved["rows"]}
    assert fams == {UNLABELLED, "all"}                                             # its own name, then the total
    n = {(r["metric"], r["family"]): r["n"] for r in saved["rows"]}
    assert n[("accuracy", UNLABELLED)] == 3 and n[("accuracy", "all")] == 3


def test_unlabelled_records_get_their_own_family_and_all_is_refused(tmp_path):
    recs = data.read_any(_jsonl(tmp_path / "a.jsonl", [{"id": "q", "question": "?", "answer": "x"}]))
    assert recs[0]["family"] == UNLABELLED == "unlabelled"
    llava = tmp_path / "l.json"
    llava.write_text(json.dumps([{"id": "l", "conversations": [{"from": "human", "value": "hi"},
                                                               {"from": "gpt", "value": "yo"}]}]))
    assert data.read_any(str(llava))[0]["family"] == UNLABELLED
    # a family called "all" would vanish into the aggregate row (by_family overwrites it): refused, named
    res = [{"family": "all", "correct": True}, {"family": "b", "correct": False}]
    assert by_family(res)["all"] == [True, False]                                  # the collision itself
    for path in (_jsonl(tmp_path / "b.jsonl", [{"id": "q", "question": "?", "answer": "x", "family": "all"}]),):
        with pytest.raises(data.DataError, match=r"record q: family 'all' is the name of the aggregate row"):
            data.read_any(path)


def test_a_refusal_names_every_unsupported_kind_at_once():
    recs = [{"id": "r1", "images": ["a", "b"], "image": "a", "history": [["q", "a"]]},     # both kinds at once
            {"id": "r2", "images": [], "image": None, "history": []}]
    with pytest.raises(data.DataError) as e:
        data.check_support(recs, "mod.infer", text_only=True)
    msg = str(e.value)
    assert msg.startswith("mod.infer: 1 record(s) with several images, e.g. ['r1']")
    assert "\n  and 1 record(s) with several question/answer turns, e.g. ['r1']" in msg   # the second kind too
    assert msg.endswith("(README, 'Records')") and msg.count("README") == 1
    # the advice fits the case: splitting helps only when each question is about one image
    assert "a question about several images together cannot be split" in msg and "mole.infer" in msg
    with pytest.raises(data.DataError) as e:
        data.check_support(recs, "rolemerge.calibrate")
    assert [k in str(e.value) for k in ("no image", "several images", "several question/answer turns")] == [True] * 3
    assert "e.g. ['r2']" in str(e.value)


def test_mod_infer_names_both_kinds_of_one_record_before_loading(tmp_path, capsys, monkeypatch):
    from common import shapes
    from helpers import error_of
    from mod import infer
    shapes.generate_split(str(tmp_path), "test", 2)
    img = str(tmp_path / json.loads((tmp_path / "test.json").read_text())[0]["image"])
    rec = {"id": "r1", "image": [img, img], "conversations": [
        {"from": "human", "value": "<image><image>\nSame shapes in both?"}, {"from": "gpt", "value": "yes"},
        {"from": "human", "value": "And colours?"}, {"from": "gpt", "value": "no"}]}
    (tmp_path / "two.json").write_text(json.dumps([rec]))
    monkeypatch.setattr(infer, "load_backbone", lambda *a, **k: pytest.fail("the model loaded before the check"))
    err = error_of(infer.main, ["--data", str(tmp_path / "two.json"), "--methods", "base"], capsys)
    assert "several images, e.g. ['r1']" in err and "several question/answer turns, e.g. ['r1']" in err


def test_every_entry_point_scores_a_reply_by_the_records_own_options_and_type():
    """mod.infer, mole.infer and rolemerge.infer once scored with is_correct(text, gold, family),
    without the record's options or answer_type, so an answer given as the option's text (or a
    yes/no benchmark record of an unknown family) counted as wrong there and right in
    eval.evaluate / eval.scores. One rule now: common.answers.is_correct_for."""
    from common.answers import is_correct, is_correct_for, score
    from mod.infer import _results
    mc = {"id": "q", "family": "mc", "answer": "A",
          "question": "Which object is at the top right? A. yellow triangle B. green square Answer with the letter."}
    pope = {"id": "p", "family": "adversarial", "answer_type": "yesno", "question": "Is there a dog?", "answer": "yes"}
    for r, text in ((mc, "yellow triangle"), (pope, "Yes, there is a dog.")):
        assert not is_correct(text, r["answer"], r["family"])          # the old call
        assert is_correct_for(r, text) and score(r, text)["correct"]    # the one rule
        assert _results([r], [text], [3])[0]["correct"]
    assert not is_correct_for(mc, "green square")
