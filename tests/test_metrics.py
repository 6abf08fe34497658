"""Answer extraction and metrics against hand-computed values."""
import numpy as np
import pytest

from eval.metrics import (accuracy, anls, anls_score, bootstrap_ci, by_family, extract, format_table, is_correct,
                          levenshtein, normalize, paired_bootstrap, pope_prf)


@pytest.mark.parametrize("text,answer_type,want", [
    ("B", "letter", "B"), ("(B)", "letter", "B"), ("B. cat", "letter", "B"), ("B)", "letter", "B"),
    ("Answer: B", "letter", "B"), ('{"Answer": "B"}', "letter", "B"),
    ('{"Reasoning": "the circle is top left", "Answer": "C"}', "letter", "C"),
    ('```json\n{"answer": "A"}\n```', "letter", "A"),
    ("tl red circle, tc empty, tr empty. Answer: D", "letter", "D"),
    ("The answer is C.", "letter", "C"), ("I pick (A) here", "letter", "A"), ("b", "letter", "B"),
    ("Bird", "letter", "bird"),                                   # no letter: normalised text, never a match
    ("Yes, there is.", "yesno", "yes"), ("tl empty. Answer: No.", "yesno", "no"), ("Nope", "yesno", "nope"),
    ("three", "number", "3"), ("Answer: 3 circles", "number", "3"), ("There are Ten.", "number", "10"),
    ("2.0", "number", "2"), ("1,000", "number", "1000"), ("0.5", "number", "0.5"), ("zero", "number", "0"),
    ("Answer: The Red.", "word", "red"), ("an apple pie!", "text", "apple pie"),
    ("x. Answer: first\nsecond line", "word", "first"),
])
def test_extract(text, answer_type, want):
    assert extract(text, answer_type) == want


def test_extract_unknown_type():
    with pytest.raises(ValueError, match="answer_type"):
        extract("B", "option")


def test_is_correct_by_family():
    assert is_correct("tl red circle, tc empty. Answer: three", "3", "count")
    assert is_correct("Answer: (B)", "B", "mc") and not is_correct("Answer: (B)", "C", "mc")
    assert is_correct("Answer: Yes", "yes", "existence") and is_correct("Answer: no.", "no", "spatial")
    assert is_correct("Answer: red.", "red", "colour") and not is_correct("Answer: blue", "red", "colour")
    # unknown family: normalised exact match (case, punctuation, articles ignored; no stemming)
    assert is_correct("Answer: The Cat.", "cat", "vqa") and not is_correct("Answer: cats", "cat", "vqa")
    assert normalize("The  Red, circle!") == "red circle"


def test_accuracy_and_by_family():
    res = [{"family": "a", "correct": True}, {"family": "b", "correct": False}, {"family": "a", "correct": False}]
    assert by_family(res) == {"a": [True, False], "b": [False], "all": [True, False, False]}
    assert accuracy([True, False, True, True]) == 0.75 and accuracy([]) == 0.0


def test_pope_six_items():
    # item:   0    1    2    3    4    5
    preds = ["yes", "yes", "yes", "no", "yes", "no"]
    golds = ["yes", "no", "no", "yes", "yes", "no"]
    # TP = {0, 4} = 2, FP = {1, 2} = 2, FN = {3} = 1, TN = {5} = 1
    m = pope_prf(preds, golds)
    assert m["precision"] == pytest.approx(2 / 4)
    assert m["recall"] == pytest.approx(2 / 3)
    assert m["f1"] == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))  # = 4/7
    assert m["f1"] == pytest.approx(4 / 7)
    assert m["accuracy"] == pytest.approx(3 / 6) and m["yes_ratio"] == pytest.approx(4 / 6) and m["n"] == 6
    # a non-yes/no prediction is a negative; no positives predicted -> precision 0, not NaN
    z = pope_prf(["maybe", "no"], ["yes", "no"])
    assert z["precision"] == 0.0 and z["recall"] == 0.0 and z["f1"] == 0.0 and z["accuracy"] == 0.5
    with pytest.raises(ValueError):
        pope_prf(["yes"], ["yes", "no"])


def test_anls_known_pairs():
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3
    assert anls_score("sitting", "kitten") == pytest.approx(1 - 3 / 7)     # NL = 3/7 < 0.5
    assert anls_score("abd", "abc") == pytest.approx(1 - 1 / 3)
    assert anls_score("ac", "ab") == 0.0                                  # NL = 0.5 is not < 0.5
    assert anls_score("abc", "xyz") == 0.0
    assert anls_score("Hello  World ", "hello world") == 1.0                # case and spaces ignored
    assert anls_score("abd", ["xyz", "abc"]) == pytest.approx(2 / 3)        # max over gold answers
    assert anls(["sitting", "abc", "ac"], ["kitten", "abc", "ab"]) == pytest.approx((4 / 7 + 1 + 0) / 3)


def test_bootstrap_ci():
    assert bootstrap_ci([1] * 20) == (1.0, 1.0) and bootstrap_ci([]) == (0.0, 0.0)
    x = [1] * 70 + [0] * 30
    lo, hi = bootstrap_ci(x, seed=0)
    assert bootstrap_ci(x, seed=0) == (lo, hi)                           # seeded
    # normal approximation: 0.7 +- 1.96 * sqrt(0.21 / 100) = [0.610, 0.790]
    assert 0.59 < lo < 0.63 and 0.77 < hi < 0.81


def test_paired_bootstrap():
    rng = np.random.default_rng(1)
    a = (rng.random(200) < 0.8).astype(int)
    b = a.copy()
    b[np.flatnonzero(a)[:50]] = 0                                         # B loses 50 items A gets right
    r = paired_bootstrap(a, b)
    assert r["diff"] == pytest.approx(50 / 200) and r["n"] == 200
    assert 0 < r["ci_low"] < 0.25 < r["ci_high"]                          # excludes 0
    same = paired_bootstrap(a, a)
    assert same["diff"] == 0.0 and same["ci_low"] <= 0.0 <= same["ci_high"]  # includes 0
    # the pairing matters: two independent systems of equal accuracy give a CI around 0
    c = (rng.random(200) < 0.8).astype(int)
    r2 = paired_bootstrap(a, c)
    assert r2["ci_low"] < r2["diff"] < r2["ci_high"]
    with pytest.raises(ValueError):
        paired_bootstrap([1, 0], [1])


def test_format_table():
    rows = [{"model": m, "family": f, "metric": "accuracy", "value": v, "ci_low": v - 0.1, "ci_high": v + 0.1, "n": 10}
            for m, f, v in [("tiny", "all", 0.5), ("tiny", "count", 0.4), ("majority", "count", 0.3),
                            ("majority", "all", 0.3)]]
    t = format_table(rows).splitlines()
    assert t[0] == "| family | n | tiny | majority |"
    assert t[2] == "| count | 10 | 0.400 [0.300, 0.500] | 0.300 [0.200, 0.400] |"
    assert t[3].startswith("| all | 10 | 0.500")                            # "all" last
