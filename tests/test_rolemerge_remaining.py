"""The remaining RoleMerge rows of eval/toys/rolemerge.py (Tables 3 / 14 / 15 A, App. F, App. D.2):
row builders, the per-task equal-weight bootstrap, the calibration-audit cells and the --part
command line, on hand-computed cases (no model runs)."""
import json

import pytest
import torch

from eval.toys import rolemerge as toy

ONES, ZEROS = [1] * 20, [0] * 20
HALF = [1] * 10 + [0] * 10


def _res(arms, name="b", rhos=(0.5,), families=None):
    """A run_paper result dict: arms {arm: per-question list} at every rho, 20 questions."""
    r = {"base": f"x/{name}", "config": {"rhos": list(rhos)}, "families": families or ["f"] * 20,
         "arms": {"full": {"correct": ONES}}}
    for a, v in arms.items():
        for rho in rhos:
            r["arms"][f"{a}@{rho}"] = {"correct": list(v), "K": 2}
    return r


def test_task_equal_bootstrap_weights_tasks_equally():
    # one base, task A: 8 items, RoleMerge right on all, REAP on none (d = 1); task B: 2 items, d = 0.
    # equal weight: (1 + 0) / 2 = .5; pooled over items it would be 8 / 10 = .8. Every resample of
    # task A is 1, of task B 0 (questions resampled within each task): the CI collapses onto .5
    tasks = ["A"] * 8 + ["B"] * 2
    r = _res({"rolemerge": [1] * 8 + [1, 0], "reap": [0] * 8 + [1, 0]}, families=tasks)
    d = toy.task_equal_bootstrap([r], "rolemerge@0.5", "reap@0.5")
    assert d["diff"] == pytest.approx(0.5) and d["n"] == 10 and d["tasks"] == 2 and d["seeds"] == 1
    assert d["ci_low"] == pytest.approx(0.5) and d["ci_high"] == pytest.approx(0.5)
    # a second base with the families listed in another order: each base is one seed, its tasks equal
    r2 = _res({"rolemerge": [1, 1] + [0] * 8, "reap": [0, 1] + [0] * 8}, name="c", families=["B"] * 2 + ["A"] * 8)
    d = toy.task_equal_bootstrap([r, r2], "rolemerge@0.5", "reap@0.5")
    assert d["per_seed"] == pytest.approx([0.5, 0.25]) and d["diff"] == pytest.approx(0.375) and d["seeds"] == 2
    with pytest.raises(ValueError, match="same tasks"):
        toy.task_equal_bootstrap([r, _res({"rolemerge": ONES[:10], "reap": ONES[:10]}, families=["C"] * 10)],
                                 "rolemerge@0.5", "reap@0.5")


def test_bootstrap_rows_against_the_example_level_rule():
    fam = ["A"] * 16 + ["B"] * 4
    # RoleMerge right on all of A, wrong on all of B; REAP the reverse: per question +12/20 = .6,
    # equal-weight (1 + -1) / 2 = 0
    r = _res({"rolemerge": [1] * 16 + [0] * 4, "reap": [0] * 16 + [1] * 4}, families=fam)
    rows = toy.bootstrap_rows([r])
    assert len(rows) == 1 and rows[0]["comparison"] == "RoleMerge - REAP" and rows[0]["rho"] == 0.5
    assert rows[0]["example_diff"] == pytest.approx(0.6) and rows[0]["example_verdict"] == "supported"
    assert rows[0]["diff"] == pytest.approx(0.0) and rows[0]["verdict"] == "inconclusive"
    assert rows[0]["bootstrap"] == "one-level (1 seed: questions only)"


def test_bootstrap_rows_two_level_when_bases_disagree():
    # three bases, task A 16 items and task B 4, every item of a task with the same difference:
    #   base 0: A +1, B 0  -> +0.5    base 1: A 0, B -1 -> -0.5    base 2: A +1, B 0 -> +0.5
    # effect 1/6, 95 % CI over the 27 base draws exactly [-0.5, +0.5]: inconclusive. Pooling the 60
    # items of the three bases per task (the old App. D.2 rule) gives A 2/3, B -1/3, CI [1/6, 1/6].
    fam = ["A"] * 16 + ["B"] * 4
    bases = [_res({"rolemerge": [1] * 16 + [1] * 4, "reap": [0] * 16 + [1] * 4}, name="s0", families=fam),
             _res({"rolemerge": [1] * 16 + [0] * 4, "reap": [1] * 16 + [1] * 4}, name="s1", families=fam),
             _res({"rolemerge": [1] * 16 + [1] * 4, "reap": [0] * 16 + [1] * 4}, name="s2", families=fam)]
    (row,) = toy.bootstrap_rows(bases, "log#x")
    assert row["per_seed"] == pytest.approx([0.5, -0.5, 0.5]) and row["diff"] == pytest.approx(1 / 6)
    assert row["ci_low"] == pytest.approx(-0.5) and row["ci_high"] == pytest.approx(0.5)
    assert row["verdict"] == "inconclusive" and row["seeds"] == "s0+s1+s2" and row["log"] == "log#x"
    assert row["per_base"] == "+0.500 / -0.500 / +0.500"
    # the per-question columns are the Table-1 rule (`compare`): per base .8 / -.2 / .8
    e = toy.compare(bases, "rolemerge@0.5", "reap@0.5")
    assert row["example_per_seed"] == pytest.approx([0.8, -0.2, 0.8]) == e["per_seed"]
    assert (row["example_ci_low"], row["example_ci_high"]) == (e["ci_low"], e["ci_high"])
    assert row["example_verdict"] == "inconclusive" and row["bootstrap"] == "two-level (3 seeds, then questions)"


def test_sensitivity_rows_hand_computed():
    km = {k: ONES if i < 3 else ZEROS for i, k in enumerate(toy.KMEANS_SEEDS)}   # 3 of 5 seeds right everywhere
    r = _res(dict({"rolemerge": ONES, "lambda0": ZEROS, "lambda01": ONES, "lambda10": HALF,
                   "average_link": HALF, "complete_link": HALF}, **km))
    rows = toy.sensitivity_rows([r], "log#x")
    by = {x.get("setting", x.get("claim")): x for x in rows}
    assert by["lambda = 0"]["acc_500"] == 0.0 and by["lambda = 0"]["delta_500"] == -1.0
    assert by["lambda = .10"]["acc_500"] == 0.5 and by["lambda = .10"]["per_seed_500"] == "0.500"
    k = by["k-means++ (5 seeds)"]
    # per question mean over seeds 3/5 = .6; seed accuracies 1, 1, 1, 0, 0 -> sample std sqrt(.3)
    assert k["acc_500"] == pytest.approx(0.6) and k["std_500"] == pytest.approx(0.3 ** 0.5)
    assert k["seed_accs_500"] == "1.000 / 1.000 / 1.000 / 0.000 / 0.000"
    assert by["S1 lambda .03 > 0"]["verdict"] == "supported at every rho"
    # lambda .01 identical to .03: CI [0, 0] inside +-.05 -> level; .10 is .5 behind -> not shown level
    assert by["S2 lambda .03 level with .01"]["verdict"] == "level at every rho"
    assert by["S2 lambda .03 level with .10"]["verdict"] == "not shown level at every rho"
    s3 = by["S3 single link > k-means++ (5 seeds)"]
    assert s3["effect"].startswith(".5: +0.400 [+0.400, +0.400]") and s3["per_seed"] == ".5: +0.400"


def test_search_rows_report_delta_j_and_swaps():
    r = _res({"rolemerge": HALF, "greedy_1swap": HALF, "greedy_swapc": ONES})
    r["arms"]["greedy_1swap@0.5"].update(J_greedy=4.0, J=3.0, swaps=2)
    r["arms"]["greedy_swapc@0.5"].update(J_greedy=4.0, J=1.0, swaps=5)
    rows = toy.search_rows([r])
    by = {x.get("claim", x.get("method")): x for x in rows}
    assert by["Greedy"]["dJ_500"] == 0.0 and by["Greedy"]["acc_500"] == 0.5
    assert by["Greedy+1Swap"]["dJ_500"] == pytest.approx(-0.25) and by["Greedy+1Swap"]["swaps_500"] == 2
    assert by["Greedy+SwapC"]["dJ_500"] == pytest.approx(-0.75) and by["Greedy+SwapC"]["delta_500"] == 0.5
    assert by["T1 Greedy+SwapC > Greedy"]["verdict"] == "supported at every rho"
    assert by["T1 Greedy+1Swap > Greedy"]["verdict"] == "inconclusive at every rho"


def test_audit_cells_and_subset_stats():
    cells = toy.audit_cells(["a", "b", "c"], dict(chunk=6, sizes=(6, 12), budget=12, rho=0.625), (0.5, 0.75))
    assert cells[:2] == [("size6", {"a": 6, "b": 6, "c": 6}, (0.5, 0.75)), ("size12", {"a": 12, "b": 12, "c": 12}, (0.5, 0.75))]
    assert ("src1:b", {"b": 12}, (0.625,)) in cells and ("src2:a+c", {"a": 6, "c": 6}, (0.625,)) in cells
    assert len(cells) == 2 + 3 + 3
    src = {f"{f}#{i}": {"counts": torch.full((1, 3, 2), float(10 * j + i)), "tokens": torch.tensor([1, 2, 3]),
                        "examples": 6} for j, f in enumerate("ab") for i in range(3)}
    stats = {"num_experts": 2, "sources": src}
    sub = toy.subset_stats(stats, {"a": 12, "b": 6}, 6)
    assert set(sub["sources"]) == {"a", "b"} and sub["num_experts"] == 2
    assert float(sub["sources"]["a"]["counts"][0, 0, 0]) == 0 + 1          # chunks a#0 + a#1
    assert float(sub["sources"]["b"]["counts"][0, 0, 0]) == 10             # chunk b#0
    assert sub["sources"]["a"]["examples"] == 12 and sub["sources"]["a"]["tokens"].tolist() == [2, 4, 6]
    with pytest.raises(ValueError, match="multiple of the chunk"):
        toy.subset_stats(stats, {"a": 5}, 6)
    with pytest.raises(ValueError, match="fewer"):
        toy.subset_stats(stats, {"a": 24}, 6)


def test_audit_rows_hand_computed():
    rhos = (0.5, 0.625, 0.75)
    r = _res({}, rhos=rhos)
    r["audit_meta"] = {"sizes": [12, 24, 60], "budget": 60, "rho": 0.625}
    r["audit"] = {f"size{n}@{rho}": {"correct": v} for n, v in ((12, ONES), (24, ONES), (60, HALF)) for rho in rhos}
    r["audit"].update({"src1:a@0.625": {"correct": ONES}, "src1:b@0.625": {"correct": ZEROS},
                       "src2:a+b@0.625": {"correct": ONES}})
    rows = toy.audit_rows([r])
    size = {x["examples_per_family"]: x for x in rows if x["kind"] == "cal_size"}
    assert size[60]["mean"] == 0.5 and size[60]["acc_625"] == 0.5 and size[24]["per_seed"] == "1.000"
    claims = {x["claim"]: x for x in rows if x["kind"] == "claim"}
    assert claims["F1 size 12 level with 24 (mean over rho)"]["verdict"] == "level"
    assert claims["F1 size 60 level with 24 (mean over rho)"]["verdict"] == "not shown level"
    src = {(x["sources"], x["set"]): x for x in rows if x["kind"] == "cal_sources"}
    # one source: a 1.0, b 0.0, mean .5; five sources = size12 at .625 = 1.0
    assert src[("one source", "mean of 2")]["acc"] == 0.5 and src[("five sources", "all five")]["acc"] == 1.0
    one = claims["F2 one source level with five (budget 60)"]
    assert one["effect"].startswith(".625: -0.500") and one["verdict"] == "not shown level"
    assert claims["F2 two sources level with five (budget 60)"]["verdict"] == "level"


def test_part_command_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        toy.main(["--part", "search"])
    assert e.value.code == 2 and "add --paper" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        toy.main(["--part", "bootstrap"])
    assert "--from FILE" in capsys.readouterr().err
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit):
        toy.main(["--part", "bootstrap", "--from", str(bad)])
    assert "not a per-question result file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        toy.main(["--from", str(bad)])
    assert "--from belongs to --part sensitivity / search / calibration / bootstrap, not table1" in capsys.readouterr().err


def test_part_bootstrap_writes_result_rows(tmp_path):
    f = tmp_path / "b.json"
    f.write_text(json.dumps(_res({"rolemerge": ONES, "reap": HALF}, families=["A"] * 10 + ["B"] * 10)))
    out = tmp_path / "r.json"
    toy.main(["--part", "bootstrap", "--from", str(f), "--results", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(x["arm"], x["diff"], x["verdict"]) for x in rows] == [("reap", 0.5, "supported")]


def test_parts_name_known_arms_with_the_paper_settings():
    for part, arms in toy.PARTS.items():
        assert all(a in toy.PAPER_ARMS for a in arms), part
    assert toy.PAPER_ARMS["lambda01"][3] == {"lam": 0.01} and toy.PAPER_ARMS["lambda10"][3] == {"lam": 0.10}
    assert [toy.PAPER_ARMS[k][3].get("seed", 0) for k in toy.KMEANS_SEEDS] == [0, 1, 2, 3, 4]
    assert "greedy_1swap" not in toy.TABLE1_ARMS and "lambda01" not in toy.TABLE1_ARMS


def test_audit_rows_of_the_source_subsets_without_new_calibration():
    r = _res({}, rhos=(0.5, 0.625, 0.75))
    r["audit_meta"] = {"source_rho": 0.625, "per_source": 24, "budget_matched": False}
    r["audit"] = {"src5:all@0.625": {"correct": HALF}, "src1:a@0.625": {"correct": HALF},
                  "src1:b@0.625": {"correct": HALF}, "src2:a+b@0.625": {"correct": ONES}}
    rows = toy.audit_rows([r])
    assert not [x for x in rows if x["kind"] == "cal_size"]                  # no size sweep in this mode
    src = {(x["sources"], x["set"]): x for x in rows if x["kind"] == "cal_sources"}
    assert src[("five sources", "all five")]["acc"] == 0.5 and src[("two sources", "a+b")]["acc"] == 1.0
    claims = {x["claim"]: x for x in rows if x["kind"] == "claim"}
    one = claims["F2 one source level with five (24 per source)"]
    assert one["verdict"] == "level" and one["effect"] == ".625: +0.000 [+0.000, +0.000]"
    two = claims["F2 two sources level with five (24 per source)"]
    assert two["verdict"] == "not shown level" and two["per_seed"] == ".625: +0.500"


def test_search_claims_t0_and_the_papers_reading():
    r = _res({"rolemerge": HALF, "greedy_1swap": ONES, "greedy_swapc": HALF}, rhos=(0.5, 0.75))
    for rho, (j1, jc) in zip((0.5, 0.75), ((3.0, 4.0), (2.0, 1.0))):
        r["arms"][f"greedy_1swap@{rho}"].update(J_greedy=4.0, J=j1, swaps=1)
        r["arms"][f"greedy_swapc@{rho}"].update(J_greedy=4.0, J=jc, swaps=1)
    by = {x["claim"]: x for x in toy.search_rows([r]) if x["kind"] == "claim"}
    assert by["T0 Greedy+1Swap lowers J"]["verdict"] == "holds at every rho"
    assert by["T0 Greedy+1Swap lowers J"]["effect"] == ".5: Delta J -25.0%; .75: Delta J -50.0%"
    assert by["T0 Greedy+SwapC lowers J"]["verdict"] == "fails at .5"
    t2 = next(v for k, v in by.items() if k.startswith("T2"))
    # Greedy+1Swap is ahead (+.5, CI above 0) at both rho: the paper's reading is not reproduced
    assert t2["verdict"] == "not reproduced" and "Greedy+1Swap supported at 2 rho" in t2["effect"]


def test_reuse_keeps_only_arms_whose_groups_replan_identically(tmp_path, monkeypatch):
    from rolemerge import model as rm
    from rolemerge import stats as rstats
    counts = torch.tensor([[[5., 3, 0, 1, 0, 2], [1, 0, 4, 2, 0, 1], [0, 2, 1, 0, 6, 1]]])   # [L=1, B=3, N=6]
    monkeypatch.setattr(rstats, "load_stats", lambda path: {"sources": {"a": {"counts": counts}}})
    same, _ = rm.plan(counts, 3, "rolemerge")
    other = [[[0, 1], [2, 3], [4, 5]]]
    assert other != same
    old = {"base": "x/b", "families": ["f"] * 2, "arms": {
        "full": {"correct": [1, 0]}, "rolemerge@0.5": {"K": 3, "groups": same, "correct": [1, 1]},
        "lambda0@0.5": {"K": 3, "groups": other, "correct": [0, 0]},
        "msmoe@0.5": {"K": 3, "groups": other, "correct": [0, 1]}}}
    f = tmp_path / "old.json"
    f.write_text(json.dumps(old))
    res = {"arms": {}}
    kept, dropped = toy._reuse(res, str(f), "stats", ("rolemerge", "lambda0", "msmoe"), (0.5,))
    assert kept == ["rolemerge@0.5"] and dropped == ["lambda0@0.5"]           # msmoe: a feature method, never reused
    assert res["arms"]["rolemerge@0.5"]["correct"] == [1, 1] and res["arms"]["full"]["correct"] == [1, 0]
    assert res["families"] == ["f", "f"] and "lambda0@0.5" not in res["arms"]


def test_reuse_flag_refuses_a_file_that_is_not_a_result_file(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as e:
        toy.main(["--part", "search", "--paper", "common/tiny/moe32", "--reuse", str(bad)])
    assert e.value.code == 2 and "--reuse" in capsys.readouterr().err


def test_max_minutes_starts_no_audit_cell_after_the_limit(tmp_path, monkeypatch):
    """--max-minutes: the source audit checks the clock before every cell; cells finished before
    the limit are on disk, the next one never starts (TimeUp), and a rerun continues."""
    base = tmp_path / "seed7"
    ck = tmp_path / "ckpt" / "seed7"
    ck.mkdir(parents=True)
    (ck / "stats.safetensors").write_bytes(b"")
    (tmp_path / "seed7.json").write_text(json.dumps({"base": str(base), "arms": {"rolemerge@0.5": {"correct": [1]}}}))
    monkeypatch.setattr(toy.rstats, "load_stats", lambda p: {"sources": {"a": 1, "b": 2, "c": 3}})
    monkeypatch.setattr(toy.rstats, "save_stats", lambda s, p: None)
    monkeypatch.setattr(toy.data, "read_llava_json", lambda p: [])
    monkeypatch.setattr(toy, "_base_cfg", lambda b, cfg: dict(cfg, max_new=8))
    clock, calls = [100.0], []

    def cell(*args):
        calls.append(args[-1])
        clock[0] += 60.0          # each cell takes a minute
        return {"correct": [1]}
    monkeypatch.setattr(toy, "_cell", cell)
    monkeypatch.setattr(toy.time, "time", lambda: clock[0])
    cfg = dict(toy.PAPER, n_cal=4, n_test=1, deadline=100.0 + 2 * 60.0 - 1)   # room for two cells
    with pytest.raises(toy.TimeUp):
        toy.run_source_audit(str(base), str(tmp_path), str(tmp_path), cfg, rho=0.5)
    assert len(calls) == 2
    saved = json.loads((tmp_path / "seed7.json").read_text())["audit"]
    assert sum(k.startswith(("src1:", "src2:")) for k in saved) == 2
    toy.run_source_audit(str(base), str(tmp_path), str(tmp_path), dict(cfg, deadline=None), rho=0.5)
    assert len(calls) == 6     # 3 single + 3 pair cells in all: the rerun ran only the 4 missing ones


def test_max_minutes_needs_the_paper_bases():
    with pytest.raises(SystemExit) as e:
        toy.main(["--max-minutes", "5"])
    assert e.value.code == 2


def test_remaining_claims_use_the_two_level_rule_when_bases_disagree():
    # three bases; rolemerge minus lambda0 is +1 on bases a and b and -.5 on base c (HALF vs ONES).
    # Pooled over the 60 questions: 40 differences of +1, 10 of 0, 10 of -1 -> mean +.5, CI far above 0
    # ("supported" under the registered pooled rule). Two-level: the bases disagree in sign, so the
    # verdict is "inconclusive" whatever the CI; and the CI reaches below 0 (all three draws are base c
    # with probability 1/27 > 2.5 %, and then the mean is about -.5)
    bases = [_res({"rolemerge": ONES, "lambda0": ZEROS}, name="a"), _res({"rolemerge": ONES, "lambda0": ZEROS}, name="b"),
             _res({"rolemerge": HALF, "lambda0": ONES}, name="c")]
    (claim,) = toy._diff_claim(bases, (0.5,), "rolemerge", "lambda0", "S1", "log#x", "greater")
    assert claim["verdict"] == "inconclusive at every rho" and claim["pooled_verdict"] == ".5: supported"
    assert claim["per_seed"] == ".5: +1.000 / +1.000 / -0.500"
    assert claim["bootstrap"] == "two-level (3 seeds, then questions)"
    assert claim["effect"].startswith(".5: +0.500 [-0.") and claim["pooled_effect"].startswith(".5: +0.500 [+0.")
    # the same numbers in the sensitivity table: lambda0 minus ours, two-level (lo, hi) and pooled (qlo, qhi)
    row = next(x for x in toy.sensitivity_rows(bases) if x.get("setting") == "lambda = 0")
    assert row["delta_500"] == pytest.approx(-0.5) and row["hi_500"] > 0 > row["qhi_500"]
    # level claims read the two-level CI too: identical arms on two bases, -.5 on the third
    (lev,) = toy._diff_claim(bases, (0.5,), "rolemerge", "rolemerge", "L", "", "level")
    assert lev["verdict"] == "level at every rho" and lev["pooled_verdict"] == ".5: level"


def test_parts_rebuild_their_rows_from_per_question_files(tmp_path):
    f = tmp_path / "a.json"
    f.write_text(json.dumps(_res({"rolemerge": ONES, "lambda0": ZEROS, "lambda01": ONES, "lambda10": HALF,
                                  "average_link": HALF, "complete_link": HALF,
                                  **{k: ONES for k in toy.KMEANS_SEEDS}})))
    out = tmp_path / "r.json"
    toy.main(["--part", "sensitivity", "--from", str(f), "--results", str(out)])
    got = json.loads(out.read_text())
    assert got["experiment"] == "rolemerge_sensitivity" and "--from" in got["source"]
    by = {x.get("setting", x.get("claim")): x for x in got["rows"]}
    assert by["lambda = 0"]["delta_500"] == -1.0 and by["S1 lambda .03 > 0"]["verdict"] == "supported at every rho"
    with pytest.raises(SystemExit):
        toy.main(["--part", "calibration", "--from", str(f)])
