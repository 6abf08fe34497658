"""Bad inputs, interruption and determinism of RoleMerge (rolemerge/calibrate.py, merge.py,
infer.py) on the committed tiny models: each refusal names the problem and the fix and
leaves nothing at --out; a merge killed mid-shard leaves no output that looks complete, and
the rerun is byte-identical to an uninterrupted run.

Already covered in test_rolemerge_merge.py, not repeated: rho 0 / 1.5 and rho below top_k
through run_merge, stats of another seed's model, --out exists without --overwrite, --out ==
--model, calibrate() on a dense model."""
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from common import backbone as bb
from common import data
from common import shapes
from rolemerge import calibrate as cal
from rolemerge import merge as mg
from rolemerge import shards as sh
from rolemerge import stats as rstats
from rolemerge.planning import MergeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """tiny-moe loaded once, 3 calibration records and their stats file."""
    root = tmp_path_factory.mktemp("rm")
    model, proc = cal.load_model("tiny-moe")
    shapes.generate_split(str(root), "val", 3)
    recs = data.read_llava_json(str(root / "val.json"))
    stats = cal.calibrate(model, proc, {"val": recs}, batch_size=3, max_new_tokens=4, model_id="tiny-moe",
                          progress=False)
    rstats.save_stats(stats, str(root / "stats.safetensors"))
    return model, proc, recs, root, str(root / "stats.safetensors")


def _cli(main, argv):
    """Run a RoleMerge main in-process, expecting an exit: (exit status, stderr)."""
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
        main(argv)
    return e.value.code, err.getvalue()


def _error(main, argv):
    """A user error: exit status 2 (as mod.* / mole.*) and `error: ...` printed last on stderr;
    returns that message (from its `error: ` on)."""
    code, err = _cli(main, argv)
    assert code == 2, (code, err)
    lines = err.rstrip("\n").split("\n")
    start = max(i for i, line in enumerate(lines) if line.startswith("error: "))
    return "\n".join(lines[start:])


def _merge_cli(argv, capsys=None):
    """rolemerge.merge: the `error: ...` message of a user error (status 2 checked), or with
    capsys (argparse errors) (exit status, stderr)."""
    return _error(mg.main, argv) if capsys is None else _cli(mg.main, argv)


# ----------------------------------------------------------------------------- CLI flags

@pytest.mark.parametrize("rho, msg", [("0", "rho=0.0 must be in (0, 1]"), ("1.5", "rho=1.5 must be in (0, 1]"),
                                      ("-1", "rho=-1.0 must be in (0, 1]"), ("nan", "rho=nan must be in (0, 1]")])
def test_rho_out_of_range_fails_before_any_loading(moe, tmp_path, rho, msg):
    out = tmp_path / "o"
    code = _merge_cli(["--model", "tiny-moe", "--stats", "missing.safetensors", "--out", str(out), "--rho", rho])
    assert code == f"error: {msg} (the fraction of experts kept per layer)" and not out.exists()


def test_k_outside_top_k_and_n(moe, tmp_path):
    *_, stats = moe
    out = str(tmp_path / "o")
    for k, msg in (("1", "K=1 is smaller than the model's top_k=2: every token routes to 2 experts, so at least 2 "
                         "must remain (use a larger rho)"),
                   ("9", "K=9 exceeds the 8 experts per layer"), ("0", "K=0 must be a positive number of experts")):
        assert _merge_cli(["--model", "tiny-moe", "--stats", stats, "--out", out, "--k", k]) \
            == f"error: {msg}"
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")


def test_choice_typos_and_dtype_flag(moe, tmp_path, capsys):
    """--dtype bf16x / --method typo are argparse errors; the old `choices=[None, ...]` listed
    None, which no command line can pass: `auto` replaces it and works."""
    *_, stats = moe
    out = str(tmp_path / "o")
    for argv, bad in ((["--dtype", "bf16x"], "bf16x"), (["--dtype", "None"], "None"), (["--method", "rolmerge"],
                                                                                          "rolmerge")):
        code, err = _merge_cli(["--model", "tiny-moe", "--stats", stats, "--out", out, "--rho", ".5"] + argv, capsys)
        assert code == 2 and f"invalid choice: '{bad}'" in err
    with pytest.raises(SystemExit) as e:
        cal.main(["--model", "tiny-moe", "--data", "x.json", "--out", "s.safetensors", "--dtype", "bf16x"])
    assert e.value.code == 2 and "invalid choice: 'bf16x' (choose from 'auto', 'float32', 'bfloat16', 'float16')" \
        in capsys.readouterr().err
    assert _merge_cli(["--model", "tiny-moe", "--stats", stats, "--out", out, "--rho", ".5",
                       "--dtype", "bfloat16"]).startswith("error: --dtype applies to the in-memory merge only")
    mg.main(["--model", "tiny-moe", "--stats", stats, "--out", out, "--rho", ".5", "--dtype", "bfloat16", "--in-memory"])
    assert all(v.dtype == torch.bfloat16 for v in load_file(os.path.join(out, "model.safetensors")).values()
               if v.is_floating_point())
    mg.main(["--model", "tiny-moe", "--stats", stats, "--out", out + "2", "--rho", ".5", "--dtype", "auto", "--in-memory"])
    assert load_file(os.path.join(out + "2", "model.safetensors"))[
        "model.language_model.layers.0.mlp.gate.weight"].dtype == torch.float32


def test_calibrate_flags_are_checked_before_the_model_loads(moe, tmp_path, capsys):
    *_, root, _ = moe
    d = str(root / "val.json")
    before = open(d).read()
    for argv, msg in ((["--max-new-tokens", "1"], "--max-new-tokens must be >= 2, got 1"),
                      (["--limit", "-1"], "--limit: must be >= 0, got -1"), (["--n", "1"], "unrecognized arguments: --n 1"),
                      (["--batch-size", "-2"], "--batch-size must be >= 1")):
        with pytest.raises(SystemExit) as e:
            cal.main(["--model", "nowhere", "--data", d, "--out", str(tmp_path / "s.safetensors")] + argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    # the .json summary is written next to --out: --out val.safetensors would overwrite val.json
    for out, msg in ((str(root / "val.safetensors"), "would overwrite the calibration data"),
                     (d, "must end in .safetensors")):
        with pytest.raises(SystemExit):
            cal.main(["--model", "tiny-moe", "--data", d, "--out", out])
        assert msg in capsys.readouterr().err
    assert open(d).read() == before and not os.path.exists(root / "val.safetensors")


# ----------------------------------------------------------------------------- wrong model / stats

def test_non_moe_model_is_refused_by_calibrate_and_merge(moe, tmp_path):
    *_, root, stats = moe
    msg = "model_type 'qwen3_vl' is not a supported MoE family (no routed experts RoleMerge knows how to merge)"
    assert _error(cal.main, ["--model", "tiny-dense", "--data", str(root / "val.json"), "--out",
                             str(tmp_path / "s.safetensors")]).startswith(f"error: {msg}. Supported: Qwen3-VL-MoE "
                                                                          f"[qwen3_vl_moe]")
    for extra in ([], ["--in-memory"]):
        code = _merge_cli(["--model", "tiny-dense", "--stats", stats, "--out", str(tmp_path / "o"), "--rho", ".5"]
                          + extra)
        assert code.startswith(f"error: {msg}")
    assert sorted(os.listdir(tmp_path)) == []


def _copy_moe(tmp_path, name="moe"):
    dst = tmp_path / name
    shutil.copytree(bb.TINY["tiny-moe"], dst)
    return dst


def test_stats_from_another_model(moe, tmp_path):
    """Same weights but a config with another top-k; stats whose counts disagree with their
    own metadata (other layer count); stats whose layers differ (other model)."""
    *_, stats = moe
    d = _copy_moe(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["num_experts_per_tok"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    for extra in ([], ["--in-memory"]):
        assert _merge_cli(["--model", str(d), "--stats", stats, "--out", str(tmp_path / "o"), "--rho", ".5"] + extra) \
            == ("error: statistics were recorded on a different model (top_k: stats 2 vs checkpoint 3; stats model "
                "'tiny-moe'); recalibrate on this one")
    from safetensors import safe_open
    with safe_open(stats, "pt") as f:
        md, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file({k: (v[:3] if k.startswith("counts/") else v) for k, v in t.items()}, str(tmp_path / "cut.safetensors"),
              metadata=md)
    assert _merge_cli(["--model", "tiny-moe", "--stats", str(tmp_path / "cut.safetensors"), "--out",
                       str(tmp_path / "o"), "--rho", ".5"]) == (
        f"error: {tmp_path / 'cut.safetensors'}: counts of source 'val' have shape [3, 3, 8], but the file's metadata "
        f"says [layers, buckets, experts] = [4, 3, 8] (non-negative); the file was edited or is corrupt: recalibrate")
    meta = json.loads(md["rolemerge"])
    meta.update(layer_names=meta["layer_names"][:3], layers=meta["layers"][:3])
    save_file({k: (v[:3] if k.startswith("counts/") else v) for k, v in t.items()}, str(tmp_path / "l3.safetensors"),
              metadata={"rolemerge": json.dumps(meta)})
    assert _merge_cli(["--model", "tiny-moe", "--stats", str(tmp_path / "l3.safetensors"), "--out",
                       str(tmp_path / "o"), "--rho", ".5"]).startswith(
        "error: statistics were recorded on a different model (layers: stats [0, 1, 2] vs checkpoint [0, 1, 2, 3]")
    n = os.path.getsize(stats)
    shutil.copy(stats, tmp_path / "trunc.safetensors")
    os.truncate(tmp_path / "trunc.safetensors", n - 10)
    assert _merge_cli(["--model", "tiny-moe", "--stats", str(tmp_path / "trunc.safetensors"), "--out",
                       str(tmp_path / "o"), "--rho", ".5"]).startswith(
        f"error: {tmp_path / 'trunc.safetensors'}: unreadable stats file (CheckpointError: ")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()


def test_empty_phase_buckets(moe, tmp_path):
    """No answer tokens (max_new_tokens=1: the only generated token is never fed back), records
    without images for a VLM, and a stats file whose answer bucket is empty."""
    model, proc, recs, _, stats = moe
    with pytest.raises(cal.CalibrationError, match=r"phase bucket 'answer' is empty over all calibration sources "
                                                   r"\(no generated token was fed back: raise --max-new-tokens"):
        cal.calibrate(model, proc, {"v": recs[:1]}, max_new_tokens=1, progress=False)
    with pytest.raises(cal.CalibrationError, match=r"phase bucket 'image' is empty over all calibration sources "
                                                   r"\(the records have no images\)"):  # text-only records alone
        cal.calibrate(model, proc, {"v": [dict(recs[0], image=None)]}, progress=False)
    from safetensors import safe_open
    with safe_open(stats, "pt") as f:
        md, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    t["counts/val"][:, 2] = 0
    t["tokens/val"][2] = 0
    save_file(t, str(tmp_path / "noans.safetensors"), metadata=md)
    assert _merge_cli(["--model", "tiny-moe", "--stats", str(tmp_path / "noans.safetensors"), "--out",
                       str(tmp_path / "o"), "--rho", ".5"]).startswith("error: phase bucket 'answer' is empty")
    assert not (tmp_path / "o").exists()


def test_truncated_shard_is_named_by_both_merge_paths(moe, tmp_path):
    *_, stats = moe
    d = _copy_moe(tmp_path)
    f = d / "model.safetensors"
    full = f.stat().st_size
    os.truncate(f, full // 2)
    for extra in ([], ["--in-memory"]):
        assert _merge_cli(["--model", str(d), "--stats", stats, "--out", str(tmp_path / "o"), "--rho", ".5"] + extra) \
            == (f"error: {f}: truncated or corrupt safetensors file: {full // 2} bytes on disk, its header describes "
                f"{full}; re-download or re-save it")
    assert f.stat().st_size == full // 2 and not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- output directory

def test_force_never_deletes_what_is_not_a_merge_output(moe, tmp_path):
    *_, stats = moe
    user = tmp_path / "results"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    assert _merge_cli(["--model", "tiny-moe", "--stats", stats, "--out", str(user), "--rho", ".5", "--overwrite"]) == (
        f"error: {user} exists and is not a RoleMerge output (no rolemerge_report.json); refusing to delete it even "
        f"with --overwrite: choose a new --out")
    d = _copy_moe(tmp_path, "models/moe")                 # --out a folder that holds the input
    assert _merge_cli(["--model", str(d), "--stats", stats, "--out", str(tmp_path / "models"), "--rho", ".5",
                       "--overwrite"]).startswith(f"error: --out {tmp_path / 'models'} is the input checkpoint (or a "
                                              f"folder holding it)")
    assert (user / "thesis.tex").read_text() == "years of work" and (d / "model.safetensors").exists()


def test_force_never_deletes_a_tmp_or_old_folder_it_did_not_write(moe, tmp_path):
    *_, stats = moe
    out = tmp_path / "o"
    (tmp_path / "o.tmp").mkdir()
    (tmp_path / "o.tmp" / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        assert _merge_cli(["--model", "tiny-moe", "--stats", stats, "--out", str(out), "--rho", ".5", *extra]) == (
            f"error: {out}.tmp exists and is not a RoleMerge temp folder (no {sh.TMP_MARK} or {sh.REPORT}); "
            f"refusing to delete it: move it away or choose a new --out")
    (tmp_path / "o.tmp" / "notes.txt").rename(tmp_path / "notes.txt")
    mg.run_merge(MergeConfig(model="tiny-moe", stats=stats, out=str(out), rho=0.5))     # an empty leftover .tmp is fine
    (tmp_path / "o.old").mkdir()
    (tmp_path / "o.old" / "notes.txt").write_text("mine")
    assert _merge_cli(["--model", "tiny-moe", "--stats", stats, "--out", str(out), "--rho", ".5", "--overwrite"]) == (
        f"error: {out}.old exists and is not a previous RoleMerge output (no {sh.REPORT}); refusing to delete it "
        f"even with --overwrite: move it away or choose a new --out")
    assert (tmp_path / "o.old" / "notes.txt").read_text() == "mine" and (out / sh.REPORT).exists()
    assert not (out / sh.TMP_MARK).exists() and not (tmp_path / "o.tmp").exists()


# ----------------------------------------------------------------------------- interruption, determinism

CHILD = """
import os, signal, sys
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from rolemerge import merge as mg
from rolemerge import shards as sh
from rolemerge.planning import MergeConfig
seen = {{}}
write = sh.write_one
def killing_write(f, *args):      # SIGKILL after 2 tensors of the second output shard
    write(f, *args)
    f.flush()
    seen[f.name] = seen.get(f.name, 0) + 1
    if len(seen) == 2 and seen[f.name] == 2:
        os.kill(os.getpid(), signal.SIGKILL)
sh.write_one = killing_write
mg.run_merge(MergeConfig(model={src!r}, stats={stats!r}, out={out!r}, rho=0.5))
"""


def _files(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d)) if f != sh.REPORT}


def test_killed_streaming_merge_leaves_no_output_and_rerun_is_identical(moe, tmp_path):
    """A streaming merge SIGKILLed mid-shard (child process) leaves nothing at --out (the
    partial shards sit in --out.tmp, without a report); the rerun's files equal those of an
    uninterrupted run byte for byte. Also: the in-memory path twice -> identical files."""
    model, proc, _, _, stats = moe
    src = str(tmp_path / "sharded")
    model.save_pretrained(src, max_shard_size="3MB")       # several shards: a kill can land mid-run
    proc.save_pretrained(src)
    shards = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    assert len(shards) >= 3
    ref = str(tmp_path / "ref")
    mg.run_merge(MergeConfig(model=src, stats=stats, out=ref, rho=0.5))
    out = str(tmp_path / "out")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, src=src, stats=stats, out=out)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not os.path.exists(out)                          # nothing that can be taken for complete
    partial = sorted(os.listdir(out + ".tmp"))
    assert sh.TMP_MARK in partial                           # marks the leftover as ours: the rerun may delete it
    partial.remove(sh.TMP_MARK)
    assert sh.REPORT not in partial and "config.json" not in partial and partial == shards[:2]
    assert os.path.getsize(os.path.join(out + ".tmp", shards[1])) < os.path.getsize(os.path.join(ref, shards[1]))
    rep = mg.run_merge(MergeConfig(model=src, stats=stats, out=out, rho=0.5))     # rerun: starts the .tmp over
    assert not os.path.exists(out + ".tmp")
    assert _files(out) == _files(ref) and len(_files(out)) > len(shards)
    ref_rep = json.load(open(os.path.join(ref, sh.REPORT)))
    assert {k: v for k, v in rep.items() if k not in ("merge_seconds", "plan_seconds")} == \
        {k: v for k, v in ref_rep.items() if k not in ("merge_seconds", "plan_seconds")}
    for i in range(2):
        mg.run_merge(MergeConfig(model=src, stats=stats, out=str(tmp_path / f"mem{i}"), rho=0.5, in_memory=True))
    assert _files(str(tmp_path / "mem0")) == _files(str(tmp_path / "mem1"))


def test_infer_flags_and_out(moe, tmp_path, capsys):
    from rolemerge import infer
    *_, root, _ = moe
    d = str(root / "val.json")
    before = open(d).read()
    for argv, msg in ((["--limit", "-1"], "--limit: must be >= 0, got -1"),
                      (["--out", d], "is the data file; predictions would overwrite it")):
        with pytest.raises(SystemExit) as e:
            infer.main(["--model", "nowhere", "--data", d] + argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert open(d).read() == before


def test_calibrate_refuses_an_existing_stats_file_without_force(moe, tmp_path):
    """--out holds stats already: refused before the data or the model is read (--model
    nowhere), the file byte for byte as it was; --overwrite replaces it."""
    *_, root, stats = moe
    d = str(root / "val.json")
    out = tmp_path / "s.safetensors"
    shutil.copy(stats, out)
    before = out.read_bytes()
    assert _error(cal.main, ["--model", "nowhere", "--data", d, "--out", str(out)]) == (
        f"error: --out {out} already exists; pass --overwrite to replace it, or choose another --out")
    (tmp_path / "d.safetensors").mkdir()
    assert _error(cal.main, ["--model", "nowhere", "--data", d, "--out", str(tmp_path / "d.safetensors"),
                             "--overwrite"]).startswith(f"error: --out {tmp_path / 'd.safetensors'} is a directory; give "
                                                    f"the stats file to write")
    assert out.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["d.safetensors", "s.safetensors"]
    cal.main(["--model", "tiny-moe", "--data", d, "--out", str(out), "--limit", "1", "--max-new-tokens", "2", "--overwrite"])
    assert out.read_bytes() != before and json.load(open(tmp_path / "s.json"))["examples"] == {"val": 1}


def test_user_errors_of_calibrate_merge_infer_exit_with_status_2(moe, tmp_path):
    """`error: ...` and status 2, as mod.* and mole.* (it was `raise SystemExit(msg)`: status 1)."""
    from rolemerge import infer
    *_, root, stats = moe
    assert _error(cal.main, ["--model", "tiny-moe", "--data", str(root), "--out", str(tmp_path / "s.safetensors")]) \
        == f"error: {root} is a directory; pass the JSON/JSONL file (e.g. {root / 'val.json'})"
    assert _error(infer.main, ["--model", "tiny-moe", "--data", str(tmp_path / "none.json")]).startswith(
        f"error: {tmp_path / 'none.json'}: file not found")
    assert _error(mg.main, ["--model", "tiny-moe", "--stats", str(tmp_path / "none.safetensors"), "--out",
                            str(tmp_path / "o"), "--rho", ".5"]).startswith("error: ")
    assert sorted(os.listdir(tmp_path)) == []


def test_calibrate_refuses_the_same_data_file_twice(moe, tmp_path):
    *_, root, _ = moe
    d = str(root / "val.json")                              # absolute: was renamed and counted as a second source
    out = tmp_path / "s.safetensors"
    for second in (d, os.path.join(str(root), ".", "val.json")):
        assert _error(cal.main, ["--model", "tiny-moe", "--data", d, second, "--out", str(out), "--limit", "1"]) == (
            f"error: --data {second} is given twice (as {d} before); each calibration source counts once")
    assert not out.exists()
