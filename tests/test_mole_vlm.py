"""MoLE on a VLM that is not Qwen, with no glue: a tiny random Gemma3ForConditionalGeneration
(SigLIP tower, Gemma3 decoder with its sqrt(d)-scaled embedding, plain 1-D RoPE) and its
transformers Gemma3Processor, wrapped as `MoLE(model, processor)` (-> `ChatVLMAdapter`).
Plus the latent init at the embedding module's output scale."""
import math
import random

import pytest
import torch
import torch.nn as nn

from common import shapes
from common.backbone import build_tokenizer
from mole.infer import generate
from mole.adapters import ChatVLMAdapter, cumulative_positions
from mole.model import (TEXT, ZSUM, ZVIS, MoLE, MoLEConfig,
                        embedding_output_scale, init_latents)

from helpers import logits_tol, tol

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def tiny_gemma3(layers=1, seed=0, sliding_window=128):
    """Tiny random Gemma3 VLM (28 px images -> 4 image tokens; even layers slide over
    `sliding_window` tokens) + a real Gemma3Processor."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              Gemma3Processor, PreTrainedTokenizerFast)
    base = build_tokenizer()
    base.add_special_tokens({"additional_special_tokens": [
        "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>", "<bos>"]})
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<end_of_turn>",
                                  pad_token="<|endoftext|>", bos_token="<bos>", extra_special_tokens={
                                      "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                      "image_token": "<image_soft_token>"})
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tokenizer=tok,
                           chat_template=GEMMA_TEMPLATE, image_seq_length=4)
    types = (["sliding_attention", "full_attention"] * layers)[:layers]
    cfg = Gemma3Config(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         sliding_window=sliding_window, pad_token_id=tok.pad_token_id, layer_types=types),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=7),
        mm_tokens_per_image=4, image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # Gemma3 initialises its vision projection to zero: the image would carry nothing
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.2)
    return model, proc


def make(layers=1, **cfg):
    model, proc = tiny_gemma3(layers)
    mole = MoLE(model, proc, MoLEConfig(**cfg))  # no glue: the processor picks ChatVLMAdapter
    g = torch.Generator().manual_seed(1)
    for e in mole.esva or []:  # gamma starts at 0; make ESVA matter
        e.gamma.data = torch.randn(e.gamma.shape, generator=g)
    return mole


def examples(n, seed=0):
    rng = random.Random(seed)
    ex = [shapes.sample_example(rng) for _ in range(n)]
    return ([shapes.render(s) for s, _, _, _ in ex], [q for _, _, q, _ in ex],
            [shapes.target_text(s, a, q)[-12:] for s, _, q, a in ex])


def answer_rows(mole, batch):
    t = mole.token_types(batch["input_ids"], batch["attention_mask"])
    last_latent = ((t == ZVIS) | (t == ZSUM)).long().cumsum(1)
    return (last_latent == last_latent[:, -1:]) & (t == TEXT)


def test_gemma3_adapter_layout():
    mole = make()
    ad = mole.adapter
    assert isinstance(ad, ChatVLMAdapter)
    tok = mole.proc.tokenizer
    assert ad.image_token_id == tok.image_token_id == mole.model.config.image_token_id
    assert ad.eos_token_id == tok.convert_tokens_to_ids("<end_of_turn>")
    assert tok.decode(mole.tail_ids) == "<end_of_turn>\n<start_of_turn>model\n"
    imgs, qs, ans = examples(2)
    qs[1] += " Answer carefully."  # different lengths -> padding
    b = mole.encode(imgs, qs, ans)
    assert set(b) == {"input_ids", "attention_mask", "pixel_values", "labels", "token_type_ids"}
    assert torch.equal(b["token_type_ids"], (b["input_ids"] == ad.image_token_id).long())  # Gemma3Processor's
    t = mole.token_types(b["input_ids"], b["attention_mask"])
    assert ((t == ZVIS).sum(1) == 4).all() and ((t == ZSUM).sum(1) == 4).all()
    assert ((b["input_ids"] == ad.image_token_id).sum(1) == 4).all()
    for i in range(2):  # latents sit right before the tail, the answer + <end_of_turn> after it
        r = b["input_ids"][i][b["attention_mask"][i].bool()].tolist()
        k = r.index(mole.vocab)
        assert r[k:k + 8] == mole.latent_ids and r[k + 8:k + 8 + len(mole.tail_ids)] == mole.tail_ids
        lab = b["labels"][i][b["labels"][i] != -100].tolist()
        assert lab == ad.text_ids(ans[i]) + [ad.eos_token_id] and r[-len(lab):] == lab
    assert torch.equal(mole.positions(b), cumulative_positions(b["attention_mask"]))


@torch.no_grad()
def test_gemma3_stage1_bottleneck():
    # one decoder layer: answer rows can depend on the image only through direct attention to V
    # (the latents' keys/values at layer 0 come from their embeddings alone), so stage 1 must
    # make them independent of the pixels, stage 2 must not
    mole = make(layers=1)
    imgs, qs, ans = examples(2)
    b = mole.encode(imgs, qs, ans)
    b2 = dict(b, pixel_values=b["pixel_values"] + torch.randn_like(b["pixel_values"]))
    rows = answer_rows(mole, b)
    for stage, same in ((1, True), (2, False)):
        l1, l2 = mole(b, stage)["logits"], mole(b2, stage)["logits"]
        assert torch.equal(l1[rows], l2[rows]) == same  # masked keys add exact zeros: bit-identical
    zv = mole.token_types(b["input_ids"], b["attention_mask"]) == ZVIS
    l1, l2 = mole(b, 1)["logits"][zv], mole(b2, 1)["logits"][zv]
    assert (l1 - l2).abs().max() > logits_tol(mole.model, b["input_ids"].shape[1], l1)  # more than rounding


@torch.no_grad()
def test_gemma3_stage1_answers_read_the_image_only_through_zvis():
    # two layers: in stage 1 the answers do read the image (through the latents), and only
    # through Z_vis: with every routed Z_vis -> V edge cut, the answers ignore the pixels
    mole = make(layers=2)
    imgs, qs, ans = examples(2, seed=1)
    b = mole.encode(imgs, qs, ans)
    b2 = dict(b, pixel_values=b["pixel_values"] + torch.randn_like(b["pixel_values"]))
    rows = answer_rows(mole, b)
    l1, l2 = mole(b, 1)["logits"][rows], mole(b2, 1)["logits"][rows]
    assert (l1 - l2).abs().max() > logits_tol(mole.model, b["input_ids"].shape[1], l1)  # more than rounding

    def no_edges(layer_idx, h, st):  # routing that selects no visual token for any expert
        B, L = h.shape[:2]
        st.route[layer_idx] = (torch.zeros(B, L, mole.cfg.n_vis, dtype=torch.bool), torch.zeros(B, L, mole.cfg.n_vis))

    mole.route = no_edges
    assert torch.equal(mole(b, 1)["logits"][rows], mole(b2, 1)["logits"][rows])  # masked: bit-identical


@torch.no_grad()
def test_gemma3_cached_generation_equals_uncached_forward():
    mole = make(layers=2)
    imgs, qs, _ = examples(2, seed=5)
    qs[0] += " (short)"
    _, _, steps, full = generate(mole, imgs, qs, stage=2, max_new_tokens=4, stop_at_eos=False, return_logits=True)
    prompt = mole.encode(imgs, qs)
    L, n = prompt["input_ids"].shape[1], steps.shape[1]
    am = torch.cat([prompt["attention_mask"], torch.ones(2, n - 1, dtype=torch.long)], 1)
    logits = mole(dict(prompt, input_ids=full[:, :L + n - 1], attention_mask=am), 2)["logits"][:, L - 1:].float()
    torch.testing.assert_close(logits, steps, rtol=0, atol=logits_tol(mole.model, L + n, logits))


def test_gemma3_one_training_step():
    mole = make(layers=2)
    mole.model.requires_grad_(False)
    imgs, qs, ans = examples(2, seed=2)
    b = mole.encode(imgs, qs, ans)
    params = [p for p in mole.parameters() if p.requires_grad]
    assert params and all(not p.requires_grad for p in mole.model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    out = mole(b, 1)
    assert torch.isfinite(out["loss"]) and out["balance"] > 0 and out["ce"] > 0
    out["loss"].backward()
    assert mole.latent.grad is not None and mole.latent.grad.abs().sum() > 0
    assert all(r.weight.grad is not None for r in mole.routers)
    before = mole.latent.detach().clone()
    opt.step()
    assert not torch.equal(before, mole.latent.detach())
    with torch.no_grad():
        assert float(mole(b, 1)["loss"]) != float(out["loss"])


@torch.no_grad()
def test_gemma3_latent_init_matches_embedding_output_scale():
    mole = make()
    table = mole.model.get_input_embeddings()
    d = table.weight.shape[1]
    # Gemma: sqrt(d); a ratio of two means of fp32 row norms (length d each): 2 d + 4 steps
    assert embedding_output_scale(table) == pytest.approx(math.sqrt(d), rel=tol(torch.float32, 2 * d + 4), abs=0)
    ids = torch.arange(table.weight.shape[0])
    out_norm = float(table(ids).norm(dim=-1).mean())
    lat_norm = float(mole.latent.norm(dim=-1).mean())
    assert lat_norm == pytest.approx(out_norm, rel=0.15), (lat_norm, out_norm)  # sampled rows: statistical
    assert float(table.weight.norm(dim=-1).mean()) < out_norm / 4  # the raw rows would be far too small
    # the latent rows enter the decoder as they are: same scale as the real tokens' embeddings
    b = mole.encode(*examples(1)[:2])
    x = mole.embed(b["input_ids"])
    lat = b["input_ids"] >= mole.vocab
    # a statistical bound (random rows), not a rounding one
    assert float(x[lat].norm(dim=-1).mean()) == pytest.approx(float(x[~lat].norm(dim=-1).mean()), rel=0.3)


class ScaledEmbedding(nn.Embedding):
    """An embedding module that multiplies its rows by sqrt(d) (Gemma's convention)."""

    def forward(self, ids):
        return super().forward(ids) * math.sqrt(self.embedding_dim)


def test_latent_init_on_scaled_embedding_matches_output_norm():
    torch.manual_seed(0)
    d = 256
    scaled, plain = ScaledEmbedding(500, d), nn.Embedding(500, d)
    plain.weight.data.copy_(scaled.weight.data)
    ids = torch.arange(500)
    lat = init_latents(scaled, 16, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out_norm = float(scaled(ids).norm(dim=-1).mean())
    assert float(lat.norm(dim=-1).mean()) == pytest.approx(out_norm, rel=0.1)  # 16 sampled rows: statistical
    # an unscaled embedding: factor exactly 1, init bit for bit the unscaled formula
    assert embedding_output_scale(plain) == 1.0
    w = plain.weight.detach().float()
    ref = w.mean(0) + w.std() * torch.randn(16, d, generator=torch.Generator().manual_seed(0))
    assert torch.equal(init_latents(plain, 16, torch.Generator().manual_seed(0)), ref)
    # the factor is a ratio of two means of fp32 row norms (length d): 2 d + 4 steps, relative
    torch.testing.assert_close(lat, ref * math.sqrt(d), rtol=tol(torch.float32, 2 * d + 4), atol=0)


@torch.no_grad()
def test_llava_next_through_the_repo_processor_bottleneck_and_cache():
    # the repo's VLProcessor protocol with a family that has no M-RoPE (LLaVA-NeXT: CLIP tiles,
    # Llama decoder): QwenVLAdapter falls back to 1-D positions, no mm_token_type_ids
    from common.backbone import build_tiny
    from mole.adapters import QwenVLAdapter
    model, proc = build_tiny("llava_next", layers=1)
    mole = MoLE(model.eval(), proc, MoLEConfig())
    assert isinstance(mole.adapter, QwenVLAdapter)
    imgs, qs, ans = examples(2, seed=4)
    b = mole.encode(imgs, qs, ans)
    assert "mm_token_type_ids" not in b and "image_sizes" in b
    assert torch.equal(mole.positions(b), cumulative_positions(b["attention_mask"]))
    b2 = dict(b, pixel_values=b["pixel_values"] + torch.randn_like(b["pixel_values"]))
    rows = answer_rows(mole, b)
    for stage, same in ((1, True), (2, False)):
        assert torch.equal(mole(b, stage)["logits"][rows], mole(b2, stage)["logits"][rows]) == same  # masked
    _, _, steps, full = generate(mole, imgs, qs, stage=1, max_new_tokens=3, stop_at_eos=False, return_logits=True)
    prompt = mole.encode(imgs, qs)
    L, n = prompt["input_ids"].shape[1], steps.shape[1]
    am = torch.cat([prompt["attention_mask"], torch.ones(2, n - 1, dtype=torch.long)], 1)
    logits = mole(dict(prompt, input_ids=full[:, :L + n - 1], attention_mask=am), 1)["logits"][:, L - 1:].float()
    torch.testing.assert_close(logits, steps, rtol=0, atol=logits_tol(mole.model, L + n, logits))
