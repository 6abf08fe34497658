"""A minimal LoRA (peft naming: r, lora_alpha, lora_dropout, target_modules, base_layer,
lora_A, lora_B), enough for MoLE's default trainable set: LoRA on the language model.

    names = add_lora(text_model(model), r=8, lora_alpha=16)   # wraps q/k/v/o_proj in place
"""
import math

import torch
import torch.nn as nn


class LoRALinear(nn.Module):
    """y = base_layer(x) + (lora_alpha / r) * lora_B(lora_A(dropout(x))).

    lora_A Kaiming-uniform, lora_B zeros: training starts at the base model (peft's init).
    lora_A / lora_B are fp32 whatever the base dtype (as in peft: bf16 weights would drop most
    small updates); the LoRA path computes in fp32 and is cast back to the base output dtype."""

    def __init__(self, base_layer, r=8, lora_alpha=16, lora_dropout=0.0):
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {r}")
        self.base_layer, self.r, self.scaling = base_layer, r, lora_alpha / r
        dev, dt = base_layer.weight.device, torch.float32
        self.lora_A = nn.Linear(base_layer.in_features, r, bias=False, device=dev, dtype=dt)
        self.lora_B = nn.Linear(r, base_layer.out_features, bias=False, device=dev, dtype=dt)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()

    @property
    def weight(self):  # attention code may read .weight (dtype/device checks)
        return self.base_layer.weight

    def forward(self, x):
        out = self.base_layer(x)
        return out + (self.lora_B(self.lora_A(self.dropout(x.to(self.lora_A.weight.dtype)))) * self.scaling).to(out.dtype)


def add_lora(module, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), r=8, lora_alpha=16,
             lora_dropout=0.0):
    """Replace every nn.Linear under `module` whose name ends with one of `target_modules`
    by a LoRALinear. Returns the wrapped names. Raises ValueError if nothing matched."""
    hits = [(n, m) for n, m in module.named_modules()
            if isinstance(m, nn.Linear) and n.split(".")[-1] in target_modules]
    if not hits:
        names = sorted({n.split(".")[-1] for n, m in module.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"LoRA target_modules {list(target_modules)} match no nn.Linear of the language model; "
                         f"available names: {names[:12]}")
    for name, lin in hits:
        parent = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        setattr(parent, name.rsplit(".", 1)[-1], LoRALinear(lin, r, lora_alpha, lora_dropout))
    return [n for n, _ in hits]
