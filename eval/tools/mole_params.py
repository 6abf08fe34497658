"""Trainable parameters of the MoLE toy's main arms (MoLE, plain LIVR-like latents, SFT), counted
on the built models (tiny dense base) and analytically at the paper's backbone (Qwen2.5-VL-7B,
from its config numbers: no weights) -> eval/results/mole/param_counts.json.

Mixture of Latent Experts (the paper "MoLE: Mixture of Latent Experts for Complementary Visual Reasoning") compares MoLE with plain latents
"at an equal budget": in this repository that is an equal number of latent tokens (8), not equal
trainable parameters; this tool gives the counts behind that sentence.

    python -m eval.tools.mole_params --threads 1            # -> eval/results/mole/param_counts.json
"""
import json
import os
import sys

from common.backbone import load_backbone
from common.cli import add_overwrite, add_threads, entry_parser, refuse_existing, set_threads
from common.data import atomic_write_text
from mole.checkpoint import build
from mole.train import parse_config

# the toy's main rows (eval/toys/mole.py MAIN): extra mole.train flags
ARMS = {"MoLE (E = 4, S = 4)": [], "plain latents (8)": ["--n-vis", "8", "--n-sum", "0", "--no-router", "--no-esva",
                                                         "--latent-mixing", "causal"],
        "SFT": ["--method", "sft"]}
QWEN25_VL_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4)


def analytic(shape, n_vis=4, n_sum=4, router=True, esva=True, esva_hidden=0, lora_r=8, method="mole"):
    """{part: parameters} of one arm at a decoder shape (hidden_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads): LoRA rank lora_r on q/k/v/o, latent rows (E + S) d,
    routers L E d, ESVA per layer E (2 d_v h + h + d_v + 1) with d_v = kv heads * head_dim,
    h = esva_hidden or d_v. method "sft": LoRA only."""
    d, L = shape["hidden_size"], shape["num_hidden_layers"]
    hd = d // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    out = {"lora": L * lora_r * ((d + d) + (d + kv) * 2 + (d + d))}
    if method == "sft":
        return out
    h = esva_hidden or kv
    out["latents"] = (n_vis + n_sum) * d
    out["routers"] = L * n_vis * d if router else 0
    out["esva"] = L * n_vis * (2 * kv * h + h + kv + 1) if esva else 0
    return out


def built(flags, model="tiny-dense"):
    """{part: parameters} of the model `mole.train` builds with these flags (requires_grad)."""
    cfg = parse_config(["--data", "unused", "--out", "unused", "--model", model, *flags])
    _, _, params = build(cfg, "cpu")
    parts = {"lora": 0, "latents": 0, "routers": 0, "esva": 0}
    for n, p in params.items():
        key = ("lora" if "lora_" in n else "latents" if n == "latent" else "routers" if n.startswith("routers")
               else "esva" if n.startswith("esva") else n)
        parts[key] = parts.get(key, 0) + p.numel()
    return {k: v for k, v in parts.items() if v or k == "lora"}


def main(argv=None):
    p = entry_parser(__spec__.name, "Trainable parameters of MoLE, plain latents and SFT.")
    p.add_argument("--out", default="eval/results/mole/param_counts.json", help="result file")
    add_threads(p)
    add_overwrite(p)
    a = p.parse_args(argv)
    refuse_existing(a.out, a.overwrite)  # before anything runs: no silent overwrite of a measurement
    set_threads(a.threads, "tiny-dense")
    tcfg = load_backbone("tiny-dense")[0].config.get_text_config()
    tiny = {k: getattr(tcfg, k) for k in QWEN25_VL_7B}
    rows = []
    kw = {"MoLE (E = 4, S = 4)": {}, "plain latents (8)": dict(n_vis=8, n_sum=0, router=False, esva=False),
          "SFT": dict(method="sft")}
    for arm, flags in ARMS.items():
        got = built(flags)
        want = analytic(tiny, **kw[arm])
        if {k: v for k, v in want.items() if v or k == "lora"} != got:
            print(f"error: {arm}: built {got} != formula {want}", file=sys.stderr)
            raise SystemExit(1)
        rows.append({"arm": arm, "backbone": "tiny-dense", "how": "built", "latent_tokens": 0 if arm == "SFT" else 8,
                     "trainable": sum(got.values()), **{f"n_{k}": v for k, v in got.items()}})
        big = analytic(QWEN25_VL_7B, **kw[arm])
        rows.append({"arm": arm, "backbone": "Qwen2.5-VL-7B", "how": "formula", "latent_tokens": 0 if arm == "SFT" else 8,
                     "trainable": sum(big.values()), **{f"n_{k}": v for k, v in big.items()}})
    out = {"experiment": "mole_param_counts",
           "source": "python -m eval.tools.mole_params --threads 1: the toy's main rows (eval/toys/mole.py MAIN) "
                     "built by mole.train's `build` on tiny-dense (requires_grad parameters) and the same formula at "
                     "Qwen2.5-VL-7B's shape (hidden 3584, 28 layers, 28 heads, 4 kv heads); LoRA r = 8 on q/k/v/o "
                     "in every arm (mole.train --train lora)",
           "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    atomic_write_text(a.out, json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(f"{r['backbone']:14s} {r['arm']:22s} {r['trainable']:>12,}")


if __name__ == "__main__":
    main()
