"""peft adapters the LoRA baseline cannot load are refused by name, exit 2, no traceback.

Reported: a peft adapter with `target_parameters` (peft >= 0.17: LoRA on parameters such as
the fused MoE expert tensors `mlp.experts.gate_up_proj`) crashed `mod.infer --adapter` with
`KeyError: 'model.language_model.layers.0.mlp.experts.lora_A'` and exit 1."""
import json

import torch
from safetensors.torch import save_file

from common import shapes
from helpers import error_of

PREFIX = "base_model.model.model.language_model.layers.0.mlp.experts"


def _expert_lora(d, config_key=True):
    """A peft-style adapter dir: LoRA on tiny-moe's fused expert parameters of layer 0
    (as peft's ParamWrapper names its tensors), with or without the config key."""
    d.mkdir()
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": None, "bias": "none"}
    if config_key:
        cfg["target_parameters"] = ["mlp.experts.gate_up_proj"]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({f"{PREFIX}.lora_A.weight": torch.zeros(16, 128), f"{PREFIX}.lora_B.weight": torch.zeros(256, 16)},
              str(d / "adapter_model.safetensors"))
    return str(d)


def test_target_parameters_adapter_is_refused_by_name(tmp_path, capsys):
    from mod import infer
    shapes.generate_split(str(tmp_path / "d"), "test", 2)
    argv = ["--model", "tiny-moe", "--data", str(tmp_path / "d" / "test.json"), "--methods", "single",
            "--max-new-tokens", "2", "--threads", "1", "--adapter"]
    err = error_of(infer.main, argv + [_expert_lora(tmp_path / "a")], capsys)      # exit 2 (was KeyError, exit 1)
    assert "error:" in err and "target_parameters" in err and "Traceback" not in err
    assert "peft options the LoRA baseline does not implement" in err
    # the same tensors without the config key: named as modules that are not nn.Linear layers
    err = error_of(infer.main, argv + [_expert_lora(tmp_path / "b", config_key=False)], capsys)
    assert "not nn.Linear" in err and "layers.0.mlp.experts" in err


def test_empty_target_parameters_is_plain_lora(tmp_path):
    """peft writes `"target_parameters": null` or `[]` for a plain LoRA: not a refusal."""
    from mod.model import AdapterConfig, attach, load_adapters, save_peft
    from common.backbone import build_tiny
    model, _ = build_tiny("qwen3_vl", hidden=32, layers=1)
    attach(model, AdapterConfig(method="lora", r=2, lora_alpha=4.0, target_modules=["q_proj"]))
    d = tmp_path / "p"
    save_peft(model, str(d))
    cfg = json.loads((d / "adapter_config.json").read_text())
    for empty in (None, []):
        (d / "adapter_config.json").write_text(json.dumps(dict(cfg, target_parameters=empty)))
        fresh, _ = build_tiny("qwen3_vl", hidden=32, layers=1)
        assert load_adapters(fresh, str(d)).method == "lora"
