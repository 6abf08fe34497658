"""DeepSeek-VL2 in RoleMerge (rolemerge/deepseek_vl2.py): the official checkpoint layout, the
forward pinned against the official maths written out here, and calibrate -> merge (in memory
and streaming) -> reload -> generate on tiny synthetic checkpoints with the real key names and
config fields (Tiny-like MHA and Small-like MLA)."""
import json
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file

from common import backbone as bb
from helpers import error_of, logits_tol, tol
from rolemerge import calibrate as cal
from rolemerge import deepseek_vl2 as vl2
from rolemerge import merge as mg
from rolemerge import blocks as blk
from rolemerge import stats as rstats
from rolemerge import planning
from rolemerge.planning import MergeConfig

SPECIAL = dict(bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜▁pad▁｜>")


def raw_config(mla, vocab, topk_method="greedy", n_group=1, topk_group=1, **lm_extra):
    """A config.json of the released kind (field names and nesting as on the hub), tiny sizes."""
    lm = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2,
              num_experts_per_tok=2, first_k_dense_replace=1, topk_method=topk_method, n_group=n_group,
              topk_group=topk_group, bos_token_id=0, eos_token_id=1, max_position_embeddings=512, use_mla=mla,
              architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", torch_dtype="float32", **lm_extra)
    if mla:   # Small: MLA, q_lora_rank null
        lm.update(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    else:     # Tiny: MHA (use_mla false), MLA ranks null / 0
        lm.update(kv_lora_rank=None, q_lora_rank=None, qk_rope_head_dim=0, qk_nope_head_dim=0, v_head_dim=0)
    return {"architectures": ["DeepseekVLV2ForCausalLM"], "model_type": "deepseek_vl_v2", "tile_tag": "2D",
            "global_view_pos": "head", "candidate_resolutions": [[42, 42], [42, 84], [84, 42]],
            "vision_config": {"model_name": "siglip_so400m_patch14_384", "model_type": "vision", "image_size": 42,
                              "patch_size": 14, "width": 24, "layers": 2, "heads": 4, "mlp_ratio": 3.7362},
            "projector_config": {"model_type": "mlp_projector", "projector_type": "downsample_mlp_gelu",
                                 "input_dim": 24, "n_embed": 32, "depth": 2, "mlp_ratio": 1, "downsample_ratio": 2},
            "language_config": lm, "torch_dtype": "float32", "transformers_version": "4.38.2"}


def vl2_tokenizer():
    """The tiny tokenizer with DeepSeek-VL2's special tokens (the `tok` fixture; imported by the
    multi-image tests)."""
    t = bb.build_tokenizer()
    t.add_tokens(list(SPECIAL.values()) + ["<image>", "<|User|>", "<|Assistant|>"], special_tokens=True)
    t.bos_token, t.eos_token, t.pad_token = SPECIAL["bos"], SPECIAL["eos"], SPECIAL["pad"]
    return t


@pytest.fixture(scope="module")
def tok():
    return vl2_tokenizer()


def make_checkpoint(path, tok, mla, seed=0, top_level_copy=False, **kw):
    """Synthetic checkpoint: random weights, official layout, the unused attention-pool head on
    disk too (as a full-state-dict save of the official model would have), several shards.
    top_level_copy: language fields repeated at the top level, as some DeepSeek VL configs do."""
    raw = raw_config(mla, len(tok), **kw)
    if top_level_copy:
        raw.update({k: raw["language_config"][k] for k in ("n_routed_experts", "num_experts_per_tok", "n_group")})
    raw["language_config"].update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = vl2.build_random(raw, seed)
    g = torch.Generator().manual_seed(seed)
    model.extra = {f"vision.attn_pool.{k}": torch.randn(*s, generator=g) for k, s in
                   (("latent", (1, 1, 24)), ("q.weight", (24, 24)), ("q.bias", (24,)), ("kv.weight", (48, 24)),
                    ("kv.bias", (48,)), ("proj.weight", (24, 24)), ("proj.bias", (24,)), ("norm.weight", (24,)),
                    ("norm.bias", (24,)), ("mlp.fc1.weight", (89, 24)), ("mlp.fc1.bias", (89,)),
                    ("mlp.fc2.weight", (24, 89)), ("mlp.fc2.bias", (24,)))}
    model.save_pretrained(str(path), max_shard_size=60_000)
    vl2.Processor(tok, raw["candidate_resolutions"], 14, 2).save_pretrained(str(path))
    return str(path)


def records(tmp_path, n=4):
    from common import data
    from common import shapes
    rng, out = random.Random(0), []
    for i in range(n):
        scene, _, q, _ = shapes.sample_example(rng)
        im = shapes.render(scene)
        if i % 2:                                     # a wide image: 2 x 1 local tiles
            im = im.resize((2 * im.width, im.height))
        p = str(tmp_path / f"im{i}.png")
        im.save(p)
        out.append({"id": str(i), "question": q, "image": p})
    return out


# ----------------------------------------------------------------------------- layout

def expected_keys(mla, n_experts=8):
    """Official parameter names of the synthetic config, written out by hand."""
    keys = {"image_newline": [32], "view_seperator": [32], "vision.pos_embed": [1, 9, 24],
            "vision.patch_embed.proj.weight": [24, 3, 14, 14], "vision.patch_embed.proj.bias": [24],
            "vision.norm.weight": [24], "vision.norm.bias": [24], "projector.layers.0.weight": [32, 96],
            "projector.layers.0.bias": [32], "projector.layers.2.weight": [32, 32], "projector.layers.2.bias": [32],
            "language.model.embed_tokens.weight": None, "language.model.norm.weight": [32],
            "language.lm_head.weight": None}
    for b in range(2):
        p = f"vision.blocks.{b}."
        keys.update({p + "norm1.weight": [24], p + "norm1.bias": [24], p + "attn.qkv.weight": [72, 24],
                     p + "attn.qkv.bias": [72], p + "attn.proj.weight": [24, 24], p + "attn.proj.bias": [24],
                     p + "norm2.weight": [24], p + "norm2.bias": [24], p + "mlp.fc1.weight": [89, 24],
                     p + "mlp.fc1.bias": [89], p + "mlp.fc2.weight": [24, 89], p + "mlp.fc2.bias": [24]})
    for i in range(3):
        p = f"language.model.layers.{i}."
        keys.update({p + "input_layernorm.weight": [32], p + "post_attention_layernorm.weight": [32]})
        if mla:
            keys.update({p + "self_attn.q_proj.weight": [64, 32], p + "self_attn.kv_a_proj_with_mqa.weight": [24, 32],
                         p + "self_attn.kv_a_layernorm.weight": [16], p + "self_attn.kv_b_proj.weight": [64, 16],
                         p + "self_attn.o_proj.weight": [32, 32]})
        else:
            keys.update({p + f"self_attn.{n}_proj.weight": [32, 32] for n in "qkvo"})
        if i == 0:                                     # first_k_dense_replace = 1
            keys.update({p + "mlp.gate_proj.weight": [64, 32], p + "mlp.up_proj.weight": [64, 32],
                         p + "mlp.down_proj.weight": [32, 64]})
            continue
        keys[p + "mlp.gate.weight"] = [n_experts, 32]
        keys.update({p + "mlp.shared_experts.gate_proj.weight": [32, 32], p + "mlp.shared_experts.up_proj.weight":
                     [32, 32], p + "mlp.shared_experts.down_proj.weight": [32, 32]})
        for e in range(n_experts):
            keys.update({p + f"mlp.experts.{e}.gate_proj.weight": [16, 32], p + f"mlp.experts.{e}.up_proj.weight":
                         [16, 32], p + f"mlp.experts.{e}.down_proj.weight": [32, 16]})
    return keys


def on_disk(path):
    from common.checkpoint import safetensors_files
    out = {}
    for f in safetensors_files(path):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("mla", [False, True])
def test_checkpoint_layout_round_trip(tok, tmp_path, mla):
    """Saved keys / shapes are exactly the official ones (+ the unused attention-pool head);
    load -> save writes the same tensors bit for bit (the loader adds and drops nothing)."""
    src = make_checkpoint(tmp_path / "src", tok, mla)
    t = on_disk(src)
    want = expected_keys(mla)
    own = {k: list(v.shape) for k, v in t.items() if not k.startswith("vision.attn_pool.")}
    assert own.keys() == want.keys()
    assert all(w is None or own[k] == w for k, w in want.items())
    assert sum(k.startswith("vision.attn_pool.") for k in t) == 13
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json"))      # several shards
    vl2.load(src).save_pretrained(str(tmp_path / "again"))
    t2 = on_disk(str(tmp_path / "again"))
    assert t.keys() == t2.keys() and all(torch.equal(t[k], t2[k]) for k in t)
    assert json.load(open(os.path.join(src, "config.json"))) == json.load(open(tmp_path / "again" / "config.json"))


def test_bad_checkpoints_are_named(tok, tmp_path, capsys):
    src = make_checkpoint(tmp_path / "src", tok, False)
    raw = json.load(open(os.path.join(src, "config.json")))
    raw["vision_config"] = {"model_name": "deeplip_b_l", "width": {"sam_vit_b": {}}}   # DeepSeek-OCR's layout
    with pytest.raises(vl2.VL2Error, match="only DeepSeek-VL2's SigLIP tower"):
        vl2.check_config(vl2.Config(raw))
    t = on_disk(src)
    del t["language.model.layers.2.mlp.experts.3.up_proj.weight"]
    os.makedirs(tmp_path / "broken")
    save_file(t, str(tmp_path / "broken" / "model.safetensors"))
    json.dump(json.load(open(os.path.join(src, "config.json"))), open(tmp_path / "broken" / "config.json", "w"))
    with pytest.raises(vl2.VL2Error, match="expert tensors are incomplete"):
        vl2.load(str(tmp_path / "broken"))
    recs = tmp_path / "r.jsonl"
    recs.write_text(json.dumps({"id": "0", "question": "q", "answer": "a"}) + "\n")
    assert "expert tensors are incomplete" in error_of(cal.main, ["--model", str(tmp_path / "broken"), "--data",
                                                                   str(recs), "--out", str(tmp_path / "s.safetensors")],
                                                       capsys)


# ----------------------------------------------------------------------------- forward pieces, hand-computed

def router(topk_method="greedy", scoring="softmax", norm=False, scale=1.0, n_group=1, topk_group=1, k=2, w=None):
    lm = vl2.LanguageConfig(dict(n_routed_experts=4, num_experts_per_tok=k, topk_method=topk_method,
                                 scoring_func=scoring, norm_topk_prob=norm, routed_scaling_factor=scale,
                                 n_group=n_group, topk_group=topk_group))
    r = vl2.Router(lm, 4)
    r.weight.data = torch.eye(4) if w is None else w
    return r


def test_router_matches_hand_computed():
    x = torch.tensor([[math.log(1.0), math.log(2.0), math.log(3.0), math.log(4.0)]])   # softmax = (1,2,3,4)/10
    exact = tol(torch.float32, 8, 2.0)   # fp32 logits, a softmax / sigmoid of 4, a renormalisation, the scale 2
    logits, w, idx = router()(x)
    order = w[0].argsort(descending=True)
    assert idx[0][order].tolist() == [3, 2]
    torch.testing.assert_close(w[0][order], torch.tensor([0.4, 0.3]), rtol=0, atol=exact)
    _, w, idx = router(norm=True, scale=2.0)(x)            # renormalised over the top-2, then scaled
    torch.testing.assert_close(w[0].sort(descending=True).values, torch.tensor([4 / 7, 3 / 7]) * 2, rtol=0, atol=exact)
    _, w, idx = router(norm=True, k=1)(x)                  # norm_topk_prob is ignored for k = 1 (official)
    assert idx.tolist() == [[3]]
    torch.testing.assert_close(w, torch.tensor([[0.4]]), rtol=0, atol=exact)
    # group-limited: groups {0,1} (max .2) and {2,3} (max .4); topk_group 1 keeps {2,3} only
    x2 = torch.tensor([[math.log(2.0), math.log(2.0), math.log(4.0), math.log(1.0)]])  # s = (.2,.2,.4,.1)/.9 ...
    _, w, idx = router("group_limited_greedy", n_group=2, topk_group=1)(x2)
    assert sorted(idx[0].tolist()) == [2, 3]
    # noaux_tc: choice on sigmoid + bias, groups by their top-2 sum, weights from the sigmoid scores
    r = router("noaux_tc", "sigmoid", n_group=2, topk_group=1)
    r.e_score_correction_bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    x3 = torch.tensor([[2.0, 1.5, 1.0, -3.0]])
    _, w, idx = r(x3)
    assert sorted(idx[0].tolist()) == [2, 3]            # group {2,3}: .731 + (.047 + 1) > .881 + .818
    torch.testing.assert_close(w[0][idx[0].argsort()], torch.sigmoid(torch.tensor([1.0, -3.0])), rtol=0, atol=exact)
    # group score = sum of the group's top-2 (1.76 for {0,1}) even when another group has the max (1.05)
    r.e_score_correction_bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    _, w, idx = r(torch.tensor([[2.0, 2.0, -3.0, -3.0]]))
    assert sorted(idx[0].tolist()) == [0, 1]


def test_tiling_and_token_counts():
    # DeepSeek-VL2 at 384 px, patch 14, 2 x 2 downsample: 27 x 27 -> 14 x 14 tokens per tile
    assert vl2.image_token_count(1, 1) == 14 * 15 + 1 + 14 * 15 == 421
    assert vl2.image_token_count(2, 1) == 210 + 1 + 14 * (2 * 14 + 1) == 617
    assert vl2.image_token_count(1, 3) == 210 + 1 + 42 * 15 == 841
    cands = [(384, 384), (384, 768), (768, 384), (768, 768)]
    assert vl2.select_best_resolution((800, 400), cands) == (768, 384)
    assert vl2.select_best_resolution((300, 300), cands) == (384, 384)      # no gain from upscaling: least waste
    assert vl2.select_best_resolution((1000, 990), cands) == (768, 768)


def test_projector_unfold_order_and_padding():
    """3 x 3 grid (odd, like the real 27 x 27) -> zero-padded to 4 x 4 -> 2 x 2 tokens whose
    features are channel-major: [c0 of (0,0),(0,1),(1,0),(1,1), c1 of ...]."""
    p = vl2.Projector(dict(vl2.PROJECTOR_DEFAULTS, input_dim=2, n_embed=4))
    p.layers = torch.nn.Identity()
    grid = torch.arange(9, dtype=torch.float32).view(1, 9, 1)
    x = torch.cat([grid, 100 + grid], -1)                     # channel 1 = 100 + position
    y = p(x)[0]
    assert y.shape == (4, 8)
    assert y[0].tolist() == [0, 1, 3, 4, 100, 101, 103, 104]
    assert y[1].tolist() == [2, 0, 5, 0, 102, 0, 105, 0]      # right column padded with zeros
    assert y[3].tolist() == [8, 0, 0, 0, 108, 0, 0, 0]


def test_image_layout_newlines_and_separator(tok, tmp_path):
    """A 2-wide 1-high image: 2 x 2 global tokens + a newline per row, the separator, then a
    2 x 4 local grid (tiles side by side) + a newline per row, in that order."""
    model = vl2.build_random(raw_config(False, len(tok)))
    feats = torch.arange(3 * 4, dtype=torch.float32).view(3, 4, 1).expand(3, 4, 32)   # tile t, token i -> 4t + i

    class Feats(torch.nn.Module):
        def forward(self, x):
            return feats
    model.vision, model.projector = torch.nn.Identity(), Feats()
    e = model.image_embeddings(torch.zeros(1, 3, 1), torch.tensor([[[2, 1]]]))[0]
    nl, sep = model.image_newline, model.view_seperator
    assert len(e) == vl2.image_token_count(2, 1, 42, 14, 2) == 6 + 1 + 2 * 5
    want = [0, 1, "n", 2, 3, "n", "s", 4, 5, 8, 9, "n", 6, 7, 10, 11, "n"]
    ref = lambda ws: torch.stack([nl if w == "n" else sep if w == "s" else torch.full((32,), float(w)) for w in ws])
    assert torch.equal(e, ref(want))
    model.config.raw["global_view_pos"] = "tail"                     # local views, separator, global view
    e = model.image_embeddings(torch.zeros(1, 3, 1), torch.tensor([[[2, 1]]]))[0]
    assert torch.equal(e, ref(want[7:] + ["s"] + want[:6]))


def test_processor_places_image_tokens(tok, tmp_path):
    proc = vl2.Processor(tok, [[42, 42], [42, 84], [84, 42]], 14, 2)
    wide = Image.new("RGB", (100, 50), (255, 0, 0))
    inp = proc.encode([wide, None], ["what colour?", "hi"], history=[[], [("a", "b")]])
    assert inp["images_spatial_crop"].tolist() == [[[2, 1]], [[0, 0]]]
    assert int(inp["images_seq_mask"][0].sum()) == vl2.image_token_count(2, 1, 42, 14, 2) == 17
    assert int(inp["images_seq_mask"][1].sum()) == 0
    assert ((inp["input_ids"] == proc.image_token_id) == inp["images_seq_mask"]).all()
    assert inp["images"].shape == (2, 3, 3, 42, 42)
    # global view: 100 x 50 padded to 42 x 42 with the mean colour (127 -> -0.004): top rows are padding
    px = tol(torch.float32, 4, 1.0)     # x / 255, normalised to [-1, 1] in fp32: 4 steps of 1
    torch.testing.assert_close(inp["images"][0, 0, :, 0, 0], torch.full((3,), 127 / 255 * 2 - 1), rtol=0, atol=px)
    torch.testing.assert_close(inp["images"][0, 0, :, 21, 21], torch.tensor([1.0, -1.0, -1.0]), rtol=0, atol=px)
    text = tok.decode(inp["input_ids"][1][inp["attention_mask"][1].bool()].tolist())
    assert text == f"{SPECIAL['bos']}<|User|>: a\n\n<|Assistant|>:b{SPECIAL['eos']}<|User|>: hi\n\n<|Assistant|>:"


def test_vision_and_projector_match_official_maths(tok):
    """SigLIP ViT as timm runs it (patch conv, + pos_embed, pre-LN blocks: qkv attention, tanh
    GELU MLP; final LayerNorm eps 1e-6) and the projector's Linear, GELU, Linear, from the
    official-layout tensors."""
    model = vl2.build_random(raw_config(False, len(tok)))
    model.vision.pos_embed.data *= 0.01             # small activations: LayerNorm's eps (1e-6) matters
    t = vl2.to_official(model.state_dict())
    x = torch.randn(2, 3, 42, 42) * 0.01
    ln = lambda z, n: F.layer_norm(z, z.shape[-1:], t[n + ".weight"], t[n + ".bias"], eps=1e-6)
    lin = lambda z, n: F.linear(z, t[n + ".weight"], t[n + ".bias"])
    h = F.conv2d(x, t["vision.patch_embed.proj.weight"], t["vision.patch_embed.proj.bias"], stride=14)
    h = h.flatten(2).transpose(1, 2) + t["vision.pos_embed"]
    for b in range(2):
        p = f"vision.blocks.{b}."
        q, k, v = lin(ln(h, p + "norm1"), p + "attn.qkv").view(2, 9, 3, 4, 6).permute(2, 0, 3, 1, 4)
        a = ((q @ k.transpose(-1, -2)) / math.sqrt(6)).softmax(-1) @ v
        h = h + lin(a.transpose(1, 2).reshape(2, 9, 24), p + "attn.proj")
        z = lin(ln(h, p + "norm2"), p + "mlp.fc1")
        h = h + lin(0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3))), p + "mlp.fc2")
    h = ln(h, "vision.norm")
    # Not derived: each LayerNorm scales rounding by |gain| / sigma of tiny activations, which this
    # random tower does not bound a priori; 1e-5 is an empirical margin.
    assert torch.allclose(model.vision(x), h, atol=1e-5)
    g = F.pad(h.view(2, 3, 3, 24), (0, 0, 0, 1, 0, 1))                       # 4 x 4, unfold order by hand
    cat = torch.stack([torch.cat([g[:, 2 * i:2 * i + 2, 2 * j:2 * j + 2, c].reshape(2, 4) for c in range(24)], -1)
                       for i in range(2) for j in range(2)], 1)
    want = lin(F.gelu(lin(cat, "projector.layers.0")), "projector.layers.2")
    # Linear, GELU (|gelu(z)| <= |z|), Linear in fp32: depth in + hidden + 3 relative to the network of
    # absolute values
    alin = lambda z, n: F.linear(z, t[n + ".weight"].abs(), t[n + ".bias"].abs())
    scale = alin(alin(cat.abs(), "projector.layers.0"), "projector.layers.2").max()
    depth = cat.shape[-1] + t["projector.layers.0.weight"].shape[0] + 3
    torch.testing.assert_close(model.projector(h), want, rtol=0, atol=tol(torch.float32, depth, scale))


# ----------------------------------------------------------------------------- the official LM maths, written out

def rms(x, w, eps=1e-6):
    return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps))


def rot_half(x):
    return torch.cat([-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]], -1)


def reference_logits(t, lm, ids):
    """Logits of the official DeepSeek-V2 LM (MHA = Llama attention; MLA in its absorbed form
    with the interleaved RoPE), from the official-layout tensors t; one sequence, no padding."""
    H, L, D = lm["num_attention_heads"], ids.shape[0], lm["hidden_size"]
    x = t["language.model.embed_tokens.weight"][ids]
    pos = torch.arange(L, dtype=torch.float32)
    causal = torch.full((L, L), -math.inf).triu(1)
    for i in range(lm["num_hidden_layers"]):
        p = lambda n: t[f"language.model.layers.{i}.{n}.weight"]
        h = rms(x, p("input_layernorm"))
        if not lm["use_mla"]:
            d = D // H
            q, k, v = (F.linear(h, p(f"self_attn.{n}_proj")).view(L, H, d).transpose(0, 1) for n in "qkv")
            f = pos[:, None] / 10000.0 ** (torch.arange(0, d, 2) / d)
            cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
            q, k = q * cos + rot_half(q) * sin, k * cos + rot_half(k) * sin
            a = ((q @ k.transpose(1, 2)) / math.sqrt(d) + causal).softmax(-1) @ v
            a = a.transpose(0, 1).reshape(L, D)
        else:
            nope, rope, vd, r = lm["qk_nope_head_dim"], lm["qk_rope_head_dim"], lm["v_head_dim"], lm["kv_lora_rank"]
            q = F.linear(h, p("self_attn.q_proj")).view(L, H, nope + rope).transpose(0, 1)
            q_nope, q_pe = q[..., :nope], q[..., nope:]
            ckv = F.linear(h, p("self_attn.kv_a_proj_with_mqa"))
            c, k_pe = rms(ckv[:, :r], p("self_attn.kv_a_layernorm")), ckv[:, r:][None]
            f = pos[:, None] / 10000.0 ** (torch.arange(0, rope, 2) / rope)
            cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
            il = lambda z: z.view(*z.shape[:-1], rope // 2, 2).transpose(-1, -2).reshape(z.shape)
            q_pe, k_pe = il(q_pe) * cos + rot_half(il(q_pe)) * sin, il(k_pe) * cos + rot_half(il(k_pe)) * sin
            kvb = p("self_attn.kv_b_proj").view(H, nope + vd, r)
            s = (q_pe @ k_pe.transpose(1, 2) + (q_nope @ kvb[:, :nope]) @ c.T) / math.sqrt(nope + rope)
            a = ((s + causal).softmax(-1) @ c) @ kvb[:, nope:].transpose(1, 2)
            a = a.transpose(0, 1).reshape(L, H * vd)
        x = x + F.linear(a, p("self_attn.o_proj"))
        h = rms(x, p("post_attention_layernorm"))
        mlp = lambda pre, z: F.linear(F.silu(F.linear(z, t[pre + "gate_proj.weight"]))
                                      * F.linear(z, t[pre + "up_proj.weight"]), t[pre + "down_proj.weight"])
        base = f"language.model.layers.{i}.mlp."
        if i < lm["first_k_dense_replace"]:
            x = x + mlp(base, h)
            continue
        s = F.linear(h, p("mlp.gate")).softmax(-1)
        w, idx = s.topk(lm["num_experts_per_tok"], -1)
        y = torch.stack([sum(w[j, m] * mlp(base + f"experts.{int(idx[j, m])}.", h[j]) for m in range(idx.shape[1]))
                         for j in range(L)])
        x = x + y + mlp(base + "shared_experts.", h)
    return F.linear(rms(x, t["language.model.norm.weight"]), t["language.lm_head.weight"])


@pytest.mark.parametrize("mla", [False, True])
def test_language_model_matches_official_maths(tok, tmp_path, mla):
    src = make_checkpoint(tmp_path / "src", tok, mla)
    model, t = vl2.load(src), on_disk(src)
    ids = torch.tensor([5, 9, 17, 3, 200, 41, 8])
    got = model(input_ids=ids[None]).logits[0]
    want = reference_logits(t, json.load(open(os.path.join(src, "config.json")))["language_config"], ids)
    torch.testing.assert_close(got, want, rtol=0, atol=logits_tol(model, len(ids), want))


def test_batched_generation_matches_one_by_one(tok, tmp_path):
    """Left padding changes nothing: each row of a mixed batch (image / text-only, different
    lengths and tilings) decodes exactly as it does alone."""
    model = vl2.load(make_checkpoint(tmp_path / "src", tok, False))
    proc = vl2.Processor.from_pretrained(str(tmp_path / "src"))
    from common import data
    from common import shapes
    recs = records(tmp_path, 3)
    ims = [data.load_image(r["image"]) for r in recs[:2]] + [None]
    qs = [r["question"] for r in recs[:2]] + ["count the shapes please"]
    kw = dict(max_new_tokens=6, eos_token_id=proc.eos_token_id, pad_token_id=proc.pad_token_id)
    batch = model.generate(**proc.encode(ims, qs), **kw)
    L = batch.shape[1] - 6
    for i in range(3):
        one = proc.encode([ims[i]], [qs[i]])
        alone = model.generate(**one, **kw)[0, one["input_ids"].shape[1]:].tolist()
        assert batch[i, L:L + len(alone)].tolist() == alone


# ----------------------------------------------------------------------------- RoleMerge end to end

@pytest.mark.parametrize("mla,topk_method,n_group", [(False, "greedy", 1), (True, "group_limited_greedy", 2)])
def test_calibrate_merge_reload_generate(tok, tmp_path, mla, topk_method, n_group):
    """calibrate (image / question / answer) -> in-memory and streaming merge (identical
    tensors, official layout with K experts, config n_routed_experts = K) -> reload -> generate;
    K = N reproduces the logits."""
    src = make_checkpoint(tmp_path / "src", tok, mla, topk_method=topk_method, n_group=n_group, top_level_copy=mla)
    model, proc = cal.load_model(src)
    recs = records(tmp_path)
    stats = cal.calibrate(model, proc, {"a": recs[:2], "b": recs[2:] + [{"question": "count"}]}, batch_size=2,
                          max_new_tokens=4, model_id=src, progress=False)
    assert stats["buckets"] == ["image", "question", "answer"] and stats["layers"] == [1, 2]
    n_img = sum(vl2.image_token_count(*((2, 1) if i % 2 else (1, 1)), 42, 14, 2) for i in range(4))
    assert int(sum(s["tokens"][0] for s in stats["sources"].values())) == n_img
    sp = str(tmp_path / "stats.safetensors")
    rstats.save_stats(stats, sp)
    rep = mg.run_merge(MergeConfig(model=src, stats=sp, out=str(tmp_path / "mem"), rho=0.5, in_memory=True))
    mg.run_merge(MergeConfig(model=src, stats=sp, out=str(tmp_path / "stream"), rho=0.5))
    assert rep["K"] == 4 and rep["routing"] == {}
    if n_group == 2:                                       # merged only within routing groups {0..3}, {4..7}
        assert all(len({e // 4 for e in g}) == 1 for lay in rep["groups"] for g in lay)
    a, b = on_disk(str(tmp_path / "mem")), on_disk(str(tmp_path / "stream"))
    want = expected_keys(mla, n_experts=4)
    assert {k for k in a if not k.startswith("vision.attn_pool.")} == want.keys()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    t = on_disk(src)
    assert all(torch.equal(a[k], t[k]) for k in t if "experts." not in k and ".mlp.gate." not in k)  # untouched
    for d in ("mem", "stream"):
        c = json.load(open(tmp_path / d / "config.json"))
        assert c["language_config"]["n_routed_experts"] == 4 and c["vision_config"] == json.load(
            open(os.path.join(src, "config.json")))["vision_config"]
        assert c.get("n_routed_experts", 4) == 4 and ("n_routed_experts" in c) == mla
    m2, p2 = cal.load_model(str(tmp_path / "stream"))
    assert all(blk.gate.weight.shape[0] == 4 for _, blk in blk.moe_blocks(m2))
    from common import data
    from common import shapes
    out = m2.generate(**p2.encode([data.load_image(recs[1]["image"]), None], ["what is here?", "hi"]),
                      max_new_tokens=4, eos_token_id=p2.eos_token_id, pad_token_id=p2.pad_token_id)
    assert out.shape[0] == 2
    mg.run_merge(MergeConfig(model=src, stats=sp, out=str(tmp_path / "k8"), rho=1.0))
    m8 = vl2.load(str(tmp_path / "k8"))
    inp = proc.encode([data.load_image(recs[0]["image"])], ["is there a circle?"])
    assert torch.equal(m8(**inp).logits, model(**inp).logits)      # rho = 1 merges nothing: the same weights


def test_cli_calibrate_and_merge(tok, tmp_path):
    """The documented commands run on a DeepSeek-VL2 checkpoint directory."""
    src = make_checkpoint(tmp_path / "src", tok, False)
    recs = records(tmp_path, 2)
    path = tmp_path / "cal.jsonl"
    path.write_text("".join(json.dumps(dict(r, answer="red")) + "\n" for r in recs))
    cal.main(["--model", src, "--data", str(path), "--out", str(tmp_path / "s.safetensors"), "--max-new-tokens", "3",
              "--batch-size", "2", "--threads", "1"])
    mg.main(["--model", src, "--stats", str(tmp_path / "s.safetensors"), "--k", "2", "--out", str(tmp_path / "m"),
             "--threads", "1"])
    assert json.load(open(tmp_path / "m" / "config.json"))["language_config"]["n_routed_experts"] == 2
    from rolemerge import infer
    infer.main(["--model", str(tmp_path / "m"), "--data", str(path), "--max-new-tokens", "3", "--threads", "1",
                "--out", str(tmp_path / "pred.json")])
    preds = json.load(open(tmp_path / "pred.json"))
    assert preds["summary"]["n"] == 2 and all(p["correct"] is not None for p in preds["predictions"])


def test_routing_groups_of_vl2_configs():
    """DeepSeek-VL2 base routes noaux_tc (V3-style groups: >= 2 experts per group); Tiny / Small
    greedy (no groups)."""
    assert planning.routing_groups("deepseek_vl_v2", dict(topk_method="greedy", n_group=1, topk_group=1), 8, 4, 2) == (1, {})
    assert planning.routing_groups("deepseek_vl_v2", dict(topk_method="noaux_tc", n_group=4, topk_group=2), 8, 4, 2) == \
        (2, {"n_group": 2, "topk_group": 1})
    assert planning.routing_groups("deepseek_vl_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
                             8, 4, 2) == (4, {})


def test_generate_stops_at_eos_and_honours_min_new_tokens(tok):
    """generate's contract with rolemerge.calibrate: stop when every row has ended, never feed
    the last token back (one call for the prompt, one per further token), EOS masked before
    min_new_tokens."""
    model = vl2.build_random(raw_config(False, len(tok)))
    eos, V = 1, len(tok)

    class EosHead(torch.nn.Module):                      # EOS always the best token, token 0 the runner-up
        def forward(self, h):
            out = torch.zeros(*h.shape[:-1], V)
            out[..., eos], out[..., 0] = 2.0, 1.0
            return out
    model.language.lm_head = EosHead()
    ids = torch.randint(5, 100, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0                                      # row 0 left-padded
    calls = []
    h = model.language.lm_head.register_forward_hook(lambda m, a, o: calls.append(o.shape[1]))
    out = model.generate(ids, mask, max_new_tokens=5, eos_token_id=eos, pad_token_id=2)
    assert out.shape == (2, 7) and (out[:, 6] == eos).all() and calls == [6]
    calls.clear()
    out = model.generate(ids, mask, max_new_tokens=5, min_new_tokens=3, eos_token_id=eos, pad_token_id=2)
    h.remove()
    # as transformers' MinNewTokensLengthLogitsProcessor: EOS masked while fewer than 3 tokens precede
    assert out[:, 6:].tolist() == [[0, 0, 0, eos]] * 2 and calls == [6, 1, 1, 1]
