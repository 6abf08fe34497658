"""Hardening of the MoD command lines (mod.train, mod.infer, mod.data) on the committed tiny base.

Every bad input must end in a clear message (`error: ...` or argparse's own, exit status 2)
and leave what is on disk as it was: each test names the input, checks the message text and
checks that nothing was lost or half-written."""
import hashlib
import json
import os
import shutil

import pytest
import torch

from common import data
from common import shapes as world
from common.checkpoint import load_train_state
from mod import data as mdata
from mod import infer as minfer
from mod import train as mtrain
from helpers import error_of, snapshot


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    world.generate_split(str(d), "train", 6)
    world.generate_split(str(d), "val", 4)
    return d


def train_args(shapes, out, *extra):
    return ["--model", "tiny-dense", "--data", str(shapes / "train.json"), "--out", str(out), "--steps", "3", "--batch-size", "2",
            "--warmup-steps", "1", "--save-every", "1", *extra]


@pytest.fixture(scope="module")
def run(shapes, tmp_path_factory):
    """A finished 3-step MoD run on tiny-dense (checkpoint, log, adapters)."""
    out = tmp_path_factory.mktemp("mod") / "run"
    mtrain.main(train_args(shapes, out))
    return out


def copy_run(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


# ----------------------------------------------------------------------------- existing output, resume

def test_existing_run_needs_resume_or_overwrite(shapes, run, capsys):
    before = snapshot(run)
    err = error_of(mtrain.main, train_args(shapes, run), capsys)
    assert f"error: --out {run} already holds a run (ckpt, log.jsonl" in err
    assert "pass --resume to continue it or --overwrite to start over" in err
    assert snapshot(run) == before


@pytest.mark.parametrize("extra, expected", [
    (["--method", "lora"], "method: saved 'mod', now 'lora'"),  # was a KeyError
    (["--lr", "0.001"], "lr: saved 0.002, now 0.001"),  # was silently accepted
    (["--r", "2"], "r: saved 4, now 2"),
    (["--batch-size", "3"], "batch_size: saved 2, now 3"),
    (["--seed", "1"], "seed: saved 0, now 1"),
    (["--steps", "5"], "steps: saved 3, now 5"),  # past warmup: the finished steps had other lrs
    (["--model", "tiny-moe"], "base_model: saved {'model_type': 'qwen3_vl'"),
    ("val", "data: saved '6 records, sha1"),
], ids=["method", "lr", "r", "batch-size", "seed", "steps", "base", "data"])
def test_resume_refuses_other_settings(shapes, run, capsys, extra, expected):
    before = snapshot(run)
    if extra == "val":
        extra = ["--data", str(shapes / "val.json")]
    err = error_of(mtrain.main, train_args(shapes, run, "--resume", *extra), capsys)
    assert f"error: --resume: {run}/ckpt was written with other settings (" in err and expected in err
    assert "or pass --overwrite to start over" in err
    assert snapshot(run) == before


def test_overwrite_starts_over_and_spares_other_files(shapes, run, tmp_path):
    out = copy_run(run, tmp_path)
    (out / "notes.txt").write_text("mine")
    (out / "log.jsonl").write_text('{"step": 99, "loss": 1}\n')
    mtrain.main(train_args(shapes, out, "--overwrite", "--steps", "2"))
    assert (out / "notes.txt").read_text() == "mine"
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == [0, 1]
    assert load_train_state(str(out / "ckpt"))[1]["step"] == 2


def test_resume_and_overwrite_are_exclusive(shapes, tmp_path, capsys):
    err = error_of(mtrain.main, train_args(shapes, tmp_path / "o", "--resume", "--overwrite"), capsys)
    assert "argument --overwrite: not allowed with argument --resume" in err
    assert not (tmp_path / "o").exists()


def test_old_torch_save_checkpoint_is_not_resumed(shapes, tmp_path, capsys):
    out = tmp_path / "old"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"pickle")
    err = error_of(mtrain.main, train_args(shapes, out, "--resume"), capsys)
    assert "ckpt.pt was written by an older mod.train (torch.save format)" in err and "--overwrite" in err
    assert snapshot(out) == {"ckpt.pt": hashlib.sha1(b"pickle").hexdigest()}


def test_out_is_a_file(shapes, tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    err = error_of(mtrain.main, train_args(shapes, f), capsys)
    assert f"error: --out {f} is a file, not a directory" in err and f.read_text() == "x"


def test_truncated_checkpoint_is_refused_on_resume(shapes, run, tmp_path, capsys):
    out = copy_run(run, tmp_path)
    w = out / "ckpt" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    before = snapshot(out)
    err = error_of(mtrain.main, train_args(shapes, out, "--resume"), capsys)
    assert f"error: checkpoint {out}/ckpt is unreadable (" in err and "start over with --overwrite" in err
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- degenerate flags

@pytest.mark.parametrize("module, argv, expected", [
    ("train", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("train", ["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    ("train", ["--grad-accum", "0"], "argument --grad-accum: must be >= 1, got 0"),
    ("train", ["--lr", "0"], "argument --lr: must be > 0, got 0"),
    ("train", ["--lr=-1e-3"], "argument --lr: must be > 0, got -1e-3"),
    ("train", ["--lr", "nan"], "argument --lr: must be > 0, got nan"),
    ("train", ["--r", "0"], "argument --r: must be >= 1, got 0"),
    ("train", ["--window", "-2"], "argument --window: must be >= 1, got -2"),
    ("train", ["--save-every", "-1"], "argument --save-every: must be >= 0, got -1"),
    ("train", ["--steps", "ten"], "argument --steps: expected an integer, got 'ten'"),
    ("train", ["--method", "mdo"], "argument --method: invalid choice: 'mdo'"),
    ("train", ["--granularity", "windw"], "argument --granularity: invalid choice: 'windw'"),
    ("data", ["--num-return-sequences", "0"], "argument --num-return-sequences: must be >= 1, got 0"),
    ("data", ["--ratios", "0,0,0"], "argument --ratios: needs three weights >= 0 (pos,rev,rob), not all 0"),
    ("data", ["--ratios", "1,2"], "argument --ratios: needs three weights >= 0"),
    ("data", ["--ratios", "1,-1,1"], "argument --ratios: needs three weights >= 0"),
    ("data", ["--limit", "-1"], "argument --limit: must be >= 0, got -1"),
    ("data", ["--max-priors", "-1"], "argument --max-priors: must be >= 0, got -1"),
    ("data", ["--min-priors", "3", "--max-priors", "1"], "--min-priors 3 exceeds --max-priors 1"),
    ("data", ["--temperature", "0"], "argument --temperature: must be > 0, got 0"),
    ("infer", ["--rounds", "-1"], "argument --rounds: must be >= 0, got -1"),
    ("infer", ["--limit", "-1"], "argument --limit: must be >= 0, got -1"),
    ("infer", ["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    ("infer", ["--methods", "single,mda", "--adapter", "x"], "unknown method(s) ['mda']"),
    ("infer", ["--methods", "single"], "these need --adapter: single (train one with mod.train); without an adapter run only the base-model rows"),
])
def test_degenerate_flags_stop_at_parse_time(shapes, tmp_path, capsys, module, argv, expected):
    out = tmp_path / "never"
    base = {"train": ["--data", str(shapes / "train.json"), "--out", str(out)],
            "data": ["--data", str(shapes / "train.json"), "--out", str(out)],
            "infer": ["--data", str(shapes / "train.json"), "--out", str(out)]}[module]
    main = {"train": mtrain.main, "data": mdata.main, "infer": minfer.main}[module]
    err = error_of(main, base + argv, capsys)
    assert "error: " in err and expected in err
    assert not out.exists()


def test_top_r_above_num_experts(shapes, tmp_path, capsys):
    err = error_of(mtrain.main, train_args(shapes, tmp_path / "o", "--r", "9"), capsys)
    assert "error: AdapterConfig: top-r must not exceed num_experts" in err
    assert not (tmp_path / "o").exists()


def test_unknown_target_modules_lists_available(shapes, tmp_path, capsys):
    err = error_of(mtrain.main, train_args(shapes, tmp_path / "o", "--target-modules", "qproj"), capsys)
    assert "error: target_modules ['qproj'] match no nn.Linear of the language model" in err
    assert "available suffixes: [" in err and "'q_proj'" in err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- bad data and checkpoints

def _broken_copy(shapes, tmp_path, how):
    d = tmp_path / "d"
    shutil.copytree(shapes, d)
    f = d / "train.json"
    recs = json.loads(f.read_text())
    if how == "missing image":
        os.remove(d / recs[1]["image"])
    elif how == "truncated image":
        img = d / recs[1]["image"]
        img.write_bytes(img.read_bytes()[:120])
    elif how == "truncated json":
        f.write_text(f.read_text()[:700])
    elif how == "empty answer":
        recs[2]["conversations"][1]["value"] = "  "
        f.write_text(json.dumps(recs))
    elif how == "empty file":
        f.write_text("")
    elif how == "missing file":
        os.remove(f)
    return f


@pytest.mark.parametrize("how, expected", [
    ("missing image", "record train_000001: image "),
    ("truncated image", "train_000001"),
    ("truncated json", "not valid JSON"),
    ("empty answer", "1 record(s) with an empty answer (gpt turn), e.g. ['train_000002']"),
    ("empty file", "no records"),
    ("missing file", "file not found"),
])
def test_bad_training_data(shapes, tmp_path, capsys, how, expected):
    f = _broken_copy(shapes, tmp_path, how)
    before = snapshot(tmp_path / "d")
    err = error_of(mtrain.main, ["--data", str(f), "--out", str(tmp_path / "o"), "--steps", "1"], capsys)
    assert err.startswith("error: ") and expected in err and "Traceback" not in err
    assert not (tmp_path / "o").exists() and snapshot(tmp_path / "d") == before


def test_missing_base_model(shapes, tmp_path, capsys):
    err = error_of(mtrain.main, train_args(shapes, tmp_path / "o", "--model", str(tmp_path / "nope")), capsys)
    assert f"error: {tmp_path / 'nope'}: no such checkpoint directory" in err


def test_nan_loss_stops_and_keeps_the_last_checkpoint(shapes, tmp_path, capsys, monkeypatch):
    out, calls, real = tmp_path / "o", [], mtrain.aux_loss

    def poisoned(model):  # the 4th forward (step 3) returns a nan aux loss
        calls.append(1)
        return real(model) * (float("nan") if len(calls) == 4 else 1.0)

    monkeypatch.setattr(mtrain, "aux_loss", poisoned)
    err = error_of(mtrain.main, train_args(shapes, out, "--steps", "6", "--save-every", "2"), capsys)
    assert "error: non-finite training loss at step 3 (loss" in err and "stopped before the update" in err
    assert f"kept the last good checkpoint {out}/ckpt (step 2)" in err
    tensors, state = load_train_state(str(out / "ckpt"))
    assert state["step"] == 2 and all(torch.isfinite(t.float()).all() for t in tensors.values())
    assert not (out / "adapter_model.safetensors").exists()  # no adapters from a diverged run
    monkeypatch.undo()  # the kept checkpoint resumes
    mtrain.main(train_args(shapes, out, "--steps", "6", "--save-every", "2", "--resume"))
    assert load_train_state(str(out / "ckpt"))[1]["step"] == 6


def test_batch_with_every_label_masked(shapes, tmp_path, capsys, monkeypatch):
    real = mtrain.Batcher.encode

    def masked(self, recs, answers=None, questions=None):
        b = real(self, recs, answers, questions)
        b["labels"][:] = -100
        return b

    monkeypatch.setattr(mtrain.Batcher, "encode", masked)
    err = error_of(mtrain.main, train_args(shapes, tmp_path / "o"), capsys)
    assert "error: step 0: every label of the batch is masked: no answer token to train on" in err
    assert not (tmp_path / "o" / "ckpt").exists()


def test_jsonl_training_data(shapes, tmp_path):
    recs = json.loads((shapes / "train.json").read_text())
    llava = tmp_path / "train_llava.jsonl"
    llava.write_text("".join(json.dumps(dict(r, image=str(shapes / r["image"]))) + "\n" for r in recs))
    canonical = tmp_path / "train_canonical.jsonl"
    canonical.write_text("".join(json.dumps({"id": r["id"], "image": str(shapes / r["image"]), "family": r["family"],
                                             "question": r["conversations"][0]["value"].split("\n", 1)[1],
                                             "answer": r["answer"]}) + "\n" for r in recs))
    for f in (llava, canonical):
        out = tmp_path / f.stem
        mtrain.main(["--data", str(f), "--out", str(out), "--steps", "1", "--batch-size", "2"])
        assert (out / "adapter_model.safetensors").exists()


# ----------------------------------------------------------------------------- inference and data synthesis

def test_adapter_on_the_wrong_base_is_refused(shapes, run, capsys):
    cfg = json.loads((run / "adapter_config.json").read_text())
    assert cfg["base_model"]["model_type"] == "qwen3_vl" and cfg["base_model"]["name_or_path"].endswith("tiny/dense")
    err = error_of(minfer.main, ["--model", "tiny-moe", "--adapter", str(run), "--data", str(shapes / "val.json"),
                                 "--methods", "single"], capsys)
    assert f"error: {run}: adapters were trained on base " in err and "tiny/dense and do not fit base " in err
    assert "tiny/moe (model_type 'qwen3_vl' vs 'qwen3_vl_moe')" in err


def test_adapter_on_a_base_with_other_weights_is_refused(shapes, run, tmp_path, capsys):
    """tiny-chat has tiny-dense's config but other weights: only the weights fingerprint tells them apart."""
    from common.backbone import load_backbone
    from mod.model import load_adapters
    err = error_of(minfer.main, ["--model", "tiny-chat", "--adapter", str(run), "--data", str(shapes / "val.json"),
                                 "--methods", "single"], capsys)
    assert f"error: {run}: adapters were trained on base " in err and "tiny/dense and do not fit base " in err
    assert "tiny/chat (same architecture and size, but the weights differ: embedding sha256 " in err
    assert load_adapters(load_backbone("tiny-dense")[0], str(run)).method == "mod"
    old = copy_run(run, tmp_path)  # adapters saved before the fingerprint was recorded: not checked
    cfg = json.loads((old / "adapter_config.json").read_text())
    del cfg["base_model"]["weights"]
    (old / "adapter_config.json").write_text(json.dumps(cfg))
    assert load_adapters(load_backbone("tiny-chat")[0], str(old)).method == "mod"
    del cfg["base_model"]                      # no base recorded at all: refused, never loaded unchecked
    (old / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="records no base_model"):
        load_adapters(load_backbone("tiny-chat")[0], str(old))


def test_resume_on_a_base_with_other_weights_is_refused(shapes, run, tmp_path, capsys):
    out = copy_run(run, tmp_path)
    err = error_of(mtrain.main, train_args(shapes, out, "--resume", "--model", "tiny-chat"), capsys)
    assert f"error: --resume: {out}/ckpt was written with other settings (base_model: saved " in err
    assert "'weights': 'sha256 " in err
    state = json.loads((out / "ckpt" / "state.json").read_text())  # a checkpoint from before the fingerprint
    del state["settings"]["base_model"]["weights"]
    (out / "ckpt" / "state.json").write_text(json.dumps(state))
    assert mtrain.main(train_args(shapes, out, "--resume"))["steps"] == 0  # finished run: nothing left to do


def test_truncated_adapter_file(shapes, run, tmp_path, capsys):
    out = copy_run(run, tmp_path)
    w = out / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:64])
    err = error_of(minfer.main, ["--model", "tiny-dense", "--adapter", str(out), "--data", str(shapes / "val.json"),
                                 "--methods", "single"], capsys)
    assert f"error: {w} is unreadable (" in err and "incomplete or corrupt" in err


def test_mod_data_never_replaces_its_input_or_an_existing_file(shapes, tmp_path, capsys):
    src = tmp_path / "q.json"
    shutil.copy(shapes / "train.json", src)
    before = src.read_bytes()
    err = error_of(mdata.main, ["--data", str(src), "--out", str(src), "--overwrite"], capsys)
    assert "--out is the --data file: it would replace the questions" in err
    other = tmp_path / "vs.json"
    other.write_text("[]")
    err = error_of(mdata.main, ["--data", str(src), "--out", str(other)], capsys)
    assert f"--out {other} exists; pass --overwrite to replace it" in err
    assert src.read_bytes() == before and other.read_text() == "[]"


def test_debate_answers_that_are_not_valid_json():
    for text in ['{"Reasoning": "tl red circle", "Answer": ', "no json at all", '["yes"]', '{"Reasoning": "x"}',
                 "", '{"Answer": {"nested": 1}}', "tl red circle. Answer: yes}}}", "{{{{"]:
        r = json.loads(mdata.to_json_response(text))
        assert set(r) == {"Reasoning", "Answer"}, text
    assert mdata.is_correct('{"Reasoning": "tl red circle", "Answer": "yes"', "yes", "existence")  # cut off
    assert not mdata.is_correct("{{{{", "yes", "existence")
    res = minfer._results([{"id": "a", "family": "count", "answer": "2"}, {"id": "b", "family": "count", "answer": "2"}],
                          ['{"Answer": 2', "<|garbage|> ]"], [5, 3])
    assert [r["correct"] for r in res] == [True, False]


def test_generation_without_end_token_is_bounded(shapes):
    from common.backbone import load_backbone
    from mod.model import AdapterConfig, attach
    model, proc = load_backbone("tiny-dense")
    attach(model, AdapterConfig())
    proc.eos_token_id = proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")  # a token it never emits
    proc.stop_ids = [proc.eos_token_id]
    recs = data.read_llava_json(str(shapes / "val.json"))[:2]
    res, _ = minfer.mod_debate(model.eval(), proc, recs, rounds=1, max_new_tokens=7)
    assert [r["n_tokens"] for r in res] == [14, 14]  # two calls of exactly max_new_tokens each


@pytest.mark.parametrize("flag", ["--out", "--heatmap"])
def test_infer_output_that_is_a_directory_fails_first(shapes, run, tmp_path, capsys, monkeypatch, flag):
    def no_generation(*a, **k):
        raise AssertionError("generation ran before the output path was checked")
    monkeypatch.setattr(minfer, "plain", no_generation)
    err = error_of(minfer.main, ["--model", "tiny-dense", "--adapter", str(run), "--data", str(shapes / "val.json"),
                                 "--methods", "base", "--limit", "1", flag, str(tmp_path)], capsys)
    assert f"error: {flag} {tmp_path} is a directory; give a file path" in err


def test_save_adapters_leaves_no_temp_file_on_failure(run, tmp_path):
    from common.backbone import load_backbone
    from mod.model import CONFIG_NAME, load_adapters, save_adapters
    model, _ = load_backbone("tiny-dense")
    load_adapters(model, str(run))
    (tmp_path / CONFIG_NAME).mkdir()                        # the rename of the config fails
    with pytest.raises(OSError):
        save_adapters(model, str(tmp_path))
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_short_run_default_warmup_reaches_the_peak_lr(shapes, tmp_path):
    """Newcomer trial: `mod.train --steps 10` kept --warmup 20, so the lr never reached its peak.
    The default is now min(20, steps // 10), at least 1; the checkpoint records the resolved value."""
    assert [mtrain.default_warmup(s) for s in (1, 10, 35, 199, 200, 5000)] == [1, 1, 3, 19, 20, 20]
    args = ["--model", "tiny-dense", "--data", str(shapes / "train.json"), "--out", str(tmp_path / "r"),
            "--steps", "2", "--batch-size", "2", "--lr", "0.004", "--save-every", "1"]
    res = mtrain.main(args)
    assert [round(r["lr"], 6) for r in res["log"]] == [0.004, 0.004]           # peak from the first step
    state = json.loads((tmp_path / "r" / "ckpt" / "state.json").read_text())
    assert state["settings"]["warmup"] == 1
    assert mtrain.main(args + ["--resume", "--warmup-steps", "1"])["steps"] == 0      # the same run, spelled out


def test_a_wrong_adapter_path_is_refused_before_any_model_loads(shapes, tmp_path, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the --adapter path was checked")
    monkeypatch.setattr(minfer, "load_backbone", no_load)
    err = error_of(minfer.main, ["--model", "tiny-chat", "--adapter", str(tmp_path / "none"), "--data",
                                 str(shapes / "val.json"), "--methods", "single", "--threads", "1"], capsys)
    assert "no adapter_config.json" in err and "not an adapter directory" in err


def test_resume_with_nothing_to_resume_says_it_starts_fresh(tmp_path, capsys):
    """`mod.train --resume` on an empty --out starts at step 0 and says so (it used to start silently)."""
    from mod.train import prepare_out
    assert prepare_out(str(tmp_path / "run"), resume=True, overwrite=False) == []
    assert "no run in" in capsys.readouterr().err
    assert prepare_out(str(tmp_path / "run2"), resume=False, overwrite=False) == []
    assert capsys.readouterr().err == ""
