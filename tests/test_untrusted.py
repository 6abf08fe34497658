"""Untrusted files: a checkpoint or training state from elsewhere must never run code here.

Weights load from safetensors only, .pt files through torch.load(weights_only=True),
checkpoint-shipped code only with --trust-remote-code, and no config file is executed. Each
attack below would create a marker file if its code ran; the tests check that it does not."""
import json
import os
import re
import shutil

import pytest
import torch

from common import backbone as bb
from common import checkpoint as ck
from rolemerge import calibrate as cal
from rolemerge import merge as mg
from rolemerge.planning import MergeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVIL_PY = "open({marker!r}, 'w').write('code ran')\n"   # runs at import of the shipped module


class Evil:
    """Unpickling this calls open(marker, 'w'): the file appears iff the pickle is executed."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_code_in_optim_pt_is_refused(tmp_path):
    marker = str(tmp_path / "PWNED")
    path = str(tmp_path / "run")
    lin = torch.nn.Linear(2, 2)
    ck.save_train_state(path, dict(lin.named_parameters()), torch.optim.SGD(lin.parameters(), lr=0.1), {"step": 1})
    torch.save({"state": {0: Evil(marker)}, "param_groups": []}, os.path.join(path, "optim.pt"))
    with pytest.raises(ck.CheckpointError, match=r"optim.pt: refused or unreadable \(UnpicklingError\); it is loaded "
                                                 r"with torch.load\(weights_only=True\), which rejects pickled code"):
        ck.load_train_state(path, torch.optim.SGD(lin.parameters(), lr=0.1))
    assert not os.path.exists(marker)
    assert sorted(os.listdir(path)) == ["model.safetensors", "optim.pt", "state.json"]   # nothing deleted
    tensors, state = ck.load_train_state(path)      # without an optimizer the weights still load
    assert state == {"step": 1} and set(tensors) == {"weight", "bias"}


def test_every_torch_load_in_the_repo_is_weights_only():
    """Static guard for the rule above: any torch.load / pickle.load / exec / yaml.load added
    later in the repo's code must be safe (tests and the venv excluded)."""
    bad = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if not x.startswith(".") and x not in ("tests", "out", "__pycache__")]
        for f in files:
            if not f.endswith(".py"):
                continue
            p = os.path.join(d, f)
            src = open(p, encoding="utf-8").read()
            for m in re.finditer(r"torch\.load\(", src):
                call = src[m.start():src.find(")", m.start()) + 1]
                if "weights_only=True" not in call:
                    bad.append(f"{os.path.relpath(p, ROOT)}: {call}")
            for m in re.finditer(r"(?<![\w.])(pickle\.loads?|exec|yaml\.load)\(|trust_remote_code=True", src):
                bad.append(f"{os.path.relpath(p, ROOT)}: {m.group(0)}")
    assert not bad, bad


def _with_files(tmp_path, name, moe=False, weights=True):
    dst = tmp_path / name
    shutil.copytree(bb.TINY["tiny-moe" if moe else "tiny-dense"], dst,
                    ignore=None if weights else shutil.ignore_patterns("*.safetensors"))
    return dst


def test_pickle_only_checkpoint_is_refused_everywhere(tmp_path):
    """pytorch_model.bin (a pickle, here one carrying code) and no safetensors: every loader
    refuses with the conversion hint and never unpickles it."""
    marker = str(tmp_path / "PWNED")
    for name, moe in (("dense", False), ("moe", True)):
        d = _with_files(tmp_path, name, moe=moe, weights=False)
        torch.save({"w": Evil(marker)}, d / "pytorch_model.bin")
        msg = r"has no \*.safetensors weights.*Weights load from safetensors only \(a pickled .bin can execute code"
        if not moe:
            with pytest.raises(bb.BackboneError, match=rf"{d} has no \*.safetensors weights, only pytorch_model.bin"):
                bb.load_backbone(str(d))
            continue
        with pytest.raises(cal.CalibrationError, match=msg):
            cal.load_model(str(d))
        stats = str(tmp_path / "none.safetensors")
        for streaming in (False, True):
            with pytest.raises(cal.CalibrationError, match=msg):
                mg.run_merge(MergeConfig(model=str(d), stats=stats, out=str(tmp_path / "o"), rho=0.5, in_memory=not streaming))
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "o")


def _auto_map(d, marker, model_type=None):
    """Point every Auto* entry of the checkpoint at evil.py (which creates `marker` on import)."""
    (d / "evil.py").write_text(EVIL_PY.format(marker=marker))
    for f, key in (("config.json", "AutoModelForImageTextToText"), ("tokenizer_config.json", "AutoTokenizer"),
                   ("preprocessor_config.json", "AutoImageProcessor")):
        cfg = json.loads((d / f).read_text())
        cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", key: "evil.Evil"}
        if model_type and f == "config.json":
            cfg["model_type"] = model_type
        (d / f).write_text(json.dumps(cfg))


def test_remote_code_is_not_run_without_the_flag(tmp_path, capsys):
    """(a) a supported architecture with an auto_map: the built-in class loads and evil.py is
    never imported; (b) an unknown architecture that needs its own code: refused, naming
    --trust-remote-code; (c) a config.json that is Python: invalid JSON, never executed."""
    marker = str(tmp_path / "PWNED")
    a = _with_files(tmp_path, "a")
    _auto_map(a, marker)
    model, proc = bb.load_backbone(str(a))
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration" and not os.path.exists(marker)
    b = _with_files(tmp_path, "b", weights=False)
    _auto_map(b, marker, model_type="evil_vlm")
    with pytest.raises(bb.BackboneError, match=r"cannot read its config.json \(The repository .* contains custom code"
                                               r".*need --trust-remote-code \(it runs that code\)"):
        bb.load_backbone(str(b))
    with pytest.raises(cal.CalibrationError, match=r"cannot read its config.json.*need --trust-remote-code"):
        cal.load_model(str(b))
    with pytest.raises(SystemExit) as e:                 # a user error: `error: ...`, exit status 2
        mg.main(["--model", str(b), "--stats", "s.safetensors", "--out", str(tmp_path / "o"), "--rho", ".5",
                 "--in-memory"])
    assert e.value.code == 2 and "need --trust-remote-code" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:                 # streaming (the default) reads config.json as JSON only
        mg.main(["--model", str(b), "--stats", "s.safetensors", "--out", str(tmp_path / "o"), "--rho", ".5"])
    assert e.value.code == 2 and "model_type 'evil_vlm' is not a supported MoE family" in capsys.readouterr().err
    c = _with_files(tmp_path, "c", weights=False)
    (c / "config.json").write_text(EVIL_PY.format(marker=marker))
    with pytest.raises(bb.BackboneError, match=r"cannot read its config.json \(.*not a valid JSON file\)"):
        bb.load_backbone(str(c))
    assert not os.path.exists(marker)
