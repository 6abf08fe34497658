"""Hardening of the MoLE command lines (mole.train, mole.infer, mole.diagnostics) on the committed tiny base.

Every bad input must end in a clear message (`error: ...` or argparse's own, exit status 2)
and leave what is on disk as it was: each test names the input, checks the message text and
checks that nothing was lost or half-written."""
import json
import os
import shutil

import pytest
import torch
from PIL import Image

from common import data
from common import shapes as world
from common.checkpoint import load_train_state
from mole import diagnostics as mdiag
from mole import infer as minfer
from mole import train as mt
from mole.model import MoLE
from helpers import error_of, snapshot


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    world.generate_split(str(d), "train", 8)
    world.generate_split(str(d), "test", 3)
    return d


def train_args(data_dir, out, *extra):
    """4 steps of batch 2 (2 in stage 1, 2 in stage 2), a checkpoint after every step."""
    return ["--data", str(data_dir), "--out", str(out), "--batch-size", "2", "--stage1-epochs", "0.5",
            "--stage2-epochs", "0.5", "--save-every", "1", "--quiet", "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def run(shapes, tmp_path_factory):
    """A finished 4-step MoLE run on tiny-dense."""
    out = tmp_path_factory.mktemp("mole") / "run"
    mt.main(train_args(shapes, out))
    return out


def copy_run(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


# ----------------------------------------------------------------------------- existing output, resume

def test_existing_checkpoint_needs_resume_or_overwrite(shapes, run, capsys):
    before = snapshot(run)
    err = error_of(mt.main, train_args(shapes, run), capsys)
    assert f"error: --out {run} already holds a checkpoint; pass --resume to continue it or --overwrite" in err
    assert snapshot(run) == before


@pytest.mark.parametrize("extra, expected", [
    (["--n-vis", "2", "--top-k", "1"], "n_vis: saved 4, now 2"),  # was a crash (tensor shapes)
    (["--lr", "0.001"], "lr: saved 0.002, now 0.001"),  # was silently accepted
    (["--batch-size", "4"], "batch_size: saved 2, now 4"),
    (["--method", "sft"], "method: saved 'mole', now 'sft'"),
    (["--r", "4"], "lora_r: saved 8, now 4"),
    (["--seed", "3"], "seed: saved 0, now 3"),
    (["--stage2-epochs", "1"], "stage2_epochs: saved 0.5, now 1.0"),
    (["--n-train", "6"], "data: saved '8 records, sha1"),
    (["--model", "tiny-moe"], "base_model: saved {'model_type': 'qwen3_vl'"),
    (["--grad-accum", "2"], "grad_accum: saved 1, now 2"),  # was accepted: aux losses are per micro-batch
], ids=["n-vis", "lr", "batch-size", "method", "lora-r", "seed", "epochs", "data", "base", "grad-accum"])
def test_resume_refuses_other_settings(shapes, run, capsys, extra, expected):
    before = snapshot(run)
    err = error_of(mt.main, train_args(shapes, run, "--resume", *extra), capsys)
    assert f"error: --resume: {run} was written with other settings (" in err and expected in err
    assert "or pass --overwrite to start over" in err
    assert snapshot(run) == before


def test_out_that_is_not_a_checkpoint_is_never_replaced(shapes, capsys):
    before = snapshot(shapes)  # the data folder itself: saving there would have replaced it wholesale
    for extra in ([], ["--overwrite"], ["--resume"]):
        err = error_of(mt.main, train_args(shapes, shapes, *extra), capsys)
        assert f"error: --out {shapes} exists and is not a mole.train checkpoint (no state.json)" in err
    assert snapshot(shapes) == before


def test_overwrite_starts_over(shapes, run, tmp_path):
    out = copy_run(run, tmp_path)
    _, _, log = mt.main(train_args(shapes, out, "--overwrite", "--max-steps", "1"))
    assert len(log) == 1 and load_train_state(str(out))[1]["step"] == 1


def test_truncated_checkpoint(shapes, run, tmp_path, capsys):
    out = copy_run(run, tmp_path)
    w = out / "model.safetensors"
    w.write_bytes(w.read_bytes()[:200])
    before = snapshot(out)
    err = error_of(mt.main, train_args(shapes, out, "--resume"), capsys)
    assert f"error: checkpoint {out} is unreadable (" in err
    err = error_of(minfer.main, ["--ckpt", str(out), "--data", str(shapes / "test.json")], capsys)
    assert f"error: checkpoint {out} is unreadable (" in err
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- degenerate flags

@pytest.mark.parametrize("module, argv, expected", [
    ("train", ["--n-train", "-5"], "argument --n-train: must be >= 0, got -5"),
    ("train", ["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    ("train", ["--lr", "0"], "argument --lr: must be > 0, got 0"),
    ("train", ["--n-vis", "0"], "argument --n-vis: must be >= 1, got 0"),
    ("train", ["--top-k", "0"], "argument --top-k: must be >= 1, got 0"),
    ("train", ["--stage1-epochs", "-1"], "argument --stage1-epochs: must be >= 0, got -1"),
    ("train", ["--warmup-ratio", "2"], "--warmup-ratio is a fraction of all steps (0-1), got 2.0"),
    ("train", ["--r", "0"], "argument --r: must be >= 1, got 0"),
    ("train", ["--max-steps", "-1"], "argument --max-steps: must be >= 0, got -1"),
    ("train", ["--method", "mle"], "argument --method: invalid choice: 'mle'"),
    ("train", ["--latent-mixing", "topo"], "argument --latent-mixing: invalid choice: 'topo'"),
    ("train", ["--train", "lora8"], "argument --train: invalid choice: 'lora8'"),
    ("infer", ["--limit", "-1"], "argument --limit: must be >= 0, got -1"),
    ("infer", ["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    ("infer", ["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    ("infer", ["--intervention", "shuffled"], "argument --intervention: invalid choice: 'shuffled'"),
    ("diagnostics", ["--limit", "-1"], "argument --limit: must be >= 0, got -1"),
    ("diagnostics", ["--stage", "3"], "argument --stage: invalid choice: 3"),
])
def test_degenerate_flags_stop_at_parse_time(shapes, tmp_path, capsys, module, argv, expected):
    out = tmp_path / "never"
    base = {"train": ["--data", str(shapes), "--out", str(out)],
            "infer": ["--ckpt", str(out), "--data", str(shapes / "test.json")],
            "diagnostics": ["--ckpt", str(out), "--data", str(shapes / "test.json")]}[module]
    main = {"train": mt.main, "infer": minfer.main, "diagnostics": mdiag.main}[module]
    err = error_of(main, base + argv, capsys)
    assert "error: " in err and expected in err
    assert not out.exists()


@pytest.mark.parametrize("extra, expected", [
    (["--top-k", "5"], "error: need 1 <= top_k <= n_vis, got top_k=5, n_vis=4"),
    (["--stage1-epochs", "0", "--stage2-epochs", "0"], "error: --stage1-epochs and --stage2-epochs are both 0"),
    (["--lora-targets", "qproj"], "error: LoRA target_modules ['qproj'] match no nn.Linear of the language model; "
                                  "available names: ['down_proj', 'gate_proj', 'k_proj'"),
], ids=["top-k>n-vis", "no-epochs", "lora-targets"])
def test_inconsistent_settings(shapes, tmp_path, capsys, extra, expected):
    err = error_of(mt.main, train_args(shapes, tmp_path / "o", *extra), capsys)
    assert expected in err and not (tmp_path / "o").exists()


def test_lr_required_for_a_big_base(shapes, tmp_path, capsys):
    # the default 2e-3 is a toy value: a base wider than the tiny ones must pass --lr (checked
    # from its config.json before anything loads); the tiny bases keep the default
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 3584}}))
    err = error_of(mt.main, train_args(shapes, tmp_path / "o", "--model", str(big)), capsys)
    assert "error: --lr is required with --model" in err and "hidden size 3584" in err
    assert not (tmp_path / "o").exists()
    assert mt.toy_lr("tiny-dense") == 2e-3


# ----------------------------------------------------------------------------- bad data

def _broken_copy(shapes, tmp_path, how):
    d = tmp_path / "d"
    shutil.copytree(shapes, d)
    recs = json.loads((d / "train.json").read_text())
    if how == "missing dir":
        shutil.rmtree(d)
    elif how == "missing image":
        os.remove(d / recs[1]["image"])
    elif how == "truncated image":
        img = d / recs[1]["image"]
        img.write_bytes(img.read_bytes()[:120])
    elif how == "no image":  # mixed image sizes are fine now (one image path: the processor's resize)
        del recs[3]["image"]
        (d / "train.json").write_text(json.dumps(recs))
    elif how == "empty answer":
        recs[2]["conversations"][1]["value"] = ""
        (d / "train.json").write_text(json.dumps(recs))
    return d


@pytest.mark.parametrize("how, expected", [
    ("missing dir", "no train.json or train.jsonl there; generate data with `python -m common.shapes"),
    ("missing image", "record train_000001: image "),
    ("truncated image", "train_000001"),
    ("no image", "mole.train: 1 record(s) with no image (a text-only record), e.g. ['train_000003']"),
    ("empty answer", "1 record(s) with an empty answer (gpt turn), e.g. ['train_000002']"),
])
def test_bad_training_data(shapes, tmp_path, capsys, how, expected):
    d = _broken_copy(shapes, tmp_path, how)
    before = snapshot(d)
    err = error_of(mt.main, train_args(d, tmp_path / "o"), capsys)
    last = err[err.index("error: "):]      # a reader's `note:` may come first (a text-only record's <image> tag)
    assert expected in last and "Traceback" not in err
    assert not (tmp_path / "o").exists() and snapshot(d) == before


def test_nan_loss_stops_and_keeps_the_last_checkpoint(shapes, tmp_path, capsys, monkeypatch):
    out, calls, real = tmp_path / "o", [], MoLE.forward

    def poisoned(self, batch, stage, **kw):  # the 4th training forward (step 3) gives a nan loss
        res = real(self, batch, stage, **kw)
        if "labels" in batch:
            calls.append(1)
            if len(calls) == 4:
                res["loss"] = res["loss"] * float("nan")
        return res

    monkeypatch.setattr(MoLE, "forward", poisoned)
    err = error_of(mt.main, train_args(shapes, out, "--save-every", "2"), capsys)
    assert "error: non-finite training loss at step 3 (loss nan" in err and "stopped before the update" in err
    assert f"kept the last good checkpoint {out} (step 2)" in err
    tensors, state = load_train_state(str(out))
    assert state["step"] == 2 and all(torch.isfinite(t).all() for t in tensors.values())
    monkeypatch.undo()
    net, _, _ = mt.load_mole(str(out))  # the kept checkpoint loads
    assert isinstance(net, MoLE)


def test_batch_with_every_label_masked(shapes, tmp_path, capsys, monkeypatch):
    real = MoLE.encode

    def masked(self, *a, **kw):
        b = real(self, *a, **kw)
        if "labels" in b:
            b["labels"][:] = -100
        return b

    monkeypatch.setattr(MoLE, "encode", masked)
    err = error_of(mt.main, train_args(shapes, tmp_path / "o"), capsys)
    assert "error: step 0: every label of the batch is masked: no answer token to train on" in err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- loading, inference, diagnostics

def test_checkpoint_on_the_wrong_base_is_refused(shapes, run, capsys):
    before = snapshot(run)
    err = error_of(minfer.main, ["--ckpt", str(run), "--model", "tiny-moe", "--data", str(shapes / "test.json")], capsys)
    assert f"error: {run} was trained on base " in err and "tiny/dense and does not fit base " in err
    assert "tiny/moe (model_type 'qwen3_vl' vs 'qwen3_vl_moe')" in err
    assert snapshot(run) == before


def test_missing_checkpoint(shapes, tmp_path, capsys):
    err = error_of(minfer.main, ["--ckpt", str(tmp_path / "none"), "--data", str(shapes / "test.json")], capsys)
    assert f"error: {tmp_path / 'none'}: no checkpoint (expected a directory written by mole.train)" in err


def test_jsonl_data_and_diagnostics_cli(shapes, run, tmp_path, capsys):
    recs = json.loads((shapes / "train.json").read_text())
    jl = tmp_path / "train.jsonl"  # LLaVA JSONL, trained from a file path
    jl.write_text("".join(json.dumps(dict(r, image=str(shapes / r["image"]))) + "\n" for r in recs))
    _, _, log = mt.main(train_args(jl, tmp_path / "j", "--max-steps", "1"))
    assert len(log) == 1
    test = json.loads((shapes / "test.json").read_text())
    canon = tmp_path / "test.jsonl"  # canonical benchmark JSONL for inference
    canon.write_text("".join(json.dumps({"id": r["id"], "image": str(shapes / r["image"]), "family": r["family"],
                                         "question": r["conversations"][0]["value"].split("\n", 1)[1],
                                         "answer": r["answer"]}) + "\n" for r in test))
    res = minfer.main(["--ckpt", str(run), "--data", str(canon), "--max-new-tokens", "4",
                       "--out", str(tmp_path / "new" / "pred.json")])
    assert len(res) == 3 and len(json.loads((tmp_path / "new" / "pred.json").read_text())) == 3
    diag = mdiag.main(["--ckpt", str(run), "--data", str(canon), "--out", str(tmp_path / "diag.json")])
    assert "latent similarity x100" in capsys.readouterr().out
    saved = json.loads((tmp_path / "diag.json").read_text())
    assert saved == diag and 0 <= saved["latent_similarity_x100"] <= 100 and saved["attention_kl_x100"] >= 0
    mt.main(train_args(shapes, tmp_path / "sft", "--method", "sft", "--max-steps", "1"))
    err = error_of(mdiag.main, ["--ckpt", str(tmp_path / "sft"), "--data", str(canon)], capsys)
    assert "is a --method sft checkpoint: it has no latent tokens to diagnose" in err


def test_generation_without_end_token_is_bounded(shapes, run):
    net, proc, stage = mt.load_mole(str(run))
    proc.eos_token_id = proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")  # a token it never emits
    imgs = [data.load_image(str(shapes / f"images/test_00000{i}.png")) for i in range(2)]
    texts, lens = minfer.generate(net, imgs, ["How many circles are there?"] * 2, stage=stage, max_new_tokens=6)
    assert lens == [6, 6] and len(texts) == 2


# ----------------------------------------------------------------------------- inference flags

def test_infer_and_diagnostics_take_limit_and_check_out_first(shapes, run, tmp_path, capsys):
    """--limit caps the records (as in every other entry point); --out a directory is refused
    before the checkpoint loads (--ckpt nowhere is never reached); nothing is written."""
    test = str(shapes / "test.json")
    for main in (minfer.main, mdiag.main):
        err = error_of(main, ["--ckpt", "nowhere", "--data", test, "--out", str(tmp_path)], capsys)
        assert f"error: --out {tmp_path} is a directory; give a file path, e.g. {tmp_path / 'results.json'}" in err
        err = error_of(main, ["--ckpt", "nowhere", "--data", test, "--limit", "-1"], capsys)
        assert "argument --limit: must be >= 0, got -1" in err
    assert os.listdir(tmp_path) == []
    res = minfer.main(["--ckpt", str(run), "--data", test, "--limit", "1", "--max-new-tokens", "2", "--device", "cpu",
                       "--out", str(tmp_path / "sub" / "p.json")])
    assert len(res) == 1 and len(json.load(open(tmp_path / "sub" / "p.json"))) == 1
    assert mdiag.main(["--ckpt", str(run), "--data", test, "--limit", "2", "--device", "cpu"])["n"] == 2


def test_inference_on_a_truncated_checkpoint_names_no_trainer_flag(shapes, run, tmp_path, capsys):
    """mole.infer / mole.diagnostics have no --overwrite: their message says restore or retrain;
    the trainer's --resume keeps `start over with --overwrite`."""
    out = copy_run(run, tmp_path)
    w = out / "model.safetensors"
    w.write_bytes(w.read_bytes()[:200])
    before = snapshot(out)
    for main in (minfer.main, mdiag.main):
        err = error_of(main, ["--ckpt", str(out), "--data", str(shapes / "test.json")], capsys)
        assert f"error: checkpoint {out} is unreadable (" in err
        assert err.rstrip().endswith("; restore it, or retrain it (its training run cannot be resumed either)")
        assert "--overwrite" not in err
    err = error_of(mt.main, train_args(shapes, out, "--resume"), capsys)
    assert err.rstrip().endswith("; restore it, or start over with --overwrite")
    assert snapshot(out) == before


def test_checkpoint_of_another_trainer_is_not_a_mole_checkpoint(shapes, run, tmp_path, capsys):
    out = copy_run(run, tmp_path)  # a mod.train / eval.tools.pretrain checkpoint: state.json without "args"
    state = json.loads((out / "state.json").read_text())
    (out / "state.json").write_text(json.dumps({k: state[k] for k in ("step", "settings", "log")}))
    before = snapshot(out)
    for extra in ([], ["--overwrite"], ["--resume"]):  # --overwrite used to delete it
        err = error_of(mt.main, train_args(shapes, out, *extra), capsys)
        assert f"error: --out {out}: {out} is not a mole.train checkpoint" in err
    err = error_of(minfer.main, ["--ckpt", str(out), "--data", str(shapes / "test.json")], capsys)  # was KeyError
    assert f"error: {out} is not a mole.train checkpoint" in err
    assert snapshot(out) == before


@pytest.mark.parametrize("extra", [["--data", "no/such/data"], ["--model", "no/such/base"]], ids=["data", "base"])
def test_overwrite_keeps_the_old_run_when_data_or_base_is_wrong(shapes, run, tmp_path, capsys, extra):
    out = copy_run(run, tmp_path)
    before = snapshot(out)
    error_of(mt.main, train_args(shapes, out, "--overwrite", *extra), capsys)
    assert snapshot(out) == before


def test_infer_warns_when_stage2_never_ran(shapes, run, tmp_path, capsys):
    """Newcomer trial: a `mole.train --max-steps 10` checkpoint stopped in stage 1 (answers could not
    read the image) and mole.infer used it without a word. One `warning:` line now; none for a
    finished run, a schedule without stage 2, or an SFT checkpoint (no stages)."""
    mt.main(train_args(shapes, tmp_path / "s1", "--max-steps", "1"))         # stops in stage 1 (2 steps there)
    capsys.readouterr()
    test = str(shapes / "test.json")
    for main in (minfer.main, mdiag.main):
        main(["--ckpt", str(tmp_path / "s1"), "--data", test, "--limit", "1", "--max-new-tokens", "2"]
             if main is minfer.main else ["--ckpt", str(tmp_path / "s1"), "--data", test, "--limit", "1"])
        warnings = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
        assert len(warnings) == 1 and warnings[0].startswith(f"warning: {tmp_path / 's1'}: training stopped at "
                                                             f"step 1 in stage 1"), warnings
        assert "stage 2 of its schedule (--stage2-epochs 0.5) never ran" in warnings[0]
    minfer.main(["--ckpt", str(run), "--data", test, "--limit", "1", "--max-new-tokens", "2"])
    assert "warning" not in capsys.readouterr().err                           # stage 2 ran
    log1, log2 = [{"step": 1, "stage": 1}], [{"step": 1, "stage": 1}, {"step": 2, "stage": 2}]
    assert mt.unfinished_stage2({"args": {"stage2_epochs": 1}, "step": 1, "log": log1})
    assert mt.unfinished_stage2({"args": {"stage2_epochs": 1}, "step": 0, "log": []})
    assert mt.unfinished_stage2({"args": {"stage2_epochs": 1}, "step": 2, "log": log2}) is None
    assert mt.unfinished_stage2({"args": {"stage2_epochs": 0}, "step": 1, "log": log1}) is None
    assert mt.unfinished_stage2({"args": {"stage2_epochs": 1, "method": "sft"}, "step": 1, "log": log1}) is None
