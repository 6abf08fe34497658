"""Checkpoint I/O shared by every training script: atomic, resumable, no pickles of code.

A training checkpoint is a directory
    model.safetensors   trainable (or all) weights
    optim.pt            optimizer state (tensors + plain containers, loaded with weights_only=True)
    state.json          step, log and anything JSON the script wants back on resume
written to `{dir}.tmp` and renamed into place, so a run killed mid-write leaves the previous
complete checkpoint (a leftover `.tmp` is never read).
"""
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file


def atomic_save_file(tensors, path, metadata=None):
    """safetensors `save_file` to a temp name + rename: `path` is either the old or the new file."""
    tmp = f"{path}.tmp{os.getpid()}"
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
    os.replace(tmp, path)


def save_train_state(path, tensors, optimizer, state):
    """Atomic training checkpoint directory (see module docstring).

    tensors: dict name -> tensor; optimizer: torch optimizer or None; state: JSON-able dict."""
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optim.pt"))
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump(state, f)
    old = path.rstrip("/") + ".old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def load_train_state(path, optimizer=None):
    """-> (tensors, state) from a `save_train_state` directory, or (None, None) if there is none.
    Falls back to `{path}.old` when a crash hit between the two renames.
    The optimizer (if given) is restored in place; `torch.load(weights_only=True)` refuses pickled code."""
    for p in (path, path.rstrip("/") + ".old"):
        if os.path.exists(os.path.join(p, "state.json")):
            tensors = load_file(os.path.join(p, "model.safetensors"))
            if optimizer is not None and os.path.exists(os.path.join(p, "optim.pt")):
                optimizer.load_state_dict(torch.load(os.path.join(p, "optim.pt"), weights_only=True))
            with open(os.path.join(p, "state.json")) as f:
                return tensors, json.load(f)
    return None, None
