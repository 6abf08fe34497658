"""Command-line and run helpers shared by the training / inference entry points (mod/, mole/).

    p.add_argument("--lr", type=number(float, above=0), ...)   # degenerate values stop at parse time
    return run_cli(train, args)                                # user errors -> `error: ...`, status 2

A run that cannot start or go on raises `RunError` (a ValueError) with a message that says
what to do; `run_cli` prints it without a traceback. SIGTERM or Ctrl-C inside `sigterm_flag()` only
sets a flag: the loop finishes its step, writes a checkpoint and raises `Interrupted`.
"""
import argparse
import hashlib
import json
import math
import os
import signal
import sys
from contextlib import contextmanager


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
        fail(e)


@contextmanager
def sigterm_flag():
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
            print("\nCtrl-C: finishing this step and writing a checkpoint (Ctrl-C again to stop at once)",
                  file=sys.stderr)

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
    """['key: saved X, now Y'] for the keys both define and that differ. Dict values (the
    base identity) are compared on the keys both define too, so a checkpoint written before
    a key was recorded still resumes."""
    def same(a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            return all(a[k] == b[k] for k in a.keys() & b.keys())
        return a == b
    return [f"{k}: saved {saved[k]!r}, now {now[k]!r}" for k in sorted(saved.keys() & now.keys())
            if not same(saved[k], now[k])]


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
    from common.checkpoint import read_state
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


def diverged(step, values, ckpt, saved_at, save_every):
    """The RunError for a non-finite loss or gradient at `step` (values: 'loss X, gradient
    norm Y'), raised before the update: it names the last good checkpoint of the run."""
    kept = (f"kept the last good checkpoint {ckpt} (step {saved_at})" if saved_at is not None else
            f"no checkpoint of this run had been written yet (--save-every {save_every})")
    return RunError(f"non-finite training loss at step {step} ({values}): stopped before the update; {kept}. "
                    f"Lower --lr or check the data; --resume continues from the checkpoint")
