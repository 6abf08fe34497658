"""GPU readiness check (a few minutes on one GPU; not a test). Skips cleanly without CUDA.

    python -m eval.tools.gpu_check                      # one GPU: every check, figures to out/gpu_check.json
    python -m eval.tools.gpu_check --device cpu         # the same code paths on CPU (smoke run, slow)

Checks, each reported as ok / skipped / failed with its figures:
  mod_bf16       MoD train steps under bf16 autocast on the tiny base (mod.train.fit): loss finite,
                 router maths in fp32 (the load-balance loss, built from the router softmax, is fp32)
  mod_compile    the same steps with the hot-path compile (mod.train --compile): cold-compile
                 seconds and compiled / eager median step ratio
  mod_decode     cached decoding parity in bf16: logits of greedy `generate` (routing cache)
                 vs one full forward over the generated sequence (max |diff|, argmax agreement)
  mole_bf16      one MoLE stage-2 train step under bf16 autocast: loss finite, router aux fp32
  rolemerge_map  RoleMerge calibration of tiny-moe with --device-map auto (needs the optional
                 package accelerate: reported as skipped with that message when it is missing)
  ddp            a 1-process `torchrun` DDP run of mod.train (2 steps)
Exit status: 0 all ok or skipped (no CUDA: everything skipped), 1 if a check failed.
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext

import torch

CHECKS = ("mod_bf16", "mod_compile", "mod_decode", "mole_bf16", "rolemerge_map", "ddp")


class Skip(Exception):
    """A check that cannot run here; the message says why."""


def _tiny_mod(device, tmp, method="mod"):
    from common import data
    from common import shapes
    from common.backbone import build_tiny
    from mod.model import AdapterConfig, attach
    shapes.generate_split(tmp, "train", 16)
    records = data.read_records(os.path.join(tmp, "train.json"))
    base, proc = build_tiny("qwen2_5_vl", hidden=64, layers=2)
    attach(base.to(device), AdapterConfig(method=method, window=4))
    return base, proc, records


def check_mod_bf16(device, tmp, steps):
    from mod.model import routing_context
    from mod.train import fit
    model, proc, records = _tiny_mod(device, tmp)
    res = fit(model, proc, records, os.path.join(tmp, "mod_bf16"), steps=steps, batch_size=4, quiet=True, log_every=1)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    from mod.train import Batcher
    batch = Batcher(proc, records).encode(records[:2], answers=[r["target"] for r in records[:2]])
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    model.train()
    with amp:
        model(**batch)
    aux = routing_context(model).aux
    if not all(torch.isfinite(torch.tensor(r["loss"])) for r in res["log"]):
        raise AssertionError(f"non-finite loss: {[r['loss'] for r in res['log']]}")
    if not aux or any(a.dtype != torch.float32 for a in aux):
        raise AssertionError(f"router aux dtypes {[a.dtype for a in aux]} (want float32)")
    return {"loss_first": res["log"][0]["loss"], "loss_last": res["log"][-1]["loss"],
            "eager_step_s": (res["log"][-1]["s"] - res["log"][0]["s"]) / max(len(res["log"]) - 1, 1)}


def check_mod_compile(device, tmp, steps):
    from mod.train import fit
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model, proc, records = _tiny_mod(device, tmp)
        t = time.perf_counter()
        res = fit(model, proc, records, os.path.join(tmp, f"mod_c{compiled}"), steps=steps, batch_size=4, quiet=True,
                  log_every=1, compile=compiled)
        log = res["log"]        # "s" is rounded to 10 ms: average over the steps after the first two
        out["compiled" if compiled else "eager"] = (log[-1]["s"] - log[1]["s"]) / max(len(log) - 2, 1)
        if compiled:
            out["cold_compile_first_step_s"] = res["log"][0]["s"] if res["log"] else time.perf_counter() - t
    out["compiled_over_eager"] = out["compiled"] / out["eager"]
    return out


def check_mod_decode(device, tmp, steps):
    from common import data
    from common import shapes
    model, proc, records = _tiny_mod(device, tmp)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.normal_(std=0.05)                    # B starts at zero: make the adapters matter
    model = model.to(torch.bfloat16).eval()
    enc = proc.encode([data.load_image(r["image"]) for r in records[:2]], [r["question"] for r in records[:2]],
                      padding_side="left")
    enc = {k: v.to(device) if torch.is_tensor(v) else v for k, v in enc.items()}
    enc["pixel_values"] = enc["pixel_values"].to(torch.bfloat16)
    with torch.no_grad():
        g = model.generate(**enc, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
        seq = g.sequences
        P, new = enc["input_ids"].shape, seq[:, enc["input_ids"].shape[1]:]
        ext = {k: torch.cat([v, (torch.ones_like if k == "attention_mask" else torch.zeros_like)(new).to(v.dtype)], 1)
               for k, v in enc.items() if torch.is_tensor(v) and v.shape == P and k != "input_ids"}   # mask, types
        full = model(**dict(enc, **ext, input_ids=seq)).logits
    T = len(g.logits)
    cached = torch.stack(g.logits, 1).float()                      # [B, T, V]
    ref = full[:, -T - 1:-1].float()
    return {"max_abs_diff": float((cached - ref).abs().max()), "logit_scale": float(ref.abs().max()),
            "argmax_agree": float((cached.argmax(-1) == ref.argmax(-1)).float().mean())}


def check_mole_bf16(device, tmp, steps):
    import random
    from common import data
    from common import shapes
    from common.backbone import build_tiny
    from mole.model import MoLE, MoLEConfig
    model, proc = build_tiny("qwen3_vl", layers=2)
    model.requires_grad_(False)
    mole = MoLE(model.to(device), proc, MoLEConfig())
    rng = random.Random(0)
    ex = [shapes.sample_example(rng) for _ in range(4)]
    b = mole.encode([shapes.render(s) for s, _, _, _ in ex], [q for _, _, q, _ in ex],
                    [shapes.target_text(s, a, q) for s, _, q, a in ex])
    b = {k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()}
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with amp:
        res = mole(b, 2)
    res["loss"].backward()
    if not torch.isfinite(res["loss"]):
        raise AssertionError(f"non-finite loss {res['loss']}")
    if res["balance"].dtype != torch.float32 or res["z"].dtype != torch.float32:
        raise AssertionError(f"router aux dtypes {res['balance'].dtype} / {res['z'].dtype} (want float32)")
    return {"loss": float(res["loss"]), "balance": float(res["balance"])}


def check_rolemerge_map(device, tmp, steps):
    from rolemerge import calibrate as cal
    if importlib.util.find_spec("accelerate") is None:
        try:
            cal.load_model("tiny-moe", device_map="auto")
        except cal.CalibrationError as e:
            raise Skip(str(e)) from None
    model, proc = cal.load_model("tiny-moe", device_map="auto")
    recs = [{"question": "how many shapes?"}, {"question": "is there a red circle?"}]
    stats = cal.calibrate(model, proc.tokenizer if hasattr(proc, "tokenizer") else proc, {"a": recs}, batch_size=2,
                          max_new_tokens=4, progress=False)
    return {"devices": sorted({str(p.device) for p in model.parameters()}),
            "tokens": {b: int(t) for b, t in zip(stats["buckets"], stats["sources"]["a"]["tokens"].tolist())}}


def check_ddp(device, tmp, steps):
    from common import data
    from common import shapes
    from common.backbone import build_tiny, save_backbone
    if device.type != "cuda":
        raise Skip("the DDP check runs on CUDA only")
    base, proc = build_tiny("qwen2_5_vl", hidden=64, layers=2)
    save_backbone(base, proc, os.path.join(tmp, "base"))
    shapes.generate_split(os.path.join(tmp, "ddp_data"), "train", 8)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "mod.train", "--model",
           os.path.join(tmp, "base"), "--data", os.path.join(tmp, "ddp_data", "train.json"), "--out",
           os.path.join(tmp, "ddp_run"), "--steps", "2", "--batch-size", "2", "--device", "cuda"]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise AssertionError(f"torchrun exited {r.returncode}: {r.stderr[-1500:]}")
    return {"wall_s": time.perf_counter() - t}


def main(argv=None):
    from common.cli import entry_parser
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--device", default="cuda", help="cuda (default; skipped without a GPU) or cpu for a smoke run")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {CHECKS}")
    p.add_argument("--steps", type=int, default=30, help="train steps per timing check")
    p.add_argument("--out", default="out/gpu_check.json", help="where the figures go (JSON)")
    from common.cli import add_overwrite, check_overwrite, fail
    add_overwrite(p)
    a = p.parse_args(argv)
    try:  # before anything runs: no silent overwrite of a measurement
        check_overwrite(a.out, a.overwrite)
    except ValueError as e:
        fail(e)
    from common.cli import fail
    bad = [c for c in a.checks.split(",") if c not in CHECKS]
    if bad:
        fail(f"unknown checks {bad}; choose from {CHECKS}")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: skipped, no CUDA device (pass --device cpu for a smoke run of the same code paths)")
        return {"skipped": "no CUDA device"}
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "checks": {}}
    for name in a.checks.split(","):
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                r = {"status": "ok", **globals()[f"check_{name}"](device, tmp, a.steps)}
            except Skip as e:
                r = {"status": "skipped", "why": str(e)}
            except Exception as e:                         # report and go on: one failure must not hide the rest
                r = {"status": "failed", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        r["seconds"] = time.perf_counter() - t
        res["checks"][name] = r
        print(f"{name:14s} {r['status']:8s} {json.dumps({k: v for k, v in r.items() if k not in ('status', 'trace')})}")
    from common.data import atomic_write_text
    atomic_write_text(a.out, json.dumps(res, indent=1))
    if any(r["status"] == "failed" for r in res["checks"].values()):
        sys.exit(1)
    return res


if __name__ == "__main__":
    main()
