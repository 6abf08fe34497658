"""No entry point replaces an existing output silently: run into an output that is already
there, each is refused (`error: ... --overwrite ...`, exit 2, nothing changed) or, where the
entry point continues runs by design, resumed. The model / checkpoint is a path that does not
exist: the refusal comes before anything loads, and with `--overwrite` the same command gets
past the output check (it then fails on the missing model instead). eval.evaluate runs twice for
real into one file."""
import importlib
import json
import os

import pytest

from common import shapes
from common.cli import run_cli
from helpers import error_of, snapshot

NOWHERE = "no-such-model-dir/x/y"   # never loads: the output check has to come first


def _file(path, text="{\"kept\": true}\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def _dir(path, *names):
    path.mkdir(parents=True, exist_ok=True)
    for n in names:
        (path / n).write_text('{"args": {}, "step": 1}')   # state.json: a checkpoint's, as far as the check reads
    return str(path)


# entry point -> (argv builder given (tmp, data file, existing output), how to make the existing output)
ENTRY_POINTS = {
    "eval.evaluate": (lambda t, d, o: ["--model", NOWHERE, "--data", d, "--out", o], "r.json"),
    "mod.infer": (lambda t, d, o: ["--model", NOWHERE, "--data", d, "--methods", "base", "--out", o], "r.json"),
    "mole.infer": (lambda t, d, o: ["--ckpt", NOWHERE, "--data", d, "--out", o], "r.json"),
    "mole.diagnostics": (lambda t, d, o: ["--ckpt", NOWHERE, "--data", d, "--out", o], "r.json"),
    "rolemerge.infer": (lambda t, d, o: ["--model", NOWHERE, "--data", d, "--out", o], "r.json"),
    "rolemerge.calibrate": (lambda t, d, o: ["--model", NOWHERE, "--data", d, "--out", o], "s.safetensors"),
    "rolemerge.merge": (lambda t, d, o: ["--model", "tiny-moe", "--stats", str(t / "none.safetensors"), "--rho", "0.5",
                                         "--out", o], "merged/"),
    "mod.data": (lambda t, d, o: ["--model", NOWHERE, "--data", d, "--out", o], "r.json"),
    "mod.train": (lambda t, d, o: ["--model", NOWHERE, "--data", d, "--out", o], "run/log.jsonl"),
    "mole.train": (lambda t, d, o: ["--model", NOWHERE, "--data", d, "--out", o], "run/state.json"),
    "eval.convert": (lambda t, d, o: ["--benchmark", "pope", "--src", str(t / "none.jsonl"), "--out", o], "c.jsonl"),
    "common.shapes": (lambda t, d, o: ["--out", o, "--n-train", "2", "--n-val", "2", "--n-test", "2"],
                      "shapes/train.json"),
    "eval.scores": (lambda t, d, o: ["--data", d, "--preds", str(t / "none.json"), "--out", o], "r.json"),
    "mod.params": (lambda t, d, o: ["--out", o], "r.json"),
    "eval.tools.bench_mod_decode": (lambda t, d, o: ["--out", o], "r.json"),
    "eval.tools.bench_mole": (lambda t, d, o: ["--out", o], "r.json"),
    "eval.tools.gpu_check": (lambda t, d, o: ["--out", o], "r.json"),
    "eval.tools.mole_params": (lambda t, d, o: ["--out", o], "r.json"),
    "eval.tools.kmeans_check": (lambda t, d, o: ["--sklearn-python", NOWHERE, "--out", o], "r.json"),
}
# continue an earlier run by design (each has its own test) rather than refuse it:
RESUMED = {"eval.quickstart": "reuses the stages an earlier run finished (test_quickstart_fresh)",
           "eval.tools.pretrain": "continues OUT.ckpt (test_pretrain)",
           "eval.tools.memory_plan": "skips the measurements already in --out",
           "eval.tools.lm_harness_check": "redoes only the missing steps",
           "eval.tools.lmms_check": "redoes only the missing steps",
           "eval.lm_harness": "continues a result file of the same settings, refuses other settings (test_lm_harness)"}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    shapes.generate_split(str(d), "test", 2)
    return str(d / "test.json")


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_existing_output_is_refused_before_anything_loads(module, data_file, tmp_path, capsys):
    build, kind = ENTRY_POINTS[module]
    work = tmp_path / "w"
    target = work / kind.rstrip("/")
    if kind.endswith("/"):
        out = _dir(target, "rolemerge_report.json")
    elif "/" in kind and module != "common.shapes":
        out = _dir(target.parent, target.name)       # a run folder holding a run's file
    elif module == "common.shapes":
        out = _dir(target.parent, "train.json")
    else:
        out = _file(target)
    before = snapshot(work)
    main = importlib.import_module(module).main
    err = error_of(lambda argv: run_cli(main, argv), build(tmp_path, data_file, out), capsys)
    assert "--overwrite" in err and "error:" in err, err
    assert NOWHERE not in err and "none." not in err, err       # refused before the model or inputs were read
    assert snapshot(work) == before                                # nothing changed, nothing added
    argv = build(tmp_path, data_file, out)
    if any(NOWHERE in x or "none." in x for x in argv):            # --overwrite passes the output check and
        with pytest.raises(SystemExit) as e:                       # stops at the missing input instead
            run_cli(main, argv + ["--overwrite"])
        err = capsys.readouterr().err
        assert e.value.code != 0 and "already exists" not in err and "already holds" not in err, err


def test_every_entry_point_is_covered():
    """Every `python -m` entry point with an --out is in ENTRY_POINTS or RESUMED (the toys run
    whole experiments into their own folders: eval.toys.*)."""
    import glob
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = set()
    for f in glob.glob(os.path.join(root, "*", "*.py")) + glob.glob(os.path.join(root, "eval", "tools", "*.py")):
        text = open(f).read()
        if "def main(" in text and '"--out"' in text and "/toys/" not in f and "/tests/" not in f:
            found.add(os.path.relpath(f, root)[:-3].replace(os.sep, "."))
    missing = found - set(ENTRY_POINTS) - set(RESUMED) - {"eval.lmms", "eval.tools.bench_reap_llmcompressor"}
    assert not missing, missing


def test_evaluate_twice_into_one_file(data_file, tmp_path, capsys):
    """The second run is refused and the first run's results stay byte for byte; --overwrite
    replaces them; --resume of a finished run is refused too (nothing to continue)."""
    from eval import evaluate
    out = tmp_path / "r.json"
    argv = ["--model", "tiny-dense", "--data", data_file, "--out", str(out), "--limit", "2", "--max-new-tokens", "2",
            "--threads", "1"]
    evaluate.main(argv)
    first = out.read_bytes()
    err = error_of(evaluate.main, argv, capsys)
    assert f"--out {out} already exists; pass --overwrite to replace it (or --resume" in err
    assert out.read_bytes() == first
    err = error_of(lambda a: run_cli(evaluate.main, a), argv + ["--resume"], capsys)
    assert "there is no interrupted run to continue" in err and out.read_bytes() == first
    evaluate.main(argv + ["--overwrite"])
    assert json.loads(out.read_text())["rows"] == json.loads(first)["rows"]
    assert sorted(os.listdir(tmp_path)) == ["r.json"]


def test_force_is_not_a_spelling_of_overwrite(tmp_path, capsys):
    from rolemerge import calibrate as cal
    out = _file(tmp_path / "s.safetensors")
    err = error_of(cal.main, ["--model", NOWHERE, "--data", str(tmp_path / "none.json"), "--out", out, "--force"],
                   capsys)
    assert "unrecognized arguments: --force" in err and open(out).read() == "{\"kept\": true}\n"


def test_refuse_existing_exits_2_naming_the_flag(tmp_path, capsys):
    from common.cli import refuse_existing
    refuse_existing(str(tmp_path / "none.json"), False)   # nothing there, or no output asked for: returns
    refuse_existing("", False)
    out = _file(tmp_path / "r.json")
    refuse_existing(out, True)
    with pytest.raises(SystemExit) as e:
        refuse_existing(out, False, flag="--result")
    assert e.value.code == 2
    assert f"error: --result {out} already exists; pass --overwrite to replace it" in capsys.readouterr().err
