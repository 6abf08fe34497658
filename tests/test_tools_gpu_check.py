"""eval.tools.gpu_check: skips cleanly without CUDA; --device-map auto without accelerate is
reported naming the package."""
import importlib.util
import os

import pytest
import torch

from eval.tools import gpu_check
from helpers import tol


def test_skips_cleanly_without_cuda(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "g.json")]) == {"skipped": "no CUDA device"}
    assert "skipped, no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "g.json").exists()
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--checks", "mod_bf16,nope"])
    assert e.value.code == 2


def test_device_map_without_accelerate_names_it(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "accelerate" else real(n, *a))
    with pytest.raises(gpu_check.Skip, match=r"needs the optional package accelerate \(pip install accelerate\)"):
        gpu_check.check_rolemerge_map(torch.device("cpu"), str(tmp_path), 1)


def test_pipelines_run_every_entry_point_with_the_device_flags_on_cpu(tmp_path, monkeypatch):
    """Everything `pipelines` does up to the device: the ten commands of the three methods, each with
    --device (and --dtype where a model is loaded for inference: bfloat16 on CUDA), on random bases of
    hidden 64, through to their outputs."""
    calls = []
    real = gpu_check.run_entry
    monkeypatch.setattr(gpu_check, "run_entry", lambda m, argv: calls.append((m, argv)) or real(m, argv))
    res = gpu_check.check_pipelines(torch.device("cpu"), str(tmp_path), 2, width=64)
    assert [m for m, _ in calls] == ["mod.data", "mod.train", "mod.infer", "mole.train", "mole.infer",
                                     "mole.diagnostics", "rolemerge.calibrate", "rolemerge.merge", "rolemerge.infer",
                                     "eval.evaluate"]
    assert set(res["seconds"]) == {m for m, _ in calls} and res["width"] == 64
    for m, argv in calls:
        if m != "rolemerge.merge":                                   # the streaming merge loads no model
            assert argv[argv.index("--device") + 1] == "cpu", m
        if m.endswith(("infer", "evaluate", "diagnostics", "calibrate", "data")):
            assert argv[argv.index("--dtype") + 1] == "float32", m       # bfloat16 on CUDA
    for f in ("vs.json", "mod/adapter_config.json", "mod_infer.json", "mole_infer.json", "mole_diag.json",
              "stats.safetensors", "merged/config.json", "eval.json"):
        assert (tmp_path / f).exists(), f


def test_run_entry_names_a_failing_command():
    with pytest.raises(AssertionError, match=r"python -m mod.data --num-return-sequences 0: exit status 2"):
        gpu_check.run_entry("mod.data", ["--num-return-sequences", "0"])


def test_mod_decode_speed_times_every_variant_on_cpu(tmp_path, monkeypatch):
    """mod_decode_speed up to the device: bare, our LoRA (peft's where installed), MoD and MoD with
    compiled adapters (compile_adapters stubbed: a cold CPU compile takes minutes; tests/test_compile.py
    covers it), per-token medians and the ratios."""
    compiled = []
    monkeypatch.setattr(gpu_check, "compile_adapters", lambda m, **kw: compiled.append(m))
    res = gpu_check.check_mod_decode_speed(torch.device("cpu"), str(tmp_path), 3, width=64, rounds=1)
    assert len(compiled) == 1
    assert {"bare", "our LoRA", "MoD", "MoD compiled"} <= set(res["ms_per_token"])
    assert all(v > 0 for v in res["ms_per_token"].values())
    ref = res["ms_per_token"][res["reference"]]
    # ms_per_token is written rounded to 4 decimals, mod_over_ref from the unrounded times
    rel = 0.5e-4 / res["ms_per_token"]["MoD"] + 0.5e-4 / ref + tol(torch.float64, 2)
    assert res["mod_over_ref"] == pytest.approx(res["ms_per_token"]["MoD"] / ref, rel=rel, abs=0)


def test_results_are_named_by_the_device():
    assert gpu_check.default_out(torch.device("cpu")).endswith(os.path.join("eval", "tools", "..", "results",
                                                                            "gpu_check", "cpu.json"))
