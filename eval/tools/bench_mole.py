"""Speed of MoLE vs the plain-latent (LIVR-like) baseline at the same latent budget (8).

    python -m eval.tools.bench_mole                  # tiny and 3B-like sizes, prints ratios
    python -m eval.tools.bench_mole --sizes tiny --reps 5

Both models run through the same wrapper, mask and trainer-default trainable set (LoRA r=8
on q/k/v/o + latents [+ routers + ESVAs]); the only difference is the MoLE path (routing
pre-hooks, Z_vis rows recomputed with prior and ESVA values). Measured: one training step
(forward + backward + AdamW step) and one prefill (no grad), median of --reps after one
warm-up. Sizes: "tiny" = the tiny dense Qwen3-VL (hidden 128, 4 layers, 9 visual tokens,
batch 32); "3b" = Qwen2.5-VL-3B text width (hidden 2048, 16 heads, 2 KV heads, head_dim
128, MLP 11008) with --layers-3b layers, 224 px images (64 visual tokens), batch 2.
Random weights: speed does not depend on them. Goal from the issue: MoLE step <= 1.5x plain.
Writes out/mole/bench.json.
"""
import json
import random
import statistics
import time

import numpy as np
import torch
from transformers import AutoModelForImageTextToText

from common import backbone as bb
from common import data, shapes
from common.cli import add_overwrite, entry_parser, refuse_existing
from mole.lora import add_lora
from mole.model import PLAIN_LATENT, MoLE, MoLEConfig


def build(size, layers_3b):
    """(model, proc, image_size, batch) for a size name."""
    if size == "tiny":
        model, proc = bb.build_tiny("qwen3_vl")
        return model, proc, 84, 32
    tok = bb.build_tokenizer()
    cfg = bb.tiny_config("qwen2_5_vl", tok, hidden=2048, layers=layers_3b)
    t = cfg.text_config
    t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.intermediate_size = 16, 2, 128, 11008
    t.rope_parameters = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    cfg.vision_config.out_hidden_size = 2048
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg)
    return model, bb.make_processor(tok, bb.build_image_processor(224), model.config, model.generation_config), 224, 2


def batch_inputs(n, image_size, seed=0):
    rng = random.Random(seed)
    ex = [shapes.sample_example(rng) for _ in range(n)]
    imgs = [shapes.render(s).resize((image_size, image_size)) for s, _, _, _ in ex]
    pixels = bb.patchify(torch.from_numpy(np.stack([np.asarray(im) for im in imgs])))
    return pixels, [q for _, _, q, _ in ex], [shapes.target_text(s, a, q) for s, _, q, a in ex]


def bench_size(size, reps, layers_3b, compile=False):
    """Build plain-latent and MoLE on the same base and inputs, then time them alternately
    (plain, mole, plain, ...) so that load on a shared machine hits both alike. compile: then
    MoLE.compile_hot() (as mole.train --compile) and time its cold first step and compiled steps."""
    fns, out = {}, {}
    pixels = qs = ts = None  # the same inputs for both models
    for name, cfg in (("plain_latent", MoLEConfig(n_vis=8, n_sum=0, **PLAIN_LATENT)), ("mole", MoLEConfig())):
        model, proc, image_size, B = build(size, layers_3b)
        if pixels is None:
            pixels, qs, ts = batch_inputs(B, image_size)
        model.requires_grad_(False)
        add_lora(bb.text_model(model), r=8, lora_alpha=16)
        mole = MoLE(model, proc, cfg)
        opt = torch.optim.AdamW([p for p in mole.parameters() if p.requires_grad], lr=1e-4)
        train_batch = mole.encode(None, qs, ts, pixels=pixels)
        prompt_batch = mole.encode(None, qs, pixels=pixels)

        def step(mole=mole, opt=opt, b=train_batch):
            loss = mole(b, 2)["loss"]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        def prefill(mole=mole, b=prompt_batch):
            with torch.no_grad():
                mole(b, 2)

        fns[name] = {"train_step_s": step, "prefill_s": prefill, "mole": mole}
        out[name] = {"seq_len": train_batch["input_ids"].shape[1], "batch": B, "visual_tokens":
                     int((train_batch["input_ids"][0] == proc.image_token_id).sum())}
    for what in ("train_step_s", "prefill_s"):
        times = {n: [] for n in fns}
        for r in range(reps + 1):  # the first round is a warm-up
            for n in fns:
                t = time.perf_counter()
                fns[n][what]()
                if r:
                    times[n].append(time.perf_counter() - t)
        for n in fns:
            out[n][what] = statistics.median(times[n])
    out["ratio_train_step"] = out["mole"]["train_step_s"] / out["plain_latent"]["train_step_s"]
    out["ratio_prefill"] = out["mole"]["prefill_s"] / out["plain_latent"]["prefill_s"]
    if compile:
        fns["mole"]["mole"].compile_hot()
        t = time.perf_counter()
        fns["mole"]["train_step_s"]()
        out["mole"]["cold_compile_s"] = time.perf_counter() - t
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fns["mole"]["train_step_s"]()
            times.append(time.perf_counter() - t)
        out["mole"]["compiled_train_step_s"] = statistics.median(times)
        out["mole"]["compiled_over_eager"] = out["mole"]["compiled_train_step_s"] / out["mole"]["train_step_s"]
    return out


def main(argv=None):
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--sizes", default="tiny,3b", help="comma list of sizes: tiny, 3b")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (median)")
    p.add_argument("--layers-3b", type=int, default=2, help="decoder layers of the 3B-like size")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--out", default="out/mole/bench.json", help="where to write the measurements")
    p.add_argument("--compile", action="store_true", help="also time MoLE with its hot functions compiled (cold-"
                   "compile seconds, compiled / eager train-step ratio; minutes of CPU)")
    add_overwrite(p)
    a = p.parse_args(argv)
    refuse_existing(a.out, a.overwrite)  # before anything runs: no silent overwrite of a measurement
    if a.threads:
        torch.set_num_threads(a.threads)
    res = {"device": "cpu", "threads": torch.get_num_threads()}
    print(f"{'size':6s} {'model':13s} {'train step s':>12s} {'prefill s':>10s}")
    for size in a.sizes.split(","):
        r = res[size] = bench_size(size, a.reps, a.layers_3b, a.compile)
        for name in ("plain_latent", "mole"):
            print(f"{size:6s} {name:13s} {r[name]['train_step_s']:12.4f} {r[name]['prefill_s']:10.4f}")
        print(f"{size:6s} {'MoLE / plain':13s} {r['ratio_train_step']:11.2f}x {r['ratio_prefill']:9.2f}x"
              f"   (goal: train step <= 1.5x)")
        if a.compile:
            m = r["mole"]
            print(f"{size:6s} MoLE compiled: cold compile + first step {m['cold_compile_s']:.1f} s, train step "
                  f"{m['compiled_train_step_s']:.4f} s, compiled / eager {m['compiled_over_eager']:.2f}")
    data.atomic_write_text(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
