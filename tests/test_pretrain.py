import sys

import pytest
from safetensors.torch import load_file

from common import pretrain

TINY = ["--arch", "qwen3_vl", "--hidden", "32", "--layers", "1", "--batch-size", "4", "--steps", "4",
        "--eval-every", "100", "--ckpt-every", "1"]


def _run(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["pretrain", *TINY, *args])
    pretrain.main()


def test_interrupted_pretraining_resumes_exactly(tmp_path, monkeypatch):
    _run(monkeypatch, "--out", str(tmp_path / "a"))
    _run(monkeypatch, "--out", str(tmp_path / "b"), "--stop-at", "2")  # "killed" after step 2
    _run(monkeypatch, "--out", str(tmp_path / "b"))  # resumes from b.ckpt at step 2
    wa = load_file(str(tmp_path / "a" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all((wa[k] == wb[k]).all() for k in wa)


def test_resume_with_other_settings_is_refused(tmp_path, monkeypatch):
    _run(monkeypatch, "--out", str(tmp_path / "a"), "--stop-at", "1")
    with pytest.raises(SystemExit, match="other settings.*--fresh"):
        _run(monkeypatch, "--out", str(tmp_path / "a"), "--lr", "1e-3")
