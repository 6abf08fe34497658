import os
import re
import sys

import pytest
from safetensors.torch import load_file

from eval.tools import pretrain

TINY = ["--arch", "qwen3_vl", "--hidden", "32", "--layers", "1", "--batch-size", "4", "--steps", "4",
        "--eval-every", "100", "--save-every", "1"]


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
    assert re.search("error: .*other settings.*--overwrite", capsys.readouterr().err)


def test_resume_refuses_a_checkpoint_whose_recipe_lacks_a_setting(tmp_path, monkeypatch, capsys):
    """Every recipe key is compared: a checkpoint that does not record one (say --look) is not
    resumed as if it had the value asked for now."""
    import json
    _run(monkeypatch, "--out", str(tmp_path / "a"), "--stop-at", "1")
    st = tmp_path / "a.ckpt" / "state.json"
    state = json.loads(st.read_text())
    del state["recipe"]["look"]
    st.write_text(json.dumps(state))
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, "--out", str(tmp_path / "a"))
    assert e.value.code == 2 and "'look': (None, 'full')" in capsys.readouterr().err


def test_chat_examples_have_the_inference_prompt_shapes():
    import json
    import random

    from common import data
    from common import answers
    from common import shapes as world
    from mod import data as vs
    rng = random.Random(0)
    ex = world.sample_example(rng)
    scene, family, q, a = ex
    gold = world.target_text(scene, a, q)
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
    from common import answers
    from common import shapes as world
    for rate, wrong in ((0.0, False), (1.0, True)):
        rng = random.Random(1)
        for _ in range(30):
            ex = world.sample_example(rng)
            prompt, _, _ = pretrain.chat_example(rng, ex, "review", wrong_priors=rate)
            prior = prompt.split("Your previous answer: ")[1].split("\n")[0]
            assert (answers.final_answer(prior) != ex[3]) == wrong


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
    assert e.value.code == 2 and re.search(r"error: .*model\.safetensors.*--overwrite", capsys.readouterr().err)
    assert f.exists() and (tmp_path / "a.ckpt" / "state.json").exists()  # nothing deleted


def test_look_steps_full_objects_none_hand_case():
    from common import data
    from common import answers
    from common import shapes as world
    rng = __import__("random").Random(3)
    scene, _, q, a = world.sample_example(rng)
    full = pretrain.look_target("full", scene, a, q)
    assert full == world.target_text(scene, a, q)
    assert pretrain.look_target("none", scene, a, q) == f"Answer: {a}"
    short = pretrain.look_target("objects", scene, a, q)
    # the short look keeps exactly the occupied cells of the full one, in raster order, with their marks
    assert short == world.short_look(full.rsplit(" Answer:", 1)[0]) + f" Answer: {a}"
    assert short.count(" ") < full.count(" ") and "empty" not in short
    with pytest.raises(ValueError, match="unknown look 'short'"):
        pretrain.look_target("short", scene, a, q)
    with pytest.raises(ValueError, match="unknown look True"):   # no bool spelling of a look step
        pretrain.look_target(True, scene, a, q)


def test_short_look_hand_case_and_errors():
    from common import data
    from common import answers
    from common import shapes as world
    full = "tl red circle + tc empty - tr empty - ml empty - mc empty - mr empty - bl empty - bc empty - br blue square -."
    assert world.short_look(full) == "tl red circle + br blue square -."
    two = "tl blue square 1tl tc empty - tr empty - ml empty - mc empty - mr red circle - bl empty - bc blue circle 2bc br empty -."
    assert world.short_look(two) == "tl blue square 1tl mr red circle - bc blue circle 2bc."
    with pytest.raises(ValueError, match="not a nine-cell look step"):
        world.short_look("tl red circle + br blue square -.")
    with pytest.raises(ValueError, match="extra words"):
        world.short_look(full[:-1] + " x.")


def test_short_look_matches_short_target_text_on_random_scenes():
    import random

    from common import data
    from common import answers
    from common import shapes as world
    rng = random.Random(0)
    for _ in range(200):
        scene, _, q, a = world.sample_example(rng)
        look = world.target_text(scene, a, q).rsplit(" Answer:", 1)[0]
        assert world.short_look(look) + f" Answer: {a}" == world.short_target_text(scene, a, q)


def test_objects_look_base_recipe_shapes():
    """The RoleMerge base of the paper's structure: 32 experts of width 32, top-4, 144 image
    tokens (84 px, patch 7, merge 1), short look targets; labels cover the turn only."""
    from common import backbone as bb
    model, proc = bb.build_tiny("qwen3_vl_moe", hidden=32, layers=1, experts=32, top_k=4, patch_size=7,
                                merge_size=1, expert_width=8)
    tc = model.config.text_config
    assert (tc.num_experts, tc.num_experts_per_tok, tc.moe_intermediate_size) == (32, 4, 8)
    assert tuple(model.model.language_model.layers[0].mlp.experts.down_proj.shape) == (32, 32, 8)
    batch, answer_mask = pretrain.make_batch(proc, 0, 3, 0, look="objects")
    assert ((batch["input_ids"] == model.config.image_token_id).sum(1) == 144).all()
    tok = proc._tok
    import random

    from common import data
    from common import answers
    from common import shapes as world
    rng = random.Random(0 * 1_000_003 + 0)
    ex = [world.sample_example(rng) for _ in range(3)]
    for row, (s, _, q, a) in enumerate(ex):
        lab = batch["labels"][row][batch["labels"][row] != -100].tolist()
        assert lab[:len(tok(world.short_target_text(s, a, q)))] == tok(world.short_target_text(s, a, q))
    assert bb.tiny_config("qwen3_vl_moe", bb.build_tokenizer(), hidden=32).text_config.moe_intermediate_size == 32
