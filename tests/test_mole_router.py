"""MoLE router maths pinned to hand-computed values (Mixture of Latent Experts, section 3: router, top-K,
prior b = alpha * log(K * rho + eps), Z_vis attention with routed edges, prior and ESVA).

Each case is small enough to check on paper; the expected numbers are written out from
the formulas with Python floats, never from the code under test."""
import math
import random

import torch
import torch.nn.functional as F

from common import data
from common import shapes
from common.backbone import build_tiny
from mole.model import TEXT, VIS, ZVIS, MoLE, MoLEConfig, MoLEPass, topology_mask

from helpers import attention_tol, logits_tol, tol

ALPHA, EPS = 0.5, 1e-4  # alpha != 1 so that a prior without alpha differs


def _mole(**cfg):
    model, proc = build_tiny("qwen3_vl", seed=0, layers=1)
    return MoLE(model.eval(), proc, MoLEConfig(**cfg))


def _softmax(xs):
    m = max(xs)
    ex = [math.exp(x - m) for x in xs]
    return [x / sum(ex) for x in ex]


# router logits per token (E = 4); the router is made the identity on the first 4 dims of h
ROWS = [
    [5.0, -5.0, 0.0, 0.0],   # 0 TEXT: must get no selection and no prior
    [2.0, 1.0, 0.0, -1.0],   # 1 VIS: top-2 {0, 1}
    [-1.0, 0.5, 3.0, 0.0],   # 2 VIS: top-2 {2, 1} (bottom-2 would be {0, 3})
    [1.0, 1.0, 0.0, 0.0],    # 3 VIS: tie inside the top-2 -> rho = 1/2 each, b = alpha * log(1 + eps)
    [0.0, 0.0, 0.0, 0.0],    # 4 VIS: all tied -> exactly K kept, rho = 1/2
]
TYPES = [TEXT, VIS, VIS, VIS, VIS, ZVIS, ZVIS, ZVIS, ZVIS, TEXT]


def _route(K=2, alpha=ALPHA):
    mole = _mole(n_vis=4, n_sum=0, top_k=K, alpha=alpha, eps=EPS, esva=False)
    r = mole.routers[0]
    with torch.no_grad():
        r.weight.zero_()
        r.weight[:, :4] = torch.eye(4)
    L = len(TYPES)
    h = torch.zeros(1, L, r.weight.shape[1])
    for j, row in enumerate(ROWS):
        h[0, j, :4] = torch.tensor(row)
    types = torch.tensor([TYPES])
    st = MoLEPass(mole, types, torch.arange(5, 9)[None])
    mole.route(0, h, st)
    sel, prior = st.route[0]
    return sel[0], prior[0]


def _b(rho, K=2, alpha=ALPHA):
    return alpha * math.log(K * rho + EPS)


def _prior_tol(b):
    """The fp32 prior against its float64 value b: a softmax over <= 4 logits, K rho + eps, the log
    (its absolute error is its argument's relative error) and the product with alpha: 8 steps of
    1 + |b|."""
    return tol(torch.float32, 8, 1 + abs(b))


@torch.no_grad()
def test_route_selects_top_k_and_prior_uses_renormalised_rho():
    sel, prior = _route()
    # row 1: kept {0, 1}; rho = softmax([2, 1]) = [0.731059, 0.268941] (renormalised over the K kept,
    # not softmax over all four: that would be [0.643914, 0.236883])
    r0, r1 = 1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1))
    assert abs(r0 - 0.731059) <= 0.5e-6  # the literal is rounded to 6 decimals
    want = {1: {0: _b(r0), 1: _b(r1)},
            2: {2: _b(1 / (1 + math.exp(-2.5))), 1: _b(math.exp(-2.5) / (1 + math.exp(-2.5)))},
            3: {0: _b(0.5), 1: _b(0.5)}}
    # the number written out once; 1.462217 is 2 r0 + eps rounded to 6 decimals, log moves that by / 1.46
    assert abs(want[1][0] - 0.5 * math.log(1.462217)) <= 0.5 * 0.5e-6 / 1.46
    for j, experts in want.items():
        assert sel[j].tolist() == [e in experts for e in range(4)], j
        for e in range(4):
            assert abs(prior[j, e].item() - experts.get(e, 0.0)) <= _prior_tol(experts.get(e, 0.0)), (j, e)
    # all four tied: exactly K kept, each with rho = 1/2 -> b = alpha * log(1 + eps) ~ 5e-5
    assert sel[4].sum().item() == 2
    torch.testing.assert_close(prior[4][sel[4]], torch.full((2,), _b(0.5)), rtol=0, atol=_prior_tol(_b(0.5)))
    assert (prior[4][~sel[4]] == 0).all()
    # non-visual tokens: nothing selected, no prior
    for j in (0, 5, 6, 7, 8, 9):
        assert not sel[j].any() and (prior[j] == 0).all(), j


@torch.no_grad()
def test_route_prior_scales_with_alpha_and_k():
    _, p1 = _route(alpha=1.0)
    _, p05 = _route(alpha=0.5)
    torch.testing.assert_close(p05, 0.5 * p1, rtol=0, atol=_prior_tol(p1.abs().max().item()))
    # 0.7310586 is rounded to 7 decimals: 2 * 0.5e-7 / 1.46 more in the log
    want = math.log(2 * 0.7310586 + EPS)
    assert abs(p1[1, 0].item() - want) <= _prior_tol(want) + 1e-7 / 1.46
    # K = 1: rho = 1 for the kept expert, b = alpha * log(1 + eps); K = 3 on row 1: kept {0, 1, 2}
    sel1, pk1 = _route(K=1)
    assert sel1[1].tolist() == [True, False, False, False] and sel1[2].tolist() == [False, False, True, False]
    assert abs(pk1[1, 0].item() - _b(1.0, K=1)) <= _prior_tol(_b(1.0, K=1))
    sel3, pk3 = _route(K=3)
    rho = _softmax([2.0, 1.0, 0.0])
    assert sel3[1].tolist() == [True, True, True, False]
    for e in range(3):
        assert abs(pk3[1, e].item() - _b(rho[e], K=3)) <= _prior_tol(_b(rho[e], K=3))


def _hand_latent_attention(q, k, v, allowed, prior, scaling, esva=None):
    """Loop reference: q [H,L,D], k/v [Hkv,L,D], allowed [E,L] bool, prior [E,L] (0 off routed
    edges), esva = (gamma [E], mlp(e, u) -> [d_v]) or None. Returns [H,E,D] as nested floats."""
    H, L, D = q.shape
    Hkv = k.shape[0]
    E = allowed.shape[0]
    out = torch.zeros(H, E, D, dtype=torch.float64)
    u = v.permute(1, 0, 2).reshape(L, Hkv * D).double()
    for h in range(H):
        kv = h // (H // Hkv)
        for e in range(E):
            zq = ZPOS[e]
            cols = [j for j in range(L) if allowed[e, j]]
            s = [float(q[h, zq] @ k[kv, j]) * scaling + float(prior[e, j]) for j in cols]
            p = _softmax(s)
            for pj, j in zip(p, cols):
                val = v[kv, j].double()
                if esva is not None and TYPES_A[j] == VIS:
                    gamma, mlp = esva
                    val = val + float(gamma[e]) * mlp(e, u[j]).view(Hkv, D)[kv]
                out[h, e] += pj * val
    return out


# sequence of the attention case: text, 3 visual tokens, E = 2 Z_vis, text
TYPES_A = [TEXT, VIS, VIS, VIS, ZVIS, ZVIS, TEXT]
ZPOS = [4, 5]


def _attention_case(esva):
    mole = _mole(n_vis=2, n_sum=0, top_k=1, alpha=ALPHA, esva=esva)
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, L, D = 1, 4, 2, len(TYPES_A), 32  # the tiny model's heads: ESVA width = Hkv * D
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, Hkv, Hkv))
    types = torch.tensor([TYPES_A])
    st = MoLEPass(mole, types, torch.tensor([ZPOS]))
    sel = torch.zeros(1, L, 2, dtype=torch.bool)
    sel[0, 1, 0] = sel[0, 2, 1] = sel[0, 3, 0] = True  # token 1 -> e0, token 2 -> e1, token 3 -> e0
    prior = torch.zeros(1, L, 2)
    prior[0, 1, 0], prior[0, 2, 1], prior[0, 3, 0] = 2.0, -1.5, -3.0  # large: dropping it moves the output
    st.route[0] = (sel, prior)
    mask = topology_mask(types, 1, mole.cfg)
    return mole, st, q, k, v, mask, sel, prior


@torch.no_grad()
def test_latent_attention_hand_values_with_prior():
    mole, st, q, k, v, mask, sel, prior = _attention_case(esva=False)
    scaling = 0.25
    out = mole.latent_attention(0, q, k, v, mask, scaling, st)[0]  # [H,E,D]
    # Z_vis e sees: the prompt text (col 0), itself, and its routed visual tokens only
    allowed = torch.zeros(2, len(TYPES_A), dtype=torch.bool)
    allowed[0, [0, 1, 3, 4]] = True
    allowed[1, [0, 2, 5]] = True
    ref = _hand_latent_attention(q[0], k[0], v[0], allowed, prior[0].T, scaling)
    bound = attention_tol(q, k, v, scaling, prior.abs().max())
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=bound)
    # the prior matters in this case (else the test above could not see it dropped)
    no_prior = _hand_latent_attention(q[0], k[0], v[0], allowed, torch.zeros(2, len(TYPES_A)), scaling)
    assert (no_prior - ref).abs().max() > 100 * bound


@torch.no_grad()
def test_latent_attention_hand_values_with_esva():
    mole, st, q, k, v, mask, sel, prior = _attention_case(esva=True)
    esva = mole.esva[0]
    esva.gamma.copy_(torch.tensor([0.7, -1.3]))

    def mlp(e, u):  # MLP_e(u) = W2_e gelu(W1_e u + b1_e) + b2_e, written out
        return F.gelu(u.float() @ esva.w1[e] + esva.b1[e]) @ esva.w2[e] + esva.b2[e]

    out = mole.latent_attention(0, q, k, v, mask, 0.5, st)[0]
    allowed = torch.zeros(2, len(TYPES_A), dtype=torch.bool)
    allowed[0, [0, 1, 3, 4]] = True
    allowed[1, [0, 2, 5]] = True
    ref = _hand_latent_attention(q[0], k[0], v[0], allowed, prior[0].T, 0.5, esva=(esva.gamma, mlp))
    # values v + gamma_e MLP_e(u): bound the MLP's sum of |terms| by the network of absolute values
    # (|gelu(x)| <= |x|), its rounding by its depth (d_v + hidden + 2), then the attention's
    u = v[0].permute(1, 0, 2).reshape(len(TYPES_A), -1).abs()
    w1, b1, w2, b2 = (t.detach().abs() for t in (esva.w1, esva.b1, esva.w2, esva.b2))
    mlp_abs = max(((u @ w1[e] + b1[e]) @ w2[e] + b2[e]).max().item() for e in range(2))
    g = esva.gamma.abs().max().item()
    v_eff = v.abs().max() + g * mlp_abs
    bound = (attention_tol(q, k, v_eff.expand(v.shape), 0.5, prior.abs().max())
             + tol(torch.float32, w1.shape[1] + w1.shape[2] + 2, g * mlp_abs))
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=bound)


@torch.no_grad()
def test_route_feeds_latent_attention_in_a_forward():
    """In a real forward, the recorded Z_vis attention over visual tokens is zero exactly on
    the unrouted (token, expert) pairs of the layer's own routing, and alpha changes it."""
    rng = random.Random(0)
    ex = [shapes.sample_example(rng) for _ in range(2)]
    imgs, qs, ans = [shapes.render(s) for s, _, _, _ in ex], [q for _, _, q, _ in ex], ["yes", "no"]
    probs = {}
    for alpha in (0.0, 2.0):
        torch.manual_seed(0)
        mole = _mole(n_vis=4, n_sum=0, top_k=2, alpha=alpha, esva=False)
        out = mole(mole.encode(imgs, qs, ans), 1, record=True)
        st = out["pass"]
        sel, _ = st.route[0]
        p = st.attn[0]  # [B,H,E,L]
        vis = st.is_vis
        routed = sel.transpose(1, 2)[:, None].expand_as(p)
        on_vis = vis[:, None, None].expand_as(p)
        assert (p[on_vis & ~routed] == 0).all() and (p[on_vis & routed] > 0).all()
        probs[alpha] = p
    assert (probs[0.0] - probs[2.0]).abs().max() > logits_tol(mole.model, p.shape[-1], probs[0.0])
