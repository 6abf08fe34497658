"""Train MoD (or the LoRA / MoE-LoRA baselines) on a frozen VLM, MoD paper §3.3.

    loss = L_reg (cross-entropy on the target response, eq. 8) + lambda * L_aux (eq. 9)

L_reg is the token mean of the step's cross-entropy by default; `--loss-reduction sum` takes
eq. 8 literally, the sum over each target response's tokens (averaged over the step's records),
which is the mean times |a'| for one record: lambda then weighs the aux loss |a'| times less.
MoE-LoRA's default (`--method moelora`: 11 rank-1 experts, top-4) has MoD's trainable
parameters within ~1 % at Qwen2.5-VL-3B / 7B; `python -m mod.params --model PATH --flags` prints
the flags that match on any checkpoint (LLaVA-1.6-13B: `--experts-pattern k_proj=10`, +0.8 %), the
paper's "same learnable parameter scale".

Only the adapters train; the base model stays frozen. Task loss and aux loss are logged
separately (out/log.jsonl and the progress bar).

    # CPU, tiny default (a few minutes)
    python -m mod.train --model tiny-chat --data out/mod/data/train_vs.json --out out/mod/run --steps 300
    # one GPU (bf16 autocast, compiled)
    python -m mod.train --model /ckpt/Qwen2.5-VL-3B-Instruct --data train_vs.json --out run --device cuda --compile
    # several GPUs (--batch-size counts the records of one optimizer step: 16 per GPU here)
    torchrun --nproc_per_node 8 -m mod.train --model ... --batch-size 128 --device cuda --compile

Batches are drawn per step from a generator seeded with (seed, step, rank), so a resumed run
(--resume) sees exactly the batches of an uninterrupted one; the checkpoint OUT/ckpt/
(`common.checkpoint`: adapters + RNG state as safetensors, optimizer state, settings and log)
is written atomically, so a killed run leaves the previous complete one. --resume refuses a
checkpoint written with other settings (method, ranks, lr, steps, batch size, seed, base,
data, ...) and lists the differences (--steps may change while the finished steps' learning
rates stay the same, e.g. inside warmup); an existing run in OUT needs --resume or --overwrite.
SIGTERM or Ctrl-C finishes the current step, writes a checkpoint and exits (status 143 / 130); a non-finite
loss stops the run before the update and keeps the last checkpoint. User errors print
`error: ...` and exit with status 2.
"""
import json
import math
import os
import random
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from common.backbone import base_identity, load_backbone
from common.checkpoint import save_train_state
from common.data import IMAGE_ROOT_HELP, SKIP_BAD_HELP, Batcher, atomic_write_text, name_path  # noqa: F401  (mod.train.Batcher: the trainer's batches)
from common.cli import add_device_args, entry_parser, load_kwargs
from common.cli import (Interrupted, RunError, check_labels, check_settings, data_fingerprint, diverged, end_distributed,
                        number, read_checkpoint, restore_optimizer, run_cli, set_threads, sigterm_flag, step_means,
                        step_tokens, token_ce, add_threads, SAVE_EVERY)
from common.routing import rank_mean
from common.schedule import lr_at
from mod.data import load_records
from mod.params import MOELORA_MATCHED
from mod.model import (CONFIG_NAME, WEIGHTS_NAME, AdapterConfig, adapter_state_dict, attach, aux_loss, compile_adapters,
                       num_trainable, save_adapters)

CKPT = "ckpt"  # the training checkpoint inside --out: a common.checkpoint directory
OWN = (CKPT, CKPT + ".tmp", CKPT + ".old", "ckpt.pt", "log.jsonl", CONFIG_NAME, WEIGHTS_NAME)  # what a run writes


# ----------------------------------------------------------------------------- flags

def add_adapter_args(p):
    """Adapter flags shared by train / toy entry points (names follow AdapterConfig)."""
    d = AdapterConfig()
    p.add_argument("--method", default=d.method, choices=["mod", "lora", "moelora"], help="adapter type")
    p.add_argument("--target-modules", default=",".join(d.target_modules),
                   help="comma-separated name suffixes of the language model's nn.Linear layers to wrap")
    p.add_argument("--r", type=number(min=1), default=d.r,
                   help="top-r experts per token (mod/moelora) or LoRA rank (lora)")
    p.add_argument("--lora-alpha", type=number(float, above=0), default=d.lora_alpha, help="output scale alpha / r")
    p.add_argument("--num-experts", type=number(min=1), default=None,
                   help=f"experts per pool (E); default {d.num_experts} for mod, "
                   f"{MOELORA_MATCHED['num_experts']} for moelora (MoD's trainable parameters within ~1 %% at Qwen2.5-VL; "
                   "mod.params --model PATH --flags for others)")
    p.add_argument("--experts-pattern", default="", metavar="MODULE=E,...",
                   help="per-projection expert counts overriding --num-experts (peft's rank_pattern for E), e.g. "
                   "o_proj=10: `python -m mod.params --model PATH` prints the MoE-LoRA flags that match MoD's "
                   "trainable parameters on a checkpoint")
    p.add_argument("--expert-rank", type=number(min=1), default=None,
                   help=f"rank of each MoE-LoRA expert (default {MOELORA_MATCHED['expert_rank']})")
    p.add_argument("--window", type=number(min=1), default=d.window, help="routing window / region size W")
    p.add_argument("--granularity", default="", choices=["token", "region", "window"],
                   help="routing input: the token, its block of W, or the sliding mean of the last W "
                   "(default: window for mod, token for moelora as in the paper's MoE-LoRA baseline)")
    p.add_argument("--combine", default=d.combine, choices=["sqrt_product", "product", "mean"],
                   help="how A and B gates combine (eq. 5)")
    p.add_argument("--shared-router", action="store_true", help="one router for both pools (I_A = I_B)")
    p.add_argument("--noise-std", type=number(float, min=0), default=d.noise_std,
                   help="router logit noise std in training")
    p.add_argument("--aux-coef", type=number(float, min=0), default=d.aux_coef,
                   help="lambda of the load-balance loss (0 = off)")


def parse_pattern(text):
    """"o_proj=10,q_proj=12" -> {"o_proj": 10, "q_proj": 12} (ValueError naming the bad entry)."""
    out = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, _, n = item.partition("=")
        if not name or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--experts-pattern entry {item!r} is not MODULE=E with E >= 1 (e.g. o_proj=10)")
        if name.strip() in out:
            raise ValueError(f"--experts-pattern names {name.strip()!r} twice; give each module once")
        out[name.strip()] = int(n)
    return out


def adapter_config(args):
    """The AdapterConfig of parsed `add_adapter_args` flags (ValueError for inconsistent ones).
    --num-experts / --expert-rank not given: AdapterConfig's (8, 1) for mod and lora,
    `mod.params.MOELORA_MATCHED` for moelora (parameter-matched to MoD's default)."""
    d = MOELORA_MATCHED if args.method == "moelora" else asdict(AdapterConfig())
    E = d["num_experts"] if args.num_experts is None else args.num_experts
    k = d["expert_rank"] if args.expert_rank is None else args.expert_rank
    return AdapterConfig(method=args.method, target_modules=args.target_modules, r=args.r,
                         lora_alpha=args.lora_alpha, num_experts=E, expert_rank=k,
                         experts_pattern=parse_pattern(args.experts_pattern),
                         window=args.window, granularity=args.granularity, combine=args.combine,
                         shared_router=args.shared_router, noise_std=args.noise_std, aux_coef=args.aux_coef)


@dataclass
class TrainConfig:
    """The settings of one training run, as `fit` takes them. Field names are the dest names of
    mod.train's flags (`train_config` fills one from parsed flags; tests/test_mod_params.py checks
    the names); the defaults are `fit`'s for callers that build one in code (the toys).

    steps: optimizer steps. batch_size: records per optimizer step, all processes and
    `grad_accum` micro-batches together. lr: peak AdamW learning rate; the schedule is
    `common.schedule.lr_at` with `warmup` steps (None: `default_warmup(steps)`) and a floor of
    MIN_LR_RATIO x lr. weight_decay: AdamW's. clip: gradient-norm clip (0 = off). aux_coef: lambda
    of the load-balance loss (eq. 9). loss_reduction: "mean" or "sum" of L_reg (`accumulate`).
    seed: batch sampling. save_every: also checkpoint every N steps (0 = only at the end).
    log_every: a log.jsonl line every N steps (and the last). resume: continue out_dir/ckpt.
    compile: torch.compile the adapters' hot path."""
    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 2e-3
    warmup: int | None = None
    weight_decay: float = 0.0
    clip: float = 1.0
    aux_coef: float = 0.01
    loss_reduction: str = "mean"
    seed: int = 0
    save_every: int = 0
    log_every: int = 10
    resume: bool = False
    compile: bool = False


def train_config(args):
    """The TrainConfig of parsed mod.train flags (each field from the flag of the same dest)."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})


def check_batch(batch_size, grad_accum, world):
    """RunError unless `batch_size` records per optimizer step split into `world` processes x
    `grad_accum` micro-batches; returns the records of one micro-batch of one process."""
    if batch_size % (world * grad_accum):
        raise RunError(f"--batch-size {batch_size} (records per optimizer step) does not divide into {world} "
                       f"process(es) x --grad-accum {grad_accum} micro-batches; pass a multiple of "
                       f"{world * grad_accum}")
    return batch_size // (world * grad_accum)


# ----------------------------------------------------------------------------- data

def batch_indices(n, batch_size, seed, step, micro, rank=0, world=1):
    """Record indices of one micro-batch of process `rank`: slice `rank` of the world * batch_size
    indices drawn by a generator seeded by (seed, step, micro), so W processes of batch B train
    on the batches one process of batch W * B draws (world 1: the draws of every earlier run)."""
    rng = random.Random(((seed * 1_000_003 + step) * 101 + micro) * 1009)
    return [rng.randrange(n) for _ in range(world * batch_size)][rank * batch_size:(rank + 1) * batch_size]


def default_warmup(steps):
    """Warmup steps when --warmup-steps is not given: a tenth of the run, at least 1 and at most 20 (so 20 from
    200 steps on, as before; a 10-step run warms up over 1 step instead of never reaching its peak lr)."""
    return min(20, max(1, steps // 10))


MIN_LR_RATIO = 0.1  # the cosine decays to 10 % of --lr (`common.schedule.lr_at`)


# ----------------------------------------------------------------------------- checkpoints

RNG = "__torch_rng_state__"  # the torch CPU RNG state, stored with the adapter tensors
BATCH_UNIT = "optimizer step"  # --batch-size counts the records of one optimizer step (settings key batch_size_unit)


def run_settings(model, records, **train_kw):
    """Everything that defines a run (adapter config, schedule, optimiser, seed, world size,
    base identity, data fingerprint) as state.json gives it back: resume requires equality."""
    cfg = asdict(model._adapter["config"])
    cfg.pop("aux_coef")  # the loss weight actually used is fit's aux_coef (in train_kw)
    base = base_identity(model)
    base.pop("name_or_path")  # a moved base checkpoint is the same base
    return json.loads(json.dumps({**cfg, **train_kw, "base_model": base, "data": data_fingerprint(records)}))


def same_lr_prefix(saved, now, done):
    """True if the `done` finished steps had the same learning rates under both settings'
    schedules (e.g. still in warmup): then changing --steps continues the run exactly."""
    try:
        return all(lr_at(s, saved["steps"], saved["lr"], saved["warmup"], MIN_LR_RATIO)
                   == lr_at(s, now["steps"], now["lr"], now["warmup"], MIN_LR_RATIO) for s in range(done))
    except KeyError:
        return False


def save_ckpt(path, model, opt, step, settings, log):
    """Atomic checkpoint directory (common.checkpoint): adapter tensors + torch RNG state
    (safetensors), optimizer state (loaded back with weights_only=True), state.json with
    step, settings and the per-step log."""
    tensors = {k: v.cpu() for k, v in adapter_state_dict(model).items()}
    tensors[RNG] = torch.get_rng_state()
    save_train_state(path, tensors, opt, {"step": step, "settings": settings, "log": log})


def load_ckpt(path, model, opt, settings):
    """Restore a `save_ckpt` directory (or its `.old` twin after a crash between renames;
    a leftover `.tmp` is never read) into model, opt and the torch RNG.

    Returns (step, log), (0, []) when there is no checkpoint. Raises RunError, before
    anything is changed, when the checkpoint is unreadable, was written with other
    settings (message lists each key saved vs now) or holds other tensors."""
    tensors, optim, state = read_checkpoint(path)
    if state is None:
        return 0, []
    saved = dict(state.get("settings", {}))
    if "batch_size" in saved and saved.get("batch_size_unit") != BATCH_UNIT:  # written when it was per micro-batch
        saved["batch_size"] *= saved.get("grad_accum", 1) * saved.get("world_size", 1)  # of one process
    if state["step"] > settings["steps"]:
        raise RunError(f"--resume: {path} is at step {state['step']}, past --steps {settings['steps']}; pass "
                       f"--steps {saved.get('steps', state['step'])} (its run) or more, or --overwrite to start over")
    if saved.get("steps") != settings["steps"] and same_lr_prefix(saved, settings, state["step"]):
        saved["steps"] = settings["steps"]  # a longer / shorter run that had the same past: exact
    check_settings(path, saved, settings)
    own = {k: p for k, p in model.named_parameters() if p.requires_grad}
    if set(own) != set(tensors) - {RNG} or any(own[k].shape != tensors[k].shape for k in own):
        raise RunError(f"checkpoint {path} holds other adapter tensors than this model; start over with --overwrite")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(tensors[k])
    restore_optimizer(opt, optim, path)
    torch.set_rng_state(tensors[RNG])
    return state["step"], state["log"]


def prepare_out(out, resume, overwrite):
    """Protect an earlier run in `out`: this script's files (OWN) may be there only with
    --resume (continue) or --overwrite (start over); other files in `out` are never touched.
    Returns the paths --overwrite will delete (the caller deletes them once data and base have
    loaded, so a typo elsewhere costs nothing). Raises RunError with what to pass."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise RunError(f"--out {out} is a file, not a directory")
    found = [f for f in OWN if os.path.exists(os.path.join(out, f))]
    if not found:
        if resume:
            print(f"--resume: no run in {out}; starting at step 0", file=sys.stderr)
        return []
    if overwrite:
        return [os.path.join(out, f) for f in found]
    if not resume:
        raise RunError(f"--out {out} already holds a run ({', '.join(found)}); pass --resume to continue it "
                       f"or --overwrite to start over (deletes those files)")
    if "ckpt.pt" in found:
        raise RunError(f"{out}/ckpt.pt was written by an older mod.train (torch.save format), which --resume no "
                       f"longer reads; start over with --overwrite")
    if CKPT not in found and CKPT + ".old" not in found:
        raise RunError(f"--resume: {out} holds {', '.join(found)} but no checkpoint ({CKPT}/) to continue from; "
                       f"pass --overwrite to start over")
    return []


# ----------------------------------------------------------------------------- loop

def _write_log(path, rows):
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))   # a failed write leaves no temp


def accumulate(run, raw, batches, aux_coef=0.0, amp=None, world=1, reduction="mean"):
    """Forward + backward of one optimizer step over its micro-batches (gradients add up in
    .grad). The task loss is the cross-entropy summed over label tokens and divided by the
    label tokens of the whole step (`common.cli.token_ce`), so 1 x 4 records, 2 x 2 and 4 x 1
    give the same gradient; the aux loss (eq. 9), a per-micro-batch average over routed tokens,
    weighs 1 / len(batches) per micro-batch. Returns (task loss = the step's token-mean CE,
    mean aux) as floats. reduction "sum": eq. 8 literally, the CE summed over each record's target
    tokens and averaged over the step's records (all processes), i.e. the token mean times the
    step's label tokens per record."""
    n = step_tokens([b["labels"] for b in batches], world)
    if reduction == "sum":
        n = float(sum(b["labels"].shape[0] for b in batches))  # DDP averages over ranks: the mean of all records
    task_sum = aux_sum = 0.0
    for batch in batches:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with amp or nullcontext():
            out = run(**inputs)
        task, aux = token_ce(out.logits, batch["labels"], n), aux_loss(raw)
        (task + aux_coef * aux / len(batches)).backward()
        task_sum, aux_sum = task_sum + task.item(), aux_sum + aux.item() / len(batches)
    return task_sum, aux_sum


def fit(model, proc, records, out_dir, cfg=None, rank=0, world=1, desc="train", quiet=False, batcher=None):
    """Train the attached adapters of `model` on (question, target) records with the settings
    `cfg` (a TrainConfig; None: its defaults).

    Writes out_dir/log.jsonl ({step, loss, aux, lr, s} every `cfg.log_every` steps) and the
    checkpoint out_dir/ckpt (every `cfg.save_every` steps, at the end, and on SIGTERM). Returns
    {"loss", "aux", "wall_s", "steps", "log"}: loss / aux averaged over the last 10% of steps,
    log = one {step, loss, aux, lr, s} per step of the whole run (a resumed run included).
    With world > 1 the process group must be initialised. batcher: a `Batcher` of `records`
    made earlier (its images already decoded), else one is made here. desc / quiet: the
    progress bar's label / no progress bar.
    Raises RunError when resuming a checkpoint of other settings, when a batch has no label
    to train on, and on a non-finite loss or gradient (the update is skipped, the last
    checkpoint kept); Interrupted after SIGTERM (step finished, checkpoint written).
    Each process draws batch_size / (world * grad_accum) records per micro-batch (RunError when
    that does not divide). warmup None: `default_warmup(steps)`, resolved here, so a checkpoint
    records (and --resume compares) the number of steps actually used. The logged loss is L_reg
    as `cfg.loss_reduction` sums it."""
    cfg = cfg or TrainConfig()
    if cfg.loss_reduction not in ("mean", "sum"):
        raise RunError(f"loss_reduction must be mean or sum, not {cfg.loss_reduction!r}")
    if not records:
        raise RunError("no training records")
    steps, lr, grad_accum, log_every = cfg.steps, cfg.lr, cfg.grad_accum, cfg.log_every
    warmup = default_warmup(steps) if cfg.warmup is None else cfg.warmup
    micro = check_batch(cfg.batch_size, grad_accum, world)   # records per micro-batch of each process
    os.makedirs(out_dir, exist_ok=True)
    raw = model
    device = next(raw.parameters()).device
    params = [p for p in raw.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    ckpt = os.path.join(out_dir, CKPT)
    settings = run_settings(raw, records, steps=steps, batch_size=cfg.batch_size, grad_accum=grad_accum, lr=lr,
                            warmup=warmup, weight_decay=cfg.weight_decay, clip=cfg.clip, seed=cfg.seed,
                            aux_coef=cfg.aux_coef, world_size=world, batch_size_unit=BATCH_UNIT,
                            **({"loss_reduction": cfg.loss_reduction} if cfg.loss_reduction != "mean" else {}))
    start, log = load_ckpt(ckpt, raw, opt, settings) if cfg.resume else (0, [])
    saved_at = start if start else None  # step of the last checkpoint of this run on disk
    run = raw
    if cfg.compile:           # the adapters' hot path, in place, before DDP (the base model stays eager)
        compile_adapters(raw)
    if world > 1:
        run = DistributedDataParallel(raw, device_ids=[device.index] if device.type == "cuda" else None)
        raw._adapter["ctx"].reduce = rank_mean  # the aux loss of the global batch, as one process computes it
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    batcher = batcher or Batcher(proc, records)
    batcher.proc = proc
    raw.train()
    log_path, t0 = os.path.join(out_dir, "log.jsonl"), time.time()
    logged = lambda step: step % log_every == 0 or step == steps - 1
    if rank == 0:  # a fresh log, or the resumed run's (lines after its checkpoint are dropped)
        _write_log(log_path, [r for r in log if logged(r["step"])])
    bar = tqdm(range(start, steps), desc=desc, disable=quiet or rank != 0, leave=False, initial=start, total=steps)
    try:
        with sigterm_flag() as flag:
            for step in bar:
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, steps, lr, warmup, MIN_LR_RATIO)
                batches = []
                for m in range(grad_accum):
                    recs = [records[i] for i in batch_indices(len(records), micro, cfg.seed, step, m, rank, world)]
                    batch = {k: v.to(device) for k, v in batcher.encode(recs, answers=[r["target"] for r in recs]).items()}
                    check_labels(batch["labels"], step, recs)
                    batches.append(batch)
                task_sum, aux_sum = accumulate(run, raw, batches, cfg.aux_coef, amp, world, cfg.loss_reduction)
                if world > 1:  # the global batch's losses (what one process logs), and one stop decision for all
                    mine = flag["stop"]  # read once: a signal arriving after the all-reduce counts next step
                    m = step_means({"task": task_sum, "aux": aux_sum, "stop": 1.0 if mine else 0.0}, world)
                    task_sum, aux_sum = m["task"], m["aux"]
                    agreed = (mine or "a signal to another process") if m["stop"] else False
                gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.clip if cfg.clip > 0 else float("inf")))
                if not all(map(math.isfinite, (task_sum, aux_sum, gnorm))):
                    raise diverged(step, f"loss {task_sum}, aux {aux_sum}, gradient norm {gnorm}", ckpt, saved_at,
                                   cfg.save_every)
                opt.step()
                opt.zero_grad(set_to_none=True)
                rec = {"step": step, "loss": task_sum, "aux": aux_sum, "lr": opt.param_groups[0]["lr"],
                       "s": round(time.time() - t0, 2)}
                log.append(rec)
                if rank == 0 and logged(step):
                    try:
                        with open(log_path, "a") as f:
                            f.write(json.dumps(rec) + "\n")
                    except OSError as e:  # a full disk: `error: ...` names the log
                        raise name_path(e, log_path)
                    bar.set_postfix(loss=f"{task_sum:.3f}", aux=f"{aux_sum:.3f}")
                if rank == 0 and cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < steps:
                    save_ckpt(ckpt, raw, opt, step + 1, settings, log)
                    saved_at = step + 1
                stop = agreed if world > 1 else flag["stop"]
                if stop and step + 1 < steps:  # SIGTERM / Ctrl-C during this step (or its checkpoint write)
                    if rank == 0 and saved_at != step + 1:
                        save_ckpt(ckpt, raw, opt, step + 1, settings, log)
                    raise Interrupted(f"interrupted at step {step + 1} of {steps} ({stop}); checkpoint {ckpt} written; "
                                      f"continue with --resume", flag["signum"])
    finally:
        run = None  # the DDP wrapper goes before the process group (common.cli.end_distributed)
        raw._adapter["ctx"].reduce = None
    if rank == 0:
        save_ckpt(ckpt, raw, opt, steps, settings, log)
    raw.eval()
    tail = log[-max(1, steps // 10):]
    mean = lambda k: float(np.mean([r[k] for r in tail])) if tail else float("nan")
    return {"loss": mean("loss"), "aux": mean("aux"), "wall_s": time.time() - t0, "steps": steps - start, "log": log}


def get_parser():
    """The argparse parser of mod.train (every flag with its help): the run's inputs, the adapter
    flags (`add_adapter_args`, an AdapterConfig) and the training flags (a TrainConfig)."""
    p = entry_parser(__spec__.name, "Train MoD / LoRA / MoE-LoRA adapters on a frozen VLM (MoD §3.3).")
    p.add_argument("--model", default="tiny-chat", help="base model: checkpoint dir or tiny-chat / tiny-dense")
    p.add_argument("--data", required=True,
                   help="training records: LLaVA JSON/JSONL (e.g. from mod.data) or canonical JSONL")
    p.add_argument("--image-root", default=None, help=IMAGE_ROOT_HELP)
    p.add_argument("--skip-bad", action="store_true", help=SKIP_BAD_HELP)
    p.add_argument("--out", required=True, help="output dir: adapter files, ckpt/, log.jsonl")
    add_adapter_args(p)
    p.add_argument("--steps", type=number(min=1), default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=number(min=1), default=16,
                   help="records per optimizer step, all processes and --grad-accum micro-batches together (a "
                        "multiple of processes x --grad-accum)")
    p.add_argument("--grad-accum", type=number(min=1), default=1,
                   help="split each process's share of the step into this many micro-batches (memory); the loss is "
                        "normalised by the label tokens of the whole step, so the gradient is the same")
    p.add_argument("--lr", type=number(float, above=0), default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-steps", dest="warmup", type=number(min=0), default=None,
                   help="linear warmup in optimizer steps (default: min(20, steps // 10), at least 1: 20 for --steps "
                        ">= 200)")
    p.add_argument("--weight-decay", type=number(float, min=0), default=0.0, help="AdamW weight decay")
    p.add_argument("--clip", type=number(float, min=0), default=1.0, help="gradient-norm clip (0 = off)")
    p.add_argument("--loss-reduction", default="mean", choices=["mean", "sum"],
                   help="L_reg over the target tokens: mean (default) or sum (eq. 8 as written: lambda then weighs "
                   "the aux loss |a'| times less)")
    p.add_argument("--seed", type=int, default=0, help="seed of adapter init and batch sampling")
    p.add_argument("--save-every", type=number(min=0), default=SAVE_EVERY,
                   help="also checkpoint every N optimizer steps (0 = only at the end)")
    p.add_argument("--log-every", type=number(min=1), default=TrainConfig.log_every,
                   help="write a line of OUT/log.jsonl every N optimizer steps (and at the last)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the run in OUT from OUT/ckpt (same settings required)")
    again.add_argument("--overwrite", action="store_true",
                       help="delete an earlier run's files in OUT (ckpt/, log.jsonl, adapter files) and start over")
    add_device_args(p)
    p.add_argument("--compile", action="store_true", help="torch.compile the adapters' forward (routing + expert mix; the base model stays eager; "
                        "worth it on GPU)")
    add_threads(p)
    return p


def main(argv=None):
    return run_cli(train, get_parser().parse_args(argv))


def train(args):
    """The body of `main` for parsed flags. Returns fit's result dict."""
    set_threads(args.threads, args.model)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cfg = adapter_config(args)  # before anything loads: a bad flag fails in seconds
    tcfg = train_config(args)
    check_batch(tcfg.batch_size, tcfg.grad_accum, world)
    stale = prepare_out(args.out, args.resume, args.overwrite) if rank == 0 else []
    records = load_records(args.data, args.image_root, skip_bad=args.skip_bad)  # before the model loads: bad data fails in seconds
    batcher = Batcher(None, records)  # decodes every image now: a truncated one fails here too
    device = torch.device(args.device)
    if world > 1:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
    model, proc = load_backbone(args.model, dtype=load_kwargs(args)["dtype"], device=device)
    torch.manual_seed(args.seed)
    names = attach(model, cfg)
    for f in stale:  # --overwrite: data, base and adapter config all loaded fine
        shutil.rmtree(f, ignore_errors=True) if os.path.isdir(f) else os.remove(f)
    if rank == 0:
        print(f"{cfg.method}: wrapped {len(names)} layers, {num_trainable(model):,} trainable parameters")
    try:
        res = fit(model, proc, records, args.out, tcfg, rank=rank, world=world, batcher=batcher)
    except Interrupted:  # every rank stops after the same step (fit agrees on it), so all reach the barrier
        end_distributed()
        raise
    if rank == 0:
        try:   # safetensors' I/O error (a full disk) as an OSError naming the folder
            save_adapters(model, args.out)
        except Exception as e:
            err = name_path(e, args.out)
            if err is e:
                raise
            raise err from None
        print(f"done: loss {res['loss']:.4f} aux {res['aux']:.4f} ({res['wall_s']:.0f} s); adapters in {args.out}")
    if world > 1:
        end_distributed()  # after fit dropped its DDP wrapper and rank 0 wrote the adapters
    return res


if __name__ == "__main__":
    main()
