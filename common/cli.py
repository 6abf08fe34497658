"""Command-line and run helpers shared by the training / inference entry points (mod/, mole/).

    p.add_argument("--lr", type=number(float, above=0), ...)   # degenerate values stop at parse time
    return run_cli(train, args)                                # user errors -> `error: ...`, status 2

A run that cannot start or go on raises `RunError` (a ValueError) with a message that says
what to do; `run_cli` prints it without a traceback. SIGTERM or Ctrl-C inside `sigterm_flag()` only
sets a flag: the loop finishes its step, writes a checkpoint and raises `Interrupted`.
"""
import argparse
import errno
import gc
import hashlib
import json
import math
import os
import signal
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.checkpoint import read_state
from common.tiny import TINY, TINY_DIR


def number(kind=int, min=None, above=None):
    """argparse type: a finite int / float that is >= min (or > above). Degenerate values
    (--steps 0, --lr 0, --k -1, nan) stop at parse time with a message naming the bound."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not math.isfinite(v) or (min is not None and v < min) or (above is not None and v <= above):
            raise argparse.ArgumentTypeError(f"must be {'>= %s' % min if min is not None else '> %s' % above}, got {text}")
        return v
    return parse


def fail(msg):
    """Print `error: msg` (no traceback) and exit with status 2, argparse's code for bad input."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


class RunError(ValueError):
    """A run cannot start or go on (existing output, settings mismatch, diverged); the message says what to do."""


class Interrupted(Exception):
    """SIGTERM or Ctrl-C (SIGINT) arrived: the step finished and a checkpoint was written.
    `signum` sets the exit status (128 + signum, as if the signal had killed the process)."""

    def __init__(self, message, signum=signal.SIGTERM):
        super().__init__(message)
        self.signum = int(signum)


def run_cli(fn, *args):
    """fn(*args) for a command line: user errors (ValueError: DataError, BackboneError,
    RunError, config checks; OSError: files) exit via `fail` (status 2); `Interrupted` prints
    its message and exits with 128 + the signal (143 for SIGTERM, 130 for Ctrl-C)."""
    try:
        return fn(*args)
    except Interrupted as e:
        print(e, file=sys.stderr)
        raise SystemExit(128 + e.signum)
    except (ValueError, OSError) as e:
        fail(with_fix(e))


WRITE_FIXES = {errno.ENOSPC: "free space on that disk or write elsewhere",
               errno.EFBIG: "the file is above a size limit (the file system's or `ulimit -f`); write elsewhere",
               errno.EDQUOT: "the disk quota is used up; free space or write elsewhere",
               errno.EROFS: "that file system is read-only; choose another folder",
               errno.EACCES: "no permission; choose a folder you can write to or fix its permissions",
               errno.EPERM: "not permitted; choose a folder you can write to or fix its permissions"}


def with_fix(e):
    """The text `run_cli` prints for an error: an OSError of a full disk, a size limit, a
    read-only folder or a permission gets what to do after it (WRITE_FIXES); the message of
    anything else as it is. An OSError names its file (`common.data.name_path`)."""
    fix = WRITE_FIXES.get(getattr(e, "errno", None)) if isinstance(e, OSError) else None
    return f"{e}; {fix}" if fix else e


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every entry point's `-h`: the description as written (RawDescription) and each option's default
    appended as "(default: X)", except when the default says nothing (None, False, "", SUPPRESS) or the
    help text already names it (contains "default")."""

    def _get_help_string(self, action):
        d, text = action.default, action.help or ""
        if d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, str) and d == "") \
                or "default" in text.lower():
            return action.help
        return super()._get_help_string(action)



def entry_parser(module, description):
    """The argparse parser of an entry point: usage names the command a user types (`python -m
    {module}`), the description is shown as written and each option's default is appended
    (`HelpFormatter`). A flag is taken only as spelled (allow_abbrev=False): `eval.evaluate --n 5` is an
    error, not `--no-loglik` followed by a stray 5. Call as `entry_parser(__spec__.name, __doc__)`."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=description, formatter_class=HelpFormatter,
                                   allow_abbrev=False)


def add_overwrite(p, what="--out"):
    """Add `--overwrite` (replace an existing output; the one name in every entry point) to an
    argparse parser. Check it with `check_overwrite` before anything slow runs."""
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace an existing {what} (without it an existing one is refused, nothing is written)")


def check_overwrite(path, overwrite, resume=None, flag="--out"):
    """RunError when `path` exists and neither `overwrite` nor `resume` is set: no entry point
    replaces an output silently. resume None: the entry point has no --resume (the message
    then names --overwrite only). Call before any model loads."""
    if not path or not os.path.lexists(path) or overwrite or resume:
        return
    more = " (or --resume to continue an interrupted run)" if resume is not None else ""
    raise RunError(f"{flag} {path} already exists; pass --overwrite to replace it{more}, or choose another {flag}")


def refuse_existing(path, overwrite, flag="--out"):
    """`check_overwrite` for a command line without --resume: an existing `path` without
    `overwrite` prints `error: ...` and exits with status 2 (`fail`). Call before anything slow runs."""
    try:
        check_overwrite(path, overwrite, flag=flag)
    except RunError as e:
        fail(e)


SAVE_EVERY = 100   # --save-every of every trainer: a checkpoint every 100 optimizer steps (0 = only at the end)


def add_limit(p, default=0, what="records", dest="limit"):
    """Add `--limit N` (use only the first N records; 0 = all, the one meaning in every script) to an
    argparse parser; a negative N stops at parse time. Apply it as `records[:N or None]`."""
    p.add_argument("--limit", dest=dest, metavar="N", type=number(min=0), default=default,
                   help=f"use only the first N {what} (0 = all; default {default or 'all'})")


def late(deadline):
    """True once time.time() has reached `deadline` (seconds since the epoch, from a run-length
    limit such as the toys' --max-minutes; None: never). A resumable run checks it before it
    starts a training, a scoring or a cell."""
    return deadline is not None and time.time() >= deadline


def add_threads(p):
    """Add `--threads` (torch CPU threads) to an argparse parser; apply it with `set_threads`."""
    p.add_argument("--threads", type=number(min=0), default=None,
                   help="torch CPU threads (default: 1 for the tiny bases, which run about as fast on one thread "
                        "idle and ~10x faster than torch's default on a busy machine; for a real checkpoint every "
                        "core this process may use; 0 = torch's own default)")


DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_device_args(p, device_map=False):
    """Add `--device` and `--dtype` (with device_map=True also `--device-map`) to an argparse parser:
    the same names, choices, defaults and help in every entry point that loads a model. Turn the
    parsed values into the loader's keyword arguments with `load_kwargs`.

    --device: a torch device string (cpu, cuda, cuda:1, ...); default cuda when torch sees a GPU,
    else cpu. --dtype: the weights' dtype, auto = the checkpoint's own. --device-map auto: spread a
    model too large for one device over the visible GPUs (and CPU memory) with accelerate, as
    transformers' `from_pretrained(device_map="auto")` does; --device is then not used."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device the model runs on: cpu, cuda, cuda:1, ... (default: cuda when a GPU is "
                        "available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="dtype of the model weights (default auto: the checkpoint's own)")
    if device_map:
        p.add_argument("--device-map", default=None, choices=["auto"],
                       help="auto: spread a model too large for one device over every visible GPU (and CPU "
                            "memory) with accelerate (pip install accelerate); --device is then not used "
                            "(default: the whole model on --device)")


def load_kwargs(args):
    """The parsed `add_device_args` flags as keyword arguments of the model loaders
    (`common.backbone.load_backbone`, `rolemerge.calibrate.load_model`): {"dtype": a torch dtype,
    or None for auto (the checkpoint's own), "device": str, "device_map": "auto" or None (None
    where the entry point has no --device-map)}."""
    return {"dtype": None if args.dtype == "auto" else getattr(torch, args.dtype), "device": args.device,
            "device_map": getattr(args, "device_map", None)}


def _small_checkpoint(path, max_hidden=512):
    """True if `path` is a local checkpoint whose language model is tiny (hidden size <=
    `max_hidden`, e.g. a RoleMerge merge or a MoLE run of a tiny base): one thread suits it."""
    try:
        with open(os.path.join(str(path), "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    text = cfg.get("text_config") or cfg.get("language_config") or cfg
    hidden = text.get("hidden_size") if isinstance(text, dict) else None
    return isinstance(hidden, int) and hidden <= max_hidden


def set_threads(threads, model=None):
    """Set torch's intra-op threads from a `--threads` value and return the number used.

    threads None = the default: 1 when `model` names a committed tiny base (tiny-dense /
    tiny-moe / tiny-chat, a path under common/tiny, or a local checkpoint with a language-model
    hidden size <= 512, such as a merge of tiny-moe), else every core this process may use
    (`os.sched_getaffinity`, which respects taskset / cgroup CPU sets, unlike os.cpu_count).
    0 leaves torch's own default. Measured in the README (Setup): on a 2-core machine busy
    with other jobs, torch's default threads made a 200-example evaluation ~10x slower."""
    if threads is None:
        tiny = (model is None or model in TINY or os.path.abspath(str(model)).startswith(TINY_DIR)
                or _small_checkpoint(model))
        threads = 1 if tiny else len(os.sched_getaffinity(0))
    if threads > 0:
        torch.set_num_threads(threads)
    return threads or torch.get_num_threads()


@contextmanager
def sigterm_flag(message="finishing this step and writing a checkpoint"):
    """Inside the block SIGTERM and the first Ctrl-C (SIGINT) only set flag["stop"] to the
    signal's name and flag["signum"]: the loop finishes its step, writes a checkpoint and
    stops (a kill in the middle of a write cannot happen this way; SIGKILL is covered by the
    atomic checkpoint). A second Ctrl-C interrupts at once (KeyboardInterrupt; the last
    complete checkpoint stays). Outside the main thread nothing changes. Multi-process (DDP)
    runs need the signal on every rank, as torchrun and SLURM deliver it; the flag is not
    synchronised across ranks."""
    flag = {"stop": False, "signum": signal.SIGTERM}

    def handler(signum, frame):
        if flag["stop"] and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.update(stop=signal.Signals(signum).name, signum=signum)
        if signum == signal.SIGINT:
            print(f"\nCtrl-C: {message} (Ctrl-C again to stop at once)", file=sys.stderr)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # signal handlers can only be set from the main thread
            pass
    try:
        yield flag
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


# ----------------------------------------------------------------------------- resume

def data_fingerprint(records):
    """'N records, sha1 X' over (question, target, image file names; every entry of an
    "images" list when a record has several): a resume on other data is refused, a moved data
    folder is not. One-image records hash as they always did."""
    h = hashlib.sha1()
    for r in records:
        names = [os.path.basename(p or "") for p in (r.get("images") or [r["image"]])]
        h.update(json.dumps([r["question"], r["target"], *names]).encode())
    return f"{len(records)} records, sha1 {h.hexdigest()[:12]}"


def settings_diff(saved, now):
    """['key: saved X, now Y'] for the keys both define and that differ. The base identity
    (`base_model`, a dict) is compared on the keys both define too, so a checkpoint written
    before a key was recorded still resumes; every other value (experts_pattern included) must
    be equal."""
    def same(k, a, b):
        if k == "base_model" and isinstance(a, dict) and isinstance(b, dict):
            return all(a[x] == b[x] for x in a.keys() & b.keys())
        return a == b
    return [f"{k}: saved {saved[k]!r}, now {now[k]!r}" for k in sorted(saved.keys() & now.keys())
            if not same(k, saved[k], now[k])]


def check_settings(path, saved, now):
    """Raise RunError listing each setting of the checkpoint at `path` that differs from now."""
    diff = settings_diff(saved, now)
    if diff:
        raise RunError(f"--resume: {path} was written with other settings ({'; '.join(diff)}); rerun with "
                       f"the saved values to continue that run, or pass --overwrite to start over")


RESUME_HINT = "restore it, or start over with --overwrite"
LOAD_HINT = "restore it, or retrain it (its training run cannot be resumed either)"


def read_checkpoint(path, optim=True, hint=None):
    """`common.checkpoint.read_state` with an unreadable (truncated, corrupt) checkpoint as a
    RunError that says what to do. Returns (tensors, optimizer state or None, state).

    hint: the "what to do" part of the message. Default: a trainer resuming (optim=True)
    gets RESUME_HINT (its --overwrite starts over); a load for inference (optim=False, e.g.
    `mole.train.load_mole` from mole.infer / mole.diagnostics, which have no --overwrite)
    gets LOAD_HINT."""
    if hint is None:
        hint = RESUME_HINT if optim else LOAD_HINT
    try:
        return read_state(path, optim)
    except Exception as e:  # CheckpointError, or safetensors' own error for corrupt tensor data
        raise RunError(f"checkpoint {path} is unreadable ({e.__class__.__name__}: {e}); {hint}") from None


def check_out_file(path, flag="--out"):
    """RunError unless `path` can be written as a file later (checked before a long run, not
    after it): it is not a directory, and its folder exists or can be created (the nearest
    existing ancestor is a writable directory). Creates nothing."""
    if os.path.isdir(path):
        raise RunError(f"{flag} {path} is a directory; give a file path, e.g. {os.path.join(path, 'results.json')}")
    parent = os.path.dirname(os.path.abspath(path))
    anc = parent
    while not os.path.exists(anc) and os.path.dirname(anc) != anc:
        anc = os.path.dirname(anc)
    if not os.path.isdir(anc):
        raise RunError(f"{flag} {path}: cannot create its folder {parent}: {anc} is a file, not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise RunError(f"{flag} {path}: cannot write into {anc} (permission denied)")


def restore_optimizer(opt, state, path):
    """opt.load_state_dict(state), or a warning when the checkpoint at `path` had none."""
    if state is not None:
        opt.load_state_dict(state)
    else:
        print(f"warning: {path} has no optimizer state (optim.pt): AdamW restarts from zero moments, so the "
              f"resumed run will differ from an uninterrupted one", file=sys.stderr)


# ----------------------------------------------------------------------------- the training step

def check_labels(labels, step, recs):
    """RunError when every label of a batch is -100 (the loss would be 0/0 = nan)."""
    if not bool((labels != -100).any()):
        raise RunError(f"step {step}: every label of the batch is masked: no answer token to train on "
                       f"(records {[r['id'] for r in recs][:3]}); check their answers")


def label_tokens(labels):
    """Number of label tokens the loss is taken over: positions t >= 1 with labels[:, t] != -100
    (the model predicts token t at t - 1), as an int."""
    return int((labels[:, 1:] != -100).sum())


def step_tokens(micro_labels, world=1):
    """Label tokens of one optimizer step: summed over its micro-batches (`label_tokens`) and, with
    world > 1, over all ranks (all-reduce), divided by world because DDP averages gradients over
    ranks. `token_ce(..., step_tokens(...))` then gives every rank's micro-batches the weight of
    their tokens in the whole step."""
    n = sum(label_tokens(lab) for lab in micro_labels)
    if world > 1:
        t = torch.tensor(float(n), device=micro_labels[0].device)
        dist.all_reduce(t)
        return float(t) / world
    return float(n)


def token_ce(logits, labels, n_tokens):
    """Next-token cross-entropy summed over the label positions of `labels` [B, L] (logits
    [B, L, V], computed in fp32) and divided by `n_tokens`, the label tokens of the whole
    optimizer step (`step_tokens`). Summed over a step's micro-batches this is the token-mean
    CE of the step however it is split, so gradient accumulation (--grad-accum) gives the
    gradient of one big batch: each token weighs the same, not each micro-batch."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum") / n_tokens


def diverged(step, values, ckpt, saved_at, save_every):
    """The RunError for a non-finite loss or gradient at `step` (values: 'loss X, gradient
    norm Y'), raised before the update: it names the last good checkpoint of the run."""
    kept = (f"kept the last good checkpoint {ckpt} (step {saved_at})" if saved_at is not None else
            f"no checkpoint of this run had been written yet (--save-every {save_every})")
    return RunError(f"non-finite training loss at step {step} ({values}): stopped before the update; {kept}. "
                    f"Lower --lr or check the data; --resume continues from the checkpoint")


# ----------------------------------------------------------------------------- data-parallel runs

def step_means(values, world=1):
    """{name: float} of one optimizer step -> the same averaged over the data-parallel ranks
    (one all-reduce). Each rank's CE is its label-token sum over (global tokens / world)
    (`step_tokens`) and its aux terms are scaled the same way (`common.routing.rank_mean`), so
    the rank mean is the value of the global batch: what a single process logs for it. Every
    rank then also sees the same loss, so a non-finite one stops them all (never one alone,
    which would leave the others waiting in a collective)."""
    if world <= 1:
        return values
    keys = sorted(values)
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"  # NCCL: GPU tensors only
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return {k: float(v) / world for k, v in zip(keys, t.tolist())}


def end_distributed():
    """Tear down torch.distributed at the end of a data-parallel run so every process exits.
    The caller first drops its DistributedDataParallel wrapper (`fwd = None`). Then here:
    gc.collect() frees a wrapper held in a reference cycle, so its reducer and its reference
    to the process group go while the group still works; a barrier, so no rank destroys the
    group while another still writes the checkpoint or talks to it; then
    destroy_process_group(). Measured (mole.train, 2 gloo processes): with the group destroyed
    while the wrapper was alive, the process hung in the wrapper's teardown after `train()`
    returned (faulthandler: the last Python frame was the return from `train()`), and torchrun
    waited for it. No-op when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
