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
import importlib.util
import json
import os

import torch
from tqdm import tqdm

from common import data
from common.checkpoint import CheckpointError, checked_weights
from common.cli import (add_device_args, add_limit, add_overwrite, add_threads, entry_parser, fail, load_kwargs,
                        set_threads, with_fix)
from rolemerge import baselines as bl
from rolemerge import comparators
from rolemerge import deepseek_vl2 as vl2
from rolemerge.blocks import VLM_TYPES, CalibrationError, check_supported, model_info, moe_blocks
from rolemerge.shards import check_weights
from rolemerge.stats import check_nonempty, save_stats, summary_path

# deferred: transformers, common.backbone (about 2 and 4.5 s of CPU to import: they load models only; the stats
# files and the streaming merge, which import this module, never need them)

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
    """The feature recorders of the comparison methods: rolemerge.baselines.FeatureRecorder and
    rolemerge.comparators.ComparatorRecorder."""
    return [bl.FeatureRecorder(model), comparators.ComparatorRecorder(model)]


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
    (`rolemerge.baselines.FeatureRecorder` and `rolemerge.comparators.ComparatorRecorder`)
    in the same decoding pass, over exactly the tokens the statistics count (`DecodeMask`); they are returned as
    stats["features"] (list over MoE layers of dicts; per-layer sums, no per-token storage).
    Raises CalibrationError for an unsupported model or an empty bucket."""
    info = model_info(model, model_id)
    vlm = model.config.model_type in VLM_TYPES
    buckets = ["image", "question", "answer"] if vlm else ["question", "answer"]
    if vlm:
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
        if importlib.util.find_spec("accelerate") is None:
            raise CalibrationError("--device-map needs the optional package accelerate (pip install accelerate)")
    path = bb.resolve(path)
    config = load_config(path, trust_remote_code)
    if config.model_type == "deepseek_vl_v2":   # no transformers class: built from transformers parts
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
    if not os.path.isdir(path):
        raise CalibrationError(f"{path}: no such checkpoint directory (a save_pretrained folder, or tiny-moe)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CalibrationError(f"{path}: no config.json (not a save_pretrained checkpoint directory)")
    if _raw_model_type(path) == "deepseek_vl_v2":
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
    check_weights(path)
    return config


def _raw_model_type(path):
    """model_type of config.json read as JSON (None when unreadable: AutoConfig then names the problem)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def main(argv=None):
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
            sources[name] = data.read_records(path, a.image_root, a.skip_bad, limit=a.n)  # DataError for a file without records
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
