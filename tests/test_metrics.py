"""Answer extraction and metrics against hand-computed values."""
import numpy as np
import pytest

from eval.metrics import (accuracy, anls, anls_score, bootstrap_ci, by_family, extract, format_table, is_correct,
                          levenshtein, normalize, paired_bootstrap, pope_prf, two_level_bootstrap,
                          two_level_task_equal_bootstrap, verdict, verdict_text)


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


def test_two_level_bootstrap_seeds_disagree():
    # per-seed effects +0.64 / -0.10 / +0.02, every question of a seed with the same difference, so the
    # question level adds nothing and a resample's mean is the mean of 3 seeds drawn with replacement:
    # 27 equally likely draws, all three = -0.10 has probability 1/27 = 3.7 % > 2.5 % (and all three
    # = +0.64 likewise), so the 95 % CI is exactly [-0.10, +0.64]; the effect is (0.64 - 0.10 + 0.02) / 3
    a = [[0.64] * 20, [-0.10] * 20, [0.02] * 20]
    b = [[0.0] * 20] * 3
    r = two_level_bootstrap(a, b)
    assert r["diff"] == pytest.approx(0.56 / 3) and r["per_seed"] == pytest.approx([0.64, -0.10, 0.02])
    assert r["ci_low"] == pytest.approx(-0.10) and r["ci_high"] == pytest.approx(0.64)
    assert r["seeds"] == 3 and r["n"] == 60 and r["bootstrap"] == "two-level (3 seeds, then questions)"
    assert verdict(r) == "inconclusive"
    # the question-only bootstrap of the same 60 pooled differences: 0.187 +- 1.96 * 0.32 / sqrt(60),
    # entirely above 0, i.e. the old rule's "supported"
    old = paired_bootstrap(sum(a, []), sum(b, []))
    assert 0.08 < old["ci_low"] < 0.14 and verdict(old) == "supported"


def test_two_level_bootstrap_resamples_questions_within_seeds():
    # two seeds, each with differences +1 / -1 alternating (mean 0): the seed level alone would give
    # [0, 0]; with the question level each drawn seed's mean has variance 1/20, their average 1/40,
    # so the CI is about 0 +- 1.96 * sqrt(1/40) = +-0.31
    a = [[1, 0] * 10, [1, 0] * 10]
    b = [[0, 1] * 10, [0, 1] * 10]
    r = two_level_bootstrap(a, b)
    assert r["diff"] == 0.0 and -0.40 < r["ci_low"] < -0.22 and 0.22 < r["ci_high"] < 0.40
    # paired: the same resampled questions for both arms, so equal arms give exactly [0, 0] however
    # much each arm's scores vary (independent resampling of A and B would not)
    x = [[1, 0, 0, 1, 1] * 8, [0, 1, 1, 0, 1] * 8, [1, 1, 0, 0, 0] * 8]
    same = two_level_bootstrap(x, x)
    assert same["ci_low"] == 0.0 and same["ci_high"] == 0.0 and verdict(same) == "inconclusive"
    assert two_level_bootstrap(a, b, seed=3) == two_level_bootstrap(a, b, seed=3)          # seeded


def test_two_level_bootstrap_one_seed_is_the_one_level_one():
    rng = np.random.default_rng(2)
    a, b = (rng.random(100) < 0.8).astype(int), (rng.random(100) < 0.5).astype(int)
    r = two_level_bootstrap([a], [b])
    p = paired_bootstrap(a, b)
    assert (r["diff"], r["ci_low"], r["ci_high"], r["n"]) == (p["diff"], p["ci_low"], p["ci_high"], p["n"])
    assert r["seeds"] == 1 and r["bootstrap"] == "one-level (1 seed: questions only)"
    assert verdict(r) == "supported" and verdict_text(r) == "supported (1 seed: questions-only bootstrap)"
    assert verdict_text(two_level_bootstrap([a, a], [b, b])) == "supported"


def test_two_level_bootstrap_bad_input():
    with pytest.raises(ValueError, match="2 seeds for A vs 1"):
        two_level_bootstrap([[1], [0]], [[1]])
    with pytest.raises(ValueError, match="seed 1 has"):
        two_level_bootstrap([[1], [0, 1]], [[1], [0]])
    with pytest.raises(ValueError, match="no seed"):
        two_level_bootstrap([], [])
    with pytest.raises(ValueError, match="seed 0 has"):
        two_level_bootstrap([[]], [[]])


def test_two_level_task_equal_bootstrap_seeds_disagree():
    # three seeds, two tasks of unequal size, every question of a task with the same difference (so the
    # question level adds nothing within a task):
    #   seed 0: task A 3 x (+1), task B 1 x 0      -> task-equal (1 + 0) / 2 = +0.5   (pooled +0.75)
    #   seed 1: task B 1 x (-1), task A 3 x 0      -> (0 - 1) / 2           = -0.5   (pooled -0.25)
    #   seed 2: task A 2 x (+1), task B 2 x 0      -> (1 + 0) / 2           = +0.5   (pooled +0.5)
    # effect (0.5 - 0.5 + 0.5) / 3 = 1/6 (seeds and tasks equal weight; pooled per seed it would be 1/3);
    # a resample's mean is that of 3 seeds drawn with replacement: all three = seed 1 has probability
    # 1/27 = 3.7 % > 2.5 %, all three at +0.5 8/27, so the 95 % CI is exactly [-0.5, +0.5]: inconclusive
    a = [[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 0, 0]]
    b = [[0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]]
    tasks = [["A", "A", "A", "B"], ["B", "A", "A", "A"], ["A", "A", "B", "B"]]
    r = two_level_task_equal_bootstrap(a, b, tasks)
    assert r["diff"] == pytest.approx(1 / 6) and r["per_seed"] == pytest.approx([0.5, -0.5, 0.5])
    assert r["ci_low"] == pytest.approx(-0.5) and r["ci_high"] == pytest.approx(0.5)
    assert (r["n"], r["tasks"], r["seeds"]) == (12, 2, 3) and r["bootstrap"] == "two-level (3 seeds, then questions)"
    assert verdict(r) == "inconclusive"
    # the per-question two-level rule on the same scores weighs seed 0's task A three times task B
    q = two_level_bootstrap(a, b)
    assert q["per_seed"] == pytest.approx([0.75, -0.25, 0.5]) and q["diff"] == pytest.approx(1 / 3)
    # 60 % band: the 20th / 80th percentiles of the 27 seed draws. Draw means (k seeds at +0.5, 3 - k
    # at -0.5): k = 0: -0.5 (1/27), k = 1: -1/6 (6/27), k = 2: +1/6 (12/27), k = 3: +0.5 (8/27);
    # cumulative 3.7 %, 25.9 %, 70.4 %, 100 %: the 20th percentile is -1/6, the 80th +0.5
    r = two_level_task_equal_bootstrap(a, b, tasks, level=0.6)
    assert r["ci_low"] == pytest.approx(-1 / 6) and r["ci_high"] == pytest.approx(0.5)


def test_two_level_task_equal_bootstrap_resamples_questions_within_tasks():
    # one seed (no seed level): task A 8 items with d = 1, task B 2 items with d = 0 -> every resample
    # of A is 1, of B 0: the CI collapses on (1 + 0) / 2 = .5 (resampling the 10 pooled items would not)
    tasks = ["A"] * 8 + ["B"] * 2
    r = two_level_task_equal_bootstrap([[1] * 8 + [1, 0]], [[0] * 8 + [1, 0]], [tasks])
    assert r["diff"] == pytest.approx(0.5) and r["ci_low"] == pytest.approx(0.5) and r["ci_high"] == pytest.approx(0.5)
    assert r["seeds"] == 1 and r["bootstrap"] == "one-level (1 seed: questions only)"
    # task B with d = +1 / -1: its resampled mean is -1, 0, +1 with prob 1/4, 1/2, 1/4, halved by the
    # equal weight: the replicate is .5 + {-.5, 0, +.5}, so the 95 % CI is [0, 1]
    r = two_level_task_equal_bootstrap([[1] * 8 + [1, 0]], [[0] * 8 + [0, 1]], [tasks], n_resamples=4000)
    assert r["diff"] == pytest.approx(0.5) and r["ci_low"] == pytest.approx(0.0) and r["ci_high"] == pytest.approx(1.0)
    # two seeds, each task alternating +1 / -1 (mean 0): the seed level alone would give [0, 0]; the
    # question level within each task widens it
    t2 = ["A"] * 10 + ["B"] * 10
    x, y = [[1, 0] * 10] * 2, [[0, 1] * 10] * 2
    r = two_level_task_equal_bootstrap(x, y, [t2, t2])
    assert r["diff"] == 0.0 and -0.40 < r["ci_low"] < -0.15 and 0.15 < r["ci_high"] < 0.40
    # paired: equal arms give exactly [0, 0] however much the scores vary
    z = [[1, 0, 0, 1, 1] * 4, [0, 1, 1, 0, 1] * 4]
    same = two_level_task_equal_bootstrap(z, z, [t2, t2])
    assert same["ci_low"] == 0.0 and same["ci_high"] == 0.0
    again = lambda: two_level_task_equal_bootstrap(x, y, [t2, t2], seed=3)
    assert again() == again()                                                               # seeded


def test_two_level_task_equal_bootstrap_bad_input():
    with pytest.raises(ValueError, match="2 seeds for A, 1 for B"):
        two_level_task_equal_bootstrap([[1], [0]], [[1]], [["A"], ["A"]])
    with pytest.raises(ValueError, match="no seed"):
        two_level_task_equal_bootstrap([], [], [])
    with pytest.raises(ValueError, match="seed 1 has"):
        two_level_task_equal_bootstrap([[1], [0, 1]], [[1], [0, 1]], [["A"], ["A"]])
    with pytest.raises(ValueError, match="seed 0 has"):
        two_level_task_equal_bootstrap([[]], [[]], [[]])
    with pytest.raises(ValueError, match="same tasks"):
        two_level_task_equal_bootstrap([[1, 0], [1, 0]], [[0, 0], [0, 0]], [["A", "B"], ["A", "C"]])


def test_verdict_needs_the_ci_and_every_seed_to_agree():
    cmp = lambda lo, hi, per: {"ci_low": lo, "ci_high": hi, "per_seed": per}
    assert verdict(cmp(0.01, 0.2, [0.1, 0.2, 0.01])) == "supported"
    assert verdict(cmp(0.01, 0.2, [0.1, 0.2, -0.01])) == "inconclusive"      # CI excludes 0, one seed disagrees
    assert verdict(cmp(0.01, 0.2, [0.1, 0.2, 0.0])) == "inconclusive"        # a seed at 0 shares no sign
    assert verdict(cmp(-0.01, 0.2, [0.1, 0.2, 0.1])) == "inconclusive"       # seeds agree, CI covers 0
    assert verdict(cmp(-0.2, -0.01, [-0.1, -0.2, -0.01])) == "contradicted"
    assert verdict(cmp(-0.2, -0.01, [-0.1, -0.2, 0.01])) == "inconclusive"
    # sign -1: the claim is "B - A > 0" (e.g. an error rate, lower is better)
    assert verdict(cmp(-0.2, -0.01, [-0.1, -0.2, -0.01]), sign=-1) == "supported"
    assert verdict(cmp(0.01, 0.2, [0.1, 0.2, 0.01]), sign=-1) == "contradicted"
    assert verdict({"ci_low": 0.01, "ci_high": 0.2}) == "supported"           # no per-seed effects: the CI alone
    # ten seeds, nine at +0.3 and one at -0.01: the two-level CI excludes 0 (the 2.5 % resample draws the
    # negative seed 3 times: (7 * 0.3 - 3 * 0.01) / 10 = 0.207 > 0), yet one seed disagrees: inconclusive
    r = two_level_bootstrap([[0.3] * 5] * 9 + [[-0.01] * 5], [[0.0] * 5] * 10)
    assert r["ci_low"] > 0.15 and verdict(r) == "inconclusive"
    assert verdict(dict(r, per_seed=[0.3] * 10)) == "supported"


def test_format_table():
    rows = [{"model": m, "family": f, "metric": "accuracy", "value": v, "ci_low": v - 0.1, "ci_high": v + 0.1, "n": 10}
            for m, f, v in [("tiny", "all", 0.5), ("tiny", "count", 0.4), ("majority", "count", 0.3),
                            ("majority", "all", 0.3)]]
    t = format_table(rows).splitlines()
    assert t[0] == "| family | n | tiny | majority |"
    assert t[2] == "| count | 10 | 0.400 [0.300, 0.500] | 0.300 [0.200, 0.400] |"
    assert t[3].startswith("| all | 10 | 0.500")                            # "all" last
