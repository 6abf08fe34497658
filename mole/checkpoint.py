"""Build a MoLE model from its flags and load a trained `mole.train` checkpoint.

Shared by training (`mole.train` builds the model it trains) and inference (`mole.infer`,
`mole.diagnostics`, the lmms-eval bridge load what it wrote), so inference never imports the
trainer. A checkpoint directory holds `model.safetensors` (only the trained tensors) and
`state.json` (`args`: the flags, `base_model`: the base's identity, `step`, `log`).

    net, proc, stage = load_mole("out/mole/mole")           # net: MoLE, or the plain VLM (sft)
"""
import argparse
import json
import os
import sys

import torch

from common import backbone as bb
from common.cli import RunError, read_checkpoint
from mole.lora import add_lora
from mole.model import MoLE, MoLEConfig


def mole_config(a):
    """The MoLEConfig of parsed flags (ValueError for inconsistent ones, e.g. --top-k > --n-vis)."""
    return MoLEConfig(n_vis=a.n_vis, n_sum=a.n_sum, top_k=a.top_k, alpha=a.alpha, router=not a.no_router,
                      esva=not a.no_esva, esva_hidden=a.esva_hidden, latent_mixing=a.latent_mixing,
                      lambda_balance=a.lambda_balance, lambda_z=a.lambda_z, lambda_div=a.lambda_div)


def build(a, device, dtype=None):
    """Base VLM (+ LoRA) (+ MoLE) with the trainable set of `a`. Returns (net, proc, params)
    where net is a MoLE or (method sft) the plain VLM. dtype: the base's weights (None: the checkpoint's own)."""
    model, proc = bb.load_backbone(a.model, device=device, dtype=dtype)
    model.requires_grad_(False)
    torch.manual_seed(a.seed)
    lm = bb.text_model(model)
    if a.train == "lora":
        add_lora(lm, tuple(t.strip() for t in a.lora_targets.split(",") if t.strip()), r=a.lora_r,
                 lora_alpha=a.lora_alpha)
        model.to(device)
    else:
        lm.requires_grad_(True)
        model.lm_head.requires_grad_(True)
    for n, prm in lm.named_parameters():
        if "lora_" in n:
            prm.requires_grad_(True)
    if a.placeholders:
        proc = PlaceholderProcessor(proc, a.placeholders)
    net = model if a.method == "sft" else MoLE(model, proc, mole_config(a))
    net.train()
    params = {n: p for n, p in net.named_parameters() if p.requires_grad}
    return net, proc, params


class PlaceholderProcessor(bb.VLProcessor):
    """A `VLProcessor` whose prompts carry n inert placeholder tokens (the pad token, whose
    embedding stays frozen) right before the assistant header, where MoLE puts its E + S
    latents: head | placeholders | tail (`VLProcessor.tail_ids`) | answer. The SFT control
    of `--placeholders n`: the header and answer move to the same later M-RoPE positions as
    with n latents (the position shift measured in mole/README.md), with nothing to learn in
    them. Labels are -100 on the placeholders. Training (`encode`) and generation
    (`common.backbone.generate`) both go through `prompt_and_labels`, so both see them."""

    def __init__(self, proc, n):
        self.__dict__.update(proc.__dict__)
        self.n_placeholders, self.placeholder_id = n, proc.pad_token_id

    def prompt_and_labels(self, question, n_image_tokens, history=()):
        ids, labels = super().prompt_and_labels(question, n_image_tokens, history)
        tail = self.tail_ids()
        T, n = len(tail), self.n_placeholders
        assert ids[-T:] == tail, "prompt does not end with the assistant header"
        return ids[:-T] + [self.placeholder_id] * n + ids[-T:], labels[:-T] + [-100] * n + labels[-T:]


def copy_tensors(params, tensors, path):
    """Load checkpoint tensors into the trainable params; RunError if names or shapes differ."""
    missing = sorted(set(params) - set(tensors))
    extra = sorted(set(tensors) - set(params))
    shapes = [n for n in params if n in tensors and params[n].shape != tensors[n].shape]
    if missing or extra or shapes:
        raise RunError(f"{path} does not fit this model: missing {missing[:3]}, unexpected {extra[:3]}, "
                       f"other shapes {shapes[:3]}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n])


def load_mole(path, device="cpu", base=None, dtype=None):
    """Rebuild a trained model from a checkpoint directory of this script. Returns
    (net, proc, stage): net is a MoLE (or the plain VLM for --method sft); stage is the
    attention stage for inference (2 unless stage 2 never ran).
    base: load this base VLM instead of the one recorded in the checkpoint (moved files);
    it must have the recorded identity (`common.backbone.base_identity`: architecture, width,
    depth, vocabulary, embedding weights).
    Raises FileNotFoundError for a missing checkpoint, ValueError (RunError) for an
    unreadable or incomplete one or a base that does not fit (message names both)."""
    tensors, _, state = read_checkpoint(path, optim=False)
    if state is None:
        raise FileNotFoundError(f"{path}: no checkpoint (expected a directory written by mole.train)")
    if not isinstance(state, dict) or "args" not in state:
        raise RunError(f"{path} is not a mole.train checkpoint (its state.json has no 'args'; mod.train and "
                       f"eval.tools.pretrain write other checkpoints)")
    a = argparse.Namespace(**state["args"])
    a.model = base or a.model
    net, proc, params = build(a, device, dtype)
    saved = state.get("base_model")
    if saved is not None:
        now = bb.base_identity(net.model if isinstance(net, MoLE) else net)
        diff = bb.identity_mismatch(saved, now)
        if diff:
            raise RunError(f"{path} was trained on base {saved['name_or_path'] or '?'} and does not fit base "
                           f"{now['name_or_path'] or a.model} ({'; '.join(diff)})")
    copy_tensors(params, tensors, path)
    warning = unfinished_stage2(state)
    if warning:
        print(f"warning: {path}: {warning}", file=sys.stderr)
    return net.eval(), proc, (2 if a.stage2_epochs > 0 else 1)


def unfinished_stage2(state):
    """A sentence if a MoLE checkpoint's schedule has a stage 2 (--stage2-epochs > 0) that never ran
    (its last logged step is in stage 1, or it has none, e.g. stopped by --max-steps or an interrupt):
    its answers were trained only through the visual bottleneck, yet inference uses stage 2. None
    otherwise (stage 2 reached, no stage 2 planned, or a --method sft checkpoint, which has no stages).
    state: the checkpoint's state.json dict ({"args", "step", "log": [{"stage", ...}, ...]})."""
    a = state.get("args", {})
    if a.get("method", "mole") != "mole" or not a.get("stage2_epochs", 0):
        return None
    log = state.get("log") or []
    if log and log[-1].get("stage") == 2:
        return None
    return (f"training stopped at step {state.get('step', 0)} in stage 1 (visual bottleneck: answers could "
            f"not read the image); the stage 2 of its schedule (--stage2-epochs {a['stage2_epochs']}) never "
            f"ran, so this model is undertrained for stage-2 inference. Finish it with mole.train --resume "
            f"(without --max-steps)")


def recorded_base(path):
    """The base VLM a mole.train checkpoint names (its --model), or None if unreadable."""
    try:
        with open(os.path.join(path, "state.json")) as f:
            args = json.load(f)["args"]
        return args.get("model")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def recorded_method(path):
    """The --method ("mole" / "sft") a mole.train checkpoint was trained with, or None if unreadable."""
    try:
        with open(os.path.join(path, "state.json")) as f:
            return json.load(f)["args"].get("method", "mole")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
