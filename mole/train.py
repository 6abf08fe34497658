"""Train MoLE (or the baselines it is compared with) on LLaVA-format data, two stages.

    python -m mole.train --data out/data --out out/mole/mole                # MoLE, tiny dense base
    python -m mole.train --data out/data --out out/mole/sft --method sft   # SFT control
    python -m mole.train ... --n-vis 8 --n-sum 0 --no-router --no-esva --latent-mixing causal   # LIVR-like
    torchrun --nproc_per_node 8 -m mole.train --base /ckpt/Qwen2.5-VL-7B-Instruct --data ... --compile

Schedule (paper, "Training stages"): `--stage1-epochs` epochs with the visual attention
bottleneck (only Z_vis read the image), then `--stage2-epochs` with direct visual access
restored; the same joint loss CE + lambda_b L_balance + lambda_z L_z + lambda_div L_div in
both. The stage of a step is a function of the global step, so a resumed run crosses the
stage boundary exactly where an uninterrupted one would.

Trainable set: LoRA on the language model (`--train lora`, default) or the whole language
model (`--train full`), plus MoLE's latent embeddings, routers and ESVAs. The vision tower
and projector stay frozen. Checkpoints hold only what was trained (+ optimizer, step, args, log)
and are written atomically (temp file, then rename).
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

from common import backbone as bb
from common import data
from common.checkpoint import load_train_state, save_train_state
from mole.lora import add_lora
from mole.model import MoLE, MoLEConfig


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="tiny-dense", help="base VLM: checkpoint directory or tiny-dense")
    p.add_argument("--data", default="out/data", help="directory with train.json (LLaVA format) + images")
    p.add_argument("--split", default="train", help="which <split>.json to train on")
    p.add_argument("--n-train", type=int, default=0, help="use only the first n training records (0 = all)")
    p.add_argument("--out", default="out/mole/mole", help="checkpoint directory (written atomically)")
    p.add_argument("--method", default="mole", choices=("mole", "sft"),
                   help="mole: latent experts; sft: the same trainer on the plain VLM (data-matched control)")
    # MoLE architecture (defaults: paper's E = S = 4, K = 2)
    p.add_argument("--n-vis", type=int, default=4, help="E, latent visual experts")
    p.add_argument("--n-sum", type=int, default=4, help="S, latent summary experts")
    p.add_argument("--top-k", type=int, default=2, help="K, visual experts per visual token")
    p.add_argument("--alpha", type=float, default=1.0, help="router prior scale alpha")
    p.add_argument("--no-router", action="store_true", help="ablation: all visual tokens visible to all experts")
    p.add_argument("--no-esva", action="store_true", help="ablation: shared value projection only")
    p.add_argument("--esva-hidden", type=int, default=0, help="ESVA MLP width (0 = value width)")
    p.add_argument("--latent-mixing", default="topological", choices=("topological", "causal"),
                   help="causal = ablation: visual experts attend to earlier visual experts")
    p.add_argument("--lambda-balance", type=float, default=0.01, help="load-balance loss weight")
    p.add_argument("--lambda-z", type=float, default=0.001, help="router z-loss weight")
    p.add_argument("--lambda-div", type=float, default=0.01, help="ESVA diversity loss weight")
    # schedule
    p.add_argument("--stage1-epochs", type=float, default=2, help="epochs with the visual bottleneck (stage 1)")
    p.add_argument("--stage2-epochs", type=float, default=1, help="epochs with direct visual access (stage 2)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch size (split over DDP ranks)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW, warmup + cosine)")
    p.add_argument("--warmup", type=float, default=0.05, help="warmup fraction of all steps")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    # trainable set
    p.add_argument("--train", default="lora", choices=("lora", "full"), help="LoRA on the LLM, or the full LLM")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank r")
    p.add_argument("--lora-alpha", type=float, default=16, help="LoRA alpha (scaling = alpha / r)")
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", help="LoRA target module name suffixes")
    # system
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (worth it on GPU)")
    p.add_argument("--seed", type=int, default=0, help="seed (init, data order)")
    p.add_argument("--resume", action="store_true", help="continue from --out if it exists")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every n steps (0 = only at the end)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this global step (0 = full schedule); "
                                                              "the schedule itself is unchanged")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def mole_config(a):
    return MoLEConfig(n_vis=a.n_vis, n_sum=a.n_sum, top_k=a.top_k, alpha=a.alpha, router=not a.no_router,
                      esva=not a.no_esva, esva_hidden=a.esva_hidden, latent_mixing=a.latent_mixing,
                      lambda_balance=a.lambda_balance, lambda_z=a.lambda_z, lambda_div=a.lambda_div)


def build(a, device):
    """Base VLM (+ LoRA) (+ MoLE) with the trainable set of `a`. Returns (net, proc, params)
    where net is a MoLE or (method sft) the plain VLM."""
    model, proc = bb.load_backbone(a.base, device=device)
    model.requires_grad_(False)
    torch.manual_seed(a.seed)
    lm = bb.text_model(model)
    if a.train == "lora":
        add_lora(lm, tuple(a.lora_targets.split(",")), r=a.lora_r, lora_alpha=a.lora_alpha)
        model.to(device)
    else:
        lm.requires_grad_(True)
        model.lm_head.requires_grad_(True)
    for n, prm in lm.named_parameters():
        if "lora_" in n:
            prm.requires_grad_(True)
    net = model if a.method == "sft" else MoLE(model, proc, mole_config(a))
    net.train()
    params = {n: p for n, p in net.named_parameters() if p.requires_grad}
    return net, proc, params


def load_mole(path, device="cpu"):
    """Rebuild a trained model from a checkpoint directory of this script. Returns
    (net, proc, stage): net is a MoLE (or the plain VLM for --method sft); stage is the attention stage for inference (2 unless stage 2 never ran).
    Raises FileNotFoundError / ValueError for a missing or incomplete checkpoint."""
    tensors, state = load_train_state(path)
    if state is None:
        raise FileNotFoundError(f"{path}: no checkpoint (expected a directory written by mole.train)")
    a = argparse.Namespace(**state["args"])
    net, proc, params = build(a, device)
    missing = set(params) - set(tensors)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks trainable tensors {sorted(missing)[:3]}...")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n])
    return net.eval(), proc, (2 if a.stage2_epochs > 0 else 1)


def save_ckpt(path, a, params, opt, step, log):
    """Atomic checkpoint directory (common.checkpoint): trainable tensors (safetensors),
    optimizer, and state.json with args, step and log. Nothing in the loop draws random
    numbers (batches are seeded by step, no dropout), so no RNG state is needed to resume."""
    os.makedirs(os.path.dirname(path.rstrip("/")) or ".", exist_ok=True)
    save_train_state(path, {n: p.detach().cpu() for n, p in params.items()}, opt,
                     {"args": vars(a), "step": step, "log": log})


class Loader:
    """Training records with images held as one uint8 tensor; batches are patchified in
    torch (identical to the PIL image processor for these fixed-size images). The order of
    epoch e is a permutation seeded by (seed, e): any step's batch is reproducible."""

    def __init__(self, records, batch_size, seed, rank=0, world=1):
        self.recs, self.bs, self.seed, self.rank, self.world = records, batch_size, seed, rank, world
        self.images = torch.from_numpy(np.stack([np.asarray(data.load_image(r["image"], r["id"]).convert("RGB"))
                                                 for r in records]))
        self.steps_per_epoch = max(len(records) // batch_size, 1)

    def batch(self, step):
        epoch, i = divmod(step, self.steps_per_epoch)
        perm = torch.randperm(len(self.recs), generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
        idx = perm[i * self.bs:(i + 1) * self.bs][self.rank::self.world].tolist()
        return [self.recs[j] for j in idx], self.images[idx]


def lr_at(step, total, lr, warmup):
    w = max(int(warmup * total), 1)
    if step < w:
        return lr * (step + 1) / w
    return lr * 0.5 * (1 + math.cos(math.pi * (step - w) / max(total - w, 1)))


def train(a):
    """Run the schedule in `a` (an argparse Namespace). Returns (net, proc, log) with log a
    list of per-step dicts {step, stage, loss, ce, balance, z, div, lr, s}."""
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank, world = 0, 1
    device = a.device
    if ddp:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
    net, proc, params = build(a, device)
    recs = data.read_llava_json(os.path.join(a.data, f"{a.split}.json"))
    recs = recs[: a.n_train] if a.n_train else recs
    loader = Loader(recs, a.batch_size, a.seed, rank, world)
    s1 = round(a.stage1_epochs * loader.steps_per_epoch)
    total = s1 + round(a.stage2_epochs * loader.steps_per_epoch)
    opt = torch.optim.AdamW(list(params.values()), lr=a.lr, betas=(0.9, 0.98), weight_decay=a.weight_decay)
    step, log = 0, []
    if a.resume:
        tensors, state = load_train_state(a.out, opt)
        if state is not None:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(tensors[n])
            step, log = state["step"], state["log"]
    fwd = torch.compile(net) if a.compile else net  # compile before DDP; save from `net`
    if ddp:
        fwd = torch.nn.parallel.DistributedDataParallel(fwd, find_unused_parameters=True)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()
    end = min(total, a.max_steps) if a.max_steps else total
    bar = None
    if rank == 0 and not a.quiet:
        from tqdm import tqdm
        bar = tqdm(total=end, initial=step, desc=f"train {a.method}", dynamic_ncols=True)
    while step < end:
        t0 = time.time()
        stage = 1 if step < s1 else 2
        chunk, imgs = loader.batch(step)
        pixels = bb.patchify(imgs)
        qs, ts = [r["question"] for r in chunk], [r["target"] for r in chunk]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, a.lr, a.warmup)
        with amp:
            if a.method == "sft":
                batch = {k: v.to(device) for k, v in proc.encode(None, qs, ts, pixels=pixels).items()}
                out = fwd(**batch)
                res = {"loss": out.loss, "ce": out.loss}
            else:
                batch = {k: v.to(device) for k, v in net.encode(None, qs, ts, pixels=pixels).items()}
                res = fwd(batch, stage)
        opt.zero_grad(set_to_none=True)
        res["loss"].backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), a.clip)
        opt.step()
        step += 1
        rec = {"step": step, "stage": stage, "lr": opt.param_groups[0]["lr"], "s": time.time() - t0}
        rec.update({k: float(res[k].detach()) for k in ("loss", "ce", "balance", "z", "div") if k in res})
        log.append(rec)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(stage=stage, loss=f"{rec['loss']:.3f}")
        if rank == 0 and a.save_every and step % a.save_every == 0:
            save_ckpt(a.out, a, params, opt, step, log)
    if bar is not None:
        bar.close()
    if rank == 0:
        save_ckpt(a.out, a, params, opt, step, log)
    if ddp:
        dist.destroy_process_group()
    return net.eval(), proc, log


def main(argv=None):
    a = get_parser().parse_args(argv)
    if not os.path.exists(os.path.join(a.data, f"{a.split}.json")):
        raise SystemExit(f"{a.data}/{a.split}.json not found: generate data with `python -m common.data` first")
    net, proc, log = train(a)
    if log and int(os.environ.get("RANK", "0")) == 0:
        last = log[-1]
        print(f"done: step {last['step']}, stage {last['stage']}, loss {last['loss']:.4f}, "
              f"{sum(r['s'] for r in log):.1f} s train time -> {a.out}")
    return net, proc, log


if __name__ == "__main__":
    main()
