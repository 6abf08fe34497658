"""Trainable-parameter counts of the MoD / LoRA / MoE-LoRA adapters from a model's shapes alone.

Mixture of Debaters (arXiv 2606.29425) compares MoD and MoE-LoRA "at the same learnable
parameter scale (12M)" (§4, Fig. 4). The counts follow `mod.model.MoDLinear`'s parameters per
wrapped projection with `in` input and `out` output features:

    mod      E (in + out) + E in (router A) + E in (router B, absent with shared_router)
    lora     r (in + out)
    moelora  E k (in + out) + E in (router)          (k = expert_rank)

`attention_shapes(config)` reads the projection shapes of q/k/v/o from a transformers config
(a VLM's text config included), so a count needs no weights. `MOELORA_MATCHED` is the MoE-LoRA
setting `mod.train` uses by default: 11 coupled rank-1 experts, top-r = 4 as MoD (the same
active rank; the one difference left is the coupling of A and B). Its count relative to MoD
(E = 8): tiny-chat +0.8 %, Qwen2.5-VL-3B -1.1 %, Qwen2.5-VL-7B -1.0 %, LLaVA-1.6-13B +3.1 %.
With multi-head attention (every projection d -> d) MoD has 32 d per projection and MoE-LoRA
E (2k + 1) d, and E (2k + 1) = 32 has no integer solution with k >= 1: +-3.125 % (33 or 31) is
the closest any uniform (E, k) gets there (`best_moelora`). `matched_moelora` gives one
projection kind one expert less (`--experts-pattern k_proj=10`, as peft's rank_pattern):
+0.78 %. `python -m mod.params --model PATH` prints the matching flags for any checkpoint.
"""
import argparse
import itertools
import json
import os

from transformers import AutoConfig, LlamaConfig, LlavaNextConfig, Qwen2_5_VLConfig

from common.cli import RunError, add_overwrite, check_overwrite
from common.data import atomic_write_text
from common.tiny import TINY   # tiny-chat, tiny-dense, tiny-moe as every --model takes them
from mod.model import AdapterConfig

MOELORA_MATCHED = dict(num_experts=11, expert_rank=1)


def attention_shapes(config, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")):
    """[(module, in_features, out_features)] of every decoder layer's attention projection named
    in `target_modules`, from a transformers config (`config.get_text_config()` for a VLM):
    hidden_size, num_attention_heads, num_key_value_heads (default: the heads), head_dim
    (default hidden_size // heads), num_hidden_layers. One entry per layer and module.
    Raises ValueError for a module other than q/k/v/o_proj."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    h = c.hidden_size
    shape = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h)}
    bad = [m for m in target_modules if m not in shape]
    if bad:
        raise ValueError(f"attention_shapes: {bad} not one of {sorted(shape)}")
    return [(m, *shape[m]) for _ in range(c.num_hidden_layers) for m in target_modules]


def adapter_params(cfg, shapes):
    """Trainable parameters of AdapterConfig `cfg` wrapped around projections `shapes`
    [(name, in, out)] (as `mod.model.num_trainable` counts them after `attach`)."""
    total = 0
    for name, din, dout in shapes:
        E, k = cfg.layer_config(name).num_experts, cfg.expert_rank
        if cfg.method == "mod":
            total += E * (din + dout) + E * din * (1 if cfg.shared_router else 2)
        elif cfg.method == "lora":
            total += cfg.r * (din + dout)
        else:
            total += E * k * (din + dout) + E * din
    return total


def best_moelora(shapes, target, max_experts=32, max_rank=32, r=4):
    """The MoE-LoRA (num_experts E >= r, expert_rank k) of at most `max_experts` / `max_rank`
    whose count on `shapes` is closest to `target`: (E, k, count, relative difference)."""
    best = None
    for E in range(r, max_experts + 1):
        for k in range(1, max_rank + 1):
            n = adapter_params(AdapterConfig(method="moelora", num_experts=E, expert_rank=k, r=r), shapes)
            if best is None or abs(n - target) < abs(best[2] - target):
                best = (E, k, n, n / target - 1)
    return best


def matched_moelora(shapes, cfg=None, expert_rank=1, r=4, tol=0.02):
    """The MoE-LoRA that matches MoD's trainable parameters on `shapes`: E0 = the closest uniform
    expert count, then the fewest per-projection overrides (each q/k/v/o_proj kind gets
    E0 - 1, E0 or E0 + 1) that bring the count within `tol` of MoD's, the closest among those
    (the closest overall when none is within tol). `cfg`: MoD's AdapterConfig (default
    AdapterConfig()). Returns (num_experts E0, experts_pattern {module: E}, count, relative
    difference to MoD). Qwen2.5-VL-3B: (11, {}, -1.10 %); LLaVA-1.6-13B (every projection d -> d,
    where no uniform E is within 3.1 %): (11, {"k_proj": 10}, +0.78 %)."""
    target = adapter_params(cfg or AdapterConfig(), shapes)
    kinds = sorted({m for m, _, _ in shapes})
    count = lambda E, pat: adapter_params(AdapterConfig(method="moelora", num_experts=E, experts_pattern=pat,
                                                        expert_rank=expert_rank, r=r, target_modules=kinds), shapes)
    E0 = min(range(r, 257), key=lambda E: abs(count(E, {}) - target))
    best = None
    for combo in itertools.product((E0 - 1, E0, E0 + 1), repeat=len(kinds)):
        if min(combo) < r:   # top-r needs at least r experts
            continue
        pat = {m: e for m, e in zip(kinds, combo) if e != E0}
        n = count(E0, pat)
        off = abs(n / target - 1)
        key = (off > tol, len(pat) if off <= tol else 0, off)
        if best is None or key < best[0]:
            best = (key, pat, n)
    return E0, best[1], best[2], best[2] / target - 1


def pattern_flags(E, pattern):
    """The mod.train flags of a MoE-LoRA (E, experts_pattern) beside --method moelora."""
    flags = [] if E == MOELORA_MATCHED["num_experts"] else [f"--num-experts {E}"]
    if pattern:
        flags.append("--experts-pattern " + ",".join(f"{m}={e}" for m, e in sorted(pattern.items())))
    return " ".join(flags)


# the bases of the paper's Table 1 and its 12M statement, by config numbers (transformers' config classes)
BASES = {"Qwen2.5-VL-3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                               num_key_value_heads=2, vocab_size=151936),
         "Qwen2.5-VL-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                               num_key_value_heads=4, vocab_size=152064),
         "LLaVA-1.6-13B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                               num_key_value_heads=40, vocab_size=32064)}


def base_config(name):
    """The transformers config of one of BASES (no weights, no hub access)."""
    if name.startswith("LLaVA"):
        return LlavaNextConfig(text_config=LlamaConfig(**BASES[name]))
    return Qwen2_5_VLConfig(text_config=dict(BASES[name]))


def main(argv=None):
    """python -m mod.params [--out FILE]: MoD / MoE-LoRA / LoRA counts at BASES and tiny-chat."""
    p = argparse.ArgumentParser(prog="python -m mod.params", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="", help="also write the rows as a result file (eval/report.py format)")
    add_overwrite(p)
    p.add_argument("--model", default="", metavar="PATH",
                   help="a checkpoint directory (its config.json only): print the MoE-LoRA flags matching MoD there")
    p.add_argument("--flags", action="store_true", help="with --model: print only the mod.train flags "
                   "(for $(python -m mod.params --model PATH --flags) in a recipe)")
    a = p.parse_args(argv)
    if a.flags and not a.model:
        p.error("--flags prints the flags for a checkpoint: pass --model PATH too")
    if a.model and a.out:
        p.error("--out writes the table of the paper's bases; leave out --model")
    try:
        check_overwrite(a.out, a.overwrite)
    except RunError as e:
        p.error(str(e))
    if a.model:
        path = TINY.get(a.model, a.model)
        if not os.path.isdir(path):
            p.exit(2, f"error: --model {a.model}: no such directory (pass a checkpoint directory or a tiny base "
                      f"name: {', '.join(TINY)})\n")
        if not os.path.isfile(os.path.join(path, "config.json")):
            p.exit(2, f"error: --model {a.model}: no config.json there (pass a checkpoint directory)\n")
        try:
            shapes = attention_shapes(AutoConfig.from_pretrained(path))
        except (OSError, ValueError, AttributeError) as e:
            p.exit(2, f"error: --model {a.model}: cannot read its attention shapes ({e})\n")
        E, pat, n, rel = matched_moelora(shapes)
        if a.flags:
            print(f"--method moelora {pattern_flags(E, pat)}".rstrip())
            return
        print(f"MoD (E = 8, top-4): {adapter_params(AdapterConfig(), shapes):,} trainable; MoE-LoRA matched: "
              f"{n:,} ({rel:+.2%}) with: --method moelora {pattern_flags(E, pat)}".rstrip())
        return
    configs = {**{n: base_config(n) for n in BASES},
               "tiny-chat": AutoConfig.from_pretrained(os.path.join(os.path.dirname(__file__), "..", "common", "tiny", "chat"))}
    arms = {"MoD (E = 8, top-4)": AdapterConfig(),
            "MoE-LoRA default (11 rank-1 experts, top-4)": AdapterConfig(method="moelora", **MOELORA_MATCHED),
            "MoE-LoRA, 8 rank-1 experts (the earlier default)": AdapterConfig(method="moelora"),
            "MoE-LoRA, 4 experts of rank 4 (the toy's)": AdapterConfig(method="moelora", num_experts=4, expert_rank=4, r=2)}
    rows = []
    for base, config in configs.items():
        shapes = attention_shapes(config)
        ref = adapter_params(arms["MoD (E = 8, top-4)"], shapes)
        E, pat, _, _ = matched_moelora(shapes)
        matched = {"MoE-LoRA matched (the recipe's flags, `mod.params --model`)":
                   AdapterConfig(method="moelora", num_experts=E, experts_pattern=pat)}
        for arm, cfg in {**arms, **matched}.items():
            n = adapter_params(cfg, shapes)
            flags = pattern_flags(E, pat) if arm in matched else ""
            rows.append({"kind": "count", "backbone": base, "arm": arm, "trainable": n, "vs_mod": round(n / ref - 1, 4),
                         "flags": f" `{flags}`" if flags else ""})
            print(f"{base:14s} {arm:60s} {n:>12,} {n / ref - 1:+.2%} {flags}")
    if a.out:
        atomic_write_text(a.out, json.dumps({"experiment": "mod_param_counts", "source": "python -m mod.params --out "
                                             f"{a.out}: trainable parameters on q/k/v/o from the bases' config numbers "
                                             "(mod.params.adapter_params; equal to attach on the meta device, "
                                             "tests/test_mod_params.py)", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
