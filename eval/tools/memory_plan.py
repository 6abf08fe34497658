"""Memory and time plan for real checkpoints: measure at 1 and 2 decoder layers, extrapolate.

    python -m eval.tools.memory_plan --threads 1                       # every measurement, then the plan
    python -m eval.tools.memory_plan --models qwen2_5_vl_3b --jobs mod  # a subset
    python -m eval.tools.memory_plan --plan-only                        # print the plan from out/memory_plan.json

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
(2, 1), and (2, 2) for the batch check where RUNS says so (without it c = 0). Per run: parameter, gradient and optimizer-state bytes (summed tensor sizes,
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
import gc
import json
import os
import resource
import subprocess
import sys
import threading
import time

import numpy as np
import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForImageTextToText, Qwen2VLImageProcessorPil

from common import backbone as bb
from common.cli import entry_parser, fail, step_tokens
from common.data import atomic_write_text
from mod import train as mod_train
from mod.model import AdapterConfig, attach
from mole import train as mole_train
from mole.lora import add_lora
from mole.model import MoLE, MoLEConfig
from rolemerge import calibrate as cal

GB = 1e9
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

# The public config.json / preprocessor_config.json of each checkpoint (fields that set sizes).
# Qwen2.5-VL's vision_config lists only hidden_size / out_hidden_size; the rest are the
# Qwen2_5_VLVisionConfig defaults the checkpoint relies on (depth 32, MLP 3420, 16 heads, ...),
# the same for the 3B and the 7B, as is the image processor.
QWEN2_5_VL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                         spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                         fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")
QWEN2_5_VL_IMAGE = dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056,
                        mean=CLIP_MEAN, std=CLIP_STD)
REAL = {
    "qwen2_5_vl_3b": dict(
        repo="Qwen/Qwen2.5-VL-3B-Instruct", model_type="qwen2_5_vl", layers=36, tie_word_embeddings=True,
        text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                  num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128000,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision=dict(QWEN2_5_VL_VISION, out_hidden_size=2048), image=QWEN2_5_VL_IMAGE),
    "qwen2_5_vl_7b": dict(
        repo="Qwen/Qwen2.5-VL-7B-Instruct", model_type="qwen2_5_vl", layers=28, tie_word_embeddings=False,
        text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                  num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=128000,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision=dict(QWEN2_5_VL_VISION, out_hidden_size=3584), image=QWEN2_5_VL_IMAGE),
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


# ----------------------------------------------------------------------------- models and inputs

def real_config(spec, layers, tok):
    """transformers config of `spec` (an entry of REAL, or a test's tiny one) with `layers`
    decoder layers; the special-token ids are those of `tok` (the repo's byte-level tokenizer:
    no hub access here; the ids only pick embedding rows, the vocabulary size is the real one)."""
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    text = dict(spec["text"], num_hidden_layers=layers, tie_word_embeddings=spec["tie_word_embeddings"],
                pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    return AutoConfig.for_model(spec["model_type"], text_config=text, vision_config=dict(spec["vision"]),
                                tie_word_embeddings=spec["tie_word_embeddings"], **ids)


def image_processor(spec):
    """The checkpoint's image processor settings (min / max pixels, patch, merge, mean / std)."""
    im = spec["image"]
    return Qwen2VLImageProcessorPil(size={"shortest_edge": im["min_pixels"], "longest_edge": im["max_pixels"]},
                                    patch_size=im["patch_size"], temporal_patch_size=im["temporal_patch_size"],
                                    merge_size=im["merge_size"], image_mean=im["mean"], image_std=im["std"])


def build(spec, layers, dtype=torch.bfloat16, device="cpu"):
    """Random-init VLM of `spec` with `layers` decoder layers in `dtype` + its VLProcessor."""
    tok = bb.build_tokenizer()
    cfg = real_config(spec, layers, tok)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=dtype).to(device)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, bb.make_processor(tok, image_processor(spec), model.config, model.generation_config)


def sample_inputs(proc, batch, image_size, q_tokens, a_tokens):
    """`batch` copies of one random image_size^2 RGB image, a question of q_tokens tokens and an
    answer of a_tokens tokens (a one-token word repeated), pixels through the processor."""
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
    word = " red circle"                     # one token of the repo's tokenizer (common.shapes.mark_tokens)
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
    if job == "mod":
        attach(model, AdapterConfig())
        model.train()
        return model, proc.encode
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


def measure(spec, job, layers, batch, device="cpu", image_size=448, q_tokens=32, a_tokens=64, new_tokens=32,
            optimizer_step=True):
    """One measurement: build `spec` at `layers` decoder layers and run one step of `job` on
    `batch` samples, counting FLOPs and saved activations and timing it. Returns a dict:
    param / trainable / frozen / grad / optimizer bytes (tensor sizes), saved_bytes (autograd's
    saved tensors), fwd_bwd_peak (peak above resident during forward + backward), opt_peak (peak
    above resident during clipping + the optimizer step, which creates AdamW's state on this first
    step), flops, step_s, seq_len, visual_tokens. optimizer_step=False stops after backward and
    reports the AdamW state as computed (2 x trainable bytes: torch keeps exp_avg / exp_avg_sq in
    the parameter dtype, + a 4-byte step per tensor; `optimizer_computed` True)."""
    t_build = time.perf_counter()
    model, proc = build(spec, layers, device=device)
    t_build = time.perf_counter() - t_build
    (pv, grid), qs, ans = sample_inputs(proc, batch, image_size, q_tokens, a_tokens)
    cuda = torch.device(device).type == "cuda"
    rec = {"job": job, "layers": layers, "batch": batch, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "threads": torch.get_num_threads(), "image_size": image_size, "build_s": t_build,
           "cpu_s_start": time.process_time(), "visual_tokens": int(grid.prod(-1).sum()) // (proc.merge ** 2) // batch}
    trainable, opt, saved_bytes, grad_bytes, opt_peak = [], None, 0, 0, 0
    if job == "calib":
        model.eval()
        params = list(model.parameters())
        inputs = {k: v.to(device) for k, v in proc.encode(None, qs, pixels=(pv, grid)).items()}
        image_mask = inputs["input_ids"] == proc.image_token_id
        recorder = cal.RouterRecorder(model)
        rec["seq_len"] = int(inputs["input_ids"].shape[1])
        with FlopCounterMode(display=False) as fc, PeakMemory(device) as pk:
            t0, c0 = timer_sync(device), time.process_time()
            counts, tokens, new = cal.record_batch(model, recorder, inputs, image_mask, proc.eos_token_id,
                                                   proc.pad_token_id, new_tokens, 3)
            rec["step_s"], rec["step_cpu_s"] = timer_sync(device) - t0, time.process_time() - c0
        rec["new_tokens"] = int(new.shape[1])
        rec["routed_tokens"] = [int(x) for x in tokens]
    else:
        net, encode = setup_job(job, model, proc)
        params = list(net.parameters())
        trainable = [p for p in params if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.98))
        b = {k: v.to(device) for k, v in encode(None, qs, ans, pixels=(pv, grid)).items()}
        rec["seq_len"] = int(b["input_ids"].shape[1])
        rec["label_tokens"] = step_tokens([b["labels"]])
        amp = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
        if job == "mod":
            run = lambda: mod_train.accumulate(net, net, [b], 0.01, amp)
        else:
            run = lambda: mole_train.accumulate(net, [b], 1 if job == "mole1" else 2, amp)
        opt.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as fc:
            t0, c0 = timer_sync(device), time.process_time()
            with PeakMemory(device) as pk, SavedTensors(params) as saved:
                run()
            grad_bytes, saved_bytes = tensor_bytes(p.grad for p in trainable), saved.bytes
            if optimizer_step:
                with PeakMemory(device) as pko:
                    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                    opt.step()
                opt_peak = pko.peak
            rec["step_s"], rec["step_cpu_s"] = timer_sync(device) - t0, time.process_time() - c0
    frozen = [p for p in params if not (p.requires_grad and opt is not None)]
    rec.update(
        param_bytes=tensor_bytes(params), trainable_bytes=tensor_bytes(trainable), frozen_bytes=tensor_bytes(frozen),
        trainable_numel=sum(p.numel() for p in trainable), trainable_tensors=len(trainable), param_numel=sum(p.numel() for p in params),
        grad_bytes=grad_bytes, saved_bytes=saved_bytes, fwd_bwd_peak=pk.peak, opt_peak=opt_peak,
        flops=fc.get_total_flops(), optimizer_step=bool(optimizer_step and opt is not None))
    rec["cpu_s_end"] = time.process_time()     # CPU seconds of this process so far (vs wall: machine load)
    if opt is not None and not optimizer_step:
        rec["optimizer_bytes"], rec["optimizer_computed"] = 2 * rec["trainable_bytes"] + 4 * len(trainable), True
    else:
        rec["optimizer_bytes"], rec["optimizer_computed"] = (optimizer_bytes(opt) if opt is not None else 0), False
    return rec


# ----------------------------------------------------------------------------- extrapolation

def fit(points, a_layer=None):
    """Fixed / per-layer / per-sample parts of a quantity measured at (layers, batch) points,
    for the model m(L, B) = c + B * (a_fixed + L * a_layer). points: {(1, 1): m11, (2, 1): m21}
    and optionally (2, 2): m22; without (2, 2), c = 0 (everything scales with the batch).
    Returns (c, a_fixed, a_layer): a_layer = m21 - m11, a_fixed = m22 - m21 - 2 a_layer
    (or m11 - a_layer), c = m11 - a_fixed - a_layer. a_layer given: used instead of m21 - m11."""
    m11, m21 = points[(1, 1)], points[(2, 1)]
    a_layer = m21 - m11 if a_layer is None else a_layer
    a_fixed = points[(2, 2)] - m21 - 2 * a_layer if (2, 2) in points else m11 - a_layer
    return m11 - a_fixed - a_layer, a_fixed, a_layer


def linear(m1, m2):
    """(fixed, per_layer) of a quantity linear in the layer count, measured at 1 and 2 layers."""
    return m1 - (m2 - m1), m2 - m1


def kv_bytes_per_layer(spec, tokens):
    """bf16 KV-cache bytes of one decoder layer for one sample of `tokens` positions."""
    t = spec["text"]
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    return 2 * t["num_key_value_heads"] * head_dim * 2 * tokens


def summarise(runs, spec=None):
    """Figures of one (model, job) from its runs {(L, B): record} ((1, 1), (2, 1), maybe (2, 2)).
    Exact tensor sizes: params, trainable, grads, optimizer = (fixed, per_layer). Fitted
    (`fit`): act = forward + backward peak minus the gradients (activations + workspace),
    saved = autograd's saved tensors, flops, step_s. opt_temp = (fixed, per_layer) of the
    optimizer step's temporaries (its peak minus the state it created); runs without an
    optimizer step assume one copy of the trainable bytes (`opt_temp_assumed`). Calibration
    (no gradient) keeps nothing per layer but its KV cache, so its per-layer activation is the
    cache size (`kv_bytes_per_layer` of `spec`), not the 1-vs-2-layer difference (allocator noise
    at the 10 MB level)."""
    r11, r21 = runs[(1, 1)], runs[(2, 1)]
    cpu_time = all("step_cpu_s" in r and r["device"] == "cpu" for r in runs.values())  # CPU s: load-independent
    s = {k: linear(r11[k], r21[k]) for k in ("param_bytes", "trainable_bytes", "grad_bytes", "optimizer_bytes")}
    calib = r11["job"] == "calib" and spec is not None
    kv = kv_bytes_per_layer(spec, r11["seq_len"] + r11.get("new_tokens", 0)) if calib else None
    s["act"] = fit({p: r["fwd_bwd_peak"] - r["grad_bytes"] for p, r in runs.items()}, kv)
    for k, f in (("saved", lambda r: r["saved_bytes"]),
                 ("flops", lambda r: r["flops"]),
                 ("step_s", lambda r: r["step_cpu_s"] if cpu_time else r["step_s"])):
        s[k] = fit({p: f(r) for p, r in runs.items()})
    s["opt_temp_assumed"] = not r11.get("optimizer_step", True) and r11["trainable_bytes"] > 0
    if s["opt_temp_assumed"]:
        s["opt_temp"] = s["trainable_bytes"]
    else:
        s["opt_temp"] = linear(max(r11["opt_peak"] - r11["optimizer_bytes"], 0),
                               max(r21["opt_peak"] - r21["optimizer_bytes"], 0))
    s["seq_len"], s["visual_tokens"], s["time"] = r11["seq_len"], r11["visual_tokens"], \
        "CPU s (1 thread)" if cpu_time else ("GPU s" if r11["device"] != "cpu" else "wall s")
    s["points"] = sorted(f"{L}x{B}" for L, B in runs)
    return s


def predict(s, L, B, ddp=False, fsdp=0, unit_bytes=0):
    """Bytes and FLOPs of one step at L decoder layers and B samples per process (`summarise`):
    resident = params + optimizer state (+ a DDP gradient bucket: one copy of the gradients);
    step peak above it = grads + max(activations(L, B), optimizer temporaries(L)), where
    activations = max(the fitted forward + backward peak minus the gradients, autograd's saved
    tensors): when the gradients are large (--train full) the small runs peak at the end of
    backward, and the saved tensors are what the start of backward holds at full depth;
    total = resident + step peak. fsdp = N processes of `mole.train --fsdp`: parameters,
    gradients, optimizer state and its temporaries are split N ways, plus the largest unit
    gathered whole (`unit_bytes`: its parameters and their gradients) on top of the activations."""
    at = lambda fl: fl[0] + L * fl[1]
    ev = lambda c_f_l: c_f_l[0] + B * (c_f_l[1] + L * c_f_l[2])
    out = {"params": at(s["param_bytes"]), "trainable": at(s["trainable_bytes"]), "grads": at(s["grad_bytes"]),
           "optimizer": at(s["optimizer_bytes"]), "activations": max(ev(s["act"]), ev(s["saved"])),
           "saved": ev(s["saved"]),
           "opt_temp": at(s["opt_temp"]), "flops": ev(s["flops"])}
    out["ddp_bucket"] = out["grads"] if ddp else 0
    if fsdp:
        for k in ("params", "grads", "optimizer", "opt_temp"):
            out[k] /= fsdp
        out["fsdp_unit"] = unit_bytes
    out["total"] = (out["params"] + out["optimizer"] + out["ddp_bucket"] + out["grads"]
                    + max(out["activations"] + out.get("fsdp_unit", 0), out["opt_temp"]))
    return out


def largest_unit_bytes(spec):
    """bf16 bytes of mole.train --fsdp's largest unit gathered whole, parameters + gradients: the
    embedding table with the LM head (tied: one matrix)."""
    t = spec["text"]
    return 2 * 2 * t["vocab_size"] * t["hidden_size"] * (1 if spec["tie_word_embeddings"] else 2)


# ----------------------------------------------------------------------------- the plan

# documented real-model commands: (label, model, job, batch per process, processes; negative: FSDP over them)
COMMANDS = [
    ("python -m mod.train --model Qwen2.5-VL-3B-Instruct (batch 16)", "qwen2_5_vl_3b", "mod", 16, 1),
    ("torchrun --nproc_per_node 8 -m mod.train --model Qwen2.5-VL-3B-Instruct --batch-size 128 (16 per GPU)",
     "qwen2_5_vl_3b", "mod", 16, 8),
    ("python -m mole.train --model Qwen2.5-VL-7B-Instruct, stage 1 (batch 32)", "qwen2_5_vl_7b", "mole1", 32, 1),
    ("python -m mole.train --model Qwen2.5-VL-7B-Instruct, stage 2 (batch 32)", "qwen2_5_vl_7b", "mole2", 32, 1),
    ("python -m mole.train --model Qwen2.5-VL-7B-Instruct --grad-accum 4, stage 2 (8 per micro-batch)",
     "qwen2_5_vl_7b", "mole2", 8, 1),
    ("torchrun --nproc_per_node 8 -m mole.train --model Qwen2.5-VL-7B-Instruct, stage 2 (4 per GPU)",
     "qwen2_5_vl_7b", "mole2", 4, 8),
    ("torchrun --nproc_per_node 8 -m mole.train --model Qwen2.5-VL-3B-Instruct --train full, stage 2 (4 per GPU)",
     "qwen2_5_vl_3b", "mole_full", 4, 8),
    ("torchrun --nproc_per_node 8 -m mole.train --model Qwen2.5-VL-7B-Instruct --train full, stage 2 (4 per GPU)",
     "qwen2_5_vl_7b", "mole_full", 4, 8),
    ("torchrun --nproc_per_node 8 -m mole.train --model Qwen2.5-VL-7B-Instruct --train full --fsdp, stage 2 "
     "(4 per GPU)", "qwen2_5_vl_7b", "mole_full", 4, -8),
    ("python -m rolemerge.calibrate --model Qwen3-VL-30B-A3B-Instruct --device-map auto (batch 16, 32 new tokens)",
     "qwen3_vl_30b_a3b", "calib", 16, 1),
]

# what `main` measures by default, in this order: (model, job, points, measure() options)
FULL, ONE = ((1, 1), (2, 1), (2, 2)), ((1, 1), (2, 1))
RUNS = [("qwen2_5_vl_3b", "mod", ONE, {}), ("qwen2_5_vl_7b", "mole2", ONE, {}), ("qwen3_vl_30b_a3b", "calib", ONE, {}),
        ("qwen2_5_vl_7b", "mole_full", ONE, {"optimizer_step": False}), ("qwen2_5_vl_7b", "mole1", ONE, {}),
        ("qwen2_5_vl_3b", "mole_full", ONE, {}),
        ("qwen2_5_vl_3b", "mod", FULL, {}), ("qwen2_5_vl_7b", "mole2", FULL, {}), ("qwen3_vl_30b_a3b", "calib", FULL, {}),
        ("qwen2_5_vl_7b", "mod", ONE, {}), ("qwen2_5_vl_3b", "mole2", ONE, {}), ("qwen3_vl_30b_a3b", "mod", ONE, {}),
        ("qwen3_vl_30b_a3b", "mole2", ONE, {})]


def runs_of(results, name, job):
    """{(L, B): record} of one model and job in a results dict (keys "L,B")."""
    got = results.get(name, {}).get(job, {})
    return {tuple(map(int, k.split(","))): r for k, r in got.items()}


def plan(results, tflops=400.0, hbm_tbs=3.35, gpu_gb=80.0):
    """Rows of the plan for every documented command (COMMANDS) whose measurements exist:
    memory per GPU and its parts, FLOPs per step and the ESTIMATED GPU seconds per step
    (FLOPs / tflops; calib adds new tokens x weight bytes / hbm_tbs for decoding)."""
    rows = []
    for label, name, job, B, procs in COMMANDS:
        runs = runs_of(results, name, job)
        if (1, 1) not in runs or (2, 1) not in runs:
            continue
        s = summarise(runs, REAL[name])
        p = predict(s, REAL[name]["layers"], B, ddp=procs > 1, fsdp=max(-procs, 0),
                    unit_bytes=largest_unit_bytes(REAL[name]))
        procs = abs(procs)
        est_s = p["flops"] / (tflops * 1e12)
        if job == "calib":
            est_s += runs[(1, 1)].get("new_tokens", 32) * p["params"] / (hbm_tbs * 1e12)
        rows.append({"command": label, "model": name, "job": job, "batch_per_gpu": B, "gpus": procs,
                     **{f"{k}_gb": v / GB for k, v in p.items() if k != "flops"},
                     "fits": p["total"] / GB + 1.0 <= gpu_gb, "tflop_per_step": p["flops"] / 1e12,
                     "gpu_s_per_step_estimate": est_s, "points": s["points"], "seq_len": s["seq_len"],
                     "visual_tokens": s["visual_tokens"], "opt_temp_assumed": s["opt_temp_assumed"]})
    return rows


def print_figures(results):
    """Per model and job: the fixed and per-layer figures the plan extrapolates from."""
    print(f"\n{'model':17s} {'job':9s} {'figure':24s} {'fixed':>9s} {'per layer':>9s}  (GB / TFLOP / s)")
    for name in REAL:
        for job in JOBS:
            runs = runs_of(results, name, job)
            if (1, 1) not in runs or (2, 1) not in runs:
                continue
            s = summarise(runs, REAL[name])
            for k in ("param_bytes", "trainable_bytes", "grad_bytes", "optimizer_bytes", "opt_temp"):
                f, l = s[k]
                print(f"{name:17s} {job:9s} {k:24s} {f / GB:9.3f} {l / GB:9.3f}")
            for k, scale, unit in (("act", GB, "GB"), ("saved", GB, "GB"), ("flops", 1e12, "TFLOP"),
                                   ("step_s", 1, s["time"])):
                c, af, al = s[k]
                print(f"{name:17s} {job:9s} {k + ' per sample':24s} {af / scale:9.3f} {al / scale:9.3f}"
                      f"  + {c / scale:.3f} {unit} once")
            print(f"{name:17s} {job:9s} {s['seq_len']} tokens per sample ({s['visual_tokens']} visual), points "
                  f"{', '.join(s['points'])}{', optimizer temporaries assumed' if s['opt_temp_assumed'] else ''}")


def print_plan(rows, tflops, hbm_tbs):
    print("\nmemory/GPU = params + optimizer [+ DDP bucket] + grads + max(act(L,B), optimizer temporaries),  "
          "act(L,B) = c + B (a_fixed + L a_layer)\nFLOPs = B (f_fixed + L f_layer);  est. GPU s = FLOPs / "
          f"{tflops:.0f} TFLOP/s (ASSUMED){f' + new tokens x weight bytes / {hbm_tbs} TB/s' if hbm_tbs else ''}\n")
    print(f"{'command':112s} {'params':>6s} {'grads':>6s} {'optim':>6s} {'ddp':>5s} {'acts':>6s} {'total':>6s} "
          f"{'fits':>5s} {'TFLOP':>6s} {'est.s':>6s}")
    for r in rows:
        print(f"{r['command']:112s} {r['params_gb']:6.1f} {r['grads_gb']:6.2f} {r['optimizer_gb']:6.2f} "
              f"{r['ddp_bucket_gb'] + r.get('fsdp_unit_gb', 0):5.1f} {r['activations_gb']:6.1f} {r['total_gb']:6.1f} {str(r['fits']):>5s} "
              f"{r['tflop_per_step']:6.1f} {r['gpu_s_per_step_estimate']:6.2f}")


def markdown(rows, tflops, hbm_tbs):
    """The plan as a README table (GB per GPU; estimated GPU seconds per optimizer step)."""
    out = ["| command | per GPU: params | grads | AdamW state | DDP bucket / FSDP unit | activations (peak) | **total GB** "
           "| fits 80 GB | TFLOP / step | est. GPU s / step |", "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        out.append(f"| `{r['command']}` | {r['params_gb']:.1f} | {r['grads_gb']:.2f} | {r['optimizer_gb']:.2f} | "
                   f"{r['ddp_bucket_gb'] + r.get('fsdp_unit_gb', 0):.2f} | {r['activations_gb']:.1f} | **{r['total_gb']:.1f}** | "
                   f"{'yes' if r['fits'] else '**no**'} | {r['tflop_per_step']:.0f} | {r['gpu_s_per_step_estimate']:.1f} |")
    return "\n".join(out)


def markdown_inputs(results):
    """The measured inputs of the plan as a README table (GB; per sample where it says so)."""
    out = ["| model, job (points) | params: fixed + per layer | trainable per layer | activations per sample: "
           "fixed + per layer | saved for backward per sample | TFLOP per sample | tokens (visual) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for name in REAL:
        for job in JOBS:
            runs = runs_of(results, name, job)
            if (1, 1) not in runs or (2, 1) not in runs:
                continue
            s = summarise(runs, REAL[name])
            g = lambda fl: f"{fl[0] / GB:.2f} + {fl[1] / GB:.3f}"
            h = lambda cfl, sc=GB, d=3: (f"{cfl[1] / sc:.2f} + {cfl[2] / sc:.{d}f}"
                                          + (f" (+ {cfl[0] / sc:.2f} once)" if abs(cfl[0]) >= 0.005 * sc else ""))
            out.append(f"| {REAL[name]['repo'].split('/')[1]}, {job} ({', '.join(s['points'])}) | {g(s['param_bytes'])} "
                       f"| {s['trainable_bytes'][1] / GB:.3f} | {h(s['act'])} | {h(s['saved'])} | "
                       f"{h(s['flops'], 1e12)} | {s['seq_len']} ({s['visual_tokens']}) |")
    return "\n".join(out)


def load_results(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def main(argv=None):
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--models", default=",".join(REAL), help=f"comma list of {tuple(REAL)}")
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma list of {JOBS} (calib: MoE models only)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per measurement")
    p.add_argument("--out", default="out/memory_plan.json", help="measurements (JSON; a rerun skips what is there)")
    p.add_argument("--redo", action="store_true", help="measure again what --out already holds")
    p.add_argument("--plan-only", action="store_true", help="no measurement: print the plan from --out")
    p.add_argument("--markdown", action="store_true", help="also print the plan as a markdown table")
    p.add_argument("--tflops", type=float, default=400.0, help="ASSUMED sustained bf16 TFLOP/s of one GPU")
    p.add_argument("--hbm-tbs", type=float, default=3.35, help="ASSUMED GPU memory bandwidth, TB/s (decoding)")
    p.add_argument("--no-optimizer-step", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--one", nargs=4, metavar=("MODEL", "JOB", "LAYERS", "BATCH"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:                                     # worker: one measurement, JSON on stdout
        torch.set_num_threads(a.threads)
        name, job, L, B = a.one
        print("RESULT " + json.dumps(measure(REAL[name], job, int(L), int(B), device=a.device,
                                             optimizer_step=not a.no_optimizer_step)))
        return
    models, jobs = a.models.split(","), a.jobs.split(",")
    bad = [m for m in models if m not in REAL] + [j for j in jobs if j not in JOBS]
    if bad:
        fail(f"unknown models / jobs {bad}; models: {tuple(REAL)}, jobs: {JOBS}")
    results = load_results(a.out)
    todo = [] if a.plan_only else [(n, j, pts, kw) for n, j, pts, kw in RUNS if n in models and j in jobs]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MALLOC_MMAP_THRESHOLD_="65536")
    for name, job, points, kw in todo:
        for L, B in points:
            key = f"{L},{B}"
            if key in results.get(name, {}).get(job, {}) and not a.redo:
                continue
            t = time.time()
            cmd = [sys.executable, "-m", "eval.tools.memory_plan", "--threads", str(a.threads), "--device", a.device,
                   "--one", name, job, str(L), str(B)] + (["--no-optimizer-step"] if kw.get("optimizer_step") is False
                                                          else [])
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode or not line:
                print(f"{name} {job} L={L} B={B}: failed (exit {r.returncode})\n{r.stderr[-3000:]}", file=sys.stderr)
                continue
            rec = json.loads(line[0][7:])
            results = load_results(a.out)          # another run may have added to it meanwhile
            results.setdefault(name, {}).setdefault(job, {})[key] = rec
            atomic_write_text(a.out, json.dumps(results, indent=1))
            print(f"{name:17s} {job:9s} L={L} B={B}: fwd+bwd peak {rec['fwd_bwd_peak'] / GB:.2f} GB, saved "
                  f"{rec['saved_bytes'] / GB:.2f} GB, params {rec['param_bytes'] / GB:.2f} GB, "
                  f"{rec['flops'] / 1e12:.2f} TFLOP, step {rec['step_s']:.1f} s ({time.time() - t:.0f} s wall)",
                  flush=True)
    print_figures(results)
    rows = plan(results, a.tflops, a.hbm_tbs)
    print_plan(rows, a.tflops, a.hbm_tbs)
    if a.markdown:
        print("\n" + markdown_inputs(results) + "\n\n" + markdown(rows, a.tflops, a.hbm_tbs))
    return rows


if __name__ == "__main__":
    main()
