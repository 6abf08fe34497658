"""eval.tools.memory_plan: the accounting and the extrapolation, on hand cases and a tiny config (seconds)."""
import pytest
import torch
import torch.nn as nn

from eval.tools import memory_plan as mp
from helpers import mod_layer_tol, tol

# a tiny Qwen2.5-VL-shaped spec (same keys as memory_plan.REAL)
TINY = dict(
    repo="tiny", model_type="qwen2_5_vl", layers=4, tie_word_embeddings=False,
    text=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
    vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1]),
    image=dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=1 << 20,
               mean=mp.CLIP_MEAN, std=mp.CLIP_STD))


def test_fit_hand_case():
    # m(L, B) = c + B (a_fixed + L a_layer) with c = 2, a_fixed = 5, a_layer = 3
    m = lambda L, B: 2 + B * (5 + 3 * L)
    assert mp.fit({(1, 1): m(1, 1), (2, 1): m(2, 1), (2, 2): m(2, 2)}) == (2, 5, 3)
    # without the batch-2 point everything scales with the batch: c = 0
    assert mp.fit({(1, 1): 10, (2, 1): 13}) == (0, 7, 3)
    assert mp.linear(10, 13) == (7, 3)
    assert mp.fit({(1, 1): 10, (2, 1): 13}, a_layer=1) == (0, 9, 1)          # a given per-layer part (KV cache)
    assert mp.kv_bytes_per_layer(mp.REAL["qwen3_vl_30b_a3b"], 100) == 2 * 4 * 128 * 2 * 100


def test_predict_adds_the_parts_hand_case():
    s = {"param_bytes": (100, 10), "trainable_bytes": (4, 1), "grad_bytes": (4, 1), "optimizer_bytes": (8, 2),
         "act": (1, 20, 5), "saved": (0, 10, 2), "opt_temp": (4, 1), "flops": (0, 30, 7)}
    p = mp.predict(s, L=4, B=2)
    assert (p["params"], p["grads"], p["optimizer"], p["activations"], p["flops"]) == (140, 8, 16, 81, 116)
    assert mp.predict(dict(s, saved=(0, 30, 10)), 4, 2)["activations"] == 140    # saved tensors above the fit
    assert p["total"] == 140 + 16 + 8 + 81               # activations (81) > optimizer temporaries (8)
    s["opt_temp"] = (200, 0)
    assert mp.predict(s, 4, 2)["total"] == 140 + 16 + 8 + 200
    d = mp.predict(s, 4, 2, ddp=True)
    assert d["ddp_bucket"] == 8 and d["total"] == 140 + 16 + 8 + 8 + 200
    # FSDP over 4: params, grads, optimizer state and its temporaries split, one unit (30) gathered
    f = mp.predict(s, 4, 2, fsdp=4, unit_bytes=30)
    assert (f["params"], f["grads"], f["optimizer"], f["opt_temp"]) == (35, 2, 4, 50)
    assert f["total"] == 35 + 4 + 2 + max(81 + 30, 50)
    assert mp.largest_unit_bytes(mp.REAL["qwen2_5_vl_7b"]) == 2 * 2 * 152064 * 3584 * 2


def test_tensor_and_saved_bytes_hand_cases():
    w = torch.zeros(10, 4)
    assert mp.tensor_bytes([w, w[:2], w.t(), None]) == 160          # views of one storage count once
    a = torch.randn(10, requires_grad=True)
    with mp.SavedTensors([]) as s:
        a.exp()                                                     # exp saves its fp32 result: 40 bytes
    assert s.bytes == 40
    lin, x = nn.Linear(4, 3, bias=False), torch.randn(2, 4, requires_grad=True)
    with mp.SavedTensors(list(lin.parameters())) as s:
        lin(x)                                                      # saves x (32 bytes) and the weight (a parameter)
    assert s.bytes == 32


def test_peak_memory_sees_a_block_allocation():
    with mp.PeakMemory("cpu") as pk:
        t = torch.ones(50_000_000)                                  # 200 MB, touched
        del t
    assert 190e6 < pk.peak < 400e6


def test_real_configs_and_image_processors():
    from common.backbone import build_tokenizer
    tok = build_tokenizer()
    c = mp.real_config(mp.REAL["qwen3_vl_30b_a3b"], 2, tok)
    t, v = c.text_config, c.vision_config
    assert (t.num_hidden_layers, t.hidden_size, t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size,
            t.vocab_size, t.num_key_value_heads) == (2, 2048, 128, 8, 768, 151936, 4)
    assert (v.depth, v.hidden_size, v.out_hidden_size, v.patch_size) == (27, 1152, 2048, 16)
    c7 = mp.real_config(mp.REAL["qwen2_5_vl_7b"], 1, tok)
    assert (c7.text_config.hidden_size, c7.text_config.intermediate_size, c7.vision_config.hidden_size,
            c7.vision_config.out_hidden_size) == (3584, 18944, 1280, 3584)
    # a 448x448 image: 32x32 patches of 14 (Qwen2.5-VL) -> 256 tokens; 28x28 of 16 (Qwen3-VL) -> 196
    from common.backbone import make_processor
    for name, n in (("qwen2_5_vl_3b", 256), ("qwen3_vl_30b_a3b", 196)):
        proc = make_processor(tok, mp.image_processor(mp.REAL[name]), mp.real_config(mp.REAL[name], 1, tok))
        (pv, grid), qs, ans = mp.sample_inputs(proc, 1, 448, 3, 2)
        assert int(grid.prod(-1).sum()) // 4 == n
        assert len(proc.text_ids(qs[0])) == 3 and len(proc.text_ids(ans[0])) == 2


@pytest.fixture(scope="module")
def mod_run():
    return mp.measure(TINY, "mod", 1, 1, image_size=56, q_tokens=3, a_tokens=4)


def test_measure_mod_accounting_tiny(mod_run):
    r = mod_run
    model, proc = mp.build(TINY, 1)
    assert r["param_bytes"] - r["trainable_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    # MoD on q/k/v/o of one layer, 8 experts: A [8,in], B [8,out], router_A, router_B [8,in], fp32
    shapes = [(64, 64), (64, 32), (64, 32), (64, 64)]               # (in, out) of q, k, v, o (2 KV heads x 16)
    n = sum(8 * (3 * i + o) for i, o in shapes)
    assert r["trainable_numel"] == n and r["trainable_bytes"] == 4 * n and r["grad_bytes"] == 4 * n
    assert r["optimizer_bytes"] == 2 * 4 * n + 4 * 4 * len(shapes)  # AdamW exp_avg + exp_avg_sq + step per tensor
    # prompt template with 4 image pads + 3 question tokens + 4 answer tokens + <|im_end|>
    assert r["visual_tokens"] == 4 and r["seq_len"] == len(proc.prompt_ids("", 4)) + 3 + 4 + 1
    assert r["saved_bytes"] > 0 and r["flops"] > 0 and r["fwd_bwd_peak"] > 0 and not r["optimizer_computed"]


def test_measure_without_optimizer_step_computes_adamw_state():
    r = mp.measure(TINY, "mole_full", 1, 1, image_size=56, q_tokens=3, a_tokens=4, optimizer_step=False)
    assert r["optimizer_computed"] and r["opt_peak"] == 0
    n_tensors = r["trainable_tensors"]
    assert r["optimizer_bytes"] == 2 * r["trainable_bytes"] + 4 * n_tensors   # exp_avg, exp_avg_sq, step
    assert r["grad_bytes"] == r["trainable_bytes"] > 0
    # language model: embed + lm_head, q/k/v (+ biases) / o, MLP, 3 norms; MoLE: 8 latents, 1 router, 1 ESVA
    lm = 2 * 512 * 64 + (64 * 64 + 64 + 2 * (64 * 32 + 32) + 64 * 64) + 3 * 64 * 128 + 3 * 64
    mole = 8 * 64 + 64 * 4 + (2 * (4 * 32 * 32 + 4 * 32) + 4)
    assert r["trainable_numel"] == lm + mole == 111940


def test_mod_adapter_runs_under_bf16_autocast():
    """Regression: MoD's B-expert weights were allocated in the dtype of z = x @ A.T (bf16 under
    autocast, CUDA or CPU) and scatter_add then refused the fp32 gate coefficients."""
    from mod.model import AdapterConfig, MoDLinear, RoutingContext
    torch.manual_seed(0)
    base = nn.Linear(16, 8).to(torch.bfloat16)
    m = MoDLinear(base, AdapterConfig(r=2, num_experts=4, window=1), RoutingContext())
    with torch.no_grad():
        m.B.normal_()
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    y.float().sum().backward()
    ref = m(x)                                                       # no autocast: fp32 adapter maths
    assert y.dtype == torch.bfloat16 and m.B.grad is not None and m.B.grad.dtype == torch.float32
    # bf16 against fp32 adapter maths: the layer's fp32 bound (helpers.mod_layer_tol) at bf16's eps, plus
    # the output's own rounding to bf16
    bound = (mod_layer_tol(m, x.float()) * torch.finfo(torch.bfloat16).eps / torch.finfo(torch.float32).eps
             + tol(torch.bfloat16, 1, ref.float().abs().max()))
    torch.testing.assert_close(y.float(), ref.float(), rtol=0, atol=bound)
