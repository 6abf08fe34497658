"""MoD's verdict rows rebuilt from per-question files (eval/toys/mod_claims.py): the two-level rule
decides (a hand-made case where the questions-only rule would say "supported"), pairing is
checked, a run is never silently replaced, rows without their runs keep their old numbers, and
`--part claims` rebuilds claims.json from the files alone."""
import json

import numpy as np
import pytest

from eval.metrics import bootstrap_ci, paired_bootstrap, verdict
from eval.report import check_verdict
from eval.toys import mod as toy_mod
from eval.toys import mod_claims as mc

H1 = "H1: MoD beats MoE-LoRA at equal parameters"


def _seed_scores():
    """Three seeds of 100 questions, MoD minus MoE-LoRA per seed +0.30, +0.02, +0.02 (every seed
    positive). Seed 0: MoD right on 30 questions MoE-LoRA misses; seeds 1-2: 11 questions MoD
    alone gets right, 9 MoE-LoRA alone (noisy, small effects)."""
    mod, moe = [], []
    for plus, minus in ((30, 0), (11, 9), (11, 9)):
        a = [1] * plus + [0] * minus + [1] * 20 + [0] * (80 - plus - minus)
        b = [0] * plus + [1] * minus + [1] * 20 + [0] * (80 - plus - minus)
        mod.append(a), moe.append(b)
    return mod, moe


def _files(tmp_path, mod, moe, seeds=(0, 1, 2)):
    ids = {"test": [f"q{i}" for i in range(len(mod[0]))]}
    runs = [{"arm": arm, "seed": s, "metric": "single", "ids": "test", "scores": sc[s]}
            for arm, sc in (("MoD", mod), ("MoE-LoRA token", moe)) for s in seeds]
    mc.save_runs(str(tmp_path / mc.MAIN), {"part": "main"}, ids, runs)
    old = [{"method": "MoD", "claim": H1, "verdict": "contradicted", "effect": "-0.054 [-0.077, -0.031]",
            "seeds": 3, "per_seed": "-0.035/-0.048/-0.078", "bootstrap": "questions", "top": True},
           {"method": "MoD", "claim": "more debate rounds keep helping", "verdict": "contradicted at rounds=3",
            "effect": "-0.151 [-0.182, -0.119]", "seeds": 3, "per_seed": "-", "bootstrap": "questions"}]
    (tmp_path / "claims.json").write_text(json.dumps({"experiment": "claims", "source": "old", "rows": old}))


def test_rebuilt_row_uses_the_two_level_rule_not_questions_only(tmp_path):
    mod, moe = _seed_scores()
    _files(tmp_path, mod, moe)
    # the questions-only rule on the seed-averaged item difference would support the claim
    pooled = paired_bootstrap(np.mean(mod, 0), np.mean(moe, 0))
    assert pooled["ci_low"] > 0.04 and verdict(dict(pooled, per_seed=[0.30, 0.02, 0.02])) == "supported"
    done, kept = mc.rebuild_claims(str(tmp_path), log=lambda *a: None)
    assert done == [H1] and kept == ["more debate rounds keep helping"]
    rows = json.loads((tmp_path / "claims.json").read_text())["rows"]
    row = rows[0]
    # two-level: a resample without seed 0 (8/27 of them) sits near +0.02 with question noise, so the CI reaches 0
    assert row["ci_low"] < 0 < row["ci_high"] and row["verdict"] == "inconclusive"
    assert row["n"] == 100 and row["per_seed"] == [0.3, 0.02, 0.02] and row["value"] == pytest.approx(0.34 / 3, abs=1e-6)
    assert row["bootstrap"] == mc.TWO_LEVEL and row["per_question"] == mc.MAIN and row["sign"] == 1
    assert row["effect"] == f"+0.113 [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]" and row["top"] is True
    check_verdict(row, "claims")                       # eval.report accepts the row it wrote
    assert rows[1]["effect"] == "-0.151 [-0.182, -0.119]"   # no multi3 runs: the old row stays as it was
    assert mc.SOURCE_NOTE in json.loads((tmp_path / "claims.json").read_text())["source"]


def test_a_missing_seed_keeps_the_old_row(tmp_path):
    mod, moe = _seed_scores()
    _files(tmp_path, mod, moe, seeds=(0, 1))
    done, _ = mc.rebuild_claims(str(tmp_path), log=lambda *a: None)
    assert done == []
    assert json.loads((tmp_path / "claims.json").read_text())["rows"][0]["verdict"] == "contradicted"


def test_claims_part_rebuilds_from_the_files_alone(tmp_path, capsys):
    mod, moe = _seed_scores()
    _files(tmp_path, mod, moe)
    toy_mod.main(["--part", "claims", "--results", str(tmp_path)])
    assert json.loads((tmp_path / "claims.json").read_text())["rows"][0]["verdict"] == "inconclusive"
    assert json.loads((tmp_path / "rerun_check.json").read_text())["total"] == 0   # nothing committed to compare


def test_pairing_is_checked(tmp_path):
    data = {"ids": {"a": ["q0", "q1"], "b": ["q1", "q0"]},
            "rows": [{"arm": "A", "seed": s, "metric": "m", "ids": "a", "scores": "10"} for s in (0, 1, 2)]
            + [{"arm": "B", "seed": s, "metric": "m", "ids": "b" if s == 2 else "a", "scores": "01"} for s in (0, 1, 2)]}
    with pytest.raises(ValueError, match="different questions in seed 2"):
        mc.compare(data, ("A", "m"), ("B", "m"))


def test_save_runs_never_replaces_silently(tmp_path):
    f = str(tmp_path / "pq.json")
    run = {"arm": "A", "seed": 0, "metric": "single", "ids": "test", "scores": [1, 0, 1]}
    mc.save_runs(f, {"part": "x"}, {"test": ["q0", "q1", "q2"]}, [run])
    mc.save_runs(f, {"part": "x"}, {"test": ["q0", "q1", "q2"]}, [run])          # the same run again: fine
    assert mc.load_runs(f)["rows"] == [dict(run, scores="101")]
    with pytest.raises(ValueError, match="other scores; pass --overwrite"):
        mc.save_runs(f, {"part": "x"}, {"test": ["q0", "q1", "q2"]}, [dict(run, scores=[1, 1, 1])])
    with pytest.raises(ValueError, match="ids 'test' differ"):
        mc.save_runs(f, {"part": "x"}, {"test": ["q0", "q2", "q1"]}, [run])
    mc.save_runs(f, {"part": "x"}, {"test": ["q0", "q1", "q2"]}, [dict(run, scores=[1, 1, 1])], overwrite=True)
    assert mc.load_runs(f)["rows"][0]["scores"] == "111"


def test_encode_decode():
    assert mc.encode([True, False, 1]) == "101" and mc.decode("101") == [1, 0, 1]
    assert mc.encode([0.25, 1.0]) == [0.25, 1.0] and mc.decode([0.25, 1]) == [0.25, 1.0]


def test_switch_rate_row_and_mechanism_sign(tmp_path):
    """The switch-rate claim: supported when the mean switch rate falls strictly with W; the
    window-vs-token claim is predicted negative (error), so a lower window error supports it."""
    ids = {f"seed{s}": f"sha1 x{s}" for s in range(3)}
    rate = {"token W=1": .5, "window W=4": .06, "window W=16": .03, "window W=64": .02}
    err = {"token W=1": [1.0, 0.8, 0.9, 0.7], "window W=16": [0.2, 0.1, 0.3, 0.2], "window W=4": [0.5] * 4,
           "window W=64": [0.6] * 4, "region W=16": [0.4] * 4}
    runs = [{"arm": arm, "seed": s, "metric": "test error", "ids": f"seed{s}", "switch_rate": rate.get(arm, .07),
             "scores": err[arm]} for arm in err for s in range(3)]
    mc.save_runs(str(tmp_path / mc.MECH / "stance.json"), {"part": "mechanism", "task": "stance"}, ids, runs)
    claims = [{"method": "MoD", "claim": c, "verdict": "supported", "effect": "old", "seeds": 3}
              for c in (mc.SWITCH_CLAIM, "window (momentum) routing beats token routing")]
    (tmp_path / "claims.json").write_text(json.dumps({"source": "old", "rows": claims}))
    mc.rebuild_claims(str(tmp_path), log=lambda *a: None)
    sw, win = json.loads((tmp_path / "claims.json").read_text())["rows"]
    assert sw["effect"] == "0.500 / 0.060 / 0.030 / 0.020" and sw["verdict"] == "supported"
    assert win["value"] == pytest.approx(-0.65) and win["sign"] == -1 and win["verdict"] == "supported"
    rate["window W=64"] = .04                                  # no longer monotone
    runs = [dict(r, switch_rate=rate.get(r["arm"], .07)) for r in runs]
    mc.save_runs(str(tmp_path / mc.MECH / "stance.json"), {"part": "mechanism", "task": "stance"}, ids, runs,
                 overwrite=True)
    mc.rebuild_claims(str(tmp_path), log=lambda *a: None)
    assert json.loads((tmp_path / "claims.json").read_text())["rows"][0]["verdict"] == "contradicted"


def test_reproduction_counts_equal_runs(tmp_path):
    (tmp_path / "mechanism.json").write_text(json.dumps({"rows": [
        {"kind": "arm", "task": "pairing", "arm": "MoD (dual routers), top-2 of 4+4", "seed": 0, "metric": "test error", "value": 0.25},
        {"kind": "arm", "task": "pairing", "arm": "LoRA rank 2", "seed": 0, "metric": "test error", "value": 0.9},
        {"kind": "arm", "task": "pairing", "arm": "LoRA rank 2", "seed": "pooled", "metric": "test error", "value": 0.9}]}))
    runs = [{"arm": "MoD (dual routers)", "seed": 0, "metric": "test error", "ids": "seed0", "scores": [0.25, 0.2501]},
            {"arm": "LoRA r=2", "seed": 0, "metric": "test error", "ids": "seed0", "scores": [0.9, 0.91]}]
    mc.save_runs(str(tmp_path / mc.MECH / "pairing.json"), {"part": "mechanism", "task": "pairing"},
                 {"seed0": "sha1 x"}, runs)
    rows = mc.write_check(str(tmp_path), log=lambda *a: None)
    assert [(r["arm"], r["equal"]) for r in rows] == [("LoRA r=2", False), ("MoD (dual routers)", True)]
    assert json.loads((tmp_path / "rerun_check.json").read_text())["equal"] == 1


def test_main_setting_comparisons_rebuilt_where_both_arms_have_every_seed(tmp_path):
    """H7 (MoD-Multi 2 rounds vs MoD-Single, one metric) has its runs: rebuilt by the two-level rule;
    H1 misled has no MoE-LoRA runs: its old numbers stay, marked as questions-only."""
    mod, moe = _seed_scores()
    ids = {"test": [f"q{i}" for i in range(100)]}
    runs = [{"arm": "MoD", "seed": s, "metric": m, "ids": "test", "scores": sc[s]}
            for m, sc in (("multi2", mod), ("single", moe)) for s in range(3)]
    mc.save_runs(str(tmp_path / mc.MAIN), {"part": "main"}, ids, runs)
    old = [{"kind": "compare", "hypothesis": "H7 MoD-Multi rounds=2 (three generations) > MoD-Single",
            "metric": "single", "value": 0.051, "ci_low": 0.023, "ci_high": 0.079, "verdict": "supported"},
           {"kind": "compare", "hypothesis": "H1 MoD > MoE-LoRA token", "metric": "misled_own", "value": -0.029,
            "ci_low": -0.062, "ci_high": 0.005, "verdict": "inconclusive"},
           {"kind": "arm", "arm": "MoD", "value": 0.633}]
    (tmp_path / "main_setting.json").write_text(json.dumps({"source": "old", "rows": old}))
    assert mc.rebuild_compare(str(tmp_path), log=lambda *a: None) == [
        "H7 MoD-Multi rounds=2 (three generations) > MoD-Single (single)"]
    once = json.loads((tmp_path / "main_setting.json").read_text())
    mc.rebuild_compare(str(tmp_path), log=lambda *a: None)            # a second rebuild changes nothing
    assert json.loads((tmp_path / "main_setting.json").read_text()) == once
    assert once["source"].count("Compare rows with a per_question field") == 1
    h7, h1, arm = once["rows"]
    assert h7["verdict"] == "inconclusive" and h7["ci_low"] < 0 and h7["bootstrap"] == mc.TWO_LEVEL
    assert h7["per_seed"] == [0.3, 0.02, 0.02] and h7["n"] == 100 and h7["seeds"] == 3
    check_verdict(h7, "main_compare")
    assert h1["value"] == -0.029 and h1["bootstrap"] == "questions" and arm == {"kind": "arm", "arm": "MoD", "value": 0.633}


def test_arm_rows_rebuilt_and_the_committed_values_kept_for_the_check(tmp_path):
    """An arm with every seed in the per-question file: per-seed accuracy, pooled mean with the
    bootstrap CI of the seed-averaged correctness, label marked "(rerun)"; the registered run's
    numbers stay under "committed", which the reproduction check reads (twice the same answer)."""
    runs = [{"arm": "MoD", "seed": s, "metric": "single", "ids": "test", "scores": sc}
            for s, sc in enumerate(([1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]))]
    mc.save_runs(str(tmp_path / mc.MAIN), {"part": "main"}, {"test": ["q0", "q1", "q2", "q3"]}, runs)
    arm = lambda seed, v: {"kind": "arm", "arm": "MoD", "label": "MoD, lr 1e-2", "metric": "single", "seed": seed,
                           "value": v, "n": 4}
    base = {"kind": "arm", "arm": "frozen base", "label": "frozen base", "metric": "single", "seed": "pooled",
            "value": 0.5, "n": 4}
    rows = [dict(arm("pooled", 0.25), ci_low=0.0, ci_high=0.5), arm(0, 0.5), arm(1, 0.25), arm(2, 0.0), base]
    (tmp_path / "main_setting.json").write_text(json.dumps({"source": "old", "rows": rows}))
    for _ in range(2):
        assert mc.rebuild_arms(str(tmp_path), log=lambda *a: None) == [("MoD", "single")]
    pooled, s0, s1, s2, b = json.loads((tmp_path / "main_setting.json").read_text())["rows"]
    assert (s0["value"], s1["value"], s2["value"]) == (0.5, 0.25, 0.75)
    assert pooled["value"] == 0.5 and pooled["label"] == "MoD, lr 1e-2 (rerun)" and pooled["n"] == 4
    assert (pooled["ci_low"], pooled["ci_high"]) == tuple(round(x, 3) for x in bootstrap_ci([1, 2 / 3, 1 / 3, 0]))
    assert pooled["committed"] == {"value": 0.25, "ci_low": 0.0, "ci_high": 0.5, "n": 4} and b == base
    check = {(r["seed"], r["committed"], r["equal"]) for r in mc.reproduction(str(tmp_path))}
    assert check == {(0, 0.5, True), (1, 0.25, True), (2, 0.0, False)}
