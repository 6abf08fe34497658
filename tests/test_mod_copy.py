"""mod/model.py + common/routing.py are a copy unit: copied alone into another project they give
MoD / LoRA / MoE-LoRA adapters on plain transformers causal LMs (Llama, Gemma3), save/load included."""
import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from transformers import LlamaConfig

from helpers import decoder_depth, tol

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"torch", "safetensors", "common.routing"}

CHILD = textwrap.dedent('''
    import sys
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM
    from mymod.model import AdapterConfig, adapter_layers, attach, aux_loss, load_adapters, save_adapters

    assert not any(m == "mod" or m.startswith(("mod.", "eval", "mole", "rolemerge")) for m in sys.modules), \\
        sorted(m for m in sys.modules if m.startswith(("mod", "eval", "mole", "rolemerge")))
    assert "common.backbone" not in sys.modules and "common.data" not in sys.modules

    SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128)
    ARCHS = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**SIZES)),
             "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(head_dim=16, **SIZES))}
    TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]

    def build(arch, seed=0):
        torch.manual_seed(seed)
        return ARCHS[arch]().eval()

    def logits(model, ids, mask):
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits

    torch.manual_seed(123)
    ids = torch.randint(1, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0                                   # left padding in row 0
    ids[0, :3] = 0
    for arch in ARCHS:
        for method in ("mod", "lora", "moelora"):
            model = build(arch)
            base = logits(model, ids, mask)
            cfg = AdapterConfig(method=method, window=4)
            names = attach(model, cfg)
            assert len(names) == 8 and all(n.rsplit(".", 1)[-1] in TARGETS for n in names), names
            assert torch.equal(logits(model, ids, mask), base), (arch, method)    # B = 0: the base exactly
            torch.manual_seed(1)                      # non-zero B, sharp routers: routing matters
            for _, m in adapter_layers(model):
                for n, p in m.named_parameters(recurse=False):
                    with torch.no_grad():
                        p.normal_(std=2.0 if n.startswith("router") else 0.5)
            # one training step on random tokens
            model.train()
            trainable = [p for p in model.parameters() if p.requires_grad]
            before = [p.detach().clone() for p in trainable]
            opt = torch.optim.AdamW(trainable, lr=1e-2)
            out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
            loss = out.loss + cfg.aux_coef * aux_loss(model)
            assert torch.isfinite(loss), (arch, method)
            if method != "lora":
                assert aux_loss(model) > 0, (arch, method)
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert all(not torch.equal(a, p) for a, p in zip(before, trainable)), (arch, method)
            model.eval()
            # cached greedy decoding == a full forward over the generated sequence
            n = 6
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            full_mask = torch.cat([mask, torch.ones(2, n, dtype=mask.dtype)], 1)
            full = logits(model, gen.sequences, full_mask)[:, ids.shape[1] - 1:-1]
            err = (full - torch.stack(gen.logits, 1)).abs().max().item()
            assert err < REL_TOL * max(1.0, full.abs().max().item()), (arch, method, err)  # float noise only
            # save / load into a fresh base: identical outputs; another base is refused
            path = f"out/{arch}_{method}"
            save_adapters(model, path)
            fresh = build(arch)
            assert load_adapters(fresh, path).method == method
            assert torch.equal(logits(fresh, ids, mask), logits(model, ids, mask)), (arch, method)
            try:
                load_adapters(build(arch, seed=5), path)
            except ValueError as e:
                assert "do not fit" in str(e) and "the weights differ" in str(e), e
            else:
                raise AssertionError("adapters loaded onto a base with other weights")
            print(arch, method, "ok", f"cached-vs-full {err:.1e} of scale {full.abs().max().item():.1f}")
''')


# The cached and the full forward differ only in rounding: kernels of other shapes, summation
# orders, MoD's fused decoding step. The bound per unit of logit scale: fp32 eps times the rounding
# steps in series behind one logit (`helpers.decoder_depth`: the child's Llama / Gemma3 sizes, 18
# positions, adapters of in_features 64 + 8 experts), passed into the child, which runs without tests/
# on its path (1060 steps: 1.3e-4; the float noise measured 1.9e-5 at most, under avx512, avx2, default).
SIZES = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=128)
CHILD = CHILD.replace("REL_TOL", repr(tol(torch.float32, decoder_depth(SIZES, 18, adapter=64 + 8))))


def _imports(tree):
    """(module name, node) of every import in the file, and the import nodes not at module level."""
    top = {id(n) for n in tree.body}
    names, nested = [], []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if id(node) not in top:
                nested.append(node.lineno)
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            names += [(m, node.lineno) for m in mods]
    return names, nested


def test_model_imports_only_stdlib_torch_safetensors_routing():
    for f in ("mod/model.py", "common/routing.py"):
        names, nested = _imports(ast.parse((ROOT / f).read_text()))
        assert not nested, f"{f}: imports inside functions / blocks at lines {nested}"
        bad = [(m, line) for m, line in names
               if m.split(".")[0] not in sys.stdlib_module_names
               and not any(m == a or m.startswith(a + ".") for a in ALLOWED)]
        assert not bad, f"{f}: imports outside stdlib / torch / safetensors / common.routing: {bad}"


def test_identity_helpers_match_common_backbone():
    """The copy's own base identity is the repo's (adapters saved by either load with the other)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common import backbone
    from mod import model as mm
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    assert mm.base_identity(m) == backbone.base_identity(m)
    assert mm.text_model(m) is backbone.text_model(m)
    other = dict(mm.base_identity(m), weights="sha256 0", num_hidden_layers=3)
    assert mm.identity_mismatch(other, mm.base_identity(m)) == backbone.identity_mismatch(other, mm.base_identity(m))


def test_copied_files_alone_adapt_llama_and_gemma3(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "mymod").mkdir()
    (tmp_path / "common" / "__init__.py").write_text("")
    (tmp_path / "mymod" / "__init__.py").write_text("")
    shutil.copy(ROOT / "common" / "routing.py", tmp_path / "common" / "routing.py")
    shutil.copy(ROOT / "mod" / "model.py", tmp_path / "mymod" / "model.py")
    (tmp_path / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONPATH=str(tmp_path), OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    p = subprocess.run([sys.executable, "-P", "child.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count(" ok ") == 6, p.stdout
