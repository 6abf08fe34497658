"""`python -m eval.quickstart --overwrite` stopped inside a stage, then rerun plainly.

Reported: `--overwrite` stopped with Ctrl-C in the MoD stage left the previous run's stage
records; the next plain rerun took 3 s, redid nothing and reported the old run's MoD /
RoleMerge / MoLE rows ("mod (an earlier run)"), and out/quickstart/mod/ mixed both runs'
adapters. Here the bases and the toys are stand-ins that tag their rows and files with the run
that made them; the quickstart's own stage logic runs unchanged."""
import json
import sys
import types

import pytest

from eval import evaluate as ev
from eval import quickstart as qs


def _fake_toy(name, run):
    """A toy module whose run() writes <run>.txt into its out_dir and returns one row tagged
    with the run; in run "fresh" the MoD toy is interrupted (KeyboardInterrupt = a 2nd Ctrl-C,
    or the trainer's stop mid-stage)."""
    def go(quick, data_dir, out_dir):
        import os
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, f"{run['id']}.txt"), "w").close()
        if run["id"] == "fresh" and name == "mod":
            raise KeyboardInterrupt
        return [{"model": f"{name}-{run['id']}", "family": "all", "metric": "accuracy", "value": 0.5,
                 "ci_low": None, "ci_high": None, "n": 1}]
    return types.SimpleNamespace(run=go, report_rows=lambda out: out)


@pytest.fixture
def stand_ins(monkeypatch):
    run = {"id": None}
    monkeypatch.setattr(qs.world, "ensure_splits", lambda *a, **k: None)
    monkeypatch.setattr(qs.data, "read_llava_json", lambda *a, **k: [])
    monkeypatch.setattr(qs, "fingerprint", lambda paths: "same bases")
    monkeypatch.setattr(qs.bb, "load_backbone", lambda name: (None, None))
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: [])
    monkeypatch.setattr(ev, "majority_rows", lambda *a, **k: [])
    monkeypatch.setattr(ev, "family_rows", lambda name, res: [
        {"model": f"{name}-{run['id']}", "family": "all", "metric": "accuracy", "value": 0.5, "ci_low": None,
         "ci_high": None, "n": 1}])
    for m in qs.METHODS:
        monkeypatch.setitem(sys.modules, f"eval.toys.{m}", _fake_toy(m, run))
    return run


def test_interrupted_fresh_run_is_continued_and_never_reports_an_earlier_run(tmp_path, stand_ins, capsys):
    run, out = stand_ins, tmp_path / "qs"
    argv = ["--out", str(out), "--data", str(tmp_path / "data"), "--threads", "1"]
    run["id"] = "old"
    qs.main(argv)                                                    # a complete earlier run
    assert {r["model"] for r in json.loads((out / "report.json").read_text())} >= {"mod-old", "mole-old"}
    run["id"] = "fresh"
    with pytest.raises(SystemExit) as e:
        qs.main(argv + ["--overwrite"])                              # stopped inside the MoD stage
    assert e.value.code == 130
    done = sorted(p.stem for p in (out / "stages").glob("*.json"))
    assert done == ["eval_tiny-chat", "eval_tiny-dense", "eval_tiny-moe"]   # the fresh run's, nothing older
    assert not (out / "report.json").exists()                        # no earlier report left to read
    capsys.readouterr()
    run["id"] = "rerun"
    qs.main(argv)                                                    # a plain rerun continues the fresh run
    printed = capsys.readouterr().out
    rows = {r["model"] for r in json.loads((out / "report.json").read_text())}
    assert not any(m.endswith("-old") for m in rows), rows           # was: mod-old, rolemerge-old, mole-old
    assert {"mod-rerun", "rolemerge-rerun", "mole-rerun", "tiny-dense-fresh", "tiny-moe-fresh"} <= rows
    assert printed.count("done in an earlier run") == 3              # the bases the fresh run finished
    for m in qs.METHODS:                                             # each method folder holds one run's files
        assert sorted(p.name for p in (out / m).iterdir()) == ["rerun.txt"], m
