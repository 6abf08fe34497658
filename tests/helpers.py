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
