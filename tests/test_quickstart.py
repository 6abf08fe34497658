"""What a newcomer meets first: file modes of written weights, the README's plain-transformers
snippet for a merged checkpoint, the quickstart's interrupt / resume and its report."""
import os
import re
import stat
import subprocess
import sys

import pytest
import torch

from common import backbone as bb
from common import checkpoint as ck
from common import data
from common import shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """A tiny-moe merged in memory to rho = .75 (stats from 4 validation examples) and its data."""
    from rolemerge import calibrate, merge
    d = tmp_path_factory.mktemp("merged")
    old = os.umask(0o022)
    try:
        shapes.generate_split(str(d / "data"), "val", 4)
        calibrate.main(["--model", "tiny-moe", "--data", str(d / "data" / "val.json"), "--out",
                        str(d / "st.safetensors"), "--limit", "4"])
        merge.main(["--model", "tiny-moe", "--stats", str(d / "st.safetensors"), "--rho", "0.75",
                    "--out", str(d / "m")])
    finally:
        os.umask(old)
    return d


def _modes(root):
    return {os.path.relpath(os.path.join(r, f), root): stat.S_IMODE(os.stat(os.path.join(r, f)).st_mode)
            for r, _, fs in os.walk(root) for f in fs}


def test_written_weights_follow_the_umask(merged, tmp_path):
    # safetensors (and so save_pretrained) creates its files 0600: collaborators could not read them
    assert set(_modes(merged / "m").values()) == {0o644}, _modes(merged / "m")     # in-memory merge
    assert stat.S_IMODE(os.stat(merged / "st.safetensors").st_mode) == 0o644         # calibration stats
    old = os.umask(0o027)
    try:
        ck.atomic_save_file({"a": torch.zeros(2)}, str(tmp_path / "w.safetensors"))          # MoD adapters
        ck.save_train_state(str(tmp_path / "ckpt"), {"a": torch.zeros(2)}, None, {"step": 1})  # MoLE / trainers
        model, proc = bb.build_tiny("qwen3_vl", hidden=32, layers=1)
        bb.save_backbone(model, proc, str(tmp_path / "base"))                                 # pretrain
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "w.safetensors").st_mode) == 0o640
    assert set(_modes(tmp_path / "ckpt").values()) == {0o640}
    assert set(_modes(tmp_path / "base").values()) == {0o640}


def test_readme_plain_transformers_snippet(merged, tmp_path):
    """The rolemerge README's snippet, run verbatim, answers as this repo's own inference does."""
    from rolemerge import infer
    text = open(os.path.join(ROOT, "rolemerge", "README.md")).read()
    sec = text[text.index("## Running a merged checkpoint with plain transformers"):]
    code = re.search(r"```python\n(.*?)```", sec, re.S).group(1)
    (tmp_path / "run_merged.py").write_text(code)
    rec = data.read_llava_json(str(merged / "data" / "val.json"))[0]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="")
    out = subprocess.run([sys.executable, str(tmp_path / "run_merged.py"), str(merged / "m"), rec["image"]],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    model, proc, _ = infer.load_timed(str(merged / "m"))
    ours = infer.predict(model, proc, [dict(rec, question="Is there a red circle?")], max_new_tokens=64,
                         progress=False)[0]["pred"]
    assert out.stdout.strip() == ours.strip()


def test_report_tables_put_accuracy_first_with_captions_n_and_integers():
    from eval.quickstart import stage_tables
    rows = [{"model": "m", "family": "all", "metric": "bytes", "value": 8976680.0, "ci_low": None, "ci_high": None, "n": 1},
            {"model": "m", "family": "count", "metric": "accuracy", "value": 0.5, "ci_low": 0.25, "ci_high": 0.75, "n": 4},
            {"model": "m", "family": "all", "metric": "accuracy", "value": 0.5, "ci_low": 0.25, "ci_high": 0.75, "n": 9},
            {"model": "m", "family": "all", "metric": "switch_rate", "value": 0.125, "ci_low": None, "ci_high": None, "n": 9}]
    text = "\n".join(stage_tables("mod", rows))
    assert text.index("**accuracy**") < text.index("**bytes**") < text.index("**switch_rate**")
    assert "| m | 9 | 0.500 [0.25, 0.75] | 0.500 [0.25, 0.75] |" in text      # n of the row; count before all
    assert "| m | 1 | 8976680 |" in text                                      # an integer stays an integer
    assert "adjacent tokens whose top-1 expert differs" in text                 # every metric has a caption


def test_quickstart_ctrl_c_stops_after_the_stage_and_a_rerun_continues(tmp_path):
    import signal
    import time
    out, dat = tmp_path / "qs", tmp_path / "data"
    cmd = [sys.executable, "-m", "eval.quickstart", "--out", str(out), "--data", str(dat), "--n-test", "12",
           "--methods", "", "--batch-size", "12"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t = time.time()
    while not list(out.glob("stages/*.json")) and p.poll() is None and time.time() - t < 240:
        time.sleep(0.05)                                                       # the first stage finished
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "rerun the same command to continue" in err
    done = sorted(f.name for f in (out / "stages").glob("*.json"))
    assert 1 <= len(done) < 3 and not (out / "report.md").exists()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("done in an earlier run") == len(done)              # nothing finished is redone
    report = (out / "report.md").read_text()
    assert report.index("## bases") < report.index("**accuracy**") and "best constant (train)" in report
    wall = dict(re.findall(r"^- (.+): ([\d.]+)$", report, re.M))            # stage times add up to the total
    assert sum(" (an earlier run)" in k for k in wall) == len(done)
    stages = sum(float(v) for k, v in wall.items() if not k.startswith(("total", "this run")))
    assert abs(float(wall["total of the stages"]) - stages) < 0.2 * len(wall)
    assert float(wall["this run (wall)"]) < float(wall["total of the stages"])


ENTRY_POINTS = {  # module: flags its -h must list (one vocabulary: --model, --data, --image-root, --limit, --out,
    # --threads, --seed)
    "eval.evaluate": ("--model", "--data", "--image-root", "--limit", "--out", "--threads"),
    "eval.quickstart": ("--data", "--out", "--threads"),
    "eval.toys.mod": ("--model", "--data", "--out", "--threads"),
    "mod.data": ("--model", "--data", "--image-root", "--limit", "--out", "--threads", "--seed"),
    "mod.train": ("--model", "--data", "--image-root", "--out", "--threads", "--seed"),
    "mod.infer": ("--model", "--data", "--image-root", "--limit", "--out", "--threads"),
    "mole.train": ("--model", "--data", "--image-root", "--out", "--threads", "--seed"),
    "mole.infer": ("--model", "--data", "--image-root", "--limit", "--out", "--threads"),
    "mole.diagnostics": ("--model", "--data", "--image-root", "--limit", "--out", "--threads"),
    "rolemerge.calibrate": ("--model", "--data", "--image-root", "--limit", "--out", "--threads"),
    "rolemerge.merge": ("--model", "--out", "--threads", "--seed"),
    "rolemerge.infer": ("--model", "--data", "--image-root", "--limit", "--out", "--threads"),
    "eval.toys.rolemerge": ("--model", "--data", "--out", "--threads"),
    "eval.convert": ("--limit", "--out"),
}


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_one_flag_vocabulary(module, capsys):
    import importlib
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(["-h"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    missing = [f for f in ENTRY_POINTS[module] if not re.search(rf"{f}[ ,=\n]", text)]
    assert not missing, f"{module} -h lacks {missing}"
    assert not re.search(r"--base[ ,]|--n[ ,]", text)                         # old spellings are not advertised
    assert text.startswith(f"usage: python -m {module} ")                     # the command a user types
    assert "(default:" in text                                                # -h shows the defaults
    if module == "mod.train":
        flat = " ".join(text.split())
        assert "optimizer steps (default: 300)" in flat and "(AdamW) (default: 0.002)" in flat, flat
        assert "--shared-router one router for both pools (I_A = I_B) --noise" in flat   # no "(default: False)"
        assert "(default: the data file's folder)" in flat and "(default: None)" not in flat
        assert "MoE-LoRA baseline) --combine" in flat                          # help that names its default
    if "--limit" in ENTRY_POINTS[module]:                                     # one meaning of --limit 0 everywhere
        assert re.search(r"--limit N\s+use only the first N [\w\s]+\(0\s+=\s+all", text), text
        with pytest.raises(SystemExit) as e:
            importlib.import_module(module).main(["--limit", "-1", "--data", "x", "--model", "x"])
        assert e.value.code == 2 and "--limit: must be >= 0, got -1" in capsys.readouterr().err


def test_help_formatter_appends_only_defaults_that_say_something():
    """Newcomer trial: -h listed --steps, --lr, --warmup without their defaults."""
    from common.cli import entry_parser
    p = entry_parser("x", "a\n  kept as written")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--device", default="cuda", help="cuda (default; cpu for a smoke run)")
    p.add_argument("--ckpt", default=None, help="checkpoint")
    p.add_argument("--adapter", default="", help="adapter dir")
    p.add_argument("--quick", action="store_true", help="main rows")
    p.add_argument("--share", type=float, default=0.5, help="a share in %%")
    flat = " ".join(p.format_help().split())
    assert "a\n  kept as written" in p.format_help()                         # the description is not re-wrapped
    assert "optimizer steps (default: 300)" in flat and "a share in % (default: 0.5)" in flat
    assert "(default; cpu for a smoke run) --ckpt" in flat                    # its help already names it
    assert flat.count("(default:") == 2, flat                                 # not None, "", False


def test_threads_default_one_for_tiny_bases_all_cores_for_real_checkpoints(tmp_path):
    from common.cli import set_threads
    before = torch.get_num_threads()
    try:
        assert set_threads(None, "tiny-moe") == 1 and torch.get_num_threads() == 1
        assert set_threads(None, bb.TINY["tiny-chat"]) == 1
        assert set_threads(None, str(tmp_path)) == len(os.sched_getaffinity(0))   # a real checkpoint path
        assert set_threads(2, "tiny-moe") == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_mod_infer_checks_every_method_first_and_keeps_finished_methods(tmp_path, monkeypatch, capsys):
    import json
    from helpers import error_of
    from mod import infer
    shapes.generate_split(str(tmp_path / "d"), "test", 2)
    recs = json.load(open(tmp_path / "d" / "test.json"))
    free = tmp_path / "free.json"
    free.write_text(json.dumps([dict(r, family="freeform", image=str(tmp_path / "d" / r["image"])) for r in recs]))
    out = tmp_path / "r.json"
    # base-misled cannot run on free-form data: refused before the model loads or any method runs
    with monkeypatch.context() as m:
        m.setattr(infer, "load_backbone", lambda *a, **k: pytest.fail("the model loaded before the data check"))
        err = error_of(infer.main, ["--data", str(free), "--methods", "base,base-misled", "--out", str(out)],
                       capsys)
    assert "misled prompts need a shapes-world family" in err and not out.exists()
    # a method failing after another finished: the finished one is on disk, marked incomplete
    monkeypatch.setattr(infer, "self_correction", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        infer.main(["--data", str(tmp_path / "d" / "test.json"), "--methods", "base,sc", "--max-new-tokens", "4",
                    "--out", str(out)])
    saved = json.loads(out.read_text())
    assert list(saved["results"]) == ["base"] and saved["complete"] is False


def test_threads_default_one_for_a_merged_tiny_checkpoint(tmp_path):
    """Newcomer trial: rolemerge.infer on a merge of tiny-moe took every core (a path, not a
    tiny name) and ran ~3x slower on a busy machine. A small local checkpoint gets 1 thread."""
    import json
    import os
    import torch
    from common.cli import set_threads
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 128}}))
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 3584}}))
    old = torch.get_num_threads()
    try:
        assert set_threads(None, str(tmp_path / "small")) == 1
        assert set_threads(None, str(tmp_path / "big")) == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(old)


def test_evaluate_refuses_the_old_base_and_n_spellings(capsys):
    """`--base` / `--n` are unknown arguments (no alias, no abbreviation of --no-loglik)."""
    import pytest
    from eval import evaluate as ev
    with pytest.raises(SystemExit) as e:
        ev.main(["--model", "tiny-dense", "--base", "tiny-dense", "--n", "1", "--data", "nope.jsonl"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unrecognized arguments: --base tiny-dense --n 1" in err
    with pytest.raises(SystemExit):
        ev.main(["--data", "nope.jsonl"])
    assert "required: --model" in capsys.readouterr().err


def test_quickstart_toy_stages_hand_back_report_rows():
    """Newcomer trial: the quickstart crashed in RoleMerge (MAX_NEW redefined as a dict by look
    step) and after MoLE (toy_mole.run returns its table summary, not report rows)."""
    from eval.toys import mole as toy_mole, rolemerge as toy_rolemerge
    assert isinstance(toy_rolemerge.MAX_NEW, int)
    items = [{"family": f, "correct": c} for f, c in (("count", 1), ("count", 1), ("colour", 0), ("colour", 0))]
    summary = {"rows": toy_mole._summary_rows({("mole", 0): {"items": items}})}
    rows = toy_mole.report_rows(summary)
    # one row per (model, family), each with its n and CI (the trial found a second "all" row
    # without a CI, and family rows without n)
    assert rows[-1] == {"model": "mole", "family": "all", "metric": "accuracy", "value": 0.5,
                        "ci_low": 0.0, "ci_high": 1.0, "n": 4}
    assert [(r["family"], r["value"], r["n"], r["ci_low"]) for r in rows[:-1]] == [("count", 1.0, 2, 1.0),
                                                                                 ("colour", 0.0, 2, 0.0)]
    from eval.quickstart import stage_tables
    assert any("mole" in line for line in stage_tables("mole", rows))


def test_unreachable_hub_says_so():
    """Newcomer trial: a hub id with no network ended in 'Supported VLMs: ...; --trust-remote-code',
    advice that does not apply. The error now names the network and the local-directory fix.
    HF_HUB_OFFLINE is set in the environment of a fresh process, before huggingface_hub reads it
    at import (set later, the call waited ~23 s on network time-outs)."""
    code = ("import time\n"
            "def no_wait(s):\n    print('RETRY-WAIT', s)\n"
            "time.sleep = no_wait\n"       # huggingface_hub's back-off between retries: reported, not waited
            "from common import backbone as bb\n"
            "try:\n    bb.load_backbone('nobody-here/not-a-model-xyz')\n"
            "except bb.BackboneError as e:\n    print('BackboneError:', e)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert re.search(r"BackboneError: .*hub cannot be reached.*local save_pretrained directory", out.stdout), out
    assert "trust-remote-code" not in out.stdout
    assert "RETRY-WAIT" not in out.stdout    # offline from the start: no request retried (set late: 5 waits, 23 s)


def test_readme_lists_the_supported_models_the_code_supports():
    """Newcomer trial: the README's supported-model lists disagreed with the code (LLaVA-NeXT,
    DeepSeek-OCR-2, DeepSeek-VL2 missing in places)."""
    from common.backbone import SUPPORTED_VLMS
    from rolemerge.blocks import SUPPORTED
    names = {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL",
             "qwen3_vl_moe": "Qwen3-VL-MoE", "llava_next": "LLaVA-NeXT", "llava": "LLaVA-1.5", "gemma3": "Gemma3"}
    top = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    vlms = top[top.index("Supported VLMs"):top.index("RoleMerge merges")]
    assert [names[t] in vlms for t in SUPPORTED_VLMS] == [True] * len(SUPPORTED_VLMS), vlms
    rm = " ".join(open(os.path.join(ROOT, "rolemerge", "README.md")).read().split())
    rm = rm[rm.index("Supported families"):rm.index("Anything else")]
    for family in SUPPORTED.values():
        short = family.split(" (")[0].split(" ")[0]                             # "DeepSeek-VL2 (Tiny ..." -> name
        assert short in top[top.index("RoleMerge merges"):] and short in rm, short


def test_mod_infer_base_json_is_the_toys_fair_baseline(tmp_path):
    """Newcomer trial: mod.infer offered `base` (plain question) but not the quickstart's `base-json`
    (the frozen base on the adapters' JSON prompt), so base vs single compared different prompts.
    `--methods base-json` answers as eval.toys.mod's base-json row: plain(base, json_prompt=True)."""
    from mod import infer
    shapes.generate_split(str(tmp_path / "d"), "test", 3)
    out = infer.main(["--model", "tiny-chat", "--data", str(tmp_path / "d" / "test.json"), "--methods",
                      "base,base-json", "--max-new-tokens", "6", "--threads", "1"])
    recs = data.read_records(str(tmp_path / "d" / "test.json"))
    model, proc = bb.load_backbone("tiny-chat")
    with torch.inference_mode():
        toy, _ = infer.plain(model, proc, recs, max_new_tokens=6, json_prompt=True)   # toy_mod's base-json call
    got = out["results"]["base-json"]
    assert [(r["id"], r["pred"], r["n_tokens"]) for r in got] == [(r["id"], r["pred"], r["n_tokens"]) for r in toy]
    assert [r["pred"] for r in got] != [r["pred"] for r in out["results"]["base"]]     # another prompt
    import inspect
    from eval.toys import mod as toy_mod
    assert 'record("base-json", plain(base, proc, test, json_prompt=True))' in inspect.getsource(toy_mod.run)


def test_report_says_quick_rows_check_code_paths_and_prints_the_readme_verdicts(tmp_path, monkeypatch):
    """Quick-mode rows can point against the README verdicts (MoLE 0.685 vs plain latents 0.660;
    RoleMerge at .5 0.300 vs frequency pruning 0.787): report.md now says, next to each method's
    rows, that they check code paths and where the verdict is, and prints the README's verdict
    lines, read from the committed result files (a changed file changes the report)."""
    import json as js
    import shutil
    from eval import quickstart as qs
    rows = [{"model": "mole", "family": "all", "metric": "accuracy", "value": 0.685, "ci_low": 0.6, "ci_high": 0.7,
             "n": 40}]
    title = "mole (quick mode; mole/README.md has the full toy)"
    qs.write_report({title: rows}, str(tmp_path), {}, {title: qs.method_note("mole")})
    md = (tmp_path / "report.md").read_text()
    claims = [r for r in js.load(open(os.path.join(ROOT, "eval/results/mole/headroom.json")))["rows"]
              if r.get("top") and r["method"] == "MoLE"]
    assert claims and all(f"- {r['claim']}: **{r['verdict']}**, effect {r['effect']}" in md for r in claims)
    head = md.index(f"## {title}")
    assert head < md.index("check that MoLE's code paths run") < md.index(claims[0]["claim"]) < md.index("| model |")
    assert 'README.md, "The claims, at toy scale"' in md
    res = tmp_path / "results"
    shutil.copytree(os.path.join(ROOT, "eval", "results"), res, ignore=shutil.ignore_patterns("*.png"))
    f = res / "mole" / "headroom.json"                          # MoLE's rows of the claims table
    d = js.loads(f.read_text())
    d["rows"] = [dict(r, verdict="supported") if r.get("top") else r for r in d["rows"]]
    f.write_text(js.dumps(d))
    monkeypatch.setattr(qs, "RESULTS", str(res))
    assert all("**supported**" in line for line in qs.method_note("mole") if line.startswith("- "))


def test_quickstart_never_writes_into_a_folder_that_is_not_its_run(tmp_path):
    """A reported bug: `eval.quickstart --out DIR` deleted DIR/rolemerge (with --out ., the repository's
    own rolemerge/ sources) and replaced DIR/report.md. A non-empty --out without the quickstart's
    stages/ record is refused before anything runs, and loses nothing."""
    proj = tmp_path / "proj"
    (proj / "rolemerge").mkdir(parents=True)
    (proj / "rolemerge" / "important.txt").write_text("precious")
    (proj / "report.md").write_text("mine")
    out = subprocess.run([sys.executable, "-m", "eval.quickstart", "--out", str(proj), "--methods", "rolemerge",
                          "--data", str(tmp_path / "data"), "--threads", "1"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2 and "no quickstart run" in out.stderr, out.stderr[-2000:]
    assert (proj / "rolemerge" / "important.txt").read_text() == "precious"
    assert (proj / "report.md").read_text() == "mine" and not (tmp_path / "data").exists()
    from eval.quickstart import check_out
    (tmp_path / "empty").mkdir()
    check_out(str(tmp_path / "empty"))                  # empty and new folders are fine,
    check_out(str(tmp_path / "new"))
    (proj / "stages").mkdir()
    check_out(str(proj))                                # and so is an earlier quickstart run
