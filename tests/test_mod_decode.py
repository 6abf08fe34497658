"""MoD's cached decoding step (mod/model.py `MoDLinear._decode`, `RoutingWindow.step`): the ring of
the last W routing logits, the fused router + expert matmul and the cached fused weights give the
full forward's routing and outputs, long after the ring has wrapped, with left padding."""
import random

import pytest
import torch
import torch.nn as nn

from common import shapes
from common.backbone import build_tiny
from helpers import adapter_depth, logits_tol, mod_layer_tol, tol
from mod import model as mm
from mod.model import AdapterConfig, MoDLinear, RoutingContext, adapter_layers, attach


@pytest.fixture(scope="module")
def tiny():
    rng = random.Random(0)
    ex = [shapes.sample_example(rng) for _ in range(2)]
    images = [shapes.render(e[0]) for e in ex]
    questions = ["How many circles are there?", "Is there a red square to the left of a blue circle in the image?"]
    model, proc = build_tiny("qwen3_vl", hidden=64, layers=2)
    return model.eval(), proc, proc.encode(images, questions)


def randomise(model):
    torch.manual_seed(1)
    for _, m in adapter_layers(model):
        for n, p in m.named_parameters(recurse=False):
            with torch.no_grad():
                p.normal_(std=2.0 if n.startswith("router") else 0.5)


def count_calls(monkeypatch, cls, name):
    calls = []
    orig = getattr(cls, name)

    def wrapper(self, *a, **k):
        calls.append(1)
        return orig(self, *a, **k)
    monkeypatch.setattr(cls, name, wrapper)
    return calls


@pytest.mark.parametrize("kw", [dict(granularity="window", window=8), dict(granularity="region", window=8),
                                dict(method="moelora", granularity="window", window=8),
                                dict(granularity="window", window=8, shared_router=True, combine="product")])
def test_long_cached_decoding_equals_full_forward_after_the_ring_wraps(tiny, monkeypatch, kw):
    """44 greedy tokens with W = 8 (the ring wraps five times), row 0 left padded: the cached
    logits equal a full forward over the generated sequence. Catches a ring that keeps the
    wrong entries (e.g. W-1 of them), a window count off by one, region blocks not reset,
    pads entering the ring, a stale fused weight, a gate not renormalised."""
    import copy
    base, proc, batch = tiny
    model = copy.deepcopy(base)
    attach(model, AdapterConfig(**kw))
    randomise(model)
    model.eval()                                                     # attach adds layers in train mode
    assert (batch["attention_mask"][:, 0] == 0).any()
    calls = count_calls(monkeypatch, MoDLinear, "_decode")
    n = 44
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=proc.pad_token_id)
    assert len(calls) == (n - 1) * len(adapter_layers(model))        # every decoding step took the fast path
    gen, seq = torch.stack(out.logits, 1), out.sequences
    L = batch["input_ids"].shape[1]
    ones = torch.ones(seq.shape[0], n, dtype=torch.long)
    full = dict(batch, input_ids=seq, attention_mask=torch.cat([batch["attention_mask"], ones], 1),
                mm_token_type_ids=torch.cat([batch["mm_token_type_ids"], 0 * ones], 1))
    with torch.no_grad():
        want = model(**full).logits[:, L - 1:-1]
    assert (gen - want).abs().max() <= logits_tol(model, seq.shape[1], want, adapter_depth(model))


@pytest.mark.parametrize("granularity,want", [("window", [1.0, 1.5, 1.5, 3.0, 5.0]),
                                              ("region", [1.0, 1.5, 1.5, 4.0, 5.0])])
def test_decode_step_window_by_hand(granularity, want):
    """W = 2, one channel: real tokens 1, 2, a pad, 4, 6. Window: means 1, 1.5, (pad: window of
    the previous real token) 1.5, (2 + 4) / 2, (4 + 6) / 2. Region (blocks of 2 real tokens):
    1, 1.5, 1.5, 4 (a new block starts), (4 + 6) / 2. Catches a pad entering the ring or the count,
    a window of W + 1, a region not reset."""
    ctx = RoutingContext()
    win = mm.RoutingWindow(AdapterConfig(window=2, granularity=granularity), ctx)
    vals, real = [1.0, 2.0, 0.0, 4.0, 6.0], [True, True, False, True, True]
    got = []
    for i, (v, r) in enumerate(zip(vals, real)):
        ctx.mask, ctx.continuing = torch.tensor([[r]]), i > 0
        got.append(win(torch.tensor([[[v]]])).item())
        if i == 1:
            ptr = win.cache[0].data_ptr()
        if i > 0:                                                    # static ring: W slots + a dump slot, same storage
            assert win.cache[0].shape == (1, 3, 1) and win.cache[0].data_ptr() == ptr
    assert got == want  # small integers and their halves: exact in fp32


def test_decode_step_equals_full_path_per_layer_with_pads_and_batch():
    """A bare MoDLinear: prefill with left padding, then 30 one-token steps (some rows padded at
    some steps) against the full-path layer on the whole sequence, for each combine rule."""
    torch.manual_seed(0)
    for combine in ("sqrt_product", "product", "mean"):
        cfg = AdapterConfig(num_experts=6, r=3, window=5, combine=combine)
        ctx, ref_ctx = RoutingContext(), RoutingContext()
        layer = MoDLinear(nn.Linear(12, 10), cfg, ctx).eval()
        with torch.no_grad():
            for p in (layer.A, layer.B, layer.router_A, layer.router_B):
                p.normal_()
        ref = MoDLinear(nn.Linear(12, 10), cfg, ref_ctx).eval()
        ref.load_state_dict(layer.state_dict())
        B, L, S = 3, 4, 30
        x = torch.randn(B, L + S, 12)
        mask = torch.ones(B, L + S, dtype=torch.bool)
        mask[0, :3] = False                                     # left padding
        mask[1, L + 7] = mask[2, L + 20] = False                # pads during decoding (rows differ)
        with torch.no_grad():
            ref_ctx.mask = mask
            want = ref(x)
            ctx.mask, ctx.continuing = mask[:, :L], False
            got = [layer(x[:, :L])]
            for t in range(L, L + S):
                ctx.mask, ctx.continuing = mask[:, t:t + 1], True
                got.append(layer(x[:, t:t + 1]))
        got = torch.cat(got, 1)
        torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=mod_layer_tol(layer, x))


def test_fused_decode_weights_follow_parameter_updates():
    """The fused [routers; A] weight is cached between steps; an in-place update (an optimizer
    step, load_state_dict) must be seen by the next step. Catches a cache without a version key."""
    torch.manual_seed(0)
    ctx = RoutingContext()
    layer = MoDLinear(nn.Linear(8, 8), AdapterConfig(num_experts=4, r=2, window=1, granularity="token"), ctx).eval()
    x = torch.randn(2, 1, 8)
    with torch.no_grad():
        layer.B.normal_()
        a = layer(x)
        layer.B.mul_(2.0)
        layer.A.add_(0.1)
        b = layer(x)
        layer.eval()
        ref = MoDLinear(nn.Linear(8, 8), layer.cfg, RoutingContext()).eval()
        ref.load_state_dict(layer.state_dict())
        torch.testing.assert_close(b, ref(torch.cat([x, x], 1))[:, :1], rtol=0, atol=mod_layer_tol(layer, x))
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("kw", [dict(), dict(shared_router=True), dict(method="moelora")])
def test_near_tied_router_rows_route_by_logits_alike_in_cached_and_full_decoding(kw):
    """eq. 3 is TopK of the logits. Router rows 1e-7 apart (0.02 + 1e-7 * a permutation of 0..E-1,
    another permutation per input coordinate) and tokens 0.25 * one-hot: every logit is one product
    (0.005 + 2.5e-8 * rank), the same bits in the full and the cached path. Their fp32 softmax
    probabilities (~1/E, ulp 1.5e-8) tie at that distance; both paths must still pick the top-r by
    logit, in logit order (hand-computed from the permutations). Ranking the full path by
    probabilities picked tied experts by index instead and disagreed with the decoding step."""
    E, r, din, L, S = 8, 3, 8, 5, 19
    cfg = AdapterConfig(num_experts=E, r=r, window=1, granularity="token", **kw)
    g = torch.Generator().manual_seed(0)
    perms = torch.stack([torch.randperm(E, generator=g) for _ in range(din)], 1)   # [E, din]: rank of e at k
    ctx, ref_ctx = RoutingContext(), RoutingContext()
    layer = MoDLinear(nn.Linear(din, 6), cfg, ctx).eval()
    with torch.no_grad():
        for n, p in layer.named_parameters(recurse=False):
            p.copy_(0.02 + 1e-7 * perms.float() if n.startswith("router") else torch.randn(p.shape, generator=g))
    ref = MoDLinear(nn.Linear(din, 6), cfg, ref_ctx).eval()
    ref.load_state_dict(layer.state_dict())
    layer.name = ref.name = "layer"
    k = torch.arange(L + S) % din                                        # token t is one-hot at k[t]
    x = 0.25 * torch.nn.functional.one_hot(k, din).float()[None]      # logits 0.005 + 2.5e-8 * rank: exact
    want_idx = perms[:, k].T.argsort(-1, descending=True)[:, :r]         # [L+S, r]: eq. 3 by hand
    with torch.no_grad():
        ref_ctx.record = ctx.record = True
        want = ref(x)
        ctx.continuing = False
        got = [layer(x[:, :L])]
        for t in range(L, L + S):
            ctx.continuing = True
            got.append(layer(x[:, t:t + 1]))
    full_a, full_b = ref_ctx.trace[0][1][0], ref_ctx.trace[0][2][0]      # [L+S, r]
    cached_a = torch.cat([tr[1].reshape(-1, r) for tr in ctx.trace])
    cached_b = torch.cat([tr[2].reshape(-1, r) for tr in ctx.trace])
    assert torch.equal(full_a, want_idx) and torch.equal(full_b, want_idx)
    assert torch.equal(cached_a, want_idx) and torch.equal(cached_b, want_idx)
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=0, atol=mod_layer_tol(layer, x))


def test_topr_and_combined_gates_by_hand():
    """eq. 3-5 on one token: A logits (3, 1, 2, 0) keep experts 0, 2 with gates softmax(3, 2) =
    (e, 1) / (e + 1); B logits (0, 1, 5, 2) keep 2, 3 with softmax(5, 2) = (e^3, 1) / (e^3 + 1)."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 5.0, 2.0]])
    idx, g = mm.topr_gates(logits, 2)
    assert idx.tolist() == [[0, 2], [2, 3]]
    e = torch.e
    ga, gb = torch.tensor([e, 1.0]) / (e + 1), torch.tensor([e ** 3, 1.0]) / (e ** 3 + 1)
    torch.testing.assert_close(g, torch.stack([ga, gb]), rtol=0, atol=tol(torch.float32, 2, 1.0))
    want = {"sqrt_product": (ga * gb).sqrt(), "product": ga * gb, "mean": (ga + gb) / 2}
    for combine, w in want.items():
        torch.testing.assert_close(mm.combine_gates(g, combine), w, rtol=0, atol=tol(torch.float32, 4, 1.0))
        shared = ga.square() if combine == "product" else ga                # shared router: g_A = g_B
        torch.testing.assert_close(mm.combine_gates(g[:1], combine), shared, rtol=0, atol=tol(torch.float32, 4, 1.0))
