"""The pure helpers of eval.tools.bench_reap_llmcompressor (no llmcompressor needed)."""
import math

import torch

from eval.tools import bench_reap_llmcompressor as bench
from helpers import expert_tol, router_tol, tol
from rolemerge import baselines as bl


def test_compare_counts_identical_sets_jaccard_differences_and_cut_gap():
    a = {"l0": {"kept": [0, 1], "saliency": [3., 2, 1, 0], "count": [1, 2, 3, 4]},
         "l1": {"kept": [0, 2], "saliency": [5., 1, 4, .5], "count": [0, 0, 0, 0]}}
    b = {"l0": {"kept": [1, 0], "saliency": [3., 2, 1, 0], "count": [1, 2, 3, 4]},      # same set, other order
         "l1": {"kept": [0, 1], "saliency": [5., 4.5, 4, .5], "count": [0, 1, 0, 0]}}
    c = bench.compare(a, b)
    assert c["identical"] == .5
    assert math.isclose(c["jaccard"], (1 + 1 / 3) / 2)                # l1: {0,2} vs {0,1}
    assert c["max_abs_dS"] == 3.5 and math.isclose(c["max_rel_dS"], 3.5 / 4.5)
    assert c["max_abs_dcount"] == 1
    assert c["min_cut_gap"] == 1.0                                    # l0: 2 - 1; l1: 4 - 1
    assert bench.cut_gap([1., 2], 2) == math.inf


def test_prune_layer_equals_a_router_that_cannot_pick_the_dropped_experts():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=16, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[])
    block = Qwen3MoeForCausalLM(cfg).model.layers[0].mlp.eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=.5)
    x = torch.randn(9, 16)
    keep = [1, 3, 4, 5]
    with torch.no_grad():
        logits = x @ block.gate.weight.T
        logits[:, [0, 2]] = -math.inf                                 # experts 0 and 2 removed
        prob = logits.softmax(-1)
        w, idx = prob.topk(2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        y = bl.expert_outputs(block.experts, x)                       # [T, N, H] of the unpruned experts
        ref = (y.gather(1, idx[..., None].expand(-1, -1, 16)) * w[..., None]).sum(1)
        bench.prune_layer(block, keep)
        assert block.gate.weight.shape[0] == 4 and block.experts.num_experts == 4
        # both sides' expert rounding, the renormalised gates (4 x the logits' error) on |y|, the sum of 2
        ymax = ref.abs().max().item()
        bound = (2 * expert_tol(block.experts, x) + 4 * router_tol(x, block.gate.weight) * ymax
                 + tol(torch.float32, 3, ymax))
        torch.testing.assert_close(block(x[None])[0], ref, rtol=0, atol=bound)
