"""Speed benchmark of one MoD-wrapped projection (not a test).

Measures, in one run and side by side:
  1. forward+backward of a frozen 2048 -> 2048 nn.Linear on 2048 tokens wrapped with
       - MoD (E=8 rank-1 experts per pool, top-4, W=16; vectorised gather/scatter),
       - LoRA with the same number of trainable parameters (rank 16),
       - a straightforward MoD with Python loops over experts (the reference to beat),
     and the bare frozen layer for scale. Goal: MoD / LoRA <= 1.3.
  2. per-token decoding cost of the MoD layer (one new token with the W-1 routing cache)
     after a context of 64 vs 2048 tokens. Goal: ratio ~1 (independent of context length).

    python -m eval.tools.bench_mod                  # Qwen2.5-VL-3B sizes, CPU or the first GPU
    python -m eval.tools.bench_mod --dim 512 --tokens 512 --reps 3     # quick
"""
import statistics
import time

import torch
import torch.nn as nn

from common.cli import entry_parser
from mod.model import AdapterConfig, MoDLinear, RoutingContext, combine_gates, topr_gates


class LoopMoD(nn.Module):
    """MoD eq. 6 written the straightforward way: a Python loop over experts (and ranks)."""

    def __init__(self, mod):
        super().__init__()
        self.m = mod

    def forward(self, x):
        m, cfg = self.m, self.m.cfg
        out = m.base_layer(x)
        logits = m.router_logits(x)
        idx, gates = topr_gates(logits.unflatten(-1, (2, -1)), cfg.r)
        ia, ib = idx[..., 0, :], idx[..., 1, :]
        g = combine_gates(gates, "sqrt_product").to(x.dtype).flatten(0, -2)  # [N, r]
        xf, ia, ib = x.flatten(0, -2), ia.flatten(0, -2), ib.flatten(0, -2)
        h = torch.zeros(xf.shape[0], m.B.shape[1], device=x.device, dtype=x.dtype)
        for j in range(cfg.r):
            c = torch.zeros(xf.shape[0], device=x.device, dtype=x.dtype)
            for e in range(cfg.num_experts):  # A expert e on the tokens whose j-th choice it is
                idx = (ia[:, j] == e).nonzero().squeeze(1)
                c = c.index_put((idx,), (xf[idx] @ m.A[e]) * g[idx, j])
            for e in range(cfg.num_experts):  # B expert e adds its direction to its tokens
                idx = (ib[:, j] == e).nonzero().squeeze(1)
                h = h.index_add(0, idx, c[idx, None] * m.B[e])
        return out + m.scaling * h.view_as(out)


def timed(fns, reps, sync, stat=statistics.median):
    """{name: fn} -> {name: stat of the seconds per call} (median by default). Round-robin over
    the functions, so load from other processes hits all of them alike."""
    ts = {k: [] for k in fns}
    for k, fn in fns.items():  # warm-up
        fn()
    sync()
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            sync()
            ts[k].append(time.perf_counter() - t)
    return {k: stat(v) for k, v in ts.items()}


def main(argv=None):
    p = entry_parser(__spec__.name, "MoD vs LoRA vs per-expert loop speed, and decoding cost vs context.")
    p.add_argument("--dim", type=int, default=2048, help="in = out features (Qwen2.5-VL-3B hidden: 2048)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per forward+backward")
    p.add_argument("--experts", type=int, default=8, help="experts per pool E")
    p.add_argument("--r", type=int, default=4, help="top-r")
    p.add_argument("--window", type=int, default=16, help="routing window W")
    p.add_argument("--contexts", default="64,2048", help="two context lengths for the decoding comparison")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--skip-loop", action="store_true", help="skip the slow per-expert loop reference")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu / cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    p.add_argument("--compile", action="store_true",
                   help="also time the layer compiled as mod.train --compile does (cold-compile seconds, "
                        "compiled / eager step ratio; minutes of CPU)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    D, E = args.dim, args.experts
    base = nn.Linear(D, D, bias=False).to(dev, dt)
    lora_rank = E * (3 * D + D) // (2 * D)  # equal trainable parameters: E(3 in + out) = rank (in + out)
    ctx = RoutingContext()
    mod = MoDLinear(base, AdapterConfig(num_experts=E, r=args.r, window=args.window), ctx)
    lora = MoDLinear(base, AdapterConfig(method="lora", r=lora_rank), ctx)
    for layer in (mod, lora):
        for n, prm in layer.named_parameters(recurse=False):
            with torch.no_grad():
                prm.normal_(std=0.02)
    n_mod = sum(q.numel() for q in mod.parameters() if q.requires_grad)
    n_lora = sum(q.numel() for q in lora.parameters() if q.requires_grad)
    x = torch.randn(1, args.tokens, D, device=dev, dtype=dt, requires_grad=True)

    def step(layer):
        def f():
            ctx.mask, ctx.continuing = None, False
            layer(x).float().square().mean().backward()
            x.grad = None
            for q in layer.parameters():
                q.grad = None
        return f

    fns = {"frozen linear": step(base), "LoRA": step(lora), "MoD": step(mod)}
    if not args.skip_loop:
        fns["MoD per-expert loop"] = step(LoopMoD(mod))
    t = timed(fns, args.reps, sync)
    print(f"forward+backward, {D}->{D}, {args.tokens} tokens, E={E}, r={args.r}, W={args.window}, "
          f"{args.device} {args.dtype}; trainable params MoD {n_mod:,}, LoRA(rank {lora_rank}) {n_lora:,}")
    for k, v in t.items():
        print(f"  {k:22s} {1000 * v:9.1f} ms")
    print(f"  ratio MoD / LoRA           {t['MoD'] / t['LoRA']:.2f}   (goal <= 1.3)")
    if "MoD per-expert loop" in t:
        print(f"  ratio loop / MoD           {t['MoD per-expert loop'] / t['MoD']:.2f}")

    comp = {}
    if args.compile:   # the hot path as the trainer compiles it: the adapter layer's forward, in place
        cmod = MoDLinear(base, mod.cfg, ctx)
        cmod.load_state_dict(mod.state_dict())
        cmod.compile()
        t0 = time.perf_counter()
        step(cmod)()
        sync()
        comp["cold_compile_s"] = time.perf_counter() - t0
        tc = timed({"MoD": step(mod), "MoD compiled": step(cmod)}, args.reps, sync)
        comp["compiled_over_eager"] = tc["MoD compiled"] / tc["MoD"]
        print(f"  compiled MoD layer: cold compile + first step {comp['cold_compile_s']:.1f} s; step "
              f"{1000 * tc['MoD compiled']:.1f} ms vs eager {1000 * tc['MoD']:.1f} ms, "
              f"compiled / eager {comp['compiled_over_eager']:.2f}")

    # decoding: prefill a context (fills the W-1 routing cache), then time one-token steps
    mod.eval()
    caches = {}
    with torch.no_grad():
        for C in [int(c) for c in args.contexts.split(",")][:2]:
            ctx.mask, ctx.continuing = None, False
            mod(torch.randn(1, C, D, device=dev, dtype=dt))  # prefill: leaves the W-1 routing cache
            caches[C] = mod.window.cache
        tok = torch.randn(1, 1, D, device=dev, dtype=dt)

        def decode(C):
            def f():
                mod.window.cache, ctx.continuing = caches[C], True
                mod(tok)
            return f
        # millisecond calls are at the mercy of other processes: report the best of many
        res = timed({C: decode(C) for C in caches}, max(200, 40 * args.reps), sync, stat=min)
    (c1, v1), (c2, v2) = list(res.items())
    print(f"decoding one token with the routing cache (best of {max(200, 40 * args.reps)}): context {c1}: {1e6 * v1:.0f} us, context {c2}: "
          f"{1e6 * v2:.0f} us, ratio {v2 / v1:.2f} (goal ~1: no dependence on context length)")
    return {"fwd_bwd_ms": {k: 1000 * v for k, v in t.items()}, "mod_over_lora": t["MoD"] / t["LoRA"],
            "decode_us": {str(k): 1e6 * v for k, v in res.items()}, "decode_ratio": v2 / v1, **comp}


if __name__ == "__main__":
    main()
