"""RoleMerge calibration + merge on tiny random models of every supported family
(rolemerge/calibrate.py, rolemerge/merge.py)."""
import json
import os

import pytest
import torch

from common import backbone as bb
from rolemerge import calibrate as cal
from rolemerge import merge as mg
from rolemerge import blocks as blk
from rolemerge import stats as rstats
from rolemerge import shards as sh
from rolemerge import planning
from rolemerge.planning import MergeConfig

TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=256)
DS = dict(moe_intermediate_size=16, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
          qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)
FAMILIES = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=16, head_dim=8),
    "olmoe": dict(num_experts=8),
    "mixtral": dict(num_local_experts=8),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=32),
    "deepseek_v2": dict(n_routed_experts=8, first_k_dense_replace=1, topk_method="greedy", **DS),
    "deepseek_v3": dict(n_routed_experts=8, first_k_dense_replace=1, **DS),
    "deepseek_ocr2": None,
    "qwen3_vl_moe": None,
}
QUESTIONS = ["is there a red circle?", "how many squares are there?", "what colour is the triangle?",
             "is the circle left of the square?", "count the shapes", "x"]


@pytest.fixture(scope="module")
def tok():
    return bb.build_tokenizer()


def build(family, tok, seed=0):
    """(model, processor-or-tokenizer) of a tiny random model of `family`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    torch.manual_seed(seed)
    if family == "qwen3_vl_moe":
        model, proc = bb.build_tiny("qwen3_vl_moe", seed=seed, hidden=32, layers=2, experts=8, top_k=2)
        return model.eval(), proc
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "deepseek_ocr2":
        cfg = AutoConfig.for_model("deepseek_ocr2", image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
            vision_config=dict(
                sam_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2,
                                image_size=64, patch_size=16, window_size=2, global_attn_indexes=[1],
                                downsample_channels=[16, 32]),
                encoder_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2)),
            text_config=dict(TEXT, **ids, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                             n_shared_experts=1, topk_method="greedy", n_group=1, topk_group=1,
                             mlp_layer_types=["dense", "sparse"]))
        model = AutoModelForImageTextToText.from_config(cfg)
    else:
        cfg = AutoConfig.for_model(family, **TEXT, **ids, num_experts_per_tok=2, **FAMILIES[family])
        model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    return model.eval(), tok


def save(model, proc, path):
    model.save_pretrained(path, max_shard_size="40KB")   # several shards: layers split across files
    proc.save_pretrained(path)
    return str(path)


def vl_records(tmp_path, n=4):
    import random
    from common import data
    from common import shapes
    rng, out = random.Random(0), []
    for i in range(n):
        scene, fam, q, a = shapes.sample_example(rng)
        p = str(tmp_path / f"im{i}.png")
        shapes.render(scene).save(p)
        out.append({"id": str(i), "question": q, "image": p})
    return out


def sources_for(family, tmp_path):
    if family == "qwen3_vl_moe":
        recs = vl_records(tmp_path)
        return {"a": recs[:2], "b": recs[2:]}
    return {"a": [{"question": q} for q in QUESTIONS[:3]], "b": [{"question": q} for q in QUESTIONS[3:]]}


def loader(family):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if family in ("qwen3_vl_moe", "deepseek_ocr2") else AutoModelForCausalLM


def state(path, family):
    return {k: v.clone() for k, v in loader(family).from_pretrained(path).state_dict().items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merge_every_family(family, tok, tmp_path):
    """calibrate -> stats file -> in-memory and streaming merge -> plain from_pretrained loads,
    generates, and both paths give identical tensors."""
    model, proc = build(family, tok)
    src = save(model, proc, tmp_path / "src")
    stats = cal.calibrate(model, proc, sources_for(family, tmp_path), batch_size=2, max_new_tokens=4,
                          model_id=src, progress=False)
    assert stats["buckets"] == (["image", "question", "answer"] if family == "qwen3_vl_moe" else ["question", "answer"])
    sp = str(tmp_path / "stats.safetensors")
    rstats.save_stats(stats, sp)
    rep = mg.run_merge(MergeConfig(model=src, stats=sp, out=str(tmp_path / "mem"), rho=0.5, in_memory=True))
    assert rep["K"] == 4 and all(len(g) == 4 for g in rep["groups"])
    mg.run_merge(MergeConfig(model=src, stats=sp, out=str(tmp_path / "stream"), rho=0.5))
    m2 = loader(family).from_pretrained(str(tmp_path / "mem")).eval()
    assert getattr(blk.text_config(m2.config), blk.expert_count_field(m2.config)) == 4
    assert all(b.gate.weight.shape[0] == 4 and b.experts.gate_up_proj.shape[0] == 4 for _, b in blk.moe_blocks(m2))
    if family == "qwen3_vl_moe":
        recs = vl_records(tmp_path, 2)
        from common import data
        from common import shapes
        texts, n = bb.generate(m2, proc, [data.load_image(r["image"]) for r in recs], [r["question"] for r in recs],
                               max_new_tokens=4)
    else:
        batch = cal.text_inputs(tok, QUESTIONS[:2])
        out = m2.generate(**batch, max_new_tokens=4, do_sample=False)
        assert out.shape[1] > batch["input_ids"].shape[1]
    a, b = state(str(tmp_path / "mem"), family), state(str(tmp_path / "stream"), family)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert os.path.exists(tmp_path / "mem" / "tokenizer_config.json")
    assert json.load(open(tmp_path / "stream" / sh.REPORT))["groups"] == rep["groups"]


def test_k_equals_n_reproduces_logits(tok, tmp_path):
    for family in ("qwen2_moe", "qwen3_vl_moe"):
        model, proc = build(family, tok)
        src = save(model, proc, tmp_path / family)
        stats = cal.calibrate(model, proc, sources_for(family, tmp_path), batch_size=4, max_new_tokens=3,
                              model_id=src, progress=False)
        rstats.save_stats(stats, str(tmp_path / f"{family}.safetensors"))
        mg.run_merge(MergeConfig(model=src, stats=str(tmp_path / f"{family}.safetensors"), out=str(tmp_path / f"{family}-k8"), rho=1.0))
        m2 = loader(family).from_pretrained(str(tmp_path / f"{family}-k8")).eval()
        if family == "qwen3_vl_moe":
            from common import data
            from common import shapes
            recs = vl_records(tmp_path, 2)
            batch = proc.encode([data.load_image(r["image"]) for r in recs], [r["question"] for r in recs])
        else:
            batch = cal.text_inputs(tok, QUESTIONS[:3])
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, m2(**batch).logits)


def test_determinism_sources_summed_and_errors(tok, tmp_path):
    from safetensors.torch import load_file
    model, proc = build("qwen3_moe", tok)
    src = save(model, proc, tmp_path / "src")
    srcs = sources_for("qwen3_moe", tmp_path)
    both = cal.calibrate(model, tok, srcs, batch_size=3, max_new_tokens=4, model_id=src, progress=False)
    # two stats files (one source each) summed == one run over both sources
    for n in srcs:
        rstats.save_stats(cal.calibrate(model, tok, {n: srcs[n]}, batch_size=3, max_new_tokens=4, model_id=src,
                                     progress=False), str(tmp_path / f"{n}.safetensors"))
    files = [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    loaded = rstats.load_stats(files)
    assert torch.equal(rstats.total_counts(loaded), rstats.total_counts(both))
    assert not torch.equal(rstats.total_counts(loaded), loaded["sources"]["b"]["counts"])   # not the last one only
    twice = rstats.load_stats([files[0], files[0]])                                          # same source twice: summed
    assert torch.equal(twice["sources"]["a"]["counts"], 2 * loaded["sources"]["a"]["counts"])
    # determinism: same inputs -> byte-identical tensors, both paths
    for streaming in (False, True):
        outs = []
        for i in range(2):
            d = str(tmp_path / f"det{streaming}{i}")
            mg.run_merge(MergeConfig(model=src, stats=files, out=d, rho=0.625, in_memory=not streaming))
            outs.append({k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
                         for k, v in load_file(os.path.join(d, f)).items()})
        assert outs[0].keys() == outs[1].keys()
        assert all(outs[0][k].view(torch.uint8).equal(outs[1][k].view(torch.uint8)) for k in outs[0])
    # baselines and controls merge through the same harness
    for method in ("frequency", "prune", "no_phase_split", "permuted", "kmeans", "lambda0"):
        rep = mg.run_merge(MergeConfig(model=src, stats=files, out=str(tmp_path / method), rho=0.5, method=method))
        assert rep["K"] == 4
    # errors
    with pytest.raises(mg.MergeError, match="exists"):
        mg.run_merge(MergeConfig(model=src, stats=files, out=str(tmp_path / "prune"), rho=0.5))
    mg.run_merge(MergeConfig(model=src, stats=files, out=str(tmp_path / "prune"), rho=0.5, overwrite=True))
    with pytest.raises(mg.MergeError, match="top_k"):
        mg.run_merge(MergeConfig(model=src, stats=files, out=str(tmp_path / "x"), rho=0.1))
    for rho in (0.0, 1.5):
        with pytest.raises(mg.MergeError, match="rho"):
            mg.run_merge(MergeConfig(model=src, stats=files, out=str(tmp_path / "x"), rho=rho))
    other, _ = build("qwen3_moe", tok, seed=1)
    osrc = save(other, tok, tmp_path / "other")
    for streaming in (False, True):
        with pytest.raises(mg.MergeError, match="different model"):
            mg.run_merge(MergeConfig(model=osrc, stats=files, out=str(tmp_path / "x"), rho=0.5, in_memory=not streaming))
    assert not os.path.exists(tmp_path / "x")


def test_unsupported_model_errors(tok):
    dense, proc = bb.build_tiny("qwen3_vl", hidden=32, layers=1)
    with pytest.raises(cal.CalibrationError, match="Qwen3-VL-MoE"):
        cal.calibrate(dense, proc, {"a": []})


def test_infer_runs_on_merged_checkpoint(tok, tmp_path):
    from rolemerge import infer
    model, proc = build("olmoe", tok)
    src = save(model, proc, tmp_path / "src")
    rstats.save_stats(cal.calibrate(model, tok, sources_for("olmoe", tmp_path), 3, 4, progress=False),
                   str(tmp_path / "s.safetensors"))
    rep = mg.run_merge(MergeConfig(model=src, stats=str(tmp_path / "s.safetensors"), out=str(tmp_path / "m"), rho=0.5, method="prune"))
    assert rep["mi_retention"] is None                      # pruning drops experts: no grouping MI
    m2, p2, load_s = infer.load_timed(str(tmp_path / "m"))
    recs = [{"id": "1", "question": "is there a red circle?", "answer": "yes", "family": "existence"}]
    pred = infer.predict(m2, p2, recs, max_new_tokens=3, progress=False)
    assert pred[0]["correct"] in (True, False) and 1 <= pred[0]["n_tokens"] <= 3
    sp = infer.speed(m2, p2, recs, n=1, decode_tokens=4)
    assert sp["ttft_s"] > 0 and sp["decode_tok_s"] > 0
    assert infer.checkpoint_bytes(str(tmp_path / "m")) < infer.checkpoint_bytes(src)


def test_merge_refuses_to_overwrite_its_input(tmp_path):
    import pytest
    from rolemerge import merge
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text("{}")
    with pytest.raises(merge.MergeError, match="is the input checkpoint"):
        merge.run_merge(MergeConfig(model=str(src), stats=[], out=str(src), rho=0.5, overwrite=True))


def test_calibrate_keeps_two_sources_with_the_same_file_name(tmp_path):
    import json
    from common import data
    from common import shapes
    from rolemerge import calibrate
    for d in ("a", "b"):
        shapes.generate_split(str(tmp_path / d), "val", 2)
    out = tmp_path / "st.safetensors"
    calibrate.main(["--model", "tiny-moe", "--data", str(tmp_path / "a" / "val.json"),
                    str(tmp_path / "b" / "val.json"), "--out", str(out), "--limit", "2"])
    meta = json.load(open(tmp_path / "st.json"))
    assert len(meta["tokens"]) == 2  # both files are sources (not one overwriting the other)
    assert sum(v["image"] for v in meta["tokens"].values()) == 4 * 9  # 2 + 2 examples x 9 visual tokens


def test_summary_line_rounds_mi_retention():
    """Newcomer trial: merge printed `expert-phase MI retention 0.8028173676820882`; now 3 decimals like its
    other numbers, and a word (not `None`) for pruning."""
    rep = {"N": 8, "K": 4, "method": "rolemerge", "merge_seconds": 1.234, "acr_mean": 0.91234,
           "mi_retention": 0.8028173676820882}
    assert mg.summary_line(rep, "out/m") == ("merged 8 -> 4 experts per layer (rolemerge) in 1.2s: out/m; ACR 91.2%, "
                                              "expert-phase MI retention 0.803")
    assert mg.summary_line(dict(rep, mi_retention=None), "o").endswith(
        "MI retention n/a (pruning keeps no grouping of all experts)")


def test_sparse_calibration_is_warned():
    """One calibration record: image bucket 9 tokens over 8 experts, top-2 -> 2.25 expected per
    expert (< 10); 2 of 24 counts zero. A full calibration says nothing."""
    counts = torch.ones(1, 3, 8)
    counts[0, 0, :2] = 0
    stats = {"buckets": ["image", "question", "answer"], "top_k": 2, "num_experts": 8,
             "sources": {"a": {"counts": counts, "tokens": torch.tensor([9, 40, 80]), "examples": 1}}}
    msg = planning.sparse_calibration(stats)
    assert msg.startswith("warning: sparse calibration (1 example(s))") and "image 2.2" in msg
    assert "question" not in msg.split("(below")[0] and "8% of the routing counts are zero" in msg
    stats["sources"]["a"]["tokens"] = torch.tensor([40, 40, 80])
    assert planning.sparse_calibration(stats) is None
