"""Run a (merged) MoE checkpoint on data: answers, accuracy per family, and the efficiency
numbers the paper reports (§5.5, App. G): parameters, checkpoint bytes, load time, time to
first token, decode tokens/s.

    python -m rolemerge.infer --model out/rolemerge/tiny-moe-rho0.5 --data out/data/test.json --limit 200

A merged checkpoint is an ordinary transformers checkpoint: nothing here is specific to
merging, which is the point (it loads with `from_pretrained` alone).
"""
import json
import os
import statistics
import time

import torch

from common import backbone as bb
from common import data
from common.answers import is_correct_for
from common.cli import (add_device_args, add_limit, add_overwrite, add_threads, check_out_file, check_overwrite,
                        entry_parser, load_kwargs, run_cli, set_threads)
from common.predictions import PredictionLog, fingerprint, model_digest
from rolemerge import blocks as blk
from rolemerge import calibrate as cal


class oracle_routing:
    """Context manager: route every token of a merged model to the groups of the experts the
    *original* router picks (issue "oracle-routing evaluation"), separating the quality of a
    grouping from the routing mass lost by averaging router rows.

    model: the merged model (K experts per layer); base_routers: list over MoE layers of the
    original router weights [N, H]; groups: the merge plan's groups [L][K][members] (pruning:
    K singletons, the other experts dropped). For each token x of layer l: s = softmax(W0 x),
    top-k of s renormalised (Qwen3-MoE / Qwen3-VL-MoE routing), expert e -> its group g(e);
    the gate weight of a dropped expert is removed and the others renormalised (a token whose
    experts were all dropped gets no MoE output). Two of a token's experts in one group add
    their weights. Needs softmax top-k routers (norm_topk_prob) and the eager experts path
    (set here, restored on exit); raises ValueError otherwise."""

    def __init__(self, model, base_routers, groups):
        self.model, self.handles = model, []
        self.blocks = [b for _, b in blk.moe_blocks(model)]
        if len(self.blocks) != len(groups) or len(base_routers) != len(groups):
            raise ValueError(f"{len(self.blocks)} MoE layers, {len(base_routers)} routers, {len(groups)} plan layers")
        tc = blk.text_config(model.config)
        if model.config.model_type not in ("qwen3_vl_moe", "qwen3_moe") or not getattr(tc, "norm_topk_prob", True):
            raise ValueError(f"oracle routing is implemented for softmax top-k renormalised routers "
                             f"(qwen3_moe, qwen3_vl_moe), not {model.config.model_type}")
        self.routers, self.luts, self.k = base_routers, [], tc.num_experts_per_tok
        for g in groups:
            K = len(g)
            lut = torch.full((base_routers[0].shape[0],), K, dtype=torch.long)   # K = dropped
            for gi, members in enumerate(g):
                lut[list(members)] = gi
            self.luts.append(lut)

    def _hook(self, i):
        def fn(module, args, out):
            x = args[0].reshape(-1, args[0].shape[-1])
            probs = torch.softmax(x.float() @ self.routers[i].float().T.to(x.device), dim=-1)
            w, idx = probs.topk(self.k, dim=-1)
            gid = self.luts[i].to(x.device)[idx]
            keep = gid < len(module.weight)
            w = torch.where(keep, w, torch.zeros_like(w))
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
            return out[0], w.to(out[1].dtype), gid
        return fn

    def __enter__(self):
        self.impl = getattr(self.model.config, "_experts_implementation", None)
        self.model.set_experts_implementation("eager")       # the eager loop skips index K (dropped)
        self.handles = [b.gate.register_forward_hook(self._hook(i)) for i, b in enumerate(self.blocks)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        if self.impl:
            self.model.set_experts_implementation(self.impl)


def checkpoint_bytes(path):
    """Bytes of the weight files (*.safetensors) of a checkpoint directory."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def param_count(model):
    """Number of parameters (all of them, vision tower included)."""
    return sum(p.numel() for p in model.parameters())


def _inputs(model, proc, records):
    """Left-padded generation inputs for a batch of records (VLM: image, or none for a
    text-only record, + question; a text LM: the question); earlier turns (`history`) go
    into the prompt."""
    history = [r.get("history", []) for r in records]
    if model.config.model_type in blk.VLM_TYPES:
        return proc.encode([data.load_image(r["image"], r.get("id", "?")) if r.get("image") else None
                            for r in records], [r["question"] for r in records], history=history)
    return cal.text_inputs(proc, [r["question"] for r in records], history)


def _ids(model, proc):
    """(eos id, pad id) of a VLProcessor or tokenizer."""
    eos = proc.eos_token_id
    pad = proc.pad_token_id if proc.pad_token_id is not None else eos
    return eos, pad


@torch.no_grad()
def predict(model, proc, records, batch_size=32, max_new_tokens=48, progress=True, log=None):
    """Batched greedy answers. records: dicts with question[, image, answer, family, id].
    Returns a list of {id, family, pred, answer, correct (None without a gold answer), n_tokens}.
    log: a `common.predictions.PredictionLog` keeping each finished batch (phase "predict")
    and holding those of a resumed run."""
    eos, pad = _ids(model, proc)

    def one(b):
        chunk = records[b * batch_size:(b + 1) * batch_size]
        batch = {k: v.to(model.device) for k, v in _inputs(model, proc, chunk).items()}
        gen = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad)
        out = []
        for r, row in zip(chunk, gen[:, batch["input_ids"].shape[1]:].tolist()):
            n = row.index(eos) + 1 if eos in row else len(row)
            text = proc.decode(row[:n]) if hasattr(proc, "image_processor") else \
                proc.decode(row[:n], skip_special_tokens=True)           # VLProcessor / plain tokenizer
            gold = r.get("answer")
            out.append({"id": r.get("id"), "family": r.get("family", "all"), "pred": text, "answer": gold,
                        "correct": None if gold is None else bool(is_correct_for(dict(r, family=r.get("family", "all")), text)),
                        "n_tokens": n})
        return out

    return (log or PredictionLog(None, None)).run("predict", -(-len(records) // batch_size), one,
                                                  desc="predict" if progress else False)


@torch.no_grad()
def speed(model, proc, records, n=8, decode_tokens=32):
    """Batch-1 latency on `n` records: median time to first token (prefill + 1 token, s) and
    decode throughput (decode_tokens - 1) / (t_decode_tokens - t_first) in tokens/s, with
    EOS suppressed so every run decodes exactly `decode_tokens` tokens. One warm-up run."""
    eos, pad = _ids(model, proc)
    ttft, tfull = [], []
    for j, r in enumerate([records[0]] + list(records[:n])):
        batch = {k: v.to(model.device) for k, v in _inputs(model, proc, [r]).items()}
        times = []
        for m in (1, decode_tokens):
            t = time.perf_counter()
            model.generate(**batch, max_new_tokens=m, min_new_tokens=m, do_sample=False, eos_token_id=eos,
                           pad_token_id=pad)
            times.append(time.perf_counter() - t)
        if j:                                  # j = 0 is the warm-up
            ttft.append(times[0])
            tfull.append(times[1])
    t1, tn = statistics.median(ttft), statistics.median(tfull)
    return {"ttft_s": t1, "decode_tok_s": (decode_tokens - 1) / max(tn - t1, 1e-9)}


def load_timed(path, dtype=None, device="cpu", device_map=None):
    """(model, processor-or-tokenizer, load seconds) through rolemerge.calibrate.load_model.
    The first load in a process also pays transformers' lazy import of the model class (measured
    4.6-5.5 s for a 5.8 MB tiny merge in a fresh `rolemerge.infer`, 0.07-0.13 s for the same
    load inside the quickstart): compare load times measured the same way."""
    t = time.perf_counter()
    model, proc = cal.load_model(path, dtype=dtype, device=device, device_map=device_map)
    return model, proc, time.perf_counter() - t


def main(argv=None):
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--model", required=True, help="checkpoint directory (merged or not), or tiny-moe")
    p.add_argument("--data", required=True,
                   help="LLaVA JSON/JSONL or canonical JSONL with questions (and answers for accuracy)")
    p.add_argument("--image-root", default=None, help=data.IMAGE_ROOT_HELP)
    add_limit(p, what="examples", dest="n")
    add_threads(p)
    add_device_args(p, device_map=True)
    p.add_argument("--batch-size", type=int, default=32, help="generation batch size")
    p.add_argument("--max-new-tokens", type=int, default=48, help="answer length cap")
    p.add_argument("--speed", action="store_true", help="also measure batch-1 time to first token and decode tok/s")
    p.add_argument("--out", default=None, help="write predictions + summary JSON here")
    p.add_argument("--resume", action="store_true",
                   help="continue a stopped run from its last finished batch (OUT.partial; the same flags)")
    add_overwrite(p)
    p.add_argument("--skip-bad", action="store_true", help=data.SKIP_BAD_HELP)
    a = p.parse_args(argv)
    for flag in ("batch_size", "max_new_tokens"):
        if getattr(a, flag) < 1:
            p.error(f"--{'limit' if flag == 'n' else flag.replace('_', '-')} must be a positive integer, got "
                    f"{getattr(a, flag)}")
    if a.out and os.path.realpath(a.out) == os.path.realpath(a.data):
        p.error(f"--out {a.out} is the data file; predictions would overwrite it")
    return run_cli(run, a)  # DataError, CalibrationError, RunError, BackboneError, files: `error: ...`, exit 2


def run(a):
    """The body of `main` for parsed flags: data first (every image decoded, refusals before
    the model loads), then predictions (each finished batch kept in OUT.partial), the
    summary, --out. Returns {"summary", "predictions"}."""
    set_threads(a.threads, a.model)
    if a.out:
        check_out_file(a.out)  # now, not after the whole run
        check_overwrite(a.out, a.overwrite, a.resume)
    records = data.expand_turns(data.read_records(a.data, a.image_root, a.skip_bad, limit=a.n))[:a.n or None]
    data.check_support(records, "rolemerge.infer", text_only=True, multi_turn=True)  # before the model loads
    fp = fingerprint(records, model=model_digest(a.model), batch_size=a.batch_size, max_new_tokens=a.max_new_tokens)
    with PredictionLog(a.out, fp, a.resume) as log:
        model, proc, load_s = load_timed(a.model, **load_kwargs(a))
        preds = predict(model, proc, records, a.batch_size, a.max_new_tokens, log=log)
        summary = {"model": a.model, "params": param_count(model),
                   "checkpoint_bytes": checkpoint_bytes(bb.resolve(a.model)), "load_s": load_s, "n": len(preds)}
        scored = [r for r in preds if r["correct"] is not None]
        if scored:
            fams = {}
            for x in scored:
                fams.setdefault(x["family"], []).append(x["correct"])
            fams["all"] = [x["correct"] for x in scored]
            summary["accuracy"] = {f: sum(c) / len(c) for f, c in fams.items()}
        if a.speed:
            summary.update(speed(model, proc, records))
        print(json.dumps(summary, indent=1))
        if a.out:
            data.atomic_write_text(a.out, json.dumps({"summary": summary, "predictions": preds}, indent=1))
        log.finish()
    return {"summary": summary, "predictions": preds}

if __name__ == "__main__":
    main()
