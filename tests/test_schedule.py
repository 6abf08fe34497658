"""common/schedule.py's lr_at against hand-computed values, and each trainer's use of it."""
import math

import pytest

from common.schedule import lr_at


@pytest.mark.parametrize("step,m,want", [
    (0, 0.1, 0.5), (1, 0.1, 1.0),                     # warmup over w = 2 steps: lr (step + 1) / w
    (2, 0.1, 1.0),                                    # cosine starts at the peak
    (4, 0.0, 0.5 * (1 + math.sqrt(0.5))),             # (4 - 2) / 8 of the way: (1 + cos(pi / 4)) / 2 = 0.8536
    (4, 0.1, 0.1 + 0.9 * 0.5 * (1 + math.sqrt(0.5))),  # the same, floored at 10 %: 0.8682
    (6, 0.0, 0.5), (6, 0.1, 0.55),                    # half way: cos(pi / 2) = 0
    (9, 0.0, 0.5 * (1 + math.cos(math.pi * 7 / 8))),  # last step: 0.0381, just above the floor
    (10, 0.1, 0.1), (10, 0.0, 0.0),                   # D steps after warmup: the floor m * lr
])
def test_lr_at_hand_values(step, m, want):
    assert lr_at(step, 10, 1.0, 2, min_ratio=m) == pytest.approx(want, abs=1e-12)


def test_lr_at_scales_with_lr_and_without_warmup_starts_at_peak():
    assert lr_at(0, 10, 3e-3, 0) == 3e-3
    assert lr_at(5, 10, 3e-3, 0) == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi / 2)), abs=1e-15)
    assert lr_at(0, 1, 2e-3, 0, min_ratio=0.1) == 2e-3   # a one-step run: D = max(1, 1 - 0)


def test_trainers_use_their_schedules():
    """mod.train: warmup in steps, floor 10 %; mole.train: warmup as a fraction (at least one step), floor 0."""
    from mod import train as mod_train
    from mole import train as mole_train
    assert mod_train.lr_at is lr_at and mole_train.lr_at is lr_at
    assert mod_train.MIN_LR_RATIO == 0.1
    assert mole_train.warmup_steps(0.05, 100) == 5 and mole_train.warmup_steps(0.0, 100) == 1
    assert mole_train.warmup_steps(0.05, 10) == 1
