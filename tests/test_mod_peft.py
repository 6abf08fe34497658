"""MoD's LoRA baseline in peft's file format (mod.model.save_peft / load_peft; peft itself is
cross-checked both ways by eval/tools/bench_peft.py in a venv that has it: exact logits)."""
import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from common import data
from common import shapes
from common.backbone import build_tiny
from mod.model import AdapterConfig, attach, load_adapters, save_peft


def _tiny():
    model, proc = build_tiny("qwen2_5_vl", hidden=64, layers=2, seed=0)
    return model.eval(), proc


def _batch(proc):
    rng = random.Random(0)
    ex = [shapes.sample_example(rng) for _ in range(2)]
    return proc.encode([shapes.render(s) for s, _, _, _ in ex], [q for _, _, q, _ in ex])


def test_peft_round_trip_names_and_refusals(tmp_path):
    torch.manual_seed(0)
    model, proc = _tiny()
    attach(model, AdapterConfig(method="lora", r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(std=0.1)
    b = _batch(proc)
    with torch.no_grad():
        want = model(**b).logits
    d = tmp_path / "peft"
    save_peft(model, str(d))
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["target_modules"] == ["model.language_model.layers.0.self_attn.q_proj",
                                     "model.language_model.layers.0.self_attn.v_proj",
                                     "model.language_model.layers.1.self_attn.q_proj",
                                     "model.language_model.layers.1.self_attn.v_proj"]
    st = load_file(str(d / "adapter_model.safetensors"))
    k = "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight"
    assert len(st) == 8 and st[k].shape == (4, 64)
    assert st[k.replace("lora_A", "lora_B")].shape == (64, 4)
    fresh, _ = _tiny()
    got_cfg = load_adapters(fresh, str(d))           # dispatches on peft_type
    assert (got_cfg.method, got_cfg.r, got_cfg.lora_alpha) == ("lora", 4, 8.0)
    with torch.no_grad():
        torch.testing.assert_close(fresh(**b).logits, want, rtol=0, atol=0)
    # refusals: MoD adapters, peft options we do not implement, foreign tensors
    mod_model, _ = _tiny()
    attach(mod_model, AdapterConfig(method="mod"))
    with pytest.raises(ValueError, match="plain LoRA only"):
        save_peft(mod_model, str(tmp_path / "x"))
    (d / "adapter_config.json").write_text(json.dumps(dict(cfg, use_rslora=True)))
    with pytest.raises(ValueError, match="does not implement.*use_rslora"):
        load_adapters(_tiny()[0], str(d))
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(dict(st, **{"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
                          "base_model.model.lm_head.lora_B.weight": torch.zeros(485, 4)}),
              str(d / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="outside the language model.*lm_head"):
        load_adapters(_tiny()[0], str(d))
