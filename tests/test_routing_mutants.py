"""Hand-computed cases that kill the mutants of common/routing.py the equation tests let through
(`python -m eval.tools.mutation --target common/routing.py`; survivors and the equivalent ones are
listed in eval/logs/mutation.md). Every expected number is worked out in the comment above it."""
import math

import pytest
import torch

from common import routing
from common.routing import load_balance_loss, rank_mean, region_mean, switch_rate, topk_gates, window_mean, z_loss

LN2, LN3 = math.log(2.0), math.log(3.0)


def test_topk_gates_3d_logits_hand_computed():
    # logits [1, 2, 3]: row 0 = [0, ln2, ln3] -> probs [1, 2, 3] / 6, top-2 idx [2, 1], gates [3, 2] / 5;
    # row 1 = [0, 0, 0] -> probs 1/3 each, gates 1/2 each. The expert axis is the last one
    # (a softmax, top-k or gate sum over axis 1 would mix the two tokens; E is 3, not 2).
    logits = torch.tensor([[[0.0, LN2, LN3], [0.0, 0.0, 0.0]]])
    probs, idx, gates = topk_gates(logits, 2)
    assert torch.allclose(probs, torch.tensor([[[1 / 6, 2 / 6, 3 / 6], [1 / 3, 1 / 3, 1 / 3]]]))
    assert idx[0, 0].tolist() == [2, 1]
    assert torch.allclose(gates, torch.tensor([[[0.6, 0.4], [0.5, 0.5]]]))
    # k = 3 = E is allowed and keeps every expert
    assert torch.allclose(topk_gates(logits, 3)[2].sum(-1), torch.ones(1, 2))


def test_topk_gates_k_bounds():
    logits = torch.zeros(2, 3)
    assert topk_gates(logits, 1)[1].shape == (2, 1)  # k = 1 allowed
    assert topk_gates(logits, 3)[1].shape == (2, 3)  # k = E allowed
    with pytest.raises(ValueError, match=r"k=0, E=3"):
        topk_gates(logits, 0)
    with pytest.raises(ValueError, match=r"k=4, E=3"):
        topk_gates(logits, 4)


def test_topk_gates_noise_only_when_training_and_asked():
    logits = torch.tensor([[0.0, LN2, LN3]])
    clean = topk_gates(logits, 2)
    # defaults: no noise (noise_std 0), not training; either flag alone adds nothing
    for kw in ({"training": True}, {"noise_std": 1.0}):
        torch.manual_seed(0)
        out = topk_gates(logits, 2, **kw)
        assert all(torch.equal(a, b) for a, b in zip(out, clean))
    # noise_std 0 while training draws no random numbers (the global RNG stream is untouched)
    torch.manual_seed(0)
    topk_gates(logits, 2, noise_std=0.0, training=True)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(1))
    # noise_std .5 while training: logits + .5 * randn_like(logits) under the same seed
    torch.manual_seed(1)
    noisy = logits + 0.5 * torch.randn_like(logits)
    torch.manual_seed(1)
    probs, _, _ = topk_gates(logits, 2, noise_std=0.5, training=True)
    assert torch.allclose(probs, noisy.softmax(-1))
    assert not torch.allclose(probs, clean[0])


def test_load_balance_loss_3d_hand_computed():
    # probs [B=1, T=2, E=3], k = 1, top-1 experts 0 and 1: hits [1, 1, 0], f = [.5, .5, 0],
    # P = mean probs = [.3, .45, .25]; loss = E * sum f P = 3 * (.15 + .225) = 1.125
    probs = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]])
    idx = torch.tensor([[[0], [1]]])
    assert load_balance_loss(probs, idx).item() == pytest.approx(1.125)
    # both tokens on expert 1: hits [0, 2, 0], f = [0, 1, 0]; loss = 3 * .45 = 1.35 (the [B, T, k]
    # index is flattened to [B T, k], one row per token, not [B, T k])
    assert load_balance_loss(probs, torch.tensor([[[1], [1]]])).item() == pytest.approx(1.35)


def test_aux_losses_all_padding_are_zero():
    probs = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    idx = torch.tensor([[0], [1]])
    none = torch.zeros(2, dtype=torch.bool)
    # no real token: the sums are 0 and the count is taken as 1 (0 / 0 would be nan)
    assert load_balance_loss(probs, idx, none).item() == 0.0
    assert z_loss(torch.zeros(2, 2), none).item() == 0.0


def half(t):
    """rank_mean of a two-process run whose other process has no real token: (t + 0) / 2."""
    return t.float() / 2


def test_load_balance_loss_reduce_hand_computed():
    # two tokens on this rank, both top-1 expert 0, the other rank empty (reduce = half):
    # global count 2/2 = 1, global hits [2, 0]/2 = [1, 0], f = [1, 0], P = [.75 + .5, .25 + .5] / 1;
    # loss = 2 * (1 * 1.25) = 2.5  (without the reduce it would be 2 * (1 * .625) = 1.25)
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    idx = torch.tensor([[0], [0]])
    assert load_balance_loss(probs, idx, reduce=half).item() == pytest.approx(2.5)
    # one real token (mask): global count 1/2 = .5 (below 1, kept), hits [.5, 0], f = [1, 0],
    # P = [.75, .25] / .5 = [1.5, .5]; loss = 2 * 1.5 = 3.0
    mask = torch.tensor([True, False])
    assert load_balance_loss(probs, idx, mask, reduce=half).item() == pytest.approx(3.0)


def test_z_loss_reduce_and_axis_hand_computed():
    # one real token with logits [0, 0]: lse = ln 2; global count 1/2 -> z = ln2^2 / .5 = 2 ln2^2
    logits = torch.zeros(2, 2)
    mask = torch.tensor([True, False])
    assert z_loss(logits, mask, reduce=half).item() == pytest.approx(2 * LN2 ** 2)
    # logits [1, 2, 3]: lse over the expert axis = ln 3 and ln 2 + ln 3 = ln 6; z = (ln3^2 + ln6^2) / 2
    logits = torch.tensor([[[0.0, 0.0, 0.0], [LN2, LN2, LN2]]])
    assert z_loss(logits).item() == pytest.approx((LN3 ** 2 + math.log(6.0) ** 2) / 2)


def test_rank_mean_divides_the_sum_by_the_world_size(monkeypatch):
    # a two-process all-reduce whose other process holds [3, 5]: ([1, 3] + [3, 5]) / 2 = [2, 4]
    def all_reduce(t):
        t.add_(torch.tensor([3.0, 5.0]))

    monkeypatch.setattr(routing.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(routing.dist, "get_world_size", lambda: 2)
    t = torch.tensor([1.0, 3.0], requires_grad=True)
    out = rank_mean(t)
    assert out.tolist() == [2.0, 4.0] and not out.requires_grad
    assert t.tolist() == [1.0, 3.0]  # the input is not reduced in place


def test_outputs_stay_on_the_inputs_device():
    # every tensor a function makes follows its input's device; a mask or offset given on another
    # device is moved there (here: inputs on "meta", masks on CPU; on CUDA the same holds)
    x = torch.zeros(2, 3, 4, device="meta")
    cpu_mask = torch.ones(2, 3, dtype=torch.bool)
    assert window_mean(x, 2).device.type == "meta"
    assert window_mean(x, 2, cpu_mask).device.type == "meta"
    assert region_mean(x, 2, cpu_mask, offset=1).device.type == "meta"
    probs = torch.zeros(6, 4, device="meta")
    idx = torch.zeros(6, 2, dtype=torch.long, device="meta")
    assert load_balance_loss(probs, idx).device.type == "meta"
    assert load_balance_loss(probs, idx, torch.ones(6, dtype=torch.bool)).device.type == "meta"
    assert z_loss(probs).device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_and_region_means_return_the_inputs_dtype(dtype):
    # sums run in float64; the result is cast back to x's dtype
    x = torch.tensor([[[1.0], [2.0], [3.0]]], dtype=dtype)
    assert window_mean(x, 2).dtype == dtype
    assert region_mean(x, 2).dtype == dtype


def test_region_mean_w1_and_messages():
    x = torch.tensor([[[1.0], [2.0], [3.0]]])
    assert torch.equal(region_mean(x, 1), x)  # W = 1: every token is its own block
    with pytest.raises(ValueError, match="region size W must be >= 1, got 0"):
        region_mean(x, 0)
    with pytest.raises(ValueError, match="window size W must be >= 1, got 0"):
        window_mean(x, 0)


def test_region_mean_per_row_offsets_hand_computed():
    # W = 2, both rows x = [1, 2, 3]. Row 0, offset 0: numbers 0 1 | 2 -> means 1, 1.5, 3.
    # Row 1, offset 1: numbers 1 | 2 3; number 1's block began before x (only itself is in x) -> 1,
    # then 2, then mean(2, 3) = 2.5.
    x = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])[..., None]
    out = region_mean(x, 2, offset=torch.tensor([0, 1]))
    assert out[..., 0].tolist() == [[1.0, 1.5, 3.0], [1.0, 2.0, 2.5]]
    assert region_mean(x[1:], 2, offset=1)[0, :, 0].tolist() == [1.0, 2.0, 2.5]


def test_switch_rate_counts_pairs_of_two_real_tokens():
    # pairs (0,1) real-real differ; (1,2) and (2,3) touch a pad -> 1 pair, 1 switch = 1.0
    top1 = torch.tensor([[0, 1, 1, 0]])
    assert switch_rate(top1, torch.tensor([[1, 1, 0, 1]])) == 1.0
    # a leading pad: only the pair (1,2) is real-real and it switches -> 1.0
    assert switch_rate(torch.tensor([[0, 0, 1]]), torch.tensor([[0, 1, 1]])) == 1.0
