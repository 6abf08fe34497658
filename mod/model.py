"""Mixture of Debaters (MoD) adapters on a frozen VLM, and the LoRA / MoE-LoRA baselines.

Paper: "Mixture of Debaters: Learn to Debate at Architectural Level in Multi-Agent Reasoning"
(arXiv 2606.29425), §3.1, eq. 1-6 and 9-10, Algorithm 1.

Every target `nn.Linear` (q/k/v/o of the language model by default) becomes

    h = W0 x + (alpha / r) * h_MoD(x)                                         # eq. 6

    x_route = mean of the last W inputs (causal, padding excluded)           # eq. 1, "momentum switching"
    l_A = W_A x_route,  l_B = W_B x_route                                     # eq. 2, dual routers
    I_A = topk(l_A, r), I_B = topk(l_B, r)                                    # eq. 3, ranked by logit
    g_A = softmax(l_A)[I_A] / sum(...), g_B likewise                         # eq. 4, fp32
    g = sqrt(g_A * g_B)                                                       # eq. 5 (pairs j-th A with j-th B)
    h_MoD = sum_j g_j * (A[I_A_j] . x) * B[I_B_j]                            # rank-1 experts A [E,in], B [E,out]

computed without a loop over experts: z = x @ A.T ([..,E]), gather the top-r entries,
scale by g, scatter-add them into an [.., E] weight at the B indices, multiply by B.

x_route itself is never materialised: the routers are linear, so W_g x_route equals the
window mean of the per-token logits W_g x (same cumulative-sum window, padding excluded).
Averaging E (or 2E) logits instead of `in_features` inputs makes momentum switching almost
free and shrinks the decoding cache to the last W tokens' router logits per layer.

Usage:
    model, proc = load_backbone("tiny-dense")
    attach(model, AdapterConfig(method="mod"))           # freezes the base, wraps q/k/v/o
    out = model(**batch); loss = out.loss + cfg.aux_coef * aux_loss(model)
    save_adapters(model, "out/mod/adapter"); load_adapters(fresh_model, "out/mod/adapter")  # checks the base

Cached decoding: a routing context, shared by all adapter layers of one model, is filled by a
forward pre-hook on the model with the current tokens' padding mask and whether this call
continues a KV-cached sequence. Each routed layer keeps the router logits of its last W non-pad
tokens in a fixed-size ring, so routing during `generate` equals routing in a full forward
(tested, also long after the ring wrapped and with left padding). A one-token step
(`MoDLinear._decode`) is a fixed, context-independent set of small operations: one matmul for
both routers and the A experts, an in-place ring write and a weighted sum for the window, one
top-r over both pools, one gather-weighted sum of B rows; the per-step bookkeeping that only
depends on the mask and the token count is computed once per forward for all layers. Beam search
reorders the batch and is not supported by that cache (greedy and sampling are).

Copy unit: this file plus common/routing.py (imported as `common.routing`) are all it needs
besides the standard library, torch and safetensors; copied into another project they give
MoD / LoRA / MoE-LoRA adapters, save/load included, on any transformers causal LM or VLM text
stack (tests/test_mod_copy.py).
"""
import hashlib
import json
import math
import os
from contextlib import suppress
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from common.routing import load_balance_loss, region_mean, window_mean

METHODS = ("mod", "lora", "moelora")
GRANULARITIES = ("token", "region", "window")
COMBINES = ("sqrt_product", "product", "mean")
CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"


@dataclass
class AdapterConfig:
    """Adapter hyper-parameters (peft names where they mean the same thing).

    method: "mod" (decoupled rank-1 pools, dual routers), "lora" (rank r), "moelora"
      (num_experts coupled rank-`expert_rank` LoRA experts, one router, top-r).
    r: top-r experts per token for mod/moelora (mod's effective rank), LoRA rank for lora.
    lora_alpha: output scale alpha / r (eq. 6).
    num_experts: E of each pool. experts_pattern: {target module suffix: E} overriding
      num_experts for those projections, as peft's rank_pattern overrides r (e.g. {"o_proj": 10}:
      how `mod.params` matches MoE-LoRA's trainable parameters to MoD's where no uniform E does).
      window: W of the routing input. granularity: token
      (x_route = x), region (mean inside blocks of W), window (sliding mean of the last W);
      "" (default) = window for mod (momentum switching, eq. 1) and token for moelora (the
      paper's MixLoRA baseline routes each token; "window" there is an explicit variant).
    combine: how g_A and g_B combine (eq. 5 default sqrt_product). shared_router: one router,
      I_A = I_B. noise_std: Gaussian router-logit noise in training. router_init_std: std of
      the router init. aux_coef: lambda of eq. 7 (used by the training loop).
    """
    method: str = "mod"
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    r: int = 4
    lora_alpha: float = 8.0
    num_experts: int = 8
    experts_pattern: dict = field(default_factory=dict)
    expert_rank: int = 1
    window: int = 16
    granularity: str = ""
    combine: str = "sqrt_product"
    shared_router: bool = False
    noise_std: float = 0.0
    router_init_std: float = 0.02
    aux_coef: float = 0.01

    def __post_init__(self):
        if isinstance(self.target_modules, str):
            self.target_modules = [s.strip() for s in self.target_modules.split(",") if s.strip()]
        if not self.granularity:
            self.granularity = "token" if self.method == "moelora" else "window"
        if self.method != "lora":   # --experts-pattern is named: it is the only way to set it by flag
            bad_keys = [k for k in self.experts_pattern if k not in self.target_modules]
            low = {k: v for k, v in self.experts_pattern.items() if not isinstance(v, int) or v < self.r}
            if bad_keys:
                raise ValueError(f"experts_pattern (--experts-pattern) names {bad_keys}, which are not "
                                 f"target_modules {self.target_modules}; use those names (e.g. o_proj=10)")
            if low:
                raise ValueError(f"experts_pattern (--experts-pattern) gives {low}: each count must be an integer "
                                 f">= top-r ({self.r}, --r)")
        checks = [(self.method in METHODS, f"method must be one of {METHODS}"),
                  (self.granularity in GRANULARITIES, f"granularity must be one of {GRANULARITIES}"),
                  (self.combine in COMBINES, f"combine must be one of {COMBINES}"),
                  (self.r >= 1 and self.window >= 1 and self.expert_rank >= 1, "r, window, expert_rank must be >= 1"),
                  (self.method == "lora" or self.r <= self.num_experts, "top-r must not exceed num_experts"),
                  (self.method != "lora" or not self.experts_pattern, "experts_pattern is for mod / moelora pools")]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"AdapterConfig: {msg} (got {self})")

    def layer_config(self, name):
        """The config of the projection named `name` (a module path): experts_pattern's count
        for a suffix it names (the longest match), else this config unchanged."""
        hits = [k for k in self.experts_pattern if _matches(name, [k])]
        if not hits:
            return self
        return replace(self, num_experts=self.experts_pattern[max(hits, key=len)], experts_pattern={})

    @property
    def route_window(self):
        return 1 if self.granularity == "token" else self.window


def _eager_or_disabled(fn):
    """fn as is in eager mode; under torch.compile, fn with dynamo disabled (it reads Python
    state: memo dicts, parameter version counters). `torch.compiler.disable` alone would add a
    frame-evaluation wrapper to every eager call (about 10 us per layer per decoding step)."""
    off = torch.compiler.disable(fn)

    def call(*args, **kw):
        return off(*args, **kw) if torch.compiler.is_compiling() else fn(*args, **kw)
    call.__doc__, call.__name__ = fn.__doc__, fn.__name__
    return call


class RoutingContext:
    """State shared by the adapter layers of one model for the current forward call.

    mask: [B, T] bool of the current tokens (None = no padding); continuing: True when the
    call extends a KV-cached sequence (use the per-layer token caches); aux: per-layer
    load-balance losses of this forward (training only); record: if True, layers append
    (name, idx_A [B,T,r], idx_B [B,T,r], mask) to `trace` for diagnostics; reduce: None, or
    `common.routing.rank_mean` while a data-parallel run trains (the aux loss of the global batch).

    The decoding bookkeeping that depends only on the mask and the number of real tokens seen
    (window weights, ring slot, counts) is the same for every layer, so it is computed once
    per forward by the first layer that needs it (`shared`) and reused by the others."""

    def __init__(self):
        self.mask, self.continuing, self.aux, self.record, self.trace = None, False, [], False, []
        self.reduce = None
        self._memo = {}

    @_eager_or_disabled
    def shared(self, kind, tensors, extra, make):
        """make() once for the same `tensors` (by identity, kept alive here) and `extra`: one
        entry per `kind`. Layers that advance in lock step hold the same count tensors, so the
        first layer of a forward computes and the others hit."""
        hit = self._memo.get(kind)
        if hit is not None and hit[1] == extra and all(a is b for a, b in zip(hit[0], tensors)):
            return hit[2]
        val = make()
        self._memo[kind] = (tensors, extra, val)
        return val


def _model_pre_hook(ctx):
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        emb = kwargs.get("inputs_embeds")
        T = (ids if ids is not None else emb).shape[1]
        past = kwargs.get("cache", kwargs.get("past_key_values"))
        past_len = past.get_seq_length() if past is not None and hasattr(past, "get_seq_length") else 0
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            past_len = max(past_len, mask.shape[1] - T)
            mask = mask[:, -T:].bool()
        else:
            mask = None  # 4-D custom masks: no padding information we can use
        ctx.mask, ctx.continuing, ctx.aux = mask, past_len > 0, []
    return hook


def _decode_plan(n_seen, mask, W, granularity, C):
    """What one cached decoding step (one new token per row) does to the ring, the same for
    every layer: (sidx [B, 1, C] long: the ring slot the new logits are written to, wv [B, 1, W+1]
    fp32: averaging weights over the ring's slots after the write, n_after [B]).

    Ring slot j % W holds the logits of real token number j (0-based, padding not counted); slot
    W is a dump slot that pads write to (never averaged). A real token is averaged with the
    previous n-1 real ones (window: n = min(n_seen + 1, W); region: its position in its block of
    W, + 1); a pad gets the mean the full forward gives a pad (the window / block of the previous
    real token; zero weights before the first one)."""
    B, dev = n_seen.shape[0], n_seen.device
    m = torch.ones(B, dtype=torch.bool, device=dev) if mask is None else mask[:, -1].to(dev).bool()
    if granularity == "region":
        n_real = n_seen % W + 1
        n_pad = torch.where(n_seen > 0, (n_seen - 1) % W + 1, torch.zeros_like(n_seen))
    else:
        n_real, n_pad = (n_seen + 1).clamp(max=W), n_seen.clamp(max=W)
    n = torch.where(m, n_real, n_pad)
    last = torch.where(m, n_seen, n_seen - 1)                    # number of the newest averaged token
    age = (last[:, None] - torch.arange(W, device=dev)[None]) % W   # slot s holds token last - age[s]
    wv = torch.zeros(B, W + 1, device=dev)
    wv[:, :W] = (age < n[:, None]).float() / n.clamp(min=1)[:, None].float()
    slot = torch.where(m, n_seen % W, torch.full_like(n_seen, W))
    return slot[:, None, None].expand(B, 1, C), wv[:, None, :], n_seen + m.long()


class RoutingWindow:
    """Momentum switching (eq. 1) applied to per-token router logits, with the routing cache
    for cached decoding. By linearity window_mean(x) @ W_g.T == window_mean(x @ W_g.T).
    Holds no parameters.

    Cache: (ring [B, W+1, C] fp32, n_seen [B] long: real tokens so far). Slot j % W holds the
    logits of real token number j for each row's last W real tokens (zeros where a row has seen
    fewer); slot W is where a pad's logits go. A one-token decoding step (`step`) costs O(W C)
    whatever the context: one in-place scatter into the ring and one [1, W+1] x [W+1, C]
    weighted sum, recomputed from the ring each step (no running sum: no drift); the ring keeps
    its shape and storage across steps. A plain object, not an nn.Module: it holds no
    parameters, and the decoding step reads and writes its attributes once per token."""

    def __init__(self, cfg, ctx):
        self.W, self.granularity, self.ctx = cfg.route_window, cfg.granularity, ctx
        self.cache = None

    def __call__(self, x):
        return self.forward(x)

    def ready(self):
        """True when the next call may use `step` (a continuing call with a filled cache)."""
        return self.ctx.continuing and self.cache is not None

    def forward(self, x):
        """x: [B, T, C] per-token values (router logits) -> their window / region mean [B, T, C]."""
        if self.W == 1:
            return x
        B, T, _ = x.shape
        ctx = self.ctx
        if ctx.continuing and self.cache is not None and T == 1:
            return self.step(x)
        mask = ctx.mask if ctx.mask is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
        if ctx.continuing and self.cache is not None:
            ring, n_seen = self.cache
            if ring.shape[0] != B:
                raise RuntimeError(f"routing cache holds {ring.shape[0]} rows but the batch has {B} "
                                   f"(beam search / batch reordering is not supported)")
            W = self.W
            i = torch.arange(W, device=x.device)[None]
            n_valid = n_seen.clamp(max=W)                               # oldest first: tokens n_seen - W + i
            buf = ring.gather(1, ((n_seen[:, None] - W + i) % W)[..., None].expand(B, W, ring.shape[-1]))
            valid = i >= (W - n_valid)[:, None]
            xc, mc = torch.cat([buf.to(x.dtype), x], 1), torch.cat([valid, mask], 1)
            offset = n_seen - n_valid
        else:
            xc, mc = x, mask
            n_seen = None
            offset = torch.zeros(B, dtype=torch.long, device=x.device)
        if self.granularity == "region":
            xr = region_mean(xc, self.W, mc, offset=offset)[:, -T:]
        else:
            xr = window_mean(xc, self.W, mc)[:, -T:]
        n_after = ctx.shared("count", (n_seen, ctx.mask), (B, T, str(x.device)),
                             lambda: (0 if n_seen is None else n_seen) + mask.sum(1))
        self._update_cache(xc.detach(), mc, n_after)
        return xr

    def step(self, x):
        """One cached decoding step: x [B, 1, C] fp32 logits of the new token -> window / region
        mean [B, 1, C] (equal to the full forward's, tested); writes x into the ring in place."""
        ring, n_seen = self.cache
        B, _, C = x.shape
        if ring.shape[0] != B:
            raise RuntimeError(f"routing cache holds {ring.shape[0]} rows but the batch has {B} "
                               f"(beam search / batch reordering is not supported)")
        sidx, wv, n_after = self.ctx.shared("plan", (n_seen, self.ctx.mask), (self.W, self.granularity, C),
                                            lambda: _decode_plan(n_seen, self.ctx.mask, self.W, self.granularity, C))
        if x.requires_grad:                                 # autograd on: out of place, the ring stays detached
            ring = ring.scatter(1, sidx, x)
            self.cache = (ring.detach(), n_after)
        else:
            ring.scatter_(1, sidx, x)
            self.cache = (ring, n_after)
        return torch.bmm(wv, ring)

    def _update_cache(self, xc, mc, n_seen):
        # the last W real positions, oldest first (pads sort first, order preserved): no host sync
        B, L, C = xc.shape
        W = self.W
        if L < W:                                        # fixed ring size: zeros in front
            xc = torch.cat([xc.new_zeros(B, W - L, C), xc], 1)
            mc = torch.cat([mc.new_zeros(B, W - L), mc], 1)
            L = W
        key = torch.where(mc, torch.arange(L, device=xc.device).expand_as(mc), torch.full_like(mc, -1, dtype=torch.long))
        pos = key.sort(dim=1).values[:, -W:]  # real positions are distinct, pads (-1) first
        valid = pos >= 0
        buf = xc.float().gather(1, pos.clamp(min=0)[..., None].expand(-1, -1, C)) * valid[..., None]
        # entry i is real token number n_seen - W + i, which lives in slot (n_seen - W + i) % W
        entry = (torch.arange(W, device=xc.device)[None] - n_seen[:, None]) % W      # slot s <- entry (s - n_seen) % W
        ring = xc.new_zeros(B, W + 1, C, dtype=torch.float32)
        ring[:, :W] = buf.gather(1, entry[..., None].expand(B, W, C))
        self.cache = (ring, n_seen)


def topr_gates(logits, r):
    """MoD's eq. 3-4 for the full and the decoding path alike: top-r experts ranked by their
    router logits and their renormalised gates.

    logits: [..., P, E] fp32, one row per router pool (P = 2: A and B of dual routing; 1 for a
    shared router or MoE-LoRA). Returns idx long [..., P, r] (eq. 3: TopK of the logits, largest
    first) and gates fp32 [..., P, r] = softmax(l)[I] / sum(softmax(l)[I]), computed as the
    softmax over the r kept logits (eq. 4; the same value, without the softmax over all E).
    Ranking by logits, not by probabilities, keeps near-ties apart: two logits 1e-7 apart can
    round to the same fp32 probability, and then the index order, not the router, would decide."""
    vals, idx = logits.topk(r, dim=-1)
    return idx, vals.softmax(-1)


def combine_gates(g, combine):
    """eq. 5: the gate of the j-th ranked (A, B) pair from g [..., P, r] (`topr_gates`) ->
    [..., r] fp32. combine: "sqrt_product" sqrt(g_A g_B) (the paper's), "product" g_A g_B,
    "mean" (g_A + g_B) / 2. P = 1 (shared router): g_A = g_B, so sqrt_product and mean are g_A
    itself. With autograd on, sqrt's input is clamped at 1e-30 (a finite gradient at 0)."""
    if g.shape[-2] == 1:
        g1 = g[..., 0, :]
        return g1.square() if combine == "product" else g1
    if combine == "mean":
        return g.mean(-2)
    gg = g.prod(-2)
    if combine == "product":
        return gg
    return (gg.clamp_min(1e-30) if torch.is_grad_enabled() else gg).sqrt()


class MoDLinear(nn.Module):
    """Frozen nn.Linear + MoD adapter (eq. 1-6), or the LoRA / MoE-LoRA baselines.

    forward(x [B, T, in]) -> [B, T, out] = base(x) + (lora_alpha / r) * adapter(x).
    Parameters: mod: A [E, in], B [E, out], router_A [E, in], router_B [E, in] (absent with
    shared_router); lora: lora_A [r, in], lora_B [out, r]; moelora: lora_A [E*k, in],
    lora_B [out, E*k] (k = expert_rank, expert e owns rows/columns e*k..e*k+k-1), router [E, in].
    Init as LoRA: A Kaiming-uniform, B zeros (the wrapped model starts equal to the base),
    routers N(0, router_init_std)."""

    def __init__(self, base, cfg, ctx):
        super().__init__()
        self.base_layer, self.cfg, self.ctx = base, cfg, ctx
        for p in base.parameters():
            p.requires_grad_(False)
        self.scaling = cfg.lora_alpha / cfg.r
        E, din, dout = cfg.num_experts, base.in_features, base.out_features
        # Trainable weights live in fp32 whatever the base dtype (as peft does): a bf16 weight
        # would drop most updates of lr * 1e-2 size. The adapter path computes in fp32 and is cast
        # back to the base output's dtype (under CUDA autocast the matmuls still run in bf16).
        dev = base.weight.device
        new = lambda *shape: nn.Parameter(torch.zeros(*shape, device=dev, dtype=torch.float32))
        if cfg.method == "mod":
            self.A, self.B = new(E, din), new(E, dout)
            self.router_A = new(E, din)
            self.router_B = None if cfg.shared_router else new(E, din)
        elif cfg.method == "lora":
            self.lora_A, self.lora_B = new(cfg.r, din), new(dout, cfg.r)
        else:
            self.lora_A, self.lora_B = new(E * cfg.expert_rank, din), new(dout, E * cfg.expert_rank)
            self.router = new(E, din)
        self.window = RoutingWindow(cfg, ctx) if cfg.method != "lora" else None
        self.pools = 2 if cfg.method == "mod" and not cfg.shared_router else 1   # P: router pools in the logits
        self._fused_names = {"mod": ("router_A",) + (() if cfg.shared_router else ("router_B",)) + ("A", "B"),
                             "moelora": ("router", "lora_A", "lora_B")}.get(cfg.method, ())
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        for name, p in self.named_parameters(recurse=False):
            if name in ("A", "lora_A"):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))  # peft's LoRA A init
            elif name.startswith("router"):
                nn.init.normal_(p, std=self.cfg.router_init_std)
            else:
                nn.init.zeros_(p)  # B, lora_B: start at the base model

    def router_logits(self, x):
        """Routing logits of eq. 2 for every token: W_g x_route, [B, T, E] per router
        (A and B concatenated on the last axis for dual routing: [B, T, 2E]), always fp32:
        computed outside autocast, since in bf16 many window-mean logits tie and the
        tie-break, not the router, would decide top-r and the A/B pairing."""
        if self.cfg.method == "moelora":
            w = self.router
        elif self.router_B is None:
            w = self.router_A
        else:
            w = torch.cat([self.router_A, self.router_B])
        with torch.autocast(x.device.type, enabled=False):
            logits = x.float() @ w.float().T  # [B, T, E or 2E] fp32
        return self.window(logits)  # window mean of W_g x == W_g x_route (linearity)

    def forward(self, x):
        out = self.base_layer(x)
        h = self._adapter(x if x.dtype == torch.float32 else x.float())
        return out + (h if h.dtype == out.dtype else h.to(out.dtype))

    def _adapter(self, x):
        """The adapter term (alpha/r) * h for fp32 input x [B,T,in] -> [B,T,out] fp32."""
        cfg = self.cfg
        if cfg.method == "lora":
            return self.scaling * ((x @ self.lora_A.T) @ self.lora_B.T)
        if x.shape[1] == 1 and not self.training and (self.window.W == 1 or self.window.ready()):
            return self._decode(x)
        return self._adapter_full(x)

    def _adapter_full(self, x):
        """Training / prefill path of `_adapter` (mod, moelora): any T, aux losses recorded."""
        cfg = self.cfg
        logits = self.router_logits(x)                                  # [B,T,P*E] fp32
        if self.training and cfg.noise_std > 0:
            logits = logits + cfg.noise_std * torch.randn_like(logits)
        P = self.pools
        logits = logits.unflatten(-1, (P, -1))                          # [B,T,P,E]
        idx, g = topr_gates(logits, cfg.r)                              # [B,T,P,r] each (eq. 3-4)
        ia, ib = idx[..., 0, :], idx[..., P - 1, :]
        # softmax over all experts: only the aux loss (eq. 9, training) reads it
        probs = logits.softmax(-1) if self.training else None           # [B,T,P,E]
        pa, pb = (None, None) if probs is None else (probs[..., 0, :], probs[..., P - 1, :])
        if cfg.method == "moelora":
            w = torch.zeros_like(logits[..., 0, :]).scatter_(-1, ia, g[..., 0, :])   # [B,T,E] gate per expert
            z = (x @ self.lora_A.T).unflatten(-1, (cfg.num_experts, cfg.expert_rank))  # [B,T,E,k]
            h = (z * w.to(x.dtype)[..., None]).flatten(-2) @ self.lora_B.T  # [B,T,out]
            self._bookkeeping(pa, ia, pa, ia)
            return self.scaling * h
        gg = combine_gates(g, cfg.combine)                              # eq. 5, [B,T,r]
        z = x @ self.A.T  # [B,T,E]: every A expert's projection (rank 1 each)
        coef = z.gather(-1, ia) * gg.to(z.dtype)  # [B,T,r]: g_j * (A[I_A_j] . x); z is bf16 under autocast
        w = torch.zeros_like(z).scatter_add(-1, ib, coef)  # [B,T,E] weight of each B expert
        self._bookkeeping(pa, ia, pb, ib)
        return self.scaling * (w @ self.B)  # eq. 6

    @_eager_or_disabled   # reads parameter version counters
    def _decode_weights(self):
        """(F, Bs) for `_decode`: F [P*E + E*k, in] = the router weight(s) stacked on the expert
        down-projections (A for mod, lora_A for moelora), Bs = scaling * B ([E, out] mod) or
        scaling * lora_B ([out, E*k] moelora), fp32. Cached while no parameter changed (their
        version counters, identity and storage, checked every step: a few microseconds) and
        autograd is off; rebuilt per call otherwise."""
        own = self._parameters   # a plain dict: no nn.Module attribute lookup per step
        ps = tuple(own[n] for n in self._fused_names)
        key = tuple((id(p), p._version, p.data_ptr()) for p in ps)
        hit = self.__dict__.get("_fused")
        if hit is not None and hit[0] == key and not torch.is_grad_enabled():
            return hit[1], hit[2]
        F = torch.cat([p.float() for p in ps[:-1]])
        Bs = self.scaling * ps[-1].float()
        if not torch.is_grad_enabled():
            self._fused = (key, F, Bs)
        return F, Bs

    def _decode(self, x):
        """One cached decoding step (x [B, 1, in] fp32, eval mode): the same eq. 1-6 as the full
        path with fewer, fixed-shape operations: one matmul gives the router logits of both pools
        and the expert projections z; the routing window is updated from its ring (O(W) per
        token); top-r of both pools in one topk; eq. 4's renormalised gates as the softmax of the
        top-r logits (probs[I] / sum probs[I] = softmax over the kept logits); the r selected B
        rows mixed by one batched matmul. Returns [B, 1, out] fp32 (tested equal to the full
        forward during `generate`, ring wrap-around and left padding included)."""
        cfg, ctx = self.cfg, self.ctx
        E, B = cfg.num_experts, x.shape[0]
        F, Bs = self._decode_weights()
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                y = torch.nn.functional.linear(x, F)
        else:
            y = torch.nn.functional.linear(x, F)                       # [B, 1, P*E + E*k]
        P = self.pools
        logits, z = y.split_with_sizes([P * E, y.shape[-1] - P * E], -1)
        if self.window.W > 1:
            logits = self.window.step(logits)                           # the routing window, from its ring
        idx, g = topr_gates(logits.view(B, P, E), cfg.r)               # [B, P, r], ranked (eq. 3-4)
        ia, ib = (idx[:, 0], idx[:, 0]) if P == 1 else idx.unbind(1)
        if ctx.record:
            self._bookkeeping(None, ia[:, None], None, ib[:, None])
        if cfg.method == "moelora":
            w = torch.zeros(B, E, device=x.device).scatter_(-1, ia, g[:, 0])   # [B, E]
            zz = z.view(B, E, cfg.expert_rank) * w[..., None]
            return (zz.view(B, 1, -1) @ Bs.T)
        gg = combine_gates(g, cfg.combine)                              # eq. 5, [B, r]
        coef = z.view(B, -1).gather(-1, ia) * gg                        # [B, r]: g_j * (A[I_A_j] . x)
        compiling = torch.compiler.is_compiling()   # cached in eager mode only (never a graph output)
        off = None if compiling else self.__dict__.get("_bag_offsets")
        if off is None or off.shape[0] != B or off.device != x.device:           # [B] bag starts 0, r, 2r, ...
            off = torch.arange(0, B * cfg.r, cfg.r, device=x.device)
            if not compiling:
                self.__dict__["_bag_offsets"] = off
        # eq. 6: sum_j coef_j B[I_B_j], one weighted bag of r rows per token (aten's embedding_bag,
        # mode 0 = sum, without F.embedding_bag's per-call input checks and offsets)
        h = torch.embedding_bag(Bs, ib.reshape(-1), off, False, 0, False, coef.reshape(-1))[0]
        return h.view(B, 1, -1)

    @torch.compiler.disable   # appends to the shared ctx lists: compiled, it would guard on their lengths and
    def _bookkeeping(self, pa, ia, pb, ib):   # recompile per layer (compile_adapters compiles the rest)
        ctx = self.ctx
        if self.training:  # eq. 9 per layer: E/2 sum_i (f_A P_A + f_B P_B), probabilities for P
            ctx.aux.append(0.5 * (load_balance_loss(pa, ia, ctx.mask, ctx.reduce) +
                                  load_balance_loss(pb, ib, ctx.mask, ctx.reduce)))
        if ctx.record:
            ctx.trace.append((self.name, ia.detach(), ib.detach(), ctx.mask))


# ----------------------------------------------------------------------------- decoder stack

def text_model(model):
    """The decoder stack of a transformers VLM or causal LM: the module whose `layers` are the
    decoder layers. Looked up as `model.model.language_model` (Qwen-VL, LLaVA(-NeXT), Gemma3,
    Mistral3, InternVL), `model.model.text_model` (Idefics3, SmolVLM), `model.language_model`
    (Llama4: a causal LM, whose `.model` is taken), `model.model` (causal LMs); never a vision
    tower. Raises ValueError naming the class when none holds a `layers` nn.ModuleList.
    (Same function as `common.backbone.text_model`, kept here so this file copies on its own; tested equal.)"""
    inner = getattr(model, "model", None)
    for found in (getattr(inner, "language_model", None), getattr(inner, "text_model", None),
                  getattr(model, "language_model", None), getattr(model, "text_model", None), inner, model):
        for m in (found, getattr(found, "model", None)):  # a causal LM wraps its decoder in `.model`
            if isinstance(getattr(m, "layers", None), nn.ModuleList):
                return m
    raise ValueError(f"{type(model).__name__}: no decoder stack found (looked for model.language_model, "
                     f"model.text_model, language_model, model with a `layers` ModuleList); this family is "
                     f"not supported")


# ----------------------------------------------------------------------------- base identity / atomic files

def base_identity(model):
    """What trained adapters depend on in their base: architecture, text width, depth,
    vocabulary and a fingerprint of the weights (`weights_fingerprint`), plus the path it was
    loaded from (for messages only: a moved checkpoint is the same base). Same dict as
    `common.backbone.base_identity` (tested), kept here so this file copies on its own."""
    t = model.config.get_text_config()
    return {"model_type": model.config.model_type, "hidden_size": t.hidden_size,
            "num_hidden_layers": t.num_hidden_layers, "vocab_size": t.vocab_size,
            "weights": weights_fingerprint(model),
            "name_or_path": getattr(model.config, "_name_or_path", "") or ""}


@torch.no_grad()
def weights_fingerprint(model, n=4096):
    """'sha256 X' over n evenly strided values of the input embedding matrix, rounded to
    bf16 and hashed as fp32 bytes (same value as `common.backbone.weights_fingerprint`)."""
    w = model.get_input_embeddings().weight.detach().reshape(-1)
    sample = w[::max(1, w.numel() // n)][:n].to(torch.bfloat16).float().cpu().contiguous()
    return "sha256 " + hashlib.sha256(bytes(sample.view(torch.uint8).tolist())).hexdigest()[:16]


def identity_mismatch(saved, now):
    """Why a base of identity `now` cannot stand in for the `saved` one, [] if it can:
    ['key saved vs now'] for each differing key (name_or_path ignored); the weights only when
    all else matches. Keys that `saved` lacks (recorded before they existed) are not compared."""
    diff = [f"{k} {saved[k]!r} vs {now.get(k)!r}" for k in saved
            if k not in ("name_or_path", "weights") and saved[k] != now.get(k)]
    if not diff and saved.get("weights", now.get("weights")) != now.get("weights"):
        diff = [f"same architecture and size, but the weights differ: embedding {saved['weights']} vs "
                f"{now.get('weights')}"]
    return diff


def _atomic_write(path, write):
    """write(tmp) to a temp file next to `path`, give it the mode a plain open() would (the
    umask; safetensors writes 0600), then rename it onto `path`; the temp file is removed when
    the write or the rename fails, so `path` is either untouched or complete."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.remove(tmp)
        raise


def _save_tensors(tensors, path):
    _atomic_write(path, lambda tmp: save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp))


def _write_text(path, text):
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    _atomic_write(path, write)


# ----------------------------------------------------------------------------- attach / utilities

def _matches(name, suffixes):
    return any(name == s or name.endswith("." + s) for s in suffixes)


def attach(model, cfg):
    """Wrap every nn.Linear of the language model whose name ends with one of
    `cfg.target_modules` and freeze everything else. Returns the list of wrapped names.

    Only the decoder stack (`text_model(model)`) is searched (never the vision tower or
    lm_head). Raises ValueError if nothing matches or adapters are already attached."""
    if getattr(model, "_adapter", None) is not None:
        raise ValueError("adapters already attached to this model")
    lm = text_model(model)
    names = [n for n, m in lm.named_modules() if isinstance(m, nn.Linear) and _matches(n, cfg.target_modules)]
    if not names:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"target_modules {cfg.target_modules} match no nn.Linear of the language model; "
                         f"available suffixes: {linear}")
    for p in model.parameters():
        p.requires_grad_(False)
    ctx = RoutingContext()
    for n in names:
        parent_name, _, child = n.rpartition(".")
        parent = lm.get_submodule(parent_name) if parent_name else lm
        layer = MoDLinear(getattr(parent, child), cfg.layer_config(n), ctx)
        layer.name = n
        setattr(parent, child, layer)
    hook = model.register_forward_pre_hook(_model_pre_hook(ctx), with_kwargs=True)
    model._adapter = {"config": cfg, "ctx": ctx, "names": names, "hook": hook}
    return names


def unload(model):
    """Undo `attach` (peft's `unload`): every wrapped layer back to its base nn.Linear, the
    routing pre-hook removed, the adapters dropped. The base parameters stay frozen. Returns the
    AdapterConfig; ValueError when no adapters are attached."""
    adapter = getattr(model, "_adapter", None)
    if adapter is None:
        raise ValueError("no adapters attached to this model")
    lm = text_model(model)
    for n in adapter["names"]:
        parent_name, _, child = n.rpartition(".")
        parent = lm.get_submodule(parent_name) if parent_name else lm
        setattr(parent, child, getattr(parent, child).base_layer)
    adapter["hook"].remove()
    model._adapter = None
    return adapter["config"]


def adapter_layers(model):
    """[(name, MoDLinear)] in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoDLinear)]


def compile_adapters(model, backend="inductor", **kw):
    """torch.compile the hot path only, per adapter layer and in place: the training / prefill
    adapter term (`_adapter_full`: routing window, top-r gates, expert mix; graph breaks around
    the eager aux-loss bookkeeping) and the one-token decoding step (`_decode`; LoRA: `_adapter`),
    each its own compiled function shared by all layers of a shape, while `MoDLinear.forward`
    (base layer + dispatch) and the transformers model around it stay eager (Qwen-VL code
    graph-breaks and a whole-model compile costs minutes). Parameter names, state_dict and
    saving are unchanged. kw go to torch.compile (dynamic, mode="reduce-overhead", ...).
    Returns the number of layers compiled.

    Recompiles: dynamo keeps one cache of compiled variants per function (code object), shared
    by all layers; a variant per layer kind (in / out features, bias) x train / eval (grad
    mode, input requires_grad) x batch 1 / batch > 1 (size 1 is specialised) x static / dynamic
    lengths. `recompile_limit` (dynamo's default 8, after which it silently runs eager) is
    raised to 16 per kind, which covers training, evaluation and cached generation at several
    batch sizes in one process (tested with `fail_on_recompile_limit_hit`). A process that
    compiles other models too can call `torch._dynamo.reset()` between them to start fresh."""
    layers = adapter_layers(model)
    kinds = {(m.base_layer.in_features, m.base_layer.out_features, m.base_layer.bias is not None) for _, m in layers}
    cfg = torch._dynamo.config  # torch imports torch._dynamo lazily on first attribute access
    field = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, field, max(getattr(cfg, field), 16 * len(kinds)))
    for _, m in layers:
        names = ("_adapter",) if m.cfg.method == "lora" else ("_adapter_full", "_decode")
        for name in names:
            fn = getattr(type(m), name)
            setattr(m, name, torch.compile(fn.__get__(m), backend=backend, **kw))
    return len(layers)


def adapter_state_dict(model):
    """Trainable adapter tensors only (names relative to the model)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def num_trainable(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def aux_loss(model):
    """Mean over adapter layers of the per-layer load-balance loss of the last forward
    (eq. 9 normalised by the number of layers); 0 if none was recorded (eval mode, lora)."""
    aux = model._adapter["ctx"].aux
    if not aux:
        return torch.zeros((), device=next(model.parameters()).device)
    return torch.stack(aux).mean()


def routing_context(model):
    return model._adapter["ctx"]


def save_adapters(model, path):
    """Write path/adapter_config.json (the AdapterConfig + `base_model`: the base's identity,
    see `base_identity`) + path/adapter_model.safetensors (adapter tensors only, fp32
    whatever the base dtype); each file atomically (temp file + rename), weights first."""
    os.makedirs(path, exist_ok=True)
    cfg = model._adapter["config"]
    _save_tensors({k: v.detach().float().cpu() for k, v in adapter_state_dict(model).items()},
                  os.path.join(path, WEIGHTS_NAME))
    meta = {**asdict(cfg), "base_model": base_identity(model)}
    _write_text(os.path.join(path, CONFIG_NAME), json.dumps(meta, indent=2))  # no temp file left on failure


def load_config(path):
    """-> (AdapterConfig, the identity of the base the adapters were trained on).
    Raises FileNotFoundError / ValueError naming the file when it is missing, unreadable or not
    written by `save_adapters` (no base_model)."""
    f = os.path.join(path, CONFIG_NAME)
    if not os.path.exists(f):
        raise FileNotFoundError(f"{path}: no {CONFIG_NAME} (not an adapter directory written by mod.train)")
    try:
        with open(f) as fh:
            meta = json.load(fh)
        base = meta.pop("base_model")
        return AdapterConfig(**meta), base
    except KeyError:
        raise ValueError(f"{f} records no base_model (not written by mod.train / save_adapters)") from None
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{f} is not a valid adapter config ({e})") from None


def _copy_checked(own, state, path):
    """Copy `state` (name -> tensor) into the model parameters `own` (name -> parameter),
    raising ValueError naming `path` for a tensor whose shape differs from its parameter."""
    with torch.no_grad():
        for k, v in state.items():
            if own[k].shape != v.shape:
                raise ValueError(f"{path}: {k} has shape {tuple(v.shape)}, model expects {tuple(own[k].shape)}")
            own[k].copy_(v)


def load_adapters(model, path):
    """Attach the adapters saved in `path` to a fresh base model and load their weights.
    Raises ValueError when the base differs from the one the adapters were trained on
    (architecture, width, depth, vocabulary, embedding weights: `identity_mismatch`;
    the message names both bases), on missing/unexpected
    tensors or shapes, and on an unreadable (e.g. truncated) weights file. Returns the config."""
    if is_peft(path):                                     # peft's LoRA format: renamed tensors, same maths
        return load_peft(model, path)
    cfg, saved = load_config(path)
    now = base_identity(model)
    diff = identity_mismatch(saved, now)
    if diff:
        raise ValueError(f"{path}: adapters were trained on base {saved['name_or_path'] or '?'} and do not fit "
                         f"base {now['name_or_path'] or '?'} ({'; '.join(diff)})")
    weights = os.path.join(path, WEIGHTS_NAME)
    try:
        state = load_file(weights)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no {WEIGHTS_NAME}") from None
    except Exception as e:  # safetensors raises its own error type for truncated / corrupt files
        raise ValueError(f"{weights} is unreadable ({e}); the file is incomplete or corrupt") from None
    attach(model, cfg)
    own = dict(model.named_parameters())
    missing = [k for k, p in own.items() if p.requires_grad and k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise ValueError(f"{path} does not fit this base model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    _copy_checked(own, state, path)
    return cfg


# ----------------------------------------------------------------------------- peft's file format (LoRA baseline)

PEFT_PREFIX = "base_model.model."


def save_peft(model, path):
    """Write the attached LoRA baseline in peft's format: path/adapter_config.json with
    `peft_type: "LORA"`, r, lora_alpha, target_modules (the wrapped modules' full names, so peft
    wraps exactly these) and path/adapter_model.safetensors with peft's key names
    `base_model.model.<module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r] (ours:
    `<module>.lora_A` / `.lora_B`, same tensors). `PeftModel.from_pretrained(base, path)` loads it
    (peft is not needed here). Raises ValueError for MoD / MoE-LoRA adapters (peft has no format
    for them). Atomic per file, weights first."""
    cfg = model._adapter["config"]
    if cfg.method != "lora":
        raise ValueError(f"peft's format holds plain LoRA only; these adapters are {cfg.method!r} "
                         f"(save them with save_adapters)")
    state = {f"{PEFT_PREFIX}{k}.weight": v.detach().cpu().contiguous() for k, v in adapter_state_dict(model).items()}
    mods = sorted({k[:-len(".lora_A")] for k in adapter_state_dict(model) if k.endswith(".lora_A")})
    os.makedirs(path, exist_ok=True)
    _save_tensors(state, os.path.join(path, WEIGHTS_NAME))
    meta = {"peft_type": "LORA", "task_type": None, "r": cfg.r, "lora_alpha": cfg.lora_alpha, "lora_dropout": 0.0,
            "target_modules": mods, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
            "base_model_name_or_path": base_identity(model).get("name_or_path")}
    _write_text(os.path.join(path, CONFIG_NAME), json.dumps(meta, indent=2))


def is_peft(path):
    """True if path/adapter_config.json is peft's (has `peft_type`)."""
    try:
        with open(os.path.join(path, CONFIG_NAME)) as f:
            return "peft_type" in json.load(f)
    except (OSError, ValueError):
        return False


def load_peft(model, path):
    """Attach a peft LoRA adapter (adapter_config.json + adapter_model.safetensors written by
    peft's save_pretrained, or save_peft) to a fresh base as our LoRA baseline and load it.
    Raises ValueError naming the problem: not LORA, options we do not implement (rslora, DoRA,
    bias, fan_in_fan_out, per-module ranks / alphas, modules_to_save, target_parameters: peft
    >= 0.17's LoRA on parameters such as fused MoE expert tensors), target modules outside
    the language model's nn.Linear layers, or tensors that do not fit. Returns the AdapterConfig."""
    with open(os.path.join(path, CONFIG_NAME)) as f:
        pc = json.load(f)
    if pc.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {pc.get('peft_type')!r}; only LORA maps to the LoRA baseline")
    unsupported = {k: pc.get(k) for k, ok in (("use_rslora", False), ("use_dora", False), ("bias", "none"),
                                               ("fan_in_fan_out", False), ("modules_to_save", None),
                                               ("rank_pattern", {}), ("alpha_pattern", {}),
                                               ("target_parameters", []))
                   if pc.get(k) not in (ok, None) and not (ok in ({}, []) and not pc.get(k))}
    if unsupported:
        raise ValueError(f"{path}: peft options the LoRA baseline does not implement: {unsupported}")
    state = load_file(os.path.join(path, WEIGHTS_NAME))
    ours = {}
    for k, v in state.items():
        if not (k.startswith(PEFT_PREFIX) and k.endswith((".lora_A.weight", ".lora_B.weight"))):
            raise ValueError(f"{path}: unexpected tensor {k} (want {PEFT_PREFIX}<module>.lora_A/B.weight)")
        ours[k[len(PEFT_PREFIX):-len(".weight")]] = v
    full = dict(model.named_modules())
    mods = sorted({k[:-len(".lora_A")] for k in ours if k.endswith(".lora_A")})
    lm = text_model(model)
    prefix = next(n for n, m in model.named_modules() if m is lm)
    cut = len(prefix) + 1 if prefix else 0
    outside = [m for m in mods if m not in full or (prefix and not m.startswith(prefix + "."))]
    if not mods or outside:
        raise ValueError(f"{path}: LoRA modules outside the language model (or missing in this base): "
                         f"{outside[:3] or 'none given'}")
    not_linear = [m for m in mods if not isinstance(full[m], nn.Linear)]
    if not_linear:  # e.g. LoRA on fused expert parameters (peft's target_parameters) without the config key
        raise ValueError(f"{path}: LoRA tensors on modules that are not nn.Linear layers: {not_linear[:3]}; the LoRA "
                         f"baseline wraps nn.Linear layers only (peft's target_parameters is not supported)")
    cfg = AdapterConfig(method="lora", r=int(pc["r"]), lora_alpha=float(pc["lora_alpha"]),
                        target_modules=[m[cut:] for m in mods])
    attach(model, cfg)
    own = dict(model.named_parameters())
    missing = [k for k, p in own.items() if p.requires_grad and k not in ours]
    if missing:
        raise ValueError(f"{path}: no tensors for {missing[:3]}")
    _copy_checked(own, ours, path)
    return cfg
