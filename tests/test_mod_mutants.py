"""Hand-computed cases for MoD's routing equations in mod/model.py (eq. 3-5 and the cached decoding
plan of eq. 1), written for the mutants the other MoD tests let through
(`python -m eval.tools.mutation --target mod/model.py --equations`; see eval/logs/mutation.md).
Every expected number is worked out in the comment above it."""
import math

import pytest
import torch

from mod.model import _decode_plan, combine_gates, topr_gates

LN2, LN3 = math.log(2.0), math.log(3.0)


def test_topr_gates_hand_computed():
    # logits [B=1, P=2, E=3]: pool A = [0, ln3, ln2] -> top-2 experts 1, 2; gates = softmax(ln3, ln2)
    # = [3, 2] / 5. Pool B = [ln2, 0, ln3] -> experts 2, 0, gates [3, 2] / 5. The expert axis is last.
    logits = torch.tensor([[[0.0, LN3, LN2], [LN2, 0.0, LN3]]])
    idx, g = topr_gates(logits, 2)
    assert idx.tolist() == [[[1, 2], [2, 0]]]
    assert torch.allclose(g, torch.tensor([[[0.6, 0.4], [0.6, 0.4]]]))
    # r = 1: the top expert alone with gate 1; r = E: every expert, gates = the full softmax
    idx, g = topr_gates(logits, 1)
    assert idx[..., 0].tolist() == [[1, 2]] and torch.equal(g, torch.ones(1, 2, 1))
    _, g = topr_gates(logits, 3)
    assert torch.allclose(g[0, 0], torch.tensor([3 / 6, 2 / 6, 1 / 6]))


def test_combine_gates_hand_computed():
    # g [B=2, P=2, r=2]; row 0: g_A = [.6, .4], g_B = [.5, .5]:
    #   sqrt_product = sqrt([.3, .2]) = [.547723, .447214], product = [.3, .2], mean = [.55, .45]
    # row 1: g_A = [.9, .1], g_B = [.2, .8]: sqrt([.18, .08]) = [.424264, .282843], product [.18, .08],
    #   mean [.55, .45]
    g = torch.tensor([[[0.6, 0.4], [0.5, 0.5]], [[0.9, 0.1], [0.2, 0.8]]])
    assert torch.allclose(combine_gates(g, "sqrt_product"),
                          torch.tensor([[math.sqrt(0.3), math.sqrt(0.2)], [math.sqrt(0.18), math.sqrt(0.08)]]))
    assert torch.allclose(combine_gates(g, "product"), torch.tensor([[0.3, 0.2], [0.18, 0.08]]))
    assert torch.allclose(combine_gates(g, "mean"), torch.tensor([[0.55, 0.45], [0.55, 0.45]]))
    # one pool (shared router): g_A = g_B = [.6, .4]: sqrt_product and mean give g itself, product g^2
    g1 = torch.tensor([[[0.6, 0.4]]])
    assert torch.allclose(combine_gates(g1, "sqrt_product"), torch.tensor([[0.6, 0.4]]))
    assert torch.allclose(combine_gates(g1, "mean"), torch.tensor([[0.6, 0.4]]))
    assert torch.allclose(combine_gates(g1, "product"), torch.tensor([[0.36, 0.16]]))


def test_combine_gates_zero_product_has_a_finite_gradient_only_with_autograd():
    # g_A = [1, 0], g_B = [0, 1]: both products are 0. With autograd on, sqrt's input is clamped at
    # 1e-30: value 1e-15 and a finite gradient; without autograd the value is exactly 0.
    g = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    out = combine_gates(g, "sqrt_product")
    assert torch.allclose(out, torch.full((2,), 1e-15), rtol=1e-3, atol=0)
    out.sum().backward()
    assert torch.isfinite(g.grad).all()
    with torch.no_grad():
        assert combine_gates(g, "sqrt_product").tolist() == [0.0, 0.0]


def _plan(n_seen, last_real, W, granularity, C=2):
    mask = None if last_real is None else torch.tensor([[True, r] for r in last_real])
    sidx, wv, n_after = _decode_plan(torch.tensor(n_seen), mask, W, granularity, C)
    assert sidx.shape == (len(n_seen), 1, C) and wv.shape == (len(n_seen), 1, W + 1) and wv.dtype == torch.float32
    assert torch.equal(sidx[..., 0], sidx[..., C - 1])   # the same slot for every channel
    return sidx[:, 0, 0].tolist(), wv[:, 0], n_after.tolist()


def test_decode_plan_window_hand_computed():
    # W = 3. A real token with n_seen earlier real tokens is number n_seen: slot n_seen % 3; it is
    # averaged with the n - 1 before it, n = min(n_seen + 1, 3), slot s holds token last - (last - s) % 3.
    # n_seen 0: n 1, slot 0 alone -> [1, 0, 0 | 0]; n_seen 2: n 3, all three -> 1/3 each, slot 2;
    # n_seen 5: n 3 -> 1/3 each, slot 5 % 3 = 2. The dump slot W never gets weight.
    t = 1 / 3
    slots, wv, n_after = _plan([0, 2, 5], None, 3, "window")
    assert slots == [0, 2, 2] and n_after == [1, 3, 6]
    assert torch.allclose(wv, torch.tensor([[1.0, 0, 0, 0], [t, t, t, 0], [t, t, t, 0]]))
    # the same with a mask whose last column is real: the same plan
    assert _plan([0, 2, 5], [True] * 3, 3, "window")[0] == [0, 2, 2]
    # pads: written to the dump slot 3, count unchanged; averaged like the previous real token:
    # n_seen 0: nothing before -> zeros; n_seen 2: tokens 0, 1 (slots 0, 1) -> 1/2 each;
    # n_seen 5: tokens 2, 3, 4 -> 1/3 each
    slots, wv, n_after = _plan([0, 2, 5], [False] * 3, 3, "window")
    assert slots == [3, 3, 3] and n_after == [0, 2, 5]
    assert torch.allclose(wv, torch.tensor([[0.0, 0, 0, 0], [0.5, 0.5, 0, 0], [t, t, t, 0]]))


def test_decode_plan_region_hand_computed():
    # W = 3, blocks of token numbers {0 1 2}, {3 4 5}. Real token number n_seen is averaged with the
    # earlier ones of its block: n = n_seen % 3 + 1.
    # n_seen 0: n 1 -> slot 0; 2: n 3 -> slots 0 1 2; 4: n 2 -> tokens 3, 4 in slots 0, 1; 3: n 1 -> slot 0
    t = 1 / 3
    slots, wv, n_after = _plan([0, 2, 4, 3], None, 3, "region")
    assert slots == [0, 2, 1, 0] and n_after == [1, 3, 5, 4]
    assert torch.allclose(wv, torch.tensor([[1.0, 0, 0, 0], [t, t, t, 0], [0.5, 0.5, 0, 0], [1.0, 0, 0, 0]]))
    # pads take the block of the previous real token (number n_seen - 1), n = (n_seen - 1) % 3 + 1:
    # n_seen 0: none -> zeros; 2: token 1, n 2 -> slots 0 1; 4: token 3, n 1 -> slot 0; 3: token 2, n 3 -> all;
    # 1: token 0, n 1 -> slot 0
    slots, wv, n_after = _plan([0, 2, 4, 3, 1], [False] * 5, 3, "region")
    assert slots == [3, 3, 3, 3, 3] and n_after == [0, 2, 4, 3, 1]
    assert torch.allclose(wv, torch.tensor([[0.0, 0, 0, 0], [0.5, 0.5, 0, 0], [1.0, 0, 0, 0], [t, t, t, 0],
                                            [1.0, 0, 0, 0]]))


@pytest.mark.parametrize("granularity", ["window", "region"])
def test_decode_plan_on_the_inputs_device(granularity):
    # every tensor the plan makes follows n_seen's device (meta here; CUDA in a GPU run)
    n_seen = torch.tensor([0, 2], device="meta")
    for mask in (torch.ones(2, 1, dtype=torch.bool), None):   # a CPU mask is moved; no mask: all real
        sidx, wv, n_after = _decode_plan(n_seen, mask, 3, granularity, 2)
        assert sidx.device.type == wv.device.type == n_after.device.type == "meta"
