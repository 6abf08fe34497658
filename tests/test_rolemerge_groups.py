"""Group-limited routing (DeepSeek-V2 group_limited_greedy, DeepSeek-V3) under RoleMerge
(rolemerge/merge.py routing_groups, rolemerge/model.py plan(blocks=...)).

The repro cases of the issue: merged to K experts, a V3 model with (N, top_k, n_group,
topk_group) = (8, 2, 4, 2), (8, 2, 2, 1), (8, 2, 4, 1) crashed ("selected index k out of
range") and (16, 4, 4, 1) at K = 8 put half of its top-k picks in masked-out groups."""
import pytest
import torch

from rolemerge import calibrate as cal
from rolemerge import merge as mg
from rolemerge import model as rm
from tests.test_rolemerge_merge import DS, QUESTIONS, TEXT, save, tok  # noqa: F401  (tok: fixture)
from rolemerge import blocks as blk
from rolemerge import stats as rstats
from rolemerge import planning
from rolemerge.planning import MergeConfig


def test_routing_groups_hand_values():
    v3 = lambda N, k, n, tg, K: planning.routing_groups("deepseek_v3", dict(n_group=n, topk_group=tg), N, K, k)
    assert v3(8, 2, 4, 2, 8) == (4, {})                                        # unmerged: unchanged
    assert v3(8, 2, 2, 1, 4) == (2, {})                                        # 2 per group, 1 group x 2 >= 2
    assert v3(8, 2, 4, 2, 4) == (2, {"n_group": 2, "topk_group": 1})           # 1 per group < 2: coarsen
    assert v3(8, 2, 2, 1, 2) == (1, {"n_group": 1, "topk_group": 1})
    assert v3(8, 2, 4, 1, 4) == (2, {"n_group": 2, "topk_group": 1})
    assert v3(16, 4, 4, 1, 8) == (4, {"n_group": 4, "topk_group": 2})          # keep groups, widen topk_group
    assert v3(16, 2, 8, 4, 12) == (4, {"n_group": 4, "topk_group": 2})         # 8 does not divide 12; 4 groups of 3, half kept
    v2 = lambda topk_method, n, tg, K: planning.routing_groups("deepseek_v2", dict(topk_method=topk_method, n_group=n,
                                                                           topk_group=tg), 8, K, 2)
    assert v2("greedy", 4, 1, 3) == (1, {})                                     # not group-limited
    assert v2("group_limited_greedy", 4, 2, 4) == (4, {})                       # V2 needs only 1 per group
    assert v2("group_limited_greedy", 4, 1, 4) == (4, {"n_group": 4, "topk_group": 2})
    assert planning.routing_groups("qwen3_moe", {}, 8, 3, 2) == (1, {})
    with pytest.raises(mg.MergeError, match=r"K=1 leaves no valid group-limited routing.*valid K: \[2, 3"):
        v3(8, 1, 1, 1, 1)                                                       # V3 scores groups by their top-2
    with pytest.raises(mg.MergeError, match=r"valid K: \[3, 4, 5"):
        v3(8, 3, 1, 1, 2)                                                       # fewer experts than top_k


def test_plan_blocks_keeps_groups_inside_blocks():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (2, 3, 16), generator=g).double()
    for method in ("rolemerge", "kmeans", "prune", "frequency"):
        groups, _ = rm.plan(counts, 8, method, routers=[torch.randn(16, 4, generator=g)] * 2, blocks=4)
        for layer in groups:
            assert len(layer) == 8 and layer == sorted(layer)
            for i, grp in enumerate(layer):
                assert {e // 4 for e in grp} == {i // 2}, (method, layer)    # merged expert i lies in block i // 2
    with pytest.raises(ValueError, match="must divide"):
        rm.plan(counts, 6, blocks=4)


def build_ds(tok, family, N, top_k, n_group, topk_group, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ds = dict(DS, n_group=n_group, topk_group=topk_group)
    extra = dict(topk_method="group_limited_greedy") if family == "deepseek_v2" else {}
    cfg = AutoConfig.for_model(family, **TEXT, **ids, num_experts_per_tok=top_k, n_routed_experts=N,
                               first_k_dense_replace=1, **ds, **extra)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if family == "deepseek_v3":      # a non-zero score-correction bias, merged with the router rows
        for _, b in blk.moe_blocks(model):
            b.gate.e_score_correction_bias.normal_(0, 0.1)
    return model


def masked_picks(model, batch):
    """Fraction of top-k picks outside the token's selected routing groups (recomputed from the
    router's own logits as transformers' router does) and the number of picks checked."""
    bad, total = [0], [0]

    def hook(gate, args, out):
        logits, _, idx = out
        n, tg, E = gate.num_group, gate.topk_group, gate.num_experts
        if hasattr(gate, "e_score_correction_bias"):     # V3: sigmoid + bias, group score = sum of top-2
            s = logits.sigmoid() + gate.e_score_correction_bias
            gs = s.view(-1, n, E // n).topk(2, dim=-1)[0].sum(-1)
        else:                                            # V2: softmax, group score = max
            gs = logits.softmax(-1).view(-1, n, E // n).max(-1).values
        chosen = gs.topk(tg, dim=-1)[1]                                  # [T, tg]
        grp = idx // (E // n)                                            # [T, top_k]
        ok = (grp[:, :, None] == chosen[:, None, :]).any(-1)
        bad[0] += int((~ok).sum())
        total[0] += ok.numel()

    hs = [b.gate.register_forward_hook(hook) for _, b in blk.moe_blocks(model)]
    with torch.no_grad():
        model(**batch)
    for h in hs:
        h.remove()
    return bad[0] / total[0], total[0]


CASES = [  # family, N, top_k, n_group, topk_group, K, expected (n_group, topk_group) after the merge
    ("deepseek_v3", 8, 2, 4, 2, 4, (2, 1)),
    ("deepseek_v3", 8, 2, 2, 1, 2, (1, 1)),
    ("deepseek_v3", 8, 2, 4, 1, 4, (2, 1)),
    ("deepseek_v3", 16, 4, 4, 1, 8, (4, 2)),
    ("deepseek_v2", 8, 2, 4, 2, 4, (4, 2)),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{c[4]}-K{c[5]}" for c in CASES])
def test_group_limited_merge_loads_runs_routes_inside_groups(case, tok, tmp_path):
    from transformers import AutoModelForCausalLM
    family, N, top_k, n_group, topk_group, K, want = case
    model = build_ds(tok, family, N, top_k, n_group, topk_group)
    src = save(model, tok, tmp_path / "src")
    stats = cal.calibrate(model, tok, {"a": [{"question": q} for q in QUESTIONS]}, batch_size=3, max_new_tokens=3,
                          model_id=src, progress=False)
    sp = str(tmp_path / "stats.safetensors")
    rstats.save_stats(stats, sp)
    rep = mg.run_merge(MergeConfig(model=src, stats=sp, out=str(tmp_path / "mem"), k=K, in_memory=True))
    mg.run_merge(MergeConfig(model=src, stats=sp, out=str(tmp_path / "stream"), k=K))
    width = N // want[0]
    for layer in rep["groups"]:                 # every merged expert inside one routing group of the merged model
        assert all(len({e // width for e in g}) == 1 and g[0] // width == i // (K // want[0]) for i, g in enumerate(layer))
    batch = cal.text_inputs(tok, QUESTIONS)
    for d in ("mem", "stream"):
        m2 = AutoModelForCausalLM.from_pretrained(str(tmp_path / d)).eval()
        tc = blk.text_config(m2.config)
        assert (tc.n_routed_experts, tc.n_group, tc.topk_group) == (K, *want)
        frac, n = masked_picks(m2, batch)
        assert n > 0 and frac == 0.0
        out = m2.generate(**batch, max_new_tokens=3, do_sample=False)
        assert out.shape[1] > batch["input_ids"].shape[1]
    a = AutoModelForCausalLM.from_pretrained(str(tmp_path / "mem")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "stream")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_group_limited_no_valid_k_is_a_clear_error(tok, tmp_path):
    model = build_ds(tok, "deepseek_v3", 8, 1, 1, 1)
    src = save(model, tok, tmp_path / "src")
    stats = cal.calibrate(model, tok, {"a": [{"question": q} for q in QUESTIONS[:2]]}, batch_size=2,
                          max_new_tokens=2, model_id=src, progress=False)
    rstats.save_stats(stats, str(tmp_path / "s.safetensors"))
    with pytest.raises(mg.MergeError, match="valid K"):
        mg.run_merge(MergeConfig(model=src, stats=str(tmp_path / "s.safetensors"), out=str(tmp_path / "out"), k=1))
    assert not (tmp_path / "out").exists()
