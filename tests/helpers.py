"""Small helpers shared by the tests (imported as `helpers`: pytest puts tests/ on sys.path)."""
import hashlib
import os

import pytest
import torch


def tol(dtype, depth, scale=1.0):
    """Absolute tolerance between two computations of one quantity in `dtype` that differ only in
    rounding (another kernel or summation order: a cached against a full path, one CPU capability
    against another): depth * eps(dtype) * scale.

    depth: rounding steps in series, a reduction of n terms counting n (the worst-case bound of a
    length-n sum is n u sum|terms| with unit roundoff u = eps / 2; both sides round, hence eps);
    scale: the magnitude the errors are relative to, e.g. sum |a_i b_i| of a dot product or the
    largest |value| of the compared tensor. A worst-case bound, not one machine's rounding: it
    holds under ATEN_CPU_CAPABILITY avx512, avx2 and default alike. Where the depth of a whole
    model is unknowable, compare against a float64 reference instead."""
    scale = scale.detach() if torch.is_tensor(scale) else scale
    return depth * torch.finfo(dtype).eps * float(scale)


def decoder_depth(config, positions, adapter=0):
    """`tol`'s depth for one logit of a decoder-only transformer (config: a transformers config;
    its text config is read): per layer the q/k/v projection (hidden), the attention scores
    (head_dim) and their weighted sum over `positions`, o_proj (heads * head_dim), the MLP (hidden
    + intermediate) and `adapter` for each of the two adapted projections in series (q/k/v, then
    o_proj: e.g. in_features + num_experts for MoD); then lm_head (hidden)."""
    c = config.get_text_config()
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    inter = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    layer = c.hidden_size + hd + positions + c.num_attention_heads * hd + c.hidden_size + inter + 2 * adapter
    return c.num_hidden_layers * layer + c.hidden_size


def logits_tol(model, positions, logits, adapter=0):
    """`tol` for a decoder's fp32 logits computed two ways that differ only in rounding (cached
    against full, batched against single, another attention kernel): decoder_depth(model.config,
    positions, adapter) steps relative to max(1, max |logits|) (the scale `test_mod_copy` uses).
    model: a transformers model (or its config); logits: either side's tensor."""
    config = getattr(model, "config", model)
    scale = max(1.0, logits.detach().abs().max().item())
    return tol(torch.float32, decoder_depth(config, positions, adapter), scale)


def adapter_depth(model):
    """`decoder_depth`'s `adapter` for a model with MoD / MoE-LoRA / LoRA layers (mod.model.MoDLinear):
    the largest in_features + rows of A (experts, or the LoRA rank) + routing window of any adapted
    projection (the adapter's dots, the mix of its rows, the router input's window mean); 0 without."""
    d = 0
    for m in model.modules():
        if hasattr(m, "base_layer") and hasattr(m, "cfg") and hasattr(m.cfg, "method"):
            A = m.A if m.cfg.method == "mod" else m.lora_A
            d = max(d, m.base_layer.in_features + A.shape[0] + m.cfg.route_window)
    return d


def mod_layer_tol(layer, x):
    """`tol` for an output of a MoD / MoE-LoRA / LoRA layer (mod.model.MoDLinear) on input x [..., in]
    computed two ways in fp32: the base term (a length-in dot, scale sum |x_i w_i| + |bias|), the
    adapter term (z = A x of length in, gates, the mix of E rows: depth in + E + 1, scale
    alpha/r * sum_e |A_e . x| * max|B|, gates <= 1) and the gates' own error, which moves the adapter
    term by its scale times the router logits' absolute error (a length-in dot and a W-token
    mean, scale sum |x_i w_gi|): d softmax / d logit <= 1."""
    base, cfg = layer.base_layer, layer.cfg
    xa = x.detach().abs().float()
    s_base = (xa @ base.weight.detach().abs().float().T).max().item()
    s_base += 0.0 if base.bias is None else base.bias.detach().abs().max().item()
    din = base.in_features
    out = tol(torch.float32, din + 1, s_base)
    if cfg.method == "mod":
        A, B = layer.A, layer.B
    else:
        A, B = layer.lora_A, layer.lora_B.T
    s_ad = layer.scaling * (xa @ A.detach().abs().T).sum(-1).max().item() * B.detach().abs().max().item()
    out += tol(torch.float32, din + A.shape[0] + 1, s_ad)
    if cfg.method != "lora":
        routers = [layer.router] if cfg.method == "moelora" else [layer.router_A, layer.router_B]
        s_route = max((xa @ w.detach().abs().T).max().item() for w in routers if w is not None)
        out += tol(torch.float32, din + cfg.route_window, s_route) * s_ad
    return out


def bf16_cpu_attention():
    """True when torch's bfloat16 scaled_dot_product_attention runs on this CPU. torch 2.13 needs
    AVX-512 for it from 64 positions on: under ATEN_CPU_CAPABILITY=avx2 or default it raises
    "pack_vnni2 is only supported when avx512 is supported" (forward and backward alike)."""
    q = torch.zeros(1, 1, 64, 32, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    except RuntimeError:
        return False
    return True


def snapshot(root):
    """{relative path: sha1} of every file under root ({} if it does not exist)."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha1(fh.read()).hexdigest()
    return out


def error_of(main, argv, capsys):
    """Run a CLI main in-process, expect exit status 2, return its stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def tiny_qwen3_moe(N=4, k=2, H=16, layers=1):
    """A seeded random Qwen3-MoE causal LM (N experts, top-k, hidden H, `layers` MoE layers),
    weights N(0, 0.5): the small MoE the rolemerge tests merge."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=H, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=N, num_experts_per_tok=k, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[])
    m = Qwen3MoeForCausalLM(cfg).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return m


def attention_tol(q, k, v, scaling, prior=0.0):
    """`tol` for fp32 attention softmax(scaling q k^T + prior) v ([..., H, L, D], k / v with H or
    fewer heads) computed two ways: the scores' error (a length-D dot, scale scaling * max_ij
    sum_d |q_id k_jd| + max |prior|) moves the output by at most 2 max|v| per unit (the softmax's
    Jacobian against values in [-max|v|, max|v|]); the normalisation and the weighted sum over L keys
    add L + 2 steps of max|v|."""
    H, Hkv = q.shape[-3], k.shape[-3]
    ka = k.detach().abs().float().repeat_interleave(H // Hkv, -3)
    s = scaling * (q.detach().abs().float() @ ka.transpose(-1, -2)).max().item() + float(prior)
    vmax = v.detach().abs().max().item()
    return tol(torch.float32, q.shape[-1] + 2, s) * 2 * vmax + tol(torch.float32, k.shape[-2] + 2, vmax)


def expert_tol(experts, x):
    """`tol` for fp32 outputs [T, N, H] of fused MoE experts (transformers 5 layout: gate_up_proj
    [N, 2I, H], down_proj [N, H, I], act(gate) * up with |act(g)| <= |g| as for SiLU) on tokens
    x [T, H], computed two ways: depth H + I + 2 relative to the largest entry of the network of
    absolute values |down| (|gate| |x| * |up| |x|), which bounds every sum of |terms| on the way."""
    xa = x.detach().abs().float()
    gu = torch.einsum("th,nih->tni", xa, experts.gate_up_proj.detach().abs().float())
    g, u = gu.chunk(2, dim=-1)
    s = torch.einsum("tni,nhi->tnh", g * u, experts.down_proj.detach().abs().float())
    return tol(torch.float32, x.shape[-1] + g.shape[-1] + 2, s.max())


def router_tol(x, weight):
    """`tol` for fp32 router logits x [T, H] @ weight [N, H]^T: a length-H dot, scale the largest
    sum_h |x_h w_h|."""
    return tol(torch.float32, x.shape[-1], (x.detach().abs().float() @ weight.detach().abs().float().T).max())
