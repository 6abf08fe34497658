"""mole/train.py: two-stage schedule, trainable set, exact resume across the stage boundary."""
import torch

from common import backbone as bb
from common import data
from common import shapes
from common.checkpoint import load_train_state
from mole import train as mt


def _setup(tmp_path):
    model, proc = bb.build_tiny("qwen3_vl", layers=2)
    bb.save_backbone(model, proc, str(tmp_path / "base"))
    shapes.generate_split(str(tmp_path / "data"), "train", 32)
    return ["--model", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "--batch-size", "8",
            "--stage1-epochs", "1", "--stage2-epochs", "1", "--quiet", "--device", "cpu", "--threads", "1"]


def test_two_stage_resume_is_exact_and_trainable_set(tmp_path):
    base = _setup(tmp_path)
    _, _, log = mt.main(base + ["--out", str(tmp_path / "a")])
    assert [r["stage"] for r in log] == [1] * 4 + [2] * 4
    assert all(r["balance"] > 0 and r["div"] >= 0 for r in log)
    # stop inside stage 1 (step 3 of 4), then resume across the boundary into stage 2
    mt.main(base + ["--out", str(tmp_path / "b"), "--max-steps", "3"])
    mt.main(base + ["--out", str(tmp_path / "b"), "--resume"])
    ta, sa = load_train_state(str(tmp_path / "a"))
    tb, sb = load_train_state(str(tmp_path / "b"))
    assert sa["step"] == sb["step"] == 8
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    names = list(ta)
    assert any("lora_A" in n for n in names) and "latent" in names and any(n.startswith("routers") for n in names)
    assert any(n.startswith("esva") for n in names) and not any("visual" in n for n in names)
    # the checkpoint reloads to the same model
    net, _, stage = mt.load_mole(str(tmp_path / "a"))
    assert stage == 2
    for n, p in net.named_parameters():
        if n in ta:
            assert torch.equal(p.detach(), ta[n])


def test_sft_and_full_finetune(tmp_path):
    base = _setup(tmp_path)
    _, _, log = mt.main(base + ["--out", str(tmp_path / "s"), "--method", "sft", "--stage1-epochs", "0"])
    assert len(log) == 4 and log[-1]["ce"] < log[0]["ce"] + 1.0
    ck, _ = load_train_state(str(tmp_path / "s"))
    assert all("lora_" in n for n in ck)
    mt.main(base + ["--out", str(tmp_path / "f"), "--train", "full", "--max-steps", "1"])
    ck, _ = load_train_state(str(tmp_path / "f"))
    assert any(n.endswith("layers.0.mlp.up_proj.weight") for n in ck)
    assert not any("visual" in n for n in ck)


def test_sft_placeholders_sit_where_moles_latents_sit(tmp_path):
    """--method sft --placeholders 8: the SFT control with MoLE's position shift. Same length,
    same answer positions and labels as MoLE's E + S = 8 latents, pad ids where the latents
    are; a checkpoint reloads with the placeholders (generation sees them); refused for MoLE."""
    from mole.model import MoLE, MoLEConfig
    base = _setup(tmp_path)
    model, proc = bb.load_backbone(base[1])
    recs = data.read_records(str(tmp_path / "data" / "train.json"))[:3]
    imgs = [data.load_image(r["image"]) for r in recs]
    qs, ts = [r["question"] for r in recs], [r["target"] for r in recs]
    mole = MoLE(model, proc, MoLEConfig())
    m = mole.encode(imgs, qs, ts)
    ph = mt.PlaceholderProcessor(proc, 8)
    s = ph.encode(imgs, qs, ts)
    assert s["input_ids"].shape == m["input_ids"].shape
    lat = m["input_ids"] >= mole.vocab
    assert lat.sum() == 3 * 8
    assert (s["input_ids"][lat] == proc.pad_token_id).all() and (s["attention_mask"][lat] == 1).all()
    assert torch.equal(s["input_ids"][~lat], m["input_ids"][~lat])
    assert torch.equal(s["labels"], m["labels"])  # answer tokens at the same positions, placeholders -100
    assert proc.encode(imgs, qs, ts)["input_ids"].shape[1] == m["input_ids"].shape[1] - 8
    # trained and reloaded: the checkpoint's processor carries the placeholders
    _, _, log = mt.main(base + ["--out", str(tmp_path / "p"), "--method", "sft", "--placeholders", "8",
                                "--stage1-epochs", "0", "--max-steps", "2"])
    assert len(log) == 2
    net, proc2, _ = mt.load_mole(str(tmp_path / "p"))
    assert isinstance(proc2, mt.PlaceholderProcessor) and proc2.n_placeholders == 8
    texts, _ = bb.generate(net, proc2, imgs[:1], qs[:1], max_new_tokens=2)
    assert len(texts) == 1
    try:
        mt.train(mt.parse_config(base + ["--out", str(tmp_path / "q"), "--placeholders", "8"]))
        raise AssertionError("expected RunError")
    except mt.RunError as e:
        assert "--placeholders is for --method sft" in str(e)


def test_train_config_fields_are_the_flags():
    """TrainConfig's fields are the dest names of mole.train's flags, with the flags' defaults, and
    parse_config fills every field from the command line."""
    import dataclasses
    parsed = vars(mt.get_parser().parse_args([]))
    assert [f.name for f in dataclasses.fields(mt.TrainConfig)] == list(parsed)
    assert dataclasses.asdict(mt.TrainConfig()) == parsed
    cfg = mt.parse_config(["--r", "4", "--warmup-ratio", "0.1", "--n-vis", "6", "--model", "m"])
    assert (cfg.lora_r, cfg.warmup, cfg.n_vis, cfg.model) == (4, 0.1, 6, "m")
