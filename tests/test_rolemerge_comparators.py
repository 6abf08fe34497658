"""RoleMerge's four extra comparators (rolemerge/comparators.py): Sub-MoE, NAMEx, MergeMoE, REAM.
Each has a hand-computed case and a check against a straight transcription of the official
formula (written here in the official code's style: loops / numpy), plus the recorder against a
brute-force pass and a merged tiny Qwen3-MoE that loads and generates."""
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from eval.tools import kmeans_check as kc
from helpers import tiny_qwen3_moe, tol
from rolemerge import baselines as bl
from rolemerge import calibrate as cal
from rolemerge import comparators as cp
from rolemerge import blocks as blk


BATCHES = [{"input_ids": torch.tensor([[1, 5, 7, 9, 2], [3, 4, 0, 0, 0]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])},
           {"input_ids": torch.tensor([[8, 8, 6, 11, 30, 2, 17]]), "attention_mask": torch.ones(1, 7, dtype=torch.long)}]


def _weights(block):
    gu = block.experts.gate_up_proj.detach().float()
    I = gu.shape[1] // 2
    return {"gate": gu[:, :I].clone(), "up": gu[:, I:].clone(), "down": block.experts.down_proj.detach().float().clone(),
            "router": block.gate.weight.detach().float().clone()}


def _random_layer(N=4, I=3, H=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(N, I, H, generator=g), "up": torch.randn(N, I, H, generator=g),
            "down": torch.randn(N, H, I, generator=g), "router": torch.randn(N, H, generator=g)}


# ----------------------------------------------------------------------------- recorder

def test_recorder_sums_match_a_brute_force_pass_over_non_padding_tokens():
    model = tiny_qwen3_moe(N=6)
    block = blk.moe_blocks(model)[0][1]
    seen = []
    h = block.experts.register_forward_hook(lambda m, a, o: seen.append((a[0].detach(), a[1])))
    feats = cp.collect(model, BATCHES, sample_tokens=5)[0]
    h.remove()
    masks = [b["attention_mask"].reshape(-1).bool() for b in BATCHES]
    xs = [s[0][m] for s, m in zip(seen, masks)]                  # each batch's non-padding inputs
    x, idx = torch.cat(xs), torch.cat([s[1][m] for s, m in zip(seen, masks)])
    T, N = x.shape[0], 6
    assert feats["tokens"] == T == 14
    base = bl.collect_features(model, BATCHES)[0]            # the shared names equal the baselines' ones
    for k in ("count", "logit_gram", "out_sum"):
        assert torch.equal(feats[k], base[k]), k             # one recorder's sums: bit for bit
    # the expert outputs [T, N, H] and router logits [T, N] batch by batch, as the recorder computes them: the
    # same fp32 numbers on every BLAS kernel set (one product over all 14 tokens rounds differently from two
    # batches under MKL's AVX2 kernels)
    y = torch.cat([bl.expert_outputs(block.experts, xb) for xb in xs]).detach().double()
    z = torch.cat([xb.float() @ block.gate.weight.detach().float().T for xb in xs]).double()
    # Sub-MoE (zhy617/SMoE calculate_expert_similarity_matrix): per-token cosine, summed
    cos = np.zeros((N, N))
    for i in range(N):
        for j in range(N):
            for t in range(T):
                a, b = y[t, i].numpy(), y[t, j].numpy()
                cos[i, j] += a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    # float64 cosines of the same fp32 outputs (|cos| <= 1): a norm and a dot of H, summed over T
    H = y.shape[-1]
    assert np.allclose(feats["out_cos_sum"].numpy(), cos, rtol=0, atol=tol(torch.float64, 2 * H + T + 4, T))
    # REAM (ream/saliency.py reap on run_all_experts(gated_sim=True) outputs): final = p * f,
    # saliency sum over routed tokens of ||final|| * p (p: full softmax, not renormalised)
    out, sal = np.zeros((N, y.shape[-1])), np.zeros(N)
    for t in range(T):
        p = torch.softmax(z[t].float(), -1).double()
        for e in range(N):
            final = p[e] * y[t, e]
            out[e] += final.numpy()
            if e in idx[t].tolist():
                sal[e] += float(final.norm()) * float(p[e])
    # float64 sums over T of the same fp32 softmax times fp32 outputs; the saliency adds a norm of H
    ymax = float(y.abs().max())
    assert np.allclose(feats["ream_out_sum"].numpy(), out, rtol=0, atol=tol(torch.float64, T + 2, T * ymax))
    bound = tol(torch.float64, H + T + 4, T * H ** 0.5 * ymax)
    assert np.allclose(feats["ream_sal_sum"].numpy(), sal, rtol=0, atol=bound)
    # the token sample: m = 5 distinct non-padding inputs with their own top-k rows
    sample, ts = feats["x_sample"], feats["x_sample_topk"]
    assert sample.shape == (5, 16) and ts.shape == (5, 2)
    rows = [int((x.float() - r).abs().sum(1).argmin()) for r in sample]
    assert len(set(rows)) == 5
    for r, t in zip(rows, ts):
        assert torch.equal(x[r].float(), sample[rows.index(r)]) and torch.equal(idx[r], t)


def test_recorder_sample_is_uniform_over_all_tokens_and_bounded():
    # bottom-m sampling keeps the m smallest of T uniform keys: each token is kept with
    # probability m / T, whatever batch it came in
    model = tiny_qwen3_moe(N=4, layers=1)
    batches = [{"input_ids": torch.tensor([[(3 * i + 1) % 32 for i in range(j, j + 10)]]),
                "attention_mask": torch.ones(1, 10, dtype=torch.long)} for j in range(0, 60, 10)]
    block = blk.moe_blocks(model)[0][1]
    seen = []
    h = block.experts.register_forward_hook(lambda m, a, o: seen.append(a[0].detach()))
    with torch.no_grad():
        for b in batches:
            model(**b)
    h.remove()
    x = torch.cat(seen).float()                                    # [60, H]
    per_batch = torch.zeros(6)
    for seed in range(100):
        feats = cp.collect(model, batches, methods=("mergemoe",), sample_tokens=6, seed=seed)[0]
        assert feats["x_sample"].shape == (6, 16) and "out_cos_sum" not in feats
        pos = [int((x - r).abs().sum(1).argmin()) for r in feats["x_sample"]]
        assert len(set(pos)) == 6
        for q in pos:
            per_batch[q // 10] += 1
    # 100 draws x 6 tokens, 1/6 of the tokens per batch: 100 expected per batch (sd ~ 9)
    assert torch.all((per_batch > 65) & (per_batch < 135)), per_batch


def test_recorder_rejects_unknown_method():
    with pytest.raises(ValueError, match="unknown comparator"):
        cp.ComparatorRecorder(tiny_qwen3_moe(N=6), ("submoe", "ties"))


# ----------------------------------------------------------------------------- Hungarian

def test_linear_assignment_is_the_exact_optimum():
    C = torch.tensor([[4., 1, 3], [2, 0, 5], [3, 2, 2]])     # optimum: 0->1, 1->0, 2->2 (cost 5)
    assert cp.linear_assignment(C).tolist() == [1, 0, 2]
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 6):
        for _ in range(5):
            C = torch.rand(n, n, generator=g)
            best = min(itertools.permutations(range(n)), key=lambda p: sum(float(C[i, p[i]]) for i in range(n)))
            col = cp.linear_assignment(C)
            assert sorted(col.tolist()) == list(range(n))
            assert math.isclose(sum(float(C[i, col[i]]) for i in range(n)), sum(float(C[i, best[i]]) for i in range(n)),
                                rel_tol=0, abs_tol=tol(torch.float64, n, n))   # n costs in [0, 1), summed


def test_linear_assignment_agrees_with_scipy_where_installed():
    optimize = pytest.importorskip("scipy.optimize")
    g = torch.Generator().manual_seed(1)
    C = torch.rand(40, 40, generator=g, dtype=torch.float64)
    ref = optimize.linear_sum_assignment(C.numpy())[1]
    assert cp.linear_assignment(C).tolist() == ref.tolist()
    assert cp._assign(C).tolist() == ref.tolist()


# ----------------------------------------------------------------------------- Sub-MoE

def test_submoe_subspace_merge_by_hand():
    # [W1 W2] = [[1,0,0,0],[0,0,0,2]]: singular values 2 (row 2), 1 (row 1); f = (.75, .25)
    W = torch.tensor([[[1., 0], [0, 0]], [[0., 0], [0, 2]]], dtype=torch.float64)
    # an SVD is backward stable: a small multiple (10) of the sizes times eps ||W|| (here 2)
    svd = tol(torch.float64, 10 * (2 + 4), 2.0)
    # full rank: U S V_i = W_i exactly, so the merge is the frequency-weighted average
    torch.testing.assert_close(cp.svd_merge(W, [3., 1]), torch.tensor([[0.75, 0], [0, 0.5]], dtype=torch.float64),
                               rtol=0, atol=svd)
    # rank 1 keeps the shared direction e2 only: U1 U1^T (.75 W1 + .25 W2) = [[0,0],[0,.5]]
    torch.testing.assert_close(cp.svd_merge(W, [3., 1], rank=1), torch.tensor([[0., 0], [0, 0.5]], dtype=torch.float64),
                               rtol=0, atol=svd)


def _svd_subspace_alignment(expert_weights, relative_frequencies, rank=None):
    """zhy617/SMoE src/qwen/compress/merge_experts.py svd_subspace_alignment, transcribed (numpy),
    plus the optional truncation to the top `rank` singular triplets."""
    concatenated = np.concatenate(expert_weights, axis=1)
    U, S, Vt = np.linalg.svd(concatenated, full_matrices=False)
    if rank is not None:
        U, S, Vt = U[:, :rank], S[:rank], Vt[:rank]
    size = expert_weights[0].shape[1]
    V_blocks = [Vt[:, i * size:(i + 1) * size] for i in range(len(expert_weights))]
    V_merged = np.zeros_like(V_blocks[0])
    for V_block, weight in zip(V_blocks, relative_frequencies):
        V_merged += weight * V_block
    return U @ np.diag(S) @ V_merged


@pytest.mark.parametrize("rank", [None, 2, 4])
def test_submoe_merge_matches_the_official_transcription(rank):
    g = torch.Generator().manual_seed(1)
    mats = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    f = [0.5, 0.3, 0.2]
    ref = _svd_subspace_alignment([m.numpy() for m in mats], f, rank)
    # two float64 SVDs of the 5 x 21 concatenation (LAPACK paths may differ): backward stable, a small
    # multiple (10) of the sizes times eps ||W||_F; the singular gaps of a random matrix are O(1)
    svd = tol(torch.float64, 10 * (5 + 21), float(mats.norm()))
    assert np.allclose(cp.svd_merge(mats, f, rank).numpy(), ref, rtol=0, atol=svd)


def test_submoe_groups_cluster_experts_with_similar_outputs():
    # per-token outputs: experts 0, 1 point along e0 (+ noise), 2 along e1, 3 along -e1 + e0 / 2
    T = 20
    g = torch.Generator().manual_seed(0)
    base = torch.tensor([[1., 0, 0], [1, 0.1, 0], [0, 1, 0.1], [0.3, 1, 0]])
    y = base[None] * (0.5 + torch.rand(T, 1, 1, generator=g)) + 0.02 * torch.randn(T, 4, 3, generator=g)
    feats = {"out_cos_sum": cp.output_cosines(y), "tokens": T, "count": torch.tensor([5., 1, 3, 3])}
    S = cp.submoe_similarity(feats["out_cos_sum"], T)
    assert torch.equal(S.diagonal(), torch.ones(4, dtype=torch.float64))
    assert float(S[0, 1]) > 0.95 and float(S[2, 3]) > 0.9 and float(S[0, 2]) < 0.3
    assert cp.submoe_groups(feats, 2) == [[0, 1], [2, 3]]
    assert cp.submoe_groups(feats, 4) == [[0], [1], [2], [3]]
    out = cp.merge_layer("submoe", _random_layer(), feats, 2)
    assert out["groups"] == [[0, 1], [2, 3]] and out["weights"] == [[5 / 6, 1 / 6], [0.5, 0.5]]
    assert out["router"] is None


def test_kmeans_returns_exactly_K_non_empty_groups_even_for_duplicate_points():
    X = torch.zeros(5, 3)
    X[3:] = 1.0
    for K in (1, 2, 3, 5):
        lab = cp.kmeans(X, K)
        assert len(set(lab.tolist())) == K
    assert cp._groups_from_labels(cp.kmeans(X, 2), 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="K=6"):
        cp.kmeans(X, 6)


def test_hartigan_moves_a_point_lloyd_keeps():
    # 1-D points 0, 1, 2, 4 split {0, 1} {2, 4}: centres 0.5 and 3, point 2 is nearer 3 (Lloyd keeps it),
    # inertia 0.5 + 2 = 2.5. Hartigan: leaving {2, 4} saves 2/1 * 1^2 = 2, joining {0, 1} costs
    # 2/3 * 1.5^2 = 1.5 < 2, so 2 moves: {0, 1, 2} {4}, inertia 2.0; then no move pays
    X = torch.tensor([[0.0], [1.0], [2.0], [4.0]], dtype=torch.float64)
    assert cp.hartigan(X, torch.tensor([0, 0, 1, 1]), 2).tolist() == [0, 0, 0, 1]
    assert cp.hartigan(X, torch.tensor([0, 0, 0, 1]), 2).tolist() == [0, 0, 0, 1]     # already optimal


def test_kmeans_plusplus_takes_the_best_of_its_candidates():
    # K = 2: 2 + floor(ln 2) = 2 candidates drawn with P ~ D^2 from the first centre; the kept one has the
    # lowest potential sum_x min(D(x)^2, ||x - c||^2) among them
    X = torch.tensor([[0.0, 0], [0, 1], [10, 0], [10, 1], [5, 0]], dtype=torch.float64)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        first = int(torch.randint(5, (1,), generator=g))
        cand = torch.multinomial((X - X[first]).pow(2).sum(1) / (X - X[first]).pow(2).sum(), 2, replacement=True,
                                 generator=g)
        pot = [float(torch.minimum((X - X[first]).pow(2).sum(1), (X - X[c]).pow(2).sum(1)).sum()) for c in cand]
        C = cp.kmeans_plusplus(X, 2, torch.Generator().manual_seed(seed))
        assert torch.equal(C[0], X[first]) and torch.equal(C[1], X[cand[int(np.argmin(pot))]])


def test_kmeans_no_worse_than_sklearn_on_the_committed_cases():
    """Our k-means (greedy k-means++, n_init 10, Hartigan refinement) against scikit-learn 1.9.1's KMeans
    inertias committed by eval.tools.kmeans_check (scikit-learn is not a dependency): no worse in >= 27
    of the 30 synthetic cases, each case regenerated bit for bit (its sum is committed too)."""
    rows = json.loads((Path(kc.__file__).parents[2] / "eval/results/rolemerge/kmeans_check.json").read_text())["rows"]
    ref = [r for r in rows if r["kind"] != "summary"]
    cs = kc.cases()
    assert [round(float(X.sum()), 9) for _, X, _ in cs] == [r["x_sum"] for r in ref]
    mine = kc.ours(cs)
    # an inertia is a float64 sum over every point's squared distance: X.numel() steps, relative
    no_worse = sum(o <= r["inertia_sklearn"] * (1 + tol(torch.float64, X.size))
                   for o, r, (_, X, _) in zip(mine, ref, cs))
    assert no_worse >= 27, f"no worse than scikit-learn in only {no_worse} of 30 cases"
    assert max(o / r["inertia_sklearn"] for o, r in zip(mine, ref)) < 1.05


# ----------------------------------------------------------------------------- NAMEx

def test_nash_weights_by_hand():
    # orthogonal directions of lengths 1 and 2: alpha_i ||tau_i||^2 alpha_i = 1 -> alpha = (1, 1/2)
    a = cp.nash_weights(torch.tensor([[1., 0], [0, 4]]))
    # not eps: the solver adds a ridge of 1e-9 x mean diagonal and stops at a residual of 1e-12, so the
    # weights are exact to ~1e-9; 1e-8 leaves a factor 10
    assert torch.allclose(a, torch.tensor([1.0, 0.5], dtype=torch.float64), atol=1e-8)
    # M = [[1, c], [c, 1]]: symmetric solution a (1 + c) a = 1 -> a = 1 / sqrt(1 + c)
    a = cp.nash_weights(torch.tensor([[1., 0.5], [0.5, 1]]))
    assert torch.allclose(a, torch.full((2,), 1 / math.sqrt(1.5), dtype=torch.float64), atol=1e-8)
    with pytest.raises(ValueError, match="zero"):
        cp.nash_weights(torch.tensor([[0., 0], [0, 1]]))


def test_namex_merge_by_hand():
    # base theta_0 = 0, theta_1 = e1, theta_2 = 2 e2, frequencies (.5, .25, .25)
    th = torch.tensor([[0., 0], [1, 0], [0, 2]])
    merged, c = cp.namex_merge(th, 0, [0.5, 0.25, 0.25])
    # alpha = (1, 1/2): Delta = e1 + e2 (equal utility per expert), ||Delta|| = sqrt 2;
    # eps = ||.25 e1 + .25 * 2 e2|| = sqrt(.3125); merged = eps / sqrt2 (e1 + e2)
    s = math.sqrt(0.3125) / math.sqrt(2)
    # fp32 output of a float64 merge: its rounding (x2 with the literal's); c: the solver's ridge (1e-9, as above)
    exact = tol(torch.float32, 2, 1.0)
    torch.testing.assert_close(merged, torch.tensor([s, s]), rtol=0, atol=exact)
    assert torch.allclose(c, torch.tensor([1 - 1.5 * s, s, s / 2], dtype=torch.float64), atol=1e-8)
    # frequency averaging would give (.25, .5): the bargaining evens out the two players
    assert (merged - torch.tensor([0.25, 0.5])).abs().max() > exact
    # a member never routed leaves the step at zero length only if all non-base members are unused
    merged, c = cp.namex_merge(th, 0, [1.0, 0.0, 0.0])
    assert torch.equal(merged, th[0]) and c.tolist() == [1.0, 0.0, 0.0]


def test_namex_matches_the_bargaining_condition_transcribed():
    g = torch.Generator().manual_seed(3)
    W = _random_layer(N=5, I=3, H=4, seed=3)
    count = torch.tensor([9., 4, 7, 1, 2])
    Z = torch.randn(30, 5, generator=g, dtype=torch.float64)
    feats = {"count": count, "logit_gram": Z.T @ Z}
    out = cp.merge_layer("namex", W, feats, 2)
    assert out["groups"] == bl.msmoe_groups(count, Z.T @ Z, 2)
    for gi, grp in enumerate(out["groups"]):
        flat = [np.concatenate([W["gate"][e].reshape(-1), W["up"][e].reshape(-1), W["down"][e].reshape(-1)]).astype(
            np.float64) for e in grp]
        base = max(grp, key=lambda e: float(count[e]))
        b = grp.index(base)
        others = [i for i in range(len(grp)) if i != b]
        tau = [flat[i] - flat[b] for i in others]
        n = len(tau)
        c = np.array(out["weights"][gi])
        freq = [float(count[e]) / float(count[grp].sum()) for e in grp]
        step = sum(freq[i] * (flat[i] - flat[b]) for i in others)
        eps = math.sqrt(sum(v * v for v in step))
        alpha = c[others] / (eps / math.sqrt(n)) if n else []
        # Nash-MTL's condition: alpha_i * sum_j <tau_i, tau_j> alpha_j = 1 for every player i
        for i in range(n):
            s = sum(float(tau[i] @ tau[j]) * alpha[j] for j in range(n))
            # the solver's ridge (1e-9 of the mean diagonal, moved by the recovered alphas' fp32 rounding)
            assert math.isclose(alpha[i] * s, 1.0, rel_tol=1e-6)
        merged = flat[b] + sum(c[i] * tau[k] for k, i in enumerate(others)) if n else flat[b]
        I, H = 3, 4
        got = np.concatenate([out["gate"][gi].reshape(-1), out["up"][gi].reshape(-1), out["down"][gi].reshape(-1)])
        # fp32 output of a float64 merge: its rounding, twice (the fp32 experts in the transcription)
        assert np.allclose(got, merged, rtol=0, atol=tol(torch.float32, 2, np.abs(merged).max()))
        assert math.isclose(sum(c), 1.0, rel_tol=tol(torch.float64, len(c) + 2))


# ----------------------------------------------------------------------------- MergeMoE

def test_mergemoe_least_squares_down_projection_by_hand():
    # H = I = 1, identity activation: E_j(x) = d_j g_j u_j x^2; gate (1, 3), up (2, 2), down (1, 2),
    # w = (.5, .5): g' = u' = 2, h'(x) = 4 x^2, target = .5 (2 + 12) x^2 = 7 x^2 -> d' = 7/4
    gate = torch.tensor([[[1.]], [[3.]]])
    up = torch.tensor([[[2.]], [[2.]]])
    down = torch.tensor([[[1.]], [[2.]]])
    x = torch.tensor([[1.], [2.]])
    g2, u2, d2 = cp.mergemoe_down(gate, up, down, [0.5, 0.5], x, lambda t: t, ridge=0.0)
    # a float64 fit returned in fp32: its rounding (2 steps), relative
    assert float(g2) == 2.0 and float(u2) == 2.0 and math.isclose(float(d2), 1.75, rel_tol=tol(torch.float32, 2))
    # the ridge pulls toward the naive average down projection (1.5): 68 / (272 + lam) = 2.5e-10 away, below fp32's
    assert math.isclose(float(cp.mergemoe_down(gate, up, down, [0.5, 0.5], x, lambda t: t, ridge=1e9)[2]), 1.5,
                        rel_tol=tol(torch.float32, 2))
    # no calibration token: the naive construction
    assert math.isclose(float(cp.mergemoe_down(gate, up, down, [0.5, 0.5], x[:0], lambda t: t)[2]), 1.5)


def test_mergemoe_matches_a_per_token_transcription_and_beats_averaging():
    W = _random_layer(N=4, I=3, H=5, seed=4)
    g = torch.Generator().manual_seed(4)
    X = torch.randn(40, 5, generator=g)
    top = torch.randint(0, 4, (40, 2), generator=g)
    count = torch.bincount(top.reshape(-1), minlength=4).double()
    feats = {"count": count, "tokens": 40, "out_sum": torch.randn(4, 5, generator=g, dtype=torch.float64),
             "x_sample": X, "x_sample_topk": top}
    out = cp.merge_layer("mergemoe", W, feats, 2, groups=[[0, 2], [1, 3]], ridge=1e-3)
    silu = lambda v: v / (1 + np.exp(-v))
    for gi, grp in enumerate([[0, 2], [1, 3]]):
        w = [float(count[e]) / float(count[grp].sum()) for e in grp]
        G = sum(w[k] * W["gate"][e].double().numpy() for k, e in enumerate(grp))
        U = sum(w[k] * W["up"][e].double().numpy() for k, e in enumerate(grp))
        avg = sum(w[k] * W["down"][e].double().numpy() for k, e in enumerate(grp))
        P, Q, n = np.zeros((3, 3)), np.zeros((5, 3)), 0
        for t in range(40):
            if not set(top[t].tolist()) & set(grp):
                continue
            n += 1
            x = X[t].double().numpy()
            h = silu(G @ x) * (U @ x)
            y = sum(w[k] * W["down"][e].double().numpy() @ (silu(W["gate"][e].double().numpy() @ x) *
                                                           (W["up"][e].double().numpy() @ x)) for k, e in enumerate(grp))
            P += np.outer(h, h)
            Q += np.outer(y, h)
        lam = 1e-3 * np.trace(P) / 3
        D = (Q + lam * avg) @ np.linalg.inv(P + lam * np.eye(3))
        assert out["info"]["fit_tokens"][gi] == n
        # float64 fits returned in fp32: that rounding, plus the float64 solve's (cond(P + lam I) x eps)
        cond = np.linalg.cond(P + lam * np.eye(3))
        bound = tol(torch.float32, 2, np.abs(D).max()) + tol(torch.float64, 40 * 3, cond * np.abs(D).max())
        assert np.allclose(out["down"][gi].numpy(), D, rtol=0, atol=bound)
        assert np.allclose(out["gate"][gi].numpy(), G, rtol=0, atol=tol(torch.float32, 2, np.abs(G).max()))
        # the fit reproduces the group's merged output better than the averaged down projection
        err = lambda M: np.trace(M @ P @ M.T) - 2 * np.trace(M @ Q.T)
        assert err(D) < err(avg)


def test_mergemoe_groups_by_euclidean_distance_of_mean_outputs():
    # mean outputs: 0 and 1 point the same way (cosine 1) but lie 9 apart; 0 and 2 are 0.5 apart.
    # Euclidean average linkage (the docstring, baselines.hcsmoe_groups' default): {0, 2} {1, 3};
    # cosine would give {0, 1} {2, 3}
    mean = torch.tensor([[1.0, 0], [10, 0], [1, 0.5], [10, 5]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    feats = {"count": torch.ones(4, dtype=torch.float64), "tokens": 10, "out_sum": 10 * mean,
             "x_sample": torch.randn(6, 5, generator=g), "x_sample_topk": torch.randint(0, 4, (6, 2), generator=g)}
    assert cp.merge_layer("mergemoe", _random_layer(N=4, I=3, H=5), feats, 2)["groups"] == [[0, 2], [1, 3]]
    assert bl.hcsmoe_groups(mean, 2, distance="cosine") == [[0, 1], [2, 3]]


# ----------------------------------------------------------------------------- REAM

def test_ream_saliency_and_pseudo_groups_by_hand():
    # saliency sums / counts: (0, .5, .3, .2); the unused expert gets min(.5, .2) = .2
    s = cp.ream_saliency(torch.tensor([0., 2, 0.3, 0.4]), torch.tensor([0., 4, 1, 2]))
    assert torch.allclose(s, torch.tensor([0.2, 0.5, 0.3, 0.2], dtype=torch.float64))
    sal = torch.tensor([0.4, 0.1, 0.3, 0.2])                 # centroids for K = 2: 0, then 2
    d = torch.tensor([[0., .5, .2, .1],
                      [.5, 0, .3, .6],
                      [.2, .3, 0, .4],
                      [.1, .6, .4, 0]])
    # C = 2: centroid 0 first takes its nearest non-centroid 3 (.1), centroid 2 then takes 1
    assert cp.ream_groups(sal, d, 2, group_size=2) == ([[0, 3], [1, 2]], [0, 2])
    # C = 3: centroid 0 takes 3 and then 1 (.5; 2 is a centroid), nothing is left for 2
    assert cp.ream_groups(sal, d, 2, group_size=3) == ([[0, 1, 3], [2]], [0, 2])
    # C = 0 (MC-SMoE): every non-centroid joins its nearest centroid: 1 -> 2 (.3 < .5), 3 -> 0
    assert cp.ream_groups(sal, d, 2, group_size=0) == ([[0, 3], [1, 2]], [0, 2])
    with pytest.raises(ValueError, match="group_size=1"):
        cp.ream_groups(sal, d, 2, group_size=1)


def _official_pseudo_group(saliency, expert_logits, k, gate_logits, group_size):
    """ream/ream.py pseudo_group + expert_similarity + utils.dist2sim / normalize_rows, transcribed."""
    x = gate_logits.T / (np.linalg.norm(gate_logits.T, axis=-1, keepdims=True) + 1e-8)
    d_gate = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
    sim_gate = 1 - d_gate / d_gate.max()
    n = expert_logits.shape[0]
    d = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            a, b = expert_logits[i, 0], expert_logits[j, 0]
            sim_out = (a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-8) + 1) / 2
            d[i, j] = d[j, i] = 1 - (sim_out + sim_gate[i, j]) / 2
    centroid_inds = np.argsort(saliency)[::-1].copy()[:k]
    labels = np.zeros(n) - 1
    labels[centroid_inds] = np.arange(k)
    for centroid in centroid_inds:
        group = [centroid]
        for ind in np.argsort(d[centroid], kind="stable"):
            if ind != centroid and labels[ind] == -1:
                group.append(ind)
            if len(group) >= group_size:
                break
        for ind in group:
            labels[ind] = labels[centroid]
        if (labels >= 0).all():
            break
    return labels, centroid_inds, d


def _official_merge(experts, group, saliency, act_all, wfeat):
    """ream/merger.py Merger._merge (merging 'logits+weights'), transcribed; brute-force matching."""
    w = saliency[group] / saliency[group].sum()
    unit = lambda a: a / (np.linalg.norm(a, axis=-1, keepdims=True) + 1e-8)
    cdist = lambda a, b: np.sqrt(((a[:, None] - b[None]) ** 2).sum(-1))
    c = group[0]
    merged = {k: v[c] * w[0] for k, v in experts.items()}
    for j, idx in enumerate(group[1:]):
        cost = cdist(unit(act_all[c]), unit(act_all[idx])) + cdist(unit(wfeat[c]), unit(wfeat[idx]))
        I = cost.shape[0]
        perm = min(itertools.permutations(range(I)), key=lambda p: sum(cost[i, p[i]] for i in range(I)))
        perm = list(perm)
        merged["gate"] = merged["gate"] + w[j + 1] * experts["gate"][idx][perm]
        merged["up"] = merged["up"] + w[j + 1] * experts["up"][idx][perm]
        merged["down"] = merged["down"] + w[j + 1] * experts["down"][idx][:, perm]
    return merged


def test_ream_matches_the_official_transcription():
    N, I, H, T, k, K = 5, 4, 6, 30, 2, 2
    W = _random_layer(N=N, I=I, H=H, seed=5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    z = x @ W["router"].double().T                                   # gate logits [T, N]
    p = torch.softmax(z, -1)
    top = p.topk(k, dim=-1).indices
    silu = torch.nn.functional.silu
    hid = cp.expert_hidden(W["gate"].double(), W["up"].double(), x, silu)              # [N, T, I]
    f = torch.einsum("nti,nhi->tnh", hid, W["down"].double())                          # [T, N, H]
    # recorder sums (the official computes the same from per-token tensors)
    o, s = cp.ream_sums(z, f, top)
    count = torch.bincount(top.reshape(-1), minlength=N).double()
    feats = {"count": count, "logit_gram": z.T @ z, "ream_out_sum": o, "ream_sal_sum": s, "x_sample": x.float()}
    out = cp.merge_layer("ream", W, feats, K, group_size=3)
    # official: saliency = mean over routed tokens of ||p f|| * p; expert_logits = mean_t p f
    final = (p[..., None] * f).numpy()
    sal = np.zeros(N)
    for e in range(N):
        rows = [t for t in range(T) if e in top[t].tolist()]
        sal[e] = np.mean([np.linalg.norm(final[t, e]) * float(p[t, e]) for t in rows]) if rows else 0.0
    if (sal == 0).any():
        sal[sal == 0] = min(0.5, sal[sal > 0].min())
    labels, cents, d = _official_pseudo_group(sal, final.mean(0)[:, None, :], K, z.numpy(), 3)
    # ours sums the fp32 softmax (as the official forward), the transcription a float64 one: the rows'
    # relative error (N + 4 fp32 steps) moves a cosine distance (<= 1) by at most twice that
    assert np.allclose(cp.ream_distance(o, z.T @ z).numpy(), d, rtol=0,
                       atol=2 * tol(torch.float32, N + 4) + tol(torch.float64, 4 * (T + N + H)))
    groups = sorted(sorted(int(e) for e in np.where(labels == c)[0]) for c in range(K))
    assert out["groups"] == groups
    wfeat = cp.ream_weight_features(W["gate"].double(), W["up"].double(), W["down"].double()).numpy()
    experts = {k2: W[k2].double().numpy() for k2 in ("gate", "up", "down")}
    act_all = hid.transpose(1, 2).numpy()                                               # [N, I, T]
    for gi, grp in enumerate(out["groups"]):
        c = [e for e in grp if e in cents.tolist()][0]
        order = [c] + [e for e in grp if e != c]
        ref = _official_merge(experts, order, sal, act_all, wfeat)
        for k2 in ("gate", "up", "down"):
            # fp32 output of a float64 merge (the transcription is float64 too)
            bound = tol(torch.float32, 2, np.abs(ref[k2]).max())
            assert np.allclose(out[k2][gi].numpy(), ref[k2], rtol=0, atol=bound), (k2, grp)
        assert torch.equal(out["router"][gi], W["router"][c])
    assert out["info"]["centroids"] == [int(c) for c in sorted(cents.tolist(), key=lambda c: [
        grp for grp in groups if c in grp][0])]


def test_ream_weight_features_are_the_exact_pca_of_normalised_neuron_rows():
    W = _random_layer(N=3, I=4, H=2, seed=6)
    feat = cp.ream_weight_features(W["gate"], W["up"], W["down"], pca_dim=3)
    F = np.concatenate([W["gate"].numpy(), W["up"].numpy(), W["down"].numpy().transpose(0, 2, 1)], 2).astype(np.float64)
    F = F / (np.linalg.norm(F, axis=-1, keepdims=True) + 1e-8)
    X = F.reshape(12, 6)
    X = X - X.mean(0)
    U, S, Vt = np.linalg.svd(X, full_matrices=False)
    ref = (X @ (Vt[:3].T * S[:3])).reshape(3, 4, 3)
    # principal axes are defined up to sign: compare column by column
    got = feat.numpy()
    for r in range(3):
        sgn = np.sign((got[..., r] * ref[..., r]).sum())
        # two float64 SVDs of X [12, 6]: backward stable, a small multiple (10) of the sizes times eps ||X||_F
        bound = tol(torch.float64, 10 * (12 + 6), np.linalg.norm(X))
        assert np.allclose(got[..., r], sgn * ref[..., r], rtol=0, atol=bound)


# ----------------------------------------------------------------------------- end to end

@pytest.mark.parametrize("method", cp.COMPARATORS)
def test_merged_tiny_qwen3_moe_loads_and_generates(method, tmp_path):
    from transformers import Qwen3MoeForCausalLM
    model = tiny_qwen3_moe(N=6, k=2, layers=2)
    feats = cp.collect(model, BATCHES, methods=(method,), sample_tokens=12)
    K = 3
    for (name, block), f in zip(blk.moe_blocks(model), feats):
        W = _weights(block)
        out = cp.merge_layer(method, W, f, K)
        assert len(out["groups"]) == K and sorted(e for g in out["groups"] for e in g) == list(range(6))
        router = out["router"]
        if router is None:
            router = torch.stack([sum(w * W["router"][e] for e, w in zip(g, cp.frequency_weights(f["count"], g)))
                                  for g in out["groups"]])
        block.experts.gate_up_proj = torch.nn.Parameter(torch.cat([out["gate"], out["up"]], 1), requires_grad=False)
        block.experts.down_proj = torch.nn.Parameter(out["down"], requires_grad=False)
        block.gate.weight = torch.nn.Parameter(router, requires_grad=False)
        for mod in (block, block.gate, block.experts):
            for attr in blk.EXPERT_FIELDS:
                if isinstance(getattr(mod, attr, None), int):
                    setattr(mod, attr, K)
    model.config.num_experts = K
    model.save_pretrained(tmp_path)
    again = Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    with torch.no_grad():
        logits = again(input_ids=ids).logits
        gen = again.generate(ids, max_new_tokens=3, do_sample=False)
    assert logits.shape == (1, 5, 32) and bool(torch.isfinite(logits).all())
    assert gen.shape == (1, 8)


# ----------------------------------------------------------------------------- errors

def test_merge_layer_errors_name_the_problem():
    W = _random_layer()
    feats = {"count": torch.ones(4), "logit_gram": torch.eye(4, dtype=torch.float64)}
    with pytest.raises(ValueError, match="unknown comparator"):
        cp.merge_layer("ties", W, feats, 2)
    with pytest.raises(ValueError, match="unknown option"):
        cp.merge_layer("namex", W, feats, 2, rank=3)
    with pytest.raises(ValueError, match=r"features \['out_cos_sum', 'tokens'\] missing"):
        cp.merge_layer("submoe", W, feats, 2)
    with pytest.raises(ValueError, match="K=5"):
        cp.merge_layer("namex", W, feats, 5)
    with pytest.raises(ValueError, match="shape"):
        cp.merge_layer("namex", dict(W, down=W["down"].transpose(1, 2)), feats, 2)
    with pytest.raises(ValueError, match="disjoint"):
        cp.merge_layer("namex", W, feats, 2, groups=[[0, 1], [1, 2, 3]])
    with pytest.raises(ValueError, match="merging"):
        cp.merge_layer("ream", W, dict(feats, ream_out_sum=torch.ones(4, 5), ream_sal_sum=torch.ones(4),
                                       x_sample=torch.ones(3, 5)), 2, merging="ties")
