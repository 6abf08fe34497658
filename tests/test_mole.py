"""MoLE (mole/model.py, mole/infer.py) on tiny randomly initialised Qwen3-VL / Qwen2.5-VL."""
import math
import random

import pytest
import torch

from common import data
from common import shapes
from common.backbone import build_tiny
from mole.infer import generate
from mole.model import PAD, TEXT, VIS, ZSUM, ZVIS, MoLE, MoLEConfig, MoLEPass, diversity_loss, topology_mask

from helpers import attention_tol, decoder_depth, logits_tol, tol


def examples(n, seed=0):
    rng = random.Random(seed)
    ex = [shapes.sample_example(rng) for _ in range(n)]
    return ([shapes.render(s) for s, _, _, _ in ex], [q for _, _, q, _ in ex],
            [shapes.target_text(s, a, q)[-12:] for s, _, q, a in ex])  # short answers keep tests fast


def make(arch="qwen3_vl", layers=2, seed=0, **cfg):
    model, proc = build_tiny(arch, seed=seed, layers=layers)
    mole = MoLE(model.eval(), proc, MoLEConfig(**cfg))
    if mole.esva is not None:  # gamma starts at 0; make ESVA matter in the tests
        g = torch.Generator().manual_seed(1)
        for e in mole.esva:
            e.gamma.data = torch.randn(e.gamma.shape, generator=g)
    return mole


def answer_rows(mole, batch):
    """Rows after the latents (assistant header + answer)."""
    t = mole.token_types(batch["input_ids"], batch["attention_mask"])
    last_latent = ((t == ZVIS) | (t == ZSUM)).long().cumsum(1)
    return (last_latent == last_latent[:, -1:]) & (t == TEXT) & ~((t == ZVIS) | (t == ZSUM))


@torch.no_grad()
def test_stage1_bottleneck_blocks_visual_tokens_stage2_does_not():
    # one decoder layer: answer rows can then depend on the image only through direct attention
    # to V (the latents' keys/values at layer 0 come from their embeddings alone)
    mole = make(layers=1)
    imgs, qs, ans = examples(2)
    b = mole.encode(imgs, qs, ans)
    b2 = dict(b, pixel_values=b["pixel_values"] + torch.randn_like(b["pixel_values"]))
    rows = answer_rows(mole, b)
    for stage, same in ((1, True), (2, False)):
        l1, l2 = mole(b, stage)["logits"], mole(b2, stage)["logits"]
        assert torch.equal(l1[rows], l2[rows]) == same  # masked keys add exact zeros: bit-identical
    # Z_vis rows do read the image in stage 1
    zv = mole.token_types(b["input_ids"], b["attention_mask"]) == ZVIS
    l1, l2 = mole(b, 1)["logits"][zv], mole(b2, 1)["logits"][zv]
    assert (l1 - l2).abs().max() > logits_tol(mole.model, b["input_ids"].shape[1], l1)  # more than rounding


def test_topology_mask_blocks():
    cfg = MoLEConfig(n_vis=2, n_sum=2)
    types = torch.tensor([[TEXT, VIS, VIS, TEXT, ZVIS, ZVIS, ZSUM, ZSUM, TEXT, TEXT, PAD]])
    m1, m2 = topology_mask(types, 1, cfg)[0, 0], topology_mask(types, 2, cfg)[0, 0]
    vis = types[0] == VIS
    for r in (3, 6, 7, 8, 9):  # question, Z_sum, answer rows
        assert not m1[r, vis].any() and m2[r, vis].all()
    assert not m1[4:6, 1:3].any() and not m2[4:6, 1:3].any()  # Z_vis -> V only through routing
    assert not m1[5, 4] and m1[5, 5] and m1[5, 3]  # no Z_vis <-> Z_vis; self and prompt yes
    assert m1[6, 4] and m1[6, 5] and m1[7, 6] and not m1[6, 7]  # Z_sum: all Z_vis, causal Z_sum
    assert not m1[:10, 10].any() and m1[10, 10]  # padding column: only its own row (no NaN)


def _random_pass(mole, B=2, L=10, seed=0):
    """A hand-built MoLEPass: text, 4 visual tokens, E Z_vis, text; fixed random routing."""
    g = torch.Generator().manual_seed(seed)
    E = mole.cfg.n_vis
    types = torch.tensor([[TEXT] + [VIS] * 4 + [ZVIS] * E + [TEXT] * (L - 5 - E)] * B)
    st = MoLEPass(mole, types, torch.arange(5, 5 + E).expand(B, E))
    logits = torch.randn(B, L, E, generator=g)
    idx = logits.topk(mole.cfg.top_k, -1).indices
    sel = torch.zeros(B, L, E, dtype=torch.bool).scatter_(-1, idx, True) & st.is_vis[..., None]
    st.route[0] = (sel, torch.randn(B, L, E, generator=g) * sel)
    return st, types, g


@torch.no_grad()
def test_expert_output_ignores_unrouted_visual_tokens():
    mole = make()
    st, types, g = _random_pass(mole)
    B, L, H, Hkv, D = 2, types.shape[1], 4, 2, 32
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, Hkv, Hkv))
    mask = topology_mask(types, 1, mole.cfg)
    out = mole.latent_attention(0, q, k, v, mask, D ** -0.5, st)  # [B,H,E,D]
    sel = st.route[0][0]
    checked = 0
    for b in range(B):
        for j in range(1, 5):  # each visual token
            k2, v2 = k.clone(), v.clone()
            k2[b, :, j] += 3.0
            v2[b, :, j] += 3.0
            out2 = mole.latent_attention(0, q, k2, v2, mask, D ** -0.5, st)
            for e in range(mole.cfg.n_vis):
                same = torch.equal(out[b, :, e], out2[b, :, e])  # masked keys add exact zeros
                assert same == (not bool(sel[b, j, e]))
                checked += 1
    assert checked == B * 4 * mole.cfg.n_vis


@torch.no_grad()
def test_gamma0_alpha0_reduce_to_shared_values():
    mole = make(alpha=0.0)
    for e in mole.esva:
        e.gamma.data.zero_()
    st, types, g = _random_pass(mole)
    st.route[0] = (st.route[0][0], torch.zeros_like(st.route[0][1]))  # alpha = 0: zero prior
    B, L, H, Hkv, D = 2, types.shape[1], 4, 2, 32
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, Hkv, Hkv))
    mask = topology_mask(types, 2, mole.cfg)
    out = mole.latent_attention(0, q, k, v, mask, D ** -0.5, st)
    # reference: plain softmax attention with the routed edges and the shared values
    allowed = mask[:, 0, 5:5 + mole.cfg.n_vis] | st.route[0][0].transpose(1, 2)  # [B,E,L]
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q[:, :, 5:5 + mole.cfg.n_vis] @ kr.transpose(-1, -2)) * D ** -0.5
    ref = s.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ vr
    torch.testing.assert_close(out, ref, rtol=0, atol=attention_tol(q, k, v, D ** -0.5))
    # and in the whole model: ESVA at gamma=0 with alpha=0 == no ESVA with alpha=0
    imgs, qs, ans = examples(2)
    a = make(alpha=0.0)
    for e in a.esva:
        e.gamma.data.zero_()
    bmod = make(alpha=0.0, esva=False)
    bmod.latent.data, bmod.routers = a.latent.data.clone(), a.routers
    batch = a.encode(imgs, qs, ans)
    la = a(batch, 1)["logits"]
    torch.testing.assert_close(la, bmod(batch, 1)["logits"], rtol=0,
                               atol=logits_tol(a.model, batch["input_ids"].shape[1], la))


@torch.no_grad()
@pytest.mark.parametrize("mixing", ["topological", "causal"])
def test_no_information_flow_between_visual_experts(mixing):
    mole = make(layers=3, latent_mixing=mixing)
    imgs, qs, ans = examples(2)
    b = mole.encode(imgs, qs, ans)
    zv = mole.token_types(b["input_ids"], b["attention_mask"]) == ZVIS
    h1 = mole(b, 2, hidden=True)["hidden"]
    mole.latent.data[0] += 5.0  # expert 0 (first Z_vis) changes
    h2 = mole(b, 2, hidden=True)["hidden"]
    first = zv & (zv.long().cumsum(1) == 1)
    others = zv & ~first
    assert (h1[first] - h2[first]).abs().max() > logits_tol(mole.model, zv.shape[1], h1)  # more than rounding
    assert torch.equal(h1[others], h2[others]) == (mixing == "topological")  # masked: bit-identical


@torch.no_grad()
def test_padding_does_not_change_results():
    mole = make()
    imgs, qs, ans = examples(3, seed=3)
    qs[1] = qs[1] + " Please answer carefully."  # different lengths -> padding
    batch = mole.encode(imgs, qs, ans)
    out = mole(batch, 2)
    for i in range(3):
        single = mole.encode(imgs[i:i + 1], qs[i:i + 1], ans[i:i + 1])
        o = mole(single, 2)
        n = single["input_ids"].shape[1]
        torch.testing.assert_close(out["logits"][i, :n], o["logits"][0], rtol=0,
                                   atol=logits_tol(mole.model, batch["input_ids"].shape[1], o["logits"]))
    t_batch, _ = generate(mole, imgs, qs, stage=2, max_new_tokens=5)
    for i in range(3):
        t_one, _ = generate(mole, imgs[i:i + 1], qs[i:i + 1], stage=2, max_new_tokens=5)
        assert t_one[0] == t_batch[i]


@torch.no_grad()
@pytest.mark.parametrize("arch,stage", [("qwen3_vl", 1), ("qwen3_vl", 2), ("qwen2_5_vl", 2)])
def test_cached_generation_equals_uncached_forward(arch, stage):
    mole = make(arch)
    imgs, qs, _ = examples(3, seed=5)
    qs[0] = qs[0] + " (short)"
    texts, lens, steps, full = generate(mole, imgs, qs, stage=stage, max_new_tokens=6, stop_at_eos=False,
                                        return_logits=True)
    prompt = mole.encode(imgs, qs)
    L = prompt["input_ids"].shape[1]
    n = steps.shape[1]
    am = torch.cat([prompt["attention_mask"], torch.ones(3, n - 1, dtype=torch.long)], 1)
    fb = dict(prompt, input_ids=full[:, : L + n - 1], attention_mask=am,
              mm_token_type_ids=torch.cat([prompt["mm_token_type_ids"], torch.zeros(3, n - 1, dtype=torch.long)], 1))
    logits = mole(fb, stage)["logits"][:, L - 1:].float()
    torch.testing.assert_close(logits, steps, rtol=0, atol=logits_tol(mole.model, L + n, logits))


@torch.no_grad()
def test_interventions_change_answers_path():
    mole = make()
    imgs, qs, _ = examples(2, seed=7)
    base = generate(mole, imgs, qs, max_new_tokens=3, stop_at_eos=False, return_logits=True)[2]
    for kind in ("random", "shuffle", "mask"):
        other = generate(mole, imgs, qs, max_new_tokens=3, stop_at_eos=False, return_logits=True,
                         intervention=kind)[2]
        bound = logits_tol(mole.model, mole.encode(imgs, qs)["input_ids"].shape[1] + 3, base)
        assert (base[:, 0] - other[:, 0]).abs().max() > bound, kind  # more than rounding


def test_diversity_loss_hand_value_and_k1():
    # one visual token, E=3, selected experts 0 and 2: cos^2 between [1,0] and [1,1] = 0.5
    delta = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]]])  # [B=1,L=1,E=3,d=2]
    sel = torch.tensor([[[True, False, True]]])
    exact = tol(torch.float32, 8, 1.0)  # a handful of fp32 steps on values <= 4 (norms, a dot, a mean)
    torch.testing.assert_close(diversity_loss(delta, sel, torch.tensor([[True]])), torch.tensor(0.5), rtol=0,
                               atol=exact)
    sel3 = torch.tensor([[[True, True, True]]])  # pairs (0,1)=0, (0,2)=0.5, (1,2)=0.5
    torch.testing.assert_close(diversity_loss(delta, sel3, torch.tensor([[True]])), torch.tensor(1 / 3), rtol=0,
                               atol=exact)
    mole = make(top_k=1)
    imgs, qs, ans = examples(2)
    out = mole(mole.encode(imgs, qs, ans), 1)
    assert out["div"].item() == 0.0 and out["balance"].item() > 0


def test_losses_and_gradients():
    mole = make()
    for r in mole.routers:  # uniform routing: load balance (Mixtral convention) equals K
        r.weight.data.zero_()
    imgs, qs, ans = examples(2)
    batch = mole.encode(imgs, qs, ans)
    out = mole(batch, 1)
    # means over at most every token of the batch (depth = tokens + experts), then the product / square
    depth = batch["input_ids"].numel() + mole.cfg.n_vis + 2
    assert abs(out["balance"].item() - mole.cfg.top_k) <= tol(torch.float32, depth, mole.cfg.top_k)
    z = math.log(mole.cfg.n_vis) ** 2
    assert abs(out["z"].item() - z) <= tol(torch.float32, depth, z)
    mole = make()
    out = mole(mole.encode(imgs, qs, ans), 1)
    out["loss"].backward()
    assert mole.latent.grad.abs().sum() > 0 and mole.routers[0].weight.grad.abs().sum() > 0
    assert mole.esva[0].gamma.grad.abs().sum() > 0


@torch.no_grad()
def test_plain_calls_are_sdpa():
    # "mole" attention registered together with a mask builder: padding masks survive
    model, proc = build_tiny("qwen3_vl", layers=2)
    imgs, qs, _ = examples(2, seed=9)
    qs[0] += " with extra words"
    batch = proc.encode(imgs, qs)
    ref = model(**batch).logits
    MoLE(model, proc)
    assert model.config.get_text_config()._attn_implementation == "mole"
    torch.testing.assert_close(model(**batch).logits, ref, rtol=0,
                               atol=logits_tol(model, batch["input_ids"].shape[1], ref))


def test_diagnostics_hand_values_and_run(tmp_path):
    from mole.diagnostics import latent_stats, pairwise_kl, pairwise_sq_cos
    h = torch.tensor([[[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]]])  # pairs: 0.5, 0, 0.5
    exact = tol(torch.float32, 8, 1.0)  # a handful of fp32 steps on values <= 4
    torch.testing.assert_close(pairwise_sq_cos(h), torch.tensor([1 / 3]), rtol=0, atol=exact)
    p = torch.tensor([[[1.0, 1.0], [1.0, 1.0]]])
    assert pairwise_kl(p).abs().item() <= exact  # identical patterns
    q = torch.tensor([[[0.75, 0.25], [0.25, 0.75]]])
    kl = 0.75 * torch.log(torch.tensor(3.0)) + 0.25 * torch.log(torch.tensor(1 / 3))
    torch.testing.assert_close(pairwise_kl(q, eps=0.0), kl[None], rtol=0, atol=exact)
    recs = shapes.generate_split(str(tmp_path), "test", 3)
    for r in recs:
        r.update(image=str(tmp_path / r["image"]), question=r["conversations"][0]["value"].split("\n", 1)[1])
    sim, kl = latent_stats(make(), recs, stage=2)
    assert 0 <= sim <= 100 and kl > 0


def test_diagnostics_on_images_of_different_sizes(tmp_path):
    """A batch with an 84 px and a 56 px image crashed (`shape '[3, 9, -1]' is invalid`): the
    first record's visual-token count was taken for the whole batch. Now each record
    uses its own, and the batched numbers equal the one-record-at-a-time ones."""
    from PIL import Image
    from mole.diagnostics import latent_stats
    recs = shapes.generate_split(str(tmp_path), "test", 3)
    for r in recs:
        r.update(image=str(tmp_path / r["image"]), question=r["conversations"][0]["value"].split("\n", 1)[1])
    Image.open(recs[1]["image"]).resize((56, 56)).save(recs[1]["image"])
    mole = make()
    batched = latent_stats(mole, recs, stage=2, batch_size=3)
    single = latent_stats(mole, recs, stage=2, batch_size=1)
    assert batched[1] > 0
    # x100 means of per-record values from forwards of other batch shapes: the decoder's depth at x100 scale
    n = mole.encode([data.load_record_images(r) for r in recs], [r["question"] for r in recs])["input_ids"].shape[1]
    assert batched == pytest.approx(single, rel=0, abs=tol(torch.float32, decoder_depth(mole.model.config, n), 100))


@torch.no_grad()
def test_remove_gives_the_model_back_unchanged():
    """MoLE.remove takes its routing hooks off the decoder layers and sets the text attention back:
    the model then computes what it did before it was wrapped."""
    model, proc = build_tiny("qwen3_vl", seed=0, layers=2)
    model.eval()
    imgs, qs, _ = examples(2)
    batch = proc.encode(imgs, qs)
    before = model(**batch).logits
    layers = model.model.language_model.layers
    mole = MoLE(model, proc, MoLEConfig())
    assert all(len(layer._forward_pre_hooks) == 1 for layer in layers)
    assert model.config.get_text_config()._attn_implementation == "mole"
    assert mole.remove() is model
    assert all(len(layer._forward_pre_hooks) == 0 for layer in layers)
    assert model.config.get_text_config()._attn_implementation == "sdpa"
    assert torch.equal(model(**batch).logits, before)
