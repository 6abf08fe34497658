"""RoleMerge's comparison criteria (rolemerge/baselines.py), the planted-structure mechanism test,
oracle routing and the API checks of plan(), against hand-computed values."""
import json
import math
import os

import pytest
import torch

from helpers import expert_tol, router_tol, tiny_qwen3_moe, tol
from rolemerge import baselines as bl
from rolemerge import model as rm
from rolemerge import blocks as blk
from rolemerge import planning
from rolemerge import merging
from rolemerge.blocks import MergeError
from rolemerge.planning import MergeConfig


# ----------------------------------------------------------------------------- M-SMoE

def test_msmoe_dominant_by_frequency_join_by_router_logit_cosine():
    # router-logit columns over T = 3 tokens: e0 = (1,0,0), e1 = (1,2,0), e2 = (0,1,0), e3 = (3,1,1)
    Z = torch.tensor([[1., 1, 0, 3], [0, 2, 1, 1], [0, 0, 0, 1]], dtype=torch.float64)   # [T, N]
    count = torch.tensor([10., 1, 5, 2])                    # dominant (K = 2): e0, e2
    # cos(e1, e0) = 1/sqrt5 = .447 < cos(e1, e2) = 2/sqrt5 = .894 -> e1 joins e2
    # cos(e3, e0) = 3/sqrt11 = .905 > cos(e3, e2) = 1/sqrt11 -> e3 joins e0
    assert bl.msmoe_groups(count, Z.T @ Z, 2) == [[0, 3], [1, 2]]
    # frequency decides the dominant set: make e1, e3 the most frequent -> e0 joins e3, e2 joins e1
    assert bl.msmoe_groups(torch.tensor([1., 10, 2, 5]), Z.T @ Z, 2) == [[0, 3], [1, 2]]
    assert bl.msmoe_groups(torch.tensor([1., 10, 5, 2]), Z.T @ Z, 3) == [[0, 3], [1], [2]]
    with pytest.raises(ValueError, match="K=5"):
        bl.msmoe_groups(count, Z.T @ Z, 5)


# ----------------------------------------------------------------------------- HC-SMoE

def _at(deg, r=1.0):
    return [r * math.cos(math.radians(deg)), r * math.sin(math.radians(deg))]


def test_hcsmoe_cosine_variant_average_linkage_on_mean_outputs():
    # directions 0, 20, 45, 75, 90 degrees; norms differ (cosine ignores them, Euclidean would not)
    X = torch.tensor([_at(0), _at(20, 3), _at(45, 9), _at(75, 0.2), _at(90)], dtype=torch.float64)
    # merges: (75, 90) at 1 - cos15; (0, 20) at 1 - cos20; then 45 -> {0, 20}: average
    # (1-cos45 + 1-cos25)/2 = .193 < to {75, 90}: (1-cos30 + 1-cos45)/2 = .213
    assert bl.hcsmoe_groups(X, 2, distance="cosine") == [[0, 1, 2], [3, 4]]
    assert bl.hcsmoe_groups(X, 3, distance="cosine") == [[0, 1], [2], [3, 4]]
    assert bl.hcsmoe_groups(X, 4, distance="cosine") == [[0], [1], [2], [3, 4]]
    assert bl.hcsmoe_groups(X, 2) == [[0, 1, 3, 4], [2]]      # the official Euclidean: 45 deg sits at radius 9
    # average vs complete linkage differ here: 45 sits 25 deg from 20 and 45 from 0 (complete 1-cos45),
    # 30 deg from 75 and 45 from 90 (complete 1-cos45) -> tie -> lower member list {0,1,2}
    assert bl.hcsmoe_groups(X, 2, "complete", "cosine") == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="unknown linkage"):
        bl.hcsmoe_groups(X, 2, "ward")


def test_hcsmoe_average_linkage_is_size_weighted():
    # angles 0, 10, 20, 34, 100: (0,10) and (10,20) tie at 10 deg -> lower members: {0,1} first.
    # Then average linkage: {0,1}-20 = (d20 + d10)/2 = .0378 > 20-34 = d14 = .0297 -> (2,3) merge;
    # single linkage: {0,1}-20 = d10 = .0152 < d14 -> {0,1,2}
    X = torch.tensor([_at(0), _at(10), _at(20), _at(34), _at(100)], dtype=torch.float64)
    d = lambda a, b: 1 - math.cos(math.radians(b - a))
    assert d(14, 0) < (d(20, 0) + d(10, 0)) / 2 and d(10, 0) < d(14, 0)
    assert bl.hcsmoe_groups(X, 3, distance="cosine") == [[0, 1], [2, 3], [4]]
    assert bl.hcsmoe_groups(X, 3, "single", "cosine") == [[0, 1, 2], [3], [4]]


# ----------------------------------------------------------------------------- REAP

def test_reap_saliency_is_mean_gated_norm_over_routed_tokens():
    count = torch.tensor([2., 1, 0, 4])
    reap_sum = torch.tensor([2., 3, 0, 4])                 # S = (1, 3, 0, 1)
    s = bl.reap_saliency(reap_sum, count)
    assert torch.equal(s, torch.tensor([1., 3, 0, 1], dtype=torch.float64))
    assert bl.reap_groups(s, 2) == [[0], [1]]              # 3 first, then the tie 1 = 1 -> lower index
    # frequency pruning keeps the most used instead: e3 (4) and e0 (2)
    assert rm.prune_groups(count, 2) == [[0], [3]]


def test_collect_features_matches_a_brute_force_pass():
    from rolemerge import calibrate as cal
    model = tiny_qwen3_moe()
    block = blk.moe_blocks(model)[0][1]
    seen = {}
    h = block.experts.register_forward_hook(lambda m, a, o: seen.update(x=a[0].detach(), idx=a[1], w=a[2], out=o))
    ids = torch.tensor([[1, 5, 7, 9, 2], [3, 4, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    feats = bl.collect_features(model, [{"input_ids": ids, "attention_mask": mask}])[0]
    h.remove()
    keep = mask.reshape(-1).bool()
    x, idx, w, out = seen["x"][keep], seen["idx"][keep], seen["w"][keep], seen["out"][keep]
    y = bl.expert_outputs(block.experts, x)                               # [T, N, H]
    # the model's own MoE output is the gated sum of our per-expert outputs (weights summing to 1):
    # both sides' expert rounding, then the sum of k = 2
    e_tol = expert_tol(block.experts, x)
    torch.testing.assert_close((y.gather(1, idx[..., None].expand(-1, -1, y.shape[-1])) * w[..., None]).sum(1), out,
                               rtol=0, atol=2 * e_tol + tol(torch.float32, 3, y.abs().max()))
    T, N = x.shape[0], 4
    assert feats["tokens"] == T == 7
    count = torch.zeros(N)
    reap = torch.zeros(N, dtype=torch.float64)
    for t in range(T):
        for j in range(2):
            e = int(idx[t, j])
            count[e] += 1
            reap[e] += float(w[t, j]) * float(y[t, e].detach().norm())
    assert torch.equal(feats["count"], count.double())
    # sums over T tokens of gate (<= 1) * ||y||: a norm moves by at most sqrt(H) x the entries' error
    H, ynorm = y.shape[-1], y.detach().norm(dim=-1).max().item()
    bound = T * (2 * H ** 0.5 * e_tol + tol(torch.float32, H + T + 4, ynorm))
    torch.testing.assert_close(feats["reap_sum"], reap, rtol=0, atol=bound)
    z = x.double() @ block.gate.weight.double().T
    # fp32 logits (router_tol each) in a T-term gram of entries <= max|z|^2
    zmax = z.abs().max().item()
    bound = 2 * T * zmax * router_tol(x, block.gate.weight) + tol(torch.float64, T, T * zmax ** 2)
    torch.testing.assert_close(feats["logit_gram"], z.T @ z, rtol=0, atol=bound)
    bound = T * 2 * e_tol + tol(torch.float32, T, T * y.abs().max())
    torch.testing.assert_close(feats["out_sum"], y.double().sum(0), rtol=0, atol=bound)


def test_reap_equals_the_published_definition_over_batches():
    """REAP as its authors define it (arXiv 2510.13999 eq. 5; their observer's defaults for a
    norm_topk_prob model): gate = full-softmax router probability renormalised over the token's
    top-k, saliency = per-batch mean over routed non-padding tokens of gate * ||f_j(x)||_2, batches
    combined weighted by the expert's routed-token count. Ours (sum / count over all batches) must
    give the same saliency and keep the same experts."""
    from rolemerge import calibrate as cal
    model = tiny_qwen3_moe(N=6, k=2)
    block = blk.moe_blocks(model)[0][1]
    batches = [{"input_ids": torch.tensor([[1, 5, 7, 9, 2], [3, 4, 0, 0, 0]]),
                "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])},
               {"input_ids": torch.tensor([[8, 8, 6, 11, 30, 2, 17]]), "attention_mask": torch.ones(1, 7, dtype=torch.long)}]
    xs = []
    h = block.experts.register_forward_hook(lambda m, a, o: xs.append(a[0].detach()))
    feats = bl.collect_features(model, batches)[0]
    h.remove()
    means, freqs = [], []
    for x, b in zip(xs, batches):
        x = x[b["attention_mask"].reshape(-1).bool()]
        logits = x.double() @ block.gate.weight.double().T
        prob = logits.softmax(-1)
        top = prob.topk(2, dim=-1).indices
        gate = prob / prob.gather(1, top).sum(-1, keepdim=True)
        y = bl.expert_outputs(block.experts, x).double().norm(dim=-1)    # [T, N]
        active = torch.zeros_like(prob, dtype=torch.bool).scatter_(1, top, True)
        f = active.sum(0).double()
        means.append(torch.where(f > 0, (gate * y * active).sum(0) / f.clamp_min(1), torch.zeros_like(f)))
        freqs.append(f)
    F = torch.stack(freqs).sum(0)
    ref = torch.where(F > 0, (torch.stack(means) * torch.stack(freqs)).sum(0) / F.clamp_min(1), torch.zeros_like(F))
    ours = bl.reap_saliency(feats["reap_sum"], feats["count"])
    assert torch.equal(feats["count"], F)
    # means of gate * ||y||: ||y|| moves by sqrt(H) x the experts' error, the gate (softmax renormalised
    # over the top k) by 4 x the fp32 router logits' error; then the sums over tokens
    x = torch.cat(xs)
    H, ynorm = x.shape[-1], bl.expert_outputs(block.experts, x).norm(dim=-1).max().item()
    bound = (2 * H ** 0.5 * expert_tol(block.experts, x) + 4 * router_tol(x, block.gate.weight) * ynorm
             + tol(torch.float32, x.shape[0] + 4, ynorm))
    torch.testing.assert_close(ours, ref, rtol=0, atol=bound)
    for K in (2, 3, 4):
        assert bl.reap_groups(ours, K) == [[e] for e in sorted(ref.topk(K).indices.tolist())]


# ----------------------------------------------------------------------------- planted structure

def planted_layer(seed=0):
    """8 experts: 0-3 'image-role' (I), 4-7 'answer-role' (A); expert j and j+4 form a pair with
    equal pooled frequency, pairs at four different frequency levels; 31x more image than answer
    tokens (image 3100, question 400, answer 100 routed positions). Small seeded jitter so that
    same-role experts are not exactly identical."""
    g = torch.Generator().manual_seed(seed)
    level = torch.tensor([1.3, 1.1, 0.9, 0.7])              # pair frequency levels
    img_I = 400 * level                                      # I experts: image only
    ans_A = torch.full((4,), 25.0)                           # A experts: all the answer tokens
    img_A = img_I - ans_A                                    # equal pooled count within each pair
    image = torch.cat([img_I, img_A])
    image = image * 3100 / image.sum()
    question = torch.full((8,), 50.0)
    answer = torch.cat([torch.zeros(4), ans_A])
    c = torch.stack([image, question, answer]) * (1 + 0.02 * torch.rand(3, 8, generator=g))
    return c.double()


def role_pure(groups):
    return all(len({e // 4 for e in grp}) == 1 for grp in groups)


@pytest.mark.parametrize("K", [4, 5, 6])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planted_phase_aware_grouping_is_role_consistent_frequency_only_is_not(K, seed):
    c = planted_layer(seed)
    pooled = c.sum(0)
    ratio = float(c[0].sum() / c[2].sum())
    assert 20 <= ratio <= 50
    pair_gap = (pooled[:4] - pooled[4:]).abs() / pooled[:4]
    assert float(pair_gap.max()) < 0.05                     # partners: (almost) equal overall frequency
    groups, _ = rm.plan(c[None], K, "rolemerge")
    assert role_pure(groups[0]), groups
    # frequency-only grouping: the same greedy agglomeration, but the dissimilarity sees only the
    # pooled frequency (|P(i) - P(j)|, max-normalised): it pairs the equal-frequency partners
    P = pooled / pooled.sum()
    d = rm.normalise_by_max((P[:, None] - P[None, :]).abs())
    freq_groups = rm.agglomerate(d, rm.phase_distributions(c)[2], K, lam=0.0)
    assert not role_pure(freq_groups), freq_groups
    assert any(sorted(grp) == [j, j + 4] for grp in freq_groups for j in range(4))
    # the empirical (token-weighted) aggregation RoleMerge argues against: pooled counts hide the
    # answer role; the no_phase_split control mixes roles as well
    groups_np, _ = rm.plan(c[None], K, "no_phase_split")
    assert not role_pure(groups_np[0]), groups_np


# ----------------------------------------------------------------------------- plan() API checks

def test_plan_rejects_unknown_linkage_for_every_method():
    c = planted_layer()[None]
    for method in rm.METHODS:
        with pytest.raises(ValueError, match="unknown linkage 'ward'"):
            rm.plan(c, 4, method, linkage="ward", routers=[torch.eye(8)])


@pytest.mark.parametrize("K", [[4], (4, 5), 4.0, "4", True, None])
def test_plan_rejects_a_per_layer_or_non_int_K(K):
    with pytest.raises(ValueError, match="K must be one int for every layer"):
        rm.plan(planted_layer()[None], K, "rolemerge")


def test_plan_refuses_the_feature_methods():
    """model.plan groups from counts only; the feature methods go through baselines.plan_groups
    (make_plan refuses them without features)."""
    for method in rm.FEATURE_METHODS:
        with pytest.raises(ValueError, match="groups from calibration features, not counts"):
            rm.plan(planted_layer()[None], 4, method)
    stats = {"sources": {"s": {"counts": planted_layer()[None].long(), "tokens": torch.ones(3)}}, "num_experts": 8}
    with pytest.raises(MergeError, match="needs the calibration features"):
        planning.make_plan(stats, 4, MergeConfig(method="reap"))


def test_merge_api_rejects_per_layer_K_unknown_linkage_and_missing_features(tmp_path):
    from rolemerge import merge as mg
    with pytest.raises(mg.MergeError, match="one int for every layer"):
        planning.check_rho_k(k=[4, 5])
    for method in ("prune", "frequency", "rolemerge"):
        with pytest.raises(mg.MergeError, match="unknown linkage 'ward'"):
            mg.run_merge(MergeConfig(model="tiny-moe", stats="unused.safetensors", out=str(tmp_path / "o"), rho=0.5, method=method, linkage="ward"))
    with pytest.raises(mg.MergeError, match="needs calibration features"):
        mg.run_merge(MergeConfig(model="tiny-moe", stats="unused.safetensors", out=str(tmp_path / "o"), rho=0.5, method="hcsmoe"))
    assert not (tmp_path / "o").exists()


def test_plan_dispatches_to_the_feature_baselines():
    Z = torch.tensor([[1., 1, 0, 3], [0, 2, 1, 1], [0, 0, 0, 1]], dtype=torch.float64)
    feats = [{"count": torch.tensor([10., 1, 5, 2]), "logit_gram": Z.T @ Z, "tokens": 3,
              "out_sum": torch.eye(4, dtype=torch.float64), "reap_sum": torch.tensor([2., 3, 0, 4])}]
    counts = torch.ones(1, 3, 4)
    assert bl.plan_groups("msmoe", feats, 2)[0] == [[0, 3], [1, 2]]
    assert bl.plan_groups("reap", feats, 2)[0] == [[1], [3]]      # S = (.2, 3, 0, 2)
    assert len(bl.plan_groups("hcsmoe", feats, 2)[0]) == 2
    stats = {"sources": {"s": {"counts": counts.long(), "tokens": torch.ones(3)}}, "num_experts": 4,
             "layer_names": ["l0"], "buckets": ["image", "question", "answer"]}
    assert planning.make_plan(stats, 2, MergeConfig(method="msmoe", router="average"), features=feats)["groups"] == [
        [[0, 3], [1, 2]]]


def test_feature_baselines_stay_inside_routing_blocks():
    """Group-limited routing (plan(blocks=)): each baseline's criterion on its block's slice."""
    from rolemerge.baselines import slice_features
    Z = torch.tensor([[1., 1, 0, 3], [0, 2, 1, 1], [0, 0, 0, 1]], dtype=torch.float64)
    feats = [{"count": torch.tensor([10., 1, 5, 2]), "logit_gram": Z.T @ Z, "tokens": 3,
              "out_sum": torch.eye(4, dtype=torch.float64), "reap_sum": torch.tensor([30., 2, .5, 0])}]
    counts = torch.ones(1, 3, 4)
    assert bl.plan_groups("reap", feats, 2)[0] == [[0], [1]]              # S = (3, 2, .1, 0)
    assert bl.plan_groups("reap", feats, 2, blocks=2)[0] == [[0], [2]]    # best of {0,1}, of {2,3}
    assert bl.plan_groups("msmoe", feats, 2)[0] == [[0, 3], [1, 2]]
    for method in ("msmoe", "hcsmoe"):
        assert bl.plan_groups(method, feats, 2, blocks=2)[0] == [[0, 1], [2, 3]]
    sl = slice_features(feats[0], slice(2, 4))
    assert sl["logit_gram"].tolist() == (Z.T @ Z)[2:, 2:].tolist() and sl["reap_sum"].tolist() == [.5, 0]
    assert sl["out_sum"].tolist() == [[0, 0, 1, 0], [0, 0, 0, 1]] and sl["tokens"] == 3


# ----------------------------------------------------------------------------- oracle routing

@pytest.mark.parametrize("groups", [[[0, 1], [2, 3]], [[0, 3], [1], [2]], [[0], [2]]])
def test_oracle_routing_sends_each_token_to_its_original_experts_groups(groups):
    from rolemerge import calibrate as cal
    from rolemerge import infer
    from rolemerge import merge as mg
    model = tiny_qwen3_moe()
    block = blk.moe_blocks(model)[0][1]
    W0 = block.gate.weight.detach().clone()
    x = torch.randn(6, 16)
    probs = torch.softmax(x @ W0.T, -1)
    w, idx = probs.topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    weights = rm.merge_weights(torch.tensor([3., 1, 2, 5]), groups)
    merging.merge_model(model, {"groups": [groups], "weights": [weights]})
    y = bl.expert_outputs(block.experts, x)                      # merged experts [T, K, H]
    lut = {e: gi for gi, g in enumerate(groups) for e in g}
    want = torch.zeros(6, 16)
    for t in range(6):
        kept = [(float(w[t, j]), lut[int(idx[t, j])]) for j in range(2) if int(idx[t, j]) in lut]
        tot = sum(a for a, _ in kept)
        for a, gi in kept:
            want[t] += a / tot * y[t, gi]
    with torch.no_grad(), infer.oracle_routing(model, [W0], [groups]):
        got = block(x[None])[0]
    # both sides' expert rounding, the renormalised weights (4 x the router logits' error) on |y|,
    # and the sum of k = 2
    ymax = y.abs().max().item()
    bound = 2 * expert_tol(block.experts, x) + 4 * router_tol(x, W0) * ymax + tol(torch.float32, 3, ymax)
    torch.testing.assert_close(got, want, rtol=0, atol=bound)
    with torch.no_grad():                                        # hooks removed on exit: merged router again
        assert (block(x[None])[0] - want).abs().max() > bound or len(groups) == 4


def test_toy_rolemerge_model_and_threads_flags(capsys):
    from eval.toys import rolemerge as toy
    a = toy.parser().parse_args([])
    assert a.model == "tiny-moe" and a.threads is None and capsys.readouterr().err == ""
    a = toy.parser().parse_args(["--model", "out/b", "--threads", "1"])
    assert a.model == "out/b" and a.threads == 1
    with pytest.raises(SystemExit):
        toy.parser().parse_args(["--threads", "-1"])


def test_toy_gold_turn_follows_the_base_look_step():
    from eval.toys import rolemerge as toy
    look = "tl blue square 1tl tc empty - tr empty - ml empty - mc empty - mr red circle - bl empty - bc blue circle 2bc br empty -."
    rec = {"scene": look, "answer": "yes", "question": "Is the blue square to the left of the blue circle?"}
    assert toy.gold_turn(rec, "full") == toy.gold_turn(rec, True) == look + " Answer: yes"
    assert toy.gold_turn(rec, "objects") == "tl blue square 1tl mr red circle - bc blue circle 2bc. Answer: yes"
    assert toy.gold_turn(rec, "none") == toy.gold_turn(rec, False) == "Answer: yes"
    with pytest.raises(ValueError, match="unknown look"):
        toy.gold_turn(rec, "short")
    assert toy.MAX_NEW_BY_LOOK["objects"] >= 32 and set(toy.MAX_NEW_BY_LOOK) == {"full", "objects", "none"}
    read = {"target": look + " Answer: yes", "answer": "yes"}                     # data.read_llava_json's fields
    assert toy.gold_turn(read, "objects") == toy.gold_turn(rec, "objects")


def test_empirical_phase_prior_hand_case():
    """counts (image; answer) per expert: e0 (90; 0), e1 (0; 10), e2 (30; 8). Phase distributions
    p_img = (.75, 0, .25), p_ans = (0, 10/18, 8/18). Uniform prior (the paper): e2's joint is
    (.125, .2222) -> q_2 = (.36, .64), an answer-role expert, merged with e1. Empirical prior
    (phase token shares 120/138, 18/138): joint (.2174, .0580) -> q_2 = (.789, .211), image-role,
    merged with e0. lambda = 0 so only d_EP decides."""
    c = torch.tensor([[[90., 0, 30], [0, 10, 8]]], dtype=torch.float64)
    p = rm.phase_distributions(c[0])
    _, q_u = rm.role_profiles(p)
    _, q_e = rm.role_profiles(p, torch.tensor([120 / 138, 18 / 138]))
    assert torch.allclose(q_u[2], torch.tensor([.36, .64], dtype=torch.float64))
    assert torch.allclose(q_e[2], torch.tensor([.25 * 120 / 138, 8 / 18 * 18 / 138], dtype=torch.float64)
                          / (.25 * 120 / 138 + 8 / 18 * 18 / 138))
    assert rm.plan(c, 2, "rolemerge", lam=0)[0][0] == [[0], [1, 2]]
    assert rm.plan(c, 2, "empirical_prior", lam=0)[0][0] == [[0, 2], [1]]
    even = torch.tensor([[[60., 0, 20], [0, 50, 30]]], dtype=torch.float64)      # equal phase totals: same as uniform
    assert rm.plan(even, 2, "empirical_prior")[0] == rm.plan(even, 2, "rolemerge")[0]


def test_toy_retrain_base_runs_the_readme_recipe(monkeypatch, tmp_path):
    import os
    import re
    import subprocess

    from eval.toys import rolemerge as toy
    readme = open(os.path.join(os.path.dirname(__file__), "..", "rolemerge", "README.md")).read()
    cmds = re.findall(r"python -m eval\.tools\.pretrain (--arch qwen3_vl_moe --experts 32 [^`]*--look objects[^`]*)`",
                      readme.replace("\n", " "))
    pairs = lambda words: dict(zip(words[::2], words[1::2]))
    readme_flags = [{k: v for k, v in pairs(c.split()).items() if k not in ("--seed", "--threads", "--out")}
                    for c in cmds]
    assert pairs(toy.PAPER_RECIPE) in readme_flags                # a README command is what --retrain-base runs
    assert pairs(toy.PAPER_RECIPE)["--steps"] == "5500"           # ... the recipe of the three-seed results
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda c, check: calls.append(c))
    assert toy.retrain_bases(str(tmp_path), [0, 2], 1) == [str(tmp_path / "seed0"), str(tmp_path / "seed2")]
    assert calls[1][-6:] == ["--seed", "2", "--out", str(tmp_path / "seed2"), "--threads", "1"]
    with pytest.raises(SystemExit):
        toy.main(["--retrain-base", str(tmp_path), "--paper", "x"])


def _claim_results(per_base):
    """Minimal toy_rolemerge per-base result dicts: per_base = [{arm: correct list}] at one rho."""
    return [{"base": f"out/b/seed{i}", "config": {"rhos": (0.5,)},
             "arms": {f"{a}@0.5": {"correct": c, "groups": [[[0], [1]]] if a in ("rolemerge", "lambda0") else [[[0, 1]]]}
                      for a, c in arms.items()}} for i, arms in enumerate(per_base)]


def test_claim_verdicts_pooled_and_per_base():
    """The pre-registered verdict rule and the pooled / per-seed differences, hand-computed."""
    from eval.toys.rolemerge import claim_table, verdict
    assert verdict({"ci_low": 0.01, "ci_high": 0.2}) == "supported"
    assert verdict({"ci_low": -0.2, "ci_high": -0.01}) == "contradicted"
    assert verdict({"ci_low": 0.0, "ci_high": 0.2}) == "inconclusive"
    ones, zeros = [1] * 20, [0] * 20
    half = [1] * 10 + [0] * 10
    b0 = {"rolemerge": ones, "msmoe": zeros, "hcsmoe": zeros, "reap": ones, "prune": half, "lambda0": ones}
    b1 = {"rolemerge": half, "msmoe": zeros, "hcsmoe": zeros, "reap": half, "prune": ones, "lambda0": half}
    t = claim_table(_claim_results([b0, b1]))
    rows = {ln.split(" | ")[0][2:]: ln for ln in t.splitlines() if ln.startswith("| ") and "rho" not in ln}
    msmoe = "H1c RoleMerge > M-SMoE (official: bound router)"
    # M-SMoE: rolemerge 30/40 vs 0/40 pooled -> +0.750, per base +1.000 / +0.500
    assert "supported (+0.750 [" in rows[msmoe]
    assert "[+1.000 / +0.500]" in rows[msmoe]
    # pruning: +0.500 on base 0, -0.500 on base 1 -> pooled 0, seeds disagree in sign
    assert "inconclusive (+0.000 [" in rows["RoleMerge > frequency pruning (control)"]
    assert "[+0.500 / -0.500]" in rows["RoleMerge > frequency pruning (control)"]
    assert "same groups" in rows["H3 collision term (vs lambda0)"]
    assert "H2 phase split (vs no_phase_split)" not in rows   # arm missing: row left out
    assert t.rstrip().endswith("rho): no")                   # REAP / pruning not supported
    worse = {a: (zeros if a != "rolemerge" else ones) for a in b0}
    t2 = claim_table(_claim_results([worse, worse]))
    assert "contradicted" not in t2 and t2.rstrip().endswith("rho): yes")
    flip = claim_table(_claim_results([{a: (ones if a != "rolemerge" else zeros) for a in b0}]))
    assert "| H1g RoleMerge > REAP (pruning) | contradicted (-1.000 [-1.000, -1.000]) |" in flip.splitlines()  # one base: no brackets


def test_table1_and_result_rows_hand_computed():
    """Table 1 layout (accuracy and % of the full model, pooled, per base in brackets) and the
    result rows' claim summary, on two bases of 20 items at one rho."""
    from eval.toys.rolemerge import _summary, result_rows, table1
    ones, zeros, half = [1] * 20, [0] * 20, [1] * 10 + [0] * 10
    b0 = {"full": ones, "rolemerge": ones, "reap": half, "msmoe": zeros}
    b1 = {"full": half, "rolemerge": half, "reap": half, "msmoe": zeros}
    res = _claim_results([b0, b1])
    for r, b in zip(res, (b0, b1)):
        r["arms"]["full"] = {"correct": b["full"]}
        for a in b:
            r["arms"].setdefault(f"{a}@0.5", {})["K"] = 2
    t = table1(res).splitlines()
    # full 30/40 = .75; RoleMerge 30/40 = .75 (100 %), per base 1.000 / 0.500; REAP 20/40 (66.7 %)
    assert "| full model | 0.750 (100%) |" in t
    assert "| RoleMerge | 0.750 (100.0%) [1.000 / 0.500] |" in t
    assert "| REAP | 0.500 (66.7%) [0.500 / 0.500] |" in t
    rows = result_rows(res, res, "log#x")
    claim = next(r for r in rows if r["kind"] == "claim" and r["arm"] == "reap")
    assert claim["effect"].startswith(".5: +0.250 [") and claim["per_seed"] == ".5: +0.500 / +0.000"
    assert claim["verdict"] == "inconclusive at every rho"   # base 1's difference is 0: the seeds share no sign
    acc = next(r for r in rows if r["kind"] == "accuracy" and r["arm"] == "reap" and r["seed"] == "seed 1")
    assert acc["value"] == 0.5 and acc["retained"] == 1.0   # no pretrain_log.json: the seed from the folder name
    t1 = next(r for r in rows if r["kind"] == "table1" and r["arm"] == "rolemerge")
    assert t1["acc_500"] == 0.75 and t1["ret_500"] == 1.0 and t1["per_seed_500"] == "1.000 / 0.500"
    h1 = next(r for r in rows if r.get("claim", "").startswith("H1 as registered"))
    assert h1["verdict"] == "not reproduced (fails against REAP)" and h1["top"]
    assert rows.index(h1) < rows.index(claim)          # the main verdict before the claims it sums up
    res[1]["arms"]["reap@0.5"]["correct"] = [1] * 5 + [0] * 15   # base 1: REAP 0.25, RoleMerge 0.5 ahead
    rows = result_rows(res, res, "log#x")
    h1 = next(r for r in rows if r.get("claim", "").startswith("H1 as registered"))
    assert h1["verdict"] == "reproduced"              # +0.5 / +0.25 over REAP, +1 / +0.5 over M-SMoE: CIs above 0
    assert h1["effect"] == "supported at >= 1 rho against 2 of 2 comparators"
    for r in res:
        r["arms"]["reap@0.5"]["correct"] = ones       # REAP now ahead on both bases
    h1 = next(r for r in result_rows(res, res, "") if r.get("claim", "").startswith("H1 as registered"))
    assert h1["verdict"] == "not reproduced (fails against REAP)"
    assert _summary(["supported"] * 3, (0.5, 0.625, 0.75)) == "supported at every rho"
    assert _summary(["supported", "inconclusive", "supported"], (0.5, 0.625, 0.75)) == \
        "partial: supported at .5 and .75, inconclusive at .625"


def test_rescore_recomputes_the_result_rows_from_per_base_files(tmp_path, capsys):
    """--rescore FILES: the result rows from finished per-base files of --paper, no merging; a file
    that is not one: exit 2 naming it. Seeds disagree (+0.75 / -0.10 over REAP): inconclusive, though
    the 40 pooled examples alone would put the CI above 0."""
    from eval.metrics import paired_bootstrap
    from eval.toys import rolemerge as toy
    res = _claim_results([{"rolemerge": [1] * 16 + [0] * 4, "reap": [0] * 20},
                          {"rolemerge": [1] * 18 + [0] * 2, "reap": [1] * 20}])
    files = []
    for r in res:
        r["arms"]["full"] = {"correct": [1] * 20}
        for k in list(r["arms"]):
            r["arms"][k]["K"] = 2
        files.append(tmp_path / f"{os.path.basename(r['base'])}.json")
        files[-1].write_text(json.dumps(r))
    out = tmp_path / "t1.json"
    toy.main(["--rescore", ",".join(map(str, files)), "--results", str(out), "--log", "log#x"])
    rows = json.loads(out.read_text())["rows"]
    reap = next(r for r in rows if r["kind"] == "claim" and r["arm"] == "reap")
    assert reap["per_seed"] == ".5: +0.800 / -0.100" and reap["verdict"] == "inconclusive at every rho"
    assert reap["bootstrap"] == "two-level (2 seeds, then questions)"
    pooled = paired_bootstrap(toy.pooled(res, "rolemerge@0.5"), toy.pooled(res, "reap@0.5"))
    assert pooled["ci_low"] > 0                                   # the examples-only CI would have said supported
    assert "--rescore" in json.loads(out.read_text())["source"]
    assert "| H1g RoleMerge > REAP (pruning) | inconclusive (+0.350 [" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        toy.main(["--rescore", str(tmp_path / "bad.json")])
    assert e.value.code == 2 and "bad.json is not a per-base result file" in capsys.readouterr().err


def test_committed_paper_structure_base_is_the_recipe():
    """common/tiny/moe32 (seed 2 of the paper-structure recipe, rolemerge/README.md) is what
    `--retrain-base` would train: 32 experts, top-4, and every PAPER_RECIPE flag in its log."""
    import json
    import os

    from eval.toys import rolemerge as toy
    d = os.path.join(os.path.dirname(__file__), "..", "common", "tiny", "moe32")
    cfg = json.load(open(os.path.join(d, "config.json")))["text_config"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (32, 4, 32)
    args = json.load(open(os.path.join(d, "pretrain_log.json")))["args"]
    flags = dict(zip(toy.PAPER_RECIPE[::2], toy.PAPER_RECIPE[1::2]))
    dest = {"--save-every": "ckpt_every"}   # pretrain's --save-every stores into ckpt_every
    for k, v in flags.items():
        key = dest.get(k, k[2:].replace("-", "_"))
        assert str(args[key]) == v or float(args[key]) == float(v), k
    assert args["seed"] == 2
