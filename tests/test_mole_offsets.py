"""MoLE (Mixture of Latent Experts, the paper "MoLE: Mixture of Latent Experts for Complementary Visual Reasoning"): per-question image
offsets in a batch that mixes image sizes, and the load-balance loss over visual tokens only.

test_mixed_image_sizes_layout_matches_each_question_alone catches `mole.qwen.QwenVLAdapter.prompts`
without `start += k` (every question would take the first images' token counts: with a tall, a
small and a wide image the second question gets a 15-token block for its 4-token image, the
batch's total still matching, so nothing downstream fails).
test_balance_loss_counts_visual_tokens_only catches `load_balance_loss(probs, idx, None)` in
`MoLE.route` (the loss would average over text, latent and pad tokens too)."""
import math
import types

import pytest
import torch
from PIL import Image

from common.backbone import build_tiny
from helpers import tol
from mole.model import VIS, ZVIS, MoLE, MoLEConfig


@pytest.fixture(scope="module")
def mole():
    model, proc = build_tiny("qwen3_vl", seed=0, layers=2)
    return MoLE(model.eval(), proc, MoLEConfig())


def image(mole, h, w, seed):
    """A noise image of (h, w) merged-patch cells (each patch * merge pixels), unresized by the
    tiny processor when h * w * (patch * merge)^2 fits its pixel limits."""
    f = mole.proc.image_processor.patch_size * mole.proc.merge
    g = torch.Generator().manual_seed(seed)
    px = (torch.rand(h * f, w * f, 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(px)


def blocks(ids, mole):
    """Image tokens of each vision block of one row, in order."""
    tok = mole.proc.tokenizer.convert_tokens_to_ids
    vs, ve = tok("<|vision_start|>"), tok("<|vision_end|>")
    out, n = [], None
    for t in ids:
        if t == vs:
            n = 0
        elif t == ve:
            out.append(n)
            n = None
        elif n is not None and t == mole.proc.image_token_id:
            n += 1
    return out


@torch.no_grad()
def test_mixed_image_sizes_layout_matches_each_question_alone(mole):
    # question 0: one tall image; question 1: a small image, then a wide one
    tall, small, wide = image(mole, 5, 3, 0), image(mole, 2, 2, 1), image(mole, 3, 5, 2)
    imgs = [[tall], [small, wide]]
    qs = ["<image>\nWhat is in the image?", "<image>\n<image>\nIs there a circle in both images?"]
    batch = mole.encode(imgs, qs)   # left padded (generation)
    m = mole.proc.merge ** 2
    n_tok = (batch["image_grid_thw"].prod(-1) // m).tolist()
    assert batch["image_grid_thw"][:, 1:].tolist() == [[10, 6], [4, 4], [6, 10]] and n_tok == [15, 4, 15]
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    assert blocks(ids[0].tolist(), mole) == [15] and blocks(ids[1].tolist(), mole) == [4, 15]
    pos = mole.positions(batch)
    types_ = mole.token_types(ids, batch["attention_mask"])
    zpos = mole.zvis_positions(ids)
    for i in range(2):   # the per-question reference: the same question encoded alone
        one = mole.encode([imgs[i]], [qs[i]])
        assert ids[i][mask[i]].tolist() == one["input_ids"][0].tolist()
        assert types_[i][mask[i]].tolist() == mole.token_types(one["input_ids"], one["attention_mask"])[0].tolist()
        pad = int((~mask[i]).sum())
        assert (zpos[i] - pad).tolist() == mole.zvis_positions(one["input_ids"])[0].tolist()
        # M-RoPE positions of the real tokens: the image grids of this question, in order
        assert torch.equal(pos[:, i][:, mask[i]], mole.positions(one)[:, 0])
        assert int((types_[i] == VIS).sum()) == sum(n_tok[:1] if i == 0 else n_tok[1:])
        assert int((types_[i] == ZVIS).sum()) == mole.cfg.n_vis


def test_balance_loss_counts_visual_tokens_only():
    """route() on hand-set logits: E = 2 visual experts, top-1; tokens (vis, vis, text).
    Visual tokens: probs [3/4, 1/4] -> expert 0, [1/4, 3/4] -> expert 1: f = P = [1/2, 1/2],
    E sum f P = 1. Over all three (text probs [9/10, 1/10] -> expert 0): f = [2/3, 1/3],
    P = [19/30, 11/30], 2 (38/90 + 11/90) = 98/90."""
    model, proc = build_tiny("qwen3_vl", seed=0, layers=2)
    mole = MoLE(model.eval(), proc, MoLEConfig(n_vis=2, n_sum=0, top_k=1))
    d = mole.routers[0].weight.shape[1]
    with torch.no_grad():
        mole.routers[0].weight.zero_()
        mole.routers[0].weight[0, 0] = mole.routers[0].weight[1, 1] = 1.0
    h = torch.zeros(1, 3, d)
    h[0, 0, 0], h[0, 1, 1], h[0, 2, 0] = math.log(3), math.log(3), math.log(9)
    st = types.SimpleNamespace(is_vis=torch.tensor([[True, True, False]]), route={}, balance=[], z=[], reduce=None)
    mole.route(0, h, st)
    exact = tol(torch.float32, 8, 1.0)   # softmax of 2 logits, means over 2 tokens, a sum over 2 experts
    assert st.balance[0].item() == pytest.approx(1.0, rel=0, abs=exact)
    assert st.balance[0].item() != pytest.approx(98 / 90, rel=0, abs=exact)   # the value without the mask
    sel, prior = st.route[0]
    assert sel[0].tolist() == [[True, False], [False, True], [False, False]]
