import os
import re
import sys

import pytest
from safetensors.torch import load_file

from common import pretrain

TINY = ["--arch", "qwen3_vl", "--hidden", "32", "--layers", "1", "--batch-size", "4", "--steps", "4",
        "--eval-every", "100", "--ckpt-every", "1"]


def _run(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["pretrain", *TINY, *args])
    pretrain.main()


def test_interrupted_pretraining_resumes_exactly(tmp_path, monkeypatch):
    _run(monkeypatch, "--out", str(tmp_path / "a"))
    _run(monkeypatch, "--out", str(tmp_path / "b"), "--stop-at", "2")  # "killed" after step 2
    _run(monkeypatch, "--out", str(tmp_path / "b"))  # resumes from b.ckpt at step 2
    wa = load_file(str(tmp_path / "a" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all((wa[k] == wb[k]).all() for k in wa)


def test_resume_with_other_settings_is_refused(tmp_path, monkeypatch, capsys):
    _run(monkeypatch, "--out", str(tmp_path / "a"), "--stop-at", "1")
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, "--out", str(tmp_path / "a"), "--lr", "1e-3")
    assert e.value.code == 2
    assert re.search("error: .*other settings.*--fresh", capsys.readouterr().err)


def test_chat_examples_have_the_inference_prompt_shapes():
    import json
    import random

    from common import data
    from mod import data as vs
    rng = random.Random(0)
    ex = data.sample_example(rng)
    scene, family, q, a = ex
    gold = data.target_text(scene, a, q)
    prompt, target, tail = pretrain.chat_example(rng, ex, "plain")
    assert (prompt, target, tail) == (q, gold, " " + a)
    prompt, target, tail = pretrain.chat_example(rng, ex, "json")
    assert prompt == vs.single_prompt(q) and json.loads(target)["Answer"] == a and target.endswith(tail)
    prompt, target, _ = pretrain.chat_example(rng, ex, "debate")
    assert prompt.startswith(q + "\n" + vs.DEBATE_PROMPT) and "Response 1: {" in prompt
    assert json.loads(target) == json.loads(vs.to_json_response(gold))
    prompt, target, _ = pretrain.chat_example(rng, ex, "review")
    assert prompt.startswith(q + "\nYour previous answer: ") and target == gold


def test_wrong_priors_rate_is_obeyed():
    import random

    from common import data
    for rate, wrong in ((0.0, False), (1.0, True)):
        rng = random.Random(1)
        for _ in range(30):
            ex = data.sample_example(rng)
            prompt, _, _ = pretrain.chat_example(rng, ex, "review", wrong_priors=rate)
            prior = prompt.split("Your previous answer: ")[1].split("\n")[0]
            assert (data.final_answer(prior) != ex[3]) == wrong


def test_chat_continuation_from_a_saved_base(tmp_path, monkeypatch, capsys):
    _run(monkeypatch, "--out", str(tmp_path / "a"))
    _run(monkeypatch, "--init", str(tmp_path / "a"), "--chat-mix", "0,1,1,1,1", "--out", str(tmp_path / "c"),
         "--stop-at", "2")
    os.rename(tmp_path / "a", tmp_path / "moved")  # the same weights by another path still resume
    _run(monkeypatch, "--init", str(tmp_path / "moved"), "--chat-mix", "0,1,1,1,1", "--out", str(tmp_path / "c"))
    assert "resumed from" in capsys.readouterr().out
    os.rename(tmp_path / "moved", tmp_path / "a")
    wa = load_file(str(tmp_path / "a" / "model.safetensors"))
    wc = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert wa.keys() == wc.keys() and any((wa[k] != wc[k]).any() for k in wa)  # same model, trained further


def test_wrong_priors_must_be_a_probability(tmp_path, monkeypatch, capsys):
    for bad in ("1.5", "-1", "nan"):
        with pytest.raises(SystemExit):
            _run(monkeypatch, "--out", str(tmp_path / "a"), "--chat-mix", "1,1,1,1,1", "--wrong-priors", bad)
        assert "--wrong-priors" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("mix", ["1,1", "0,0,0,0,0", "1,1,-1,1,1", "a,b,c,d,e"])
def test_bad_chat_mix_is_refused(tmp_path, monkeypatch, capsys, mix):
    with pytest.raises(SystemExit):
        _run(monkeypatch, "--out", str(tmp_path / "a"), "--chat-mix", mix)
    assert "--chat-mix needs 5 non-negative weights" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_truncated_checkpoint_is_named_and_kept(tmp_path, monkeypatch, capsys):
    _run(monkeypatch, "--out", str(tmp_path / "a"), "--stop-at", "1")
    f = tmp_path / "a.ckpt" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, "--out", str(tmp_path / "a"))
    assert e.value.code == 2 and re.search(r"error: .*model\.safetensors.*--fresh", capsys.readouterr().err)
    assert f.exists() and (tmp_path / "a.ckpt" / "state.json").exists()  # nothing deleted
