"""Checkpoint I/O shared by every training script: atomic, resumable, no pickles of code.

A training checkpoint is a directory
    model.safetensors   trainable (or all) weights
    optim.pt            optimizer state (tensors + plain containers, loaded with weights_only=True)
    state.json          step, log and anything JSON the script wants back on resume
written to `{dir}.tmp` and renamed into place, so a run killed mid-write leaves the previous
complete checkpoint (a leftover `.tmp` is never read).

Reading is the other half of the contract: weights come from safetensors only (a pickle can
run code), `check_safetensors` turns a truncated or corrupt file into a `CheckpointError`
naming it, and optim.pt goes through `torch.load(weights_only=True)`, which refuses pickled
code (the error says so instead of a raw `UnpicklingError`).
"""
import errno
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from common.files import atomic_target, follow_umask, name_path

MAX_HEADER = 100 << 20   # safetensors' own cap on the JSON header (100 MB)


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or unsafe; the message names the file."""


def check_safetensors(path):
    """Validate a .safetensors file from its header alone (no tensor data is read).

    Returns (entries {name: {dtype, shape, data_offsets}}, data_start, metadata). Raises
    CheckpointError naming `path` when the file is missing, shorter than its header says
    (a truncated download or copy, a job killed mid-write) or has an unreadable header."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file not found")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: not a complete safetensors file ({size} bytes, header length "
                                  f"{n}); it is truncated or corrupt: re-download or re-save it")
        try:
            h = json.loads(f.read(n))
            meta = h.pop("__metadata__", None) or {}
            end = max([e["data_offsets"][1] for e in h.values()], default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e}); re-download or re-save it") from None
    if 8 + n + end != size:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file: {size} bytes on disk, its header "
                              f"describes {8 + n + end}; re-download or re-save it")
    return h, 8 + n, meta


def safetensors_files(path):
    """The weight files of a save_pretrained directory, as transformers picks them: those
    listed in model.safetensors.index.json, else model.safetensors ([] if neither exists).
    Raises CheckpointError when the index is unreadable or lists a file that is not there."""
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(idx):
        try:
            with open(idx) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{idx}: unreadable index ({e.__class__.__name__}: {e}); re-download it") from None
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise CheckpointError(f"{idx} lists {missing} but they are not in {path}: an incomplete download or copy")
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    return [single] if os.path.exists(single) else []


def checked_weights(path):
    """The safetensors weight files of checkpoint directory `path`, every header checked
    (`check_safetensors`; no tensor is read). Raises CheckpointError naming a truncated shard,
    a bad index, or a directory with no safetensors at all (pickled weights are never loaded:
    the message lists them and says how to convert)."""
    shards = safetensors_files(path)
    for f in shards:
        check_safetensors(f)
    if not shards:
        pickles = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
        raise CheckpointError(
            f"{path} has no *.safetensors weights" + (f", only {', '.join(pickles)}" if pickles else "")
            + ". Weights load from safetensors only (a pickled .bin can execute code when loaded). If you "
            "trust the file, convert it once: load the model with transformers and call "
            "model.save_pretrained(new_dir), which writes safetensors")
    return shards


def atomic_save_file(tensors, path, metadata=None):
    """safetensors `save_file` to a temp name + rename: `path` is either the old or the new file.
    The temp file is removed when the write or the rename fails."""
    with atomic_target(path) as tmp:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)


def save_train_state(path, tensors, optimizer, state):
    """Atomic training checkpoint directory (see module docstring).

    tensors: dict name -> tensor; optimizer: torch optimizer or None; state: JSON-able dict.
    A failed write (full disk, read-only folder) removes the temp directory and raises an
    OSError naming `path` (`common.data.name_path`); the previous checkpoint stays."""
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), os.path.join(tmp, "optim.pt"))
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump(state, f)
        follow_umask(tmp)
    except Exception as e:  # a full disk or a read-only folder: no half-written temp stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, RuntimeError) and "inline_container" in str(e):   # torch.save's message for a failed write
            raise OSError(errno.EIO, f"torch.save could not write optim.pt ({e})", path) from None
        err = name_path(e, path)
        if err is e:
            raise
        raise err from None
    old = path.rstrip("/") + ".old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def read_state(path, optim=True):
    """-> (tensors, optimizer state dict or None, state) from a `save_train_state` directory,
    or (None, None, None) if there is none. Falls back to `{path}.old` when a crash hit between
    the two renames. Nothing is applied, so a caller can check `state` before it changes
    anything; optim=False does not read optim.pt at all (inference).
    Raises CheckpointError naming the file for a truncated / corrupt model.safetensors or
    state.json, and for an optim.pt that holds anything but tensors and plain containers
    (`torch.load(weights_only=True)` refuses pickled code)."""
    for p in (path, path.rstrip("/") + ".old"):
        if os.path.exists(os.path.join(p, "state.json")):
            weights, optim_file, st = (os.path.join(p, n) for n in ("model.safetensors", "optim.pt", "state.json"))
            check_safetensors(weights)
            tensors = load_file(weights)
            try:
                with open(st) as f:
                    state = json.load(f)
            except ValueError as e:
                raise CheckpointError(f"{st}: not valid JSON ({e}); the checkpoint is corrupt") from None
            sd = None
            if optim and os.path.exists(optim_file):
                try:
                    sd = torch.load(optim_file, weights_only=True)
                except Exception as e:  # UnpicklingError for code, RuntimeError / EOFError for truncation
                    raise CheckpointError(
                        f"{optim_file}: refused or unreadable ({e.__class__.__name__}); it is loaded with "
                        f"torch.load(weights_only=True), which rejects pickled code and non-tensor objects. "
                        f"If this file is not one this code wrote, delete it (the optimizer then starts fresh; "
                        f"model.safetensors and state.json are kept)") from None
            return tensors, sd, state
    return None, None, None


def load_train_state(path, optimizer=None):
    """-> (tensors, state) from a `save_train_state` directory, or (None, None) if there is none
    (`read_state`); the optimizer (if given) is restored in place from optim.pt. Raises
    CheckpointError as `read_state`."""
    tensors, sd, state = read_state(path, optim=optimizer is not None)
    if optimizer is not None and sd is not None:
        optimizer.load_state_dict(sd)
    return tensors, state
