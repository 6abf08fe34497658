"""Train MoLE (or the baselines it is compared with) on LLaVA-format data, two stages.

    python -m mole.train --data out/data --out out/mole/mole                # MoLE, tiny dense base
    python -m mole.train --data out/data --out out/mole/sft --method sft   # SFT control
    python -m mole.train ... --n-vis 8 --n-sum 0 --no-router --no-esva --latent-mixing causal   # LIVR-like
    torchrun --nproc_per_node 8 -m mole.train --model /ckpt/Qwen2.5-VL-7B-Instruct --data ... --lr 2e-4 --compile
    torchrun --nproc_per_node 8 -m mole.train --model /ckpt/Qwen2.5-VL-7B-Instruct --data ... --lr LR --train full --fsdp

Schedule (paper, "Training stages"): `--stage1-epochs` epochs with the visual attention
bottleneck (only Z_vis read the image), then `--stage2-epochs` with direct visual access
restored; the same joint loss CE + lambda_b L_balance + lambda_z L_z + lambda_div L_div in
both. The stage of a step is a function of the global step, so a resumed run crosses the
stage boundary exactly where an uninterrupted one would.

Trainable set: LoRA on the language model (`--train lora`, default) or the whole language
model (`--train full`), plus MoLE's latent embeddings, routers and ESVAs. The vision tower
and projector stay frozen. LoRA, latent, router and ESVA weights are fp32 whatever the base dtype
(peft's convention) and are saved in fp32; `--train full` trains and saves the language model in
its own dtype. Checkpoints hold only what was trained (+ optimizer, step, args, log)
and are written atomically (temp file, then rename), so a killed run leaves the previous
complete checkpoint. An existing checkpoint in --out needs --resume (continue; every setting
that defines the run must match, differences are listed) or --overwrite (start over).
SIGTERM or Ctrl-C finishes the current step, writes a checkpoint and exits (status 143 / 130); a non-finite
loss stops the run before the update and keeps the last checkpoint. User errors print
`error: ...` and exit with status 2.
"""
import argparse
import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from tqdm import tqdm

from common import backbone as bb
from common import data
from common.checkpoint import save_train_state
from common.data import IMAGE_ROOT_HELP, record_images
from common.cli import add_device_args, entry_parser, load_kwargs
from common.cli import (Interrupted, RunError, check_labels, check_settings, data_fingerprint, diverged, end_distributed,
                        number, read_checkpoint, restore_optimizer, run_cli, set_threads, sigterm_flag, step_means,
                        step_tokens, token_ce, add_threads, SAVE_EVERY)
from common.routing import rank_mean
from common.schedule import lr_at
from mole.checkpoint import (PlaceholderProcessor, build, copy_tensors, load_mole, mole_config,  # noqa: F401
                             recorded_base, recorded_method, unfinished_stage2)
from mole.model import MoLE, MoLEConfig
# deferred: torch.distributed.fsdp, torch.distributed.checkpoint.state_dict (measured 2.4-2.7 s and 0.7 s to import;
# the --fsdp paths alone use them: shard, load_full, save_ckpt, train)

# flags that do not change what a run computes: everything else must match on --resume
# (--grad-accum is a setting: the aux losses are per-micro-batch means, so it changes the objective)
NOT_SETTINGS = ("model", "base", "data", "image_root", "skip_bad", "out", "resume", "overwrite", "device", "compile",
                "quiet", "save_every", "max_steps", "threads")


# ----------------------------------------------------------------------------- flags

@dataclass
class TrainConfig:
    """The settings of one mole.train run, passed whole to `train`. Field names are the dest
    names of mole.train's flags and the defaults are theirs (`get_parser` reads them from here;
    tests/test_mole_train.py checks both), so `TrainConfig(**vars(get_parser().parse_args(argv)))`
    is the run of `python -m mole.train ARGV`. A checkpoint's state.json keeps them as "args".
    Each field's meaning is its flag's help (`python -m mole.train --help`)."""
    # data and output
    model: str = "tiny-dense"
    data: str = "out/data"
    image_root: str | None = None
    skip_bad: bool = False
    split: str = "train"
    n_train: int = 0
    out: str = "out/mole/mole"
    method: str = "mole"
    placeholders: int = 0
    # MoLE architecture: MoLEConfig's defaults (`mole_config` builds one from these fields)
    n_vis: int = MoLEConfig.n_vis
    n_sum: int = MoLEConfig.n_sum
    top_k: int = MoLEConfig.top_k
    alpha: float = MoLEConfig.alpha
    no_router: bool = not MoLEConfig.router
    no_esva: bool = not MoLEConfig.esva
    esva_hidden: int = MoLEConfig.esva_hidden
    latent_mixing: str = MoLEConfig.latent_mixing
    lambda_balance: float = MoLEConfig.lambda_balance
    lambda_z: float = MoLEConfig.lambda_z
    lambda_div: float = MoLEConfig.lambda_div
    # schedule
    stage1_epochs: float = 2
    stage2_epochs: float = 1
    batch_size: int = 32
    grad_accum: int = 1
    lr: float | None = None
    warmup: float = 0.05          # --warmup-ratio
    weight_decay: float = 0.0
    clip: float = 1.0
    # trainable set
    train: str = "lora"
    lora_r: int = 8               # --r
    lora_alpha: float = 16
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"
    # system
    device: str = "cpu"
    dtype: str = "auto"
    fsdp: bool = False
    compile: bool = False
    seed: int = 0
    resume: bool = False
    overwrite: bool = False
    save_every: int = SAVE_EVERY
    max_steps: int = 0
    threads: int | None = None
    quiet: bool = False


def get_parser():
    """The argparse parser of mole.train (every flag with its help; defaults from TrainConfig)."""
    d = TrainConfig()
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--model", default=d.model, help="base VLM: checkpoint directory or tiny-dense")
    p.add_argument("--data", default=d.data,
                   help="directory with <split>.json / <split>.jsonl (LLaVA format) + images, or one such file "
                        "(canonical JSONL too)")
    p.add_argument("--image-root", default=d.image_root, help=IMAGE_ROOT_HELP)
    p.add_argument("--skip-bad", action="store_true", help=data.SKIP_BAD_HELP)
    p.add_argument("--split", default=d.split, help="which <split>.json(l) of a --data directory to train on")
    p.add_argument("--n-train", type=number(min=0), default=d.n_train, help="use only the first n training records (0 = all)")
    p.add_argument("--out", default=d.out, help="checkpoint directory (written atomically)")
    p.add_argument("--method", default=d.method, choices=("mole", "sft"),
                   help="mole: latent experts; sft: the same trainer on the plain VLM (data-matched control)")
    p.add_argument("--placeholders", type=number(min=0), default=d.placeholders,
                   help="--method sft only: insert this many inert placeholder tokens (the pad token, frozen "
                        "embedding) where MoLE's latents sit, before the assistant header, in training and "
                        "inference: the SFT control with the latents' position shift (8 = E + S)")
    # MoLE architecture
    p.add_argument("--n-vis", type=number(min=1), default=d.n_vis, help="E, latent visual experts")
    p.add_argument("--n-sum", type=number(min=0), default=d.n_sum, help="S, latent summary experts")
    p.add_argument("--top-k", type=number(min=1), default=d.top_k, help="K, visual experts per visual token (<= E)")
    p.add_argument("--alpha", type=number(float, min=0), default=d.alpha, help="router prior scale alpha")
    p.add_argument("--no-router", action="store_true",
                   help="ablation: all visual tokens visible to all experts (no top-K, so no diversity loss)")
    p.add_argument("--no-esva", action="store_true", help="ablation: shared value projection only")
    p.add_argument("--esva-hidden", type=number(min=0), default=d.esva_hidden, help="ESVA MLP width (0 = value width)")
    p.add_argument("--latent-mixing", default=d.latent_mixing, choices=("topological", "causal"),
                   help="causal = ablation: visual experts attend to earlier visual experts")
    p.add_argument("--lambda-balance", type=number(float, min=0), default=d.lambda_balance, help="load-balance loss weight")
    p.add_argument("--lambda-z", type=number(float, min=0), default=d.lambda_z, help="router z-loss weight")
    p.add_argument("--lambda-div", type=number(float, min=0), default=d.lambda_div, help="ESVA diversity loss weight")
    # schedule
    p.add_argument("--stage1-epochs", type=number(float, min=0), default=d.stage1_epochs,
                   help="epochs with the visual bottleneck (stage 1)")
    p.add_argument("--stage2-epochs", type=number(float, min=0), default=d.stage2_epochs,
                   help="epochs with direct visual access (stage 2)")
    p.add_argument("--batch-size", type=number(min=1), default=d.batch_size,
                   help="records per optimizer step, all processes and --grad-accum micro-batches together (a "
                        "multiple of the processes)")
    p.add_argument("--grad-accum", type=number(min=1), default=d.grad_accum,
                   help="split each process's share of the step into this many micro-batches (memory); the loss is "
                        "normalised by the label tokens of the whole step, so the gradient is the same")
    p.add_argument("--lr", type=number(float, above=0), default=d.lr,
                   help="peak learning rate (AdamW, warmup + cosine); default 2e-3 for the tiny bases only "
                        "(a toy value), required for any other --model")
    p.add_argument("--warmup-ratio", dest="warmup", type=number(float, min=0), default=d.warmup,
                   help="linear warmup as a fraction of all optimizer steps (0-1)")
    p.add_argument("--weight-decay", type=number(float, min=0), default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--clip", type=number(float, min=0), default=d.clip, help="gradient norm clip (0 = off)")
    # trainable set
    p.add_argument("--train", default=d.train, choices=("lora", "full"), help="LoRA on the LLM, or the full LLM")
    p.add_argument("--r", dest="lora_r", type=number(min=1), default=d.lora_r, help="LoRA rank r (peft's r)")
    p.add_argument("--lora-alpha", type=number(float, above=0), default=d.lora_alpha,
                   help="LoRA output scale alpha (peft's lora_alpha; scaling = lora_alpha / r: 2 by default)")
    p.add_argument("--lora-targets", default=d.lora_targets, help="LoRA target module name suffixes")
    # system
    add_device_args(p)
    p.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and AdamW state over the torchrun processes with PyTorch FSDP2 "
                        "(fully_shard: one unit per decoder layer) instead of replicating them with DDP; for "
                        "--train full on a 7B base, which does not fit one 80 GB GPU with DDP (README: memory plan). "
                        "Needs torchrun (one process is fine)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile MoLE's latent attention and ESVA (the base model stays eager; worth it on GPU)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed (init, data order)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the checkpoint in --out (same settings required; none there: start)")
    again.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint in --out, start over")
    p.add_argument("--save-every", type=number(min=0), default=d.save_every,
                   help="also checkpoint every N optimizer steps (0 = only at the end)")
    p.add_argument("--max-steps", type=number(min=0), default=d.max_steps,
                   help="stop after this global step (0 = full schedule); the schedule itself is unchanged")
    add_threads(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar and no start-up notes")
    return p


def parse_config(argv=None):
    """The TrainConfig of mole.train's command line `argv` (None: sys.argv): the one place flags
    become settings. Exits with `error: ...` (status 2) for a bad flag."""
    p = get_parser()
    a = p.parse_args(argv)
    if a.warmup > 1:
        p.error(f"--warmup-ratio is a fraction of all steps (0-1), got {a.warmup}")
    return TrainConfig(**vars(a))


# ----------------------------------------------------------------------------- data

def data_file(a):
    """--data as a .json / .jsonl file, or a directory holding <split>.json or <split>.jsonl."""
    if os.path.isfile(a.data):
        return a.data
    for ext in (".json", ".jsonl"):
        f = os.path.join(a.data, a.split + ext)
        if os.path.exists(f):
            return f
    raise data.DataError(f"{a.data}: no {a.split}.json or {a.split}.jsonl there; generate data with "
                         f"`python -m common.shapes --out {a.data}`, or pass a .json / .jsonl file")


class Loader:
    """Training records with their images decoded once; a batch's pixels come from
    `VLProcessor.images`, the one image path of every entry point (the processor's resize
    rules, mixed sizes allowed). The order of epoch e is a permutation seeded by (seed, e):
    any step's batch is reproducible. Raises DataError for unreadable images. A record may
    hold several images (its "images" list): batch() returns one list of PIL images per record."""

    def __init__(self, records, batch_size, seed, rank=0, world=1):
        self.recs, self.bs, self.seed, self.rank, self.world = records, batch_size, seed, rank, world
        self.images = [[data.load_image(p, r["id"]) for p in record_images(r)] for r in records]
        self.steps_per_epoch = max(len(records) // batch_size, 1)

    def batch(self, step):
        epoch, i = divmod(step, self.steps_per_epoch)
        perm = torch.randperm(len(self.recs), generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
        idx = perm[i * self.bs:(i + 1) * self.bs][self.rank::self.world].tolist()
        return [self.recs[j] for j in idx], [self.images[j] for j in idx]


TOY_LR, TOY_WIDTH = 2e-3, 512


def toy_lr(base):
    """The default --lr: 2e-3 (a toy value) for a tiny base (tiny-dense etc., or a checkpoint whose
    text hidden size is <= 512); RunError for a bigger base, which must pass --lr. A base without a
    readable config.json is left to the loader's own error (returns 2e-3, never used)."""
    if base in bb.TINY:
        return TOY_LR
    try:
        with open(os.path.join(base, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return TOY_LR
    width = (cfg.get("text_config") or {}).get("hidden_size") or cfg.get("hidden_size") or 0
    if width > TOY_WIDTH:
        raise RunError(f"--lr is required with --model {base} (hidden size {width}): the default 2e-3 is a toy "
                       f"value for the tiny bases; e.g. --lr 2e-4 for LoRA, 1e-5 for --train full on a 7B model")
    return TOY_LR


def warmup_steps(ratio, total):
    """--warmup-ratio as optimizer steps of a `total`-step run: int(ratio * total), at least 1. The
    schedule is `common.schedule.lr_at` with this warmup and no floor (cosine decay to 0)."""
    return max(int(ratio * total), 1)


# ----------------------------------------------------------------------------- checkpoints

def run_settings(cfg, model, recs, world):
    """Everything that defines a run (all flags but NOT_SETTINGS, world size, base identity,
    data fingerprint), as state.json gives it back: resume requires equality."""
    base = bb.base_identity(model)
    base.pop("name_or_path")  # a moved base checkpoint is the same base
    s = {k: v for k, v in asdict(cfg).items() if k not in NOT_SETTINGS}
    return json.loads(json.dumps({**s, "world_size": world, "base_model": base, "data": data_fingerprint(recs)}))


def save_ckpt(path, cfg, params, opt, step, log, settings, base, net=None, rank=0):
    """Atomic checkpoint directory (common.checkpoint): trainable tensors (safetensors),
    optimizer, and state.json with args, settings, base identity, step and log. Nothing in
    the loop draws random numbers (batches are seeded by step, no dropout), so no RNG state
    is needed to resume. Call it on every rank: only rank 0 writes; under --fsdp (`net` given)
    every rank first takes part in gathering the full tensors and optimizer state (FQN-keyed,
    `torch.distributed.checkpoint.state_dict`), so the files are those of an unsharded run's
    layout and load anywhere (mole.infer needs no FSDP)."""
    if net is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        tensors = {n: p.detach().full_tensor().cpu() for n, p in params.items()}
        full = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        opt = argparse.Namespace(state_dict=lambda: full)
    elif rank == 0:
        tensors = {n: p.detach().cpu() for n, p in params.items()}
    if rank != 0:
        return
    os.makedirs(os.path.dirname(path.rstrip("/")) or ".", exist_ok=True)
    save_train_state(path, tensors, opt,
                     {"args": asdict(cfg), "settings": settings, "base_model": base, "step": step, "log": log})


def shard(net, vlm):
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) units: each decoder layer, the embedding
    table with the LM head, then the rest of the VLM (final norm, vision tower), then `net` (MoLE's latents, routers, ESVAs;
    for --method sft net is the VLM). FSDP2 wants one dtype among a unit's trainable parameters:
    --train full trains the bf16 language model while MoLE's own weights are fp32, so they get
    separate units. In place; returns the trainable parameters by name (now DTensors)."""
    from torch.distributed.fsdp import fully_shard
    for layer in bb.text_model(vlm).layers:
        fully_shard(layer)
    # MoLE looks its tokens up in the embedding table outside the VLM's forward: the table (with the LM
    # head, which may be tied to it) is a unit of its own, gathered whenever either module runs
    fully_shard([vlm.get_input_embeddings(), vlm.lm_head])
    if net is not vlm:
        fully_shard(vlm)
    fully_shard(net)
    return {n: p for n, p in net.named_parameters() if p.requires_grad}


def load_full(net, params, tensors, path, fsdp):
    """Copy checkpoint tensors into the trainable params (`copy_tensors`); under --fsdp each
    rank keeps its shard of the full tensors (`set_model_state_dict`)."""
    if not fsdp:
        return copy_tensors(params, tensors, path)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    copy_tensors({n: torch.empty(p.shape) for n, p in params.items()}, tensors, path)   # names and shapes
    set_model_state_dict(net, {n: tensors[n] for n in params}, options=StateDictOptions(full_state_dict=True,
                                                                                        strict=False))


def is_mole_ckpt(path):
    """True if `path` holds a state.json written by this script (it alone records "args"; a
    mod.train or eval.tools.pretrain checkpoint also has a state.json, without "args")."""
    try:
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and "args" in state


def prepare_out(out, resume, overwrite):
    """Protect what is at --out. A checkpoint of this script (state.json with "args", or its
    `.old` twin) needs --resume (continue) or --overwrite (start over). Anything else that is
    not an empty directory is refused outright: saving replaces the directory wholesale.
    Deletes nothing: returns the paths --overwrite will delete (`clear_out`), which the
    trainer does only once data and base have loaded, so a typo does not cost the old run."""
    out = out.rstrip("/")
    found = [p for p in (out, out + ".old") if os.path.exists(os.path.join(p, "state.json"))]
    for p in found:
        if not is_mole_ckpt(p):
            raise RunError(f"--out {out}: {p} is not a mole.train checkpoint (its state.json is unreadable or has "
                           f"no 'args'); a checkpoint there would replace it, so nothing was written: choose a "
                           f"new --out")
    if not found:
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise RunError(f"--out {out} exists and is not a mole.train checkpoint (no state.json); a checkpoint "
                           f"there would replace it, so nothing was written: choose a new --out")
        return []
    if overwrite:
        return [out, out + ".old", out + ".tmp"]
    if not resume:
        raise RunError(f"--out {out} already holds a checkpoint; pass --resume to continue it or --overwrite to "
                       f"start over (deletes it)")
    return []


def clear_out(paths):
    """Delete what `prepare_out` returned (--overwrite), right before training starts."""
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- loop

def accumulate(fwd, batches, stage=None, amp=None, world=1):
    """Forward + backward of one optimizer step over its micro-batches (gradients add up).
    CE is summed over label tokens and divided by the label tokens of the whole step
    (`common.cli.token_ce`), so 1 x 4 records, 2 x 2 and 4 x 1 give the same gradient; the aux
    terms (lambda_b L_balance + lambda_z L_z + lambda_div L_div, each a per-micro-batch mean)
    weigh 1 / len(batches) per micro-batch. stage None: `fwd` is the plain VLM (--method sft).
    Returns floats {loss, ce[, balance, z, div]} for the step."""
    n = step_tokens([b["labels"] for b in batches], world)
    tot = {}
    for batch in batches:
        with amp or nullcontext():
            if stage is None:
                out = fwd(**{k: v for k, v in batch.items() if k != "labels"})
                res = {"logits": out.logits}
            else:
                res = fwd(batch, stage)
        ce = token_ce(res["logits"], batch["labels"], n)
        aux = (res["loss"] - res["ce"]) / len(batches) if "ce" in res else ce.new_zeros(())
        (ce + aux).backward()
        step = {"loss": ce.item() + aux.item(), "ce": ce.item()}
        step.update({k: res[k].item() / len(batches) for k in ("balance", "z", "div") if k in res})
        for k, v in step.items():
            tot[k] = tot.get(k, 0.0) + v
    return tot


def train(cfg):
    """Run the schedule of `cfg` (a TrainConfig). Returns (net, proc, log) with log a
    list of per-step dicts {step, stage, loss, ce, balance, z, div, lr, s}.
    Raises RunError (a ValueError) for an existing --out without --resume / --overwrite, a
    resume with other settings (each key saved vs now), a batch without labels and a
    non-finite loss or gradient (the update is skipped, the last checkpoint kept);
    Interrupted after SIGTERM (step finished, checkpoint written); DataError / BackboneError."""
    if cfg.method == "mole":
        mole_config(cfg)  # ValueError for e.g. --top-k > --n-vis, before anything loads
    if cfg.stage1_epochs + cfg.stage2_epochs == 0:
        raise RunError("--stage1-epochs and --stage2-epochs are both 0: nothing to train")
    if cfg.placeholders and cfg.method != "sft":
        raise RunError("--placeholders is for --method sft (the SFT control with MoLE's position shift); "
                       "MoLE's own latents are set by --n-vis / --n-sum")
    if cfg.lr is None:
        cfg = replace(cfg, lr=toy_lr(cfg.model))
    set_threads(cfg.threads, cfg.model)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    ddp = world > 1
    if cfg.fsdp and "RANK" not in os.environ:
        raise RunError("--fsdp shards the model over torchrun processes: run it as `torchrun --nproc_per_node N -m "
                       "mole.train ... --fsdp` (N = 1 works too)")
    doomed = prepare_out(cfg.out, cfg.resume, cfg.overwrite) if rank == 0 else []
    path = data_file(cfg)
    recs = data.read_records(path, cfg.image_root, cfg.skip_bad)
    recs = recs[: cfg.n_train] if cfg.n_train else recs
    if cfg.method == "sft" and any(len(record_images(r)) > 1 for r in recs):
        raise RunError(f"{path}: --method sft takes one image per record; records with several images "
                       f"('images' list) train with --method mole")
    data.check_support(recs, "mole.train", multi_image=True)  # MoLE routes Z_vis over every image of a record
    data.check_training_records(recs, path)
    loader = Loader(recs, cfg.batch_size, cfg.seed, rank, world)  # images checked before the model loads
    per_step = min(cfg.batch_size, len(recs))
    if world > 1 and per_step % world:  # uneven shares: ranks would run different numbers of micro-batches
        raise RunError(f"--batch-size {cfg.batch_size} ({per_step} records per step) does not split evenly over "
                       f"{world} processes; pass a multiple of {world}")
    device = cfg.device
    if ddp or cfg.fsdp:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
    net, proc, params = build(cfg, device, load_kwargs(cfg)["dtype"])
    vlm = net.model if isinstance(net, MoLE) else net
    settings, base = run_settings(cfg, vlm, recs, world), bb.base_identity(vlm)
    if cfg.fsdp:               # after the base identity: it reads the (then sharded) embedding
        params = shard(net, vlm)
    sharded = net if cfg.fsdp else None
    s1 = round(cfg.stage1_epochs * loader.steps_per_epoch)
    total = s1 + round(cfg.stage2_epochs * loader.steps_per_epoch)
    opt = torch.optim.AdamW(list(params.values()), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    clear_out(doomed)  # --overwrite: only now that data and base have loaded
    step, log = 0, []
    if cfg.resume:
        tensors, optim, state = read_checkpoint(cfg.out)
        if state is not None:
            saved = state.get("settings", {})
            check_settings(cfg.out, saved, settings)
            load_full(net, params, tensors, cfg.out, cfg.fsdp)
            if cfg.fsdp and optim is not None:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
                set_optimizer_state_dict(net, opt, optim, options=StateDictOptions(full_state_dict=True))
            else:
                restore_optimizer(opt, optim, cfg.out)
            step, log = state["step"], state["log"]
        elif rank == 0 and not cfg.quiet:  # the toys pass --resume on every run: no news there
            print(f"--resume: no checkpoint in {cfg.out}; starting at step 0", file=sys.stderr)
    saved_at = step or None  # step of the last checkpoint of this run on disk
    if cfg.compile and isinstance(net, MoLE):   # MoLE's hot functions (latent attention, ESVA MLPs) in place; the base model stays eager
        net.compile_hot()
    fwd = net
    if ddp and not cfg.fsdp:
        fwd = torch.nn.parallel.DistributedDataParallel(fwd, find_unused_parameters=True)
    if world > 1 and isinstance(net, MoLE):  # aux losses over the global batch, as one process computes them
        net.reduce = rank_mean
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()
    end = min(total, cfg.max_steps) if cfg.max_steps else total
    warmup = warmup_steps(cfg.warmup, total)
    bar = None
    if rank == 0 and not cfg.quiet:
        bar = tqdm(total=end, initial=step, desc=f"train {cfg.method}", dynamic_ncols=True)
    try:
        with sigterm_flag() as flag:
            while step < end:
                t0 = time.time()
                stage = 1 if step < s1 else 2
                chunk, imgs = loader.batch(step)
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, total, cfg.lr, warmup)
                enc = proc.encode if cfg.method == "sft" else net.encode
                batches = []
                for m in range(min(cfg.grad_accum, len(chunk))):  # the step's records in --grad-accum micro-batches
                    recs, ims = chunk[m::cfg.grad_accum], imgs[m::cfg.grad_accum]
                    pixels = proc.vision([im for per_rec in ims for im in per_rec])  # every image of every record, in order
                    kw = {} if cfg.method == "sft" else {"n_images": [len(per_rec) for per_rec in ims]}
                    batch = {k: v.to(device) for k, v in enc(None, [r["question"] for r in recs], [r["target"] for r in recs],
                                                             pixels=pixels, **kw).items()}
                    check_labels(batch["labels"], step, recs)
                    batches.append(batch)
                opt.zero_grad(set_to_none=True)
                res = accumulate(fwd, batches, stage if cfg.method == "mole" else None, amp, world)
                if world > 1:  # the global batch's losses (what one process logs), and one stop decision for all
                    mine = flag["stop"]  # read once: a signal arriving after the all-reduce counts next step
                    res = step_means(dict(res, stop=1.0 if mine else 0.0), world)
                    agreed = (mine or "a signal to another process") if res.pop("stop") else False
                gnorm = torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.clip if cfg.clip > 0 else math.inf)
                gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)   # a DTensor under FSDP
                loss = float(res["loss"])
                if not (math.isfinite(loss) and math.isfinite(gnorm)):
                    raise diverged(step, f"loss {loss}, gradient norm {gnorm}", cfg.out, saved_at, cfg.save_every)
                opt.step()
                step += 1
                rec = {"step": step, "stage": stage, "lr": opt.param_groups[0]["lr"], "s": time.time() - t0}
                rec.update({k: float(res[k]) for k in ("loss", "ce", "balance", "z", "div") if k in res})
                log.append(rec)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(stage=stage, loss=f"{rec['loss']:.3f}")
                if cfg.save_every and step % cfg.save_every == 0 and step < end:
                    save_ckpt(cfg.out, cfg, params, opt, step, log, settings, base, sharded, rank)
                    saved_at = step
                stop = agreed if world > 1 else flag["stop"]
                if stop and step < end:  # SIGTERM / Ctrl-C during this step (or its checkpoint write)
                    if saved_at != step:
                        save_ckpt(cfg.out, cfg, params, opt, step, log, settings, base, sharded, rank)
                    raise Interrupted(f"interrupted at step {step} of {end} ({stop}); checkpoint {cfg.out} written; "
                                      f"continue with --resume", flag["signum"])
    except Interrupted:  # every rank stops after the same step (step_means agrees on it), so all reach this
        fwd = None
        net.reduce = None
        end_distributed()
        raise
    if bar is not None:
        bar.close()
    save_ckpt(cfg.out, cfg, params, opt, step, log, settings, base, sharded, rank)
    fwd = None  # the DDP wrapper goes before the process group does (`end_distributed`): else a rank can hang at exit
    net.reduce = None
    if ddp or cfg.fsdp:
        end_distributed()
    return net.eval(), proc, log


def main(argv=None):
    """Command line entry; returns (net, proc, log). User errors exit with `error: ...`
    (status 2), SIGTERM after a checkpoint with status 143."""
    cfg = parse_config(argv)
    net, proc, log = run_cli(train, cfg)
    if log and int(os.environ.get("RANK", "0")) == 0:
        last = log[-1]
        print(f"done: step {last['step']}, stage {last['stage']}, loss {last['loss']:.4f}, "
              f"{sum(r['s'] for r in log):.1f} s train time -> {cfg.out}")
    return net, proc, log


if __name__ == "__main__":
    main()
