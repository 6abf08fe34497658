"""MoD's greedy decoding cost against peft's LoRA, our LoRA and the bare model (not a test).

Measures, in one run, side by side, rounds interleaved over the variants (medians reported):
  1. per-token time of greedy `generate` with the KV cache (and MoD's routing cache) after a
     context of C tokens, on the committed tiny base (`--model tiny-dense`, hidden 128, 4 layers)
     and on a random tiny Qwen3-VL of hidden `--wide` (2 layers): bare model, our LoRA, peft's
     LoRA (rank 16 on q/k/v/o: MoD's trainable count on a square projection), MoD (E=8, top-4,
     W=16). The time of one step is the gap between two calls of a logits processor (one call per
     generated token), so prefill is excluded. Goals: MoD / peft LoRA <= 1.3 at tiny width,
     <= 1.05 at hidden 2048.
  2. MoD-Multi (`mod.infer.mod_debate`, rounds=1: 2 generations) against MAD
     (`multi_agent_debate`, rounds=1: 5 generations) wall time on shapes-world test questions,
     `--toy-model` (tiny-chat), batch 1 and 64, equal `max_new_tokens`. Goal: <= 0.5.
  3. aten operations per adapted layer per decoding step (torch.profiler), MoD and our LoRA.

peft is not a dependency: run from a venv that has it, else our LoRA is the reference (printed):

    out/venv-peft/bin/python -m eval.tools.bench_mod_decode --threads 1 --out eval/results/mod/bench_decode.json
"""
import copy
import json
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common.backbone import build_tiny, load_backbone
from common.cli import add_overwrite, entry_parser, refuse_existing
from common.data import atomic_write_text, read_records
from common.shapes import generate_split
from mod.infer import mod_debate, multi_agent_debate
from mod.model import AdapterConfig, MoDLinear, RoutingContext, attach
# deferred: peft (optional, not in requirements.txt: peft's LoRA is compared where it is installed)


class _Clock:
    """Logits processor that timestamps every generated token."""

    def __init__(self):
        self.t = []

    def __call__(self, input_ids, scores):
        self.t.append(time.perf_counter())
        return scores


def _randomise(model, std=0.02):
    """Non-zero adapter weights (B, lora_B start at zero): no branch can skip the adapter."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad or "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def variants(base, targets, peft_mod, rank=16):
    """{name: model} for the bare base, our LoRA, peft's LoRA (if peft imports), MoD."""
    out = {"bare": base}
    lora = copy.deepcopy(base)
    attach(lora, AdapterConfig(method="lora", r=rank, lora_alpha=2.0 * rank))
    out["our LoRA"] = lora
    if peft_mod is not None:
        names = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and "language_model" in n
                 and n.rsplit(".", 1)[-1] in targets]
        pm = peft_mod.get_peft_model(copy.deepcopy(base), peft_mod.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=names, lora_dropout=0.0))
        out["peft LoRA"] = pm
    mod = copy.deepcopy(base)
    attach(mod, AdapterConfig(method="mod", num_experts=8, r=4, window=16))
    out["MoD"] = mod
    for m in out.values():
        _randomise(m)
        m.eval()
    return out


def decode_times(models, context, steps, rounds, vocab):
    """{name: median seconds per generated token} over `rounds` interleaved rounds."""
    g = torch.Generator().manual_seed(context)
    ids = torch.randint(0, vocab, (1, context), generator=g)
    mask = torch.ones_like(ids)
    ts = {k: [] for k in models}
    for r in range(rounds + 1):                                      # round 0: warm-up
        for k, m in models.items():
            clock = _Clock()
            with torch.no_grad():
                m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                           do_sample=False, logits_processor=[clock], pad_token_id=0)
            if r:
                ts[k] += [b - a for a, b in zip(clock.t[1:], clock.t[2:])]   # skip the prefill's token
    return {k: statistics.median(v) for k, v in ts.items()}


def op_counts(dim=128, E=8, r=4, W=16, rank=16):
    """aten operations (torch.profiler) of one decoding step of one adapted dim -> dim layer: MoD
    with its routing cache, our LoRA, the bare nn.Linear: {name: (top-level ops = dispatches
    from Python, all ops including nested ones)}."""
    torch.manual_seed(0)
    base = torch.nn.Linear(dim, dim, bias=False)
    res = {}
    for name, cfg in (("MoD", AdapterConfig(num_experts=E, r=r, window=W)),
                      ("our LoRA", AdapterConfig(method="lora", r=rank)), ("bare", None)):
        ctx = RoutingContext()
        layer = (MoDLinear(base, cfg, ctx) if cfg else base).eval()
        with torch.no_grad():
            ctx.mask, ctx.continuing = None, False
            layer(torch.randn(1, 64, dim))
            ctx.continuing = True
            x = torch.randn(1, 1, dim)
            c0 = getattr(getattr(layer, "window", None), "cache", None)
            layer(x)                     # computes the per-forward plan that all layers of a model share
            if c0 is not None:
                layer.window.cache = c0  # the same step again: the plan is reused, as by layers 2..L
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                layer(x)
        ev = [e for e in prof.events() if e.name.startswith("aten::")]
        top = [e for e in ev if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
        res[name] = (len(top), len(ev))
    return res


def toy_walls(model_name, n_questions, batches, max_new_tokens, rounds):
    """{batch: {"MoD-Multi": s, "MAD": s, tokens...}} medians over interleaved rounds. MoD's
    adapters are random (same cost as trained ones); MAD runs on the frozen base."""
    base, proc = load_backbone(model_name)
    tuned = copy.deepcopy(base)
    attach(tuned, AdapterConfig(method="mod"))
    _randomise(tuned)
    tuned.eval()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        generate_split(d, "test", max(n_questions))
        recs_all = read_records(f"{d}/test.json")
        for b, n in zip(batches, n_questions):
            recs = recs_all[:n]
            w = {"MoD-Multi": [], "MAD": []}
            tok = {}
            for r in range(rounds):
                order = [("MoD-Multi", lambda: mod_debate(tuned, proc, recs, 1, b, max_new_tokens)),
                         ("MAD", lambda: multi_agent_debate(base, proc, recs, 1, batch_size=b,
                                                            max_new_tokens=max_new_tokens))]
                for k, fn in (order if r % 2 == 0 else order[::-1]):
                    res, wall = fn()
                    w[k].append(wall)
                    tok[k] = sum(x["n_tokens"] for x in res)
            out[b] = {"questions": n, **{k: statistics.median(v) for k, v in w.items()},
                      **{f"{k} tokens": v for k, v in tok.items()}}
    return out


def main(argv=None):
    p = entry_parser(__spec__.name, "MoD greedy decoding per token vs peft LoRA / our LoRA / bare; MoD-Multi vs MAD.")
    p.add_argument("--model", default="tiny-dense", help="committed tiny base for the tiny-width rows")
    p.add_argument("--wide", type=int, default=2048, help="hidden size of the random 2-layer wide model (0 = skip)")
    p.add_argument("--contexts", default="64,2048", help="context lengths before decoding")
    p.add_argument("--steps", type=int, default=24, help="timed tokens per generate call")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians reported)")
    p.add_argument("--toy-model", default="tiny-chat", help="base for MoD-Multi vs MAD ('' = skip)")
    p.add_argument("--toy-batches", default="1,64", help="batch sizes for MoD-Multi vs MAD")
    p.add_argument("--toy-questions", default="4,64", help="questions per batch size (same order)")
    p.add_argument("--toy-max-new-tokens", type=int, default=32, help="max_new_tokens of every generation")
    p.add_argument("--toy-rounds", type=int, default=3, help="interleaved rounds of the toy comparison")
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--out", default="", help="write the result file (eval/report.py format) here")
    add_overwrite(p)
    args = p.parse_args(argv)
    refuse_existing(args.out, args.overwrite)  # before anything runs: no silent overwrite of a measurement
    torch.set_num_threads(args.threads)
    try:
        import peft
    except ImportError:
        peft = None
        print("peft is not installed here: our LoRA is the reference (pip install peft in another venv, "
              "see the module docstring)")
    ref = "peft LoRA" if peft is not None else "our LoRA"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    rows = []
    contexts = [int(c) for c in args.contexts.split(",")]
    bases = [(args.model, lambda: load_backbone(args.model)[0])]
    if args.wide:
        bases.append((f"random qwen3_vl hidden {args.wide}, 2 layers",
                      lambda: build_tiny("qwen3_vl", hidden=args.wide, layers=2)[0]))
    for label, make in bases:
        base = make().eval()
        models = variants(base, targets, peft)
        vocab = min(400, base.config.get_text_config().vocab_size)
        for C in contexts:
            t = decode_times(models, C, args.steps, args.rounds, vocab)
            key = {"bare": "bare_ms", "our LoRA": "our_lora_ms", "peft LoRA": "peft_lora_ms", "MoD": "mod_ms"}
            row = {"kind": "decode", "model": label, "context": C, "reference": ref,
                   **{key[k]: round(1e3 * v, 4) for k, v in t.items()},
                   "mod_over_ref": round(t["MoD"] / t[ref], 3), "mod_over_bare": round(t["MoD"] / t["bare"], 3),
                   "our_lora_over_peft": round(t["our LoRA"] / t["peft LoRA"], 3) if peft is not None else None}
            rows.append(row)
            print(f"{label}, context {C}: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in t.items())
                  + f"; MoD / {ref} {t['MoD'] / t[ref]:.2f}, MoD / bare {t['MoD'] / t['bare']:.2f}"
                  + (f", our LoRA / peft LoRA {t['our LoRA'] / t['peft LoRA']:.2f}" if peft is not None else ""))
        del models, base
    ops = op_counts()
    print("aten ops per adapted layer per decoding step (128 -> 128; top-level / all): "
          + ", ".join(f"{k} {a} / {b}" for k, (a, b) in ops.items()))
    toy = {}
    if args.toy_model:
        batches = [int(b) for b in args.toy_batches.split(",")]
        nq = [int(n) for n in args.toy_questions.split(",")]
        toy = toy_walls(args.toy_model, nq, batches, args.toy_max_new_tokens, args.toy_rounds)
        for b, v in toy.items():
            ratio = v["MoD-Multi"] / v["MAD"]
            rows.append({"kind": "debate", "model": args.toy_model, "batch": b, "questions": v["questions"],
                         "max_new_tokens": args.toy_max_new_tokens, "mod_multi_s": round(v["MoD-Multi"], 3),
                         "mad_s": round(v["MAD"], 3), "multi_over_mad": round(ratio, 3),
                         "mod_multi_tokens": v["MoD-Multi tokens"], "mad_tokens": v["MAD tokens"]})
            print(f"{args.toy_model} batch {b}, {v['questions']} questions, max_new_tokens {args.toy_max_new_tokens}: "
                  f"MoD-Multi {v['MoD-Multi']:.2f} s ({v['MoD-Multi tokens']} tokens), MAD {v['MAD']:.2f} s "
                  f"({v['MAD tokens']} tokens), ratio {ratio:.2f} (goal <= 0.5)")
    rows.append({"kind": "ops", "model": "one 128 -> 128 layer, one decoding step", "mod_ops": ops["MoD"][0],
                 "our_lora_ops": ops["our LoRA"][0], "bare_ops": ops["bare"][0], "mod_ops_all": ops["MoD"][1],
                 "our_lora_ops_all": ops["our LoRA"][1], "bare_ops_all": ops["bare"][1]})
    if args.out:
        cmd = "python -m eval.tools.bench_mod_decode " + " ".join(sys.argv[1:] if argv is None else argv)
        atomic_write_text(args.out, json.dumps({"experiment": "MoD greedy decoding cost (CPU, one thread)",
                                                "source": cmd + (f" (peft {peft.__version__})" if peft else ""),
                                                "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
