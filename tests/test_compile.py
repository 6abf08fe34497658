"""torch.compile on the hot paths (mod.model.compile_adapters, MoLE.compile_hot): routing
and outputs stay those of eager mode. Backend aot_eager (dynamo capture + AOT autograd, no
C++ codegen): inductor's cold compile costs minutes on CPU; the graphs are the same."""
import torch
import torch.nn as nn

from helpers import decoder_depth, logits_tol, mod_layer_tol, tol
from mod.model import AdapterConfig, MoDLinear, RoutingContext, compile_adapters


class _Holder(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m


def test_mod_compiled_adapter_matches_eager_routing_grads_and_cache():
    """MoD through AOT autograd (train step); MoE-LoRA and the cached-decoding recompiles
    through dynamo's capture alone (backend eager) to keep the test to seconds."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    for method, backend in (("mod", "aot_eager"), ("moelora", "eager")):
        ctx = RoutingContext()
        m = MoDLinear(nn.Linear(16, 24), AdapterConfig(method=method, num_experts=4, r=2, window=3), ctx)
        with torch.no_grad():
            (m.B if method == "mod" else m.lora_B).normal_()
        ref = MoDLinear(nn.Linear(16, 24), AdapterConfig(method=method, num_experts=4, r=2, window=3), RoutingContext())
        ref.load_state_dict(m.state_dict())
        m.name = ref.name = "m"                                                    # attach() names the layers
        h = _Holder(m)
        assert compile_adapters(h, backend=backend) == 1
        assert list(h.state_dict()) == ["m." + k for k in ref.state_dict()]          # names unchanged
        x = torch.randn(2, 7, 16)
        mask = torch.ones(2, 7, dtype=torch.bool)
        mask[0, :2] = False                                                        # left padding
        for mod in (m, ref):
            mod.train()
            mod.ctx.mask, mod.ctx.continuing, mod.ctx.aux, mod.ctx.record, mod.ctx.trace = mask, False, [], True, []
        y, y_ref = m(x), ref(x)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=mod_layer_tol(ref, x))
        for a, b in zip(m.ctx.trace[0][1:3], ref.ctx.trace[0][1:3]):               # top-r picks of A and B
            assert torch.equal(a, b)
        # aux: softmax of router logits (a length-16 dot), means over 14 tokens, a sum over 4 experts
        s_route = max((x.abs() @ w.detach().abs().T).max().item()
                      for n, w in ref.named_parameters() if n.startswith("router"))
        aux = ref.ctx.aux[0].item()
        torch.testing.assert_close(m.ctx.aux[0], ref.ctx.aux[0], rtol=0,
                                   atol=(2 * tol(torch.float32, 16, s_route) + tol(torch.float32, 14 + 4 + 4)) * aux)
        y.square().sum().backward()
        y_ref.square().sum().backward()
        # d/dp sum y^2: the forward's steps (in + E + 1 for the adapter, in + W for the router), twice
        # (the backward retraces them), plus the backward's sums over 14 tokens, 24 outputs and 16 inputs,
        # relative to the gradient tensor's largest entry
        depth = 2 * (16 + 4 + 1 + 16 + 3) + 14 + 24 + 16
        for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=tol(torch.float32, depth, q.grad.abs().max()),
                                           msg=n)
        if backend != "eager":
            continue
        # cached decoding: one more token continuing the sequence uses the W-1 routing cache
        m.eval(), ref.eval()
        for mod in (m, ref):
            mod.ctx.mask, mod.ctx.continuing, mod.ctx.trace = mask, False, []
            mod(x)
            mod.ctx.mask, mod.ctx.continuing = torch.ones(2, 1, dtype=torch.bool), True
        x1 = torch.randn(2, 1, 16)
        torch.testing.assert_close(m(x1), ref(x1), rtol=0, atol=mod_layer_tol(ref, x1))
        assert torch.equal(m.ctx.trace[-1][1], ref.ctx.trace[-1][1])


def test_mole_compiled_hot_functions_match_eager():
    from tests.test_mole import examples, make
    torch._dynamo.reset()
    mole = make(layers=2)
    imgs, qs, ans = examples(2)
    b = mole.encode(imgs, qs, ans)
    ref = mole(b, 2, record=True)
    mole.compile_hot(backend="aot_eager")
    assert mole._scores is not type(mole)._scores and all(e.fn is mole.esva[0].fn for e in mole.esva)
    got = mole(b, 2, record=True)
    L = b["input_ids"].shape[1]
    torch.testing.assert_close(got["logits"], ref["logits"], rtol=0, atol=logits_tol(mole.model, L, ref["logits"]))
    # the losses and the attention probabilities come out of the same decoder: its depth, at their own scale
    # (the CE mean moves by at most 2 per unit of logit error)
    depth = decoder_depth(mole.model.config, L)
    for k in ("balance", "z", "div"):
        scale = max(1.0, ref[k].abs().item())
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=tol(torch.float32, depth, scale))
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=0,
                               atol=2 * logits_tol(mole.model, L, ref["logits"])
                               + tol(torch.float32, L + ref["logits"].shape[-1], ref["loss"].abs().item()))
    for layer, p in ref["pass"].attn.items():                  # Z_vis attention over the routed tokens
        torch.testing.assert_close(got["pass"].attn[layer], p, rtol=0, atol=tol(torch.float32, depth, 1.0))
    assert set(mole.state_dict()) == set(make(layers=2).state_dict())


def test_mod_compiled_layers_share_one_compile():
    """Layers of one shape compile once: no guard on the per-forward aux list (its length grows
    layer by layer), so a deep model does not recompile per layer or fall back to eager."""
    torch._dynamo.reset()
    ctx = RoutingContext()
    layers = [MoDLinear(nn.Linear(8, 8), AdapterConfig(num_experts=4, r=2, window=3), ctx) for _ in range(4)]
    for i, m in enumerate(layers):
        m.name = str(i)
        m.train()
        m.compile(backend="eager")
    x = torch.randn(1, 5, 8)
    ctx.mask, ctx.continuing, ctx.aux = None, False, []
    y = x
    for m in layers[:2]:                  # compiles: input without / with requires_grad (layer 1 on)
        y = m(y)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            ctx.aux = []
            y = x
            for m in layers:
                y = m(y)
            assert len(ctx.aux) == 4


def test_compile_adapters_raises_the_recompile_limit_per_layer_kind():
    """q / k / v / o of a real model are several kinds (widths, bias); with dynamo's default
    limit of 8 compiles per function the later kinds silently ran eager."""
    from common.backbone import build_tiny
    from mod.model import attach
    model, _ = build_tiny("qwen2_5_vl", hidden=64, layers=2)
    attach(model, AdapterConfig())
    with torch._dynamo.config.patch(recompile_limit=8):
        assert compile_adapters(model, backend="eager") == 8
        assert torch._dynamo.config.recompile_limit == 48        # q/o (bias / none) and k/v widths: 3 kinds, 16 each


def test_compile_adapters_stays_within_the_recompile_limit_through_train_eval_and_generation():
    """Layers of three kinds (as q/k/v/o of a real model: widths, bias), one shared context, as one
    process uses them: training at batch 1 and 4 and two lengths (inputs without and with grad),
    evaluation, then cached decoding at batch 1 and 4. Dynamo must never hit its recompile limit
    (it would silently run eager; `fail_on_recompile_limit_hit` turns that into an error), the
    compiled functions must run, and a second pass over the same regimes compiles nothing new.
    Compiling the whole layer forward (before) needed more variants than 8 per kind."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    ctx = RoutingContext()
    cfg = AdapterConfig(num_experts=4, r=2, window=3)
    layers = nn.ModuleList([MoDLinear(nn.Linear(8, o, bias=b), cfg, ctx) for o, b in ((8, False), (4, False), (8, True))])
    for i, m in enumerate(layers):
        m.name = str(i)

    def run(x):
        outs = []
        for j, m in enumerate(layers):
            outs.append(m(x if j == 0 else x.detach().requires_grad_(layers.training)))
        return outs

    def regimes():
        layers.train()
        for B in (1, 4):
            for T in (5, 9):
                ctx.mask, ctx.continuing, ctx.aux = torch.ones(B, T, dtype=torch.bool), False, []
                sum(o.square().sum() for o in run(torch.randn(B, T, 8))).backward()
        layers.eval()
        with torch.no_grad():
            for B in (1, 4):
                ctx.mask, ctx.continuing = torch.ones(B, 6, dtype=torch.bool), False
                run(torch.randn(B, 6, 8))
                for _ in range(3):
                    ctx.mask, ctx.continuing = torch.ones(B, 1, dtype=torch.bool), True
                    run(torch.randn(B, 1, 8))
    with torch._dynamo.config.patch(recompile_limit=8):            # dynamo's default, raised per kind
        compile_adapters(nn.ModuleDict({"l": layers}), backend="eager")
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            regimes()
            graphs = counters["stats"]["unique_graphs"]
            assert counters["frames"]["ok"] > 0 and graphs > 0
            with torch._dynamo.config.patch(error_on_recompile=True):
                regimes()
            assert counters["stats"]["unique_graphs"] == graphs
