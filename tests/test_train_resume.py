"""Killed training runs resume to exactly the weights of an uninterrupted run; seeded runs repeat.

Each interrupted run is a child process running `mod.train` / `mole.train` as `python -m` does
(runpy, one torch thread) that sends itself SIGTERM or SIGKILL at a chosen point:

  step    inside a training step (after backward, before the optimizer update)
  ckpt    inside a checkpoint write: model.safetensors written to `<ckpt>.tmp`, optim.pt and
          state.json not yet
  rename  between the checkpoint's two renames: the old checkpoint moved to `<ckpt>.old`, the
          complete new one still at `<ckpt>.tmp` (MoD only)

SIGTERM (and Ctrl-C = SIGINT) must finish the step, write a checkpoint and exit with status 143
(130) and a message;
SIGKILL leaves whatever the atomic writes left. Then `--resume` (in-process) must end at the
uninterrupted run's weights (bit for bit), and a leftover `.tmp` is never taken for a checkpoint.
The children are forked from one python process after its imports, all at once (~15 s here).
"""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from common import data
from common import shapes
from common.checkpoint import load_train_state
from mod import train as mtrain
from mole import train as mt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One python process imports torch / transformers / the trainers once, then forks one child per
# case: each child patches its kill point in and runs the trainer exactly as `python -m` does
# (runpy, run_name="__main__"), so the nine runs cost one import instead of nine.
ZYGOTE = r"""
import json, os, runpy, signal, sys, traceback, types
import torch
torch.set_num_threads(1)
import common.checkpoint as ck
import mod.train, mole.train  # noqa: F401  (imported once, before the forks)


def arm(where, sig, n):
    calls = [0]
    def hit():
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), sig)
    if where == "step":  # once per training step, after backward and before the update
        real_clip = torch.nn.utils.clip_grad_norm_
        def clip(*a, **k):
            hit()
            return real_clip(*a, **k)
        torch.nn.utils.clip_grad_norm_ = clip
    elif where == "ckpt":  # save_train_state: right after model.safetensors, before optim.pt / state.json
        real_save = ck.save_file
        def save(*a, **k):
            real_save(*a, **k)
            hit()
        ck.save_file = save
    else:  # "rename": save_train_state moved the old checkpoint to .old, the new one is still .tmp
        proxy = types.ModuleType("os")
        proxy.__dict__.update(os.__dict__)
        def replace(src, dst):
            os.replace(src, dst)
            if str(dst).endswith(".old"):
                hit()
        proxy.replace = replace
        ck.os = proxy


cases, logs, pids = json.loads(sys.argv[1]), sys.argv[2], {}
for name, (module, where, sig, n, argv) in cases.items():
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.path.join(logs, name + ".err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        code = 0
        try:
            arm(where, getattr(signal, sig), n)
            sys.argv = [module] + argv
            runpy.run_module(module, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code)
    pids[pid] = name
codes = {}
while pids:
    pid, status = os.wait()
    codes[pids.pop(pid)] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
print(json.dumps(codes))
"""

CASES = {  # name -> (module, where, signal, n-th hit); every run: 6 steps, checkpoint every 2
    "mod-term-step": ("mod.train", "step", "SIGTERM", 4),
    "mod-kill-step": ("mod.train", "step", "SIGKILL", 4),
    "mod-term-ckpt": ("mod.train", "ckpt", "SIGTERM", 2),
    "mod-kill-ckpt": ("mod.train", "ckpt", "SIGKILL", 2),
    "mod-kill-rename": ("mod.train", "rename", "SIGKILL", 1),
    "mod-ctrlc-step": ("mod.train", "step", "SIGINT", 4),
    "mole-term-step": ("mole.train", "step", "SIGTERM", 4),
    "mole-kill-step": ("mole.train", "step", "SIGKILL", 4),
    "mole-term-ckpt": ("mole.train", "ckpt", "SIGTERM", 2),
    "mole-kill-ckpt": ("mole.train", "ckpt", "SIGKILL", 2),
    "mole-ctrlc-step": ("mole.train", "step", "SIGINT", 4),
}


def mod_args(d, out):
    return ["--data", os.path.join(d, "train.json"), "--out", out, "--steps", "6", "--batch-size", "2",
            "--warmup-steps", "1", "--save-every", "2", "--threads", "1"]


def mole_args(d, out):  # 8 records, batch 2: stage 1 = steps 0-2, stage 2 = steps 3-5
    return ["--data", d, "--out", out, "--batch-size", "2", "--stage1-epochs", "0.75", "--stage2-epochs", "0.75",
            "--save-every", "2", "--quiet", "--device", "cpu"]


def args_of(module, d, out):
    return (mod_args if module == "mod.train" else mole_args)(d, out)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Run every interrupted child (all at once); -> (data dir, tmp root, {case: (returncode, stderr, out)})."""
    root = tmp_path_factory.mktemp("interrupt")
    d = str(root / "data")
    shapes.generate_split(d, "train", 8)
    cases = {name: (module, where, sig, n, args_of(module, d, str(root / name)))
             for name, (module, where, sig, n) in CASES.items()}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", ZYGOTE, json.dumps(cases), str(root)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    codes = json.loads(p.stdout.strip().splitlines()[-1])
    return d, root, {name: (codes[name], (root / f"{name}.err").read_text(), str(root / name)) for name in CASES}


@pytest.fixture(scope="module")
def reference(killed):
    """Uninterrupted runs (in-process), each twice: final weights and per-step logs."""
    d, root, _ = killed
    ref = {}
    for module in ("mod.train", "mole.train"):
        logs = []
        for i in range(2):
            out = str(root / f"ref-{module}-{i}")
            if module == "mod.train":
                logs.append(mtrain.main(mod_args(d, out))["log"])
            else:
                logs.append(mt.main(mole_args(d, out))[2])
            if i == 0:
                ref[module] = final_weights(module, out)
        ref[module + " logs"] = logs
    return ref


def final_weights(module, out):
    if module == "mod.train":
        return load_file(os.path.join(out, "adapter_model.safetensors"))
    return load_train_state(out)[0]


def ckpt_dir(module, out):
    return os.path.join(out, "ckpt") if module == "mod.train" else out


@pytest.mark.parametrize("name", list(CASES))
def test_resume_after_interrupt_equals_uninterrupted_run(killed, reference, name):
    d, _, res = killed
    module, where, sig, _ = CASES[name]
    code, err, out = res[name]
    ck = ckpt_dir(module, out)
    if sig in ("SIGTERM", "SIGINT"):  # the step finished, a checkpoint was written, the message says how to go on
        assert code == 128 + getattr(signal, sig), err
        assert f"interrupted at step 4 of 6 ({sig}); checkpoint {ck} written; continue with --resume" in err
        expect_step = 4
    else:
        assert code == -signal.SIGKILL, err
        expect_step = 2  # the checkpoint before the kill
    if where == "ckpt" and sig == "SIGKILL":  # a half-written .tmp is left and must be ignored
        assert os.listdir(ck + ".tmp") == ["model.safetensors"]
    if where == "rename":  # the complete new checkpoint never made it from .tmp: the .old one counts
        assert not os.path.exists(ck) and load_train_state(ck + ".tmp")[1]["step"] == 4
    tensors, state = load_train_state(ck)
    assert state["step"] == expect_step
    if module == "mod.train":
        mtrain.main(mod_args(d, out) + ["--resume"])
    else:
        mt.main(mole_args(d, out) + ["--resume"])
    want, got = reference[module], final_weights(module, out)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k          # the same steps on the same state: bit for bit
    assert not os.path.exists(ck + ".tmp") and not os.path.exists(ck + ".old")
    assert load_train_state(ck)[1]["step"] == 6


@pytest.mark.parametrize("module", ["mod.train", "mole.train"])
def test_seeded_runs_repeat_exactly(reference, module):
    a, b = reference[module + " logs"]
    strip = lambda log: [{k: v for k, v in r.items() if k != "s"} for r in log]  # "s": wall time
    assert len(a) == 6 and strip(a) == strip(b)
