"""Fast hand-computed cases for the rest of mole/model.py (the `MoLE` module, its config, the
per-forward context, the registered attention function, ESVA), without a VLM: a stand-in model of
a few Linear layers with the attributes MoLE reads from a transformers VLM (config, decoder stack,
input embeddings, attention implementation). Written for the mutation pass over the whole file
(`python -m eval.tools.mutation --target mole/model.py`; see eval/logs/mutation.md). Every
expected number is worked out in the comment above it."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from mole.adapters import VLMAdapter
from mole.model import (PAD, TEXT, VIS, ZSUM, ZVIS, ESVA, MoLE, MoLEConfig, MoLEPass, esva_delta, init_latents,
                        latent_scores, mole_attention, topology_mask)

IMG, PADID, EOS, V = 5, 0, 9, 12   # the stand-in's image id, pad id, end id and vocabulary size
TAIL = [7, 8]                      # the assistant header every prompt ends with


class _TextConfig(SimpleNamespace):
    def get_text_config(self):
        return self


class _Attn(nn.Module):
    """One attention block: q/k/v/o projections and `mole_attention`, which the model must have been
    switched to (`owner`: the model, held in a list so that it is not registered as a submodule)."""

    def __init__(self, idx, d, H, Hkv, D, owner):
        super().__init__()
        self.layer_idx, self.H, self.Hkv, self.D, self.owner = idx, H, Hkv, D, [owner]
        self.num_key_value_groups = H // Hkv
        self.q_proj, self.o_proj = nn.Linear(d, H * D, bias=False), nn.Linear(H * D, d, bias=False)
        self.k_proj, self.v_proj = nn.Linear(d, Hkv * D, bias=False), nn.Linear(d, Hkv * D, bias=False)

    def forward(self, h, mask, **kw):
        B, L, _ = h.shape
        q = self.q_proj(h).view(B, L, self.H, self.D).transpose(1, 2)
        k = self.k_proj(h).view(B, L, self.Hkv, self.D).transpose(1, 2)
        v = self.v_proj(h).view(B, L, self.Hkv, self.D).transpose(1, 2)
        assert self.owner[0].impl["text_config"] == "mole"
        out, _ = mole_attention(self, q, k, v, mask, scaling=self.D ** -0.5, **kw)
        return self.o_proj(out.reshape(B, L, self.H * self.D))


class _Layer(nn.Module):
    def __init__(self, idx, d, H, Hkv, D, owner):
        super().__init__()
        self.self_attn = _Attn(idx, d, H, Hkv, D, owner)

    def forward(self, hidden_states, attention_mask=None, **kw):
        return hidden_states + self.self_attn(hidden_states, attention_mask, **kw)


class _FakeVLM(nn.Module):
    """The parts of a transformers VLM that MoLE reads: config (text config with the head sizes,
    vision config's attention implementation, image token id), model.language_model.layers,
    get_input_embeddings, set_attn_implementation, device, and a forward over inputs_embeds whose
    keyword arguments are recorded in `calls` (and its last hidden state in `last`)."""

    def __init__(self, d=4, H=2, Hkv=1, D=2, layers=1, head_dim=True, vision_impl="sdpa", device=None):
        super().__init__()
        text = _TextConfig(hidden_size=d, num_attention_heads=H, num_key_value_heads=Hkv,
                           _attn_implementation="sdpa")
        if head_dim:
            text.head_dim = D
        vision = SimpleNamespace() if vision_impl == "unset" else SimpleNamespace(_attn_implementation=vision_impl)
        self.config = SimpleNamespace(model_type="fake_vlm", image_token_id=IMG, get_text_config=lambda: text,
                                      vision_config=vision)
        self._device = device   # a device to report (meta: where MoLE's parameters must follow), else the weights'
        self.model = nn.Module()
        self.model.language_model = nn.Module()
        self.model.language_model.layers = nn.ModuleList(_Layer(i, d, H, Hkv, D, self) for i in range(layers))
        self.embed_tokens = nn.Embedding(V, d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.impl = {"text_config": "sdpa", "vision_config": None if vision_impl == "unset" else vision_impl}
        self.impl_calls, self.calls = [], []

    @property
    def device(self):
        return torch.device(self._device) if self._device else self.lm_head.weight.device

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_attn_implementation(self, impl):
        self.impl_calls.append(dict(impl))
        self.impl = dict(impl)

    def forward(self, inputs_embeds=None, attention_mask=None, position_ids=None, mm_token_type_ids=None,
                pixel_values=None, cache=None, use_cache=False, output_hidden_states=False, **kw):
        self.calls.append(dict(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                               mm_token_type_ids=mm_token_type_ids, pixel_values=pixel_values, cache=cache,
                               use_cache=use_cache, output_hidden_states=output_hidden_states, **kw))
        B, L, _ = inputs_embeds.shape
        mask = (torch.ones(L, L, dtype=torch.bool).tril()[None] & attention_mask.bool()[:, None, :])[:, None]
        hs = [inputs_embeds]
        for layer in self.model.language_model.layers:
            hs.append(layer(hs[-1], attention_mask=mask, **{k: v for k, v in kw.items() if k == "mole"}))
        self.last = hs[-1]
        return SimpleNamespace(logits=self.lm_head(hs[-1]), hidden_states=tuple(hs) if output_hidden_states else None)


class _Adapter(VLMAdapter):
    """Prompts are the question's own ids (a list of ints, image ids included) + TAIL; answers are
    their ids + EOS; the vision tensors are one `pixel_values` tensor per batch."""
    image_token_id, pad_token_id, eos_token_id = IMG, PADID, EOS
    proc = "the processor"

    def tail_ids(self):
        return list(TAIL)

    def prompts(self, images, questions, pixels=None, n_images=None):
        self.seen = (pixels, n_images)
        return [list(q) + TAIL for q in questions], {"pixel_values": torch.tensor([len(images)])}

    def text_ids(self, text):
        return list(text)

    def decode(self, ids):
        return " ".join(map(str, ids))


def _mole(cfg=None, **model_kw):
    torch.manual_seed(0)
    model = _FakeVLM(**model_kw)
    return MoLE(model, _Adapter(), cfg or MoLEConfig(n_vis=2, n_sum=1, top_k=1))


# ----------------------------------------------------------------------------- mole_attention
# One head, D = 1, scaling 2, every query 1, keys [0, ln 2 / 2, ln 3 / 2]: the logits over the three
# columns are [0, ln 2, ln 3], softmax weights proportional to [1, 2, 3]; values [0, 3, 6].
# Over columns {0}: 0; {0, 1}: (0 + 2 * 3) / 3 = 2; {0, 2}: (0 + 3 * 6) / 4 = 4.5; {0, 1, 2}: (6 + 18) / 6 = 4.

def _qkv(Q=3, device="cpu"):
    q = torch.ones(1, 1, Q, 1, device=device)
    k = torch.tensor([0.0, math.log(2) / 2, math.log(3) / 2], device=device).view(1, 1, 3, 1)
    v = torch.tensor([0.0, 3.0, 6.0], device=device).view(1, 1, 3, 1)
    return q, k, v


def _module(is_causal=True, groups=1):
    return SimpleNamespace(layer_idx=0, num_key_value_groups=groups, is_causal=is_causal)


def _col(out):
    return [round(x, 5) for x in out[0, :, 0, 0].tolist()]   # out [B, Q, H, D] -> the one head's column


FULL = torch.ones(1, 1, 3, 3, dtype=torch.bool)


def test_mole_attention_without_mole_arguments_is_sdpa_with_the_given_mask():
    q, k, v = _qkv()
    out, w = mole_attention(_module(), q, k, v, FULL, scaling=2.0)
    assert w is None and out.shape == (1, 3, 1, 1)
    assert _col(out) == [4.0, 4.0, 4.0]            # the bidirectional mask kept, no dropout by default
    # no mask: SDPA's own causal flag (the module's is_causal): rows over {0}, {0, 1}, {0, 1, 2}
    assert _col(mole_attention(_module(), q, k, v, None, scaling=2.0)[0]) == [0.0, 2.0, 4.0]
    # a module that is not causal and no mask: every row reads every column (no causal mask made here)
    assert _col(mole_attention(_module(is_causal=False), q, k, v, None, scaling=2.0)[0]) == [4.0, 4.0, 4.0]
    # the scaling reaches SDPA: at scaling 4 the logits are [0, 2 ln 2, 2 ln 3], weights [1, 4, 9] / 14:
    # (12 + 54) / 14 = 4.714286
    assert _col(mole_attention(_module(), q, k, v, FULL, scaling=4.0)[0]) == [round(66 / 14, 5)] * 3
    # the other keyword arguments reach SDPA: is_causal=False overrides the causal module
    assert _col(mole_attention(_module(), q, k, v, None, scaling=2.0, is_causal=False)[0]) == [4.0, 4.0, 4.0]
    # dropout reaches SDPA: p = 1 drops every weight
    assert _col(mole_attention(_module(), q, k, v, FULL, dropout=1.0, scaling=2.0)[0]) == [0.0, 0.0, 0.0]


def test_mole_attention_restricts_text_rows_to_the_given_columns():
    q, k, v = _qkv()
    cols = torch.tensor([[True, False, True]])
    # the base's (full) mask and the columns: every row over {0, 2}
    assert _col(mole_attention(_module(), q, k, v, FULL, scaling=2.0, mole_columns=cols)[0]) == [4.5] * 3
    # a sliding-window cache holds the last 3 of 5 columns: the columns' last 3 entries are used
    cols5 = torch.tensor([[False, False, True, False, True]])
    assert _col(mole_attention(_module(), q, k, v, FULL, scaling=2.0, mole_columns=cols5)[0]) == [4.5] * 3
    # no mask built: causal aligned to the end (tril(K - Q)); one new row (Q = 1) sees every cached
    # column, here {0, 2}
    q1 = torch.ones(1, 1, 1, 1)
    assert _col(mole_attention(_module(), q1, k, v, None, scaling=2.0, mole_columns=cols)[0]) == [4.5]
    # two new rows over three columns: tril(1): rows {0, 1} and {0, 1, 2}
    q2 = torch.ones(1, 1, 2, 1)
    every = torch.ones(1, 3, dtype=torch.bool)
    assert _col(mole_attention(_module(), q2, k, v, None, scaling=2.0, mole_columns=every)[0]) == [2.0, 4.0]


def test_mole_attention_builds_its_masks_on_the_inputs_device():
    q, k, v = _qkv(Q=2, device="meta")
    out, _ = mole_attention(_module(), q, k, v, None, scaling=2.0,
                            mole_columns=torch.ones(1, 3, dtype=torch.bool, device="meta"))
    assert out.device.type == "meta" and out.shape == (1, 2, 1, 1)


class _StubMoLE(SimpleNamespace):
    """What MoLEPass and mole_attention read from a MoLE: cfg, training, reduce, latent_attention
    (recorded; returns `zout`)."""

    def latent_attention(self, layer_idx, query, key, value, mask, scaling, st):
        self.seen = dict(layer_idx=layer_idx, mask=mask, scaling=scaling, st=st)
        return self.zout


def _pass(types, cfg, zpos=None, stage=2, record=False, zout=None):
    mole = _StubMoLE(cfg=cfg, training=False, reduce=None, zout=zout)
    return MoLEPass(mole, torch.tensor([types]), torch.tensor([zpos or [0]]), stage, record)


def test_mole_attention_applies_the_topology_over_the_base_mask():
    q, k, v = _qkv()
    plain = MoLEConfig(n_vis=1, n_sum=0, top_k=1, router=False, esva=False)
    # text rows with a bidirectional base mask: the topology keeps it (each row over {0, 1, 2})
    st = _pass([TEXT, TEXT, TEXT], plain)
    assert _col(mole_attention(_module(), q, k, v, FULL, scaling=2.0, mole=st)[0]) == [4.0, 4.0, 4.0]
    # no mask built: causal
    st = _pass([TEXT, TEXT, TEXT], plain)
    assert _col(mole_attention(_module(), q, k, v, None, scaling=2.0, mole=st)[0]) == [0.0, 2.0, 4.0]
    # stage 1: the text rows 0 and 2 may not read the visual column 1: {0, 2} -> 4.5; the visual row keeps 4
    st = _pass([TEXT, VIS, TEXT], plain, stage=1)
    assert _col(mole_attention(_module(), q, k, v, FULL, scaling=2.0, mole=st)[0]) == [4.5, 4.0, 4.5]


def test_mole_attention_writes_the_latent_rows_over_the_sdpa_rows():
    # two heads (no GQA), E = 1 Z_vis at position 1; the stub's Z_vis output is 10 (head 0) and 20 (head 1)
    q, k, v = (t.expand(1, 2, *t.shape[2:]).contiguous() for t in _qkv())
    zout = torch.tensor([10.0, 20.0]).view(1, 2, 1, 1)
    cfg = MoLEConfig(n_vis=1, n_sum=0, top_k=1)                       # router and ESVA: special
    st = _pass([TEXT, ZVIS, TEXT], cfg, zpos=[1], zout=zout)
    out, _ = mole_attention(_module(), q, k, v, FULL, scaling=2.0, mole=st)
    # rows 0 and 2 from SDPA over the topology (text rows keep the full base mask: 4.0 each); row 1 is the stub's
    assert out[0, :, :, 0].tolist() == [[4.0, 4.0], [10.0, 20.0], [4.0, 4.0]]
    seen = st.mole.seen
    assert seen["layer_idx"] == 0 and seen["scaling"] == 2.0 and seen["st"] is st
    assert torch.equal(seen["mask"], st.mask(FULL))
    # in bfloat16 the fp32 Z_vis rows are cast to the output's dtype
    st = _pass([TEXT, ZVIS, TEXT], cfg, zpos=[1], zout=zout)
    out, _ = mole_attention(_module(), q.bfloat16(), k.bfloat16(), v.bfloat16(), FULL, scaling=2.0, mole=st)
    assert out.dtype == torch.bfloat16 and out[0, 1, :, 0].tolist() == [10.0, 20.0]
    # without router and ESVA the SDPA rows stand, unless the pass records the Z_vis attention
    plain = MoLEConfig(n_vis=1, n_sum=0, top_k=1, router=False, esva=False)
    st = _pass([TEXT, ZVIS, TEXT], plain, zpos=[1], zout=zout)
    out, _ = mole_attention(_module(), q, k, v, FULL, scaling=2.0, mole=st)
    assert out[0, 1, :, 0].tolist() != [10.0, 20.0] and not hasattr(st.mole, "seen")
    st = _pass([TEXT, ZVIS, TEXT], plain, zpos=[1], record=True, zout=zout)
    out, _ = mole_attention(_module(), q, k, v, FULL, scaling=2.0, mole=st)
    assert out[0, 1, :, 0].tolist() == [10.0, 20.0]
    # E = 2 Z_vis at positions 2 and 0 with two heads: out[0, zpos[e], h] = zout[0, h, e]
    cfg2 = MoLEConfig(n_vis=2, n_sum=0, top_k=1)
    zout2 = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(1, 2, 2, 1)   # [B, H, E, D]
    st = _pass([ZVIS, TEXT, ZVIS], cfg2, zpos=[2, 0], zout=zout2)
    out, _ = mole_attention(_module(), q, k, v, FULL, scaling=2.0, mole=st)
    assert out[0, :, :, 0].tolist() == [[2.0, 4.0], [4.0, 4.0], [1.0, 3.0]]


def test_mole_attention_refuses_latent_rows_in_a_cached_step():
    # one new row (a lone Z_vis token, whose mask broadcasts) against three cached columns
    q, k, v = _qkv(Q=1)
    st = _pass([ZVIS], MoLEConfig(n_vis=1, n_sum=0, top_k=1), zpos=[0], zout=torch.zeros(1, 1, 1, 1))
    with pytest.raises(RuntimeError) as e:
        mole_attention(_module(), q, k, v, None, scaling=2.0, mole=st)
    assert str(e.value) == "MoLE Z_vis rows must be computed in a full (uncached) prefill"


# ----------------------------------------------------------------------------- MoLEConfig

def _message(fn):
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


def test_config_defaults_bounds_and_messages():
    c = MoLEConfig()
    assert (c.n_vis, c.n_sum, c.top_k, c.alpha, c.eps, c.router, c.esva, c.esva_hidden, c.latent_mixing) == \
        (4, 4, 2, 1.0, 1e-4, True, True, 0, "topological")
    assert (c.lambda_balance, c.lambda_z, c.lambda_div) == (0.01, 0.001, 0.01)
    # the smallest valid sizes: one visual expert, no summary expert, K = 1 = E; K = E; causal mixing
    MoLEConfig(n_vis=1, n_sum=0, top_k=1)
    MoLEConfig(n_vis=3, top_k=3, latent_mixing="causal")
    assert _message(lambda: MoLEConfig(n_vis=0)) == "need n_vis >= 1 and n_sum >= 0, got 0, 4"
    assert _message(lambda: MoLEConfig(n_sum=-1)) == "need n_vis >= 1 and n_sum >= 0, got 4, -1"
    assert _message(lambda: MoLEConfig(top_k=0)) == "need 1 <= top_k <= n_vis, got top_k=0, n_vis=4"
    assert _message(lambda: MoLEConfig(top_k=5)) == "need 1 <= top_k <= n_vis, got top_k=5, n_vis=4"
    assert _message(lambda: MoLEConfig(latent_mixing="full")) == \
        "latent_mixing must be 'topological' or 'causal', got 'full'"


def test_config_special_is_router_or_esva():
    assert [MoLEConfig(router=r, esva=e).special for r, e in ((1, 1), (1, 0), (0, 1), (0, 0))] == \
        [True, True, True, False]


# ----------------------------------------------------------------------------- MoLEPass

def test_pass_packs_the_visual_positions_per_row():
    # row 0: visual at 1 and 3; row 1: visual at 0 only -> vis_idx [[1, 3], [0, 1]] (row 1's second slot is
    # padding: the first non-visual position, stable order), vis_ok [[T, T], [T, F]]
    types = torch.tensor([[TEXT, VIS, ZVIS, VIS], [VIS, TEXT, TEXT, PAD]])
    f = lambda t: t
    st = MoLEPass(_StubMoLE(cfg=MoLEConfig(), training=True, reduce=f), types, torch.tensor([[2], [1]]), 1, True)
    assert st.reduce is f and st.stage == 1 and st.record is True and st.types is types
    assert st.is_vis.tolist() == [[False, True, False, True], [True, False, False, False]]
    assert st.vis_idx.tolist() == [[1, 3], [0, 1]]
    assert st.vis_ok.tolist() == [[True, True], [True, False]]
    assert st.route == {} and st.attn == {} and st.balance == [] and st.z == [] and st.div == []
    # outside training no reduce (evaluation counts this process's tokens only); stage 2 and no record by default
    st = MoLEPass(_StubMoLE(cfg=MoLEConfig(), training=False, reduce=f), types, torch.tensor([[2], [1]]))
    assert st.reduce is None and st.stage == 2 and st.record is False
    # an empty batch: no visual slot
    st = MoLEPass(_StubMoLE(cfg=MoLEConfig(), training=False, reduce=None), torch.zeros(0, 3, dtype=torch.long),
                  torch.zeros(0, 1, dtype=torch.long))
    assert st.vis_idx.shape == (0, 0) and st.vis_ok.shape == (0, 0)
    # made on the types' device (an empty batch on meta: the one case with no host read of the count)
    st = MoLEPass(_StubMoLE(cfg=MoLEConfig(), training=False, reduce=None),
                  torch.zeros(0, 3, dtype=torch.long, device="meta"), torch.zeros(0, 1, dtype=torch.long, device="meta"))
    assert st.vis_ok.device.type == "meta" and st.vis_idx.device.type == "meta"


def test_pass_packs_visual_positions_in_order_on_a_long_row():
    # 200 tokens, every third visual: vis_idx lists 0, 3, ..., 198 in order (a stable sort; an unstable one
    # permutes equal keys on CPU at this length)
    types = torch.tensor([[VIS if i % 3 == 0 else TEXT for i in range(200)]])
    st = MoLEPass(_StubMoLE(cfg=MoLEConfig(), training=False, reduce=None), types, torch.zeros(1, 1, dtype=torch.long))
    assert st.vis_idx.tolist() == [list(range(0, 200, 3))] and st.vis_ok.all()


def test_pass_mask_is_the_topology_over_each_base_mask_once():
    types = [TEXT, VIS, ZVIS, TEXT]
    cfg = MoLEConfig(n_vis=1, n_sum=0, top_k=1)
    st = _pass(types, cfg, zpos=[2], stage=1)
    full = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    causal = st.mask(None)
    m = st.mask(full)
    assert torch.equal(causal, topology_mask(st.types, 1, cfg)) and torch.equal(m, topology_mask(st.types, 1, cfg, full))
    assert not torch.equal(m, causal)                  # the base mask matters here (text row 0 reads column 3)
    # the same base tensor again: the same mask object; another tensor with equal values: a new one
    assert st.mask(None) is causal and st.mask(full) is m and st.mask(full.clone()) is not m


# ----------------------------------------------------------------------------- ESVA

def test_esva_init_shapes_and_scales():
    torch.manual_seed(5)
    e = ESVA(2, 3, 4)
    torch.manual_seed(5)
    w1 = torch.randn(2, 3, 4) / math.sqrt(3)
    w2 = torch.randn(2, 4, 3) / math.sqrt(4)
    assert torch.equal(e.w1, w1) and torch.equal(e.w2, w2)
    assert torch.equal(e.b1, torch.zeros(2, 4)) and torch.equal(e.b2, torch.zeros(2, 3))
    assert torch.equal(e.gamma, torch.zeros(2))        # gamma = 0: the routed value starts as the shared one
    u = torch.randn(1, 2, 3)
    assert torch.equal(e.delta(u), esva_delta(u, e.w1, e.b1, e.w2, e.b2))


# ----------------------------------------------------------------------------- MoLE: construction

def test_mole_init_reads_the_model_and_the_adapter():
    m = _mole(MoLEConfig(n_vis=2, n_sum=1, top_k=1), layers=2, d=4, H=2, Hkv=1, D=3)
    model, ad = m.model, m.adapter
    assert isinstance(ad, _Adapter) and m.proc == "the processor" and m.reduce is None
    assert m.vocab == V and m.latent_ids == [12, 13, 14] and m.tail_ids == TAIL
    # latent rows: init_latents of the table with a generator seeded 0
    want = init_latents(model.embed_tokens, 3, generator=torch.Generator().manual_seed(0))
    assert isinstance(m.latent, nn.Parameter) and torch.equal(m.latent.data, want)
    # a router per layer, E x d without bias; an ESVA per layer of width Hkv * head_dim = 1 * 3 (the config's
    # head_dim, not d / H = 2), hidden = that width
    assert len(m.routers) == 2 and all(r.weight.shape == (2, 4) and r.bias is None for r in m.routers)
    assert len(m.esva) == 2 and m.esva[1].w1.shape == (2, 3, 3) and m.esva[1].w2.shape == (2, 3, 3)
    assert len(m._hooks) == 2
    # the text model switched to "mole", the vision tower kept; the old names kept for remove()
    assert model.impl_calls == [{"text_config": "mole", "vision_config": "sdpa"}]
    assert m._attn_before == {"text_config": "sdpa", "vision_config": "sdpa"}
    # no head_dim in the config: d / H = 2; two key/value heads of 2: width 4; esva_hidden sets the hidden width
    m = _mole(MoLEConfig(n_vis=2, n_sum=0, top_k=1, esva_hidden=5), d=4, H=2, Hkv=2, D=2, head_dim=False,
              vision_impl="eager")
    assert m.esva[0].w1.shape == (2, 4, 5) and m.esva[0].b2.shape == (2, 4) and m.latent_ids == [12, 13]
    assert m.model.impl_calls == [{"text_config": "mole", "vision_config": "eager"}]
    assert m._attn_before == {"text_config": "sdpa", "vision_config": "eager"}
    m = _mole(vision_impl=None)                         # a vision tower without a name: sdpa
    assert m.model.impl_calls == [{"text_config": "mole", "vision_config": "sdpa"}]
    # "w/o router": no routers, no hooks; "w/o ESVA": no adapters
    m = _mole(MoLEConfig(n_vis=2, n_sum=0, top_k=1, router=False, esva=False), layers=2)
    assert m.routers is None and m.esva is None and m._hooks == []


def test_mole_router_init_scale():
    # router weights N(0, 1 / d): d = 256, 4 x 256 draws, sample std within 20 % of 1 / 16 (the uniform
    # nn.Linear default has std 1 / sqrt(3 d) = .036, d^(+1/2) 16)
    m = _mole(MoLEConfig(n_vis=4, n_sum=0, top_k=1, esva=False), d=256, H=2, Hkv=1, D=4)
    assert 0.8 / 16 < m.routers[0].weight.std().item() < 1.2 / 16


def test_mole_init_follows_the_models_device_and_names():
    # MoLE's own parameters move to the device the model reports
    m = _mole(device="meta")
    assert m.latent.device.type == "meta" and m.routers[0].weight.device.type == "meta"
    assert m.esva[0].w1.device.type == "meta"
    # a vision config without an attention name: sdpa
    m = _mole(vision_impl="unset")
    assert m.model.impl_calls == [{"text_config": "mole", "vision_config": "sdpa"}]
    # the repo's VLProcessor (anything with prompt_and_labels) gets a QwenVLAdapter over this model
    proc = SimpleNamespace(prompt_and_labels=None, image_token_id=IMG, pad_token_id=PADID, eos_token_id=EOS,
                           tail_ids=lambda: TAIL)
    torch.manual_seed(0)
    model = _FakeVLM()
    m = MoLE(model, proc, MoLEConfig(n_vis=2, n_sum=1, top_k=1))
    assert m.adapter.model is model and m.proc is proc and m.tail_ids == TAIL


def test_remove_gives_the_model_back():
    m = _mole(layers=2)
    model = m.remove()
    assert model is m.model and m._hooks == []
    assert model.impl_calls[-1] == {"text_config": "sdpa", "vision_config": "sdpa"}
    # the layers no longer route
    st = MoLEPass(m, torch.tensor([[TEXT, VIS]]), torch.tensor([[0, 0]]))
    for layer in model.model.language_model.layers:
        for hook in layer._forward_pre_hooks.values():
            hook(layer, (torch.zeros(1, 2, 4),), {"mole": st})
    assert st.route == {}


def test_compile_hot_compiles_the_two_pure_functions(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: ("compiled", fn, kw))
    m = _mole(layers=2)
    assert m.compile_hot(backend="eager", dynamic=False) is m
    assert m._scores == ("compiled", latent_scores, {"backend": "eager", "dynamic": False})
    assert [e.fn for e in m.esva] == [("compiled", esva_delta, {"backend": "eager", "dynamic": False})] * 2
    m.compile_hot()
    assert m._scores == ("compiled", latent_scores, {"backend": "inductor"})
    assert m.esva[0].fn == ("compiled", esva_delta, {"backend": "inductor"})


# ----------------------------------------------------------------------------- MoLE: inputs

QS, ANS = [[1, IMG, IMG, 2], [IMG, 3]], [[4], [4, 4]]
# latent ids 12, 13 (Z_vis) and 14 (Z_sum) go before the tail [7, 8]; the answer and its end id 9 after it
ROW0 = [1, IMG, IMG, 2, 12, 13, 14, 7, 8, 4, 9]
ROW1 = [IMG, 3, 12, 13, 14, 7, 8, 4, 4, 9]


def test_encode_right_pads_with_answers_and_labels_them():
    m = _mole()
    b = m.encode(["a", "b"], QS, ANS, pixels="px", n_images=[1, 1])
    assert m.adapter.seen == ("px", [1, 1])
    assert b["input_ids"].tolist() == [ROW0, ROW1 + [PADID]]
    assert b["attention_mask"].tolist() == [[1] * 11, [1] * 10 + [0]]
    assert b["labels"].tolist() == [[-100] * 9 + [4, 9], [-100] * 7 + [4, 4, 9, -100]]
    assert b["mm_token_type_ids"].tolist() == [[int(i == IMG) for i in r] for r in b["input_ids"].tolist()]
    assert b["pixel_values"].tolist() == [2]
    # left padding asked for
    b = m.encode(["a", "b"], QS, ANS, padding_side="left")
    assert b["input_ids"].tolist() == [ROW0, [PADID] + ROW1]
    assert b["attention_mask"].tolist() == [[1] * 11, [0] + [1] * 10]
    assert b["labels"].tolist() == [[-100] * 9 + [4, 9], [-100] * 8 + [4, 4, 9]]


def test_encode_left_pads_prompts_without_answers():
    m = _mole()
    b = m.encode(["a", "b"], QS)
    assert m.adapter.seen == (None, None)
    assert b["input_ids"].tolist() == [ROW0[:9], [PADID, PADID] + ROW1[:7]]
    assert b["attention_mask"].tolist() == [[1] * 9, [0, 0] + [1] * 7]
    assert "labels" not in b
    b = m.encode(["a", "b"], QS, padding_side="right")
    assert b["input_ids"].tolist() == [ROW0[:9], ROW1[:7] + [PADID, PADID]]


def test_encode_refuses_a_prompt_without_the_tail():
    m = _mole()
    m.adapter.prompts = lambda images, questions, pixels=None, n_images=None: ([[1, 2, 3]], {})
    with pytest.raises(AssertionError) as e:
        m.encode(["a"], [[1]])
    assert str(e.value) == "prompt does not end with the assistant header"


def test_token_types_and_zvis_positions():
    m = _mole()
    b = m.encode(["a", "b"], QS, ANS)
    T_, Vi, Z, S = TEXT, VIS, ZVIS, ZSUM
    assert m.token_types(b["input_ids"], b["attention_mask"]).tolist() == [
        [T_, Vi, Vi, T_, Z, Z, S, T_, T_, T_, T_],
        [Vi, T_, Z, Z, S, T_, T_, T_, T_, T_, PAD]]
    # the pad id with attention 1 is text; any id under attention 0 is padding
    assert m.token_types(torch.tensor([[PADID, 12]]), torch.tensor([[1, 0]])).tolist() == [[TEXT, PAD]]
    assert m.zvis_positions(b["input_ids"]).tolist() == [[4, 5], [2, 3]]
    # Z_vis e's slot is its own id, wherever it stands
    assert m.zvis_positions(torch.tensor([[13, 1, 12, 14]])).tolist() == [[2, 0]]
    assert m.zvis_positions(b["input_ids"].to("meta")).device.type == "meta"


def test_embed_puts_the_latent_rows_in():
    m = _mole()
    ids = torch.tensor([[1, 12, 13, 14, 3]])
    w, lat = m.model.embed_tokens.weight, m.latent
    out = m.embed(ids)
    assert torch.equal(out[0], torch.stack([w[1], lat[0], lat[1], lat[2], w[3]]))
    # an id past the latent rows reads the last one (the gather index is clamped into the table)
    assert torch.equal(m.embed(torch.tensor([[15, 99]]))[0], torch.stack([lat[2], lat[2]]))
    # the latent rows take the embedding's dtype
    m.model.embed_tokens.to(torch.bfloat16)
    assert m.embed(ids).dtype == torch.bfloat16


def test_positions_are_the_models_own():
    m = _mole()
    b = m.encode(["a", "b"], QS, ANS)
    # no rope index: the cumulative count of real tokens - 1
    assert m.positions(b).tolist() == [list(range(11)), list(range(10)) + [9]]
    # a model with a rope index (M-RoPE) gets the ids (clamped into the table), the token types under the mask
    # and the mask
    m.model.model.get_rope_index = lambda ids, types, image_grid_thw=None, video_grid_thw=None, attention_mask=None: (
        torch.stack([ids, types, attention_mask]), None)
    want = torch.stack([b["input_ids"].clamp(max=V - 1), b["mm_token_type_ids"] * b["attention_mask"],
                        b["attention_mask"]])
    assert torch.equal(m.positions(b), want)


# ----------------------------------------------------------------------------- MoLE: routing hook and forward

def test_route_hook_reads_the_hidden_state_of_its_own_layer():
    m = _mole(layers=2)
    types = torch.tensor([[TEXT, VIS, ZVIS, ZVIS]])
    h = torch.randn(1, 4, 4)
    st = MoLEPass(m, types, torch.tensor([[2, 3]]))
    m._route_hook(1)(None, (h,), {"mole": st})
    m._route_hook(0)(None, (), {"hidden_states": h, "mole": st})
    assert sorted(st.route) == [0, 1] and len(st.balance) == 2
    # routed with each layer's own router: token 1's top-1 expert = argmax of its logits
    for i in (0, 1):
        sel, _ = st.route[i]
        assert sel[0, 1].tolist() == [e == int((m.routers[i].weight @ h[0, 1]).argmax()) for e in range(2)]
    m._route_hook(0)(None, (h,), {})                   # a call without a MoLE pass (plain use of the model) passes


def _route_case(m, dtype=torch.float32):
    """Router = identity on the first two of d = 4 dims. Tokens: text [5, 0] (never routed), visual [ln 3, 0],
    [0, ln 3], [ln 3, 0]: probs [3/4, 1/4], [1/4, 3/4], [3/4, 1/4], top-1 experts 0, 1, 0."""
    with torch.no_grad():
        m.routers[0].weight.zero_()
        m.routers[0].weight[:, :2] = torch.eye(2)
    l3 = math.log(3)
    h = torch.tensor([[[5.0, 0, 0, 0], [l3, 0, 0, 0], [0, l3, 0, 0], [l3, 0, 0, 0]]], dtype=dtype)
    st = MoLEPass(m, torch.tensor([[TEXT, VIS, VIS, VIS]]), torch.zeros(1, 2, dtype=torch.long))
    m.route(0, h, st)
    return st


def test_route_hand_computed():
    m = _mole(MoLEConfig(n_vis=2, n_sum=0, top_k=1, alpha=2.0))
    st = _route_case(m)
    sel, prior = st.route[0]
    assert sel[0].tolist() == [[False, False], [True, False], [False, True], [True, False]]
    # K = 1: rho = 1 for the kept expert, b = alpha log(1 + eps) = 2 log(1.0001) = 1.99990e-4; 0 elsewhere.
    # fp32 rounds 1 + eps by up to 2^-24 (6e-8), which the log passes on and alpha doubles: abs 2.5e-7
    b = pytest.approx(2 * math.log(1 + 1e-4), abs=2.5e-7)
    assert prior[0].tolist() == [[0.0, 0.0], [b, 0.0], [0.0, b], [b, 0.0]]
    assert prior.dtype == torch.float32
    # over the visual tokens only: f = [2/3, 1/3], P = [7/12, 5/12]: E sum f P = 2 (14 + 5) / 36 = 19/18;
    # z = mean logsumexp^2 = (ln 4)^2 (the text token's logsumexp ln(e^5 + 1) is left out)
    assert st.balance[0].item() == pytest.approx(19 / 18, rel=1e-6)
    assert st.z[0].item() == pytest.approx(math.log(4) ** 2, rel=1e-6)
    # bfloat16 hidden states are read in the router's dtype (fp32 weights): the same choices
    st = _route_case(m, torch.bfloat16)
    assert st.route[0][0][0].tolist() == sel[0].tolist()


def _ce(logits, labels):
    """Mean over labelled positions of -log softmax(logits[t])[labels[t + 1]], written out in float64."""
    terms = []
    for i in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            y = int(labels[i, t + 1])
            if y != -100:
                row = logits[i, t].detach().double()
                terms.append(float(torch.logsumexp(row, 0) - row[y]))
    return sum(terms) / len(terms)


def test_forward_hands_the_model_its_inputs_and_returns_the_pass():
    m = _mole(layers=2)
    b = m.encode(["a", "b"], QS, ANS)
    out = m(b, 2)
    call, st = m.model.calls[-1], out["pass"]
    assert torch.equal(call["inputs_embeds"], m.embed(b["input_ids"]))
    assert call["attention_mask"] is b["attention_mask"] and torch.equal(call["position_ids"], out["positions"])
    assert torch.equal(call["mm_token_type_ids"], b["mm_token_type_ids"]) and call["pixel_values"].tolist() == [2]
    assert call["cache"] is None and call["use_cache"] is False and call["output_hidden_states"] is False
    assert call["mole"] is st and st.stage == 2 and st.record is False and st.attn == {}
    assert out["positions"].tolist() == [list(range(11)), list(range(10)) + [9]]
    assert out["types"].tolist() == m.token_types(b["input_ids"], b["attention_mask"]).tolist()
    assert out["types"][1, -1].item() == PAD                         # the mask reaches the token types
    assert st.zpos.tolist() == [[4, 5], [2, 3]] and sorted(st.route) == [0, 1]
    assert "hidden" not in out and torch.equal(out["logits"], m.model.lm_head(m.model.last))
    # a cache to fill, hidden states, recorded attention, stage 1
    cache = object()
    out = m(b, 1, cache=cache, record=True, hidden=True)
    call, st = m.model.calls[-1], out["pass"]
    assert call["cache"] is cache and call["use_cache"] is True and call["output_hidden_states"] is True
    assert st.stage == 1 and sorted(st.attn) == [0, 1] and out["hidden"] is m.model.last
    assert _message(lambda: m(b, 3)) == "stage must be 1 or 2, got 3"


def test_forward_loss_is_ce_plus_the_weighted_aux_losses():
    cfg = MoLEConfig(n_vis=2, n_sum=1, top_k=2, lambda_balance=0.5, lambda_z=0.25, lambda_div=2.0)
    m = _mole(cfg, layers=2)
    with torch.no_grad():
        for e in m.esva:                                             # make the diversity loss non-zero
            e.b2.copy_(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    b = m.encode(["a", "b"], QS, ANS)
    out = m(b, 2)
    st = out["pass"]
    # per layer: one balance, one z and (K = 2, ESVA) one diversity term; the forward takes their means
    assert len(st.balance) == len(st.z) == len(st.div) == 2
    for key in ("balance", "z", "div"):
        terms = getattr(st, key)
        assert out[key].item() == pytest.approx((terms[0].item() + terms[1].item()) / 2, rel=1e-6)
    assert out["div"].item() > 0.1
    assert out["ce"].item() == pytest.approx(_ce(out["logits"], b["labels"]), rel=1e-5)
    want = out["ce"].item() + 0.5 * out["balance"].item() + 0.25 * out["z"].item() + 2.0 * out["div"].item()
    assert out["loss"].item() == pytest.approx(want, rel=1e-6)
    # without labels: no loss
    b.pop("labels")
    out = m(b, 2)
    assert "loss" not in out and "ce" not in out


def test_forward_without_router_has_zero_aux_losses():
    m = _mole(MoLEConfig(n_vis=2, n_sum=1, top_k=1, router=False, esva=False), layers=2)
    out = m(m.encode(["a", "b"], QS, ANS), 2)
    for key in ("balance", "z", "div"):
        assert out[key].dtype == torch.float32 and out[key].shape == () and out[key].item() == 0.0
    assert out["loss"].item() == out["ce"].item()
    # a bfloat16 model: the empty aux losses stay fp32 scalars
    m.model.to(torch.bfloat16)
    out = m(m.encode(["a", "b"], QS, ANS), 2)
    assert out["logits"].dtype == torch.bfloat16
    assert all(out[key].dtype == torch.float32 for key in ("balance", "z", "div"))


# ----------------------------------------------------------------------------- MoLE: aux losses, latent attention paths

def test_aux_losses_use_the_data_parallel_reduce_in_training():
    # a reduce that halves every count (as if the other process had no token): the global token and pair
    # counts halve, so balance (P over half the tokens; f unchanged), z and the diversity loss double
    cfg = MoLEConfig(n_vis=2, n_sum=1, top_k=2)
    m = _mole(cfg, layers=2)
    with torch.no_grad():
        for e in m.esva:
            e.b2.copy_(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    b = m.encode(["a", "b"], QS, ANS)
    m.train()
    plain = m(b, 2)
    m.reduce = lambda t: t.float() / 2
    halved = m(b, 2)
    for key in ("balance", "z", "div"):
        assert halved[key].item() == pytest.approx(2 * plain[key].item(), rel=1e-6)
    assert plain["div"].item() > 0.1
    # outside training the reduce is not used
    m.eval()
    assert m(b, 2)["z"].item() == pytest.approx(plain["z"].item(), rel=1e-6)


def test_latent_attention_variants_without_router_or_with_one_expert_per_token():
    # ESVA without a router (K = 2 kept in the config): no prior, no diversity loss
    m = _mole(MoLEConfig(n_vis=2, n_sum=1, top_k=2, router=False), layers=1)
    out = m(m.encode(["a", "b"], QS, ANS), 2)
    assert out["pass"].div == [] and out["div"].item() == 0.0 and out["pass"].route == {}
    # router and ESVA with K = 1: no pair, so no diversity term is appended
    m = _mole(MoLEConfig(n_vis=2, n_sum=1, top_k=1), layers=1)
    out = m(m.encode(["a", "b"], QS, ANS), 2)
    assert out["pass"].div == [] and len(out["pass"].balance) == 1


def test_latent_attention_routed_value_in_bfloat16():
    # E = 1, tokens [text, visual, Z_vis]; zero queries and keys: the Z_vis row spreads 1/3 over text, its routed
    # visual token and itself. Values 0, MLP_0(u) = b2 = 1 (w2 = 0), gamma = 1 + 2^-10, which bfloat16 rounds
    # to 1 (8 significant bits): output = gamma * 1 / 3 = 1/3 in bfloat16 arithmetic (gamma cast to the
    # activations' dtype), 0.333659 had gamma stayed fp32
    m = _mole(MoLEConfig(n_vis=1, n_sum=0, top_k=1), d=4, H=1, Hkv=1, D=2)
    esva = m.esva[0]
    with torch.no_grad():
        esva.w2.zero_()
        esva.b2.fill_(1.0)
        esva.gamma.fill_(1 + 2 ** -10)
    types = torch.tensor([[TEXT, VIS, ZVIS]])
    st = MoLEPass(m, types, torch.tensor([[2]]))
    st.route[0] = (torch.tensor([[[False], [True], [False]]]), torch.zeros(1, 3, 1))
    q = torch.zeros(1, 1, 3, 2, dtype=torch.bfloat16)
    v = torch.zeros(1, 1, 3, 2, dtype=torch.bfloat16)
    out = m.latent_attention(0, q, q, v, topology_mask(types, 2, m.cfg), 1.0, st)
    assert out.shape == (1, 1, 1, 2)
    assert out[0, 0, 0].tolist() == pytest.approx([1 / 3, 1 / 3], abs=1e-6)
    # in fp32 gamma stays 1 + 2^-10
    out = m.latent_attention(0, q.float(), q.float(), v.float(), topology_mask(types, 2, m.cfg), 1.0, st)
    assert out[0, 0, 0].tolist() == pytest.approx([(1 + 2 ** -10) / 3] * 2, abs=1e-6)
