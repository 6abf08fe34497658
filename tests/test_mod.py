"""MoD adapters (mod/model.py) on the tiny Qwen3-VL and Qwen2.5-VL architectures."""
import copy
import random

import pytest
import torch

from common import data
from common import shapes
from common.backbone import build_tiny
from helpers import adapter_depth, logits_tol, mod_layer_tol
from mod.model import (AdapterConfig, MoDLinear, RoutingContext, adapter_layers, attach, aux_loss, load_adapters,
                       num_trainable, routing_context, save_adapters, unload)

ARCHS = ["qwen3_vl", "qwen2_5_vl"]


@pytest.fixture(scope="module")
def tiny():
    """arch -> (base model, proc, a left-padded 2-example generation batch, the examples)."""
    out = {}
    rng = random.Random(0)
    ex = [shapes.sample_example(rng) for _ in range(2)]
    images = [shapes.render(e[0]) for e in ex]
    questions = ["How many circles are there?", "Is there a red square to the left of a blue circle in the image?"]
    for arch in ARCHS:
        model, proc = build_tiny(arch, hidden=64, layers=2)
        out[arch] = (model.eval(), proc, proc.encode(images, questions), (images, questions))
    return out


def randomise(model, std=0.5):
    """Non-zero B and sharper routers so the adapters change the output and routing varies."""
    torch.manual_seed(1)
    for _, m in adapter_layers(model):
        for n, p in m.named_parameters(recurse=False):
            with torch.no_grad():
                p.normal_(std=2.0 if n.startswith("router") else std)


def wrapped(tiny, arch, **kw):
    model, proc, batch, raw = tiny[arch]
    model = copy.deepcopy(model)
    attach(model, AdapterConfig(**kw))
    return model, proc, batch, raw


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_B_reproduces_base_exactly(tiny, arch):
    base, _, batch, _ = tiny[arch]
    for method in ("mod", "lora", "moelora"):
        model, *_ = wrapped(tiny, arch, method=method)
        assert torch.equal(logits(model, batch), logits(base, batch))


def test_uniform_routing_aux_equals_r(tiny):
    model, _, batch, _ = wrapped(tiny, "qwen3_vl", r=3)
    for _, m in adapter_layers(model):
        with torch.no_grad():
            m.router_A.zero_(), m.router_B.zero_()  # logits 0 -> softmax uniform
    model.train()
    model(**batch)
    per_layer = routing_context(model).aux
    assert len(per_layer) == len(adapter_layers(model))
    assert all(v.item() == pytest.approx(3.0) for v in per_layer)
    assert aux_loss(model).item() == pytest.approx(3.0)


def naive_mod(layer, x, x_route):
    """Per-token reference of eq. 2-6 with explicit loops over tokens and ranks."""
    cfg, out = layer.cfg, layer.base_layer(x).clone()
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            sa = torch.softmax(layer.router_A @ x_route[b, t], -1)
            sb = sa if cfg.shared_router else torch.softmax(layer.router_B @ x_route[b, t], -1)
            ia, ib = sa.topk(cfg.r).indices, sb.topk(cfg.r).indices
            ga, gb = sa[ia] / sa[ia].sum(), sb[ib] / sb[ib].sum()
            g = {"sqrt_product": (ga * gb).sqrt(), "product": ga * gb, "mean": (ga + gb) / 2}[cfg.combine]
            h = sum(g[j] * (layer.A[ia[j]] @ x[b, t]) * layer.B[ib[j]] for j in range(cfg.r))
            out[b, t] += layer.scaling * h
    return out


@pytest.mark.parametrize("combine,shared", [("sqrt_product", False), ("product", False), ("mean", False),
                                            ("sqrt_product", True)])
def test_vectorised_equals_naive(combine, shared):
    torch.manual_seed(0)
    cfg = AdapterConfig(combine=combine, shared_router=shared, window=3, num_experts=6, r=3)
    layer = MoDLinear(torch.nn.Linear(12, 10), cfg, RoutingContext())
    with torch.no_grad():
        layer.B.normal_(), layer.router_A.normal_()
        if layer.router_B is not None:
            layer.router_B.normal_()
    x = torch.randn(2, 7, 12)
    with torch.no_grad():
        got = layer(x)
        x_route = torch.stack([x[:, max(0, t - 2):t + 1].mean(1) for t in range(7)], 1)  # eq. 1 by hand
        want = naive_mod(layer, x, x_route)
    assert (got - want).abs().max() <= mod_layer_tol(layer, x)


def full_forward_logits(model, batch, seq):
    L, n = batch["input_ids"].shape[1], seq.shape[1] - batch["input_ids"].shape[1]
    full = dict(batch, input_ids=seq)
    ones = torch.ones(seq.shape[0], n, dtype=torch.long)
    full["attention_mask"] = torch.cat([batch["attention_mask"], ones], 1)
    full["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], 0 * ones], 1)
    return logits(model, full)[:, L - 1:-1]


def generate_logits(model, proc, batch, n=10):
    out = model.generate(**batch, max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=proc.eos_token_id, pad_token_id=proc.pad_token_id,
                         min_new_tokens=n)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("granularity,W", [("token", 1), ("region", 4), ("window", 4), ("window", 16)])
def test_cached_decoding_equals_full_forward(tiny, arch, granularity, W):
    model, proc, batch, _ = wrapped(tiny, arch, granularity=granularity, window=W)
    randomise(model)
    assert (batch["attention_mask"][:, 0] == 0).any()  # the batch really is left padded
    seq, gen = generate_logits(model, proc, batch)
    full = full_forward_logits(model, batch, seq)
    # float noise only; a routing difference is larger (control below)
    assert (gen - full).abs().max() <= logits_tol(model, seq.shape[1], full, adapter_depth(model))


def test_cached_decoding_needs_the_token_cache(tiny, monkeypatch):
    """Control: without the W-1 token cache, decoding routes differently (the test above is sensitive)."""
    model, proc, batch, _ = wrapped(tiny, "qwen3_vl", window=8)
    randomise(model)
    from mod import model as mm
    monkeypatch.setattr(mm.RoutingWindow, "_update_cache", lambda self, *a: None)
    seq, gen = generate_logits(model, proc, batch)
    monkeypatch.undo()
    full = full_forward_logits(model, batch, seq)
    assert (gen - full).abs().max() > logits_tol(model, seq.shape[1], full, adapter_depth(model))


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_batch_equals_single_examples(tiny, arch):
    """Tolerance from fp32 eps and the decoder's depth relative to the logits' scale
    (helpers.logits_tol); letting the pads into the routing window changes the logits by more than
    the scale itself (1.6-1.8x, measured)."""
    model, proc, batch, (images, questions) = wrapped(tiny, arch, window=8)
    randomise(model)
    got = logits(model, batch)
    for i in range(2):
        one = logits(model, proc.encode(images[i:i + 1], questions[i:i + 1]))
        bound = logits_tol(model, batch["input_ids"].shape[1], one, adapter_depth(model))
        assert (got[i, -one.shape[1]:] - one[0]).abs().max() <= bound


@pytest.mark.parametrize("method", ["mod", "lora", "moelora"])
def test_only_adapter_parameters_get_gradients(tiny, method):
    model, proc, _, (images, questions) = wrapped(tiny, "qwen3_vl", method=method)
    randomise(model)
    model.train()
    batch = proc.encode(images, questions, answers=["yes", "two"])
    out = model(**batch)
    (out.loss + 0.01 * aux_loss(model)).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n
    expected = {"mod": {"A", "B", "router_A", "router_B"}, "lora": {"lora_A", "lora_B"},
                "moelora": {"lora_A", "lora_B", "router"}}[method]
    assert {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad} == expected


def test_shared_router_identical_indices(tiny):
    model, _, batch, _ = wrapped(tiny, "qwen3_vl", shared_router=True)
    randomise(model)
    ctx = routing_context(model)
    ctx.record = True
    logits(model, batch)
    assert len(ctx.trace) == 8 and all(torch.equal(a, b) for _, a, b, _ in ctx.trace)
    assert all(m.router_B is None for _, m in adapter_layers(model))


@pytest.mark.parametrize("method", ["mod", "moelora"])
def test_save_load_round_trip(tiny, tmp_path, method):
    model, _, batch, _ = wrapped(tiny, "qwen2_5_vl", method=method, granularity="region", window=4)
    randomise(model)
    save_adapters(model, str(tmp_path))
    fresh = copy.deepcopy(tiny["qwen2_5_vl"][0])
    cfg = load_adapters(fresh, str(tmp_path))
    assert cfg.granularity == "region" and cfg.method == method
    assert torch.equal(logits(fresh, batch), logits(model, batch))
    with pytest.raises(ValueError):
        load_adapters(build_tiny("qwen2_5_vl", hidden=64, layers=3)[0], str(tmp_path))  # a deeper base


def test_target_modules_errors_and_language_model_only(tiny):
    model = copy.deepcopy(tiny["qwen3_vl"][0])
    with pytest.raises(ValueError, match="match no nn.Linear"):
        attach(model, AdapterConfig(target_modules="nonexistent_proj"))
    names = attach(model, AdapterConfig(target_modules="qkv,q_proj,down_proj"))  # qkv lives in the vision tower
    assert names and all(n.endswith(("q_proj", "down_proj")) for n in names)
    assert not any("visual" in n for n, _ in adapter_layers(model))
    assert num_trainable(model) > 0
    with pytest.raises(ValueError):
        AdapterConfig(r=9, num_experts=8)


def test_llava_next_architecture():
    """The adapters are architecture-agnostic: a tiny LLaVA-NeXT (Llama decoder) wraps, starts
    at the base model and decodes with the routing cache like a full forward (text-only input)."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration
    cfg = LlavaNextConfig(
        text_config=dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        image_token_index=299, image_grid_pinpoints=[[28, 28]], vision_feature_layer=-1)
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(cfg).eval()
    ids = torch.randint(0, 290, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    base = logits(model, dict(input_ids=ids, attention_mask=mask))
    names = attach(model, AdapterConfig(window=4))
    assert len(names) == 8 and not any("vision" in n for n in names)
    assert torch.equal(logits(model, dict(input_ids=ids, attention_mask=mask)), base)
    randomise(model)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    full = logits(model, dict(input_ids=out.sequences, attention_mask=torch.cat([mask, torch.ones(2, 6).long()], 1)))
    bound = logits_tol(model, out.sequences.shape[1], full, adapter_depth(model))
    assert (full[:, 11:-1] - torch.stack(out.logits, 1)).abs().max() <= bound


def test_unload_gives_the_base_back(tiny):
    """unload undoes attach: the base layers are back, the model's pre-hook is gone, the output is
    the base's again, and new adapters attach."""
    base, _, batch, _ = tiny["qwen3_vl"]
    model, *_ = wrapped(tiny, "qwen3_vl", method="mod")
    randomise(model)
    assert not torch.equal(logits(model, batch), logits(base, batch)) and len(model._forward_pre_hooks) == 1
    assert unload(model).method == "mod"
    assert adapter_layers(model) == [] and len(model._forward_pre_hooks) == 0
    assert torch.equal(logits(model, batch), logits(base, batch))
    with pytest.raises(ValueError, match="no adapters attached"):
        unload(model)
    attach(model, AdapterConfig(method="lora"))
    assert len(adapter_layers(model)) > 0
