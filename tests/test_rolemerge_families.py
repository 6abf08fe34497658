"""The library merge on every MoE family transformers ships: merged and reloadable, or refused
before any change (rolemerge/calibrate.py `check_mergeable`, rolemerge/merge.py `merge_model`,
`check_streamable`).

The families are found the way a reader would: every `models/<family>/configuration_*.py` of the
installed transformers that declares one of the expert-count fields. Each is built tiny from its
own config class (defaults shrunk: hidden 32, 2 layers, 8 experts, top-2) and merged with a fixed
plan (8 -> 4 experts); a family RoleMerge supports must merge, save and reload with plain
transformers (no missing, unexpected or mismatched tensor) and generate; every other family must
be refused with every parameter bit-identical and the config unchanged.
"""
import copy
import os
import re

import pytest
import torch

from rolemerge import calibrate as cal
from rolemerge import merge as mg
from rolemerge import model as rm
from rolemerge import blocks as blk
from rolemerge import merging
from rolemerge.planning import MergeConfig

FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
FIELD_RE = re.compile(r"^\s*(?:self\.)?(%s)\s*[:=]" % "|".join(FIELDS), re.M)

# tiny sizes: a default value above these is lowered to them (sub-configs too)
SIZES = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
             expert_intermediate_size=16, ffn_hidden_size=64, d_model=32, d_ff=64, embed_dim=32, n_embd=32, d_kv=8,
             num_hidden_layers=2, num_layers=2, n_layers=2, depth=2, encoder_layers=1, decoder_layers=1,
             num_attention_heads=4, n_head=4, num_heads=4, encoder_attention_heads=4, decoder_attention_heads=4,
             num_key_value_heads=4, head_dim=8, vocab_size=256, max_position_embeddings=256,
             num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
             n_group=1, topk_group=1, first_k_dense_replace=1, moe_topk=2, top_k=2, num_selected_experts=2,
             encoder_ffn_dim=64, decoder_ffn_dim=64, ssm_state_size=8, mamba_d_state=8, mamba_n_heads=4,
             mamba_head_dim=8, mamba_d_head=8, linear_num_key_heads=2, linear_num_value_heads=2,
             linear_key_head_dim=8, linear_value_head_dim=8, image_size=32, out_hidden_size=32,
             vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, zero_expert_num=2, moe_k=2,
             patch_size=8, window_size=2)
DROP = object()   # an OVERRIDE value: leave the field to the config's own default
# what the shrunk defaults leave inconsistent, per family
OVERRIDE = {
    "dots3_note": dict(per_layer_config=DROP),
    "vitpose_backbone": dict(out_features=["stage2"], out_indices=[2], part_features=8),
    "dbrx": dict(attn_config=dict(rope_theta=10000.0)),
    "deepseek_ocr2": dict(text_config=dict(mlp_layer_types=["dense", "sparse"])),
    "dots1": dict(n_shared_experts=1),
    "glm5_next": dict(text_config=dict(num_key_value_heads=4)),
    "granitemoehybrid": dict(mamba_n_heads=8),
    "hunyuan_v1_moe": dict(head_dim=8),
    "hy_v4_vl": dict(text_config=dict(rope_parameters=dict(mrope_section=[2, 1, 1]))),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "ernie4_5_vl_moe": dict(text_config=dict(head_dim=8, rope_parameters=dict(
        rope_theta=500000.0, rope_type="default", mrope_section=[1, 1, 2]))),
    "muse_spark": dict(audio_config=dict(out_hidden_size=32)),
}


def moe_families():
    """Model folders of the installed transformers whose config declares an expert-count field."""
    import transformers
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    out = []
    for d in sorted(os.listdir(root)):
        folder = os.path.join(root, d)
        if not os.path.isdir(folder):
            continue
        for f in os.listdir(folder):
            if f.startswith("configuration_") and f.endswith(".py"):
                with open(os.path.join(folder, f)) as fh:
                    if FIELD_RE.search(fh.read()):
                        out.append(d)
                        break
    return out


def model_type_of(family):
    """(model_type, class name) to build: the family's text LM when it has one, else its
    causal LM, image-text-to-text model, base model; a backbone for vitpose."""
    from transformers.models.auto import configuration_auto as ca, modeling_auto as ma
    causal, vlm, base = (ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                         ma.MODEL_MAPPING_NAMES)
    if family in blk.SUPPORTED and family in vlm:        # the supported VLMs merge as the VLM
        return family, vlm[family]
    if family + "_text" in causal:
        return family + "_text", causal[family + "_text"]
    mts = sorted((mt for mt in ca.CONFIG_MAPPING_NAMES if ca.model_type_to_module_name(mt) == family),
                 key=lambda m: (m != family, len(m)))
    for maps in (causal, vlm, base):
        for mt in mts:
            if mt in maps:
                return mt, maps[mt]
    return mts[0], "VitPoseBackbone"


def _shrink(d, depth=0):
    n_layers = d.get("num_hidden_layers")
    out = {}
    for k, v in d.items():
        is_int = isinstance(v, int) and not isinstance(v, bool)
        if k == "per_layer_config" and isinstance(v, dict):
            out[k] = {i: _shrink(c, depth + 1) if isinstance(c, dict) else c for i, c in v.items() if int(i) < 2}
        elif isinstance(v, dict) and depth < 4:
            out[k] = _shrink(v, depth + 1)
        elif k in ("pad_token_id", "bos_token_id", "eos_token_id") and is_int and v > 200:
            out[k] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[k]
        elif k in ("pad_token_id", "bos_token_id", "eos_token_id") and isinstance(v, list):
            out[k] = [x if x < 200 else 2 for x in v]
        elif k in FIELDS and (v is None or is_int):
            out[k] = 8
        elif k in ("num_experts_per_tok", "top_k_experts") and v is None:
            out[k] = 2
        elif k == "moe_intermediate_size" and (v is None or isinstance(v, list)):
            out[k] = 16 if v is None else [16] * len(v)
        elif k == "q_lora_rank" and v is not None:
            out[k] = 16
        elif k in SIZES and is_int and v > SIZES[k]:
            out[k] = SIZES[k]
        elif isinstance(v, list) and n_layers and len(v) == n_layers > 2:
            out[k] = v[:2]
        else:
            out[k] = v
    return out


def _diff(a, b):
    """The keys of b that differ from a (recursively), so the config's own defaults derive the rest."""
    out = {}
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict) and k != "per_layer_config":
            if d := _diff(a[k], v):
                out[k] = d
        elif a.get(k) != v or k == "per_layer_config":
            out[k] = v
    return out


def _update(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = _update(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
        if v is DROP:
            del out[k]
    return out


def build(family):
    """A tiny random model of `family` in eval mode (its class is the one model_type_of names)."""
    import transformers
    from transformers.models.auto import configuration_auto as ca
    mt, cls_name = model_type_of(family)
    cfg_cls = ca.CONFIG_MAPPING[mt]
    base = cfg_cls().to_dict()
    cfg = cfg_cls(**_update(_diff(base, _shrink(base)), OVERRIDE.get(family, {})))
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(cfg).eval()


def expert_count(model):
    """N from the text config's expert-count field (8 when the family has none we read)."""
    tc = blk.text_config(model.config)
    for f in FIELDS:
        v = blk._int_field(tc, f)
        if isinstance(v, int):
            return v
    return 8


def pair_plan(n_layers, N, seed=0):
    """Groups {0,1}, {2,3}, ... in every layer, merge weights from fixed unequal masses."""
    groups = [[[e, e + 1] for e in range(0, N - 1, 2)] + ([[N - 1]] if N % 2 else []) for _ in range(n_layers)]
    mass = torch.arange(1, N + 1, dtype=torch.float64) + seed
    return {"groups": groups, "weights": [rm.merge_weights(mass, g) for g in groups], "routing": {}}


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, copy.deepcopy(model.config.to_dict())


def assert_untouched(model, before):
    sd, cfg = before
    now = model.state_dict()
    assert now.keys() == sd.keys()
    assert all(now[k].shape == sd[k].shape and torch.equal(now[k], sd[k]) for k in sd)
    assert model.config.to_dict() == cfg


FAMILIES = moe_families()


def test_the_family_list_is_the_installed_transformers_one():
    """The scan finds the families RoleMerge supports and the two the review named."""
    assert {"qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3", "deepseek_ocr2",
            "qwen3_vl_moe", "phimoe", "ernie4_5_moe"} <= set(FAMILIES)
    assert len(FAMILIES) > 40


@pytest.mark.parametrize("family", FAMILIES)
def test_every_moe_family_merges_or_is_refused_untouched(family, tmp_path):
    model = build(family)
    N = expert_count(model)
    blocks = blk.moe_blocks(model)
    plan = pair_plan(len(blocks) or 2, N)
    before = snapshot(model)
    supported = model.config.model_type in blk.SUPPORTED
    if not supported:
        with pytest.raises(cal.CalibrationError) as e:
            merging.merge_model(model, plan)
        msg = str(e.value)
        assert model.config.model_type in msg and "Qwen3-MoE" in msg and "DeepSeek-V3" in msg   # family + the list
        assert_untouched(model, before)
        return
    # a supported family: merged, saved, reloaded strictly, generates
    K = len(plan["groups"][0])
    merging.merge_model(model, plan)
    tc = blk.text_config(model.config)
    assert getattr(tc, blk.expert_count_field(model.config)) == K
    merged = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path)
    loaded, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    sd = loaded.state_dict()
    assert sd.keys() == merged.keys() and all(torch.equal(sd[k], merged[k]) for k in merged)
    assert all(b.gate.weight.shape[0] == K and b.experts.gate_up_proj.shape[0] == K for _, b in blk.moe_blocks(loaded))
    ids = torch.tensor([[3, 5, 7, 9]])
    out = loaded.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                 min_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 6)


def test_families_merged_are_the_supported_ones():
    """The split the report lists: every family whose model_type is in SUPPORTED merges (above),
    all others are refused; the in-transformers supported families are all found by the scan."""
    found = {model_type_of(f)[0] for f in FAMILIES}
    assert set(blk.SUPPORTED) - {"deepseek_vl_v2"} <= found        # DeepSeek-VL2 is not in transformers


# ----------------------------------------------------------------------------- the structure checks


@pytest.fixture
def qwen3():
    return build("qwen3_moe")


def _refused(model, plan, match):
    before = snapshot(model)
    with pytest.raises(cal.CalibrationError, match=match):
        merging.merge_model(model, plan)
    assert_untouched(model, before)


def test_a_router_the_merge_does_not_know_is_refused_before_any_change(qwen3):
    """Phimoe-like: one layer's router is named `router`, so that block is not found; before the
    check the other layers were merged and the config rewritten around it."""
    mlp = qwen3.model.layers[1].mlp
    mlp.router = mlp.gate
    del mlp.gate
    _refused(qwen3, pair_plan(1, 8), "model.layers.1.mlp.experts is an experts module outside")


def test_expert_count_field_and_plan_mismatches_are_refused(qwen3):
    N = 8
    _refused(qwen3, pair_plan(1, N), "the plan has 1 layers")                        # 2 MoE blocks
    bad = pair_plan(2, N)
    bad["groups"][1][0] = [0, 9]
    _refused(qwen3, bad, r"distinct expert indices in \[0, 8\)")
    bad = pair_plan(2, N)
    bad["groups"][1][1] = [1, 3]                                                    # expert 1 twice
    _refused(qwen3, bad, "distinct expert indices")
    one = {"groups": [[list(range(8))]] * 2, "weights": [[[1 / 8] * 8]] * 2}       # K=1 < top_k=2
    _refused(qwen3, one, "top_k=2 <= K")
    bad = pair_plan(2, N)
    bad["weights"][0][0] = [float("nan"), 1.0]
    _refused(qwen3, bad, "finite")
    qwen3.config.num_experts = 6                                                    # config disagrees with router
    _refused(qwen3, pair_plan(2, 6), r"gate.weight has shape \[8, 32\], not \[6, hidden\]")


def test_an_expert_tensor_the_merge_does_not_rewrite_is_refused(qwen3):
    """gpt-oss-like expert biases would stay at N rows beside K merged experts."""
    qwen3.model.layers[0].mlp.experts.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(8, 32))
    _refused(qwen3, pair_plan(2, 8), "gate_up_proj_bias")


def test_the_supported_families_pass_the_check_as_calibrate_builds_them():
    """check_mergeable accepts every supported tiny family (no false refusal in the merge tests)."""
    for fam in ("qwen2_moe", "deepseek_v3"):
        m = build(fam)
        blk.check_mergeable(m, pair_plan(len(blk.moe_blocks(m)), 8))


def test_run_merge_refusal_leaves_no_output(tmp_path):
    """The CLI / run_merge path on an unsupported family (Phimoe): nothing at out or out.tmp."""
    m = build("phimoe")
    m.save_pretrained(tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(cal.CalibrationError, match="Phimoe|phimoe"):
        mg.run_merge(MergeConfig(model=str(tmp_path / "src"), stats=str(tmp_path / "none.safetensors"), out=str(out), rho=0.5))
    assert not out.exists() and not (tmp_path / "out.tmp").exists()


def test_streaming_refuses_a_plan_for_another_layer_count_before_writing(qwen3, tmp_path):
    qwen3.save_pretrained(tmp_path / "src")
    with pytest.raises(mg.MergeError, match="the plan has 1 layers, the checkpoint 2"):
        merging.merge_streaming(str(tmp_path / "src"), str(tmp_path / "dst"), pair_plan(1, 8))
    assert not (tmp_path / "dst").exists()
    merging.merge_streaming(str(tmp_path / "src"), str(tmp_path / "dst"), pair_plan(2, 8))    # the right plan merges
    assert (tmp_path / "dst" / "config.json").exists()
