"""common/routing.py against hand-computed values."""
import math

import pytest
import torch

from common.routing import load_balance_loss, region_mean, switch_rate, topk_gates, window_mean, z_loss
from helpers import tol


def test_topk_gates_renormalise():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    probs, idx, gates = topk_gates(logits, 2)
    exact = tol(torch.float32, 8, 1.0)   # fp32 logs, a softmax of 4, a renormalisation over 2
    torch.testing.assert_close(probs, torch.tensor([[0.1, 0.4, 0.2, 0.3]]), rtol=0, atol=exact)
    assert idx.tolist() == [[1, 3]]
    torch.testing.assert_close(gates, torch.tensor([[0.4 / 0.7, 0.3 / 0.7]]), rtol=0, atol=exact)
    assert probs.dtype == torch.float32 and gates.dtype == torch.float32
    with pytest.raises(ValueError):
        topk_gates(logits, 5)


def test_topk_gates_fp32_and_noise_only_in_training():
    logits = torch.randn(3, 5, dtype=torch.bfloat16)
    p1, i1, _ = topk_gates(logits, 2, noise_std=10.0, training=False)
    p2, i2, _ = topk_gates(logits, 2)
    assert p1.dtype == torch.float32 and torch.equal(i1, i2)


def test_load_balance_uniform_equals_k():
    E, k = 4, 2
    probs = torch.full((4, E), 1 / E)
    idx = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])  # every expert chosen by half the tokens
    assert load_balance_loss(probs, idx).item() == pytest.approx(k)


def test_load_balance_collapsed_and_mask():
    # every token sends all mass to expert 0 and picks it: E * 1 * 1 = E (top-1)
    probs = torch.tensor([[1.0, 0, 0, 0]] * 3 + [[0, 0, 0, 1.0]])
    idx = torch.tensor([[0]] * 3 + [[3]])
    assert load_balance_loss(probs, idx).item() == pytest.approx(4 * (0.75 * 0.75 + 0.25 * 0.25))
    mask = torch.tensor([True, True, True, False])  # the odd token is padding
    assert load_balance_loss(probs, idx, mask).item() == pytest.approx(4.0)


def test_z_loss():
    logits = torch.zeros(2, 4)  # logsumexp = log 4
    assert z_loss(logits).item() == pytest.approx(math.log(4) ** 2)
    logits = torch.tensor([[0.0, 0.0], [100.0, 100.0]])
    assert z_loss(logits, torch.tensor([True, False])).item() == pytest.approx(math.log(2) ** 2)


def test_window_mean_hand_values():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]).reshape(1, 5, 1)
    got = window_mean(x, 2).flatten().tolist()
    assert got == pytest.approx([1.0, 1.5, 2.5, 3.5, 4.5])
    got = window_mean(x, 3).flatten().tolist()
    assert got == pytest.approx([1.0, 1.5, 2.0, 3.0, 4.0])
    assert torch.equal(window_mean(x, 1), x)


def test_window_mean_left_padding_equals_unpadded():
    x = torch.tensor([9.0, 9.0, 1.0, 2.0, 3.0, 4.0]).reshape(1, 6, 1)  # two pads in front
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    got = window_mean(x, 2, mask).flatten()[2:].tolist()
    assert got == pytest.approx([1.0, 1.5, 2.5, 3.5])
    # a pad in the middle is skipped: window counts real tokens
    x = torch.tensor([1.0, 100.0, 3.0, 5.0]).reshape(1, 4, 1)
    got = window_mean(x, 2, torch.tensor([[1, 0, 1, 1]])).flatten().tolist()
    assert got[0] == 1.0 and got[2:] == pytest.approx([2.0, 4.0])


def test_region_mean_hand_values():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]).reshape(1, 5, 1)
    got = region_mean(x, 2).flatten().tolist()
    assert got == pytest.approx([1.0, 1.5, 3.0, 3.5, 5.0])  # resets at tokens 0, 2, 4
    mask = torch.tensor([[0, 1, 1, 1, 1]])  # one pad: blocks counted in real tokens
    got = region_mean(x, 2, mask).flatten()[1:].tolist()
    assert got == pytest.approx([2.0, 2.5, 4.0, 4.5])
    # offset: a chunk that comes after 2 real tokens gets numbers 2, 3, 4 -> blocks [2,3], [4]
    chunk = torch.tensor([3.0, 4.0, 5.0]).reshape(1, 3, 1)
    got = region_mean(chunk, 2, offset=torch.tensor([2])).flatten().tolist()
    assert got == pytest.approx([3.0, 3.5, 5.0])


@pytest.mark.parametrize("fn", [window_mean, region_mean])
def test_window_and_region_means_stay_accurate_over_a_long_context(fn):
    """x_route after 8,192 tokens of router logits of size ~100 (offset 100, spread 1) against a
    float64 reference: the error is that of one fp32 mean of W values, W eps max|x|, whatever the
    position. Prefix sums in fp32 erred by ~t eps |x| / W (measured 1.5e-2 for the window, 5.9e-2
    for the region mean; the W-token ring of cached decoding has no such error), so cached and
    full routing parted at near-ties."""
    torch.manual_seed(0)
    T, W = 8192, 4
    x = 100.0 + torch.randn(1, T, 8)
    got = fn(x, W)
    x64 = x.double()
    if fn is window_mean:
        want = torch.stack([x64[:, max(0, t - W + 1):t + 1].mean(1) for t in range(T - 64, T)], 1)
    else:
        want = torch.stack([x64[:, t - t % W:t + 1].mean(1) for t in range(T - 64, T)], 1)
    err = (got[:, -64:].double() - want).abs().max().item()
    assert err <= tol(torch.float32, W + 1, x.abs().max()), err


def test_switch_rate():
    top1 = torch.tensor([[0, 0, 1, 1, 2], [3, 3, 3, 3, 3]])
    assert switch_rate(top1) == pytest.approx(2 / 8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert switch_rate(top1, mask) == pytest.approx(2 / 4)
    assert switch_rate(top1[:, :1]) == 0.0
