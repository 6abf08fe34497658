"""Cross-check of MoD's LoRA baseline against peft's own loader and saver (not a test; peft
is not a dependency of this repository: run it from a venv that has peft).

    out/venv-peft/bin/python -m eval.tools.bench_peft      # any venv with torch, transformers, peft

1. ours -> peft: attach our LoRA (random A and B) to the tiny Qwen2.5-VL, `mod.model.save_peft`,
   then `peft.PeftModel.from_pretrained(fresh base, dir)`; logits must equal ours.
2. peft -> ours: `peft.get_peft_model` with a LoraConfig on the same modules (random B),
   `save_pretrained`, then `mod.model.load_adapters(fresh base, dir)` (dispatches to load_peft);
   logits must equal peft's.
Prints the max |logit difference| of both directions and exits 1 if either exceeds 1e-5.
"""
import random
import sys
import tempfile

import torch

from common import shapes
from common.backbone import build_tiny
from mod.model import AdapterConfig, attach, load_adapters, save_peft
# deferred: peft (optional, not in requirements.txt: run from a venv with peft)


def batch(proc):
    rng = random.Random(0)
    ex = [shapes.sample_example(rng) for _ in range(2)]
    return proc.encode([shapes.render(s) for s, _, _, _ in ex], [q for _, _, q, _ in ex])


def fresh():
    model, proc = build_tiny("qwen2_5_vl", hidden=64, layers=2, seed=0)
    return model.eval(), proc


def main():
    if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
        print(__doc__)
        return {}
    try:
        import peft
    except ImportError:
        print("error: peft is not installed in this venv (it is not a dependency of this repository); run this "
              "from a venv with peft: python -m venv --system-site-packages out/venv-peft && "
              "out/venv-peft/bin/pip install peft", file=sys.stderr)
        raise SystemExit(2)
    torch.manual_seed(0)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        ours, proc = fresh()
        attach(ours, AdapterConfig(method="lora", r=4, lora_alpha=8.0))
        with torch.no_grad():
            for n, p in ours.named_parameters():
                if p.requires_grad:
                    p.normal_(std=0.1)
        b = batch(proc)
        with torch.no_grad():
            want = ours(**b).logits
        with torch.no_grad():
            res["lora_effect"] = float((fresh()[0](**b).logits - want).abs().max())   # the adapter matters
        save_peft(ours, d)
        pm = peft.PeftModel.from_pretrained(fresh()[0], d).eval()
        with torch.no_grad():
            got = pm(**b).logits
        res["ours->peft"] = float((got - want).abs().max())
    with tempfile.TemporaryDirectory() as d:
        base, proc = fresh()
        mods = [n for n, _ in ours.named_modules() if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                and "language_model" in n and not n.endswith("base_layer")]
        pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=mods, lora_dropout=0.0))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.1)
        pm.eval()
        b = batch(proc)
        with torch.no_grad():
            want = pm(**b).logits
        pm.save_pretrained(d)
        mine, _ = fresh()
        cfg = load_adapters(mine, d)
        with torch.no_grad():
            got = mine(**b).logits
        res["peft->ours"] = float((got - want).abs().max())
        res["peft_loaded_as"] = f"{cfg.method} r={cfg.r} alpha={cfg.lora_alpha} on {len(cfg.target_modules)} modules"
    print(f"peft {peft.__version__}: max |logit diff| ours->peft {res['ours->peft']:.2e}, peft->ours "
          f"{res['peft->ours']:.2e} ({res['peft_loaded_as']}); goal <= 1e-5; the adapter moves the logits by "
          f"{res['lora_effect']:.2e} (so a load that dropped it would show)")
    if max(res["ours->peft"], res["peft->ours"]) > 1e-5 or res["lora_effect"] < 1e-3:
        sys.exit(1)
    return res


if __name__ == "__main__":
    main()
