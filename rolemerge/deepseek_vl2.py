"""DeepSeek-VL2 (Tiny / Small / base) on transformers 5 parts, for RoleMerge.

"DeepSeek-VL2: Mixture-of-Experts Vision-Language Models for Advanced Multimodal
Understanding" (arXiv 2412.10302) are the main models of the RoleMerge paper (arXiv 2608.04454,
§5). transformers has no DeepSeek-VL2 class and the official code targets transformers 4.38, so
this file rebuilds the model from the public description of its checkpoint (config.json with
`model_type: deepseek_vl_v2`, safetensors key names) and forward:

    tiles   = global view (image padded to S x S) + local views (image padded to the best
              candidate resolution, cut into S x S tiles, row-major)             S = 384
    vision  = SigLIP ViT (timm naming: vision.patch_embed / pos_embed / blocks.N / norm),
              no class token, output of the last block + LayerNorm            [T, (S/p)^2, C]
    project = 2 x 2 unfold (odd grid zero-padded) -> Linear, GELU, Linear      [T, h*w, D]
    layout  = global h x (w + newline), view_seperator, local (th*h) x (tw*w + newline)
    LM      = DeepSeek-V2/MoE (language.model.layers.N..., language.lm_head): MHA when
              `use_mla` is false (Tiny), MLA otherwise (Small, base); routed experts +
              shared experts; dense layers before `first_k_dense_replace` and where
              `layer % moe_layer_freq != 0`

Every `<image>` position of the prompt (`images_seq_mask`) receives one of those embeddings in
order, exactly as many as `image_token_count` gives. The language model reuses transformers'
`DeepseekOcr2TextModel` (MHA, rotate-half RoPE: the official MHA path is Llama attention) or
`DeepseekV2Model` (MLA); the router is replaced by `Router`, which implements the official
gate (softmax / sigmoid scores, greedy / group_limited_greedy / noaux_tc top-k, norm_topk_prob,
routed_scaling_factor). Weights are read and written in the official on-disk layout
(per-expert `experts.E.{gate,up,down}_proj.weight`), so a merged checkpoint keeps the layout and
the official loader's config fields, with `n_routed_experts` = K.

Used by rolemerge.calibrate / merge / infer through `load`, `Processor` and the model's
`generate` (greedy, the semantics of transformers' `generate` that rolemerge.calibrate relies
on: one prefill call, one call per generated token but the last, rows padded after EOS).
"""
import json
import math
import os
import re
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from PIL import ImageOps
from safetensors.torch import load_file, save_file
from torch import nn

from common.checkpoint import safetensors_files

# deferred: transformers (about 2 s of CPU to import: only where a model, config or tokenizer is built, so
# that the streaming merge, which imports this module, never pays it)

MODEL_TYPE = "deepseek_vl_v2"

# Defaults of the official config classes for fields a config.json may omit
# (DeepseekV2Config, VisionEncoderConfig, MlpProjectorConfig of the DeepSeek-VL2 repository).
LM_DEFAULTS = dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, moe_intermediate_size=1407,
                   num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=None, n_shared_experts=None,
                   n_routed_experts=None, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=1536,
                   qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="gready", n_group=None,
                   topk_group=None, num_experts_per_tok=None, moe_layer_freq=1, first_k_dense_replace=0,
                   norm_topk_prob=False, scoring_func="softmax", hidden_act="silu", max_position_embeddings=2048,
                   rms_norm_eps=1e-6, bos_token_id=100000, eos_token_id=100001, pad_token_id=None,
                   tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None, attention_bias=False,
                   use_mla=True)
VISION_DEFAULTS = dict(model_name="siglip_large_patch16_384", image_size=384, patch_size=16, width=1024, layers=24,
                       heads=16, mlp_ratio=4, global_pool="map", ignore_head=True, class_token=False)
PROJECTOR_DEFAULTS = dict(projector_type="downsample_mlp_gelu", input_dim=1152, n_embed=2048, depth=2, mlp_ratio=1,
                          downsample_ratio=2, token_pooling=False)
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


class VL2Error(ValueError):
    """A DeepSeek-VL2 checkpoint this code cannot run; the message says why."""


# ----------------------------------------------------------------------------- config

class LanguageConfig:
    """Attribute view of config.json's `language_config` (official defaults filled in on read).
    Writes go to the dict itself, so `save_pretrained` writes what a merge changed."""

    def __init__(self, d):
        object.__setattr__(self, "_d", d)

    def __getattr__(self, k):
        d = object.__getattribute__(self, "_d")
        if k in d:
            return d[k]
        if k in LM_DEFAULTS:
            return LM_DEFAULTS[k]
        raise AttributeError(k)

    def __setattr__(self, k, v):
        self._d[k] = v

    def to_dict(self):
        return dict(LM_DEFAULTS, **self._d)


class Config:
    """config.json of a DeepSeek-VL2 checkpoint, kept as the raw dict (written back unchanged
    except for what a merge sets). `get_text_config()` is the language model's view."""

    model_type = MODEL_TYPE

    def __init__(self, raw):
        self.raw = raw
        self.vision = dict(VISION_DEFAULTS, **(raw.get("vision_config") or {}))
        self.projector = dict(PROJECTOR_DEFAULTS, **(raw.get("projector_config") or {}))
        raw.setdefault("language_config", {})
        self.lm = LanguageConfig(raw["language_config"])

    def get_text_config(self, *a, **k):
        return self.lm

    @classmethod
    def from_pretrained(cls, path):
        with open(os.path.join(path, "config.json")) as f:
            return cls(json.load(f))


def check_config(config):
    """Raise VL2Error unless `config` (a Config) describes a DeepSeek-VL2 model this code runs:
    a SigLIP vision tower (DeepSeek-OCR / OCR-2 hub checkpoints share the model_type but have
    SAM / CLIP / Qwen2 encoders), 2D tile tags, a supported projector and router."""
    v, p, lm = config.vision, config.projector, config.lm
    if not str(v.get("model_name", "")).startswith("siglip") or isinstance(v.get("width"), dict):
        raise VL2Error(f"vision_config.model_name {v.get('model_name')!r}: only DeepSeek-VL2's SigLIP tower is "
                       f"supported (DeepSeek-OCR hub checkpoints share model_type {MODEL_TYPE!r}; merge them with "
                       f"the default streaming merge, which needs no model code)")
    if config.raw.get("tile_tag", "2D") != "2D":
        raise VL2Error(f"tile_tag {config.raw.get('tile_tag')!r}: only '2D' (image_newline / view_seperator) exists "
                       f"in released DeepSeek-VL2 checkpoints")
    if p["projector_type"] not in ("identity", "linear", "mlp_gelu", "downsample_mlp_gelu") or p["token_pooling"]:
        raise VL2Error(f"projector_config: projector_type {p['projector_type']!r} / token_pooling "
                       f"{p['token_pooling']} is not supported")
    if lm.topk_method not in TOPK_METHODS or lm.scoring_func not in ("softmax", "sigmoid"):
        raise VL2Error(f"language_config: topk_method {lm.topk_method!r} / scoring_func {lm.scoring_func!r} not "
                       f"supported ({TOPK_METHODS}; softmax, sigmoid)")
    if not lm.n_routed_experts or not lm.num_experts_per_tok or not lm.n_shared_experts:
        raise VL2Error("language_config needs routed and shared experts (n_routed_experts, num_experts_per_tok, "
                       "n_shared_experts), as every released DeepSeek-VL2 has")


def is_moe_layer(lm, i):
    """Official rule: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    return bool(lm.n_routed_experts) and i >= lm.first_k_dense_replace and i % lm.moe_layer_freq == 0


def hf_text_config(lm):
    """transformers config of the language model: DeepseekOcr2TextConfig (MHA) when use_mla is
    false, else DeepseekV2Config (MLA)."""
    from transformers.models.deepseek_ocr2.configuration_deepseek_ocr2 import DeepseekOcr2TextConfig
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    rope = {"rope_type": "default", "rope_theta": float(lm.rope_theta)}
    if lm.rope_scaling:                        # official {"type": ..., "factor": ...}; not checked on real weights
        rs = dict(lm.rope_scaling)
        rope = dict(rs, rope_type=rs.pop("type", rs.get("rope_type")), rope_theta=float(lm.rope_theta))
    common = dict(vocab_size=lm.vocab_size, hidden_size=lm.hidden_size, intermediate_size=lm.intermediate_size,
                  moe_intermediate_size=lm.moe_intermediate_size, num_hidden_layers=lm.num_hidden_layers,
                  num_attention_heads=lm.num_attention_heads,
                  num_key_value_heads=lm.num_key_value_heads or lm.num_attention_heads,
                  n_shared_experts=lm.n_shared_experts or 0, n_routed_experts=lm.n_routed_experts,
                  num_experts_per_tok=lm.num_experts_per_tok, routed_scaling_factor=lm.routed_scaling_factor,
                  topk_method="greedy", n_group=lm.n_group, topk_group=lm.topk_group, hidden_act=lm.hidden_act,
                  max_position_embeddings=lm.max_position_embeddings, rms_norm_eps=lm.rms_norm_eps,
                  attention_bias=lm.attention_bias, rope_parameters=rope, bos_token_id=lm.bos_token_id,
                  eos_token_id=lm.eos_token_id, pad_token_id=lm.pad_token_id, tie_word_embeddings=False)
    if not lm.use_mla:
        return DeepseekOcr2TextConfig(**common, mlp_layer_types=[
            "sparse" if is_moe_layer(lm, i) else "dense" for i in range(lm.num_hidden_layers)])
    return DeepseekV2Config(**common, kv_lora_rank=lm.kv_lora_rank, q_lora_rank=lm.q_lora_rank,
                            qk_rope_head_dim=lm.qk_rope_head_dim, qk_nope_head_dim=lm.qk_nope_head_dim,
                            v_head_dim=lm.v_head_dim, first_k_dense_replace=lm.first_k_dense_replace)


# ----------------------------------------------------------------------------- vision tower (timm names)

class PatchEmbed(nn.Module):
    def __init__(self, patch, width):
        super().__init__()
        self.proj = nn.Conv2d(3, width, patch, patch)

    def forward(self, x):                                   # [T, 3, S, S] -> [T, (S/p)^2, C]
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """SigLIP ViT as DeepSeek-VL2 runs it (ignore_head: the attention-pool head is never used,
    so its tensors are kept on disk as they are but not built): patch conv (bias), learned
    absolute positions, pre-norm blocks (tanh GELU), final LayerNorm (eps 1e-6)."""

    def __init__(self, v):
        super().__init__()
        n = (v["image_size"] // v["patch_size"]) ** 2
        self.patch_embed = PatchEmbed(v["patch_size"], v["width"])
        self.pos_embed = nn.Parameter(torch.zeros(1, n, v["width"]))
        self.blocks = nn.Sequential(*[Block(v["width"], v["heads"], v["mlp_ratio"]) for _ in range(v["layers"])])
        self.norm = nn.LayerNorm(v["width"], eps=1e-6)

    def forward(self, x):
        return self.norm(self.blocks(self.patch_embed(x) + self.pos_embed))


class Projector(nn.Module):
    """MlpProjector: `downsample_mlp_gelu` concatenates each 2 x 2 (downsample_ratio) block of
    the tile's token grid (bottom / right zero-padded when the grid is odd, e.g. 27 x 27) in
    F.unfold order (channel-major: c * r^2 + di * r + dj), then Linear, (GELU, Linear) x (depth-1)."""

    def __init__(self, p):
        super().__init__()
        self.p = p
        t, din, d, mr = p["projector_type"], p["input_dim"], p["n_embed"], p["mlp_ratio"]
        if t == "identity":
            self.layers = nn.Identity()
        elif t == "linear":
            self.layers = nn.Linear(din, d)
        elif t == "mlp_gelu":
            mods = [nn.Linear(din, d)]
            for _ in range(1, p["depth"]):
                mods += [nn.GELU(), nn.Linear(d, d)]
            self.layers = nn.Sequential(*mods)
        else:
            r = p["downsample_ratio"]
            mods = [nn.Linear(din * r * r, d * mr)]
            for _ in range(1, p["depth"] - 1):
                mods += [nn.GELU(), nn.Linear(d * mr, d * mr)]
            self.layers = nn.Sequential(*mods, nn.GELU(), nn.Linear(d * mr, d))

    def forward(self, x):                                   # [T, h*w, C] -> [T, h'*w', D]
        if self.p["projector_type"] == "downsample_mlp_gelu":
            r = self.p["downsample_ratio"]
            T, hw, C = x.shape
            h = int(hw ** 0.5)
            pad = -h % r
            x = F.pad(x.reshape(T, h, h, C), (0, 0, 0, pad, 0, pad))
            x = F.unfold(x.permute(0, 3, 1, 2), kernel_size=r, stride=r).permute(0, 2, 1)
        return self.layers(x)


# ----------------------------------------------------------------------------- router and language model

class Router(nn.Module):
    """The official MoE gate (inference path). Returns (logits [T, N] fp32, weights [T, k],
    indices [T, k]) like transformers' routers, so forward hooks see the chosen experts.

        s = softmax(x W^T) or sigmoid(x W^T)                                   (fp32)
        greedy: top-k of s; group_limited_greedy: top-k of s inside the topk_group groups
        with the largest max_e s; noaux_tc: choice on s + bias, groups scored by the sum of
        their top-2, weights gathered from s
        w = w / (sum w + 1e-20) * routed_scaling_factor   if norm_topk_prob and k > 1
            w * routed_scaling_factor                     otherwise"""

    def __init__(self, lm, hidden):
        super().__init__()
        self.num_experts, self.top_k = lm.n_routed_experts, lm.num_experts_per_tok
        self.topk_method, self.scoring_func = lm.topk_method, lm.scoring_func
        self.num_group, self.topk_group = lm.n_group, lm.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = lm.norm_topk_prob, lm.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, hidden).normal_(0, 0.02))
        if self.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def forward(self, x):
        x = x.reshape(-1, self.weight.shape[1])
        logits = F.linear(x.float(), self.weight.float())
        s = logits.softmax(-1) if self.scoring_func == "softmax" else logits.sigmoid()
        choice = s if self.topk_method != "noaux_tc" else s + self.e_score_correction_bias.float()
        if self.topk_method != "greedy":
            g = choice.view(len(x), self.num_group, -1)
            gs = g.max(-1).values if self.topk_method == "group_limited_greedy" else g.topk(2, -1)[0].sum(-1)
            keep = torch.zeros_like(gs).scatter_(1, gs.topk(self.topk_group, -1, sorted=False)[1], 1.0)
            choice = choice.masked_fill(~keep.bool()[:, :, None].expand_as(g).reshape(len(x), -1), 0.0)
        w, idx = choice.topk(self.top_k, -1, sorted=False)
        if self.topk_method == "noaux_tc":
            w = s.gather(1, idx)
        if self.top_k > 1 and self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, idx


class Language(nn.Module):
    """`language.model` (transformers' DeepSeek-V2 decoder, MHA or MLA) + `language.lm_head`."""

    def __init__(self, lm):
        super().__init__()
        from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2TextModel
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP, DeepseekV2Model
        tc = hf_text_config(lm)
        self.model = (DeepseekV2Model if lm.use_mla else DeepseekOcr2TextModel)(tc)
        for i, layer in enumerate(self.model.layers):
            if lm.use_mla and not is_moe_layer(lm, i) and hasattr(layer.mlp, "gate"):   # moe_layer_freq
                layer.mlp = DeepseekV2MLP(tc)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate = Router(lm, lm.hidden_size)
        self.lm_head = nn.Linear(lm.hidden_size, lm.vocab_size, bias=False)


class DeepseekVL2ForCausalLM(nn.Module):
    """DeepSeek-VL2 with the official parameter names (vision, projector, image_newline,
    view_seperator, language). forward / generate take the official processor outputs:
    input_ids [B, L], attention_mask [B, L], images [B, T, 3, S, S], images_seq_mask [B, L]
    (bool, the <image> positions), images_spatial_crop [B, n_images, 2] (tiles wide, high)."""

    def __init__(self, config):
        super().__init__()
        check_config(config)
        self.config = config
        self.vision = VisionTower(config.vision)
        self.projector = Projector(config.projector)
        d = config.projector["n_embed"]
        self.image_newline = nn.Parameter(torch.randn(d) / math.sqrt(d))
        self.view_seperator = nn.Parameter(torch.randn(d) / math.sqrt(d))
        self.language = Language(config.lm)
        self.extra = {}                      # checkpoint tensors the forward never reads (vision.attn_pool.*)

    @property
    def device(self):
        return self.image_newline.device

    @property
    def dtype(self):
        return self.image_newline.dtype

    def image_embeddings(self, images, spatial_crop):
        """Per batch row, the embeddings of all its images in prompt order: global view rows
        each + image_newline, view_seperator, local views as one (th*h) x (tw*w) grid with a
        newline per row (tile_tag 2D; global_view_pos "tail" swaps the two views around the
        separator). Returns a list of [n_i, D]."""
        counts = [[(1 + int(w) * int(h)) for w, h in row if w > 0 and h > 0] for row in spatial_crop.tolist()]
        tiles = [images[b, :sum(c)] for b, c in enumerate(counts)]
        if sum(map(len, tiles)) == 0:
            return [None] * len(counts)
        emb = self.projector(self.vision(torch.cat(tiles).to(self.dtype)))     # [T_all, h*w, D]
        _, hw, D = emb.shape
        h = int(hw ** 0.5)
        nl = self.image_newline.to(emb.dtype)
        out, t = [], 0
        for b, row in enumerate(spatial_crop.tolist()):
            parts = []
            for w_t, h_t in ((int(w), int(hh)) for w, hh in row if w > 0 and hh > 0):
                g = emb[t].view(h, h, D)
                loc = emb[t + 1:t + 1 + w_t * h_t].view(h_t, w_t, h, h, D).permute(0, 2, 1, 3, 4).reshape(
                    h_t * h, w_t * h, D)
                t += 1 + w_t * h_t
                views = [torch.cat([g, nl.expand(h, 1, D)], 1).reshape(-1, D),
                         torch.cat([loc, nl.expand(h_t * h, 1, D)], 1).reshape(-1, D)]
                if self.config.raw.get("global_view_pos", "head") != "head":     # "tail": local views first
                    views.reverse()
                parts += [views[0], self.view_seperator[None].to(emb.dtype), views[1]]
            out.append(torch.cat(parts) if parts else None)
        return out

    def embed(self, input_ids, images=None, images_seq_mask=None, images_spatial_crop=None):
        """Token embeddings with the image embeddings scattered into the <image> positions.
        Raises VL2Error when a row's <image> positions and its image embeddings differ in number."""
        x = self.language.model.embed_tokens(input_ids)
        if images is None or images_spatial_crop is None or int(images_spatial_crop.sum()) == 0:
            return x
        x = x.clone()
        for b, e in enumerate(self.image_embeddings(images, images_spatial_crop)):
            m = images_seq_mask[b].bool()
            if int(m.sum()) != (0 if e is None else len(e)):
                raise VL2Error(f"row {b}: {int(m.sum())} <image> positions but {0 if e is None else len(e)} image "
                               f"embeddings (see image_token_count)")
            if e is not None:
                x[b, m] = e.to(x.dtype)
        return x

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                images=None, images_seq_mask=None, images_spatial_crop=None, use_cache=False):
        """Namespace(logits [B, L, V], cache) of one call of the language model."""
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids, images, images_seq_mask, images_spatial_crop)
        out = self.language.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                  position_ids=position_ids, cache=cache, use_cache=use_cache)
        return SimpleNamespace(logits=self.language.lm_head(out.last_hidden_state), cache=out.cache)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens=32, min_new_tokens=0, do_sample=False,
                 eos_token_id=None, pad_token_id=None, **image_inputs):
        """Greedy decoding with a KV cache (left padding: positions count only attended tokens).
        Same contract as transformers' generate: returns [B, L + n] with tokens after a row's EOS
        set to pad_token_id, stops when every row has ended; the model is called once for the
        prompt and once per generated token but the last. min_new_tokens masks EOS before that.
        image_inputs: the processor's `images`, `images_seq_mask`, `images_spatial_crop` (absent
        for text-only prompts); other keys are ignored."""
        from transformers import DynamicCache
        if do_sample:
            raise VL2Error("only greedy decoding (do_sample=False) is implemented")
        eos = self.config.lm.eos_token_id if eos_token_id is None else eos_token_id
        pad = eos if pad_token_id is None else pad_token_id
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.language.model.config)
        emb = self.embed(input_ids, image_inputs.get("images"), image_inputs.get("images_seq_mask"),
                         image_inputs.get("images_spatial_crop"))
        logits = self(inputs_embeds=emb, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits
        done = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
        new = []
        for step in range(max_new_tokens):
            last = logits[:, -1].float()
            if step < min_new_tokens:
                last[:, eos] = -math.inf
            nxt = torch.where(done, torch.full_like(done, pad, dtype=torch.long), last.argmax(-1))
            new.append(nxt)
            done |= nxt == eos
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = pos[:, -1:] + 1
            logits = self(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, cache=cache,
                          use_cache=True).logits
        return torch.cat([input_ids, torch.stack(new, 1)], 1)

    def save_pretrained(self, path, max_shard_size=5 << 30):
        """Write config.json (the loaded one, as a merge left it) and the weights in the official
        layout: per-expert `experts.E.{gate,up,down}_proj.weight`, checkpoint tensors the forward
        does not use written back unchanged; shards of at most max_shard_size bytes (+ index)."""
        os.makedirs(path, exist_ok=True)
        tensors = to_official(self.state_dict())
        tensors.update(self.extra)
        shards, cur, size = [], {}, 0
        for k in tensors:
            n = tensors[k].numel() * tensors[k].element_size()
            if cur and size + n > max_shard_size:
                shards.append(cur)
                cur, size = {}, 0
            cur[k], size = tensors[k].contiguous(), size + n
        shards.append(cur)
        names = ["model.safetensors"] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, s in zip(names, shards):
            save_file(s, os.path.join(path, name), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                     "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        raw = self.config.raw
        for k in ("n_routed_experts", "n_group", "topk_group"):     # copies of language fields at the top level
            if k in raw and k in raw["language_config"]:
                raw[k] = raw["language_config"][k]
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)


# ----------------------------------------------------------------------------- weights

def to_official(sd):
    """state_dict -> official key names: fused experts.gate_up_proj [E, 2I, H] / down_proj
    [E, H, I] become experts.E.gate_proj / up_proj / down_proj .weight (gate = first I rows)."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".experts.gate_up_proj"):
            pre, half = k[:-len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"], out[f"{pre}{e}.up_proj.weight"] = v[e, :half], v[e, half:]
        elif k.endswith(".experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def from_official(tensors):
    """Inverse of to_official (per-expert tensors stacked in expert order). Consumes `tensors`
    (each layer's per-expert tensors are dropped as soon as they are stacked, so loading holds
    the model plus one layer's experts twice at most)."""
    out, experts = {}, {}
    for k in list(tensors):
        m = re.match(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = k
        else:
            out[k] = tensors.pop(k)
    for pre, parts in experts.items():
        n = len(parts["gate_proj"])
        if any(sorted(parts.get(p, {})) != list(range(n)) for p in ("gate_proj", "up_proj", "down_proj")):
            raise VL2Error(f"{pre}: expert tensors are incomplete (expected 0..{n - 1} for gate/up/down)")
        g = lambda p, e: tensors.pop(parts[p][e])
        out[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([g("gate_proj", e), g("up_proj", e)]) for e in range(n)])
        out[f"{pre}.down_proj"] = torch.stack([g("down_proj", e) for e in range(n)])
    return out


def load(path, dtype=None, device="cpu"):
    """DeepseekVL2ForCausalLM from a checkpoint directory (config.json + safetensors in the
    official layout), in eval mode. dtype None keeps the checkpoint's dtypes. Tensors the
    forward never reads (the unused attention-pool head) are kept in `model.extra` and written
    back by save_pretrained. Raises VL2Error for an unsupported config or missing tensors."""
    config = Config.from_pretrained(path)
    with torch.device("meta"):
        model = DeepseekVL2ForCausalLM(config)
    tensors = {}
    for f in safetensors_files(path):
        tensors.update(load_file(f))
    sd = from_official(tensors)
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    if missing:
        raise VL2Error(f"{path}: checkpoint lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")
    for k in own:
        if tuple(sd[k].shape) != tuple(own[k].shape):
            raise VL2Error(f"{path}: {k} has shape {list(sd[k].shape)}, config.json implies {list(own[k].shape)}")
    model.load_state_dict({k: sd[k] for k in own}, assign=True)
    model.extra = {k: v for k, v in sd.items() if k not in own}
    # non-persistent buffers (rotary frequencies) were created on the meta device: rebuild them
    rot = model.language.model.rotary_emb
    model.language.model.rotary_emb = type(rot)(rot.config)
    if dtype is not None:
        model.to(dtype)
    return model.to(device).eval()


def build_random(raw, seed=0):
    """A randomly initialised model of config dict `raw` (tests, synthetic checkpoints)."""
    torch.manual_seed(seed)
    model = DeepseekVL2ForCausalLM(Config(raw))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith("weight") and p.dim() == 1:
                p.fill_(1.0)
            elif p.dim() > 1 or "experts" in n:
                p.normal_(0, 0.05)
    return model.eval()


# ----------------------------------------------------------------------------- processor

def select_best_resolution(size, candidates):
    """The official tiling choice: among candidate (width, height) pairs, the one whose
    aspect-preserving downscale of the image keeps the most pixels, ties broken by the least
    padding. size = (width, height) of the image."""
    W, H = size
    best, best_eff, best_waste = None, 0, math.inf
    for w, h in candidates:
        s = min(w / W, h / H)
        eff = min(int(W * s) * int(H * s), W * H)
        waste = w * h - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (w, h), eff, waste
    return best


def image_token_count(tiles_w, tiles_h, image_size=384, patch_size=14, downsample_ratio=2):
    """Number of <image> positions of one image: h (w + 1) global + 1 separator + (th h)(tw w + 1)
    local, h = w = ceil((image_size // patch_size) / downsample_ratio) (14 for 384 / 14 / 2)."""
    h = math.ceil((image_size // patch_size) / downsample_ratio)
    return h * (h + 1) + 1 + tiles_h * h * (tiles_w * h + 1)


class Processor:
    """The official DeepseekVLV2Processor's inference path, without its torchvision transform:
    prompt `<bos><|User|>: <image>\\n{question}\\n\\n<|Assistant|>:` (sft_format deepseek), earlier
    turns as `... <|Assistant|>: {answer}<eos>`, images padded (PIL ImageOps.pad, mean colour)
    to a global S x S view and to the best candidate resolution cut into S x S tiles, pixel
    values (x / 255 - mean) / std; batches left-padded. `encode` returns model inputs."""

    def __init__(self, tokenizer, candidate_resolutions, patch_size, downsample_ratio, image_mean=(0.5, 0.5, 0.5),
                 image_std=(0.5, 0.5, 0.5), image_token="<image>"):
        self.tokenizer = tokenizer
        self.candidates = [tuple(c) for c in candidate_resolutions]
        self.image_size, self.patch_size, self.downsample_ratio = self.candidates[0][0], patch_size, downsample_ratio
        self.mean, self.std = image_mean, image_std
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise VL2Error(f"the tokenizer has no {image_token!r} token")
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id

    @classmethod
    def from_pretrained(cls, path, config=None):
        """Tokenizer (AutoTokenizer) + processor_config.json (else config.json's candidate
        resolutions and the vision / projector settings)."""
        from transformers import AutoTokenizer
        from transformers.utils import logging
        config = config or Config.from_pretrained(path)
        level = logging.get_verbosity()
        logging.set_verbosity_error()          # it reads config.json and warns that deepseek_vl_v2 is unknown
        try:
            tok = AutoTokenizer.from_pretrained(path)
        finally:
            logging.set_verbosity(level)
        # the official processor's additions (no-ops when the tokenizer already has them as tokens)
        if tok.pad_token is None:
            tok.add_special_tokens({"pad_token": "<｜▁pad▁｜>"})
        tok.add_tokens(["<image>", "<|ref|>", "<|/ref|>", "<|det|>", "<|/det|>", "<|grounding|>", "<|User|>",
                        "<|Assistant|>"], special_tokens=True)
        used = {t: tok.convert_tokens_to_ids(t) for t in ("<image>", "<|User|>", "<|Assistant|>", tok.pad_token,
                                                         tok.bos_token, tok.eos_token) if t is not None}
        over = {t: i for t, i in used.items() if i is None or i >= config.lm.vocab_size}
        if over:
            raise VL2Error(f"{path}: tokens {over} are outside the model's vocab_size {config.lm.vocab_size}: the "
                           f"tokenizer does not belong to this checkpoint")
        pc = {}
        if os.path.exists(os.path.join(path, "processor_config.json")):
            with open(os.path.join(path, "processor_config.json")) as f:
                pc = json.load(f)
        return cls(tok,
                   pc.get("candidate_resolutions") or config.raw.get("candidate_resolutions") or [[384, 384]],
                   pc.get("patch_size", config.vision["patch_size"]),
                   pc.get("downsample_ratio", config.projector["downsample_ratio"]),
                   tuple(pc.get("image_mean", (0.5, 0.5, 0.5))), tuple(pc.get("image_std", (0.5, 0.5, 0.5))),
                   pc.get("image_token", "<image>"))

    def _pixels(self, im):
        x = torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (x - torch.tensor(self.mean)[:, None, None]) / torch.tensor(self.std)[:, None, None]

    def tiles(self, image, cropping=True):
        """[1 + tw*th, 3, S, S] pixel values (global first, then local tiles row-major) and (tw, th).
        cropping False (the official processor's choice for a prompt with more than 2 images): the
        local view is the image padded to S x S, one tile (tw = th = 1)."""
        image = image.convert("RGB")
        S, fill = self.image_size, tuple(int(m * 255) for m in self.mean)
        w, h = select_best_resolution(image.size, self.candidates) if cropping else (S, S)
        out = [self._pixels(ImageOps.pad(image, (S, S), color=fill))]
        local = ImageOps.pad(image, (w, h), color=fill)
        out += [self._pixels(local.crop((j, i, j + S, i + S))) for i in range(0, h, S) for j in range(0, w, S)]
        return torch.stack(out), (w // S, h // S)

    def _ids(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def encode(self, images, questions, history=None):
        """Left-padded batch: input_ids, attention_mask [B, L], images [B, T, 3, S, S],
        images_seq_mask [B, L], images_spatial_crop [B, n_max, 2] (rows with fewer images padded
        with [0, 0]). images[i]: None (a text-only row), one PIL image or a list of them; they go
        with the first turn, at its `<image>` tags when it has one per image, else one
        `<image>\n` line per image in front of the question. As in the official processor,
        a prompt with more than 2 images is not tiled (each image: global view + one S x S local
        view); 1 or 2 images are tiled at their best candidate resolution.
        history: None or per row its earlier (question, answer) turns."""
        rows, masks, pix, crops = [], [], [], []
        for i, (im, q) in enumerate(zip(images, questions)):
            ims = [] if im is None else list(im) if isinstance(im, (list, tuple)) else [im]
            cropping = len(ims) <= 2
            turns = list(history[i]) if history else []
            ids = [] if self.bos_token_id is None else [self.bos_token_id]
            m = [False] * len(ids)
            crop, t = [], []
            for j, (u, a) in enumerate(turns + [(q, None)]):
                user = str(u).strip()
                if j == 0 and ims and user.count(self.image_token) != len(ims):
                    user = f"{self.image_token}\n" * len(ims) + user
                pieces = f"<|User|>: {user}\n\n<|Assistant|>:".split(self.image_token)
                if j > 0 or not ims:                    # an `<image>` typed in a later turn stays text
                    pieces = ["".join(self.image_token.join(pieces))]
                for k, piece in enumerate(pieces):
                    seg = self._ids(piece)
                    ids += seg
                    m += [False] * len(seg)
                    if k < len(pieces) - 1:
                        x, c = self.tiles(ims[k], cropping)
                        n = image_token_count(*c, self.image_size, self.patch_size, self.downsample_ratio)
                        ids += [self.image_token_id] * n
                        m += [True] * n
                        t.append(x)
                        crop.append(c)
                if a is not None:
                    ans = self._ids(str(a).strip()) + [self.eos_token_id]
                    ids += ans
                    m += [False] * len(ans)
            rows.append(ids), masks.append(m), crops.append(crop or [(0, 0)])
            pix.append(torch.cat(t) if t else None)
        L = max(map(len, rows))
        S = self.image_size
        T = max([len(t) for t in pix if t is not None] or [1])
        n_max = max(map(len, crops))
        images_t = torch.zeros(len(rows), T, 3, S, S)
        for b, t in enumerate(pix):
            if t is not None:
                images_t[b, :len(t)] = t
        return {"input_ids": torch.tensor([[self.pad_token_id] * (L - len(r)) + r for r in rows]),
                "attention_mask": torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows]),
                "images": images_t,
                "images_seq_mask": torch.tensor([[False] * (L - len(m)) + m for m in masks]),
                "images_spatial_crop": torch.tensor([[list(c) for c in cs] + [[0, 0]] * (n_max - len(cs))
                                                     for cs in crops], dtype=torch.long)}

    def decode(self, ids, skip_special_tokens=True, **kw):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, **kw)

    def save_pretrained(self, path):
        self.tokenizer.save_pretrained(path)
        with open(os.path.join(path, "processor_config.json"), "w") as f:
            json.dump({"candidate_resolutions": [list(c) for c in self.candidates], "patch_size": self.patch_size,
                       "downsample_ratio": self.downsample_ratio, "image_mean": list(self.mean),
                       "image_std": list(self.std), "image_token": self.image_token,
                       "processor_class": "DeepseekVLV2Processor"}, f, indent=2)
