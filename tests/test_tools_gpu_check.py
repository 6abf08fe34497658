"""eval.tools.gpu_check: skips cleanly without CUDA; --device-map auto without accelerate is
reported naming the package."""
import importlib.util

import pytest
import torch

from eval.tools import gpu_check


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
