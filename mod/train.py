"""Train MoD (or the LoRA / MoE-LoRA baselines) on a frozen VLM, MoD paper §3.3.

    loss = L_reg (cross-entropy on the target response, eq. 8) + lambda * L_aux (eq. 9)

Only the adapters train; the base model stays frozen. Task loss and aux loss are logged
separately (out/log.jsonl and the progress bar).

    # CPU, tiny default (a few minutes)
    python -m mod.train --model tiny-dense --data out/mod/data/train_vs.json --out out/mod/run --steps 300
    # one GPU (bf16 autocast, compiled)
    python -m mod.train --model /ckpt/Qwen2.5-VL-3B-Instruct --data train_vs.json --out run --device cuda --compile
    # several GPUs
    torchrun --nproc_per_node 8 -m mod.train --model ... --device cuda --compile

Batches are drawn per step from a generator seeded with (seed, step, rank), so a resumed run
(--resume) sees exactly the batches of an uninterrupted one; checkpoints hold the adapters,
the optimizer and the RNG state and are written atomically (temp file + rename).
"""
import argparse
import json
import math
import os
import random
import time
from contextlib import nullcontext

import numpy as np
import torch
from tqdm import tqdm

from mod.model import AdapterConfig, adapter_state_dict, attach, aux_loss, num_trainable, save_adapters


def add_adapter_args(p):
    """Adapter flags shared by train / toy entry points (names follow AdapterConfig)."""
    d = AdapterConfig()
    p.add_argument("--method", default=d.method, choices=["mod", "lora", "moelora"], help="adapter type")
    p.add_argument("--target-modules", default=",".join(d.target_modules),
                   help="comma-separated name suffixes of the language model's nn.Linear layers to wrap")
    p.add_argument("--r", type=int, default=d.r, help="top-r experts per token (mod/moelora) or LoRA rank (lora)")
    p.add_argument("--lora-alpha", type=float, default=d.lora_alpha, help="output scale alpha / r")
    p.add_argument("--num-experts", type=int, default=d.num_experts, help="experts per pool (E)")
    p.add_argument("--expert-rank", type=int, default=d.expert_rank, help="rank of each MoE-LoRA expert")
    p.add_argument("--window", type=int, default=d.window, help="routing window / region size W")
    p.add_argument("--granularity", default=d.granularity, choices=["token", "region", "window"],
                   help="routing input: the token, its block of W, or the sliding mean of the last W")
    p.add_argument("--combine", default=d.combine, choices=["sqrt_product", "product", "mean"],
                   help="how A and B gates combine (eq. 5)")
    p.add_argument("--shared-router", action="store_true", help="one router for both pools (I_A = I_B)")
    p.add_argument("--noise-std", type=float, default=d.noise_std, help="router logit noise std in training")
    p.add_argument("--aux-coef", type=float, default=d.aux_coef, help="lambda of the load-balance loss (0 = off)")


def adapter_config(args):
    return AdapterConfig(method=args.method, target_modules=args.target_modules, r=args.r,
                         lora_alpha=args.lora_alpha, num_experts=args.num_experts, expert_rank=args.expert_rank,
                         window=args.window, granularity=args.granularity, combine=args.combine,
                         shared_router=args.shared_router, noise_std=args.noise_std, aux_coef=args.aux_coef)


# ----------------------------------------------------------------------------- data

class Batcher:
    """Turns training records into model batches; images are decoded once and kept as uint8.

    records: dicts with image (path), question, target. 84x84-style images (sides multiple
    of 28) are patchified in torch (`common.backbone.patchify`), others go through the
    processor."""

    def __init__(self, proc, records):
        from common.data import load_image
        self.proc, self.records = proc, records
        paths = list(dict.fromkeys(r["image"] for r in records))
        self.slot = {p: i for i, p in enumerate(paths)}
        self.images = [load_image(p) for p in paths]
        sizes = {im.size for im in self.images}
        self.uint8 = None
        if len(sizes) == 1 and all(s % 28 == 0 for s in next(iter(sizes))):
            self.uint8 = torch.from_numpy(np.stack([np.asarray(im) for im in self.images]))

    def pixels(self, recs):
        from common.backbone import patchify
        if self.uint8 is None:
            return None
        return patchify(self.uint8[[self.slot[r["image"]] for r in recs]])

    def encode(self, recs, answers=None, questions=None):
        """Model inputs for records; with answers: training batch (right padding, labels)."""
        questions = questions or [r["question"] for r in recs]
        px = self.pixels(recs)
        images = None if px is not None else [self.images[self.slot[r["image"]]] for r in recs]
        return self.proc.encode(images, questions, answers=answers, pixels=px)


def batch_indices(n, batch_size, seed, step, micro, rank):
    """Record indices of one micro-batch: a generator seeded by (seed, step, micro, rank)."""
    rng = random.Random(((seed * 1_000_003 + step) * 101 + micro) * 1009 + rank)
    return [rng.randrange(n) for _ in range(batch_size)]


def lr_at(step, steps, lr, warmup):
    """Linear warmup then cosine decay to 10% of lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


# ----------------------------------------------------------------------------- checkpoints

def save_ckpt(path, model, opt, step):
    state = {"adapters": adapter_state_dict(model), "opt": opt.state_dict(), "step": step,
             "torch_rng": torch.get_rng_state()}
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_ckpt(path, model, opt):
    state = torch.load(path, map_location="cpu", weights_only=False)
    own = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in state["adapters"].items():
            own[k].copy_(v)
    opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"]


# ----------------------------------------------------------------------------- loop

def fit(model, proc, records, out_dir, steps=300, batch_size=16, grad_accum=1, lr=2e-3, warmup=20,
        weight_decay=0.0, clip=1.0, seed=0, aux_coef=0.01, save_every=0, resume=False, compile=False,
        log_every=10, rank=0, world=1, desc="train", quiet=False):
    """Train the attached adapters of `model` on (question, target) records.

    Writes out_dir/log.jsonl ({step, loss, aux, lr, s}) and out_dir/ckpt.pt (every
    `save_every` steps and at the end). Returns {"loss", "aux", "wall_s", "steps"} averaged
    over the last 10% of steps. With world > 1 the process group must be initialised."""
    os.makedirs(out_dir, exist_ok=True)
    raw = model
    device = next(raw.parameters()).device
    params = [p for p in raw.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)
    ckpt = os.path.join(out_dir, "ckpt.pt")
    start = load_ckpt(ckpt, raw, opt) if resume and os.path.exists(ckpt) else 0
    run = raw
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel
        run = DistributedDataParallel(raw, device_ids=[device.index] if device.type == "cuda" else None)
    if compile:
        run = torch.compile(run)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    batcher = Batcher(proc, records)
    raw.train()
    log_path, tail, t0 = os.path.join(out_dir, "log.jsonl"), [], time.time()
    bar = tqdm(range(start, steps), desc=desc, disable=quiet or rank != 0, leave=False)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        task_sum = aux_sum = 0.0
        for micro in range(grad_accum):
            recs = [records[i] for i in batch_indices(len(records), batch_size, seed, step, micro, rank)]
            batch = {k: v.to(device) for k, v in batcher.encode(recs, answers=[r["target"] for r in recs]).items()}
            with amp:
                out = run(**batch)
            aux = aux_loss(raw)
            loss = out.loss + aux_coef * aux
            (loss / grad_accum).backward()
            task_sum, aux_sum = task_sum + out.loss.item() / grad_accum, aux_sum + aux.item() / grad_accum
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tail = (tail + [(task_sum, aux_sum)])[-max(1, (steps - start) // 10):]
        if rank == 0 and (step % log_every == 0 or step == steps - 1):
            with open(log_path, "a") as f:
                f.write(json.dumps({"step": step, "loss": task_sum, "aux": aux_sum, "lr": opt.param_groups[0]["lr"],
                                    "s": round(time.time() - t0, 2)}) + "\n")
            bar.set_postfix(loss=f"{task_sum:.3f}", aux=f"{aux_sum:.3f}")
        if rank == 0 and save_every and (step + 1) % save_every == 0 and step + 1 < steps:
            save_ckpt(ckpt, raw, opt, step + 1)
    if rank == 0:
        save_ckpt(ckpt, raw, opt, steps)
    raw.eval()
    mean = lambda i: float(np.mean([t[i] for t in tail])) if tail else float("nan")
    return {"loss": mean(0), "aux": mean(1), "wall_s": time.time() - t0, "steps": steps - start}


def main(argv=None):
    p = argparse.ArgumentParser(description="Train MoD / LoRA / MoE-LoRA adapters on a frozen VLM (MoD §3.3).")
    p.add_argument("--model", default="tiny-dense", help="base model: checkpoint dir or tiny-dense / tiny-moe")
    p.add_argument("--data", required=True, help="training records (LLaVA JSON/JSONL, e.g. from mod.data)")
    p.add_argument("--out", required=True, help="output dir: adapter files, ckpt.pt, log.jsonl")
    add_adapter_args(p)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="micro-batch size per process")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="seed of adapter init and batch sampling")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (0 = only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt if present")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu / cuda")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (worth it on GPU)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(args.device)
    if world > 1:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
    from common.backbone import load_backbone
    from common.data import read_llava_json
    model, proc = load_backbone(args.model, device=device)
    torch.manual_seed(args.seed)
    cfg = adapter_config(args)
    names = attach(model, cfg)
    if rank == 0:
        print(f"{cfg.method}: wrapped {len(names)} layers, {num_trainable(model):,} trainable parameters")
    records = read_llava_json(args.data)
    res = fit(model, proc, records, args.out, args.steps, args.batch_size, args.grad_accum, args.lr, args.warmup,
              args.weight_decay, args.clip, args.seed, cfg.aux_coef, args.save_every, args.resume, args.compile,
              rank=rank, world=world)
    if rank == 0:
        save_adapters(model, args.out)
        print(f"done: loss {res['loss']:.4f} aux {res['aux']:.4f} ({res['wall_s']:.0f} s); adapters in {args.out}")
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
