"""Phase-separated routing statistics of an MoE (VL)M (paper §4.2, App. B.1).

    python -m rolemerge.calibrate --model tiny-moe --data out/data/val.json --out out/rolemerge/stats.safetensors

Runs greedy decoding (temperature 0) on every calibration example and records, at every MoE
layer, the hard top-k expert assignments of every token into phase buckets:

    image    = visual-token positions of the prompt prefill   (VLMs only)
    question = the other prompt positions
    answer   = positions fed back during decoding (the generated tokens)

Counts n[l, b, e] are summed over the examples of a source (one data file = one source, e.g.
one calibration task) and kept per source, so merging can sum all sources and ACR can be
computed per task-layer record. Every run checks assignment conservation
(sum_e n[l,b,e] = k * tokens[b] for every layer) and, at the end, that no bucket is empty.

Routers are observed with forward hooks: in transformers 5 every MoE router
(`*TopKRouter`, `DeepseekV2TopkRouter`, ...) returns (logits, scores, top-k indices).
The file written is a safetensors file (counts/<source> [L, B, N] and tokens/<source> [B],
int64) whose metadata holds the model id, family, MoE layer names, top-k, expert count and a
router fingerprint; a readable .json summary is written next to it.
"""
import hashlib
import json
import math
import os
import re

import torch

from common.cli import add_device_args, load_kwargs

# model_type -> family name; the text decoder of every one holds `mlp.gate` + `mlp.experts`
SUPPORTED = {
    "qwen3_vl_moe": "Qwen3-VL-MoE", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE", "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2-MoE", "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3",
    "deepseek_ocr2": "DeepSeek-OCR-2 (DeepSeek MoE-VLM)",
    "deepseek_vl_v2": "DeepSeek-VL2 (Tiny / Small / base; rolemerge/deepseek_vl2.py)",
}
VLM_TYPES = ("qwen3_vl_moe", "deepseek_vl_v2")   # calibrated with image / question / answer buckets
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
META_KEY = "rolemerge"


class CalibrationError(ValueError):
    """Calibration cannot run or its statistics are inconsistent; the message says why."""


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


# ----------------------------------------------------------------------------- recording

class RouterRecorder:
    """Forward hooks on every router; collects the top-k indices of each forward call.

    calls[l] is a list of LongTensor [T, k] (T = batch * positions of that call)."""

    def __init__(self, model):
        self.blocks = moe_blocks(model)
        self.calls = [[] for _ in self.blocks]
        self.handles = [b.gate.register_forward_hook(self._hook(i)) for i, (_, b) in enumerate(self.blocks)]

    def _hook(self, i):
        def fn(module, args, out):
            self.calls[i].append(out[2].detach().reshape(-1, out[2].shape[-1]).cpu())
        return fn

    def reset(self):
        self.calls = [[] for _ in self.blocks]

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def record_batch(model, rec, inputs, image_mask, eos_id, pad_id, max_new_tokens, n_buckets):
    """Greedy-decode one left-padded batch and count its routing per phase bucket.

    inputs: model kwargs with input_ids [B, L0] and attention_mask [B, L0];
    image_mask [B, L0] bool (visual positions) or None for text-only models.
    Returns (counts [n_layers, n_buckets, N] int64, tokens [n_buckets] int64, texts ids list).
    Raises CalibrationError if prefill was not one call or conservation fails."""
    rec.reset()
    ids, attn = inputs["input_ids"], inputs["attention_mask"].bool().cpu()
    Bsz, L0 = ids.shape
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_id,
                         pad_token_id=pad_id)
    new = out[:, L0:].cpu()
    # phase of every prefill position: 0 image, 1 question (text-only: 0 question), -1 padding
    q_bucket = n_buckets - 2
    prefill = torch.full((Bsz, L0), q_bucket, dtype=torch.long)
    if image_mask is not None:
        prefill[image_mask.cpu().bool()] = 0
    prefill[~attn] = -1
    # generated token j of row i is fed back (and routed) iff j < n_i - 1, n_i = tokens up to EOS
    n_gen = []
    for row in new.tolist():
        n_gen.append(row.index(eos_id) + 1 if eos_id in row else len(row))
    n_steps = new.shape[1] - 1
    N, k = rec.blocks[0][1].gate.weight.shape[0], None
    counts = torch.zeros(len(rec.blocks), n_buckets, N, dtype=torch.long)
    for l, calls in enumerate(rec.calls):
        if len(calls) != 1 + n_steps or calls[0].shape[0] != Bsz * L0:
            raise CalibrationError(f"layer {rec.blocks[l][0]}: expected one prefill call of {Bsz * L0} tokens and "
                                   f"{n_steps} decode calls, got {len(calls)} calls "
                                   f"(first {calls[0].shape[0] if calls else 0} tokens); chunked prefill?")
        k = calls[0].shape[1]
        bucket = [prefill.reshape(-1)]
        for s in range(n_steps):
            bucket.append(torch.tensor([n_buckets - 1 if s < n - 1 else -1 for n in n_gen]))
        bucket = torch.cat(bucket)                                  # [T_total]
        idx = torch.cat(calls)                                      # [T_total, k]
        keep = bucket >= 0
        flat = (bucket[keep, None] * N + idx[keep]).reshape(-1)
        counts[l] = torch.bincount(flat, minlength=n_buckets * N).reshape(n_buckets, N)
    tokens = torch.stack([(prefill == b).sum() for b in range(n_buckets - 1)] +
                         [torch.tensor(sum(max(n - 1, 0) for n in n_gen))])
    bad = (counts.sum(-1) != k * tokens[None]).nonzero()
    if len(bad):
        l, b = bad[0].tolist()
        raise CalibrationError(f"assignment conservation failed at layer {rec.blocks[l][0]} bucket {b}: "
                               f"{int(counts[l, b].sum())} assignments != k={k} x {int(tokens[b])} tokens")
    return counts, tokens, new


def text_inputs(tokenizer, questions, history=None):
    """Left-padded prompts for a text-only LM: its chat template (generation prompt) when it
    has one, the raw question otherwise. history: None or per question its earlier (question,
    answer) turns. User text is tokenized with special-token strings escaped ("<|im_end|>" in
    a question stays text), the template's own markers as special tokens."""
    rows = [_chat_ids(tokenizer, q, history[i] if history else ()) for i, q in enumerate(questions)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    L = max(map(len, rows))
    ids = torch.tensor([[pad] * (L - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


def _chat_ids(tokenizer, question, history=()):
    """Token ids of one prompt: each user text is rendered into the chat template as a
    placeholder, then the template pieces are tokenized as they are and the user texts with
    special tokens escaped (`split_special_tokens`)."""
    texts = [t for pair in history for t in pair] + [question]
    tok = lambda s, esc: tokenizer(s, add_special_tokens=False, split_special_tokens=esc)["input_ids"] if s else []
    if not getattr(tokenizer, "chat_template", None):
        return tok("\n".join(texts), True)
    marks = [f"\ue000{i}\ue001" for i in range(len(texts))]
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": m} for i, m in enumerate(marks)]
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = []
    for m, t in zip(marks, texts):
        head, rendered = rendered.split(m, 1)
        ids += tok(head, False) + tok(t, True)
    return ids + tok(rendered, False)


class DecodeMask:
    """Sets `.mask` of feature recorders (rolemerge.baselines.FeatureRecorder, the comparators'
    ComparatorRecorder) during greedy decoding to exactly the positions the routing statistics
    count, through a forward pre-hook on the model: the first call of a batch (prefill) counts
    its non-padding positions (attention_mask), every later call (one fed-back token per row)
    counts row i while none of the tokens fed so far is EOS (token j is routed and counted iff
    j < n_i - 1, see record_batch). Call `start()` before each batch's generate."""

    def __init__(self, model, recorders, eos_id):
        self.recorders, self.eos, self.first, self.alive = recorders, eos_id, True, None
        self.handle = model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def start(self):
        self.first = True

    def _pre(self, module, args, kwargs):
        if self.first:
            mask = kwargs.get("attention_mask")
            if mask is None:             # generate may drop an all-ones mask
                x = kwargs.get("input_ids", args[0] if args else None)
                x = kwargs["inputs_embeds"] if x is None else x
                mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
            mask = mask.bool()
            self.alive = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
            self.first = False
        else:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.alive = self.alive & (ids[:, -1] != self.eos)
            mask = self.alive
        for r in self.recorders:
            r.mask = mask.reshape(-1)

    def remove(self):
        self.handle.remove()


def feature_recorders(model):
    """The feature recorders of the comparison methods: rolemerge.baselines.FeatureRecorder and,
    when rolemerge/comparators.py provides one, its ComparatorRecorder."""
    from rolemerge import baselines as bl
    recs = [bl.FeatureRecorder(model)]
    try:
        from rolemerge import comparators
    except ImportError:
        comparators = None
    if comparators is not None and hasattr(comparators, "ComparatorRecorder"):
        recs.append(comparators.ComparatorRecorder(model))
    return recs


def merged_features(recorders):
    """Per MoE layer, one dict of every recorder's features (earlier recorders win a name clash)."""
    out = []
    for per in zip(*[r.feats for r in recorders]):
        d = {}
        for f in per:
            d.update({k: v for k, v in f.items() if k not in d})
        out.append(d)
    return out


def calibrate(model, proc_or_tok, sources, batch_size=16, max_new_tokens=32, model_id="model", progress=True,
              features=False):
    """Phase-separated routing statistics of `model` over calibration sources.

    model: a supported MoE model (eval mode); proc_or_tok: `common.backbone.VLProcessor` for a
    VLM (3 buckets), the tokenizer for a text-only LM (2 buckets: question, answer);
    sources: {name: list of records {question[, image]}} (records from common.data.read_llava_json).
    Returns a stats dict: model info + buckets + sources {name: {counts [L,B,N], tokens [B], examples}}.
    A VLM calibrates text-only records (image None) too: they add to the question and answer
    buckets only. features: also collect the features of the comparison methods
    (`rolemerge.baselines.FeatureRecorder`, and `rolemerge.comparators.ComparatorRecorder` when
    that module exists) in the same decoding pass, over exactly the tokens the statistics count (`DecodeMask`); they are returned as
    stats["features"] (list over MoE layers of dicts; per-layer sums, no per-token storage).
    Raises CalibrationError for an unsupported model or an empty bucket."""
    from tqdm import tqdm
    info = model_info(model, model_id)
    vlm = model.config.model_type in VLM_TYPES
    buckets = ["image", "question", "answer"] if vlm else ["question", "answer"]
    if vlm:
        from common import data
        eos, pad = proc_or_tok.eos_token_id, proc_or_tok.pad_token_id
    else:
        eos = proc_or_tok.eos_token_id
        pad = proc_or_tok.pad_token_id if proc_or_tok.pad_token_id is not None else eos
    rec = RouterRecorder(model)
    frec = feature_recorders(model) if features else []
    dmask = DecodeMask(model, frec, eos) if features else None
    out = {}
    try:
        for name, records in sources.items():
            counts = torch.zeros(len(rec.blocks), len(buckets), info["num_experts"], dtype=torch.long)
            tokens = torch.zeros(len(buckets), dtype=torch.long)
            for i in tqdm(range(0, len(records), batch_size), desc=f"calibrate {name}", disable=not progress):
                chunk = records[i:i + batch_size]
                qs = [r["question"] for r in chunk]
                if vlm:
                    ims = [data.load_image(r["image"], r.get("id", "?")) if r.get("image") else None for r in chunk]
                    inputs = proc_or_tok.encode(ims, qs)
                    image_mask = inputs["input_ids"] == proc_or_tok.image_token_id
                else:
                    inputs, image_mask = text_inputs(proc_or_tok, qs), None
                inputs = {k: v.to(model.device) for k, v in inputs.items()}
                if dmask is not None:
                    dmask.start()
                c, t, _ = record_batch(model, rec, inputs, image_mask, eos, pad, max_new_tokens, len(buckets))
                counts += c
                tokens += t
            out[name] = {"counts": counts, "tokens": tokens, "examples": len(records)}
    finally:
        rec.remove()
        for r in frec + ([dmask] if dmask else []):
            r.remove()
    stats = dict(info, buckets=buckets, sources=out)
    check_nonempty(stats)
    if features:
        stats["features"] = merged_features(frec)
    return stats


def check_nonempty(stats):
    """Raise CalibrationError if a phase bucket received no token over all sources."""
    tot = sum(s["tokens"] for s in stats["sources"].values())
    for b, n in zip(stats["buckets"], tot.tolist()):
        if n == 0:
            why, fix = {
                "image": ("the records have no images", ": add records with images (an `image` field) to a --data "
                          "file; one source with images beside text-only sources is enough"),
                "answer": ("no generated token was fed back: raise --max-new-tokens (>= 2) or check that the model "
                           "does not stop at once", ""),
            }.get(b, ("the prompts are empty", ": add records with a non-empty `question`"))
            raise CalibrationError(f"phase bucket {b!r} is empty over all calibration sources ({why}){fix}; "
                                   f"RoleMerge needs routing counts of every phase")


# ----------------------------------------------------------------------------- files

def save_stats(stats, path):
    """Write stats to `path` (safetensors: counts/<src>, tokens/<src>; metadata JSON) and a
    readable `path` with .json suffix next to it."""
    from common.checkpoint import atomic_save_file
    from common.data import atomic_write_text
    meta = {k: v for k, v in stats.items() if k not in ("sources", "features")}
    meta["examples"] = {n: s["examples"] for n, s in stats["sources"].items()}
    tensors = {}
    for n, s in stats["sources"].items():
        tensors[f"counts/{n}"] = s["counts"].contiguous()
        tensors[f"tokens/{n}"] = s["tokens"].contiguous()
    atomic_save_file(tensors, path, metadata={META_KEY: json.dumps(meta)})   # temp file + rename
    summary = dict(meta, tokens={n: dict(zip(stats["buckets"], s["tokens"].tolist()))
                                 for n, s in stats["sources"].items()})
    atomic_write_text(summary_path(path), json.dumps(summary, indent=1))


def summary_path(path):
    """The readable .json summary written next to a stats file."""
    return os.path.splitext(path)[0] + ".json"


def load_stats(paths):
    """Read and combine one or more stats files of the same model. Sources with the same name
    in several files are summed. Raises CalibrationError for a missing, truncated or foreign
    file, counts whose shape disagrees with the file's own metadata, files of different
    models, and a phase bucket that is empty over all sources."""
    from safetensors import safe_open
    from common.checkpoint import CheckpointError, check_safetensors
    paths = [paths] if isinstance(paths, str) else list(paths)
    if not paths:
        raise CalibrationError("no stats file given (run python -m rolemerge.calibrate first)")
    stats = None
    for p in paths:
        if not os.path.exists(p):
            raise CalibrationError(f"{p}: stats file not found (run python -m rolemerge.calibrate first)")
        try:
            check_safetensors(p)
            with safe_open(p, "pt") as f:
                md = f.metadata() or {}
                if META_KEY not in md:
                    raise CalibrationError(f"{p}: not a RoleMerge stats file (no '{META_KEY}' metadata)")
                meta = json.loads(md[META_KEY])
                sources = {n: {"counts": f.get_tensor(f"counts/{n}"), "tokens": f.get_tensor(f"tokens/{n}"),
                               "examples": e} for n, e in meta.pop("examples").items()}
            shape = [len(meta["layer_names"]), len(meta["buckets"]), meta["num_experts"]]
        except (CheckpointError, ValueError, KeyError, TypeError) as e:
            if isinstance(e, CalibrationError):
                raise
            raise CalibrationError(f"{p}: unreadable stats file ({e.__class__.__name__}: {e}); "
                                   f"recalibrate with python -m rolemerge.calibrate") from None
        for n, s in sources.items():
            if list(s["counts"].shape) != shape or list(s["tokens"].shape) != shape[1:2] or (s["counts"] < 0).any():
                raise CalibrationError(f"{p}: counts of source {n!r} have shape {list(s['counts'].shape)}, but the "
                                       f"file's metadata says [layers, buckets, experts] = {shape} (non-negative); "
                                       f"the file was edited or is corrupt: recalibrate")
        if stats is None:
            stats = dict(meta, sources=sources)
            continue
        for key in ("model_type", "layer_names", "num_experts", "top_k", "fingerprint", "buckets"):
            if stats[key] != meta[key]:
                raise CalibrationError(f"{p}: {key} differs from {paths[0]} ({meta[key]} vs {stats[key]}): "
                                       f"stats of different models cannot be combined")
        for n, s in sources.items():
            if n in stats["sources"]:
                t = stats["sources"][n]
                stats["sources"][n] = {"counts": t["counts"] + s["counts"], "tokens": t["tokens"] + s["tokens"],
                                       "examples": t["examples"] + s["examples"]}
            else:
                stats["sources"][n] = s
    check_nonempty(stats)
    return stats


def total_counts(stats):
    """counts [L, B, N] summed over all sources."""
    return sum(s["counts"] for s in stats["sources"].values())


# ----------------------------------------------------------------------------- loading models

def load_model(path, dtype=None, device="cpu", device_map=None, trust_remote_code=False):
    """Load any supported MoE checkpoint with its processor (VLM) or tokenizer (LM).
    device_map="auto" spreads a model over devices (needs the optional `accelerate`).
    Weights load from safetensors only; trust_remote_code stays off unless asked.
    Raises CalibrationError for a missing / unreadable checkpoint, pickle-only weights, a
    truncated shard (named) and unsupported families, with the list of supported ones."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    from common import backbone as bb
    if device_map is not None:
        import importlib.util
        if importlib.util.find_spec("accelerate") is None:
            raise CalibrationError("--device-map needs the optional package accelerate (pip install accelerate)")
    path = bb.resolve(path)
    config = load_config(path, trust_remote_code)
    if config.model_type == "deepseek_vl_v2":   # no transformers class: built from transformers parts
        from rolemerge import deepseek_vl2 as vl2
        if device_map is not None:
            raise CalibrationError("--device-map is not supported for DeepSeek-VL2; use --device (e.g. cuda)")
        try:
            return vl2.load(path, dtype, device), vl2.Processor.from_pretrained(path, config)
        except vl2.VL2Error as e:                 # a missing / misshapen tensor, a foreign tokenizer
            raise CalibrationError(str(e)) from None
    if config.model_type in VLM_TYPES:
        try:
            return bb.load_backbone(path, dtype=dtype, device=device, device_map=device_map,
                                    trust_remote_code=trust_remote_code)
        except bb.BackboneError as e:
            raise CalibrationError(str(e)) from None
    cls = AutoModelForImageTextToText if config.model_type == "deepseek_ocr2" else AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=dtype, device_map=device_map, trust_remote_code=trust_remote_code,
                                use_safetensors=True)
    if device_map is None:
        model.to(device)
    return model.eval(), AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_config(path, trust_remote_code=False):
    """config of a local checkpoint directory of a supported MoE family whose weights are
    complete safetensors files (headers checked, no tensor read). Raises CalibrationError
    naming the problem: no directory / config.json, unreadable config, unsupported family,
    no safetensors weights (pickles are never loaded: they can run code), a truncated shard."""
    from transformers import AutoConfig
    from common.checkpoint import CheckpointError, checked_weights
    if not os.path.isdir(path):
        raise CalibrationError(f"{path}: no such checkpoint directory (a save_pretrained folder, or tiny-moe)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CalibrationError(f"{path}: no config.json (not a save_pretrained checkpoint directory)")
    if _raw_model_type(path) == "deepseek_vl_v2":
        from rolemerge import deepseek_vl2 as vl2
        try:
            config = vl2.Config.from_pretrained(path)
            vl2.check_config(config)
            checked_weights(path)
        except (vl2.VL2Error, CheckpointError) as e:
            raise CalibrationError(str(e)) from None
        return config
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # bad JSON, no/unknown model_type, custom code without the flag
        why = str(e).splitlines()[0].rstrip(". ")
        raise CalibrationError(f"{path}: cannot read its config.json ({why}); checkpoints with their own code "
                               f"need --trust-remote-code (it runs that code)") from None
    check_supported(config)
    try:
        checked_weights(path)
    except CheckpointError as e:
        raise CalibrationError(str(e)) from None
    return config


def _raw_model_type(path):
    """model_type of config.json read as JSON (None when unreadable: AutoConfig then names the problem)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def main(argv=None):
    from common import data
    from common.cli import add_limit, add_overwrite, add_threads, fail, set_threads, with_fix
    from common.cli import entry_parser
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--model", required=True, help="checkpoint directory (or tiny-moe for the committed tiny MoE-VLM)")
    p.add_argument("--data", nargs="+", required=True,
                   help="calibration files (LLaVA JSON/JSONL or canonical JSONL); each file is one source (task)")
    p.add_argument("--image-root", default=None, help=data.IMAGE_ROOT_HELP)
    p.add_argument("--skip-bad", action="store_true", help=data.SKIP_BAD_HELP)
    p.add_argument("--out", required=True, help="stats file to write (.safetensors; a .json summary goes next to it)")
    add_limit(p, default=128, what="examples of each source file", dest="n")
    add_threads(p)
    p.add_argument("--batch-size", type=int, default=16, help="calibration batch size (left-padded greedy decoding)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer tokens decoded per example")
    add_device_args(p, device_map=True)
    p.add_argument("--trust-remote-code", action="store_true", help="allow code shipped with the checkpoint")
    add_overwrite(p, "stats file at --out (and its features file)")
    p.add_argument("--features", action="store_true",
                   help="also collect the comparison methods' features (M-SMoE, HC-SMoE, REAP, rolemerge/comparators.py) "
                        "over the same decoded tokens, written to <out minus .safetensors>.features.safetensors; "
                        "rolemerge.merge --method msmoe|hcsmoe|reap|... reads them next to --stats")
    a = p.parse_args(argv)
    for flag, low in (("batch_size", 1), ("max_new_tokens", 2)):
        if getattr(a, flag) < low:   # max_new_tokens 1: the one generated token is never fed back (no answer bucket)
            p.error(f"--{'limit' if flag == 'n' else flag.replace('_', '-')} must be >= {low}, got {getattr(a, flag)}")
    if not a.out.endswith(".safetensors"):  # the summary goes to <out minus suffix>.json: never onto --out itself
        p.error(f"--out {a.out} must end in .safetensors (a .json summary is written next to it)")
    for path in a.data:
        if os.path.realpath(path) in (os.path.realpath(a.out), os.path.realpath(summary_path(a.out))):
            p.error(f"--out {a.out} would overwrite the calibration data {path}")
    if os.path.isdir(a.out):
        fail(f"--out {a.out} is a directory; give the stats file to write "
             f"(e.g. {os.path.join(a.out, 'stats.safetensors')})")
    if os.path.exists(a.out) and not a.overwrite:  # before the data and the model are read
        fail(f"--out {a.out} already exists; pass --overwrite to replace it, or choose another --out")
    from rolemerge import baselines as bl
    fpath = bl.features_path(a.out)
    if os.path.exists(fpath) and not a.overwrite:  # with or without --features: never beside other statistics
        fail(f"{fpath} already exists (comparator features of an earlier calibration); pass --overwrite to "
             f"{'replace' if a.features else 'remove'} it, or choose another --out")
    seen = {}
    for path in a.data:
        if os.path.realpath(path) in seen:  # also ./val.json after val.json, or a link to it
            fail(f"--data {path} is given twice (as {seen[os.path.realpath(path)]} before); each calibration "
                 f"source counts once")
        seen[os.path.realpath(path)] = path
    dtype = load_kwargs(a)["dtype"]
    try:
        sources = {}   # data first: a bad record fails before a model of many GB is loaded
        for path in a.data:
            name = os.path.splitext(os.path.basename(path))[0]
            if name in sources:  # two files with the same name (a/val.json, b/val.json): keep both
                name = os.path.splitext(os.path.normpath(path))[0].replace(os.sep, "/")
            if name in sources:  # val.json and val.jsonl side by side
                raise CalibrationError(f"{path}: another --data file has the same source name {name!r}; rename one")
            sources[name] = data.read_records(path, a.image_root, a.skip_bad)[:a.n or None]  # DataError for a file without records
            data.check_support(sources[name], "rolemerge.calibrate", text_only=True)
        set_threads(a.threads, a.model)
        model, proc = load_model(a.model, dtype, a.device, a.device_map, a.trust_remote_code)
        stats = calibrate(model, proc, sources, a.batch_size, a.max_new_tokens, model_id=a.model,
                          features=a.features)
    except (CalibrationError, data.DataError) as e:
        fail(e)
    feats = stats.pop("features", None)
    try:  # a full disk, a read-only folder: `error: ...` naming the file, no temporary left
        save_stats(stats, a.out)
        if feats is not None:
            bl.save_features(feats, fpath, {k: stats[k] for k in ("model_id", "model_type", "fingerprint",
                                                                  "layer_names")})
    except OSError as e:
        fail(with_fix(e))
    if feats is not None:
        print(f"wrote {fpath}: features of {len(feats)} MoE layers over the same decoded tokens")
    elif os.path.exists(fpath):  # an earlier calibration's features must not pair with these statistics
        os.remove(fpath)
        print(f"removed {fpath}: comparator features of the replaced calibration (rerun with --features for new ones)")
    tot = sum(s["tokens"] for s in stats["sources"].values())
    print(f"wrote {a.out}: {len(stats['layer_names'])} MoE layers x {stats['num_experts']} experts, tokens "
          + ", ".join(f"{b}={n}" for b, n in zip(stats["buckets"], tot.tolist())))


if __name__ == "__main__":
    main()
