"""Hand-computed cases for MoLE's equations in mole/model.py (attention topology, ESVA, the routed
latent attention, the diversity loss, latent init), written for the mutation pass
(`python -m eval.tools.mutation --target mole/model.py --equations`; see eval/logs/mutation.md).
Every expected number is worked out in the comment above it."""
import math

import pytest
import torch

from mole.model import (PAD, TEXT, VIS, ZSUM, ZVIS, MoLEConfig, column_mask, diversity_loss, embedding_output_scale,
                        esva_delta, init_latents, latent_scores, topology_mask)

LN2, LN3 = math.log(2.0), math.log(3.0)
# positions 0..6: text, visual, Z_vis 1, Z_vis 2, Z_sum, text, pad
TYPES = torch.tensor([[TEXT, VIS, ZVIS, ZVIS, ZSUM, TEXT, PAD]])


def rows(mask):
    return [[int(v) for v in r] for r in mask[0, 0].tolist()]


def test_topology_mask_stage2_router_topological():
    # causal over non-pad columns; Z_vis rows lose the visual column (routed edges come later) and
    # the other Z_vis; the trailing pad row sees the earlier columns and itself
    assert rows(topology_mask(TYPES, 2, MoLEConfig())) == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1]]
    # a leading pad row has no non-pad column: it sees only itself (no all-masked row, no NaN)
    assert rows(topology_mask(torch.tensor([[PAD, TEXT]]), 2, MoLEConfig())) == [[1, 0], [0, 1]]


def test_topology_mask_stage1_bottleneck_and_plain_latents():
    # stage 1: text and Z_sum rows lose the visual column (rows 4 and 5)
    m = rows(topology_mask(TYPES, 1, MoLEConfig()))
    assert m[4] == [1, 0, 1, 1, 1, 0, 0] and m[5] == [1, 0, 1, 1, 1, 1, 0] and m[1] == [1, 1, 0, 0, 0, 0, 0]
    # no router, causal mixing: Z_vis rows are plain causal rows
    m = rows(topology_mask(TYPES, 2, MoLEConfig(router=False, latent_mixing="causal")))
    assert m[2] == [1, 1, 1, 0, 0, 0, 0] and m[3] == [1, 1, 1, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="stage must be 1 or 2, got 3"):
        topology_mask(TYPES, 3, MoLEConfig())


def test_topology_mask_keeps_the_base_mask_outside_latent_rows():
    # a bidirectional base mask: text, visual and pad rows take it (minus the stage-1 bottleneck);
    # the latent rows keep MoLE's causal topology
    base = torch.ones(1, 1, 7, 7, dtype=torch.bool)
    m = rows(topology_mask(TYPES, 2, MoLEConfig(), base))
    assert m[0] == m[1] == m[5] == m[6] == [1] * 7
    assert m[2] == [1, 0, 1, 0, 0, 0, 0] and m[3] == [1, 0, 0, 1, 0, 0, 0] and m[4] == [1, 1, 1, 1, 1, 0, 0]
    m = rows(topology_mask(TYPES, 1, MoLEConfig(), base))
    assert m[0] == m[5] == [1, 0, 1, 1, 1, 1, 1] and m[1] == [1] * 7


def test_column_mask():
    types = torch.tensor([[TEXT, VIS, ZVIS, ZSUM, PAD]])
    assert column_mask(types, 2).tolist() == [[True, True, True, True, False]]
    assert column_mask(types, 1).tolist() == [[True, False, True, True, False]]


def test_esva_delta_hand_computed():
    # d_v = 1, hidden 1, E = 2, u = 1. Expert 0: gelu(2 * 1 + 0) = 1 + erf(sqrt 2) = 1.954500,
    # times 3 plus .5 = 6.363500. Expert 1: gelu(-1 + 1) = 0, times 1 plus 0 = 0.
    u = torch.tensor([[[1.0]]])
    w1, b1 = torch.tensor([[[2.0]], [[-1.0]]]), torch.tensor([[0.0], [1.0]])
    w2, b2 = torch.tensor([[[3.0]], [[1.0]]]), torch.tensor([[0.5], [0.0]])
    out = esva_delta(u, w1, b1, w2, b2)
    assert out.shape == (1, 1, 2, 1)
    assert out[0, 0, :, 0].tolist() == pytest.approx([3 * (1 + math.erf(math.sqrt(2))) + 0.5, 0.0], abs=1e-5)
    assert esva_delta(u.bfloat16(), w1, b1, w2, b2).dtype == torch.bfloat16   # in u's dtype


def test_esva_delta_two_wide_hand_computed():
    # d_v = 2, hidden 2, one expert, identity weights, zero biases: gelu(u) per entry;
    # u = [1, -1]: gelu(1) = .5 (1 + erf(1 / sqrt 2)) = .841345, gelu(-1) = -.158655
    u = torch.tensor([[[1.0, -1.0]]])
    eye = torch.eye(2)[None]
    out = esva_delta(u, eye, torch.zeros(1, 2), eye, torch.zeros(1, 2))
    g = lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2)))
    assert out[0, 0, 0].tolist() == pytest.approx([g(1.0), g(-1.0)], abs=1e-6)
    # w2 swaps the two hidden units: [gelu(-1), gelu(1)]
    out = esva_delta(u, eye, torch.zeros(1, 2), torch.tensor([[[0.0, 1.0], [1.0, 0.0]]]), torch.zeros(1, 2))
    assert out[0, 0, 0].tolist() == pytest.approx([g(-1.0), g(1.0)], abs=1e-6)


def test_latent_scores_hand_computed():
    # B = Hkv = G = 1, E = 2 Z_vis queries, L = 2 tokens, D = 1; keys [ln 2, 0], values [1, 4], scaling 2.
    # Expert 0 (q = 1): logits [2 ln 2, 0] -> p = [4/5, 1/5], output .8 + .8 = 1.6.
    # Expert 1 (q = 0): logits 0 plus the prior of token 0 for expert 1, ln 3 -> [ln 3, 0] -> p = [3/4, 1/4],
    # output .75 + 1 = 1.75.
    qz = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2, 1)
    key = torch.tensor([LN2, 0.0]).view(1, 1, 2, 1)
    value = torch.tensor([1.0, 4.0]).view(1, 1, 2, 1)
    allowed = torch.ones(1, 2, 2, dtype=torch.bool)
    prior = torch.tensor([[[0.0, LN3], [0.0, 0.0]]])          # [B, L, E]: token 0 -> expert 1
    p, out = latent_scores(qz, key, value, allowed, prior, 2.0)
    assert p.dtype == out.dtype == torch.float32 and p.shape == (1, 1, 1, 2, 2)
    assert p[0, 0, 0].tolist() == [pytest.approx([0.8, 0.2]), pytest.approx([0.75, 0.25])]
    assert out[0, 0, 0, :, 0].tolist() == pytest.approx([1.6, 1.75])
    # expert 0 may not see token 0: p = [0, 1], output 4; no prior: expert 1 uniform, output 2.5
    allowed[0, 0, 0] = False
    p, out = latent_scores(qz, key, value, allowed, None, 2.0)
    assert p[0, 0, 0].tolist() == [[0.0, 1.0], [0.5, 0.5]]
    assert out[0, 0, 0, :, 0].tolist() == pytest.approx([4.0, 2.5])


def test_diversity_loss_hand_computed():
    # token 0 (visual) selects experts 0, 1, 2 with deltas [1, 0], [1, 1], [0, 1]: squared cosines
    # (0,1) .5, (0,2) 0, (1,2) .5; token 1 (visual) selects 0 and 1 with [1, 0], [2, 0]: 1;
    # token 2 is not visual (its pair is ignored). Mean over 4 pairs: (.5 + 0 + .5 + 1) / 4 = .5
    delta = torch.tensor([[[[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]],
                           [[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]],
                           [[1.0, 0.0], [3.0, 0.0], [0.0, 1.0]]]])
    sel = torch.tensor([[[True, True, True], [True, True, False], [True, True, False]]])
    is_vis = torch.tensor([[True, True, False]])
    assert diversity_loss(delta, sel, is_vis).item() == pytest.approx(0.5)
    # a data-parallel reduce whose other process has no pair: global pairs 4 / 2 = 2 -> 2.0 / 2 = 1.0
    assert diversity_loss(delta, sel, is_vis, reduce=lambda t: t.float() / 2).item() == pytest.approx(1.0)
    # one pair (token 1 alone is visual) and the other process has none: 1 / (1 / 2) = 2.0
    assert diversity_loss(delta, sel, torch.tensor([[False, True, False]]),
                          reduce=lambda t: t.float() / 2).item() == pytest.approx(2.0)
    # L = 2 tokens, E = 3 experts (the pair mask is over the expert axis): the first two tokens, (.5 + 0 + .5 + 1) / 4
    assert diversity_loss(delta[:, :2], sel[:, :2], is_vis[:, :2]).item() == pytest.approx(0.5)
    # K = 1: no pair, loss 0 (not 0 / 0)
    one = torch.tensor([[[True, False, False]] * 3])
    assert diversity_loss(delta, one, is_vis).item() == 0.0


class _RowScaled(torch.nn.Embedding):
    """An embedding module whose output row i is (i + 1) times its weight row."""

    def forward(self, ids):
        return super().forward(ids) * (ids[:, None] + 1).float()


def test_embedding_output_scale_over_every_chunk():
    # 5 rows of norm 1, output row i scaled by i + 1: (1 + 2 + 3 + 4 + 5) / 5 = 3, also in chunks of 2
    table = _RowScaled(5, 2)
    with torch.no_grad():
        table.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [-1.0, 0.0], [0.0, -1.0]]))
    assert embedding_output_scale(table) == pytest.approx(3.0)
    assert embedding_output_scale(table, chunk=2) == pytest.approx(3.0)
    plain = torch.nn.Embedding(5, 2)
    assert embedding_output_scale(plain, chunk=2) == 1.0
    with torch.no_grad():
        plain.weight.zero_()
    assert embedding_output_scale(plain) == 1.0   # zero weights: no scale to measure


def test_init_latents_hand_computed():
    # rows mean [2, 3] and std (of all entries) s; latents = mean + s * N(0, 1) from the generator,
    # times the module's output scale (3 for the row-scaled table)
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    s = w.std()
    noise = torch.randn(3, 2, generator=torch.Generator().manual_seed(7))
    plain = torch.nn.Embedding(2, 2)
    with torch.no_grad():
        plain.weight.copy_(w)
    lat = init_latents(plain, 3, torch.Generator().manual_seed(7))
    assert torch.equal(lat, torch.tensor([2.0, 3.0]) + s * noise)
    scaled = _RowScaled(2, 2)
    with torch.no_grad():
        scaled.weight.copy_(w)
    # output scale: (|w0| + 2 |w1|) / (|w0| + |w1|) with |w0| = sqrt 5, |w1| = 5
    k = (math.sqrt(5) + 2 * 5) / (math.sqrt(5) + 5)
    lat = init_latents(scaled, 3, torch.Generator().manual_seed(7))
    assert torch.allclose(lat, (torch.tensor([2.0, 3.0]) + s * noise) * k)


def test_masks_and_losses_on_the_inputs_device():
    # the masks and the pair mask are made on the inputs' device (meta here; CUDA in a GPU run)
    assert topology_mask(TYPES.to("meta"), 2, MoLEConfig()).device.type == "meta"
    delta = torch.zeros(1, 2, 3, 2, device="meta")
    sel = torch.ones(1, 2, 3, dtype=torch.bool, device="meta")
    assert diversity_loss(delta, sel, torch.ones(1, 2, dtype=torch.bool, device="meta")).device.type == "meta"


class _Doubled(torch.nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2


def test_init_latents_times_an_output_scale_of_two():
    # a module that doubles every row: scale exactly 2, latents = 2 (mean + s * noise)
    table = _Doubled(2, 2)
    with torch.no_grad():
        table.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert embedding_output_scale(table) == 2.0
    noise = torch.randn(3, 2, generator=torch.Generator().manual_seed(7))
    lat = init_latents(table, 3, torch.Generator().manual_seed(7))
    assert torch.allclose(lat, 2 * (torch.tensor([2.0, 3.0]) + table.weight.detach().std() * noise))
