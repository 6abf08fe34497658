"""Hand-computed pins of the merge lines a plausible edit could break silently (paper §4.4:
"the router row of a merged expert is merged with the same weights"; App. B.2: weights from
the pooled calibration counts; HC-SMoE, arXiv 2410.08589 §3: average linkage).

Each test names the line it guards:
- router rows merged with the merge weights, in memory (`merging.merge_block`) and streaming
  (`merging.merge_streaming`), not averaged uniformly;
- DeepSeek-V3's `e_score_correction_bias` merged with the same weights (not a member's own);
- `planning.make_plan` weights from the pooled raw counts, not the phase-balanced P(e);
- HC-SMoE dispatched with average linkage (`baselines.baseline_groups`, `model.plan`).
"""
import math

import pytest
import torch
from safetensors.torch import load_file

from rolemerge import baselines as bl
from rolemerge import calibrate as cal
from rolemerge import merge as mg
from rolemerge import model as rm
from helpers import tol
from test_rolemerge_families import build
from rolemerge import blocks as blk
from rolemerge import stats as rstats
from rolemerge import planning
from rolemerge import merging

GROUPS = [[0, 1, 2], [3], [4, 5], [6, 7]]
MASS = torch.tensor([5., 1, 2, 7, 3, 1, 4, 4], dtype=torch.float64)


def plan_for(n_layers):
    w = rm.merge_weights(MASS, GROUPS)
    assert w[0] == [5 / 8, 1 / 8, 2 / 8] and w[2] == [3 / 4, 1 / 4]          # hand-computed, not uniform
    return {"groups": [GROUPS] * n_layers, "weights": [w] * n_layers, "routing": {}}


def expected_rows(t):
    """sum_{e in G} omega_e t[e] in float64 for every group (the §4.4 merge, by hand)."""
    out = []
    for g in GROUPS:
        m = MASS[g]
        out.append(sum(float(m[i] / m.sum()) * t[e].double() for i, e in enumerate(g)))
    return torch.stack(out)


@pytest.mark.parametrize("path", ["memory", "streaming"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_router_rows_and_score_bias_merge_with_the_merge_weights(family, path, tmp_path):
    model = build(family)
    blocks = blk.moe_blocks(model)
    with torch.no_grad():
        for _, b in blocks:
            if hasattr(b.gate, "e_score_correction_bias"):
                b.gate.e_score_correction_bias.copy_(torch.arange(8, dtype=torch.float32) * 0.1 + 0.05)
    before = {n: (b.gate.weight.detach().clone(), getattr(b.gate, "e_score_correction_bias", None)) for n, b in blocks}
    before = {n: (w, None if bias is None else bias.clone()) for n, (w, bias) in before.items()}
    plan = plan_for(len(blocks))
    if path == "memory":
        merging.merge_model(model, plan)
        got = {n: (b.gate.weight.detach(), getattr(b.gate, "e_score_correction_bias", None)) for n, b in blocks}
    else:
        model.save_pretrained(tmp_path / "src")
        merging.merge_streaming(str(tmp_path / "src"), str(tmp_path / "dst"), plan)
        sd = {}
        for f in (tmp_path / "dst").glob("*.safetensors"):
            sd.update(load_file(str(f)))
        got = {n: (sd[f"{n}.gate.weight"], sd.get(f"{n}.gate.e_score_correction_bias")) for n in before}
    G = max(map(len, GROUPS))
    for n, (w0, b0) in before.items():
        w, bias = got[n]
        assert w.shape[0] == len(GROUPS)
        # fp32 rows: a weighted sum of <= G members (weights summing to 1), rounded to fp32
        bound = tol(torch.float32, G + 1, w0.abs().max())
        torch.testing.assert_close(w.double(), expected_rows(w0), atol=bound, rtol=0)
        assert (w[0].double() - w0[:3].double().mean(0)).abs().max() > bound     # uniform differs
        if family == "deepseek_v3":
            assert bias is not None
            bound = tol(torch.float32, G + 1, b0.abs().max())
            # group {0,1,2}: (5 * .05 + 1 * .15 + 2 * .25) / 8 = .1125 (a member's own: .05)
            assert abs(float(bias[0]) - 0.1125) <= bound
            torch.testing.assert_close(bias.double(), expected_rows(b0[:, None])[:, 0], atol=bound, rtol=0)


def _stats(counts):
    """A stats dict of one source with counts [L, B, N] (question / answer buckets)."""
    L, B, N = counts.shape
    return {"num_experts": N, "layer_names": [f"model.layers.{i}.mlp" for i in range(L)],
            "buckets": ["question", "answer"],
            "sources": {"a": {"counts": counts, "tokens": counts.sum(-1)[0] // 2, "examples": 1}}}


def test_make_plan_weights_come_from_the_pooled_raw_counts():
    """K = 1 puts all experts in one group: omega = pooled counts / total = [6, 2, 1, 1] / 10.
    The phase-balanced P(e) (question [.75, .25, 0, 0], answer [0, 0, .5, .5], each 1/2) would
    give [.375, .125, .25, .25]."""
    counts = torch.tensor([[[6, 2, 0, 0], [0, 0, 1, 1]]])
    plan = planning.make_plan(_stats(counts), 1)
    assert plan["groups"] == [[[0, 1, 2, 3]]]
    exact = tol(torch.float64, 4 + 1, 1.0)     # float64 counts over a sum of 4: exact but for the division
    assert plan["weights"][0][0] == pytest.approx([0.6, 0.2, 0.1, 0.1], rel=0, abs=exact)
    # and with K = 2 (whatever the grouping) every group's weights are its pooled counts normalised
    counts = torch.tensor([[[30, 10, 5, 5], [1, 3, 40, 2]]])
    plan = planning.make_plan(_stats(counts), 2)
    mass = counts.sum(1)[0].double()
    for g, w in zip(plan["groups"][0], plan["weights"][0]):
        assert w == pytest.approx([float(mass[e] / mass[g].sum()) for e in g], rel=0, abs=exact)


# ----------------------------------------------------------------------------- HC-SMoE linkage

ANGLES = [0, 10, 21, 33, 46, 58, 61, 88]      # a chain on the unit circle, then one far expert
AVERAGE = [[0, 1, 2, 3], [4, 5, 6, 7]]        # average (and complete) linkage, K = 2
SINGLE = [[0, 1, 2, 3, 4, 5, 6], [7]]         # single linkage chains


def _naive(X, K, linkage, dist):
    """Textbook agglomerative clustering (recomputes every cluster distance), for the check
    that the expected partitions hold for the cosine AND the Euclidean distance."""
    D = 1 - torch.nn.functional.normalize(X, dim=1) @ torch.nn.functional.normalize(X, dim=1).T \
        if dist == "cosine" else torch.cdist(X, X)
    cl = [[i] for i in range(len(X))]
    agg = {"single": min, "average": lambda v: sum(v) / len(v)}[linkage]
    while len(cl) > K:
        _, i, j = min((agg([float(D[a, b]) for a in cl[i] for b in cl[j]]), i, j)
                      for i in range(len(cl)) for j in range(i + 1, len(cl)))
        cl[i] = sorted(cl[i] + cl.pop(j))
    return sorted(cl)


def test_hcsmoe_uses_average_linkage_whatever_the_distance():
    X = torch.tensor([[math.cos(math.radians(a)), math.sin(math.radians(a))] for a in ANGLES], dtype=torch.float64)
    for dist in ("cosine", "euclidean"):                      # the case separates the linkages under both
        assert _naive(X, 2, "average", dist) == AVERAGE and _naive(X, 2, "single", dist) == SINGLE
    tokens = 4
    feats = {"count": torch.ones(8), "logit_gram": torch.eye(8), "out_sum": X * tokens, "reap_sum": torch.ones(8),
             "tokens": tokens}
    assert bl.baseline_groups("hcsmoe", feats, 2) == AVERAGE
    # through the plan, whose default linkage (RoleMerge's) is single: HC-SMoE keeps its own
    counts = torch.ones(1, 2, 8, dtype=torch.float64)
    groups = bl.plan_groups("hcsmoe", [feats], 2)
    assert groups == [AVERAGE]


# ----------------------------------------------------------------------------- MI retention, empty phase bucket

def test_mi_retention_of_a_record_ignores_an_empty_phase_bucket():
    """A text-only source beside image sources has an empty image bucket. Question [3, 1, 0, 0],
    answer [0, 0, 1, 3]: every expert is phase-pure, I(S;B) = ln 2; groups {0,2}, {1,3} each
    hold P(G, q), P(G, a) = .375, .125 (or reversed) with P(G) = P(b) = 1/2, so
    I(C;B) = .75 ln 1.5 - .25 ln 2 and the retention is (.75 ln 1.5 - .25 ln 2) / ln 2 = 0.18872.
    With the empty bucket in front the joint used to sum to 2/3 and the retention moved."""
    two = torch.tensor([[3., 1, 0, 0], [0, 0, 1, 3]])
    three = torch.cat([torch.zeros(1, 4), two])
    groups = [[0, 2], [1, 3]]
    want = (0.75 * math.log(1.5) - 0.25 * math.log(2)) / math.log(2)
    # float64: distributions over 3 x 4 cells, a log per cell, sums, a ratio of two informations (<= ln 2)
    exact = tol(torch.float64, 3 * 4 * 3 + 4, 1.0)
    assert rm.mi_retention([two], groups) == pytest.approx(want, rel=0, abs=exact)
    assert rm.mi_retention([three], groups) == pytest.approx(want, rel=0, abs=exact)
    P_e, q = rm.role_profiles(rm.phase_distributions(three))
    assert float(P_e.sum()) == pytest.approx(1.0, rel=0, abs=exact)
    assert rm.mutual_information(P_e, q) == pytest.approx(math.log(2), rel=0, abs=exact)
    # the plan's per-layer and summary retention use the same per-record profiles
    stats = {"num_experts": 4, "layer_names": ["model.layers.0.mlp"], "buckets": ["image", "question", "answer"],
             "sources": {"text": {"counts": three[None].long(), "tokens": torch.tensor([0, 2, 2]), "examples": 1},
                         "vl": {"counts": torch.tensor([[[4, 0, 0, 0], [3, 1, 0, 0], [0, 0, 1, 3]]]),
                                "tokens": torch.tensor([2, 2, 2]), "examples": 1}}}
    plan = planning.make_plan(stats, 2)
    rec = {n: rm.mi_retention([s["counts"][0]], plan["groups"][0]) for n, s in stats["sources"].items()}
    rec_two = rm.mi_retention([two], plan["groups"][0])
    assert rec["text"] == pytest.approx(rec_two, rel=0, abs=2 * exact)   # both sides round


def test_an_empty_image_bucket_says_what_to_add():
    """rolemerge.calibrate on text-only records of a VLM: the error names the empty bucket and the fix."""
    stats = {"buckets": ["image", "question", "answer"],
             "sources": {"text": {"tokens": torch.tensor([0, 5, 3])}}}
    with pytest.raises(cal.CalibrationError, match=r"phase bucket 'image' is empty over all calibration sources "
                                                   r"\(the records have no images\): add records with images"):
        rstats.check_nonempty(stats)
