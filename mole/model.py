"""MoLE ("MoLE: Mixture of Latent Experts for Complementary Visual Reasoning", section 3), on a `transformers` VLM.

The decoder input becomes (paper: [V; Q; Z_vis; Z_sum; Y]; Qwen chat shown)

    <|im_start|>user\\n<|vision_start|> V <|vision_end|> Q | Z_vis (E) | Z_sum (S) | <|im_end|>\\n<|im_start|>assistant\\n Y

The model family enters only through `mole.adapters`, the one module below this file (this
file imports the standard library, torch, `common.routing` and `mole.adapters`; it copies into
another project with those two). From the model itself: the decoder stack, the position ids
(M-RoPE `get_rope_index` on Qwen-VL, else 1-D), the token types the forward takes and, per
layer, the base's own attention mask. From the processor: a `VLMAdapter` builds the prompt ids
and vision tensors and names the tail (assistant header) the latents are inserted before
(`QwenVLAdapter` for the repo's `VLProcessor`, `ChatVLMAdapter` for a transformers processor
with a chat template; `adapter_for` picks one).

Z_vis are E latent *visual experts*, Z_sum S latent *summary experts*: new special tokens
whose embeddings are trainable parameters here (ids past the embedding table, so the LM
head can never emit them). At every decoder layer l:

  * a router W_R[l] (E x d) reads the hidden state of each visual token entering the layer,
    keeps its top-K experts; expert e may attend to token v only if e is among v's top-K;
  * router prior steering: rho = router probs renormalised over the K kept experts,
    b = alpha * log(K * rho + eps) is added to the attention logit of the pair (e, v);
  * ESVA: the value that expert e reads from v is u~ = u + gamma_e * MLP_e(u), with
    u = W_V h_v flattened over heads, MLP_e a two-layer GELU MLP, gamma_e initialised to 0;
  * topology: Z_vis see the prompt text, themselves and their routed visual tokens, never
    another Z_vis; Z_sum see prompt, all Z_vis and earlier Z_sum; answers see everything
    the stage allows. Stage 1 blocks prompt-text, Z_sum and answer rows from V; stage 2
    lifts that block.

How it plugs into transformers (the traps it avoids are named below):
  * `mole_attention` is registered under the name "mole" together with a mask builder
    (`mole.adapters.register_attention`; without one transformers builds no mask and padding
    silently vanishes). The model gets the 2-D attention mask and its token types, so it builds
    its own boolean mask per layer kind: causal + padding, and per family a sliding window,
    Gemma3's bidirectional image blocks (from `token_type_ids`).
    `mole_attention` puts the topology on top (`topology_mask(..., base=)`): rows that are not
    latents keep the base's attention minus the stage-1 bottleneck; latent rows follow the
    topology over the whole sequence. All rows go through the standard SDPA kernel; only the
    E Z_vis rows are then recomputed (routed mask + prior + ESVA values) and written over.
  * The per-forward context (`MoLEPass`: token types, stage, Z_vis positions, routing, aux
    losses) travels through the model's **kwargs as `mole=...`: transformers hands unknown
    kwargs to every decoder layer and attention call.
  * Routing runs in a forward pre-hook on each decoder layer (it needs the hidden state
    *entering* the layer, which the attention function never sees).
  * Position ids are passed explicitly (the model gets embeddings, and Qwen-VL would index a
    custom mask as 2-D inside `get_rope_index`): the model's own (`mole.adapters.model_positions`).
  * The latents bypass the embedding module, so they start at the scale of its output
    (`init_latents`: Gemma's module multiplies rows by sqrt(d)).

    mole = MoLE(model, proc, MoLEConfig())                  # proc: VLProcessor, HF processor or VLMAdapter
    batch = mole.encode(images, questions, answers)        # right padding, labels on answers
    out = mole(batch, stage=1)                              # dict: logits, loss, ce, balance, z, div
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.routing import load_balance_loss, topk_gates, z_loss
from mole.adapters import (adapter_for, check_served, model_positions, register_attention, sdpa_attention_forward,
                           text_model, token_type_inputs)

# token types
PAD, TEXT, VIS, ZVIS, ZSUM = 0, 1, 2, 3, 4


@dataclass
class MoLEConfig:
    """Everything that defines a MoLE variant (saved with every checkpoint).

    n_vis (E), n_sum (S), top_k (K): paper section 3; the paper's balanced allocation at a
    budget of 8 latents is E=S=4 (its Table 2(a)). K = 2 is our default: the paper text
    we have does not state its K.
    alpha, eps: router prior b = alpha * log(K * rho + eps).
    router: False = every visual token visible to every visual expert, no prior ("w/o router").
      There is then no top-K selection, so the diversity loss (defined over the pairs of
      experts a visual token selected) is not computed: "w/o router" also drops L_div.
    esva: False = shared value projection only ("w/o ESVA").
    esva_hidden: MLP_e hidden width (0 = the flattened value width Hkv * head_dim).
    latent_mixing: "topological" (no Z_vis <-> Z_vis attention) or "causal" (ablation).
    lambda_*: loss weights of balance, z-loss and diversity.
    The LIVR-like plain-latent baseline is router=False, esva=False, latent_mixing="causal",
    n_sum=0: plain causal latent tokens under the same two-stage bottleneck."""
    n_vis: int = 4
    n_sum: int = 4
    top_k: int = 2
    alpha: float = 1.0
    eps: float = 1e-4
    router: bool = True
    esva: bool = True
    esva_hidden: int = 0
    latent_mixing: str = "topological"
    lambda_balance: float = 0.01
    lambda_z: float = 0.001
    lambda_div: float = 0.01

    def __post_init__(self):
        if self.n_vis < 1 or self.n_sum < 0:
            raise ValueError(f"need n_vis >= 1 and n_sum >= 0, got {self.n_vis}, {self.n_sum}")
        if not 1 <= self.top_k <= self.n_vis:
            raise ValueError(f"need 1 <= top_k <= n_vis, got top_k={self.top_k}, n_vis={self.n_vis}")
        if self.latent_mixing not in ("topological", "causal"):
            raise ValueError(f"latent_mixing must be 'topological' or 'causal', got {self.latent_mixing!r}")

    @property
    def special(self):
        """True if Z_vis rows need the MoLE path (routing or ESVA); else plain SDPA is exact."""
        return self.router or self.esva


PLAIN_LATENT = dict(router=False, esva=False, latent_mixing="causal")  # + n_vis = budget, n_sum = 0


# ----------------------------------------------------------------------------- latent embeddings

@torch.no_grad()
def embedding_output_scale(table, chunk=8192):
    """Mean row norm of the embedding module's OUTPUT over every id of its table divided by
    the mean row norm of its weight: the factor by which the module scales rows (Gemma's
    sqrt(d); exactly 1.0 for a plain nn.Embedding, whose output rows are its weight rows)."""
    w = table.weight
    out_sum = w_sum = 0.0
    for s in range(0, w.shape[0], chunk):
        ids = torch.arange(s, min(s + chunk, w.shape[0]), device=w.device)
        out_sum += float(table(ids).float().norm(dim=-1).double().sum())
        w_sum += float(w[ids].float().norm(dim=-1).double().sum())
    return out_sum / w_sum if w_sum > 0 else 1.0


def init_latents(table, n, generator=None):
    """Initial latent rows [n, d] fp32 at the scale of the embedding module's output:
    mean row + std * N(0, 1) of the weight, times `embedding_output_scale` (no-op, bit for
    bit, for an unscaled embedding; Gemma's module multiplies its rows by sqrt(d), and the
    latents bypass it, so they get the factor here)."""
    emb = table.weight.detach().float()
    lat = emb.mean(0) + emb.std() * torch.randn(n, emb.shape[1], generator=generator).to(emb.device)
    scale = embedding_output_scale(table)
    return lat if scale == 1.0 else lat * scale


# ----------------------------------------------------------------------------- masks

def topology_mask(types, stage, cfg, base=None):
    """Boolean attention mask of the MoLE sequence (True = may attend).

    types: [B, L] long (PAD/TEXT/VIS/ZVIS/ZSUM); stage: 1 (visual bottleneck) or 2;
    base: the base model's own mask of one layer, [B or 1, 1, L, L] bool (causal + padding, and
    per family a sliding window or Gemma3's bidirectional image blocks), or None
    for causal over non-pad columns. Rows that are not latents keep the base's mask, minus the
    stage-1 bottleneck (text rows never see V); the latent rows (Z_vis, Z_sum) follow MoLE's
    topology over the whole sequence in every layer (causal, no window). Returns [B, 1, L, L]
    bool. Z_vis -> V edges are left False when the router is on: the attention function adds the
    routed ones per layer. Every row may attend to itself, so pad rows never produce NaN.
    Raises ValueError for another stage."""
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage}")
    B, L = types.shape
    row, col = types[:, :, None], types[:, None, :]  # [B,L,1], [B,1,L]
    eye = torch.eye(L, dtype=torch.bool, device=types.device)[None]
    allowed = torch.ones(L, L, dtype=torch.bool, device=types.device).tril()[None] & (col != PAD)
    if base is not None:  # the base's own attention outside the latent rows
        allowed = torch.where((row == ZVIS) | (row == ZSUM), allowed, base[:, 0].to(torch.bool))
    if cfg.router:
        allowed &= ~((row == ZVIS) & (col == VIS))  # only routed edges, added per layer
    if cfg.latent_mixing == "topological":
        allowed &= ~((row == ZVIS) & (col == ZVIS))  # no visual expert reads another (eye re-added below)
    if stage == 1:
        allowed &= ~(((row == TEXT) | (row == ZSUM)) & (col == VIS))  # the visual attention bottleneck
    return (allowed | eye)[:, None]


def column_mask(types, stage):
    """Which cached columns a later text row (answer token) may attend to: [B, Lk] bool.
    Used for cached decoding, where the new row is an answer token."""
    keep = types != PAD
    if stage == 1:
        keep &= types != VIS
    return keep


# ----------------------------------------------------------------------------- per-forward context

class MoLEPass:
    """What one forward pass of MoLE hands to the routing hooks and the attention function.

    types [B,L], zpos [B,E] (position of each Z_vis token), stage (1 or 2: the mask the
    attention function builds, `mask`), is_vis [B,L];
    route[layer] = (sel [B,L,E] bool, prior [B,L,E] fp32); per-layer aux losses;
    record: keep each layer's Z_vis attention probs [B,H,E,L] in `attn` (diagnostics);
    reduce: `mole.reduce` in training (the global-batch counts of a data-parallel run), else None."""

    def __init__(self, mole, types, zpos, stage=2, record=False):
        self.mole, self.types, self.zpos, self.stage, self.record = mole, types, zpos, stage, record
        self.reduce = mole.reduce if mole.training else None
        self.is_vis = types == VIS
        # visual positions packed per row: vis_idx [B,Nv] (padded), vis_ok [B,Nv]; ESVA runs on these only
        n = self.is_vis.sum(1)
        nv = int(n.max()) if n.numel() else 0  # one host sync per forward, not per layer
        self.vis_idx = torch.argsort((~self.is_vis).to(torch.int8), dim=1, stable=True)[:, :nv]
        self.vis_ok = torch.arange(nv, device=types.device)[None] < n[:, None]
        self.route, self.attn = {}, {}
        self.balance, self.z, self.div = [], [], []
        self._masks = []  # (base mask, MoLE mask): one per layer kind (full / sliding / chunked)

    def mask(self, base):
        """`topology_mask` over the base's own mask of a layer ([B,1,L,L] bool, or None: causal),
        computed once per distinct base mask (transformers hands the same tensor to every layer
        of a kind)."""
        for b, m in self._masks:
            if b is base:
                return m
        m = topology_mask(self.types, self.stage, self.mole.cfg, base)
        self._masks.append((base, m))
        return m


def mole_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention function registered as "mole".

    query [B,H,Q,D], key/value [B,Hkv,K,D] (GQA not repeated), attention_mask [B,1,Q,K] bool:
    the base's own mask of this layer (`mole.adapters.base_mask`: causal, padding and the
    family's sliding window / image blocks). Returns (out [B,Q,H,D], None).
    With a `mole` kwarg (a MoLEPass: a full MoLE forward) the mask becomes `topology_mask` over
    the base's, every row goes through SDPA and the Z_vis rows are then replaced by
    `MoLE.latent_attention` (routed mask, prior, ESVA). With `mole_columns` ([B,Lk] bool: which
    of the sequence's columns text rows may read; cached decoding) the base's mask is restricted
    to them (its last K columns: a sliding-window cache holds only the newest keys). With
    neither, exactly SDPA."""
    st = kwargs.pop("mole", None)
    cols = kwargs.pop("mole_columns", None)
    if attention_mask is None and (st is not None or cols is not None):  # no mask built: plain causal
        Q, K = query.shape[2], key.shape[2]
        attention_mask = torch.ones(Q, K, dtype=torch.bool, device=query.device).tril(K - Q)[None, None]
    if st is not None:
        attention_mask = st.mask(attention_mask)
    elif cols is not None:
        attention_mask = attention_mask & cols[:, None, None, -key.shape[2]:]
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                    scaling=scaling, **kwargs)
    if st is None or not (st.mole.cfg.special or st.record):
        return out, None
    if query.shape[2] != key.shape[2]:
        raise RuntimeError("MoLE Z_vis rows must be computed in a full (uncached) prefill")
    zout = st.mole.latent_attention(module.layer_idx, query, key, value, attention_mask, scaling, st)  # [B,H,E,D]
    B, H, E, D = zout.shape
    idx = st.zpos[:, :, None, None].expand(B, E, H, D)
    out = out.scatter(1, idx, zout.transpose(1, 2).to(out.dtype))
    return out, None


register_attention("mole", mole_attention)  # with a mask builder that hands over the base's own mask


# ----------------------------------------------------------------------------- modules

def esva_delta(u, w1, b1, w2, b2):
    """MLP_e(u) for every expert e: u [B,L,d_v], w1 [E,d_v,h], b1 [E,h], w2 [E,h,d_v], b2 [E,d_v]
    -> [B,L,E,d_v] in u's dtype (a pure function, so it compiles once for all layers)."""
    h = F.gelu(torch.einsum("bld,edh->bleh", u, w1.to(u.dtype)) + b1.to(u.dtype))
    return torch.einsum("bleh,ehd->bled", h, w2.to(u.dtype)) + b2.to(u.dtype)


class ESVA(nn.Module):
    """Expert-specific value adapters of one layer: E two-layer GELU MLPs on the flattened
    value u [.., d_v] (d_v = Hkv * head_dim), batched over experts, and residual scales gamma.

    delta(u) -> [.., E, d_v] = MLP_e(u); the routed value is u + gamma_e * MLP_e(u)."""

    def __init__(self, E, d_v, hidden):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, d_v, hidden) / math.sqrt(d_v))
        self.b1 = nn.Parameter(torch.zeros(E, hidden))
        self.w2 = nn.Parameter(torch.randn(E, hidden, d_v) / math.sqrt(hidden))
        self.b2 = nn.Parameter(torch.zeros(E, d_v))
        self.gamma = nn.Parameter(torch.zeros(E))  # start from the shared value projection

    fn = staticmethod(esva_delta)   # or its compiled version (MoLE.compile_hot)

    def delta(self, u):
        return self.fn(u, self.w1, self.b1, self.w2, self.b2)


def latent_scores(qz, key, value, allowed, prior, scaling):
    """The Z_vis attention of one layer before ESVA (a pure function: compiled once for all
    layers by MoLE.compile_hot). qz [B,Hkv,G,E,D] Z_vis queries, key/value [B,Hkv,L,D],
    allowed [B,E,L] bool, prior [B,L,E] fp32 or None (no router), scaling float.
    logit(e, j) = q_e . k_j * scaling + prior[j, e]; p = softmax over allowed j.
    Returns (p [B,Hkv,G,E,L] fp32, shared-value output [B,Hkv,G,E,D] fp32)."""
    logits = torch.einsum("bkged,bkld->bkgel", qz.float(), key.float()) * scaling  # [B,Hkv,G,E,L]
    if prior is not None:
        logits = logits + prior.transpose(1, 2)[:, None, None]
    p = logits.masked_fill(~allowed[:, None, None], float("-inf")).softmax(-1)
    return p, torch.einsum("bkgel,bkld->bkged", p, value.float())


def diversity_loss(delta, sel, is_vis, reduce=None):
    """Mean pairwise squared cosine between the ESVA deltas of the experts that the same
    visual token selected (paper: L_div; 0 when K = 1 since no pair exists).

    delta: [B,L,E,d] (MLP_e(u); squared cosine is scale-free, so gamma drops out and the
    loss stays defined at gamma = 0); sel: [B,L,E] bool top-K selection; is_vis: [B,L] bool;
    reduce: None, or a data-parallel run's `common.routing.rank_mean`: the mean is then over
    the global batch's pairs (this rank's sum / (global pairs / world)).
    Returns a scalar fp32 (0 if no pair)."""
    d = F.normalize(delta.float(), dim=-1)
    cos2 = torch.einsum("blie,blje->blij", d, d).square()  # [B,L,E,E]
    E = sel.shape[-1]
    upper = torch.ones(E, E, dtype=torch.bool, device=sel.device).triu(1)
    pair = sel[..., :, None] & sel[..., None, :] & upper & is_vis[..., None, None]
    n = pair.sum().float() if reduce is None else reduce(pair.sum())
    return (cos2 * pair).sum() / torch.where(n > 0, n, torch.ones_like(n))


class MoLE(nn.Module):
    """A VLM with MoLE latent experts. Owns the new parameters (latent embeddings, routers,
    ESVAs); the wrapped `model` is used as is (its own parameters are frozen or LoRA'd by
    the trainer). Registers "mole" attention on the text model and one routing pre-hook per
    decoder layer; `remove()` undoes both.

    model: a transformers VLM; proc: a `VLMAdapter` (the prompt format), or a processor from
    which `adapter_for` picks one (the repo's `VLProcessor` -> `QwenVLAdapter`, a transformers
    processor with a chat template -> `ChatVLMAdapter`). Positions, token types and attention
    come from the model (`mole.adapters`), whichever adapter builds the prompts.
    `self.adapter` is the adapter, `self.proc` its processor. The latent rows start at the
    scale of the embedding module's output (`init_latents`).
    Raises ValueError for a family MoLE cannot serve (`check_served`) or whose decoder stack
    `text_model` does not find, naming it."""

    def __init__(self, model, proc, cfg=None):
        super().__init__()
        self.cfg = cfg = cfg or MoLEConfig()
        # data-parallel training sets this to common.routing.rank_mean: the aux losses then average
        # over the global batch (what one process computes on it), not over this rank's share
        self.reduce = None
        check_served(model)
        layers = text_model(model).layers
        self.adapter = adapter = adapter_for(model, proc)
        self.model, self.proc = model, adapter.proc
        tcfg = model.config.get_text_config()
        d, E, n_lat = tcfg.hidden_size, cfg.n_vis, cfg.n_vis + cfg.n_sum
        head_dim = getattr(tcfg, "head_dim", None) or d // tcfg.num_attention_heads
        d_v = tcfg.num_key_value_heads * head_dim
        table = model.get_input_embeddings()
        self.vocab = table.weight.shape[0]  # latent ids start here: past the table, never generated
        g = torch.Generator().manual_seed(0)
        self.latent = nn.Parameter(init_latents(table, n_lat, generator=g))
        self.routers = nn.ModuleList(nn.Linear(d, E, bias=False) for _ in layers) if cfg.router else None
        if self.routers is not None:
            for r in self.routers:
                nn.init.normal_(r.weight, std=d ** -0.5)
        self.esva = nn.ModuleList(ESVA(E, d_v, cfg.esva_hidden or d_v) for _ in layers) if cfg.esva else None
        self.to(device=model.device)
        vision_impl = getattr(model.config.vision_config, "_attn_implementation", None) or "sdpa"
        self._attn_before = {"text_config": tcfg._attn_implementation, "vision_config": vision_impl}
        model.set_attn_implementation({"text_config": "mole", "vision_config": vision_impl})
        self._hooks = [layer.register_forward_pre_hook(self._route_hook(i), with_kwargs=True)
                       for i, layer in enumerate(layers)] if cfg.router else []
        self.tail_ids = adapter.tail_ids()
        self.latent_ids = list(range(self.vocab, self.vocab + n_lat))

    # ------------------------------------------------------------------ inputs

    def encode(self, images, questions, answers=None, padding_side=None, pixels=None, n_images=None):
        """The adapter's prompts (`VLMAdapter.prompts`) with the latent tokens inserted before
        the assistant header: head (image(s) + question) | Z_vis | Z_sum | tail | answer.

        images: one entry per question, a PIL image or a list of PIL images (several images
        per question: for the Qwen adapter `<|vision_start|> image <|vision_end|>` per image, in
        order, at the question's "<image>" placeholders or, without any, before the question;
        Z_vis are routed over the visual tokens of all of them). With
        pixels=(pixel_values, image_grid_thw) instead (Qwen adapter), the grid rows are the
        images in order and n_images (list, one count per question; default 1 each) says how
        many belong to each question.
        Returns input_ids [B,L] (latent ids >= self.vocab), attention_mask, the adapter's vision
        tensors (Qwen: pixel_values, image_grid_thw) and batch extras (Qwen: mm_token_type_ids),
        labels (answers given; -100 outside answer + its terminator).
        Right padding with answers, left padding without (generation).
        Raises ValueError if the image counts do not add up to the images."""
        ad = self.adapter
        prompts, vision = ad.prompts(images, questions, pixels=pixels, n_images=n_images)
        T = len(self.tail_ids)
        rows, labels = [], []
        for i, p in enumerate(prompts):
            assert p[-T:] == self.tail_ids, "prompt does not end with the assistant header"
            r = p[:-T] + self.latent_ids + self.tail_ids
            if answers is not None:
                a = ad.answer_ids(answers[i])
                labels.append([-100] * len(r) + a)
                r = r + a
            rows.append(r)
        side = padding_side or ("right" if answers is not None else "left")
        L = max(map(len, rows))
        pad = lambda r, v: (r + [v] * (L - len(r))) if side == "right" else ([v] * (L - len(r)) + r)
        input_ids = torch.tensor([pad(r, ad.pad_token_id) for r in rows])
        mask = torch.tensor([pad([1] * len(r), 0) for r in rows])
        batch = {"input_ids": input_ids, "attention_mask": mask, **token_type_inputs(self.model, input_ids), **vision}
        if answers is not None:
            batch["labels"] = torch.tensor([pad(r, -100) for r in labels])
        return batch

    def token_types(self, input_ids, attention_mask):
        """[B,L] PAD/TEXT/VIS/ZVIS/ZSUM from ids (latent id vocab+j: Z_vis for j < E)."""
        t = torch.full_like(input_ids, TEXT)
        t[input_ids == self.adapter.image_token_id] = VIS
        j = input_ids - self.vocab
        t[(j >= 0) & (j < self.cfg.n_vis)] = ZVIS
        t[j >= self.cfg.n_vis] = ZSUM
        t[attention_mask == 0] = PAD
        return t

    def zvis_positions(self, input_ids):
        """[B,E] position of Z_vis token e in each row (every row holds all of them)."""
        B, L = input_ids.shape
        j = input_ids - self.vocab
        is_z = (j >= 0) & (j < self.cfg.n_vis)
        slot = torch.where(is_z, j, torch.full_like(j, self.cfg.n_vis))  # non-latents -> dump slot E
        pos = torch.arange(L, device=input_ids.device).expand(B, L)
        return torch.zeros(B, self.cfg.n_vis + 1, dtype=torch.long, device=input_ids.device).scatter_(
            1, slot, pos)[:, :self.cfg.n_vis]

    def embed(self, input_ids):
        """Token embeddings with the trainable latent rows: [B,L,d]."""
        table = self.model.get_input_embeddings()
        lat = input_ids >= self.vocab
        x = table(torch.where(lat, torch.full_like(input_ids, self.adapter.pad_token_id), input_ids))
        j = (input_ids - self.vocab).clamp(min=0, max=self.latent.shape[0] - 1)
        return torch.where(lat[..., None], self.latent.to(x.dtype)[j], x)

    def positions(self, batch):
        """Explicit position ids (MoLE passes embeddings), the model's own (`model_positions`):
        M-RoPE [3,B,L] from `get_rope_index` on Qwen-VL (latents counted as text tokens), else
        1-D [B,L] from the attention mask."""
        return model_positions(self.model, batch["input_ids"], batch["attention_mask"], batch)

    # ------------------------------------------------------------------ routing

    def _route_hook(self, layer_idx):
        def hook(module, args, kwargs):
            st = kwargs.get("mole")
            if st is not None:
                h = args[0] if args else kwargs["hidden_states"]
                self.route(layer_idx, h, st)
        return hook

    def route(self, layer_idx, h, st):
        """Per-layer routing of visual tokens (paper: r = softmax(W_R h), top-K, prior b).

        h: [B,L,d] hidden states entering the layer. Stores in st.route[layer_idx]
        (sel [B,L,E] bool, prior [B,L,E] fp32; both zero off visual tokens) and appends the
        layer's load-balance (Mixtral convention E * sum_e sg(f_e) P_e, = K at uniform
        routing; f has no gradient since it counts top-K choices) and z-loss over visual tokens."""
        cfg = self.cfg
        logits = self.routers[layer_idx](h.to(self.routers[layer_idx].weight.dtype)).float()  # [B,L,E]
        probs, idx, rho = topk_gates(logits, cfg.top_k)  # rho: probs renormalised over the top-K
        vis = st.is_vis
        sel = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, idx, True) & vis[..., None]
        b = cfg.alpha * torch.log(cfg.top_k * rho + cfg.eps)  # eq. prior: ~0 when rho = 1/K
        prior = torch.zeros_like(probs).scatter_(-1, idx, b) * vis[..., None]
        st.route[layer_idx] = (sel, prior)
        st.balance.append(load_balance_loss(probs, idx, vis, st.reduce))
        st.z.append(z_loss(logits, vis, st.reduce))

    # ------------------------------------------------------------------ Z_vis attention

    def latent_attention(self, layer_idx, query, key, value, mask, scaling, st):
        """Attention output of the E Z_vis rows at one layer.

        query [B,H,L,D], key/value [B,Hkv,L,D], mask [B,1,L,L] bool (topology), st: MoLEPass.
        logit(e, j) = q_e . k_j * scaling (+ b[v=j, e] on routed visual columns);
        allowed(e, j) = mask row of Z_vis e | (j visual and e in top-K(j));
        value(e, j) = u_j (+ gamma_e * MLP_e(u_j) if j is visual: ESVA).
        Returns [B,H,E,D]; appends the layer's diversity loss; records probs if st.record."""
        cfg = self.cfg
        B, H, L, D = query.shape
        Hkv, E = key.shape[1], cfg.n_vis
        G = H // Hkv
        zpos = st.zpos
        qz = query.gather(2, zpos[:, None, :, None].expand(B, H, E, D)).view(B, Hkv, G, E, D)
        allowed = mask[:, 0].gather(1, zpos[:, :, None].expand(B, E, L))  # [B,E,L]
        prior = None
        if cfg.router:
            sel, prior = st.route[layer_idx]
            allowed = allowed | sel.transpose(1, 2)
        p, out = self._scores(qz, key, value, allowed, prior, scaling)
        if cfg.esva:
            vi, ok = st.vis_idx, st.vis_ok  # [B,Nv]
            Nv = vi.shape[1]
            u = value.transpose(1, 2).reshape(B, L, Hkv * D)  # flattened value projection
            u = u.gather(1, vi[..., None].expand(B, Nv, Hkv * D))  # [B,Nv,d_v] visual tokens only
            esva = self.esva[layer_idx]
            delta = esva.delta(u)  # [B,Nv,E,d_v] = MLP_e(u)
            routed = delta * (esva.gamma.to(delta.dtype)[:, None] * ok[..., None, None])
            p_v = p.gather(-1, vi[:, None, None, None].expand(B, Hkv, G, E, Nv))  # [B,Hkv,G,E,Nv]
            # sum_v p(e,v) (u_v + gamma_e MLP_e(u_v)) = (shared part above) + this routed part
            out = out + torch.einsum("bkgev,bvekd->bkged", p_v, routed.view(B, Nv, E, Hkv, D).float())
            if cfg.router and cfg.top_k > 1:
                sel_v = sel.gather(1, vi[..., None].expand(B, Nv, E))
                st.div.append(diversity_loss(delta, sel_v, ok, st.reduce))
        if st.record:
            st.attn[layer_idx] = p.reshape(B, H, E, L).detach()
        return out.reshape(B, H, E, D)

    # ------------------------------------------------------------------ forward

    def forward(self, batch, stage, cache=None, record=False, hidden=False):
        """One full (prefill / training) pass.

        batch: from `encode` (labels optional); stage: 1 or 2; cache: a transformers Cache
        to fill (generation prefill) or None; record: keep Z_vis attention probs;
        hidden: also return the last hidden states.
        Returns dict(logits [B,L,V] fp32-able, types, positions, pass, and with labels:
        loss = ce + lambda_balance*balance + lambda_z*z + lambda_div*div, plus each term)."""
        ids, am = batch["input_ids"], batch["attention_mask"]
        types = self.token_types(ids, am)
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage}")
        st = MoLEPass(self, types, self.zvis_positions(ids), stage, record=record)
        pos = self.positions(batch)
        # the 2-D mask and the token types let the model build its own per-layer masks (causal, padding,
        # sliding window, image blocks); mole_attention applies the topology on top of them
        inputs = {**self.adapter.model_inputs(batch), **token_type_inputs(self.model, ids)}
        out = self.model(inputs_embeds=self.embed(ids), attention_mask=am, position_ids=pos, **inputs, cache=cache,
                         use_cache=cache is not None, output_hidden_states=hidden, mole=st)
        res = {"logits": out.logits, "types": types, "positions": pos, "pass": st}
        if hidden:
            res["hidden"] = out.hidden_states[-1]
        zero = out.logits.new_zeros((), dtype=torch.float32)
        mean = lambda xs: torch.stack(xs).mean() if xs else zero
        res.update(balance=mean(st.balance), z=mean(st.z), div=mean(st.div))
        if "labels" in batch:
            lab = batch["labels"][:, 1:]
            ce = F.cross_entropy(out.logits[:, :-1].float().reshape(-1, out.logits.shape[-1]), lab.reshape(-1),
                                 ignore_index=-100)
            c = self.cfg
            res["ce"] = ce
            res["loss"] = ce + c.lambda_balance * res["balance"] + c.lambda_z * res["z"] + c.lambda_div * res["div"]
        return res

    _scores = staticmethod(latent_scores)   # or its compiled version (compile_hot)

    def compile_hot(self, backend="inductor", **kw):
        """torch.compile MoLE's hot functions only, once for all layers: the Z_vis latent
        attention scores (`latent_scores`) and the ESVA expert MLPs (`esva_delta`); the
        wrapped transformers model stays eager (its Qwen-VL code graph-breaks). In place;
        parameters and state_dict unchanged. kw go to torch.compile."""
        self._scores = torch.compile(latent_scores, backend=backend, **kw)
        fn = torch.compile(esva_delta, backend=backend, **kw)
        for e in self.esva or []:
            e.fn = fn
        return self

    def remove(self):
        """Give the wrapped model back as it was: the routing pre-hooks removed and the text model's
        attention implementation set back to the one it had. Returns the model; this MoLE no
        longer routes afterwards (build a new one to use MoLE again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.model.set_attn_implementation(self._attn_before)
        return self.model
