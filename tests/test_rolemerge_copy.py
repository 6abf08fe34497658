"""RoleMerge's merge library is a copy unit: rolemerge/{model, blocks, stats, planning, merging, shards,
baselines, comparators}.py with common/{checkpoint, files}.py, copied alone into another project,
plan and stream a merge whose files equal those of `python -m rolemerge.merge` (no transformers,
no common/data.py or common/answers.py)."""
import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from common.tiny import TINY
from rolemerge import blocks as blk
from rolemerge import merge as mg
from rolemerge import shards as sh
from rolemerge import stats as rstats
from rolemerge.planning import MergeConfig

ROOT = Path(__file__).resolve().parents[1]
UNIT = ["rolemerge/model.py", "rolemerge/blocks.py", "rolemerge/stats.py", "rolemerge/planning.py",
        "rolemerge/merging.py", "rolemerge/shards.py", "rolemerge/baselines.py", "rolemerge/comparators.py",
        "common/checkpoint.py", "common/files.py"]
THIRD_PARTY = {"numpy", "torch", "safetensors", "scipy"}   # scipy: optional (comparators._assign)

CHILD = textwrap.dedent('''
    import sys
    from rolemerge import merging, planning, shards, stats
    from rolemerge.planning import MergeConfig
    src, sp, out = sys.argv[1:4]
    st = stats.load_stats(sp)
    info = shards.streaming_info(src, shards.read_config(src))
    planning.check_stats(st, info)
    plan = planning.make_plan(st, planning.target_k(info["num_experts"], info["top_k"], rho=0.5), MergeConfig())
    merging.merge_streaming(src, out, plan)
    bad = sorted(m for m in sys.modules if m.startswith(("transformers", "common.data", "common.answers",
                                                          "common.backbone", "rolemerge.calibrate", "eval", "mod")))
    assert not bad, bad
''')


def test_the_copy_unit_imports_only_itself_and_torch():
    names = {p[:-3].replace("/", ".") for p in UNIT}
    for p in UNIT:
        for node in ast.walk(ast.parse((ROOT / p).read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):   # `from rolemerge import blocks` names a module of the unit
                mods = [node.module if node.module in names or node.module.split(".")[0] not in ("rolemerge", "common")
                        else f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for m in mods:
                assert m.split(".")[0] in sys.stdlib_module_names | THIRD_PARTY or m in names, (p, m)


def test_copied_library_merges_like_the_command_line(tmp_path):
    src = TINY["tiny-moe"]
    headers, where, layers = sh.scan_checkpoint(src)
    first = min(layers)
    N, L = headers[where[layers[first]["router"][0]]][0][layers[first]["router"][0]]["shape"][0], len(layers)
    g = torch.Generator().manual_seed(0)
    counts = (torch.rand(L, 3, N, generator=g) ** 4 * 1000).long()
    stats = {"model_id": "tiny-moe", "model_type": "qwen3_vl_moe", "layer_names": [f"l{i}" for i in sorted(layers)],
             "layers": sorted(layers), "num_experts": N, "top_k": 2, "buckets": ["image", "question", "answer"],
             "fingerprint": blk.router_fingerprint(sh.router_weights(src)[0]),
             "sources": {"s": {"counts": counts, "tokens": counts.sum(-1)[0] // 2, "examples": 1}}}
    sp = str(tmp_path / "stats.safetensors")
    rstats.save_stats(stats, sp)
    mg.run_merge(MergeConfig(model="tiny-moe", stats=sp, out=str(tmp_path / "cli"), rho=0.5))
    copy = tmp_path / "copy"
    for p in UNIT:
        (copy / p).parent.mkdir(parents=True, exist_ok=True)
        (copy / p).parent.joinpath("__init__.py").touch()
        shutil.copy(ROOT / p, copy / p)
    env = dict(os.environ, PYTHONPATH=str(copy))
    res = subprocess.run([sys.executable, "-c", CHILD, src, sp, str(tmp_path / "lib")], cwd=copy, env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "lib" / f).read_bytes() == (tmp_path / "cli" / f).read_bytes(), f
