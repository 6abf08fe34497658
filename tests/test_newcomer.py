"""What a newcomer meets first: file modes of written weights, the README's plain-transformers
snippet for a merged checkpoint, the quickstart's interrupt / resume and its report."""
import os
import re
import stat
import subprocess
import sys

import pytest
import torch

from common import backbone as bb
from common import checkpoint as ck
from common import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """A tiny-moe merged in memory to rho = .75 (stats from 4 validation examples) and its data."""
    from rolemerge import calibrate, merge
    d = tmp_path_factory.mktemp("merged")
    old = os.umask(0o022)
    try:
        data.generate_split(str(d / "data"), "val", 4)
        calibrate.main(["--model", "tiny-moe", "--data", str(d / "data" / "val.json"), "--out",
                        str(d / "st.safetensors"), "--n", "4"])
        merge.main(["--model", "tiny-moe", "--stats", str(d / "st.safetensors"), "--rho", "0.75",
                    "--out", str(d / "m")])
    finally:
        os.umask(old)
    return d


def _modes(root):
    return {os.path.relpath(os.path.join(r, f), root): stat.S_IMODE(os.stat(os.path.join(r, f)).st_mode)
            for r, _, fs in os.walk(root) for f in fs}


def test_written_weights_follow_the_umask(merged, tmp_path):
    # safetensors (and so save_pretrained) creates its files 0600: collaborators could not read them
    assert set(_modes(merged / "m").values()) == {0o644}, _modes(merged / "m")     # in-memory merge
    assert stat.S_IMODE(os.stat(merged / "st.safetensors").st_mode) == 0o644         # calibration stats
    old = os.umask(0o027)
    try:
        ck.atomic_save_file({"a": torch.zeros(2)}, str(tmp_path / "w.safetensors"))          # MoD adapters
        ck.save_train_state(str(tmp_path / "ckpt"), {"a": torch.zeros(2)}, None, {"step": 1})  # MoLE / trainers
        model, proc = bb.build_tiny("qwen3_vl", hidden=32, layers=1)
        bb.save_backbone(model, proc, str(tmp_path / "base"))                                 # pretrain
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "w.safetensors").st_mode) == 0o640
    assert set(_modes(tmp_path / "ckpt").values()) == {0o640}
    assert set(_modes(tmp_path / "base").values()) == {0o640}


def test_readme_plain_transformers_snippet(merged, tmp_path):
    """The rolemerge README's snippet, run verbatim, answers as this repo's own inference does."""
    from rolemerge import infer
    text = open(os.path.join(ROOT, "rolemerge", "README.md")).read()
    sec = text[text.index("## Running a merged checkpoint with plain transformers"):]
    code = re.search(r"```python\n(.*?)```", sec, re.S).group(1)
    (tmp_path / "run_merged.py").write_text(code)
    rec = data.read_llava_json(str(merged / "data" / "val.json"))[0]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="")
    out = subprocess.run([sys.executable, str(tmp_path / "run_merged.py"), str(merged / "m"), rec["image"]],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    model, proc, _ = infer.load_timed(str(merged / "m"))
    ours = infer.predict(model, proc, [dict(rec, question="Is there a red circle?")], max_new_tokens=64,
                         progress=False)[0]["pred"]
    assert out.stdout.strip() == ours.strip()
