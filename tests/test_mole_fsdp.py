"""mole.train --fsdp: FSDP2 (fully_shard) in one CPU process (gloo), as torchrun would start it."""
import socket

import pytest
import torch

from common import backbone as bb
from common import data
from common import shapes
from common.checkpoint import load_train_state
from helpers import bf16_cpu_attention
from mole import train as mt


@pytest.fixture
def setup(tmp_path, monkeypatch):
    model, proc = bb.build_tiny("qwen3_vl", layers=2)
    bb.save_backbone(model.to(torch.bfloat16), proc, str(tmp_path / "base"))   # bf16 LM + fp32 MoLE weights
    shapes.generate_split(str(tmp_path / "data"), "train", 16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    args = ["--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "--batch-size", "8", "--train", "full",
            "--stage1-epochs", "1", "--stage2-epochs", "1", "--quiet", "--device", "cpu", "--threads", "1"]
    return args, torchrun, monkeypatch


@pytest.mark.skipif(not bf16_cpu_attention(), reason="the bf16 base needs torch's bf16 CPU attention, which needs "
                                                  "AVX-512 (helpers.bf16_cpu_attention)")
def test_fsdp_full_finetune_matches_unsharded_and_resumes(tmp_path, setup):
    args, torchrun, mp = setup
    _, _, log_a = mt.main(args + ["--out", str(tmp_path / "a")])
    for k, v in torchrun.items():
        mp.setenv(k, v)
    _, _, log_b = mt.main(args + ["--out", str(tmp_path / "b"), "--fsdp"])
    assert [r["stage"] for r in log_b] == [1, 1, 2, 2]
    ta, _ = load_train_state(str(tmp_path / "a"))
    tb, sb = load_train_state(str(tmp_path / "b"))
    assert ta.keys() == tb.keys() and any(n.endswith("layers.0.mlp.up_proj.weight") for n in tb)
    assert tb["latent"].dtype == torch.float32 and tb["model.lm_head.weight"].dtype == torch.bfloat16
    # bf16 weights (eps 2^-8 = 3.9e-3) after Adam steps: Adam gives no a-priori bound from eps, so
    # 1e-2 is an empirical margin of about 2.5 bf16 steps on values of order 1.
    for k in ta:   # one process: the sharded run computes what the unsharded one does
        assert torch.allclose(ta[k].float(), tb[k].float(), atol=1e-2, rtol=1e-2), k
    assert all(abs(x["loss"] - y["loss"]) < 1e-2 for x, y in zip(log_a, log_b))
    # interrupted after step 1 and resumed: the same checkpoint as the uninterrupted sharded run
    mt.main(args + ["--out", str(tmp_path / "c"), "--fsdp", "--max-steps", "1"])
    mt.main(args + ["--out", str(tmp_path / "c"), "--fsdp", "--resume"])
    tc, sc = load_train_state(str(tmp_path / "c"))
    assert sc["step"] == sb["step"] == 4
    for k in tb:
        assert torch.equal(tb[k], tc[k]), k
    # the checkpoint loads without FSDP (inference)
    net, _, stage = mt.load_mole(str(tmp_path / "b"))
    assert stage == 2 and torch.equal(net.latent.detach(), tb["latent"])


def test_fsdp_needs_torchrun(tmp_path, setup, capsys):
    args, _, mp = setup
    mp.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        mt.main(args + ["--out", str(tmp_path / "x"), "--fsdp"])
    assert e.value.code == 2
    assert "--fsdp shards the model over torchrun processes" in capsys.readouterr().err
