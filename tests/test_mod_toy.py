"""`python -m eval.toys.mod --part ...` drives every MoD experiment committed in eval/results/mod/:
each part is listed by --help, the main setting and the paper-rounds runs make the debate-lr calls
the pre-registered plan names (eval/logs/mod.md), --max-minutes stops new calls, and the results
part writes the result files from what is on disk."""
import json
import time

import pytest

from eval.toys import mod as toy_mod
from eval.toys import mod_claims
from eval.toys import mod_debate as toy_debate
from eval.toys import mod_mad as toy_mad

# every MoD experiment with a committed result or a logged command, by the part that runs it
PARTS = ("all", "mechanism", "debate", "debate-lr", "e2e", "mad-rounds", "mad-protocols", "main-a", "main-b",
         "main-report", "paper-rounds", "results")


def test_help_lists_every_part(capsys):
    with pytest.raises(SystemExit) as e:
        toy_mod.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for part in PARTS:
        assert f"{part}: " in text, f"--part {part} is not described in --help"
    assert "--max-minutes" in text


def test_max_minutes_is_refused_where_it_has_no_effect(capsys, tmp_path):
    for part in ("mechanism", "e2e", "results", "main-report"):
        with pytest.raises(SystemExit) as e:
            toy_mod.main(["--part", part, "--max-minutes", "5", "--out", str(tmp_path)])
        assert e.value.code == 2
        assert "--max-minutes goes with --part debate-lr" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.fixture
def calls(monkeypatch):
    """Record every run_lr call as (arms with their lr or None, seeds, tag, L rounds, train, n_test, steps,
    metrics); a fake clock advances one minute per call (so --max-minutes counts calls); the mix
    sweep writes its picks as run_lr would."""
    seen, clock = [], [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("main-a waited although base_val.json exists"))

    def fake_run_lr(data_dir, out_dir, base_name, S, L, log=print, deadline=None):
        clock[0] += 60
        picks = L["picks"] or {}
        seen.append(([(toy_debate.ARMS[a][0], picks.get(a)) for a in L["lr_arms"]], S["seeds"], L["tag"],
                     L["rounds"], L["train"], S["n_test"], S["steps"], L["metrics"]))
        if L["tag"] == "_mix_sweep":
            lroot = f"{out_dir}/debate/lr"
            with open(f"{lroot}/results_mix_sweep.json", "w") as fh:
                json.dump({"picks": {"MoD T_pos only": 5e-3, "MoD T_pos+T_rev": 1e-2}}, fh)
        return {}
    monkeypatch.setattr(toy_debate, "run_lr", fake_run_lr)
    # the report parts end with mod_claims.rebuild (tested in test_mod_claims.py): recorded, so no test
    # rewrites the committed result files
    monkeypatch.setattr(mod_claims, "rebuild", lambda results, log=print: seen.append(("rebuild", results)))
    return seen


def test_main_setting_parts_make_the_registered_calls(calls, tmp_path):
    """main-a / main-b / main-report: the order, lrs, seeds and tags of the deleted shell driver
    (eval/logs/mod.md, the main setting), 600 questions and 500 steps at fixed picks."""
    (tmp_path / "debate" / "lr").mkdir(parents=True)
    (tmp_path / "debate" / "lr" / "base_val.json").write_text("{}")
    out = ["--out", str(tmp_path)]
    toy_mod.main(["--part", "main-a"] + out)
    one = lambda arm, lr, s, rounds=(): ([(arm, lr)], (s,), "_step", rounds, True, 600, 500, toy_debate.METRICS)
    want = [one(arm, lr, s) for s in (0, 1, 2) for arm, lr in (("MoD", 1e-2), ("MoE-LoRA", 5e-3), ("LoRA", 5e-3))]
    want += [one("MoD", 1e-2, s, (2, 3)) for s in (0, 1, 2)] + [one("MoE-LoRA_window", 5e-3, s) for s in (0, 1, 2)]
    assert calls == want
    calls.clear()
    toy_mod.main(["--part", "main-b"] + out)
    sweep = ([("MoD_pos", None), ("MoD_pos_rev", None)], (0,), "_mix_sweep", (), True, 600, 300, toy_debate.METRICS)
    want = [sweep] + [one(arm, lr, s) for s in (0, 1, 2) for arm, lr in (("MoD_pos", 5e-3), ("MoD_pos_rev", 1e-2))]
    want += [one(arm, 1e-2, s) for arm in ("LoRA_r4", "MoD_shared") for s in (0, 1, 2)]
    assert calls == want
    calls.clear()
    toy_mod.main(["--part", "main-report"] + out)
    picks = [("MoD", 1e-2), ("MoE-LoRA", 5e-3), ("LoRA", 5e-3), ("LoRA_r4", 1e-2), ("MoE-LoRA_window", 5e-3),
             ("MoD_shared", 1e-2), ("MoD_pos", 5e-3), ("MoD_pos_rev", 1e-2)]
    assert calls == [(picks, (0, 1, 2), "_main", (2, 3), False, 600, 500, toy_debate.METRICS),
                     ("rebuild", "eval/results/mod")]


def test_max_minutes_starts_no_call_after_the_limit(calls, tmp_path, capsys):
    """Each fake call takes one minute: with --max-minutes 2.5 the calls starting at 0, 1 and 2
    minutes run, every later one is reported as not run; rerunning continues (everything is on disk)."""
    (tmp_path / "debate" / "lr").mkdir(parents=True)
    (tmp_path / "debate" / "lr" / "base_val.json").write_text("{}")
    toy_mod.main(["--part", "main-a", "--out", str(tmp_path), "--max-minutes", "2.5"])
    assert [c[0] for c in calls] == [[("MoD", 1e-2)], [("MoE-LoRA", 5e-3)], [("LoRA", 5e-3)]]
    out = capsys.readouterr().out
    assert out.count("--max-minutes reached") == 12 and "MoE-LoRA_window=0.005 seed 2 not run" in out


def test_main_report_without_the_mix_sweep_names_the_part_to_run(calls, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        toy_mod.main(["--part", "main-report", "--out", str(tmp_path)])
    assert e.value.code == 2 and "the data-mix sweep of --part main-b is not finished" in capsys.readouterr().err
    assert calls == []


def test_paper_rounds_part_makes_the_registered_calls(calls, tmp_path, monkeypatch):
    """paper-rounds: MoD at 1e-2 per seed (single round, MoD-Multi 1 round), MAD 1-3 rounds on the
    first 64 questions, MoD-Multi 2 rounds on the seeds run, then the report; as the deleted driver."""
    mad = []
    monkeypatch.setattr(toy_mad, "run", lambda data, out, model, n, rounds, log=print, deadline=None:
                        mad.append((n, rounds, len(calls))))
    toy_mod.main(["--part", "paper-rounds", "--out", str(tmp_path)])
    one = lambda seeds, rounds, train: ([("MoD", 1e-2)], seeds, "_paper_rounds", rounds, train, 600, 500, ("single",))
    assert calls == [one((0,), (1,), True), one((1,), (1,), True), one((2,), (1,), True),
                     one((0, 1, 2), (1, 2), False), one((0, 1, 2), (1, 2), False), ("rebuild", "eval/results/mod")]
    assert mad == [(64, (1, 2, 3), 3)]


def test_rerun_part_makes_the_registered_calls_in_the_registered_order(calls, tmp_path):
    """rerun (eval/logs/mod.md, 2026-12-02): MoD seeds 0-2 first with MoD-Multi 1-3 rounds, then main-a's
    order for the other arms, then main-b's; every call keeps its per-question scores in
    --results/main_per_question/main.json; last the claims rebuild."""
    (tmp_path / "debate" / "lr").mkdir(parents=True)
    res = str(tmp_path / "res")
    toy_mod.main(["--part", "rerun", "--out", str(tmp_path), "--results", res])
    one = lambda arm, lr, s, rounds=(): ([(arm, lr)], (s,), "_step", rounds, True, 600, 500, toy_debate.METRICS)
    want = [one("MoD", 1e-2, s, (1, 2, 3)) for s in (0, 1, 2)]
    want += [one(arm, 5e-3, s) for s in (0, 1, 2) for arm in ("MoE-LoRA", "LoRA")]
    want += [one("MoE-LoRA_window", 5e-3, s) for s in (0, 1, 2)]
    want += [([("MoD_pos", None), ("MoD_pos_rev", None)], (0,), "_mix_sweep", (), True, 600, 300, toy_debate.METRICS)]
    want += [one(arm, lr, s) for s in (0, 1, 2) for arm, lr in (("MoD_pos", 5e-3), ("MoD_pos_rev", 1e-2))]
    want += [one(arm, 1e-2, s) for arm in ("LoRA_r4", "MoD_shared") for s in (0, 1, 2)]
    assert calls == want + [("rebuild", res)]


def test_rerun_calls_keep_their_per_question_scores(monkeypatch, tmp_path):
    """Every (arm, seed) call of the main setting's drivers names the per-question file."""
    got = []
    monkeypatch.setattr(toy_debate, "run_lr", lambda *a, S, L, log=print, deadline=None: got.append(L["per_question"]))
    monkeypatch.setattr(mod_claims, "rebuild", lambda results, log=print: None)
    (tmp_path / "debate" / "lr").mkdir(parents=True)
    (tmp_path / "debate" / "lr" / "base_val.json").write_text("{}")
    toy_mod.main(["--part", "main-a", "--out", str(tmp_path), "--results", str(tmp_path / "r")])
    assert len(got) == 15 and set(got) == {str(tmp_path / "r" / "main_per_question" / "main.json")}


def test_results_part_writes_the_result_files_from_disk(tmp_path):
    """--part results end to end on a run folder with one protocol run per arm (two questions,
    seed 0): mad_protocols.json with the rows of protocol_rows and the command that reruns it;
    no paper-rounds scores: paper_rounds.json is not written."""
    runs = tmp_path / "out" / "protocols" / "runs"
    runs.mkdir(parents=True)
    for arm, correct in (("mod_single", [True, True]), ("mod_multi1", [True, False]), ("mad_du", [False, False])):
        res = [{"correct": c, "n_tokens": 10} for c in correct]
        (runs / f"{arm}_b64_s0.json").write_text(json.dumps({"arm": arm, "seed": 0, "batch_size": 64, "n": 2,
                                                             "wall_s": 1.0, "threads": 1, "results": res}))
    toy_mod.main(["--part", "results", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "res")])
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == ["mad_protocols.json"]
    got = json.loads((tmp_path / "res" / "mad_protocols.json").read_text())
    assert got["rows"] == toy_mad.protocol_rows(str(tmp_path / "out"))[0]
    assert got["source"].startswith("python -m eval.toys.mod --part mad-protocols --debate-seeds 0 --debate-test 2 "
                                    "--threads 1, then python -m eval.toys.mod --part results")


def test_debate_lr_starts_no_training_after_the_deadline(tmp_path, monkeypatch):
    """mod_debate.run_lr with a passed deadline: an unfinished sweep trains nothing and returns None
    (no pick from a partial grid); at fixed picks every missing (arm, seed) is reported as not run.
    Without a deadline the same call goes on to train (the check is what stops it)."""
    item = {"id": "t0", "family": "count", "correct": True, "n_tokens": 1}
    monkeypatch.setattr(toy_debate, "load_data", lambda *a: ([], [item], None, None))
    monkeypatch.setattr(toy_debate, "val_questions", lambda *a: ([], []))
    monkeypatch.setattr(toy_debate, "read_llava_json", lambda path: [])
    monkeypatch.setattr(toy_debate, "prepare", lambda *a: {"own_wrong": {}, "train_vs": []})
    monkeypatch.setattr(toy_debate, "json_samples", lambda *a: [])
    monkeypatch.setattr(toy_debate, "plain", lambda *a, **k: ([], 0.0))
    monkeypatch.setattr(toy_debate, "misled_own", lambda *a, **k: ([], 0.0))
    monkeypatch.setattr(toy_debate, "score_test", lambda *a, **k: {"single": [dict(item)]})

    class Trained(Exception):
        pass

    def fit(*a, **k):
        raise Trained
    monkeypatch.setattr(toy_debate, "fit", fit)
    monkeypatch.setattr(toy_debate, "attach", lambda *a: None)
    logs = []
    S = dict(toy_debate.SETTINGS, n_test=1)
    past = time.time() - 1
    sweep = dict(toy_debate.LR_SETTINGS, lrs=(1e-2, 2e-2))
    assert toy_debate.run_lr("d", str(tmp_path), "m", S=S, L=sweep, log=logs.append, deadline=past) is None
    assert sum("--max-minutes reached: sweep" in x for x in logs) == 4 and not (tmp_path / "debate" / "lr" / "results.json").exists()
    fixed = dict(toy_debate.LR_SETTINGS, picks={"MoD": 1e-2, "MoE-LoRA token": 5e-3})
    logs.clear()
    out = toy_debate.run_lr("d", str(tmp_path), "m", S=S, L=fixed, log=logs.append, deadline=past)
    assert [x.strip() for x in logs if "not run" in x] == [
        "MoD seed 0 at lr 0.01: not run (--max-minutes reached)",
        "MoE-LoRA token seed 0 at lr 0.005: not run (--max-minutes reached)"]
    assert out["test"] == {} and out["picks"] == fixed["picks"]   # nothing scored at the picks
    with pytest.raises(Trained):
        toy_debate.run_lr("d", str(tmp_path), "m", S=S, L=fixed, log=logs.append)


def test_debate_lr_adds_missing_metrics_and_keeps_per_question_scores(tmp_path, monkeypatch):
    """A scores file made for fewer metrics (the paper-rounds runs score the single round only) gets
    the other asked metrics from its adapters, and every scored (arm, seed) lands in the per-question
    file with its question ids and step-0 loss."""
    item = lambda i, c: {"id": f"t{i}", "family": "count", "correct": c, "n_tokens": 1}

    class Base:
        def eval(self):
            return self
    monkeypatch.setattr(toy_debate, "load_data", lambda *a: ([], [item(0, 1), item(1, 0)], Base(), None))
    monkeypatch.setattr(toy_debate, "val_questions", lambda *a: ([], []))
    monkeypatch.setattr(toy_debate, "read_llava_json", lambda path: [])
    monkeypatch.setattr(toy_debate, "prepare", lambda *a: {"own_wrong": {}, "train_vs": []})
    monkeypatch.setattr(toy_debate, "json_samples", lambda *a: [])
    monkeypatch.setattr(toy_debate, "load_adapters", lambda *a: None)
    monkeypatch.setattr(toy_debate, "plain", lambda *a, **k: ([], 0.0))
    monkeypatch.setattr(toy_debate, "misled_own", lambda *a, **k: ([], 0.0))
    asked = []

    def score_test(model, proc, test, own, base=False, metrics=toy_debate.METRICS):
        asked.append(tuple(metrics))
        return {m: [item(0, 0), item(1, 1)] for m in metrics}
    monkeypatch.setattr(toy_debate, "score_test", score_test)
    d = tmp_path / "debate" / "lr" / "MoD_lr0.01_s0"
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_text("")
    (d / "train.json").write_text(json.dumps({"loss": 0.1, "wall_s": 1.0}))
    (d / "log.jsonl").write_text(json.dumps({"loss": 0.0548412}) + "\n")
    (d / "scores_test2.json").write_text(json.dumps({"results": {"single": [item(0, 1), item(1, 0)]}}))
    pq = tmp_path / "pq" / "main.json"
    S = dict(toy_debate.SETTINGS, n_test=2)
    L = dict(toy_debate.LR_SETTINGS, lr_arms=("MoD",), picks={"MoD": 1e-2}, metrics=("single", "misled_ood"),
             per_question=str(pq))
    toy_debate.run_lr("d", str(tmp_path), "m", S=S, L=L, log=lambda *a: None)
    assert asked[-1] == ("misled_ood",)                      # only the missing metric is scored
    assert set(json.loads((d / "scores_test2.json").read_text())["results"]) == {"single", "misled_ood"}
    got = mod_claims.load_runs(str(pq))
    assert got["ids"] == {"test": ["t0", "t1"]}
    assert {(r["arm"], r["seed"], r["metric"], r["scores"], r["step0_loss"]) for r in got["rows"]} == {
        ("MoD", 0, "single", "10", 0.0548412), ("MoD", 0, "misled_ood", "01", 0.0548412)}
