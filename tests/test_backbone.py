import os
import random

import numpy as np
import pytest
import torch

from common import backbone as bb
from common import data
from common import shapes
from helpers import tol


@pytest.fixture(scope="module")
def tiny():
    return bb.build_tiny("qwen2_5_vl", hidden=64, layers=2)


def _examples(n, seed=0):
    rng = random.Random(seed)
    ex = [shapes.sample_example(rng) for _ in range(n)]
    return [shapes.render(s) for s, _, _, _ in ex], [q for _, _, q, _ in ex], [shapes.target_text(s, a, q) for s, _, q, a in ex]


def test_tokenizer_is_byte_level_and_round_trips():
    tok = bb.build_tokenizer()
    for s in ["tl red circle, tc empty. Answer: yes", "Unseen wörds 123 ✓"]:
        assert tok.decode(tok(s)["input_ids"]) == s
    assert len(tok("tl red circle")["input_ids"]) <= 4  # BPE merged the world's words


def test_patchify_equals_image_processor(tiny):
    _, proc = tiny
    imgs, _, _ = _examples(3)
    pv, grid = proc.images(imgs)
    pv2, grid2 = bb.patchify(torch.from_numpy(np.stack([np.asarray(i) for i in imgs])))
    assert torch.equal(grid, grid2) and grid.tolist() == [[1, 6, 6]] * 3
    # rescale, normalise (x / 255 - mean) / std: 4 fp32 steps of the largest |value|
    torch.testing.assert_close(pv, pv2, rtol=0, atol=tol(torch.float32, 4, pv.abs().max()))


def test_encode_masks_labels_to_answer_and_pads(tiny):
    _, proc = tiny
    imgs, qs, ans = _examples(4)
    b = proc.encode(imgs, qs, ans)
    assert (b["mm_token_type_ids"].sum(1) == 9).all()  # 3x3 merged visual tokens each
    assert b["attention_mask"][:, 0].all()  # right padding for training
    for i in range(4):
        lab = b["labels"][i][b["labels"][i] != -100]
        assert proc.decode(lab.tolist()) == ans[i]  # answer (+ <|im_end|>, a special token) only
        assert lab[-1].item() == proc.eos_token_id
    g = proc.encode(imgs, qs)
    assert "labels" not in g and g["attention_mask"][:, -1].all()  # left padding for generation


def test_save_load_round_trip_same_logits(tiny, tmp_path):
    model, proc = tiny
    path = str(tmp_path / "ckpt")
    bb.save_backbone(model, proc, path)
    assert os.path.exists(os.path.join(path, "config.json"))
    model2, proc2 = bb.load_backbone(path)
    imgs, qs, ans = _examples(2)
    b1, b2 = proc.encode(imgs, qs, ans), proc2.encode(imgs, qs, ans)
    assert torch.equal(b1["input_ids"], b2["input_ids"])
    with torch.no_grad():
        assert torch.equal(model.eval()(**b1).logits, model2(**b2).logits)


def test_left_padded_batch_generation_equals_single(tiny):
    model, proc = tiny
    model.eval()
    imgs, qs, _ = _examples(3, seed=5)
    qs[1] = qs[1] + " Please answer carefully and look at every cell."  # force unequal lengths
    batch, _ = bb.generate(model, proc, imgs, qs, max_new_tokens=6)
    singles = [bb.generate(model, proc, [imgs[i]], [qs[i]], max_new_tokens=6)[0][0] for i in range(3)]
    assert batch == singles


def test_load_errors(tmp_path):
    with pytest.raises(bb.BackboneError, match="no config.json"):
        bb.load_backbone(str(tmp_path))
    with pytest.raises(bb.BackboneError, match="no such checkpoint"):
        bb.load_backbone(str(tmp_path / "nope"))
    with pytest.raises(bb.BackboneError, match="did you mean tiny-dense"):
        bb.load_backbone("tiny-dnse")


def test_relative_path_typo_with_one_slash_is_not_a_hub_id(tmp_path, monkeypatch):
    """`ckpt/qwen25v1` (a typo of ckpt/qwen25vl) was taken for a hub id: half a minute of retries,
    then "the model hub cannot be reached". Under an existing local folder it is a local path."""
    (tmp_path / "ckpt" / "qwen25vl").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained",
                        lambda *a, **k: pytest.fail("the hub was asked for a local path typo"))
    with pytest.raises(bb.BackboneError, match=r"ckpt/qwen25v1: no such checkpoint directory \(did you mean "
                                               r"ckpt/qwen25vl\?\)"):
        bb.load_backbone("ckpt/qwen25v1")


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_committed_tiny_models_load_and_answer(name):
    if not os.path.exists(os.path.join(bb.TINY[name], "config.json")):
        pytest.fail(f"committed checkpoint {bb.TINY[name]} missing: run python -m eval.tools.pretrain (README)")
    model, proc = bb.load_backbone(name)
    rng = random.Random(7)
    ex = [shapes.sample_example(rng) for _ in range(8)]
    texts, _ = bb.generate(model, proc, [shapes.render(s) for s, _, _, _ in ex], [q for _, _, q, _ in ex])
    # the pretrained bases write the marked scene, then the answer: most come out exactly right
    assert sum(t == shapes.target_text(s, a, q) for t, (s, _, q, a) in zip(texts, ex)) >= 6
