"""MoLE takes positions and attention from the model, whatever processor built the inputs.

Each family is built tiny and offline with its real transformers processor (`tiny_vlms`,
`test_mole_vlm.tiny_gemma3`). Outside the latent rows MoLE must be the untouched model: the
logits of every token before the first latent equal the plain model's on the processor's own
output (stage 2: no bottleneck there), which holds only if the positions (Qwen M-RoPE from
`get_rope_index`) and the attention (Gemma3's bidirectional image blocks) are the model's own.
Cached generation equals a full forward past a sliding window of 8 tokens."""
import pytest
import torch

import tiny_vlms as tv
from helpers import logits_tol
from mole.adapters import ChatVLMAdapter, check_served, model_positions, text_model
from mole.infer import generate
from mole.model import TEXT, VIS, ZSUM, ZVIS, MoLE, MoLEConfig, topology_mask
from test_mole_vlm import examples, tiny_gemma3

EPS = torch.finfo(torch.float32).eps


def tolerance(model, ref):
    """Float32 noise bound for logits of a `layers`-deep model: a few eps per layer, relative to the
    logits' scale (the paths differ only in summation order: SDPA over a [B,L] batch vs one row)."""
    layers = model.config.get_text_config().num_hidden_layers
    return 64 * EPS * (layers + 1) * max(1.0, float(ref.abs().max()))


def processor_inputs(proc, image, question):
    """The processor's own model inputs for one question about one image (chat template with the
    generation prompt)."""
    turn = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    text = proc.apply_chat_template([turn], add_generation_prompt=True, tokenize=False)
    return proc(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)


def mole_of(model, proc, **cfg):
    mole = MoLE(model, proc, MoLEConfig(**cfg))
    g = torch.Generator().manual_seed(1)
    for e in mole.esva or []:  # gamma starts at 0; make ESVA matter
        e.gamma.data = torch.randn(e.gamma.shape, generator=g)
    return mole


def two_questions(seed=3):
    imgs, qs, _ = examples(2, seed=seed)
    qs[1] += " Answer carefully please."  # different lengths: left padding in the batch
    return imgs, qs


@torch.no_grad()
def check_prefix_is_the_untouched_model(model, proc):
    """For two questions (batched, left-padded), MoLE's stage-2 logits at every token before the
    first latent equal the untouched model's on the processor's output for that question alone.
    Returns MoLE, its batch and output and the per-question (inputs, k = first latent index)."""
    imgs, qs = two_questions()
    refs = [processor_inputs(proc, im, q) for im, q in zip(imgs, qs)]
    ref_logits = [model(**r).logits[0] for r in refs]
    mole = mole_of(model, proc)
    assert isinstance(mole.adapter, ChatVLMAdapter)
    b = mole.encode(imgs, qs)
    res = mole(b, 2)
    T, ks = len(mole.tail_ids), []
    for i, (r, ref) in enumerate(zip(refs, ref_logits)):
        am = b["attention_mask"][i].bool()
        ids = b["input_ids"][i][am]
        k = int((ids >= mole.vocab).nonzero()[0])  # first latent
        assert k == r["input_ids"].shape[1] - T and torch.equal(ids[:k], r["input_ids"][0][:k])
        for key in ("token_type_ids", "mm_token_type_ids"):  # rebuilt from the ids as the processor builds them
            assert key not in r or torch.equal(b[key][i][am][:k], r[key][0][:k]), key
        err = float((res["logits"][i][am][:k] - ref[:k]).abs().max())
        assert err <= tolerance(model, ref), (i, err, tolerance(model, ref))
        ks.append(k)
    return mole, b, res, refs, ks


# ----------------------------------------------------------------------------- the mask over the base's

def test_topology_over_the_base_mask_hand_case():
    # text, a 2-token image block, text, Z_vis, Z_sum, tail, answer; the base slides over 3 tokens and
    # lets the image block attend bidirectionally (Gemma3's sliding layers)
    types = torch.tensor([[TEXT, VIS, VIS, TEXT, ZVIS, ZSUM, TEXT, TEXT]])
    base = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0, 0, 0],
                         [0, 1, 1, 1, 0, 0, 0, 0],
                         [0, 0, 1, 1, 1, 0, 0, 0],
                         [0, 0, 0, 1, 1, 1, 0, 0],
                         [0, 0, 0, 0, 1, 1, 1, 0],
                         [0, 0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)[None, None]
    stage2 = [[1, 0, 0, 0, 0, 0, 0, 0],
              [1, 1, 1, 0, 0, 0, 0, 0],  # the image block keeps its bidirectional attention
              [1, 1, 1, 0, 0, 0, 0, 0],
              [0, 1, 1, 1, 0, 0, 0, 0],  # text keeps the window
              [1, 0, 0, 1, 1, 0, 0, 0],  # Z_vis: whole prompt text (no window), itself; V only when routed
              [1, 1, 1, 1, 1, 1, 0, 0],  # Z_sum: causal over everything (no window)
              [0, 0, 0, 0, 1, 1, 1, 0],  # tail and answer: the base's window
              [0, 0, 0, 0, 0, 1, 1, 1]]
    stage1 = [r[:] for r in stage2]
    stage1[3] = [0, 0, 0, 1, 0, 0, 0, 0]  # the bottleneck: text and Z_sum rows never see V
    stage1[5] = [1, 0, 0, 1, 1, 1, 0, 0]
    for stage, want in ((2, stage2), (1, stage1)):
        got = topology_mask(types, stage, MoLEConfig(), base)[0, 0]
        assert got.long().tolist() == want, (stage, got.long().tolist())
    # no base: today's causal topology (the base of a plain causal LM)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    assert torch.equal(topology_mask(types, 2, MoLEConfig(), causal), topology_mask(types, 2, MoLEConfig()))


# ----------------------------------------------------------------------------- positions: Qwen2.5-VL

def test_qwen25_vl_positions_are_the_models_own_from_its_processor():
    # handed a transformers Qwen2.5-VL processor (not the repo's VLProcessor), MoLE still uses M-RoPE:
    # the prompt's positions are get_rope_index's on the processor's own inputs, the latents and the
    # assistant header continue as text (max + 1, + 2, ... on all three axes)
    model, proc = tv.qwen25_vl()
    mole, b, res, refs, ks = check_prefix_is_the_untouched_model(model, proc)
    pos = res["positions"]
    assert pos.shape == (3, *b["input_ids"].shape)
    for i, (r, k) in enumerate(zip(refs, ks)):
        own, _ = model.model.get_rope_index(r["input_ids"], r["mm_token_type_ids"], image_grid_thw=r["image_grid_thw"],
                                            attention_mask=r["attention_mask"])
        p = pos[:, i][:, b["attention_mask"][i].bool()]
        assert torch.equal(p[:, :k], own[:, 0, :k])
        n_rest = p.shape[1] - k
        assert torch.equal(p[:, k:], own[:, 0, :k].max() + 1 + torch.arange(n_rest).expand(3, n_rest))
        assert not torch.equal(p[0], p[1])  # M-RoPE: the image's height axis is not the token count


# ----------------------------------------------------------------------------- attention: Gemma3

@torch.no_grad()
def test_gemma3_logits_before_the_first_latent_are_the_untouched_models():
    # Gemma3's image tokens attend bidirectionally inside their block (token_type_ids): MoLE passes the
    # token types to the model, which builds that mask itself
    model, proc = tiny_gemma3(layers=2)
    mole, b, res, refs, ks = check_prefix_is_the_untouched_model(model, proc)
    assert torch.equal(b["token_type_ids"], (b["input_ids"] == model.config.image_token_id).long())
    # the check can fail: without token_type_ids the untouched model's image rows attend causally
    r = refs[0]
    causal = model(**{k: v for k, v in r.items() if k != "token_type_ids"}).logits[0]
    assert float((causal - model(**r).logits[0]).abs().max()) > 100 * tolerance(model, causal)


# ----------------------------------------------------------------------------- cached generation past a window

def window_matters(build):
    """The family with a sliding window of 8 gives other full-forward logits than with a window
    of 4096 (same weights): the sequences below are longer than the window."""
    (m8, proc), (m_wide, _) = build(8), build(4096)
    imgs, qs = two_questions(seed=5)
    r = processor_inputs(proc, imgs[0], qs[0])
    assert r["input_ids"].shape[1] > 3 * 8
    with torch.no_grad():
        a, b = m8(**r).logits, m_wide(**r).logits
    return (a - b).abs().max() > logits_tol(m8, r["input_ids"].shape[1], b)   # more than rounding


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
@pytest.mark.parametrize("stage", [1, 2])
@torch.no_grad()
def test_cached_generation_equals_full_forward_past_a_sliding_window(family, stage):
    build = {"gemma3": lambda w: tiny_gemma3(layers=2, sliding_window=w),
             "qwen2_5_vl": lambda w: tv.qwen25_vl(layers=2, sliding_window=w)}[family]
    assert window_matters(build)
    model, proc = build(8)
    assert [layer.self_attn.sliding_window for layer in text_model(model).layers] == [8, None]
    mole = mole_of(model, proc)
    imgs, qs = two_questions(seed=5)
    n = 6
    _, _, steps, full = generate(mole, imgs, qs, stage=stage, max_new_tokens=n, stop_at_eos=False, return_logits=True)
    prompt = mole.encode(imgs, qs)
    L = prompt["input_ids"].shape[1]
    assert steps.shape[1] == n and L > 3 * 8
    am = torch.cat([prompt["attention_mask"], torch.ones(2, n - 1, dtype=torch.long)], 1)
    logits = mole(dict(prompt, input_ids=full[:, :L + n - 1], attention_mask=am), stage)["logits"][:, L - 1:].float()
    assert (logits - steps).abs().max() <= tolerance(model, logits), (logits - steps).abs().max()


@torch.no_grad()
def test_latent_intervention_on_a_sliding_window_cache():
    # the sliding layers hold only the newest keys: the intervention maps latent columns into them
    model, proc = tiny_gemma3(layers=2, sliding_window=8)
    mole = mole_of(model, proc)
    imgs, qs = two_questions(seed=5)
    base = generate(mole, imgs, qs, max_new_tokens=3, stop_at_eos=False, return_logits=True)[2]
    for kind in ("random", "shuffle", "mask"):
        out = generate(mole, imgs, qs, max_new_tokens=3, stop_at_eos=False, return_logits=True, intervention=kind)[2]
        L = mole.encode(imgs, qs)["input_ids"].shape[1] + 3
        assert torch.isfinite(out).all() and (out - base).abs().max() > logits_tol(model, L, base), kind


# ----------------------------------------------------------------------------- more families

@pytest.mark.parametrize("build", [tv.idefics3, tv.smolvlm, tv.llava_next], ids=["idefics3", "smolvlm", "llava_next"])
@torch.no_grad()
def test_mole_runs_on_1d_position_families(build):
    # Idefics3 / SmolVLM: the decoder is model.model.text_model (not language_model), the vision
    # inputs include pixel_attention_mask; LLaVA-NeXT through its transformers processor (Vicuna
    # template, image_sizes); 1-D positions (no position function of their own)
    model, proc = build()
    mole, b, res, refs, ks = check_prefix_is_the_untouched_model(model, proc)
    assert len(mole.routers) == 2 and set(refs[0]) - {"input_ids", "attention_mask"} <= set(b)
    assert torch.equal(res["positions"], model_positions(model, b["input_ids"], b["attention_mask"], b))
    assert res["positions"].dim() == 2
    imgs, qs = two_questions()
    _, _, steps, full = generate(mole, imgs, qs, stage=1, max_new_tokens=3, stop_at_eos=False, return_logits=True)
    prompt = mole.encode(imgs, qs)
    L, n = prompt["input_ids"].shape[1], steps.shape[1]
    am = torch.cat([prompt["attention_mask"], torch.ones(2, n - 1, dtype=torch.long)], 1)
    logits = mole(dict(prompt, input_ids=full[:, :L + n - 1], attention_mask=am), 1)["logits"][:, L - 1:].float()
    assert (logits - steps).abs().max() <= tolerance(model, logits)


def test_mole_refuses_llama4_by_name():
    model = tv.llama4()
    assert text_model(model) is model.language_model.model  # the decoder is found ...
    with pytest.raises(ValueError, match="Llama4ForConditionalGeneration: MoLE cannot serve this family"):
        MoLE(model, None)  # ... but transformers' forward of this family fails on every call
    with pytest.raises(ValueError, match="cannot serve"):
        check_served(model)
    with pytest.raises(AttributeError, match="image_outputs"):  # the reason, still true of the pinned version
        model(input_ids=torch.tensor([[1, 2] + [299] * 4 + [3]]), pixel_values=torch.randn(1, 3, 28, 28))


def test_text_model_refuses_an_unknown_layout_by_name():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tower = torch.nn.Module()
            self.tower.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # a vision tower's layers

    with pytest.raises(ValueError, match="Odd: no decoder stack found"):
        text_model(Odd())
