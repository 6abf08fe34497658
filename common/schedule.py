"""The learning-rate schedule of every trainer: linear warmup, then cosine decay to a floor.

Standard library only, so a copied trainer takes it along without torch.
"""
import math


def lr_at(step, total, lr, warmup_steps, min_ratio=0.0):
    """Learning rate of optimizer step `step` (0-based) of a `total`-step run with peak `lr`.

        step < w:  lr * (step + 1) / w                                      linear warmup, w = warmup_steps
        else:      lr * (m + (1 - m) * (1 + cos(pi * (step - w) / D)) / 2)   cosine from lr down to m * lr

    with D = max(1, total - w) and m = min_ratio. The first step already trains (lr / w, not 0);
    the last step (total - 1) stays just above m * lr. warmup_steps 0: no warmup. Callers choose
    their own w and m (mod.train: w steps, m = 0.1; mole.train: w = a fraction of the run, m = 0;
    eval.tools.pretrain: w steps, m = 0)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(1, total - warmup_steps)))
    return lr * (min_ratio + (1 - min_ratio) * cosine)
