"""Fast hand-checked cases for the rest of mod/model.py (everything but the routing equations, which
tests/test_mod_mutants.py pins): the config, the model pre-hook, the decoder-stack lookup, attach /
unload / compile, the base identity, atomic files, save / load in both formats. No VLM is built: a
toy module of a few nn.Linear layers named like a VLM's stands in (`ToyVLM`), so each case runs in
milliseconds (`python -m eval.tools.mutation --target mod/model.py` reruns them for every mutant)."""
import builtins
import hashlib
import json
import os
import stat
import struct
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from mod import model as mm
from mod.model import (AdapterConfig, MoDLinear, RoutingContext, adapter_layers, adapter_state_dict, attach,
                       aux_loss, base_identity, identity_mismatch, is_peft, load_adapters, load_config, load_peft,
                       num_trainable, routing_context, save_adapters, save_peft, text_model, unload,
                       weights_fingerprint)


# ----------------------------------------------------------------------------- a toy VLM without transformers

class ToyConfig:
    """What mod/model.py reads of a transformers config: model_type, _name_or_path and the text config."""

    def __init__(self, hidden=4, layers=2, vocab=5, name="toy/base", model_type="toy_vlm"):
        self.hidden_size, self.num_hidden_layers, self.vocab_size = hidden, layers, vocab
        self._name_or_path, self.model_type = name, model_type

    def get_text_config(self):
        return self


class Attn(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(h, h), nn.Linear(h, 2, bias=False),
                                                              nn.Linear(h, h), nn.Linear(h, h))


class Layer(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.self_attn = Attn(h)


class Stack(nn.Module):
    def __init__(self, h, n, vocab):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Layer(h) for _ in range(n))


class Inner(nn.Module):
    def __init__(self, h, n, vocab):
        super().__init__()
        self.visual = nn.Module()
        self.visual.q_proj = nn.Linear(h, h)           # a vision-tower projection: never wrapped
        self.language_model = Stack(h, n, vocab)


class ToyVLM(nn.Module):
    """model.model.language_model.layers[i].self_attn.{q,k,v,o}_proj, as Qwen-VL lays them out."""

    def __init__(self, h=4, n=2, vocab=5, seed=0, name="toy/base"):
        super().__init__()
        torch.manual_seed(seed)
        self.model = Inner(h, n, vocab)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.config = ToyConfig(h, n, vocab, name)

    def get_input_embeddings(self):
        return self.model.language_model.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, past_key_values=None):
        h = self.get_input_embeddings()(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.model.language_model.layers:
            a = layer.self_attn
            h = h + a.o_proj(a.q_proj(h) + a.v_proj(h))
        return self.lm_head(h)


class ToyLM(nn.Module):
    """A bare decoder stack (`layers` on the model itself): text_model is the model, prefix ''."""

    def __init__(self, h=4, n=1, vocab=5, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Layer(h) for _ in range(n))
        self.config = ToyConfig(h, n, vocab, "toy/lm", "toy_lm")

    def get_input_embeddings(self):
        return self.embed_tokens


def fill(model, std=0.5, seed=3):
    """Non-zero adapter weights (B starts at zero), reproducible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * std)


# ----------------------------------------------------------------------------- AdapterConfig

def test_config_defaults_and_target_modules_string():
    c = AdapterConfig()
    assert (c.method, c.target_modules, c.r, c.lora_alpha, c.num_experts, c.experts_pattern, c.expert_rank, c.window,
            c.granularity, c.combine, c.shared_router, c.noise_std, c.router_init_std, c.aux_coef) == (
        "mod", ["q_proj", "k_proj", "v_proj", "o_proj"], 4, 8.0, 8, {}, 1, 16, "window", "sqrt_product", False,
        0.0, 0.02, 0.01)
    assert AdapterConfig(target_modules=" q_proj, ,v_proj ,").target_modules == ["q_proj", "v_proj"]
    # the default granularity: window for mod and lora, token for moelora; an explicit one is kept
    assert AdapterConfig(method="lora").granularity == "window"
    assert AdapterConfig(method="moelora").granularity == "token"
    assert AdapterConfig(method="moelora", granularity="window").granularity == "window"
    assert AdapterConfig(granularity="region").granularity == "region"
    # route_window: 1 for token routing, W otherwise
    assert AdapterConfig(window=5).route_window == 5
    assert AdapterConfig(window=5, granularity="region").route_window == 5
    assert AdapterConfig(window=5, granularity="token").route_window == 1


def _msg(exc):
    return str(exc.value)


def test_config_refusals_name_the_problem():
    def refused(**kw):
        with pytest.raises(ValueError) as e:
            AdapterConfig(**kw)
        return _msg(e)
    for kw, msg in [(dict(method="mlp"), "method must be one of ('mod', 'lora', 'moelora')"),
                    (dict(granularity="block"), "granularity must be one of ('token', 'region', 'window')"),
                    (dict(combine="max"), "combine must be one of ('sqrt_product', 'product', 'mean')"),
                    (dict(r=0), "r, window, expert_rank must be >= 1"),
                    (dict(window=0), "r, window, expert_rank must be >= 1"),
                    (dict(expert_rank=0), "r, window, expert_rank must be >= 1"),
                    (dict(r=9, num_experts=8), "top-r must not exceed num_experts"),
                    (dict(method="lora", experts_pattern={"o_proj": 10}),
                     "experts_pattern is for mod / moelora pools")]:
        got = refused(**kw)
        assert got.startswith(f"AdapterConfig: {msg} (got AdapterConfig(method="), (kw, got)
        assert got.endswith("aux_coef=0.01))"), got
    # the bounds themselves are allowed: r = 1, window = 1, expert_rank = 1, r = num_experts; lora ignores E
    AdapterConfig(r=1, window=1, expert_rank=1)
    AdapterConfig(r=8, num_experts=8)
    AdapterConfig(method="lora", r=16, num_experts=8)
    # experts_pattern: keys must be target modules, counts integers >= r
    assert refused(experts_pattern={"up_proj": 10}) == (
        "experts_pattern (--experts-pattern) names ['up_proj'], which are not target_modules "
        "['q_proj', 'k_proj', 'v_proj', 'o_proj']; use those names (e.g. o_proj=10)")
    assert refused(experts_pattern={"o_proj": 3}) == (
        "experts_pattern (--experts-pattern) gives {'o_proj': 3}: each count must be an integer >= top-r (4, --r)")
    assert refused(experts_pattern={"o_proj": 6.0}) == (
        "experts_pattern (--experts-pattern) gives {'o_proj': 6.0}: each count must be an integer >= top-r (4, --r)")
    assert AdapterConfig(experts_pattern={"o_proj": 4}).experts_pattern == {"o_proj": 4}    # = r is allowed
    assert AdapterConfig(method="moelora", experts_pattern={"o_proj": 4}).experts_pattern == {"o_proj": 4}


def test_layer_config_takes_the_longest_matching_suffix():
    c = AdapterConfig(target_modules=["o_proj", "self_attn.o_proj", "q_proj"], num_experts=6,
                      experts_pattern={"o_proj": 10, "self_attn.o_proj": 12})
    got = c.layer_config("model.layers.0.self_attn.o_proj")
    assert (got.num_experts, got.experts_pattern, got.r, got.target_modules) == (12, {}, 4, c.target_modules)
    got = c.layer_config("model.layers.0.mlp.o_proj")          # only "o_proj" matches
    assert (got.num_experts, got.experts_pattern) == (10, {})
    assert c.layer_config("model.layers.0.self_attn.q_proj") is c   # no match: the config itself
    assert c.layer_config("model.layers.0.self_attn.xo_proj") is c  # a suffix matches at a dot only
    assert c.experts_pattern == {"o_proj": 10, "self_attn.o_proj": 12}   # not changed in place
    # the longest suffix, not the largest string ("o_proj" > "attn.o_proj")
    c = AdapterConfig(target_modules=["o_proj", "attn.o_proj"], experts_pattern={"o_proj": 10, "attn.o_proj": 12})
    assert c.layer_config("layers.0.attn.o_proj").num_experts == 12


# ----------------------------------------------------------------------------- the model pre-hook

class Past:
    def __init__(self, n):
        self.n = n

    def get_seq_length(self):
        return self.n


def _hook(args=(), **kwargs):
    ctx = RoutingContext()
    ctx.aux = [torch.ones(())]                     # the previous forward's losses: reset by the hook
    mm._model_pre_hook(ctx)(None, args, kwargs)
    assert ctx.aux == []
    return ctx


def test_model_pre_hook_reads_mask_length_and_cache():
    ids = torch.zeros(2, 3, dtype=torch.long)
    m = torch.tensor([[0, 1, 1], [1, 1, 1]])
    # a first call: the mask as bool, not continuing
    ctx = _hook(input_ids=ids, attention_mask=m)
    assert ctx.mask.dtype == torch.bool and ctx.mask.tolist() == [[False, True, True], [True, True, True]]
    assert ctx.continuing is False
    # ids passed positionally, one new token with a 3-column mask: 2 earlier tokens -> continuing, last column
    ctx = _hook((ids[:, :1],), attention_mask=m)
    assert ctx.continuing is True and ctx.mask.tolist() == [[True], [True]]
    # inputs_embeds instead of ids (ids None): T = 2 from the embeddings; a 2-column mask -> not continuing
    ctx = _hook(input_ids=None, inputs_embeds=torch.zeros(1, 2, 4), attention_mask=torch.tensor([[1, 0]]))
    assert ctx.continuing is False and ctx.mask.tolist() == [[True, False]]
    ctx = _hook(inputs_embeds=torch.zeros(1, 1, 4), attention_mask=torch.tensor([[1, 0]]))
    assert ctx.continuing is True and ctx.mask.tolist() == [[False]]
    # no mask: the cache length alone decides; `cache` is read before `past_key_values`
    ctx = _hook(input_ids=ids, past_key_values=Past(3))
    assert ctx.mask is None and ctx.continuing is True
    ctx = _hook(input_ids=ids, cache=Past(2))
    assert ctx.mask is None and ctx.continuing is True
    assert _hook(input_ids=ids, cache=Past(0), past_key_values=Past(5)).continuing is False
    assert _hook(input_ids=ids, past_key_values=Past(0)).continuing is False
    assert _hook(input_ids=ids, past_key_values=object()).continuing is False   # no get_seq_length: 0
    # a cache with a mask as wide as the tokens: the cache length counts
    ctx = _hook(input_ids=ids, attention_mask=m, past_key_values=Past(4))
    assert ctx.continuing is True and ctx.mask.shape == (2, 3)
    # a 4-D custom mask carries no padding we can use: None, the cache still decides
    ctx = _hook(input_ids=ids, attention_mask=torch.ones(2, 1, 3, 3), past_key_values=Past(1))
    assert ctx.mask is None and ctx.continuing is True
    ctx = _hook(input_ids=ids, attention_mask=torch.ones(2, 1, 3, 5))
    assert ctx.mask is None and ctx.continuing is False


# ----------------------------------------------------------------------------- text_model

def _holder(**children):
    m = nn.Module()
    for k, v in children.items():
        setattr(m, k, v)
    return m


def _stack():
    return _holder(layers=nn.ModuleList([nn.Linear(1, 1)]))


def test_text_model_lookup_order():
    a, b, c, d = _stack(), _stack(), _stack(), _stack()
    # model.model.language_model first, then model.model.text_model, model.language_model, model.text_model,
    # model.model, the model itself; each may wrap its stack in `.model`
    m = _holder(model=_holder(language_model=a, text_model=b, layers=nn.ModuleList()), language_model=c)
    m.layers = nn.ModuleList()
    assert text_model(m) is a
    assert text_model(_holder(model=_holder(text_model=b), language_model=c)) is b
    assert text_model(_holder(model=_holder(language_model=_holder(model=a)))) is a
    assert text_model(_holder(model=_holder(text_model=_holder(model=b)))) is b
    assert text_model(_holder(language_model=c, text_model=d)) is c
    assert text_model(_holder(language_model=_holder(model=c))) is c
    assert text_model(_holder(text_model=d, model=_holder(layers=nn.ModuleList()))) is d
    assert text_model(_holder(text_model=_holder(model=d))) is d
    causal = _holder(model=a)
    assert text_model(causal) is a
    inner = _holder(layers=nn.ModuleList())
    assert text_model(_holder(model=inner)) is inner
    bare = _stack()
    assert text_model(bare) is bare
    # `layers` must be an nn.ModuleList: a plain list is skipped
    fake = _holder(model=_holder(language_model=nn.Module()), language_model=c)
    fake.model.language_model.layers = [nn.Linear(1, 1)]
    assert text_model(fake) is c


def test_text_model_refusal_names_the_class():
    class Odd(nn.Module):
        pass
    with pytest.raises(ValueError) as e:
        text_model(Odd())
    assert _msg(e) == ("Odd: no decoder stack found (looked for model.language_model, model.text_model, "
                       "language_model, model with a `layers` ModuleList); this family is not supported")


# ----------------------------------------------------------------------------- attach / unload / utilities

def test_attach_wraps_language_model_targets_only_and_freezes_the_rest():
    model = ToyVLM()
    cfg = AdapterConfig(target_modules=["q_proj", "v_proj"], num_experts=4, r=2, experts_pattern={"v_proj": 5})
    names = attach(model, cfg)
    assert names == ["layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj",
                     "layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"]
    lm = model.model.language_model
    layers = adapter_layers(model)
    assert [n for n, _ in layers] == ["model.language_model." + n for n in names]
    assert [m.name for _, m in layers] == names
    assert [m.cfg.num_experts for _, m in layers] == [4, 5, 4, 5]          # layer_config per name
    assert isinstance(lm.layers[0].self_attn.q_proj, MoDLinear) and isinstance(model.model.visual.q_proj, nn.Linear)
    assert isinstance(lm.layers[1].self_attn.o_proj, nn.Linear) and not isinstance(lm.layers[1].self_attn.o_proj,
                                                                                    MoDLinear)
    ctx = routing_context(model)
    assert isinstance(ctx, RoutingContext) and all(m.ctx is ctx for _, m in layers)
    assert model._adapter["config"] is cfg and model._adapter["names"] == names and model._adapter["ctx"] is ctx
    # only the adapter tensors train: 4 per layer (A, B, router_A, router_B), every base weight frozen
    trainable = sorted(adapter_state_dict(model))
    assert len(trainable) == 16 and all(k.rsplit(".", 1)[1] in ("A", "B", "router_A", "router_B") for k in trainable)
    assert not model.lm_head.weight.requires_grad and not model.model.visual.q_proj.weight.requires_grad
    assert not lm.layers[0].self_attn.q_proj.base_layer.weight.requires_grad
    # E = 4 (q) and 5 (v), in = out = 4: (3 * E * 4 + E * 4) per layer
    assert num_trainable(model) == 2 * (16 * 4 + 16 * 5)
    # the pre-hook fills the shared context from the model call
    model(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[0, 1, 1]]))
    assert ctx.mask.tolist() == [[False, True, True]] and ctx.continuing is False
    with pytest.raises(ValueError) as e:
        attach(model, cfg)
    assert _msg(e) == "adapters already attached to this model"


def test_attach_refuses_unknown_targets_and_lists_the_available_ones():
    model = ToyVLM()
    with pytest.raises(ValueError) as e:
        attach(model, AdapterConfig(target_modules=["gate_proj"]))
    assert _msg(e) == ("target_modules ['gate_proj'] match no nn.Linear of the language model; available suffixes: "
                       "['k_proj', 'o_proj', 'q_proj', 'v_proj']")
    assert getattr(model, "_adapter", None) is None and model.lm_head.weight.requires_grad   # nothing changed
    # a bare stack (text_model is the model): full names without a prefix
    lm = ToyLM()
    assert attach(lm, AdapterConfig(target_modules=["layers.0.self_attn.k_proj"], method="lora", r=2)) == [
        "layers.0.self_attn.k_proj"]
    assert isinstance(lm.layers[0].self_attn.k_proj, MoDLinear)


def test_unload_gives_back_the_base_layers():
    model = ToyVLM()
    base = {n: p.clone() for n, p in model.named_parameters()}
    q0 = model.model.language_model.layers[0].self_attn.q_proj
    cfg = AdapterConfig(target_modules=["q_proj", "o_proj"], method="lora", r=2)
    attach(model, cfg)
    x = torch.tensor([[1, 4]])
    assert unload(model) is cfg
    assert model.model.language_model.layers[0].self_attn.q_proj is q0
    assert model._adapter is None and not adapter_layers(model)
    assert {n for n, _ in model.named_parameters()} == set(base)
    assert all(torch.equal(p, base[n]) and not p.requires_grad for n, p in model.named_parameters())
    assert not model._forward_pre_hooks                    # the routing pre-hook is gone
    with pytest.raises(ValueError) as e:
        unload(model)
    assert _msg(e) == "no adapters attached to this model"
    lm = ToyLM()                                          # prefix '' (the model is its own stack)
    attach(lm, AdapterConfig(target_modules=["q_proj"], method="lora", r=2))
    unload(lm)
    assert type(lm.layers[0].self_attn.q_proj) is nn.Linear
    assert model(input_ids=x).shape == (1, 2, 5)


def test_aux_loss_is_the_mean_of_the_layers_losses():
    model = ToyVLM()
    attach(model, AdapterConfig(target_modules=["q_proj"], method="lora", r=2))
    z = aux_loss(model)
    assert z.shape == () and z.item() == 0.0 and z.device.type == "cpu"
    routing_context(model).aux = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(6.0)]
    assert aux_loss(model).item() == 3.0
    meta = ToyVLM().to("meta")
    attach(meta, AdapterConfig(target_modules=["q_proj"], method="lora", r=2))
    assert aux_loss(meta).device.type == "meta"


def test_compile_adapters_wraps_the_hot_paths(monkeypatch):
    calls = []

    def fake_compile(fn, backend=None, **kw):
        calls.append((fn, backend, kw))
        return ("compiled", fn)
    monkeypatch.setattr(torch, "compile", fake_compile)
    # dynamo's config stands in as a namespace: `recompile_limit` (torch >= 2.7) or `cache_size_limit` (older)
    cfg = SimpleNamespace(recompile_limit=3)
    monkeypatch.setattr(torch, "_dynamo", SimpleNamespace(config=cfg), raising=False)
    model = ToyVLM()
    # two kinds of layer: (4, 4, bias) for q/v/o and (4, 2, no bias) for k
    attach(model, AdapterConfig(target_modules=["q_proj", "k_proj"], num_experts=2, r=2))
    assert mm.compile_adapters(model, backend="eager", dynamic=True) == 4
    assert vars(cfg) == {"recompile_limit": 32}                   # 16 per kind
    layers = [m for _, m in adapter_layers(model)]
    assert len(calls) == 8
    for (fn, backend, kw), (m, name) in zip(calls, [(m, n) for m in layers for n in ("_adapter_full", "_decode")]):
        assert fn.__self__ is m and fn.__func__ is getattr(MoDLinear, name)
        assert backend == "eager" and kw == {"dynamic": True}
        assert m.__dict__[name] == ("compiled", fn)
    # a limit already higher stays; the older field name; lora compiles `_adapter` only, with inductor by default
    cfg = SimpleNamespace(cache_size_limit=100)
    monkeypatch.setattr(torch, "_dynamo", SimpleNamespace(config=cfg), raising=False)
    calls.clear()
    lora = ToyVLM()
    attach(lora, AdapterConfig(target_modules=["q_proj"], method="lora", r=2))
    assert mm.compile_adapters(lora) == 2 and vars(cfg) == {"cache_size_limit": 100}
    assert [(c[0].__func__, c[1], c[2]) for c in calls] == [(MoDLinear._adapter, "inductor", {})] * 2
    cfg = SimpleNamespace(cache_size_limit=2)
    monkeypatch.setattr(torch, "_dynamo", SimpleNamespace(config=cfg), raising=False)
    mm.compile_adapters(model)
    assert vars(cfg) == {"cache_size_limit": 32}


# ----------------------------------------------------------------------------- base identity

def test_weights_fingerprint_by_hand():
    model = ToyLM(h=2, vocab=3)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.tensor([[1.001, -2.0], [0.5, 3.0], [0.25, -0.75]]))

    def want(values):   # bf16 rounding (1.001 -> 1.0), then the fp32 bytes
        return "sha256 " + hashlib.sha256(struct.pack(f"<{len(values)}f", *values)).hexdigest()[:16]
    assert weights_fingerprint(model) == want([1.0, -2.0, 0.5, 3.0, 0.25, -0.75])   # 6 values <= 4096: all
    assert weights_fingerprint(model, n=2) == want([1.0, 3.0])                      # stride 6 // 2 = 3
    assert weights_fingerprint(model, n=4) == want([1.0, -2.0, 0.5, 3.0])            # stride 1, first 4
    assert weights_fingerprint(model, n=5) == want([1.0, -2.0, 0.5, 3.0, 0.25])


def test_base_identity_and_mismatch():
    model = ToyVLM()
    ident = base_identity(model)
    assert ident == {"model_type": "toy_vlm", "hidden_size": 4, "num_hidden_layers": 2, "vocab_size": 5,
                     "weights": weights_fingerprint(model), "name_or_path": "toy/base"}
    model.config._name_or_path = None
    assert base_identity(model)["name_or_path"] == ""
    del model.config._name_or_path
    assert base_identity(model)["name_or_path"] == ""
    same = dict(ident, name_or_path="elsewhere")
    assert identity_mismatch(ident, same) == []
    assert identity_mismatch(ident, dict(ident, hidden_size=8, vocab_size=7)) == ["hidden_size 4 vs 8",
                                                                               "vocab_size 5 vs 7"]
    assert identity_mismatch(ident, dict(ident, model_type="x", weights="sha256 0")) == ["model_type 'toy_vlm' vs 'x'"]
    assert identity_mismatch(ident, dict(ident, weights="sha256 0")) == [
        f"same architecture and size, but the weights differ: embedding {ident['weights']} vs sha256 0"]
    old = {k: v for k, v in ident.items() if k != "weights"}          # saved before the weights were recorded
    assert identity_mismatch(old, dict(ident, weights="sha256 0")) == []
    assert identity_mismatch({"vocab_size": 5}, {}) == ["vocab_size 5 vs None"]


# ----------------------------------------------------------------------------- atomic files

def test_atomic_write_mode_rename_and_cleanup(tmp_path):
    path = str(tmp_path / "sub" / "f.txt")
    seen = []

    def write(tmp):
        seen.append(tmp)
        with open(tmp, "w") as f:
            f.write("new")
    old = os.umask(0o027)
    try:
        mm._atomic_write(path, write)                               # the parent directory is made
        assert os.umask(0o027) == 0o027                             # the umask is put back
    finally:
        os.umask(old)
    assert open(path).read() == "new" and stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert seen == [f"{path}.tmp{os.getpid()}"] and os.listdir(tmp_path / "sub") == ["f.txt"]

    def broken(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        mm._atomic_write(path, broken)
    assert open(path).read() == "new" and os.listdir(tmp_path / "sub") == ["f.txt"]

    def nothing(tmp):                                           # a failure before the temp file exists
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        mm._atomic_write(path, nothing)
    mm._write_text(str(tmp_path / "t.json"), "é{}")
    assert (tmp_path / "t.json").read_bytes() == "é{}".encode("utf-8")
    a = torch.arange(6.0).reshape(2, 3)
    mm._save_tensors({"a": a.T, "b": torch.ones(2, requires_grad=True)}, str(tmp_path / "w.safetensors"))
    got = load_file(str(tmp_path / "w.safetensors"))
    assert torch.equal(got["a"], a.T) and torch.equal(got["b"], torch.ones(2)) and sorted(got) == ["a", "b"]
    assert stat.S_IMODE(os.stat(tmp_path / "w.safetensors").st_mode) == 0o666 & ~old


# ----------------------------------------------------------------------------- save / load (our format)

def _trained(method="mod", **kw):
    model = ToyVLM()
    cfg = AdapterConfig(method=method, target_modules=["q_proj", "v_proj"], num_experts=3, r=2, **kw)
    attach(model, cfg)
    fill(model)
    return model, cfg


def test_save_adapters_writes_config_identity_and_fp32_tensors(tmp_path):
    model, cfg = _trained()
    model.to(torch.bfloat16)
    d = tmp_path / "a" / "b"
    save_adapters(model, str(d))
    assert sorted(os.listdir(d)) == ["adapter_config.json", "adapter_model.safetensors"]
    meta = json.loads((d / "adapter_config.json").read_text())
    assert meta == {**{k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "base_model": base_identity(model)}
    st = load_file(str(d / "adapter_model.safetensors"))
    want = adapter_state_dict(model)
    assert sorted(st) == sorted(want) and len(st) == 16
    assert all(v.dtype == torch.float32 and torch.equal(v, want[k].float()) for k, v in st.items())
    assert (d / "adapter_config.json").read_text() == json.dumps(meta, indent=2)


def test_load_config_round_trip_and_refusals(tmp_path):
    model, cfg = _trained(shared_router=True, combine="mean")
    d = tmp_path / "a"
    save_adapters(model, str(d))
    got, base = load_config(str(d))
    assert got == cfg and base == base_identity(model)
    f = d / "adapter_config.json"
    meta = json.loads(f.read_text())
    with pytest.raises(FileNotFoundError) as e:
        load_config(str(tmp_path / "none"))
    assert _msg(e) == f"{tmp_path / 'none'}: no adapter_config.json (not an adapter directory written by mod.train)"
    f.write_text(json.dumps({k: v for k, v in meta.items() if k != "base_model"}))
    with pytest.raises(ValueError) as e:
        load_config(str(d))
    assert _msg(e) == f"{f} records no base_model (not written by mod.train / save_adapters)"
    f.write_text("{")
    with pytest.raises(ValueError) as e:
        load_config(str(d))
    assert _msg(e).startswith(f"{f} is not a valid adapter config (Expecting property name")
    f.write_text(json.dumps(dict(meta, rank=3)))
    with pytest.raises(ValueError) as e:
        load_config(str(d))
    assert _msg(e).startswith(f"{f} is not a valid adapter config (") and "'rank'" in _msg(e)


@pytest.mark.parametrize("method", ["mod", "moelora", "lora"])
def test_load_adapters_round_trip(tmp_path, method):
    model, cfg = _trained(method)
    d = str(tmp_path / "a")
    save_adapters(model, d)
    fresh = ToyVLM()
    assert load_adapters(fresh, d) == cfg
    assert fresh._adapter["config"] == cfg
    want, got = adapter_state_dict(model), adapter_state_dict(fresh)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    ids = torch.tensor([[1, 2, 3, 4]])
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids), model(input_ids=ids))


def test_load_adapters_refusals_name_the_file(tmp_path):
    model, cfg = _trained()
    d = tmp_path / "a"
    save_adapters(model, str(d))
    other = ToyVLM(seed=1, name="toy/other")
    with pytest.raises(ValueError) as e:
        load_adapters(other, str(d))
    ident, now = base_identity(model), base_identity(other)
    assert _msg(e) == (f"{d}: adapters were trained on base toy/base and do not fit base toy/other (same architecture "
                       f"and size, but the weights differ: embedding {ident['weights']} vs {now['weights']})")
    nameless = ToyVLM(h=6, name="")
    with pytest.raises(ValueError) as e:
        load_adapters(nameless, str(d))
    assert _msg(e).startswith(f"{d}: adapters were trained on base toy/base and do not fit base ? (hidden_size 4 vs 6")
    assert getattr(nameless, "_adapter", None) is None
    w = d / "adapter_model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[:40])
    with pytest.raises(ValueError) as e:
        load_adapters(ToyVLM(), str(d))
    assert _msg(e).startswith(f"{w} is unreadable (") and _msg(e).endswith("); the file is incomplete or corrupt")
    w.unlink()
    with pytest.raises(FileNotFoundError) as e:
        load_adapters(ToyVLM(), str(d))
    assert _msg(e) == f"{d}: no adapter_model.safetensors"
    # tensors that do not fit: a missing one, an unexpected one, a shape
    st = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    k0 = "model.language_model.layers.0.self_attn.q_proj.A"
    save_file({k: v for k, v in st.items() if k != k0}, str(w))
    with pytest.raises(ValueError) as e:
        load_adapters(ToyVLM(), str(d))
    assert _msg(e) == f"{d} does not fit this base model: missing ['{k0}'], unexpected []"
    save_file(dict(st, extra=torch.zeros(1)), str(w))
    with pytest.raises(ValueError) as e:
        load_adapters(ToyVLM(), str(d))
    assert _msg(e) == f"{d} does not fit this base model: missing [], unexpected ['extra']"
    save_file(dict(st, **{k0: torch.zeros(3, 5)}), str(w))
    with pytest.raises(ValueError) as e:
        load_adapters(ToyVLM(), str(d))
    assert _msg(e) == f"{d}: {k0} has shape (3, 5), model expects (3, 4)"


# ----------------------------------------------------------------------------- peft's format

def _lora(model=None, targets=("q_proj", "v_proj")):
    model = model or ToyVLM()
    attach(model, AdapterConfig(method="lora", r=2, lora_alpha=6.0, target_modules=list(targets)))
    fill(model)
    return model


def test_save_peft_names_and_config(tmp_path):
    model = _lora()
    d = tmp_path / "p"
    save_peft(model, str(d))
    mods = [f"model.language_model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]
    meta = json.loads((d / "adapter_config.json").read_text())
    assert meta == {"peft_type": "LORA", "task_type": None, "r": 2, "lora_alpha": 6.0, "lora_dropout": 0.0,
                    "target_modules": mods, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
                    "use_dora": False, "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
                    "base_model_name_or_path": "toy/base"}
    assert (d / "adapter_config.json").read_text() == json.dumps(meta, indent=2)
    st = load_file(str(d / "adapter_model.safetensors"))
    ours = adapter_state_dict(model)
    assert sorted(st) == sorted(f"base_model.model.{k}.weight" for k in ours)
    assert all(torch.equal(st[f"base_model.model.{k}.weight"], v) for k, v in ours.items())
    assert st[f"base_model.model.{mods[0]}.lora_A.weight"].shape == (2, 4)
    assert is_peft(str(d))
    mod = ToyVLM()
    attach(mod, AdapterConfig(target_modules=["q_proj"], num_experts=2, r=2))
    with pytest.raises(ValueError) as e:
        save_peft(mod, str(tmp_path / "x"))
    assert _msg(e) == "peft's format holds plain LoRA only; these adapters are 'mod' (save them with save_adapters)"
    assert not (tmp_path / "x").exists()


def test_is_peft(tmp_path):
    assert not is_peft(str(tmp_path / "none"))               # no file
    (tmp_path / "adapter_config.json").write_text("{")
    assert not is_peft(str(tmp_path))                        # not JSON
    (tmp_path / "adapter_config.json").write_text(json.dumps({"method": "lora"}))
    assert not is_peft(str(tmp_path))                        # ours
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    assert is_peft(str(tmp_path))


def test_load_peft_round_trip_and_dispatch(tmp_path):
    model = _lora()
    d = str(tmp_path / "p")
    save_peft(model, d)
    fresh = ToyVLM()
    cfg = load_adapters(fresh, d)                            # dispatches on peft_type
    assert (cfg.method, cfg.r, cfg.lora_alpha, cfg.target_modules) == (
        "lora", 2, 6.0, [f"layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")])
    assert type(cfg.r) is int and type(cfg.lora_alpha) is float
    want, got = adapter_state_dict(model), adapter_state_dict(fresh)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    # a bare stack: no prefix to cut
    lm = _lora(ToyLM(), targets=("q_proj",))
    save_peft(lm, str(tmp_path / "lm"))
    fresh = ToyLM()
    cfg = load_peft(fresh, str(tmp_path / "lm"))
    assert cfg.target_modules == ["layers.0.self_attn.q_proj"]
    assert torch.equal(fresh.layers[0].self_attn.q_proj.lora_A, lm.layers[0].self_attn.q_proj.lora_A)


def _peft_dir(tmp_path, name, cfg_over=None, tensors=None):
    model = _lora()
    d = tmp_path / name
    save_peft(model, str(d))
    if cfg_over is not None:
        meta = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({k: v for k, v in {**meta, **cfg_over}.items()
                                                           if v != "DROP"}))
    if tensors is not None:
        st = load_file(str(d / "adapter_model.safetensors"))
        save_file(tensors(st), str(d / "adapter_model.safetensors"))
    return str(d)


def _load_peft_error(d, model=None):
    with pytest.raises(ValueError) as e:
        load_peft(model or ToyVLM(), d)
    return _msg(e)


def test_load_peft_refusals(tmp_path):
    d = _peft_dir(tmp_path, "t", {"peft_type": "IA3"})
    assert _load_peft_error(d) == f"{d}: peft_type 'IA3'; only LORA maps to the LoRA baseline"
    for i, (k, v) in enumerate([("use_rslora", True), ("use_dora", True), ("bias", "all"), ("fan_in_fan_out", True),
                                ("modules_to_save", ["lm_head"]), ("rank_pattern", {"q_proj": 4}),
                                ("alpha_pattern", {"q_proj": 4}), ("target_parameters", ["mlp.experts.w"])]):
        d = _peft_dir(tmp_path, f"u{i}", {k: v})
        assert _load_peft_error(d) == f"{d}: peft options the LoRA baseline does not implement: {({k: v})}"
    # the defaults peft writes, or the keys left out, are plain LoRA
    d = _peft_dir(tmp_path, "ok", {"use_rslora": None, "bias": None, "rank_pattern": {}, "alpha_pattern": None,
                                   "target_parameters": [], "modules_to_save": None, "use_dora": "DROP",
                                   "fan_in_fan_out": "DROP"})
    assert load_peft(ToyVLM(), d).method == "lora"
    pre = "base_model.model.model.language_model.layers.0.self_attn"
    d = _peft_dir(tmp_path, "n1", tensors=lambda st: dict(st, **{f"{pre}.q_proj.lora_C.weight": torch.zeros(1)}))
    assert _load_peft_error(d) == (f"{d}: unexpected tensor {pre}.q_proj.lora_C.weight (want "
                                   f"base_model.model.<module>.lora_A/B.weight)")
    d = _peft_dir(tmp_path, "n2", tensors=lambda st: dict(st, **{"model.x.lora_A.weight": torch.zeros(1)}))
    assert _load_peft_error(d) == f"{d}: unexpected tensor model.x.lora_A.weight (want base_model.model.<module>." \
                                  f"lora_A/B.weight)"
    # modules outside the language model, or not in this base
    d = _peft_dir(tmp_path, "o1", tensors=lambda st: {"base_model.model.model.visual.q_proj.lora_A.weight":
                                                      torch.zeros(2, 4),
                                                      "base_model.model.model.visual.q_proj.lora_B.weight":
                                                      torch.zeros(4, 2)})
    assert _load_peft_error(d) == (f"{d}: LoRA modules outside the language model (or missing in this base): "
                                   f"['model.visual.q_proj']")
    d = _peft_dir(tmp_path, "o2", tensors=lambda st: dict(st, **{f"{pre}.x_proj.lora_A.weight": torch.zeros(2, 4)}))
    assert _load_peft_error(d) == (f"{d}: LoRA modules outside the language model (or missing in this base): "
                                   f"['model.language_model.layers.0.self_attn.x_proj']")
    d = _peft_dir(tmp_path, "o3", tensors=lambda st: {})
    assert _load_peft_error(d) == f"{d}: LoRA modules outside the language model (or missing in this base): none given"
    # a module that is not an nn.Linear (the stack's layer itself)
    d = _peft_dir(tmp_path, "l", tensors=lambda st: {"base_model.model.model.language_model.layers.0.lora_A.weight":
                                                     torch.zeros(2, 4)})
    assert _load_peft_error(d) == (f"{d}: LoRA tensors on modules that are not nn.Linear layers: "
                                   f"['model.language_model.layers.0']; the LoRA baseline wraps nn.Linear layers "
                                   f"only (peft's target_parameters is not supported)")
    # a lora_A without its lora_B, and a shape that does not fit
    d = _peft_dir(tmp_path, "m", tensors=lambda st: {k: v for k, v in st.items() if k != f"{pre}.q_proj.lora_B.weight"})
    assert _load_peft_error(d) == f"{d}: no tensors for ['model.language_model.layers.0.self_attn.q_proj.lora_B']"
    d = _peft_dir(tmp_path, "s", tensors=lambda st: dict(st, **{f"{pre}.q_proj.lora_B.weight": torch.zeros(4, 3)}))
    assert _load_peft_error(d) == f"{d}: model.language_model.layers.0.self_attn.q_proj.lora_B has shape (4, 3), " \
                                  f"model expects (4, 2)"


# ----------------------------------------------------------------------------- the compile switch, the routing window

def test_eager_or_disabled_calls_fn_eagerly_and_the_disabled_copy_under_compile(monkeypatch):
    seen = []

    def fake_disable(fn):
        def off(*a, **k):
            seen.append("off")
            return fn(*a, **k)
        return off
    monkeypatch.setattr(torch.compiler, "disable", fake_disable)

    def f(a, b, *, c):
        """doc of f"""
        seen.append("fn")
        return (a, b, c)
    g = mm._eager_or_disabled(f)
    assert (g.__name__, g.__doc__) == ("f", "doc of f")
    assert g(1, 2, c=3) == (1, 2, 3) and seen == ["fn"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert g(4, 5, c=6) == (4, 5, 6) and seen == ["fn", "off", "fn"]


def _window(W=3, granularity="window"):
    ctx = RoutingContext()
    return mm.RoutingWindow(AdapterConfig(window=W, granularity=granularity), ctx), ctx


def test_routing_window_ready_needs_both_a_cache_and_a_continuing_call():
    win, ctx = _window()
    assert not win.ready()
    ctx.continuing = True
    assert not win.ready()
    win.cache = (torch.zeros(1, 4, 1), torch.zeros(1, dtype=torch.long))
    assert win.ready()
    ctx.continuing = False
    assert not win.ready()


def test_prefill_cache_by_hand():
    # W = 3, one channel, rows: [pad, 1, 2] (two real tokens: numbers 0, 1 in slots 0, 1) and [3, 4, 5]
    # (numbers 0 1 2 in slots 0 1 2). Slot W = 3 (the dump slot) is zero. The ring is fp32 whatever x's dtype.
    win, ctx = _window()
    ctx.mask = torch.tensor([[False, True, True], [True, True, True]])
    x = torch.tensor([[[9.0], [1.0], [2.0]], [[3.0], [4.0], [5.0]]], dtype=torch.float64)
    out = win(x)
    ring, n_seen = win.cache
    assert n_seen.tolist() == [2, 3] and ring.dtype == torch.float32
    assert ring[..., 0].tolist() == [[1.0, 2.0, 0.0, 0.0], [3.0, 4.0, 5.0, 0.0]]
    # window means: row 0: pad (no real token yet) 0, 1, 1.5; row 1: 3, 3.5, 4
    assert out[..., 0].tolist() == [[0.0, 1.0, 1.5], [3.0, 3.5, 4.0]]
    # four real tokens with W = 3: numbers 1 2 3 kept, in slots 1 2 0
    win, ctx = _window()
    ctx.mask = None
    win(torch.tensor([[[1.0], [2.0], [3.0], [4.0]]]))
    assert win.cache[0][..., 0].tolist() == [[4.0, 2.0, 3.0, 0.0]] and win.cache[1].tolist() == [4]


def test_routing_window_on_the_inputs_device():
    # every tensor the cache holds follows x's device (meta here; CUDA in a GPU run)
    for granularity in ("window", "region"):
        win, ctx = _window(granularity=granularity)
        ctx.mask = torch.ones(2, 4, dtype=torch.bool, device="meta")
        out = win(torch.zeros(2, 4, 2, device="meta"))
        assert out.device.type == win.cache[0].device.type == win.cache[1].device.type == "meta"


def test_step_with_autograd_writes_out_of_place_and_passes_gradients():
    win, ctx = _window(W=2)
    ctx.mask = None
    win(torch.tensor([[[1.0, 10.0], [2.0, 20.0]]]))      # slots 0, 1 hold tokens 0, 1
    ring0 = win.cache[0]
    before = ring0.clone()
    ctx.continuing = True
    x = torch.tensor([[[4.0, 40.0]]], requires_grad=True)
    out = win(x)                                          # token 2 -> slot 0; window (2 + 4) / 2
    assert out.tolist() == [[[3.0, 30.0]]]
    assert torch.equal(ring0, before)                     # the old ring is not written
    ring, n = win.cache
    assert ring.tolist() == [[[4.0, 40.0], [2.0, 20.0], [0.0, 0.0]]] and not ring.requires_grad and n.tolist() == [3]
    out.sum().backward()
    assert x.grad.tolist() == [[[0.5, 0.5]]]
    # without autograd the ring is written in place (same storage)
    with torch.no_grad():
        win(torch.tensor([[[6.0, 60.0]]]))                # token 3 -> slot 1; (4 + 6) / 2
    assert win.cache[0].data_ptr() == ring.data_ptr() and ring[0, 1].tolist() == [6.0, 60.0]


def test_step_refuses_a_reordered_batch():
    win, ctx = _window(W=2)
    win(torch.ones(2, 2, 1))
    ctx.continuing = True
    with pytest.raises(RuntimeError) as e:
        win.step(torch.ones(3, 1, 1))
    assert _msg(e) == ("routing cache holds 2 rows but the batch has 3 (beam search / batch reordering is not "
                       "supported)")


def test_layers_of_other_widths_share_the_count_but_not_the_plan():
    # two windows (C = 1 and C = 2) of one model: the shared count tensor is the same object, but each
    # decoding plan is made for its own width
    ctx = RoutingContext()
    a, b = (mm.RoutingWindow(AdapterConfig(window=2), ctx) for _ in range(2))
    a(torch.tensor([[[1.0], [3.0]]]))
    b(torch.tensor([[[1.0, 2.0], [3.0, 4.0]]]))
    assert a.cache[1] is b.cache[1]
    ctx.continuing = True
    assert a(torch.tensor([[[5.0]]])).tolist() == [[[4.0]]]
    assert b(torch.tensor([[[5.0, 6.0]]])).tolist() == [[[4.0, 5.0]]]


def test_decode_step_under_autocast_runs_in_fp32():
    torch.manual_seed(0)
    layer = MoDLinear(nn.Linear(4, 3), AdapterConfig(num_experts=3, r=2, window=1, granularity="token"),
                      RoutingContext()).eval()
    fill(layer)
    x = torch.randn(2, 1, 4)
    with torch.no_grad():
        want = layer._decode(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = layer._decode(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)


# ----------------------------------------------------------------------------- MoDLinear by hand

LN2, LN3 = float(torch.tensor(2.0).log()), float(torch.tensor(3.0).log())


def hand_layer(method="mod", **kw):
    """in = out = 2, E = 3, r = 2, alpha 8 (scaling 4); base y = x + (.5, -.5). On x = (1, 0) the router
    logits are the first columns: A pool (0, ln3, ln2) -> experts 1, 2 with gates (.6, .4); B pool
    (ln2, 0, ln3) -> experts 2, 0 with gates (.6, .4). A's first column z = (1, 2, 3);
    B rows (1, 0), (0, 1), (1, 1)."""
    cfg = AdapterConfig(method=method, num_experts=3, r=2, lora_alpha=8.0, window=1, granularity="token", **kw)
    base = nn.Linear(2, 2)
    layer = MoDLinear(base, cfg, RoutingContext())
    with torch.no_grad():
        base.weight.copy_(torch.eye(2))
        base.bias.copy_(torch.tensor([0.5, -0.5]))
        A = torch.tensor([[1.0, 5.0], [2.0, 5.0], [3.0, 5.0]])
        B = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
        ra = torch.tensor([[0.0, 1.0], [LN3, 1.0], [LN2, 1.0]])
        rb = torch.tensor([[LN2, 1.0], [0.0, 1.0], [LN3, 1.0]])
        if method == "mod":
            layer.A.copy_(A), layer.B.copy_(B), layer.router_A.copy_(ra)
            if layer.router_B is not None:
                layer.router_B.copy_(rb)
        else:
            layer.lora_A.copy_(A), layer.lora_B.copy_(B.T), layer.router.copy_(ra)
    return layer


# out = base (1.5, -0.5) + 4 * h, h worked in the comments of test_layer_forward_by_hand
HAND = {"sqrt_product": [1.5 + 9.6, -0.5 + 4.8], "mean": [1.5 + 9.6, -0.5 + 4.8], "product": [1.5 + 4.8, -0.5 + 2.88]}


@pytest.mark.parametrize("combine", ["sqrt_product", "product", "mean"])
def test_layer_forward_by_hand(combine):
    # dual routers: I_A = (1, 2), I_B = (2, 0), g_A = g_B = (.6, .4).
    #   sqrt_product / mean: g = (.6, .4); coef = z[I_A] g = (2 * .6, 3 * .4) = (1.2, 1.2);
    #   B weights: expert 2 gets 1.2, expert 0 gets 1.2 -> h = 1.2 (1, 0) + 1.2 (1, 1) = (2.4, 1.2); x 4 = (9.6, 4.8)
    #   product: g = (.36, .16); coef (.72, .48) -> h = .72 (1, 1) + .48 (1, 0) = (1.2, .72); x 4 = (4.8, 2.88)
    layer = hand_layer(combine=combine)
    x = torch.tensor([[[1.0, 0.0]]])
    with torch.no_grad():
        full = layer._adapter_full(x)
        assert torch.allclose(full, torch.tensor([[HAND[combine]]]) - torch.tensor([1.5, -0.5]), atol=1e-6)
        for mode in (layer.train, layer.eval):           # training / full path, then the one-token decoding path
            mode()
            got = layer(x)
            assert got.dtype == torch.float32 and torch.allclose(got, torch.tensor([[HAND[combine]]]), atol=1e-6)
        # a batch of 2 tokens through the full path (eval, T = 2): the same per token; the zero token gives the base
        got = layer(torch.tensor([[[1.0, 0.0], [0.0, 0.0]]]))
        assert torch.allclose(got, torch.tensor([[HAND[combine], [0.5, -0.5]]]), atol=1e-6)


def test_layer_shared_router_and_moelora_by_hand():
    # shared router: I_A = I_B = (1, 2), g = (.6, .4): coef (1.2, 1.2) on B rows 1, 2 -> h = (1.2, 2.4); x 4
    # moelora: the same experts and gates on z = (1, 2, 3): (2 * .6) (0, 1) + (3 * .4) (1, 1) = (1.2, 2.4); x 4
    x = torch.tensor([[[1.0, 0.0]]])
    want = torch.tensor([[[1.5 + 4.8, -0.5 + 9.6]]])
    for layer in (hand_layer(shared_router=True), hand_layer("moelora")):
        with torch.no_grad():
            for mode in (layer.train, layer.eval):
                mode()
                assert torch.allclose(layer(x), want, atol=1e-6)
    # lora: scaling alpha / r = 4; h = lora_B (lora_A x) with lora_A [2, 2] = I, lora_B = [[1, 2], [3, 4]]: (1, 3)
    layer = MoDLinear(nn.Linear(2, 2, bias=False), AdapterConfig(method="lora", r=2, lora_alpha=8.0), RoutingContext())
    with torch.no_grad():
        layer.base_layer.weight.zero_()
        layer.lora_A.copy_(torch.eye(2)), layer.lora_B.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        assert layer(x).tolist() == [[[4.0, 12.0]]]
        assert layer.eval()(x).tolist() == [[[4.0, 12.0]]]


def test_layer_parameters_shapes_dtypes_and_init():
    base = nn.Linear(64, 3).to(torch.bfloat16)
    cfg = AdapterConfig(num_experts=8, r=2, lora_alpha=6.0, router_init_std=0.5, window=5)
    layer = MoDLinear(base, cfg, RoutingContext())
    own = dict(layer.named_parameters(recurse=False))
    assert {k: tuple(v.shape) for k, v in own.items()} == {"A": (8, 64), "B": (8, 3), "router_A": (8, 64),
                                                           "router_B": (8, 64)}
    assert all(v.dtype == torch.float32 and v.requires_grad for v in own.values())
    assert not base.weight.requires_grad and not base.bias.requires_grad and layer.base_layer is base
    assert layer.cfg is cfg and layer.scaling == 3.0 and layer.pools == 2
    assert layer._fused_names == ("router_A", "router_B", "A", "B")
    assert isinstance(layer.window, mm.RoutingWindow) and layer.window.W == 5 and layer.window.ctx is layer.ctx
    # init as LoRA: A Kaiming-uniform (bound 1 / sqrt(64) = .125), B zero, routers N(0, .5)
    assert torch.equal(layer.B, torch.zeros(8, 3))
    assert 0.1 < layer.A.abs().max() <= 0.125
    for r in (layer.router_A, layer.router_B):
        assert 0.4 < r.std().item() < 0.6 and r.abs().max() > 0.8
    assert not torch.equal(layer.router_A, layer.router_B)
    shared = MoDLinear(nn.Linear(4, 3), AdapterConfig(num_experts=3, r=2, shared_router=True), RoutingContext())
    assert shared.router_B is None and shared.pools == 1 and shared._fused_names == ("router_A", "A", "B")
    assert [n for n, _ in shared.named_parameters(recurse=False)] == ["A", "B", "router_A"]
    lora = MoDLinear(nn.Linear(4, 3), AdapterConfig(method="lora", r=2, lora_alpha=6.0), RoutingContext())
    assert {k: tuple(v.shape) for k, v in lora.named_parameters(recurse=False)} == {"lora_A": (2, 4), "lora_B": (3, 2)}
    assert lora.window is None and lora.pools == 1 and lora._fused_names == () and lora.scaling == 3.0
    assert torch.equal(lora.lora_B, torch.zeros(3, 2)) and 0 < lora.lora_A.abs().max() <= 0.5
    moe = MoDLinear(nn.Linear(4, 3), AdapterConfig(method="moelora", num_experts=3, r=2, expert_rank=2),
                    RoutingContext())
    assert {k: tuple(v.shape) for k, v in moe.named_parameters(recurse=False)} == {
        "lora_A": (6, 4), "lora_B": (3, 6), "router": (3, 4)}
    assert moe.pools == 1 and moe._fused_names == ("router", "lora_A", "lora_B") and moe.window.W == 1
    assert torch.equal(moe.lora_B, torch.zeros(3, 6)) and moe.router.abs().max() < 0.2   # std .02
    meta = MoDLinear(nn.Linear(4, 3, device="meta"), AdapterConfig(num_experts=3, r=2), RoutingContext())
    assert all(p.device.type == "meta" for p in meta.parameters())


def test_layer_output_keeps_the_base_dtype():
    layer = hand_layer()
    layer.base_layer.to(torch.bfloat16)
    x = torch.tensor([[[1.0, 0.0]]], dtype=torch.bfloat16)
    with torch.no_grad():
        for mode in (layer.train, layer.eval):
            mode()
            got = layer(x)
            # base (1.5, -.5) exact in bf16; h (9.6, 4.8) computed in fp32, then rounded to bf16 and added
            want = torch.tensor([1.5, -0.5], dtype=torch.bfloat16) + torch.tensor([9.6, 4.8]).to(torch.bfloat16)
            assert got.dtype == torch.bfloat16 and torch.equal(got[0, 0], want)


def test_adapter_takes_the_decoding_step_only_for_one_token_in_eval(monkeypatch):
    for W, gran in ((1, "token"), (3, "window")):
        layer = hand_layer()
        layer.cfg = AdapterConfig(num_experts=3, r=2, window=W, granularity=gran)
        layer.window = mm.RoutingWindow(layer.cfg, layer.ctx)
        steps = []
        real = layer._decode
        monkeypatch.setattr(layer, "_decode", lambda x: steps.append(tuple(x.shape)) or real(x))
        x1, x2 = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
        with torch.no_grad():
            layer.train()(x1)                                     # training: full path
            layer.eval()(x2)                                      # two tokens: full path (prefill)
            assert steps == []
            layer(x1)                                             # one token: W = 1 steps; W = 3 needs the cache
            assert steps == ([(1, 1, 2)] if W == 1 else [])
            layer.ctx.continuing = True
            layer(x1)                                             # W = 3: continuing with a filled cache
            assert len(steps) == (2 if W == 1 else 1)


def test_training_records_the_load_balance_loss_by_hand():
    # x = (1, 0): pool A probabilities softmax(0, ln3, ln2) = (1, 3, 2) / 6, top-2 {1, 2}: f_A = (0, 1, 1)
    #   -> E sum f P = 3 (3 + 2) / 6 = 2.5; pool B softmax(ln2, 0, ln3) = (2, 1, 3) / 6, top-2 {2, 0}:
    #   f_B = (1, 0, 1) -> 3 (2 + 3) / 6 = 2.5; the layer's loss .5 (2.5 + 2.5) = 2.5. Pools swapped
    #   (f_A with P_B, f_B with P_A): .5 (3 (1 + 3) / 6 + 3 (1 + 2) / 6) = 1.75.
    # moelora (one router = pool A): .5 (2.5 + 2.5) = 2.5. A second token (2, 0) doubles the logits:
    #   softmax(0, 2 ln3, 2 ln2) = (1, 9, 4) / 14, same top-2: f = (0, 1, 1) each; mean P over both tokens
    #   P_A = ((1/6 + 1/14) / 2, (3/6 + 9/14) / 2, (2/6 + 4/14) / 2) -> 3 (P_1 + P_2)
    x = torch.tensor([[[1.0, 0.0]], [[2.0, 0.0]]])                  # B = 2, T = 1
    pa = torch.tensor([[1.0, 3.0, 2.0], [1.0, 9.0, 4.0]]) / torch.tensor([[6.0], [14.0]])
    want_a = 3 * (pa[:, 1].mean() + pa[:, 2].mean())
    for layer, want in ((hand_layer(), 2.5), (hand_layer("moelora"), 2.5)):
        layer.train()
        layer(x[:1])
        assert len(layer.ctx.aux) == 1 and abs(layer.ctx.aux[0].item() - want) < 1e-6
    layer = hand_layer("moelora").train()
    layer(x)
    assert abs(layer.ctx.aux[0].item() - want_a.item()) < 1e-6
    # in eval nothing is recorded; the padding mask is applied (a pad token is not counted)
    layer = hand_layer().eval()
    layer(x[:1])
    assert layer.ctx.aux == []
    layer = hand_layer().train()
    layer.ctx.mask = torch.tensor([[True, False]])
    layer(torch.tensor([[[1.0, 0.0], [0.0, 3.0]]]))
    assert abs(layer.ctx.aux[0].item() - 2.5) < 1e-6


def test_recorded_trace_holds_both_pools_indices():
    # the full path (training, then a 2-token eval call) and the decoding step record (name, I_A, I_B, mask)
    layer = hand_layer()
    layer.name = "q"
    ctx = layer.ctx
    ctx.record = True
    x = torch.tensor([[[1.0, 0.0]]])
    layer.train()(x)
    layer.eval()(x)                                                   # W = 1: the decoding step
    ctx.mask = torch.tensor([[True, True]])
    layer(torch.cat([x, 2 * x], 1))
    names = [t[0] for t in ctx.trace]
    assert names == ["q", "q", "q"]
    assert [t[1].tolist() for t in ctx.trace] == [[[[1, 2]]], [[[1, 2]]], [[[1, 2], [1, 2]]]]
    assert [t[2].tolist() for t in ctx.trace] == [[[[2, 0]]], [[[2, 0]]], [[[2, 0], [2, 0]]]]
    assert ctx.trace[0][3] is None and ctx.trace[2][3] is ctx.mask
    moe = hand_layer("moelora")
    moe.name = "v"
    moe.ctx.record = True
    moe.train()(x)
    moe.eval()(x)
    assert [(t[0], t[1].tolist(), t[2].tolist()) for t in moe.ctx.trace] == [("v", [[[1, 2]]], [[[1, 2]]])] * 2


def test_router_noise_only_while_training_with_a_positive_std():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 2)
    for kw, train in ((dict(noise_std=0.0), True), (dict(noise_std=0.5), False)):
        layer = hand_layer(**kw).train(train)
        state = torch.get_rng_state()
        with torch.no_grad():
            layer(x)
        assert torch.equal(torch.get_rng_state(), state)             # no random numbers drawn
    layer = hand_layer(noise_std=0.5).train()
    layer.name = "q"
    layer.ctx.record = True
    with torch.no_grad():
        logits = layer.router_logits(x)
        torch.manual_seed(7)
        noisy = (logits + 0.5 * torch.randn(2, 3, 6)).unflatten(-1, (2, 3))
        torch.manual_seed(7)
        layer(x)
    idx = noisy.topk(2, dim=-1).indices
    assert torch.equal(layer.ctx.trace[0][1], idx[..., 0, :]) and torch.equal(layer.ctx.trace[0][2], idx[..., 1, :])


@pytest.mark.parametrize("granularity,want", [("window", [[4.0, 5.0], [20.0, 20.0]]),
                                              ("region", [[4.5, 5.0], [20.0, 20.0]])])
def test_continuing_call_of_several_tokens_by_hand(granularity, want):
    # W = 3, one channel. Prefill: row 0 real tokens 1 2 3 4 (numbers 0-3), row 1 two pads then 10 20
    # (numbers 0 1). Then a continuing call of two tokens: row 0 real 5, 6 (numbers 4 5), row 1 real 30
    # (number 2) and a pad.
    # window: row 0: (3 + 4 + 5) / 3 = 4, (4 + 5 + 6) / 3 = 5; row 1: (10 + 20 + 30) / 3 = 20, the pad
    #   takes the previous real token's window: 20.
    # region (blocks {0 1 2}, {3 4 5}): row 0: (4 + 5) / 2 = 4.5, (4 + 5 + 6) / 3 = 5; row 1: 20, pad 20.
    win, ctx = _window(granularity=granularity)
    ctx.mask = torch.tensor([[True, True, True, True], [False, False, True, True]])
    win(torch.tensor([[[1.0], [2.0], [3.0], [4.0]], [[0.0], [0.0], [10.0], [20.0]]]))
    ctx.continuing, ctx.mask = True, torch.tensor([[True, True], [True, False]])
    out = win(torch.tensor([[[5.0], [6.0]], [[30.0], [99.0]]]))
    assert torch.allclose(out[..., 0], torch.tensor(want), atol=1e-6, rtol=0)
    ring, n = win.cache
    assert n.tolist() == [6, 3]
    assert ring[..., 0].tolist() == [[4.0, 5.0, 6.0, 0.0], [10.0, 20.0, 30.0, 0.0]]   # slot j % 3 <- number j
    with pytest.raises(RuntimeError) as e:
        ctx.mask = None
        win(torch.ones(3, 2, 1))
    assert _msg(e) == ("routing cache holds 2 rows but the batch has 3 (beam search / batch reordering is not "
                       "supported)")


def test_counts_are_made_per_call_shape_and_device():
    # without a mask the count's memo key is (None, None) in every prefill: the call's B, T and device
    # keep a later call from reusing an earlier count
    win, ctx = _window()
    win(torch.ones(1, 2, 1))
    assert win.cache[1].tolist() == [2]
    win(torch.ones(1, 3, 1))
    assert win.cache[1].tolist() == [3]
    win(torch.ones(1, 3, 1, device="meta"))
    assert win.cache[1].device.type == "meta"
    # a continuing call before any cache (one token): the plain window over that token alone
    win, ctx = _window()
    ctx.continuing = True
    assert win(torch.tensor([[[6.0]]])).tolist() == [[[6.0]]] and win.cache[1].tolist() == [1]


def test_routing_context_starts_empty():
    ctx = RoutingContext()
    assert (ctx.mask, ctx.continuing, ctx.aux, ctx.record, ctx.trace, ctx.reduce, ctx._memo) == (
        None, False, [], False, [], None, {})


def test_adapter_weights_are_fp32_whatever_the_default_dtype():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        layer = MoDLinear(nn.Linear(4, 3), AdapterConfig(num_experts=3, r=2), RoutingContext())
    finally:
        torch.set_default_dtype(old)
    assert all(p.dtype == torch.float32 for p in layer.parameters(recurse=False))


def _decode_pair(W=1, granularity="token", **kw):
    """A layer and a copy for the full path, random weights, eval mode."""
    torch.manual_seed(0)
    cfg = AdapterConfig(num_experts=4, r=2, window=W, granularity=granularity, **kw)
    layer = MoDLinear(nn.Linear(5, 3), cfg, RoutingContext()).eval()
    fill(layer, std=1.0)
    ref = MoDLinear(nn.Linear(5, 3), cfg, RoutingContext()).eval()
    ref.load_state_dict(layer.state_dict())
    return layer, ref


@pytest.mark.parametrize("kw", [dict(), dict(method="moelora", expert_rank=2)])
def test_decode_step_with_a_window_of_two_equals_the_full_path(kw):
    layer, ref = _decode_pair(W=2, granularity="window", **kw)
    x = torch.randn(2, 5, 5)
    with torch.no_grad():
        want = ref(x)
        got = [layer(x[:, :2])]
        layer.ctx.continuing = True
        got += [layer(x[:, t:t + 1]) for t in range(2, 5)]
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=0, atol=1e-5)


def test_decode_bag_offsets_are_cached_per_batch_size_in_eager_mode_only(monkeypatch):
    layer, ref = _decode_pair()
    x2, x3 = torch.randn(2, 1, 5), torch.randn(3, 1, 5)
    with torch.no_grad():
        a = layer(x2)
        off = layer.__dict__["_bag_offsets"]
        assert off.tolist() == [0, 2]                                # bag starts 0, r
        assert torch.allclose(layer(x2), a) and layer.__dict__["_bag_offsets"] is off   # reused
        b = layer(x3)                                                # another batch size: new offsets
        assert layer.__dict__["_bag_offsets"].tolist() == [0, 2, 4]
        torch.testing.assert_close(b, ref(x3), rtol=0, atol=1e-5)
        # while compiling nothing is read from or stored in the module (a stale entry stays unused)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        stale = torch.zeros(3, dtype=torch.long)
        layer.__dict__["_bag_offsets"] = stale
        torch.testing.assert_close(layer(x3), b, rtol=0, atol=0)
        assert layer.__dict__["_bag_offsets"] is stale
        del layer.__dict__["_bag_offsets"]
        layer(x2)
        assert "_bag_offsets" not in layer.__dict__


@pytest.mark.parametrize("kw", [dict(), dict(method="moelora")])
def test_decode_step_on_the_inputs_device(kw, monkeypatch):
    # meta has no autocast state to ask about (CUDA and CPU do): answered "off" here
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: False)
    layer = MoDLinear(nn.Linear(5, 3, device="meta"), AdapterConfig(num_experts=4, r=2, window=1,
                                                                    granularity="token", **kw),
                      RoutingContext()).eval()
    with torch.no_grad():
        assert layer(torch.zeros(2, 1, 5, device="meta")).device.type == "meta"


def test_decode_step_gradients_equal_the_full_paths():
    # both tokens pick the same B rows: the decoding step's weighted bag must not rescale B's gradient by
    # how often a row occurs (embedding_bag's scale_grad_by_freq), nor make it sparse
    layer, ref = _decode_pair()
    x = torch.randn(1, 1, 5).expand(2, 1, 5).contiguous()
    layer(x).square().sum().backward()
    ref(torch.cat([x[:1], x[:1]], 1)).square().sum().backward()      # full path, the same token twice
    assert not layer.B.grad.is_sparse
    torch.testing.assert_close(layer.B.grad, ref.B.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(layer.A.grad, ref.A.grad, rtol=0, atol=1e-5)


# ------------------------------------------------- long lists, nameless bases, empty options, continuing calls

def test_attach_lists_suffixes_of_top_level_layers_too():
    lm = _holder(layers=nn.ModuleList([_holder(up=nn.Linear(2, 2))]), proj=nn.Linear(2, 2))   # "proj": no dot
    with pytest.raises(ValueError) as e:
        attach(lm, AdapterConfig(target_modules=["gate"]))
    assert _msg(e).endswith("available suffixes: ['proj', 'up']")
    with pytest.raises(ValueError) as e:
        unload(ToyVLM())                                        # never attached
    assert _msg(e) == "no adapters attached to this model"


def test_lora_config_with_experts_pattern_is_refused_as_lora():
    with pytest.raises(ValueError) as e:
        AdapterConfig(method="lora", experts_pattern={"up_proj": 1})
    assert _msg(e).startswith("AdapterConfig: experts_pattern is for mod / moelora pools (got ")


def test_saving_twice_into_one_directory_overwrites(tmp_path):
    model, _ = _trained()
    d = str(tmp_path / "a")
    save_adapters(model, d)
    fill(model, seed=4)
    save_adapters(model, d)
    st = load_file(os.path.join(d, "adapter_model.safetensors"))
    assert all(torch.equal(st[k], v) for k, v in adapter_state_dict(model).items())
    lora = _lora()
    save_peft(lora, str(tmp_path / "p"))
    save_peft(lora, str(tmp_path / "p"))
    assert is_peft(str(tmp_path / "p"))


def test_load_adapters_messages_with_nameless_bases_and_long_lists(tmp_path):
    model = ToyVLM(name="")
    attach(model, AdapterConfig(target_modules=["q_proj", "v_proj"], num_experts=3, r=2))
    d = tmp_path / "a"
    save_adapters(model, str(d))
    with pytest.raises(ValueError) as e:
        load_adapters(ToyVLM(h=6, vocab=7, name=""), str(d))
    assert _msg(e) == (f"{d}: adapters were trained on base ? and do not fit base ? (hidden_size 4 vs 6; "
                       f"vocab_size 5 vs 7)")
    # four missing and four unexpected tensors: the first three of each are named
    st = adapter_state_dict(model)
    names = sorted(st)
    save_file({k: v for k, v in st.items() if k not in names[:4]}, str(d / "adapter_model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_adapters(ToyVLM(name=""), str(d))
    assert _msg(e) == f"{d} does not fit this base model: missing {names[:3]}, unexpected []"
    save_file(dict(st, **{f"x{i}": torch.zeros(1) for i in range(4)}), str(d / "adapter_model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_adapters(ToyVLM(name=""), str(d))
    assert _msg(e) == f"{d} does not fit this base model: missing [], unexpected ['x0', 'x1', 'x2']"


def test_load_peft_long_lists_and_empty_option_values(tmp_path):
    pre = "base_model.model.model.language_model.layers"
    d = _peft_dir(tmp_path, "o", tensors=lambda st: {f"base_model.model.m{i}.lora_A.weight": torch.zeros(1)
                                                     for i in range(4)})
    assert _load_peft_error(d) == (f"{d}: LoRA modules outside the language model (or missing in this base): "
                                   f"['m0', 'm1', 'm2']")
    d = _peft_dir(tmp_path, "l", tensors=lambda st: {f"{pre}.{m}.lora_A.weight": torch.zeros(1)
                                                     for m in ("0", "1", "0.self_attn", "1.self_attn")})
    assert _load_peft_error(d).startswith(f"{d}: LoRA tensors on modules that are not nn.Linear layers: "
                                          f"['model.language_model.layers.0', "
                                          f"'model.language_model.layers.0.self_attn', "
                                          f"'model.language_model.layers.1']; ")
    d = _peft_dir(tmp_path, "m", tensors=lambda st: {k: v for k, v in st.items() if "lora_A" in k})
    assert _load_peft_error(d) == (f"{d}: no tensors for ['model.language_model.layers.0.self_attn.q_proj.lora_B', "
                                   f"'model.language_model.layers.0.self_attn.v_proj.lora_B', "
                                   f"'model.language_model.layers.1.self_attn.q_proj.lora_B']")
    # an empty container where peft's default is the other empty container is plain LoRA; an empty bias is not
    d = _peft_dir(tmp_path, "e", {"rank_pattern": [], "target_parameters": {}})
    assert load_peft(ToyVLM(), d).method == "lora"
    d = _peft_dir(tmp_path, "b", {"bias": ""})
    assert _load_peft_error(d) == f"{d}: peft options the LoRA baseline does not implement: {{'bias': ''}}"


def test_continuing_window_call_keeps_the_input_dtype_and_device():
    for dev, dtype in (("cpu", torch.bfloat16), ("meta", torch.float32)):
        win, ctx = _window()
        win(torch.ones(1, 2, 1, dtype=dtype, device=dev))
        ctx.continuing = True
        out = win(torch.ones(1, 2, 1, dtype=dtype, device=dev))
        assert out.dtype == dtype and out.device.type == dev
    assert out.shape == (1, 2, 1)


def test_write_text_is_utf8_under_any_locale(tmp_path, monkeypatch):
    # a locale whose default encoding is ASCII (the C locale without UTF-8 mode): open() without an
    # encoding would fail on "é"; the file must still be UTF-8
    def ascii_default_open(file, mode="r", *a, encoding=None, **kw):
        return builtins.open(file, mode, *a, encoding=encoding or "ascii", **kw)
    monkeypatch.setattr(mm, "open", ascii_default_open, raising=False)
    mm._write_text(str(tmp_path / "a.txt"), "é")
    assert (tmp_path / "a.txt").read_bytes() == "é".encode("utf-8")
