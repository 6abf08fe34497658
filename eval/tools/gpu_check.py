"""GPU readiness check (a few minutes on one GPU; not a test). Skips cleanly without CUDA.

    python -m eval.tools.gpu_check                      # one GPU: every check, figures to
                                                        # eval/results/gpu_check/<device name>.json (commit it)
    python -m eval.tools.gpu_check --device cpu --width 64 --out out/gpu_check_cpu.json   # the same code paths on CPU

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
  pipelines      each method's pipeline through its entry points (their `main`, what `python -m` runs), with
                 `--device` (and `--dtype bfloat16` wherever a model is loaded for inference; the trainers
                 train under bf16 autocast on CUDA; float32 on CPU) on random-init bases of hidden `--width`:
                 mod.data -> mod.train -> mod.infer (Qwen2.5-VL); mole.train -> mole.infer -> mole.diagnostics
                 (Qwen2.5-VL); rolemerge.calibrate -> rolemerge.merge -> rolemerge.infer -> eval.evaluate
                 (Qwen3-VL-MoE). Seconds per command.
  mod_decode_speed  MoD's greedy decoding per token against peft's LoRA (rank 16; our LoRA where peft is
                 not installed) and the bare model, on a random bf16 Qwen3-VL of hidden `--width`, context
                 64, with and without `torch.compile` of the adapters' decoding step (`compile_adapters`)
Exit status: 0 all ok or skipped (no CUDA: everything skipped), 1 if a check failed.
"""
import copy
import importlib
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext

import torch

from common import data, shapes
from common.backbone import build_tiny, save_backbone
from common.cli import add_overwrite, entry_parser, fail, refuse_existing
from common.data import atomic_write_text
from eval.tools.bench_mod_decode import variants
from mod.model import AdapterConfig, attach, compile_adapters, routing_context
from mod.train import Batcher, TrainConfig, fit
from mole.model import MoLE, MoLEConfig
from rolemerge import calibrate as cal
# deferred: peft (optional, not in requirements.txt: peft's LoRA is compared where it is installed)

CHECKS = ("mod_bf16", "mod_compile", "mod_decode", "mole_bf16", "rolemerge_map", "ddp", "pipelines",
          "mod_decode_speed")
WIDTH = 2048   # hidden size of the random bases of `pipelines` and `mod_decode_speed` (Qwen2.5-VL-3B's)


class Skip(Exception):
    """A check that cannot run here; the message says why."""


def _tiny_mod(device, tmp, method="mod"):
    shapes.generate_split(tmp, "train", 16)
    records = data.read_records(os.path.join(tmp, "train.json"))
    base, proc = build_tiny("qwen2_5_vl", hidden=64, layers=2)
    attach(base.to(device), AdapterConfig(method=method, window=4))
    return base, proc, records


def check_mod_bf16(device, tmp, steps):
    model, proc, records = _tiny_mod(device, tmp)
    res = fit(model, proc, records, os.path.join(tmp, "mod_bf16"), TrainConfig(steps=steps, batch_size=4, log_every=1),
              quiet=True)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
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
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model, proc, records = _tiny_mod(device, tmp)
        t = time.perf_counter()
        res = fit(model, proc, records, os.path.join(tmp, f"mod_c{compiled}"),
                  TrainConfig(steps=steps, batch_size=4, log_every=1, compile=compiled), quiet=True)
        log = res["log"]        # "s" is rounded to 10 ms: average over the steps after the first two
        out["compiled" if compiled else "eager"] = (log[-1]["s"] - log[1]["s"]) / max(len(log) - 2, 1)
        if compiled:
            out["cold_compile_first_step_s"] = res["log"][0]["s"] if res["log"] else time.perf_counter() - t
    out["compiled_over_eager"] = out["compiled"] / out["eager"]
    return out


def check_mod_decode(device, tmp, steps):
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


def run_entry(module, argv):
    """`python -m module argv` in this process (module.main(argv)); returns its seconds. An exit
    status other than 0 (argparse, `error: ...`) raises AssertionError naming the command."""
    t = time.perf_counter()
    try:
        importlib.import_module(module).main(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise AssertionError(f"python -m {module} {' '.join(argv)}: exit status {e.code}") from None
    return time.perf_counter() - t


def pipeline_commands(device, tmp, steps, dense, moe):
    """[(module, argv)] of the three methods' pipelines on the saved bases `dense` (Qwen2.5-VL)
    and `moe` (Qwen3-VL-MoE), shapes data in tmp/data, every output under tmp."""
    j = lambda *p: os.path.join(tmp, *p)
    train, test = j("data", "train.json"), j("data", "test.json")
    dev = ["--device", str(device), "--threads", "1" if device.type == "cpu" else "0"]
    # bf16 inference on CUDA; float32 on CPU, where torch's bf16 attention needs AVX-512 (under
    # ATEN_CPU_CAPABILITY=avx2 / default, sdpa raises "pack_vnni2 is only supported when avx512 is supported")
    bf = dev + ["--dtype", "bfloat16" if device.type == "cuda" else "float32"]
    return [
        ("mod.data", ["--model", dense, "--data", train, "--out", j("vs.json"), "--num-return-sequences", "2",
                      "--limit", "4", "--max-new-tokens", "8", *bf]),
        ("mod.train", ["--model", dense, "--data", j("vs.json"), "--out", j("mod"), "--steps", str(steps),
                       "--batch-size", "2", *dev]),
        ("mod.infer", ["--model", dense, "--adapter", j("mod"), "--data", test, "--methods", "single,multi",
                       "--max-new-tokens", "8", "--out", j("mod_infer.json"), *bf]),
        ("mole.train", ["--model", dense, "--data", j("data"), "--out", j("mole"), "--max-steps", str(steps),
                        "--batch-size", "2", "--quiet", *dev]),
        ("mole.infer", ["--ckpt", j("mole"), "--data", test, "--max-new-tokens", "8", "--out", j("mole_infer.json"),
                        *bf]),
        ("mole.diagnostics", ["--ckpt", j("mole"), "--data", test, "--limit", "2", "--out", j("mole_diag.json"), *bf]),
        ("rolemerge.calibrate", ["--model", moe, "--data", test, "--out", j("stats.safetensors"), "--max-new-tokens",
                                 "8", *bf]),
        ("rolemerge.merge", ["--model", moe, "--stats", j("stats.safetensors"), "--out", j("merged"), "--rho", "0.5"]),
        ("rolemerge.infer", ["--model", j("merged"), "--data", test, "--max-new-tokens", "8", "--speed", *bf]),
        ("eval.evaluate", ["--model", j("merged"), "--data", test, "--max-new-tokens", "8", "--out", j("eval.json"),
                           *bf]),
    ]


def check_pipelines(device, tmp, steps, width=WIDTH):
    shapes.generate_split(os.path.join(tmp, "data"), "train", 8)
    shapes.generate_split(os.path.join(tmp, "data"), "test", 4)
    dense, moe = os.path.join(tmp, "dense"), os.path.join(tmp, "moe")
    save_backbone(*build_tiny("qwen2_5_vl", hidden=width, layers=2), dense)
    save_backbone(*build_tiny("qwen3_vl_moe", hidden=width, layers=2, expert_width=max(width // 4, 16)), moe)
    return {"width": width, "seconds": {m: round(run_entry(m, argv), 2)
                                        for m, argv in pipeline_commands(device, tmp, steps, dense, moe)}}


class _SyncClock:
    """Logits processor that timestamps every generated token after the device has finished it."""

    def __init__(self, device):
        self.t, self.device = [], device

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t.append(time.perf_counter())
        return scores


def check_mod_decode_speed(device, tmp, steps, width=WIDTH, context=64, rounds=5):
    try:
        import peft
    except ImportError:    # optional: our LoRA is the reference then (named in the result)
        peft = None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = build_tiny("qwen3_vl", hidden=width, layers=2)[0].to(device, dtype).eval()
    models = variants(base, ["q_proj", "k_proj", "v_proj", "o_proj"], peft)
    models["MoD compiled"] = copy.deepcopy(models["MoD"])
    compile_adapters(models["MoD compiled"])
    ids = torch.randint(0, min(400, base.config.get_text_config().vocab_size), (1, context),
                        generator=torch.Generator().manual_seed(0)).to(device)
    ts = {k: [] for k in models}
    for r in range(rounds + 1):                          # round 0: warm-up (and the cold compile)
        for k, m in models.items():
            clock = _SyncClock(device)
            with torch.no_grad():
                m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1,
                           min_new_tokens=steps + 1, do_sample=False, logits_processor=[clock], pad_token_id=0)
            if r:
                ts[k] += [b - a for a, b in zip(clock.t[1:], clock.t[2:])]   # skip the prefill's token
    ms = {k: 1e3 * statistics.median(v) for k, v in ts.items()}
    ref = "peft LoRA" if peft is not None else "our LoRA"
    return {"width": width, "dtype": str(dtype), "context": context, "reference": ref,
            "ms_per_token": {k: round(v, 4) for k, v in ms.items()}, "mod_over_ref": ms["MoD"] / ms[ref],
            "mod_compiled_over_ref": ms["MoD compiled"] / ms[ref], "mod_over_bare": ms["MoD"] / ms["bare"]}


def default_out(device):
    """eval/results/gpu_check/<device name>.json: the results are committed under the device's name."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return os.path.join(os.path.dirname(__file__), "..", "results", "gpu_check", f"{slug}.json")


def main(argv=None):
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--device", default="cuda", help="cuda (default; skipped without a GPU) or cpu for a smoke run")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {CHECKS}")
    p.add_argument("--steps", type=int, default=30, help="train steps per timing check")
    p.add_argument("--width", type=int, default=WIDTH, help="hidden size of the random bases of pipelines and "
                   "mod_decode_speed")
    p.add_argument("--out", default="", help="where the figures go (JSON; default "
                   "eval/results/gpu_check/<device name>.json)")
    add_overwrite(p)
    a = p.parse_args(argv)
    bad = [c for c in a.checks.split(",") if c not in CHECKS]
    if bad:
        fail(f"unknown checks {bad}; choose from {CHECKS}")
    refuse_existing(a.out, a.overwrite)  # before anything runs: no silent overwrite of a measurement
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: skipped, no CUDA device (pass --device cpu for a smoke run of the same code paths)")
        return {"skipped": "no CUDA device"}
    out = a.out or default_out(device)
    refuse_existing(out, a.overwrite)  # the device-named default output, known once the device is
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "checks": {}}
    for name in a.checks.split(","):
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                fn = globals()[f"check_{name}"]
                kw = {"width": a.width} if name in ("pipelines", "mod_decode_speed") else {}
                r = {"status": "ok", **fn(device, tmp, a.steps, **kw)}
            except Skip as e:
                r = {"status": "skipped", "why": str(e)}
            except Exception as e:                         # report and go on: one failure must not hide the rest
                r = {"status": "failed", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        r["seconds"] = time.perf_counter() - t
        res["checks"][name] = r
        print(f"{name:14s} {r['status']:8s} {json.dumps({k: v for k, v in r.items() if k not in ('status', 'trace')})}")
    atomic_write_text(out, json.dumps(res, indent=1))
    if any(r["status"] == "failed" for r in res["checks"].values()):
        sys.exit(1)
    return res


if __name__ == "__main__":
    main()
