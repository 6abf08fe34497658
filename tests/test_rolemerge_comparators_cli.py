"""Every comparison method by command (rolemerge.calibrate --features, rolemerge.merge --method M),
the router operators ("bound": the M-SMoE / HC-SMoE codes' N slots bound to their group's merge;
"average": K rows) and the per-layer hook for methods that produce their own tensors
(rolemerge/comparators.py), on tiny models of the fused (Qwen3-VL-MoE), per-expert (Mixtral,
DeepSeek-V3 with a router bias) and DeepSeek-VL2 layouts."""
import json
import os
import types

import pytest
import torch
from safetensors.torch import load_file

from common import backbone as bb
from helpers import error_of, expert_tol, router_tol, tiny_qwen3_moe, tol
from rolemerge import baselines as bl
from rolemerge import calibrate as cal
from rolemerge import comparators
from rolemerge import infer
from rolemerge import merge as mg
from rolemerge import model as rm
from rolemerge import blocks as blk
from rolemerge import stats as rstats
from rolemerge import shards as sh
from rolemerge import planning
from rolemerge import merging
from rolemerge.planning import MergeConfig


def on_disk(path):
    from common.checkpoint import safetensors_files
    out = {}
    for f in safetensors_files(str(path)):
        out.update(load_file(f))
    return out


# ----------------------------------------------------------------------------- router operators

GROUPS = [[0, 3], [1, 2, 5], [4], [6, 7]]


def test_bound_operator_hand_computed_and_equal_to_oracle_routing():
    """Bound: token x routes with the ORIGINAL router, s = softmax(W0 x), top-2 renormalised;
    slot e holds Theta_{g(e)} = sum_{m in g(e)} omega_m Theta_m, so the output is
    sum_j w_j f_{g(e_j)}(x), written out here. It is the same function as the K-expert merge
    under `infer.oracle_routing`; with singleton groups it is the unmerged model."""
    import copy
    base = tiny_qwen3_moe(N=8)
    blk0 = blk.moe_blocks(base)[0][1]
    W0 = blk0.gate.weight.detach().clone()
    mass = torch.tensor([3.0, 1, 2, 5, 4, 1, 1, 2])
    weights = rm.merge_weights(mass, GROUPS)
    x = torch.randn(7, 16)
    # by hand
    gu, dn = blk0.experts.gate_up_proj.detach(), blk0.experts.down_proj.detach()
    lut = {e: gi for gi, g in enumerate(GROUPS) for e in g}
    mgu = [sum(w * gu[e] for e, w in zip(g, ws)) for g, ws in zip(GROUPS, weights)]
    mdn = [sum(w * dn[e] for e, w in zip(g, ws)) for g, ws in zip(GROUPS, weights)]
    p = torch.softmax(x @ W0.T, -1)
    w, idx = p.topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    want = torch.zeros(7, 16)
    for t in range(7):
        for j in range(2):
            g = lut[int(idx[t, j])]
            a, b = (mgu[g] @ x[t]).chunk(2)
            want[t] += w[t, j] * (mdn[g] @ (torch.nn.functional.silu(a) * b))
    bound = copy.deepcopy(base)
    merging.merge_model(bound, {"groups": [GROUPS], "weights": [weights], "router": "bound", "K": 4})
    bb_ = blk.moe_blocks(bound)[0][1]
    assert bb_.gate.weight.shape[0] == 8 and torch.equal(bb_.gate.weight, W0)       # router untouched
    assert torch.equal(bb_.experts.down_proj[1], bb_.experts.down_proj[5])           # members share the merge
    with torch.no_grad():
        got = bb_(x[None])[0]
    # both sides' expert rounding, the renormalised gates (4 x the router logits' error) on |y|, the sum of 2
    ymax = want.abs().max().item()
    bound = 2 * expert_tol(bb_.experts, x) + 4 * router_tol(x, W0) * ymax + tol(torch.float32, 3, ymax)
    torch.testing.assert_close(got, want, rtol=0, atol=bound)
    avg = copy.deepcopy(base)
    merging.merge_model(avg, {"groups": [GROUPS], "weights": [weights], "router": "average", "K": 4})
    with torch.no_grad(), infer.oracle_routing(avg, [W0], [GROUPS]):
        oracle = blk.moe_blocks(avg)[0][1](x[None])[0]
    torch.testing.assert_close(got, oracle, rtol=0, atol=bound)
    with torch.no_grad():                                   # the averaged K-row router is another function
        assert (blk.moe_blocks(avg)[0][1](x[None])[0] - want).abs().max() > bound
    single = copy.deepcopy(base)
    merging.merge_model(single, {"groups": [[[e] for e in range(8)]], "weights": [[[1.0]] * 8], "router": "bound", "K": 8})
    with torch.no_grad():
        assert torch.equal(blk.moe_blocks(single)[0][1](x[None])[0], blk0(x[None])[0])


def test_router_operator_defaults_and_refusals():
    assert planning.router_operator("msmoe") == planning.router_operator("hcsmoe") == "bound"
    assert planning.router_operator("rolemerge") == planning.router_operator("reap") == "average"
    assert planning.router_operator("hcsmoe", "average") == "average" and planning.router_operator("rolemerge", "bound") == "bound"
    for m in ("reap", "prune"):
        with pytest.raises(mg.MergeError, match="prunes experts"):
            planning.router_operator(m, "bound")


# ----------------------------------------------------------------------------- calibration features

@pytest.fixture(scope="module")
def tok():
    return bb.build_tokenizer()


def _records(tmp_path, n=4):
    import random
    from common import shapes
    rng, out = random.Random(0), []
    for i in range(n):
        scene, _, q, a = shapes.sample_example(rng)
        p = str(tmp_path / f"im{i}.png")
        shapes.render(scene).save(p)
        out.append({"id": str(i), "question": q, "image": p, "answer": a})
    return out


def _build(family, tok, dtype=None):
    """A tiny checkpoint of `family` (its model and tokenizer / processor)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    if family == "qwen3_vl_moe":
        return bb.build_tiny("qwen3_vl_moe", seed=0, hidden=32, layers=2, experts=8, top_k=2)
    extra = {"mixtral": dict(num_local_experts=8),
             "deepseek_v3": dict(n_routed_experts=8, first_k_dense_replace=1, moe_intermediate_size=16,
                                 n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                 qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)}[family]
    cfg = AutoConfig.for_model(family, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=4, max_position_embeddings=256, vocab_size=len(tok),
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, num_experts_per_tok=2,
                               **extra)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if family == "deepseek_v3":                          # a non-zero score-correction bias, merged too
        for _, b in blk.moe_blocks(model):
            b.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    return model, tok


def _calibrated(family, tok, tmp_path, dtype=None):
    """Checkpoint dir + stats path (features written next to it) of a tiny `family` model."""
    model, proc = _build(family, tok, dtype)
    src = str(tmp_path / "src")
    model.save_pretrained(src, max_shard_size="40KB")
    proc.save_pretrained(src)
    if family == "qwen3_vl_moe":
        recs = _records(tmp_path)
        sources = {"a": recs[:2], "b": recs[2:]}
    else:
        sources = {"a": [{"question": q} for q in ("is there a red circle?", "count the shapes", "x")]}
    stats = cal.calibrate(model, proc, sources, batch_size=2, max_new_tokens=4, model_id=src, progress=False,
                          features=True)
    sp = str(tmp_path / "stats.safetensors")
    feats = stats.pop("features")
    rstats.save_stats(stats, sp)
    bl.save_features(feats, bl.features_path(sp), {"fingerprint": stats["fingerprint"]})
    return src, sp, stats, feats


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "mixtral", "deepseek_v3"])
def test_features_count_the_same_tokens_as_the_stats(family, tok, tmp_path):
    """The baseline features are recorded in the decoding pass over exactly the tokens the routing
    statistics count (prefill non-padding positions + fed-back answer tokens): their per-expert
    top-k counts equal the stats' counts summed over phases, their token count the stats' tokens."""
    _, sp, stats, feats = _calibrated(family, tok, tmp_path)
    tot = rstats.total_counts(stats)
    assert all(torch.equal(f["count"], tot[l].sum(0).double()) for l, f in enumerate(feats))
    assert all(f["tokens"] == int(sum(s["tokens"].sum() for s in stats["sources"].values())) for f in feats)
    back, meta = bl.load_features(bl.features_path(sp))
    assert meta["fingerprint"] == stats["fingerprint"] and back[0]["tokens"] == feats[0]["tokens"]
    assert torch.equal(back[-1]["out_sum"], feats[-1]["out_sum"])


# ----------------------------------------------------------------------------- own-tensor hook

def _wavg_module():
    """A comparator that returns the weighted-average merge (groups: consecutive pairs, weights:
    activation frequency from its features), through the rolemerge/comparators.py contract."""
    mod = types.ModuleType("rolemerge.comparators")
    mod.COMPARATORS = ("wavg",)
    seen = []

    def merge_layer(method, W, feats, K, **opts):
        assert method == "wavg" and set(W) >= {"gate", "up", "down", "router"}
        N = W["gate"].shape[0]
        assert W["gate"].dtype == torch.float32 and W["down"].shape[1:] == W["gate"].shape[1:][::-1]
        groups = [[2 * i, 2 * i + 1] for i in range(N // 2)][::-1]          # unsorted on purpose
        weights = rm.merge_weights(feats["count"], groups)
        seen.append(groups)
        out = {k: torch.stack([merging.weighted_sum([W[k][e] for e in g], w, torch.float32) for g, w in zip(groups, weights)])
               for k in ("gate", "up", "down")}
        return dict(out, groups=groups, router=None, bias=None)

    mod.merge_layer, mod.seen = merge_layer, seen
    return mod


@pytest.mark.parametrize("family,dtype", [("qwen3_vl_moe", None), ("mixtral", torch.bfloat16), ("deepseek_v3", None)])
def test_own_tensor_hook_equals_the_weighted_sum_path_bit_for_bit(family, dtype, tok, tmp_path, monkeypatch):
    """A comparator returning the weighted-average merge through the hook (canonical float32
    layout in, checkpoint layout and dtype out, router None -> averaged rows) writes exactly the
    bytes of the weighted-sum path with the same groups, in memory and streaming."""
    fake = _wavg_module()
    monkeypatch.setattr(planning, "comparators", fake)     # the modules that dispatch to the comparators
    monkeypatch.setattr(merging, "comparators", fake)
    src, sp, stats, feats = _calibrated(family, tok, tmp_path, dtype)
    mass = rstats.total_counts(stats).double().sum(1)
    groups = [[[2 * i, 2 * i + 1] for i in range(4)] for _ in stats["layers"]]
    plan = {"groups": groups, "weights": [rm.merge_weights(mass[l], g) for l, g in enumerate(groups)], "K": 4,
            "routing": {}, "router": "average"}
    merging.merge_streaming(src, str(tmp_path / "ref"), plan)
    rep = mg.run_merge(MergeConfig(model=src, stats=sp, out=str(tmp_path / "stream"), k=4, method="wavg"))
    mg.run_merge(MergeConfig(model=src, stats=sp, out=str(tmp_path / "mem"), k=4, method="wavg", in_memory=True))
    assert rep["streaming"] and rep["groups"] == groups and rep["weights"] == plan["weights"] and len(fake.seen) == 2 * len(groups)
    ref = on_disk(tmp_path / "ref")
    for d in ("stream", "mem"):
        got = on_disk(tmp_path / d)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), d
        assert all(got[k].dtype == ref[k].dtype for k in ref)
    assert any("e_score_correction_bias" in k for k in ref) == (family == "deepseek_v3")


# ----------------------------------------------------------------------------- every method by command

def _vl2_checkpoint(tmp_path):
    import test_rolemerge_deepseek_vl2 as tv
    t = bb.build_tokenizer()
    t.add_tokens(list(tv.SPECIAL.values()) + ["<image>", "<|User|>", "<|Assistant|>"], special_tokens=True)
    t.bos_token, t.eos_token, t.pad_token = tv.SPECIAL["bos"], tv.SPECIAL["eos"], tv.SPECIAL["pad"]
    return tv.make_checkpoint(tmp_path / "vl2", t, False), tv.records(tmp_path, 2)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """{model: (checkpoint, stats, data file)} after `rolemerge.calibrate --features` on tiny-moe
    and on a DeepSeek-VL2-Tiny-shaped checkpoint."""
    out = {}
    tmp = tmp_path_factory.mktemp("cli")
    vl2, vrecs = _vl2_checkpoint(tmp)
    for name, src, recs in (("tiny-moe", "tiny-moe", _records(tmp, 3)), ("vl2", vl2, vrecs)):
        data = tmp / f"{name}.jsonl"
        data.write_text("".join(json.dumps(dict(r, answer=r.get("answer", "red"))) + "\n" for r in recs))
        sp = str(tmp / f"{name}.safetensors")
        cal.main(["--model", src, "--data", str(data), "--out", sp, "--features", "--max-new-tokens", "3",
                  "--batch-size", "3", "--threads", "1"])
        out[name] = (src, sp, str(data))
    return out


METHODS = ["rolemerge", "msmoe", "hcsmoe", "reap"] + list(comparators.COMPARATORS)


@pytest.mark.parametrize("name", ["tiny-moe", "vl2"])
@pytest.mark.parametrize("method", METHODS)
def test_every_method_by_command_loads_and_generates(calibrated, name, method, tmp_path):
    src, sp, data = calibrated[name]
    out = str(tmp_path / "m")
    mg.main(["--model", src, "--stats", sp, "--k", "4", "--method", method, "--out", out, "--threads", "1"])
    rep = json.load(open(f"{out}/{sh.REPORT}"))
    bound = rep["router"] == "bound"
    assert rep["streaming"] and bound == (method in ("msmoe", "hcsmoe"))
    cfg = json.load(open(f"{out}/config.json"))
    n = (cfg.get("text_config") or cfg.get("language_config"))
    assert next(n[f] for f in blk.EXPERT_FIELDS if f in n) == (8 if bound else 4)
    assert rep["expert_slots"] == (8 if bound else 4) and rep["unique_experts"] == [4] * len(rep["groups"])
    assert (rep["unique_params"] < rep["params"]) == bound
    model, proc = cal.load_model(out)                    # plain transformers (DeepSeek-VL2: our loader)
    blocks = blk.moe_blocks(model)
    assert all(b.gate.weight.shape[0] == (8 if bound else 4) for _, b in blocks)
    if bound:                                            # members of a group hold one merged expert
        g = next(g for g in rep["groups"][0] if len(g) > 1)
        assert torch.equal(blocks[0][1].experts.down_proj[g[0]], blocks[0][1].experts.down_proj[g[1]])
    rec = json.loads(open(data).readline())
    from common import data as dat
    inp = proc.encode([dat.load_image(rec["image"])], [rec["question"]])
    gen = model.generate(**inp, max_new_tokens=3, do_sample=False, eos_token_id=proc.eos_token_id,
                         pad_token_id=proc.pad_token_id)
    assert gen.shape[1] > inp["input_ids"].shape[1]


def test_bound_streaming_equals_in_memory_and_adaptive_counts(calibrated, tmp_path):
    src, sp, _ = calibrated["tiny-moe"]
    for i, extra in enumerate(([], ["--adaptive"], ["--distance", "cosine", "--router", "average"])):
        method = "msmoe" if i == 1 else "hcsmoe"
        for mode in ([], ["--in-memory"]):
            mg.main(["--model", src, "--stats", sp, "--k", "4", "--method", method, "--out",
                     str(tmp_path / f"o{i}{len(mode)}"), "--threads", "1"] + extra + mode)
        a, b = on_disk(tmp_path / f"o{i}0"), on_disk(tmp_path / f"o{i}1")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rep = json.load(open(tmp_path / "o10" / sh.REPORT))
    feats, _ = bl.load_features(bl.features_path(sp))
    ks = bl.msmoe_layer_counts([f["count"] for f in feats], 4)
    assert rep["adaptive"] and rep["unique_experts"] == ks and [l["K"] for l in rep["layers"]] == ks
    assert sum(ks) == pytest.approx(4 * len(ks), abs=len(ks))      # integer counts: each layer rounds by <= 1
    rep = json.load(open(tmp_path / "o20" / sh.REPORT))
    assert rep["distance"] == "cosine" and rep["router"] == "average"


def test_command_errors(calibrated, tmp_path, capsys):
    src, sp, data = calibrated["tiny-moe"]
    import shutil
    bare = str(tmp_path / "bare.safetensors")
    shutil.copy(sp, bare)
    shutil.copy(rstats.summary_path(sp), rstats.summary_path(bare))
    base = ["--model", src, "--k", "4", "--out", str(tmp_path / "x"), "--threads", "1"]
    err = error_of(mg.main, base + ["--stats", bare, "--method", "hcsmoe"], capsys)
    assert "rolemerge.calibrate" in err and "--features" in err and "bare.features.safetensors" in err
    assert "--in-memory" in error_of(mg.main, base + ["--stats", sp, "--dtype", "float32"], capsys)
    assert "prunes experts" in error_of(mg.main, base + ["--stats", sp, "--method", "reap", "--router", "bound"], capsys)
    assert "--router bound" in error_of(mg.main, base + ["--stats", sp, "--method", "msmoe", "--adaptive",
                                                         "--router", "average"], capsys)
    assert "--method" in error_of(mg.main, base + ["--stats", sp, "--method", "nope"], capsys)
    assert error_of(cal.main, ["--model", src, "--data", data, "--out", sp, "--features", "--threads", "1"],
                    capsys).startswith("error:")


def test_calibration_without_features_never_leaves_old_features_beside_it(calibrated, tmp_path, capsys):
    """An earlier --features calibration's feature file must not pair with new statistics: refused
    without --overwrite, removed with it (MergeMoE / HC-SMoE would otherwise merge on old features)."""
    import shutil
    src, sp, data = calibrated["tiny-moe"]
    out = str(tmp_path / "s.safetensors")
    shutil.copy(sp, out)
    shutil.copy(bl.features_path(sp), bl.features_path(out))
    argv = ["--model", src, "--data", data, "--out", out, "--max-new-tokens", "3", "--batch-size", "3", "--threads", "1"]
    assert "pass --overwrite" in error_of(cal.main, argv, capsys)
    os.remove(out)  # only the features file left: still refused
    assert "features of an earlier calibration" in error_of(cal.main, argv, capsys)
    cal.main(argv + ["--overwrite"])
    assert os.path.exists(out) and not os.path.exists(bl.features_path(out))


def test_feature_recorder_chunks_tokens_with_the_same_sums(monkeypatch):
    """The all-experts pass runs over token chunks (bounded memory); one token per chunk gives the
    same features as one chunk for the whole batch."""
    model = tiny_qwen3_moe(N=8)
    ids = torch.randint(0, 32, (2, 9))
    batch = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    whole = bl.collect_features(model, batch)[0]
    monkeypatch.setattr(bl.FeatureRecorder, "chunk_bytes", 1)
    tiny = bl.collect_features(model, batch)[0]
    assert torch.equal(whole["count"], tiny["count"]) and whole["tokens"] == tiny["tokens"] == 18
    # float32 matmuls per chunk: each token's expert outputs (helpers.expert_tol, both sides) and router
    # logits (helpers.router_tol) summed over 18 tokens; the gram's entries are products of two logits
    block = cal.moe_blocks(model)[0][1]
    seen = []
    h = block.experts.register_forward_hook(lambda m, a, o: seen.append(a[0].detach()))
    bl.collect_features(model, batch)
    h.remove()
    x = seen[0]
    y = bl.expert_outputs(block.experts, x)
    z = (x @ block.gate.weight.T).abs().max().item()
    e_tol, H = 2 * expert_tol(block.experts, x), x.shape[-1]
    bounds = {"logit_gram": 18 * 2 * 2 * z * router_tol(x, block.gate.weight) + tol(torch.float64, 18, 18 * z * z),
              "out_sum": 18 * e_tol + tol(torch.float64, 18, 18 * y.abs().max()),
              "reap_sum": 18 * (H ** 0.5 * e_tol + 4 * router_tol(x, block.gate.weight) * y.norm(dim=-1).max().item())
              + tol(torch.float64, 18, 18 * y.norm(dim=-1).max())}
    for k in ("logit_gram", "out_sum", "reap_sum"):
        torch.testing.assert_close(whole[k], tiny[k], rtol=0, atol=bounds[k], msg=k)


def test_decode_mask_counts_prefill_and_the_fed_back_tokens_before_eos():
    """Hand case, eos = 9, two rows, row 0 left-padded. Prefill: the attention mask. Decode call s
    feeds token s: row 0 generates 5, 9 (EOS), pad -> fed 5 (counted), 9 (not), pad (not); row 1
    generates 6, 7, 8 -> all fed tokens counted. record_batch counts the same: j < n_i - 1."""
    from types import SimpleNamespace

    class M(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None):
            return masks.append(rec.mask.clone())

    masks, rec = [], SimpleNamespace(mask=None)
    m = M()
    dm = cal.DecodeMask(m, [rec], eos_id=9)
    dm.start()
    m(input_ids=torch.tensor([[0, 1, 2], [3, 4, 5]]), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    for tok_ in ([5, 6], [9, 7], [0, 8]):
        m(input_ids=torch.tensor(tok_)[:, None])
    assert [x.tolist() for x in masks] == [[False, True, True, True, True, True], [True, True], [False, True],
                                           [False, True]]
    dm.start()                                            # the next batch starts with a prefill again
    m(input_ids=torch.tensor([[1, 2]]))                   # generate may drop an all-ones attention mask
    assert masks[-1].tolist() == [True, True]
    dm.remove()


def test_bound_streaming_equals_in_memory_on_deepseek_vl2(calibrated, tmp_path):
    src, sp, _ = calibrated["vl2"]
    for mode in ([], ["--in-memory"]):
        mg.main(["--model", src, "--stats", sp, "--k", "4", "--method", "hcsmoe", "--out", str(tmp_path / f"o{len(mode)}"),
                 "--threads", "1"] + mode)
    a, b = on_disk(tmp_path / "o0"), on_disk(tmp_path / "o1")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.load(open(tmp_path / "o1" / "config.json"))["language_config"]["n_routed_experts"] == 8


def test_own_tensor_hook_on_the_transposed_fused_layout(tok, tmp_path, monkeypatch):
    """Hub Qwen3-VL-MoE files store experts.gate_up_proj [N, H, 2I] / down_proj [N, I, H] (transposed
    against transformers 5's in-memory layout). The hook reads them as gate / up [N, I, H], down
    [N, H, I] and writes the merge back transposed: the same bytes as the row-wise weighted sum."""
    from safetensors.torch import save_file
    from common.checkpoint import safetensors_files
    fake = _wavg_module()
    monkeypatch.setattr(planning, "comparators", fake)     # the modules that dispatch to the comparators
    monkeypatch.setattr(merging, "comparators", fake)
    src, sp, stats, feats = _calibrated("qwen3_vl_moe", tok, tmp_path)
    for f in safetensors_files(src):
        t = load_file(f)
        save_file({k: (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
                       else v) for k, v in t.items()}, f, metadata={"format": "pt"})
    mass = rstats.total_counts(stats).double().sum(1)
    groups = [[[2 * i, 2 * i + 1] for i in range(4)] for _ in stats["layers"]]
    plan = {"groups": groups, "weights": [rm.merge_weights(mass[l], g) for l, g in enumerate(groups)], "K": 4,
            "routing": {}, "router": "average"}
    merging.merge_streaming(src, str(tmp_path / "ref"), plan)
    seen = []
    real = merging.own_merge
    monkeypatch.setattr(merging, "own_merge", lambda p, li, W, K: seen.append(W) or real(p, li, W, K))
    mg.run_merge(MergeConfig(model=src, stats=sp, out=str(tmp_path / "own"), k=4, method="wavg"))
    ref, got = on_disk(tmp_path / "ref"), on_disk(tmp_path / "own")
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    I, H = seen[0]["gate"].shape[1:]
    key = next(k for k in ref if k.endswith("experts.gate_up_proj"))
    assert list(ref[key].shape) == [4, H, 2 * I] and seen[0]["down"].shape[1:] == (H, I)


def test_merging_two_feature_files_concatenates_the_token_samples():
    """Hand case: counts add; the token sample is the bottom-m of both samples' keys (m = 3, the
    larger size), rows kept whole, never added element-wise (which gave expert ids up to 2(N-1))."""
    a = {"count": torch.tensor([1.0, 2.0]), "tokens": 2, "x_sample": torch.tensor([[1.0], [2.0]]),
         "x_sample_topk": torch.tensor([[0], [1]]), "x_sample_key": torch.tensor([0.1, 0.5], dtype=torch.float64)}
    b = {"count": torch.tensor([3.0, 0.0]), "tokens": 3, "x_sample": torch.tensor([[10.0], [20.0], [30.0]]),
         "x_sample_topk": torch.tensor([[1], [1], [0]]),
         "x_sample_key": torch.tensor([0.3, 0.2, 0.9], dtype=torch.float64)}
    m = bl.merge_feature_dicts(a, b)
    assert torch.equal(m["count"], torch.tensor([4.0, 2.0])) and m["tokens"] == 5
    assert m["x_sample"].tolist() == [[1.0], [10.0], [20.0]]          # keys 0.1, 0.3, 0.2 in arrival order
    assert m["x_sample_topk"].tolist() == [[0], [1], [1]]
    assert m["x_sample_key"].tolist() == [0.1, 0.3, 0.2]
    same = bl.merge_feature_dicts(b, b)                   # equal sizes: keys 0.3, 0.2 | 0.2 kept, no doubling
    assert same["x_sample"].tolist() == [[10.0], [20.0], [20.0]] and same["x_sample_topk"].max() == 1


@pytest.mark.parametrize("keep", [None, 5])
def test_merge_with_two_stats_files_of_unequal_and_equal_samples(calibrated, keep, tmp_path):
    """`rolemerge.merge --stats a b` on two calibrations: with unequal token samples (keep 5 rows of
    the second) MergeMoE and REAM crashed with a traceback; with equal ones they ran on doubled
    inputs. Now both run, and the merged sample holds rows of the two files, not sums."""
    import shutil
    from safetensors.torch import load_file, save_file
    src, sp, _ = calibrated["tiny-moe"]
    sp2 = str(tmp_path / "second.safetensors")
    shutil.copy(sp, sp2)
    f2 = bl.features_path(sp2)
    shutil.copy(bl.features_path(sp), f2)
    if keep:
        from safetensors import safe_open
        with safe_open(f2, "pt") as f:
            md = f.metadata()
        t = load_file(f2)
        for k in list(t):
            if k.split("/", 1)[1] in bl.SAMPLE_KEYS:
                t[k] = t[k][:keep].contiguous()
        save_file(t, f2, metadata=md)
    feats, _ = bl.load_features([bl.features_path(sp), f2])
    one, _ = bl.load_features(bl.features_path(sp))
    N = one[0]["count"].numel()
    assert all(int(f["x_sample_topk"].max()) < N for f in feats)
    assert all(len(f["x_sample"]) == len(o["x_sample"]) for f, o in zip(feats, one))
    rows = {tuple(r.tolist()) for r in one[0]["x_sample"]}
    assert all(tuple(r.tolist()) in rows for r in feats[0]["x_sample"])   # whole rows of the inputs
    for method in ("mergemoe", "ream"):
        out = str(tmp_path / method)
        mg.main(["--model", src, "--stats", sp, sp2, "--k", "4", "--method", method, "--out", out, "--threads", "1"])
        assert os.path.exists(os.path.join(out, sh.REPORT))
