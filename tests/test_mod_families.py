"""MoD's `attach` wraps only the language model's layers, on every VLM family (never a vision
tower: Idefics3 / SmolVLM keep their decoder at `model.model.text_model` and Llama4 at
`model.language_model.model`, beside vision towers with their own q/k/v projections), and the
three copies of `text_model` (common.backbone, mod.model, mole.adapters) agree on every family."""
import pytest
import torch.nn as nn

import tiny_vlms as tv
from common import backbone
from mod import model as mm
from mole import adapters
from test_mole_vlm import tiny_gemma3

FAMILIES = {
    "idefics3": lambda: tv.idefics3()[0], "smolvlm": lambda: tv.smolvlm()[0], "llama4": tv.llama4,
    "mistral3": tv.mistral3, "internvl": tv.internvl, "llava": tv.llava, "gemma3": lambda: tiny_gemma3(layers=2)[0],
    "qwen2_5_vl": lambda: tv.qwen25_vl()[0], "qwen3_vl": lambda: tv.repo_tiny("qwen3_vl"),
    "llava_next": lambda: tv.repo_tiny("llava_next"),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("family", FAMILIES)
def test_attach_wraps_only_the_language_model(family):
    model = FAMILIES[family]()
    lm = mm.text_model(model)
    assert lm is backbone.text_model(model) is adapters.text_model(model)
    layers = model.config.get_text_config().num_hidden_layers
    assert len(lm.layers) == layers
    prefix = next(n for n, m in model.named_modules() if m is lm) + "."
    if family in ("idefics3", "smolvlm", "llama4", "gemma3", "llava"):
        # q/k/v projections outside the language model (the vision tower's): a wrong lookup wraps them
        assert [n for n, m in model.named_modules()
                if isinstance(m, nn.Linear) and n.endswith(TARGETS) and not n.startswith(prefix)], family
    names = mm.attach(model, mm.AdapterConfig(method="mod"))
    assert len(names) == 4 * layers, names
    wrapped = [n for n, m in model.named_modules() if isinstance(m, mm.MoDLinear)]
    assert len(wrapped) == len(names) and all(n.startswith(prefix) for n in wrapped), wrapped
    assert not any(isinstance(m, mm.MoDLinear) for n, m in model.named_modules() if not n.startswith(prefix))


def test_text_model_copies_refuse_the_same_way():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_tower = nn.Module()
            self.vision_tower.layers = nn.ModuleList([nn.Linear(2, 2)])

    for f in (mm.text_model, backbone.text_model, adapters.text_model):
        with pytest.raises(ValueError, match="Odd: no decoder stack found"):
            f(Odd())
