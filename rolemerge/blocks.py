"""What RoleMerge knows about an MoE model's structure (torch only; shared by every RoleMerge file).

The supported families, the routed-expert blocks of a loaded model (`moe_blocks`: a router
`.gate` [N, H] and fused `.experts`), the expert-count fields of a config, the checks that a
model (and a plan) are ones the merge understands (`check_mergeable`), and the metadata the
statistics are stamped with (`model_info`, `router_fingerprint`).
"""
import hashlib
import math
import re

import torch

# model_type -> family name; the text decoder of every one holds `mlp.gate` + `mlp.experts`
SUPPORTED = {
    "qwen3_vl_moe": "Qwen3-VL-MoE", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE", "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2-MoE", "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3",
    "deepseek_ocr2": "DeepSeek-OCR-2 (DeepSeek MoE-VLM)",
    "deepseek_vl_v2": "DeepSeek-VL2 (Tiny / Small / base; rolemerge/deepseek_vl2.py)",
}
VLM_TYPES = ("qwen3_vl_moe", "deepseek_vl_v2")   # calibrated with image / question / answer buckets
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


class CalibrationError(ValueError):
    """Calibration cannot run or its statistics are inconsistent; the message says why."""


class MergeError(ValueError):
    """The merge cannot run as asked; the message says why."""


# ----------------------------------------------------------------------------- model structure

def check_supported(config):
    """Raise CalibrationError unless `config.model_type` is a supported MoE family."""
    if config.model_type not in SUPPORTED:
        raise CalibrationError(
            f"model_type {config.model_type!r} is not a supported MoE family (no routed experts RoleMerge "
            f"knows how to merge). Supported: {', '.join(f'{v} [{k}]' for k, v in SUPPORTED.items())}")


def moe_blocks(model):
    """[(name, block)] of the routed-expert blocks of a model, in layer order: modules with a
    router `.gate` (weight [N, H]) and fused `.experts` (gate_up_proj [N, 2I, H], down_proj).
    Shared experts, dense layers and vision towers are not returned."""
    out = []
    for name, mod in model.named_modules():
        gate, experts = getattr(mod, "gate", None), getattr(mod, "experts", None)
        if (gate is not None and experts is not None and hasattr(gate, "weight")
                and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)):
            out.append((name, mod))
    return out


ROUTER_TENSORS = ("weight", "e_score_correction_bias")     # what merge_block rewrites in a router
EXPERT_TENSORS = ("gate_up_proj", "down_proj")              # ... and in the fused experts


def _int_field(obj, f):
    """obj.f when it is an int (config attribute maps included), else None."""
    try:
        v = getattr(obj, f, None)
    except Exception:   # a config that refuses global access to a per-layer field: not a layout we know
        return "per-layer"
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def check_mergeable(model, plan=None):
    """Raise CalibrationError unless the merge understands every routed-expert block, router and
    expert-count field of `model` (and `plan` fits it); reads only, so a refusal leaves every
    parameter and config field as it was. Called before any tensor or config field changes.

    Checks: the family is one of SUPPORTED (its routing semantics are known: a family outside
    it may route by groups or by a router RoleMerge does not rewrite); at least one block from
    `moe_blocks`; every module named `*.experts` belongs to one; each router holds only
    ROUTER_TENSORS (weight [N, H], bias [N]) and each experts module only EXPERT_TENSORS with N
    rows; no tensor sits on the block itself; every int expert-count attribute of block, router,
    experts and the config equals N; top_k <= N. plan (make_plan's dict, optional): one entry
    of groups and weights per block, the same K >= top_k in every layer (bound router operator:
    any 1 <= K <= N per layer), each group a non-empty
    list of distinct experts in [0, N) (no expert in two groups), weights finite and aligned
    with the groups, routing fields among n_group / topk_group."""
    mt = getattr(model.config, "model_type", None)
    check_supported(model.config)
    fam = f"{SUPPORTED[mt]} [{mt}]"

    def no(why):
        raise CalibrationError(f"{fam}: {why}; nothing was changed. RoleMerge merges blocks with a router `gate` "
                               f"({', '.join(ROUTER_TENSORS)}) and fused `experts` ({', '.join(EXPERT_TENSORS)}) "
                               f"in the families {', '.join(SUPPORTED.values())}")

    blocks = moe_blocks(model)
    if not blocks:
        no("no routed-expert block (`gate` router + fused `experts`) found")
    names = {n for n, _ in blocks}
    for n, _ in model.named_modules():
        if n.rsplit(".", 1)[-1] == "experts" and n.rsplit(".", 1)[0] not in names:
            no(f"{n} is an experts module outside the blocks the merge rewrites")
    tc = text_config(model.config)
    try:
        field = expert_count_field(model.config)
    except CalibrationError:
        no(f"its config has none of the expert-count fields {EXPERT_FIELDS}")
    N = _int_field(tc, field)
    top_k = _int_field(tc, "num_experts_per_tok")
    if not isinstance(N, int) or not isinstance(top_k, int) or not 1 <= top_k <= N:
        no(f"config {field}={N!r}, num_experts_per_tok={top_k!r} (need ints, 1 <= top_k <= N)")
    for cfg in {id(c): c for c in (model.config, tc)}.values():
        for f in EXPERT_FIELDS:
            v = _int_field(cfg, f)
            if v is not None and v != N:
                no(f"config field {f}={v} disagrees with {field}={N}")
    for name, b in blocks:
        w = b.gate.weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[0] != N:
            no(f"{name}.gate.weight has shape {list(getattr(w, 'shape', []))}, not [{N}, hidden]")
        for k, t in list(b.gate.named_parameters()) + list(b.gate.named_buffers()):
            if k not in ROUTER_TENSORS or t.shape[0] != N:
                no(f"{name}.gate.{k} {list(t.shape)} is a router tensor the merge does not rewrite")
        for k, t in list(b.experts.named_parameters()) + list(b.experts.named_buffers()):
            if k not in EXPERT_TENSORS or t.dim() < 2 or t.shape[0] != N:
                no(f"{name}.experts.{k} {list(t.shape)} is an expert tensor the merge does not rewrite")
        if not all(isinstance(getattr(b.experts, k, None), torch.Tensor) for k in EXPERT_TENSORS):
            no(f"{name}.experts lacks one of {EXPERT_TENSORS}")
        for k, t in list(b.named_parameters(recurse=False)) + list(b.named_buffers(recurse=False)):
            no(f"{name}.{k} {list(t.shape)} is a block tensor the merge does not rewrite")
        for mod in (b, b.gate, b.experts):
            for f in EXPERT_FIELDS:
                v = _int_field(mod, f)
                if v is not None and v != N:
                    no(f"{name}: module field {f}={v} disagrees with the {N} router rows")
    if plan is None or (plan.get("own") and plan.get("groups") is None):   # comparators group while merging
        return
    groups, weights = plan.get("groups"), plan.get("weights")
    if not isinstance(groups, list) or not isinstance(weights, list) or not len(groups) == len(weights) == len(blocks):
        no(f"the plan has {len(groups or [])} layers of groups and {len(weights or [])} of weights for "
           f"{len(blocks)} MoE blocks")
    K, bound = len(groups[0]), plan.get("router") == "bound"
    for (name, _), g, w in zip(blocks, groups, weights):
        if bound:      # N slots stay (members bound to their group's merge): any 1 <= K_l <= N per layer
            if not 1 <= len(g) <= N:
                no(f"{name}: {len(g)} merged experts (the bound operator needs 1 <= K <= N={N})")
        elif len(g) != K or not top_k <= K <= N:
            no(f"{name}: {len(g)} merged experts (need the same K in every layer, top_k={top_k} <= K <= N={N})")
        flat = [e for grp in g for e in grp]
        if (any(not grp for grp in g) or len(set(flat)) != len(flat)
                or any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < N for e in flat)):
            no(f"{name}: groups must be non-empty lists of distinct expert indices in [0, {N})")
        if len(w) != len(g) or any(len(a) != len(b) for a, b in zip(g, w)) or not all(
                isinstance(x, (int, float)) and math.isfinite(x) for a in w for x in a):
            no(f"{name}: merge weights must be finite numbers aligned with the groups")
    extra = set(plan.get("routing") or {}) - {"n_group", "topk_group"}
    if extra:
        no(f"the plan rewrites routing fields {sorted(extra)} (only n_group / topk_group exist)")


def layer_index(name):
    """Decoder layer index in a module or tensor name ('...layers.12.mlp...' -> 12)."""
    m = re.search(r"layers\.(\d+)\.", name + ".")
    if m is None:
        raise CalibrationError(f"cannot find a layer index in {name!r}")
    return int(m.group(1))


def text_config(config):
    """The decoder's config (`text_config` of a VLM, the config itself for an LM)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def expert_count_field(config):
    """Name of the routed-expert-count field of a (text) config."""
    d = text_config(config).to_dict()
    for f in EXPERT_FIELDS:
        if f in d:
            return f
    raise CalibrationError(f"config {config.model_type!r} has none of the expert-count fields {EXPERT_FIELDS}")


def router_fingerprint(weight):
    """Short hash of a router weight [N, H], rounded to bf16 so fp32 / bf16 loads of one
    checkpoint agree. Used to refuse statistics recorded on a different model."""
    w = weight.detach().float().cpu().to(torch.bfloat16).contiguous().view(torch.int16)
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()[:16]


def model_info(model, model_id):
    """Metadata stats are stamped with (and checked against at merge time)."""
    check_supported(model.config)
    blocks = moe_blocks(model)
    if not blocks:
        raise CalibrationError(f"{model_id}: no routed-expert blocks found")
    tc = text_config(model.config)
    return {"model_id": str(model_id), "model_type": model.config.model_type,
            "layer_names": [n for n, _ in blocks], "layers": [layer_index(n) for n, _ in blocks],
            "num_experts": int(blocks[0][1].gate.weight.shape[0]), "top_k": int(tc.num_experts_per_tok),
            "fingerprint": router_fingerprint(blocks[0][1].gate.weight)}
