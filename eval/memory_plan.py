"""Memory and time plan for real checkpoints: measure at 1 and 2 decoder layers, extrapolate.

    python -m eval.memory_plan --threads 1                       # every measurement, then the plan
    python -m eval.memory_plan --models qwen2_5_vl_3b --jobs mod  # a subset
    python -m eval.memory_plan --plan-only                        # print the plan from out/memory_plan.json

What it measures. Random-init models at the REAL widths of Qwen2.5-VL-3B-Instruct,
Qwen2.5-VL-7B-Instruct and Qwen3-VL-30B-A3B-Instruct (hidden size, heads, KV heads, MLP /
expert widths, expert count, vocabulary, the whole vision tower: `REAL`, copied from the public
config.json files) but with 1 or 2 decoder layers, in bf16 (a real checkpoint loads in its own
bf16; the training scripts add bf16 autocast on CUDA, mimicked here on CPU), fed one 448x448
image per sample through the checkpoint's own image-processor settings, run:

    mod        one `mod.train` step (MoD adapters, the trainer's defaults: r 4, 8 experts, q/k/v/o)
    mole1/2    one `mole.train` step in stage 1 / stage 2 (LoRA r 8 on q/k/v/o + MoLE E 4, S 4, K 2)
    mole_full  one `mole.train --train full` step in stage 2 (the whole language model trains)
    calib      one `rolemerge.calibrate` batch (prefill + 32 greedy tokens, routing recorded)

Each measurement runs in its own process (a clean resident set) at (layers, batch) = (1, 1),
(2, 1) and (2, 2). Per run: parameter, gradient and optimizer-state bytes (summed tensor sizes,
exact), the bytes autograd saves for backward (saved-tensor hooks: the activations), the step's
peak memory above what was resident before it (CUDA: `torch.cuda.max_memory_allocated`; CPU: the
peak resident set sampled every millisecond minus the resident set before the step, with glibc
returning freed memory), the step's FLOPs (`torch.utils.flop_counter`) and its wall time.

The extrapolation (`fit`), at L decoder layers and B samples per process:

    params(L), grads(L), optimizer(L) = fixed + L * per_layer         (exact: tensor sizes)
    step peak above resident(L, B)    = c + B * (a_fixed + L * a_layer)
    memory(L, B) = params + optimizer + step peak            (+ the CUDA context, ~0.5-1 GB)
    FLOPs(L, B)  = B * (f_fixed + L * f_layer)

with per_layer = m(2,1) - m(1,1), a_fixed = m(2,2) - m(2,1) - 2 a_layer, c = m(1,1) - a_fixed
- a_layer. CPU time does not predict GPU time: the GPU time is an ESTIMATE, FLOPs / an assumed
sustained throughput (`--tflops`, default 400 TFLOP/s = ~40 % of an H100 SXM's dense bf16 peak);
decoding (calib) is bounded by reading the weights: + new tokens x weight bytes / `--hbm-tbs`.
On a GPU the same script measures with CUDA (then its step times are real GPU figures).
Writes out/memory_plan.json (each measurement as it finishes; a rerun skips what is there).
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import nullcontext

import torch

GB = 1e9
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

# The public config.json / preprocessor_config.json of each checkpoint (fields that set sizes).
# Qwen2.5-VL's vision_config lists only hidden_size / out_hidden_size; the rest are the
# Qwen2_5_VLVisionConfig defaults the checkpoint relies on (depth 32, MLP 3420, 16 heads, ...).
REAL = {
    "qwen2_5_vl_3b": dict(
        repo="Qwen/Qwen2.5-VL-3B-Instruct", model_type="qwen2_5_vl", layers=36, tie_word_embeddings=True,
        text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                  num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128000,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
        image=dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056,
                   mean=CLIP_MEAN, std=CLIP_STD)),
    "qwen2_5_vl_7b": dict(
        repo="Qwen/Qwen2.5-VL-7B-Instruct", model_type="qwen2_5_vl", layers=28, tie_word_embeddings=False,
        text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                  num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=128000,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
        image=dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056,
                   mean=CLIP_MEAN, std=CLIP_STD)),
    "qwen3_vl_30b_a3b": dict(
        repo="Qwen/Qwen3-VL-30B-A3B-Instruct", model_type="qwen3_vl_moe", layers=48, tie_word_embeddings=False,
        text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                  num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=262144,
                  num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                  mlp_only_layers=[], norm_topk_prob=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True}),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
                    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
        image=dict(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=65536, max_pixels=16777216,
                   mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])),
}
JOBS = ("mod", "mole1", "mole2", "mole_full", "calib")
POINTS = ((1, 1), (2, 1), (2, 2))     # (decoder layers, batch) of the three runs per model and job


# ----------------------------------------------------------------------------- models and inputs

def real_config(spec, layers, tok):
    """transformers config of `spec` (an entry of REAL, or a test's tiny one) with `layers`
    decoder layers; the special-token ids are those of `tok` (the repo's byte-level tokenizer:
    no hub access here; the ids only pick embedding rows, the vocabulary size is the real one)."""
    from transformers import AutoConfig
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    text = dict(spec["text"], num_hidden_layers=layers, tie_word_embeddings=spec["tie_word_embeddings"],
                pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    return AutoConfig.for_model(spec["model_type"], text_config=text, vision_config=dict(spec["vision"]),
                                tie_word_embeddings=spec["tie_word_embeddings"], **ids)


def image_processor(spec):
    """The checkpoint's image processor settings (min / max pixels, patch, merge, mean / std)."""
    from transformers import Qwen2VLImageProcessorPil
    im = spec["image"]
    return Qwen2VLImageProcessorPil(size={"shortest_edge": im["min_pixels"], "longest_edge": im["max_pixels"]},
                                    patch_size=im["patch_size"], temporal_patch_size=im["temporal_patch_size"],
                                    merge_size=im["merge_size"], image_mean=im["mean"], image_std=im["std"])


def build(spec, layers, dtype=torch.bfloat16, device="cpu"):
    """Random-init VLM of `spec` with `layers` decoder layers in `dtype` + its VLProcessor."""
    from transformers import AutoModelForImageTextToText
    from common import backbone as bb
    tok = bb.build_tokenizer()
    cfg = real_config(spec, layers, tok)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=dtype).to(device)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, bb.VLProcessor(tok, image_processor(spec), model.config)


def sample_inputs(proc, batch, image_size, q_tokens, a_tokens):
    """`batch` copies of one random image_size^2 RGB image, a question of q_tokens tokens and an
    answer of a_tokens tokens (a one-token word repeated), pixels through the processor."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
    word = " red circle"                     # one token of the repo's tokenizer (common.data.mark_tokens)
    q, a = word * q_tokens, word * a_tokens
    assert len(proc.text_ids(q)) == q_tokens, "the filler word is not one token"
    return proc.images([img] * batch), [q] * batch, [a] * batch


# ----------------------------------------------------------------------------- accounting

def tensor_bytes(tensors):
    """Bytes of distinct storages among `tensors` (views of one storage count once)."""
    seen = {}
    for t in tensors:
        if t is not None and torch.is_tensor(t):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def optimizer_bytes(opt):
    """Bytes of an optimizer's state tensors (AdamW: exp_avg, exp_avg_sq, step)."""
    return tensor_bytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


class SavedTensors:
    """Context manager summing the distinct storages autograd saves for backward (the
    activations a training step holds), leaving out parameters (saved weights are not new
    memory). .bytes after exit."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen, self.bytes = {}, 0

    def _pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.skip and s.nbytes():
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
        self.bytes = sum(self.seen.values())


def rss_bytes():
    """Current resident set of this process (Linux /proc; else the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_free_memory():
    """Hand freed heap memory back to the OS (glibc malloc_trim), so the next RSS delta counts
    a step's own allocations rather than reusing memory an earlier phase left in the heap."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory of a block above what was in use when it started, in bytes (.peak).
    CUDA: torch.cuda.max_memory_allocated; CPU: resident set sampled every `every` s by a thread."""

    def __init__(self, device, every=0.001):
        self.cuda, self.every = torch.device(device).type == "cuda", every

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        import gc
        gc.collect()
        release_free_memory()
        self.base = self.top = rss_bytes()
        self.stop = threading.Event()

        def sample():
            while not self.stop.is_set():
                self.top = max(self.top, rss_bytes())
                time.sleep(self.every)
        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
            return
        self.stop.set()
        self.thread.join()
        self.top = max(self.top, rss_bytes())
        self.peak = self.top - self.base


def timer_sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


# ----------------------------------------------------------------------------- one step of each job

def setup_job(job, model, proc):
    """Attach what the job trains, as the training script does. Returns (run, params, step_fn
    maker) pieces: (forward-able module, trainable params dict, encode function)."""
    from common import backbone as bb
    if job == "mod":
        from mod.model import AdapterConfig, attach
        attach(model, AdapterConfig())
        model.train()
        return model, proc.encode
    from mole.lora import add_lora
    from mole.model import MoLE, MoLEConfig
    model.requires_grad_(False)
    lm = bb.text_model(model)
    if job == "mole_full":
        lm.requires_grad_(True)
        model.lm_head.requires_grad_(True)
    else:
        add_lora(lm, ("q_proj", "k_proj", "v_proj", "o_proj"), r=8, lora_alpha=16)
        for n, p in lm.named_parameters():
            if "lora_" in n:
                p.requires_grad_(True)
    net = MoLE(model, proc, MoLEConfig()).to(next(model.parameters()).device)
    net.train()
    return net, net.encode


def measure(spec, job, layers, batch, device="cpu", image_size=448, q_tokens=32, a_tokens=64, new_tokens=32):
    """One measurement: build `spec` at `layers` decoder layers, run `job` twice on `batch`
    samples (first: FLOPs + saved activations + peak; second: timed + peak). Returns a dict of
    bytes / FLOPs / seconds / token counts (keys documented in the module docstring)."""
    from torch.utils.flop_counter import FlopCounterMode
    from common.cli import step_tokens
    model, proc = build(spec, layers, device=device)
    (pv, grid), qs, ans = sample_inputs(proc, batch, image_size, q_tokens, a_tokens)
    cuda = torch.device(device).type == "cuda"
    rec = {"job": job, "layers": layers, "batch": batch, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "threads": torch.get_num_threads(), "image_size": image_size,
           "visual_tokens": int(grid.prod(-1).sum()) // (proc.merge ** 2) // batch}
    if job == "calib":
        from rolemerge import calibrate as cal
        model.eval()
        params = list(model.parameters())
        inputs = {k: v.to(device) for k, v in proc.encode(None, qs, pixels=(pv, grid)).items()}
        image_mask = inputs["input_ids"] == proc.image_token_id
        recorder = cal.RouterRecorder(model)
        rec["seq_len"] = int(inputs["input_ids"].shape[1])

        def step():
            return cal.record_batch(model, recorder, inputs, image_mask, proc.eos_token_id, proc.pad_token_id,
                                    new_tokens, 3)
        trainable, opt, saved = [], None, None
        with FlopCounterMode(display=False) as fc, PeakMemory(device) as pk1:
            counts, tokens, new = step()
        t0 = timer_sync(device)
        with PeakMemory(device) as pk2:
            step()
        rec["step_s"] = timer_sync(device) - t0
        rec["new_tokens"] = int(new.shape[1])
        rec["routed_tokens"] = [int(x) for x in tokens]
    else:
        net, encode = setup_job(job, model, proc)
        params = list(net.parameters())
        trainable = [p for p in params if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.98))
        b = {k: v.to(device) for k, v in encode(None, qs, ans, pixels=(pv, grid)).items()}
        rec["seq_len"] = int(b["input_ids"].shape[1])
        amp = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
        if job == "mod":
            from mod.train import accumulate
            run = lambda: accumulate(net, net, [b], 0.01, amp)
        else:
            from mole.train import accumulate
            stage = 1 if job == "mole1" else 2
            run = lambda: accumulate(net, [b], stage, amp)

        def step():
            opt.zero_grad(set_to_none=True)
            run()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as fc, PeakMemory(device) as pk1, SavedTensors(params) as saved:
            opt.zero_grad(set_to_none=True)
            run()
            rec["grad_bytes"] = tensor_bytes(p.grad for p in trainable)
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        t0 = timer_sync(device)
        with PeakMemory(device) as pk2:
            step()
        rec["step_s"] = timer_sync(device) - t0
        rec["label_tokens"] = step_tokens([b["labels"]])
    frozen = [p for p in params if not (p.requires_grad and opt is not None)]
    rec.update(
        param_bytes=tensor_bytes(params), trainable_bytes=tensor_bytes(trainable), frozen_bytes=tensor_bytes(frozen),
        trainable_numel=sum(p.numel() for p in trainable), param_numel=sum(p.numel() for p in params),
        optimizer_bytes=optimizer_bytes(opt) if opt is not None else 0,
        saved_bytes=saved.bytes if saved is not None else 0,
        first_step_peak=pk1.peak, step_peak=pk2.peak, flops=fc.get_total_flops())
    rec.setdefault("grad_bytes", 0)
    return rec


# ----------------------------------------------------------------------------- extrapolation

def fit(m11, m21, m22):
    """Per-layer / per-sample decomposition of a quantity measured at (layers, batch) = (1,1),
    (2,1), (2,2), for the model m(L, B) = c + B * (a_fixed + L * a_layer).
    Returns (c, a_fixed, a_layer)."""
    a_layer = m21 - m11
    a_fixed = m22 - m21 - 2 * a_layer
    return m11 - a_fixed - a_layer, a_fixed, a_layer


def linear(m1, m2):
    """(fixed, per_layer) of a quantity linear in the layer count, measured at 1 and 2 layers."""
    return m1 - (m2 - m1), m2 - m1


def at(fixed_layer, L):
    return fixed_layer[0] + L * fixed_layer[1]


def summarise(runs, depth):
    """Figures of one (model, job) from its three runs {(L, B): record}: fixed / per-layer parts
    and the functions of (L, B) the plan uses. Returns a dict."""
    r11, r21, r22 = (runs[p] for p in POINTS)
    s = {k: linear(r11[k], r21[k]) for k in ("param_bytes", "trainable_bytes", "grad_bytes", "optimizer_bytes")}
    s["step_peak"] = fit(r11["step_peak"], r21["step_peak"], r22["step_peak"])
    s["saved_bytes"] = fit(r11["saved_bytes"], r21["saved_bytes"], r22["saved_bytes"])
    s["flops"] = fit(r11["flops"], r21["flops"], r22["flops"])
    s["step_s"] = fit(r11["step_s"], r21["step_s"], r22["step_s"])
    s["seq_len"], s["visual_tokens"], s["depth"] = r11["seq_len"], r11["visual_tokens"], depth
    return s


def predict(s, L, B):
    """Memory (bytes) and FLOPs of one step at L layers, B samples per process, from `summarise`."""
    c, af, al = s["step_peak"]
    peak = c + B * (af + L * al)
    sc, sf, sl = s["saved_bytes"]
    fc, ff, fl = s["flops"]
    out = {"params": at(s["param_bytes"], L), "trainable": at(s["trainable_bytes"], L),
           "grads": at(s["grad_bytes"], L), "optimizer": at(s["optimizer_bytes"], L),
           "activations": sc + B * (sf + L * sl), "step_peak": peak, "flops": fc + B * (ff + L * fl)}
    out["total"] = out["params"] + out["optimizer"] + peak
    return out


# ----------------------------------------------------------------------------- the plan

# documented real-model commands: (label, model, job, batch per process, processes, note)
COMMANDS = [
    ("python -m mod.train --model Qwen2.5-VL-3B-Instruct (batch 16)", "qwen2_5_vl_3b", "mod", 16, 1),
    ("torchrun --nproc_per_node 8 -m mod.train --model Qwen2.5-VL-3B-Instruct (16 per GPU)", "qwen2_5_vl_3b", "mod",
     16, 8),
    ("python -m mole.train --model Qwen2.5-VL-7B-Instruct, stage 1 (batch 32)", "qwen2_5_vl_7b", "mole1", 32, 1),
    ("python -m mole.train --model Qwen2.5-VL-7B-Instruct, stage 2 (batch 32)", "qwen2_5_vl_7b", "mole2", 32, 1),
    ("torchrun --nproc_per_node 8 -m mole.train --model Qwen2.5-VL-7B-Instruct, stage 2 (4 per GPU)",
     "qwen2_5_vl_7b", "mole2", 4, 8),
    ("torchrun --nproc_per_node 8 -m mole.train --model Qwen2.5-VL-7B-Instruct --train full, stage 2 (4 per GPU)",
     "qwen2_5_vl_7b", "mole_full", 4, 8),
    ("python -m rolemerge.calibrate --model Qwen3-VL-30B-A3B-Instruct --device-map auto (batch 16, 32 new tokens)",
     "qwen3_vl_30b_a3b", "calib", 16, 1),
]


def plan(results, tflops=400.0, hbm_tbs=3.35, gpu_gb=80.0):
    """Rows of the plan for every documented command whose measurements exist: memory per GPU,
    the parts, FLOPs and estimated GPU seconds per step. DDP adds one gradient bucket copy of the
    trainable parameters per process (gradient_as_bucket_view off)."""
    rows = []
    for label, name, job, B, procs in COMMANDS:
        runs = results.get(name, {}).get(job)
        if not runs or any(f"{L},{b}" not in runs for L, b in POINTS):
            continue
        s = summarise({p: runs[f"{p[0]},{p[1]}"] for p in POINTS}, REAL[name]["layers"])
        p = predict(s, REAL[name]["layers"], B)
        ddp = p["trainable"] if procs > 1 else 0
        total = p["total"] + ddp
        est_s = p["flops"] / (tflops * 1e12)
        if job == "calib":          # decoding reads every weight once per new token (batch 16 touches most experts)
            est_s += runs["1,1"].get("new_tokens", 32) * p["params"] / (hbm_tbs * 1e12)
        rows.append({"command": label, "model": name, "job": job, "batch_per_gpu": B, "gpus": procs,
                     "params_gb": p["params"] / GB, "grads_gb": p["grads"] / GB, "optimizer_gb": p["optimizer"] / GB,
                     "ddp_bucket_gb": ddp / GB, "activations_gb": p["activations"] / GB,
                     "step_peak_gb": p["step_peak"] / GB, "total_gb": total / GB,
                     "fits": total / GB + 1.0 <= gpu_gb, "tflop_per_step": p["flops"] / 1e12,
                     "gpu_s_per_step_estimate": est_s, "summary": s})
    return rows


def print_figures(results):
    """Per model and job: the fixed and per-layer figures the plan extrapolates from."""
    print(f"\n{'model':17s} {'job':9s} {'what':22s} {'fixed':>10s} {'per layer':>10s}   (GB; FLOPs in TFLOP)")
    for name, jobs in results.items():
        if name not in REAL:
            continue
        for job, runs in jobs.items():
            if any(f"{L},{b}" not in runs for L, b in POINTS):
                continue
            s = summarise({p: runs[f"{p[0]},{p[1]}"] for p in POINTS}, REAL[name]["layers"])
            for k in ("param_bytes", "trainable_bytes", "grad_bytes", "optimizer_bytes"):
                f, l = s[k]
                print(f"{name:17s} {job:9s} {k:22s} {f / GB:10.3f} {l / GB:10.3f}")
            for k, unit, scale in (("step_peak", "GB", GB), ("saved_bytes", "GB", GB), ("flops", "TFLOP", 1e12),
                                   ("step_s", "s", 1)):
                c, af, al = s[k]
                print(f"{name:17s} {job:9s} {k + ' per sample':22s} {af / scale:10.3f} {al / scale:10.3f}"
                      f"   + {c / scale:.3f} {unit} once")
            print(f"{name:17s} {job:9s} tokens per sample: {s['seq_len']} ({s['visual_tokens']} visual)")


def print_plan(rows, tflops, hbm_tbs):
    print("\nmemory(L, B) = params(L) + optimizer(L) + c + B * (a_fixed + L * a_layer)   [+ DDP bucket = trainable "
          "bytes]\nFLOPs(L, B) = B * (f_fixed + L * f_layer);  GPU s ESTIMATE = FLOPs / "
          f"{tflops:.0f} TFLOP/s" + f" (+ calib: new tokens x weight bytes / {hbm_tbs} TB/s)\n")
    print(f"{'command':100s} {'params':>7s} {'grads':>6s} {'optim':>6s} {'acts':>6s} {'peak':>6s} {'total GB':>8s} "
          f"{'fits 80GB':>9s} {'TFLOP':>7s} {'est. GPU s':>10s}")
    for r in rows:
        print(f"{r['command']:100s} {r['params_gb']:7.1f} {r['grads_gb']:6.2f} {r['optimizer_gb']:6.2f} "
              f"{r['activations_gb']:6.1f} {r['step_peak_gb']:6.1f} {r['total_gb']:8.1f} {str(r['fits']):>9s} "
              f"{r['tflop_per_step']:7.1f} {r['gpu_s_per_step_estimate']:10.2f}")


def load_results(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(REAL), help=f"comma list of {tuple(REAL)}")
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma list of {JOBS} (calib: MoE models only)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per measurement")
    p.add_argument("--out", default="out/memory_plan.json", help="measurements (JSON; a rerun skips what is there)")
    p.add_argument("--redo", action="store_true", help="measure again what --out already holds")
    p.add_argument("--plan-only", action="store_true", help="no measurement: print the plan from --out")
    p.add_argument("--tflops", type=float, default=400.0, help="ASSUMED sustained bf16 TFLOP/s of one GPU")
    p.add_argument("--hbm-tbs", type=float, default=3.35, help="ASSUMED GPU memory bandwidth, TB/s (decoding)")
    p.add_argument("--one", nargs=4, metavar=("MODEL", "JOB", "LAYERS", "BATCH"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from common.cli import fail
    if a.one:                                     # worker: one measurement, JSON on stdout
        torch.set_num_threads(a.threads)
        name, job, L, B = a.one
        print("RESULT " + json.dumps(measure(REAL[name], job, int(L), int(B), device=a.device)))
        return
    models, jobs = a.models.split(","), a.jobs.split(",")
    bad = [m for m in models if m not in REAL] + [j for j in jobs if j not in JOBS]
    if bad:
        fail(f"unknown models / jobs {bad}; models: {tuple(REAL)}, jobs: {JOBS}")
    from common.data import atomic_write_text
    results = load_results(a.out)
    if not a.plan_only:
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MALLOC_MMAP_THRESHOLD_="65536")
        for name in models:
            for job in jobs:
                if job == "calib" and "num_experts" not in REAL[name]["text"]:
                    continue
                for L, B in POINTS:
                    key = f"{L},{B}"
                    if key in results.get(name, {}).get(job, {}) and not a.redo:
                        continue
                    t = time.time()
                    r = subprocess.run([sys.executable, "-m", "eval.memory_plan", "--threads", str(a.threads),
                                        "--device", a.device, "--one", name, job, str(L), str(B)],
                                       capture_output=True, text=True, env=env)
                    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
                    if r.returncode or not line:
                        print(f"{name} {job} L={L} B={B}: failed (exit {r.returncode})\n{r.stderr[-3000:]}",
                              file=sys.stderr)
                        continue
                    rec = json.loads(line[0][7:])
                    results.setdefault(name, {}).setdefault(job, {})[key] = rec
                    atomic_write_text(a.out, json.dumps(results, indent=1))
                    print(f"{name:17s} {job:9s} L={L} B={B}: step peak {rec['step_peak'] / GB:.2f} GB, saved "
                          f"{rec['saved_bytes'] / GB:.2f} GB, params {rec['param_bytes'] / GB:.2f} GB, "
                          f"{rec['flops'] / 1e12:.2f} TFLOP, step {rec['step_s']:.1f} s ({time.time() - t:.0f} s wall)",
                          flush=True)
    print_figures(results)
    rows = plan(results, a.tflops, a.hbm_tbs)
    print_plan(rows, a.tflops, a.hbm_tbs)
    return rows


if __name__ == "__main__":
    main()
