"""MoD mechanism experiments on one frozen linear layer (pre-registered in
eval/logs/mod.md).

Both tasks wrap one frozen `nn.Linear` W0 (in = d_c + d_z, out = d_out) in `mod.model.MoDLinear`
(the adapter code the VLM runs) and regress y = W0 x + delta(x). A token is x = [c ; z]: a
routing code c (d_c) and content z ~ N(0, I) (d_z). The update is a rank-1 map chosen by the
token's type t, with an A/B *pairing* (a(t), b(t)) out of E x E:

    delta(x) = u_{a(t)} (v_{b(t)} . z)          u_a in R^{d_out}, v_b in R^{d_z}

(a) "pairing": tokens i.i.d., 16 types = every (a, b) of E = 4, c = the type's code (clean).
    Dual routers can pick a(t) and b(t) independently (E A + E B experts cover all 16 maps);
    a shared router couples A_j with B_j; MoE-LoRA couples each expert's A and B; LoRA is linear
    in x and cannot express a type-dependent map of z. Arms at token-level routing.
(b) "stance": sequences of T tokens in constant-stance segments (S = 4 stances, lengths
    geometric, mean `seg_mean`), stance s uses pairing (s, perm(s)); the code is noisy:
    c = beta * c_s + N(0, I). A window mean of the router logits (momentum switching, eq. 1)
    averages the noise away inside a segment and lags at its boundaries. Arms: MoD with token
    routing, window W in {4, 16, 64}, region W = 16.

Metric: normalised squared error ||y_hat - y||^2 / mean ||delta||^2 per test token (the frozen
base scores 1.0). Per arm: learning rate picked from LRS on a validation split (seed 0), then
`seeds` seeds (task, init and data all drawn from the seed), mean over seeds; 95% CI by
bootstrap over test items of the seed-averaged item error; difference vs the reference arm by
the two-level paired bootstrap (seeds, then items; eval.metrics.two_level_bootstrap). Switch rate: fraction of adjacent test tokens whose top-1 router-A expert differs.

    python -m eval.toys.mod --part mechanism --threads 1      # ~minutes on one CPU thread
"""
import hashlib
import json
import math
import os
import time

import numpy as np
import torch

from common.data import atomic_write_text
from common.routing import switch_rate
from common.schedule import lr_at
from eval.metrics import bootstrap_ci, two_level_bootstrap
from eval.plots import bar_ci_png, line_png
from eval.toys.mod_claims import save_runs
from mod.model import AdapterConfig, MoDLinear, RoutingContext
from mod.train import MIN_LR_RATIO

D_C, D_Z, D_OUT, E = 8, 16, 16, 4
D_IN = D_C + D_Z
# Arm -> AdapterConfig kwargs. Trainable parameters (D_IN = 24, D_OUT = 16):
#   MoD E=4 top-2: A + B + 2 routers = 4*40 + 2*4*24 = 352; shared router: 256;
#   MoE-LoRA 6 rank-1 experts + router, top-2: 6*40 + 6*24 = 384 (closest expert count >= MoD's);
#   LoRA rank 9: 9*40 = 360 (matched); LoRA rank 2 = MoD's top-r.
PAIRING_ARMS = {
    "MoD (dual routers)": dict(method="mod", num_experts=E, r=2, lora_alpha=2.0, granularity="token"),
    "MoD shared router": dict(method="mod", num_experts=E, r=2, lora_alpha=2.0, granularity="token",
                              shared_router=True),
    "MoE-LoRA token": dict(method="moelora", num_experts=6, expert_rank=1, r=2, lora_alpha=2.0, granularity="token"),
    "LoRA r=9 (matched)": dict(method="lora", r=9, lora_alpha=9.0),
    "LoRA r=2": dict(method="lora", r=2, lora_alpha=2.0),
}
STANCE_ARMS = {
    "token W=1": dict(granularity="token"),
    "window W=4": dict(granularity="window", window=4),
    "window W=16": dict(granularity="window", window=16),
    "window W=64": dict(granularity="window", window=64),
    "region W=16": dict(granularity="region", window=16),
}
STANCE_BASE = dict(method="mod", num_experts=E, r=2, lora_alpha=2.0)
LRS = (3e-3, 1e-2, 3e-2)
# The lr each arm picked on validation in the registered run (eval/logs/mod.md, 2026-11-30): a rerun with
# `picks=COMMITTED_PICKS` trains only the test seeds at these lrs (no sweep).
COMMITTED_PICKS = {"pairing": {arm: 3e-2 for arm in PAIRING_ARMS},
                   "stance": {"token W=1": 3e-3, "window W=4": 3e-2, "window W=16": 1e-2, "window W=64": 1e-2,
                              "region W=16": 3e-2}}
SETTINGS = dict(steps=600, warmup=30, batch=(16, 16), stance_batch=(4, 128), n_val=2048, n_test=4096,
                stance_T=128, seg_mean=32, beta=0.7, n_stances=4, aux_coef=0.01)


# ----------------------------------------------------------------------------- tasks

class Task:
    """One random instance of a task (all drawn from `seed`): frozen W0, type codes, u_a, v_b,
    and the type -> (a, b) pairing. kind: "pairing" or "stance"."""

    def __init__(self, kind, seed, S=SETTINGS):
        g = torch.Generator().manual_seed(1000 + seed)
        self.kind, self.S, self.g = kind, S, g
        self.W0 = torch.randn(D_OUT, D_IN, generator=g) / math.sqrt(D_IN)
        self.u = torch.randn(E, D_OUT, generator=g) / math.sqrt(D_OUT) * 2
        self.v = torch.randn(E, D_Z, generator=g) / math.sqrt(D_Z)
        if kind == "pairing":
            self.pairs = torch.tensor([(a, b) for a in range(E) for b in range(E)])  # 16 types
        else:
            perm = torch.randperm(E, generator=g)
            self.pairs = torch.stack([torch.arange(S["n_stances"]), perm[:S["n_stances"]]], 1)
        self.codes = torch.randn(len(self.pairs), D_C, generator=g)

    def sample(self, shape, g):
        """shape (B, T) -> x [B, T, D_IN], y [B, T, D_OUT], delta [B, T, D_OUT], types [B, T]."""
        B, T = shape
        if self.kind == "pairing":
            t = torch.randint(len(self.pairs), (B, T), generator=g)
            c = self.codes[t]
        else:  # constant stance inside segments of geometric length (mean seg_mean)
            p = 1.0 / self.S["seg_mean"]
            switch = torch.rand(B, T, generator=g) < p
            switch[:, 0] = True
            draw = torch.randint(len(self.pairs), (B, T), generator=g)
            seg = switch.long().cumsum(1) - 1  # segment index per token
            first = torch.where(switch, draw, torch.zeros_like(draw))
            # stance of a segment = the draw at its first token
            starts = torch.zeros(B, T, dtype=torch.long)
            for b in range(B):
                starts[b] = first[b][switch[b]][seg[b]]
            t = starts
            c = self.S["beta"] * self.codes[t] + torch.randn(B, T, D_C, generator=g)
        z = torch.randn(B, T, D_Z, generator=g)
        a, b = self.pairs[t, 0], self.pairs[t, 1]
        delta = self.u[a] * (self.v[b] * z).sum(-1, keepdim=True)
        x = torch.cat([c, z], -1)
        return x, x @ self.W0.T + delta, delta, t


def make_layer(task, cfg_kw, seed):
    torch.manual_seed(seed)
    base = torch.nn.Linear(D_IN, D_OUT, bias=False)
    with torch.no_grad():
        base.weight.copy_(task.W0)
    layer = MoDLinear(base, AdapterConfig(**cfg_kw), RoutingContext())
    layer.name = "layer"
    return layer


def train_eval(task, cfg_kw, lr, seed, split, S=SETTINGS):
    """Train one adapter on fresh batches, score `split` ("val" or "test").
    Returns {"item_err": [n] per-token normalised error, "err", "switch_rate", "params", "s",
    "test_sha1": sha1 of the scored inputs x (equal for every arm of a seed: the pairing check)}."""
    t0 = time.time()
    layer = make_layer(task, cfg_kw, seed)
    params = [p for p in layer.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(2000 + seed)
    shape = S["batch"] if task.kind == "pairing" else S["stance_batch"]
    ctx = layer.ctx
    layer.train()
    for step in range(S["steps"]):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, S["steps"], lr, S["warmup"], MIN_LR_RATIO)
        x, y, _, _ = task.sample(shape, g)
        ctx.aux = []
        loss = ((layer(x) - y) ** 2).sum(-1).mean()
        if ctx.aux:
            loss = loss + S["aux_coef"] * torch.stack(ctx.aux).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    layer.eval()
    # evaluation data: its own generator per split (val and test never overlap with training draws)
    ge = torch.Generator().manual_seed((3000 if split == "val" else 4000) + seed)
    n = S["n_val"] if split == "val" else S["n_test"]
    T = 16 if task.kind == "pairing" else S["stance_T"]
    x, y, delta, _ = task.sample((n // T, T), ge)
    ctx.record, ctx.trace = True, []
    with torch.no_grad():
        pred = layer(x)
    ctx.record = False
    scale = (delta ** 2).sum(-1).mean()
    item = ((pred - y) ** 2).sum(-1) / scale  # [B, T]
    sw = switch_rate(ctx.trace[0][1][..., 0]) if ctx.trace and task.kind == "stance" else None
    return {"item_err": item.reshape(-1).tolist(), "err": float(item.mean()), "switch_rate": sw,
            "params": sum(p.numel() for p in params), "s": time.time() - t0,
            "test_sha1": hashlib.sha1(x.numpy().tobytes()).hexdigest()}


# ----------------------------------------------------------------------------- experiment

def run_part(kind, arms, out_dir, seeds=3, S=SETTINGS, log=print, picks=None):
    """lr sweep on validation (seed 0) then `seeds` test seeds per arm; `picks` {arm: lr} fixes
    each arm's lr (no sweep). Resumable: each (arm, lr, split, seed) result is a small JSON file
    in out_dir/runs/ written atomically. The result's "_per_question" entry holds the test runs
    in the form of `eval.toys.mod_claims.save_runs` (ids: the sha1 of each seed's test inputs)."""
    runs = os.path.join(out_dir, "runs")
    os.makedirs(runs, exist_ok=True)

    def cached(arm, lr, seed, split):
        f = os.path.join(runs, f"{kind}__{arm.replace(' ', '_').replace('/', '')}__lr{lr:g}__{split}{seed}.json")
        if os.path.exists(f):
            with open(f) as fh:
                return json.load(fh)
        cfg = {**STANCE_BASE, **arms[arm]} if kind == "stance" else arms[arm]
        res = train_eval(Task(kind, seed, S), cfg, lr, seed, split, S)
        atomic_write_text(f, json.dumps(res))
        log(f"  {kind} {arm:20s} lr {lr:g} {split} seed {seed}: err {res['err']:.4f}"
            + (f" switch {res['switch_rate']:.3f}" if res["switch_rate"] is not None else "") + f" ({res['s']:.1f} s)")
        return res

    out, runs_pq, ids = {}, [], {}
    for arm in arms:
        val = {lr: cached(arm, lr, 0, "val")["err"] for lr in LRS} if picks is None else {}
        best = min(val, key=val.get) if picks is None else picks[arm]
        tests = [cached(arm, best, s, "test") for s in range(seeds)]
        for s, t in enumerate(tests):
            ids[f"seed{s}"] = f"sha1 {t.get('test_sha1')} of the {len(t['item_err'])} test tokens of seed {s}"
            runs_pq.append({"arm": arm, "seed": s, "metric": "test error", "lr": best, "ids": f"seed{s}",
                            "switch_rate": t["switch_rate"], "scores": [round(v, 4) for v in t["item_err"]]})
        items = np.mean([t["item_err"] for t in tests], 0)  # seed-averaged error per item
        lo, hi = bootstrap_ci(items)
        out[arm] = {"lr": best, "val_err_by_lr": {f"{k:g}": v for k, v in val.items()},
                    "err": float(items.mean()), "ci_low": lo, "ci_high": hi,
                    "err_by_seed": [t["err"] for t in tests], "params": tests[0]["params"],
                    "switch_rate": (float(np.mean([t["switch_rate"] for t in tests]))
                                    if tests[0]["switch_rate"] is not None else None),
                    "switch_rate_by_seed": [t["switch_rate"] for t in tests], "_items": items,
                    "_seed_items": [t["item_err"] for t in tests]}
    ref = next(iter(arms))
    for arm, r in out.items():
        if arm == ref:
            continue
        pb = two_level_bootstrap(r["_seed_items"], out[ref]["_seed_items"])   # seeds, then items
        signs = [np.sign(a - b) for a, b in zip(r["err_by_seed"], out[ref]["err_by_seed"])]
        r["diff_vs_ref"] = {"ref": ref, "diff": pb["diff"], "ci_low": pb["ci_low"], "ci_high": pb["ci_high"],
                            "per_seed": pb["per_seed"], "bootstrap": pb["bootstrap"],
                            "same_sign_all_seeds": bool(len(set(signs)) == 1 and signs[0] != 0),
                            "sd_item_diff": float(np.std(r["_items"] - out[ref]["_items"]))}
    for r in out.values():
        r.pop("_items"), r.pop("_seed_items")
    out["_per_question"] = {"ids": ids, "runs": runs_pq}
    return out


def figures(res, out_dir, S=SETTINGS):
    """PNG figures: error per arm with CI for both parts; switch rate and error vs W."""
    paths = []
    for kind, title in (("pairing", "(a) pairing task: test error (normalised MSE), 3 seeds, 95% CI"),
                        ("stance", "(b) stance task: test error (normalised MSE), 3 seeds, 95% CI")):
        if kind in res:
            bars = [(a.replace(" (", "\n(").replace(" W=", "\nW="), r["err"], r["ci_low"], r["ci_high"])
                    for a, r in res[kind].items()]
            paths.append(bar_ci_png(bars, os.path.join(out_dir, f"mechanism_{kind}_error.png"), title,
                                    "error (base = 1)"))
    if "stance" in res:
        st = res["stance"]
        Ws = {"token W=1": 1, "window W=4": 4, "window W=16": 16, "window W=64": 64}
        sw = [(w, st[a]["switch_rate"]) for a, w in Ws.items() if a in st]
        er = [(w, st[a]["err"], st[a]["ci_low"], st[a]["ci_high"]) for a, w in Ws.items() if a in st]
        pts = {"region W=16 switch": (16, st["region W=16"]["switch_rate"])} if "region W=16" in st else {}
        paths.append(line_png({"switch rate (window)": sw, "true boundary rate": [(w, 1 / S["seg_mean"]) for w, _ in sw]},
                              os.path.join(out_dir, "mechanism_switch_rate_vs_W.png"),
                              "(b) switch rate of the top-1 A expert vs W", "W (log2)", "switch rate", logx=True,
                              points=pts))
        paths.append(line_png({"error (window)": er}, os.path.join(out_dir, "mechanism_error_vs_W.png"),
                              "(b) test error vs W (95% CI)", "W (log2)", "error", logx=True,
                              points={"region W=16": (16, st["region W=16"]["err"])} if "region W=16" in st else None))
    return paths


def run(out_dir="out/mod/mechanism", seeds=3, parts=("pairing", "stance"), log=print, picks=None,
        per_question=None, overwrite=False):
    """Both mechanism parts -> out_dir/mechanism.json + PNG figures. Returns the results dict.
    picks: {kind: {arm: lr}} (e.g. COMMITTED_PICKS) trains the test seeds at those lrs, no sweep.
    per_question: a folder (e.g. eval/results/mod/mechanism_per_question) that gets <kind>.json,
    every test run's per-token error (`eval.toys.mod_claims.save_runs`; a run already there with
    other scores raises ValueError unless `overwrite`)."""
    t0 = time.time()
    res = {"settings": SETTINGS, "lrs": LRS, "picks": picks}
    for kind in parts:
        res[kind] = run_part(kind, PAIRING_ARMS if kind == "pairing" else STANCE_ARMS, out_dir, seeds, log=log,
                             picks=(picks or {}).get(kind))
        pq = res[kind].pop("_per_question")
        if per_question:
            header = {"part": "mechanism", "task": kind, "metric": "test error",
                      "items": "per test token: squared error / mean ||delta||^2 (frozen base = 1.0), rounded to "
                               "4 decimals; ids: a fingerprint of each seed's test inputs (the same for every arm)",
                      "source": "python -m eval.toys.mod --part mechanism --mechanism-lr committed --threads 1"}
            save_runs(os.path.join(per_question, f"{kind}.json"), header, pq["ids"], pq["runs"], overwrite)
    res["figures"] = figures(res, out_dir)
    res["wall_s"] = time.time() - t0
    atomic_write_text(os.path.join(out_dir, "mechanism.json"), json.dumps(res, indent=1))
    for kind in parts:
        log(f"\n({kind}) {'arm':22s} {'params':>6s} {'lr':>6s} {'error [95% CI]':>26s} {'diff vs ref [95% CI]':>28s}"
            f" {'seeds':>5s} {'switch':>6s}")
        for arm, r in res[kind].items():
            d = r.get("diff_vs_ref")
            ds = f"{d['diff']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]" if d else "ref"
            agree = ("yes" if d["same_sign_all_seeds"] else "no") if d else ""
            sw = f"{r['switch_rate']:.3f}" if r["switch_rate"] is not None else ""
            log(f"    {arm:22s} {r['params']:6d} {r['lr']:6g} {r['err']:.4f} [{r['ci_low']:.4f}, {r['ci_high']:.4f}]"
                f"   {ds:>28s} {agree:>5s} {sw:>6s}")
    return res
