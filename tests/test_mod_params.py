"""MoD vs MoE-LoRA trainable parameters at the real bases' shapes, from their configs alone.

Mixture of Debaters (arXiv 2606.29425) compares MoD and MoE-LoRA "at the same learnable parameter
scale"; `mod.train --method moelora` must be parameter-matched to `mod.train`'s MoD (within 2 %)
at Qwen2.5-VL-3B's and the tiny chat base's shapes; at LLaVA-1.6-13B (multi-head attention) no
uniform (E, k) gets within 3.1 %, and the recipe's `--experts-pattern k_proj=10` (one projection
kind with one expert less, `mod.params.matched_moelora`) gets within 0.8 %. Also L_reg's
reduction (eq. 8)."""
import argparse
import math
import types

import pytest
import torch
from torch import nn

from mod.model import AdapterConfig, attach, num_trainable
from mod.params import MOELORA_MATCHED, adapter_params, attention_shapes, best_moelora, matched_moelora, pattern_flags


def qwen25_vl_3b():
    from transformers import Qwen2_5_VLConfig
    return Qwen2_5_VLConfig(text_config=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                             num_attention_heads=16, num_key_value_heads=2, vocab_size=151936))


def llava_16_13b():
    from transformers import LlamaConfig, LlavaNextConfig
    return LlavaNextConfig(text_config=LlamaConfig(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                                   num_attention_heads=40, num_key_value_heads=40, vocab_size=32064))


def cli_config(*argv):
    """The AdapterConfig mod.train builds from these flags (its defaults otherwise)."""
    from mod.train import add_adapter_args, adapter_config
    p = argparse.ArgumentParser()
    add_adapter_args(p)
    return adapter_config(p.parse_args(list(argv)))


def test_attention_shapes_from_configs():
    q = attention_shapes(qwen25_vl_3b())
    assert len(q) == 4 * 36 and q[:4] == [("q_proj", 2048, 2048), ("k_proj", 2048, 256), ("v_proj", 2048, 256),
                                          ("o_proj", 2048, 2048)]
    assert set(attention_shapes(llava_16_13b())) == {(m, 5120, 5120) for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    with pytest.raises(ValueError, match="gate_proj"):
        attention_shapes(qwen25_vl_3b(), ["gate_proj"])


def test_counts_hand_computed():
    # MoD E = 8 per projection: E (in + out) + 2 E in; Qwen2.5-VL-3B per layer
    # 8 (3 * 4 * 2048 + 2048 + 256 + 256 + 2048) = 233,472, x 36 layers
    assert adapter_params(cli_config(), attention_shapes(qwen25_vl_3b())) == 233_472 * 36 == 8_404_992
    assert adapter_params(cli_config(), attention_shapes(llava_16_13b())) == 4 * 32 * 5120 * 40 == 26_214_400
    # the earlier MoE-LoRA default (8 rank-1 experts): 8 (in + out) + 8 in
    old = AdapterConfig(method="moelora")
    assert adapter_params(old, attention_shapes(qwen25_vl_3b())) == 6_045_696
    # MoE-LoRA 11 rank-1 experts: 11 (2 * 8192 + 4608) per layer
    assert adapter_params(cli_config("--method", "moelora"), attention_shapes(qwen25_vl_3b())) == 11 * 20992 * 36
    assert adapter_params(AdapterConfig(method="lora", r=17), [("q", 10, 6)]) == 17 * 16


@pytest.mark.parametrize("make", [qwen25_vl_3b, llava_16_13b])
def test_analytic_count_equals_attach_on_the_meta_device(make):
    """No weights: the text model is built on the meta device; attach's count = the formula."""
    from transformers import LlamaModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel
    config = make()
    cls = LlamaModel if config.model_type == "llava_next" else Qwen2_5_VLTextModel
    for cfg in (cli_config(), cli_config("--method", "moelora"),
                cli_config("--method", "moelora", "--experts-pattern", "k_proj=10,o_proj=12")):
        with torch.device("meta"):
            model = cls(config.get_text_config())
        attach(model, cfg)
        assert num_trainable(model) == adapter_params(cfg, attention_shapes(config))


def test_moelora_default_matches_mod_within_2_percent():
    from transformers import AutoConfig
    tiny = AutoConfig.from_pretrained("common/tiny/chat")
    mod, moe = cli_config(), cli_config("--method", "moelora")
    assert (moe.num_experts, moe.expert_rank) == (MOELORA_MATCHED["num_experts"], MOELORA_MATCHED["expert_rank"])
    assert (mod.num_experts, mod.expert_rank) == (8, 1)
    assert cli_config("--method", "moelora", "--num-experts", "4", "--expert-rank", "4").num_experts == 4
    for config, want_mod in ((qwen25_vl_3b(), 8_404_992), (tiny, 61_440)):
        shapes = attention_shapes(config)
        n_mod, n_moe = adapter_params(mod, shapes), adapter_params(moe, shapes)
        assert n_mod == want_mod
        assert abs(n_moe / n_mod - 1) <= 0.02, (config.model_type, n_mod, n_moe)
    # multi-head attention: MoD 32 d per projection, MoE-LoRA E (2k + 1) d; 32 has no odd factor > 1,
    # so the best any (E, k) does is 33 / 32 (+3.125 %): the default is that best
    shapes = attention_shapes(llava_16_13b())
    E, k, n, rel = best_moelora(shapes, adapter_params(mod, shapes))
    assert abs(rel) == pytest.approx(1 / 32) and adapter_params(moe, shapes) / adapter_params(mod, shapes) == 33 / 32


# the MoE-LoRA flags of mod/README.md's "Reproducing the paper's table", per base
RECIPE_FLAGS = {"Qwen2.5-VL-3B": ["--method", "moelora"],
                "LLaVA-1.6-13B": ["--method", "moelora", "--experts-pattern", "k_proj=10"]}


@pytest.mark.parametrize("base,make", [("Qwen2.5-VL-3B", qwen25_vl_3b), ("LLaVA-1.6-13B", llava_16_13b)])
def test_recipe_flags_match_mod_within_2_percent(base, make):
    shapes = attention_shapes(make())
    n_mod, n_moe = adapter_params(cli_config(), shapes), adapter_params(cli_config(*RECIPE_FLAGS[base]), shapes)
    assert abs(n_moe / n_mod - 1) <= 0.02, (base, n_mod, n_moe)
    E, pat, n, _ = matched_moelora(shapes)        # the flags mod.params prints for that base
    assert ["--method", "moelora", *pattern_flags(E, pat).split()] == RECIPE_FLAGS[base] and n == n_moe


def test_matched_moelora_hand_computed():
    # LLaVA-1.6-13B, every projection 5120 -> 5120: rank-1 expert = 2 d + router row d = 3 d;
    # MoD 32 d per projection = 128 d per layer; 11 + 11 + 11 + 10 experts = 129 d (+1/128)
    shapes = attention_shapes(llava_16_13b())
    E, pat, n, rel = matched_moelora(shapes)
    assert (E, pat) == (11, {"k_proj": 10}) and n == 40 * 3 * 5120 * 43 == 26_419_200
    assert rel == pytest.approx(1 / 128)
    # Qwen2.5-VL-3B: uniform 11 is within 2 % (-1.10 %): no override
    assert matched_moelora(attention_shapes(qwen25_vl_3b()))[:2] == (11, {})
    # a tighter tolerance asks for the fewest overrides that reach it: per layer an expert costs
    # 6,144 on q/o_proj and 4,352 on k/v_proj; one override is at best +0.77 %, two (q + 1, k - 1)
    # give 8,312,832 + 36 (6,144 - 4,352) = 8,377,344 (-0.33 %)
    E, pat, n, rel = matched_moelora(attention_shapes(qwen25_vl_3b()), tol=0.005)
    assert (E, pat, n) == (11, {"k_proj": 10, "q_proj": 12}, 8_377_344)
    assert pattern_flags(11, {}) == "" and pattern_flags(12, {"o_proj": 10}) == "--num-experts 12 --experts-pattern o_proj=10"


def test_experts_pattern_attach_save_load_and_bad_input(tmp_path):
    from common.backbone import load_backbone
    from mod.model import adapter_layers, load_adapters, save_adapters
    from mod.train import parse_pattern
    model, _ = load_backbone("tiny-chat")
    cfg = cli_config("--method", "moelora", "--experts-pattern", "o_proj=5")
    attach(model, cfg)
    E = {n.rsplit(".", 1)[-1]: m.router.shape[0] for n, m in adapter_layers(model)}
    assert E == {"q_proj": 11, "k_proj": 11, "v_proj": 11, "o_proj": 5}
    assert num_trainable(model) == adapter_params(cfg, attention_shapes(model.config))
    save_adapters(model, tmp_path / "a")
    fresh, _ = load_backbone("tiny-chat")
    load_adapters(fresh, tmp_path / "a")
    assert {n.rsplit(".", 1)[-1]: m.router.shape[0] for n, m in adapter_layers(fresh)} == E
    assert parse_pattern(" o_proj=10, q_proj=12 ") == {"o_proj": 10, "q_proj": 12}
    for bad in ("o_proj", "o_proj=x", "o_proj=0", "=3"):
        with pytest.raises(ValueError, match="MODULE=E"):
            parse_pattern(bad)
    with pytest.raises(ValueError, match=r"names \['gate_proj'\], which are not target_modules"):
        AdapterConfig(method="moelora", num_experts=11, experts_pattern={"gate_proj": 4})
    with pytest.raises(ValueError, match=r"gives \{'o_proj': 3\}: each count must be an integer >= top-r \(4"):
        AdapterConfig(method="moelora", num_experts=11, experts_pattern={"o_proj": 3})
    with pytest.raises(ValueError, match="names 'o_proj' twice"):
        parse_pattern("o_proj=5,o_proj=6")
    with pytest.raises(ValueError, match="experts_pattern is for"):
        AdapterConfig(method="lora", experts_pattern={"o_proj": 3})


def test_moelora_default_on_the_tiny_chat_model():
    from common.backbone import load_backbone
    model, _ = load_backbone("tiny-chat")
    attach(model, cli_config("--method", "moelora"))
    assert num_trainable(model) == 11 * (2 * 512 + 384) * 4 == 61_952   # MoD: 61,440 (+0.83 %)


def _accumulate(reduction, lengths, V=4):
    """accumulate() on uniform logits over V classes: every label token costs log V."""
    from mod.train import accumulate
    w = nn.Parameter(torch.zeros(()))
    raw = nn.Module()
    raw.w = w
    raw._adapter = {"ctx": types.SimpleNamespace(aux=[])}
    L = max(lengths) + 2
    labels = torch.full((len(lengths), L), -100)
    for i, n in enumerate(lengths):
        labels[i, L - n:] = 1          # the last n positions are the target a'
    run = lambda **kw: types.SimpleNamespace(logits=w + torch.zeros(len(lengths), L, V))
    return accumulate(run, raw, [{"input_ids": labels.clamp(min=0), "labels": labels}], reduction=reduction)[0]


def test_loss_reduction_sum_is_eq8_the_mean_times_target_tokens():
    # one record, |a'| = 3: sum = 3 log 4 = mean * |a'|
    assert _accumulate("mean", [3]) == pytest.approx(math.log(4))
    assert _accumulate("sum", [3]) == pytest.approx(3 * math.log(4))
    # two records of 3 and 1 target tokens: token mean log 4; eq. 8 per record, averaged: (3 + 1) log 4 / 2
    assert _accumulate("mean", [3, 1]) == pytest.approx(math.log(4))
    assert _accumulate("sum", [3, 1]) == pytest.approx(2 * math.log(4))


def test_loss_reduction_flag():
    from mod.train import main
    with pytest.raises(SystemExit) as e:
        main(["--data", "x.json", "--out", "o", "--loss-reduction", "max"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv, want", [([], 1), (["--rounds", "2"], 2), (["--rounds", "1", "--mad-rounds", "3"], 3)])
def test_mad_rounds_flag_reaches_mad(tmp_path, monkeypatch, argv, want):
    """mod.infer --mad-rounds sets MAD's debate rounds apart from MoD-Multi's --rounds (Du-style
    MAD's default: --rounds; Liang's default is tests/test_mad_liang.py's)."""
    import json
    from common import data
    from mod import infer
    seen = []
    monkeypatch.setattr(infer, "load_backbone", lambda *a, **k: (None, None))
    monkeypatch.setattr(infer, "multi_agent_debate", lambda m, p, recs, rounds, **kw: (seen.append(rounds) or [], 0.0))
    path = tmp_path / "q.json"
    data.atomic_write_text(str(path), json.dumps([{"id": "t0", "family": "mmlu", "answer": "B", "image": None,
                                                   "conversations": [{"from": "human", "value": "Second letter? A B C"},
                                                                     {"from": "gpt", "value": "B"}]}]))
    infer.main(["--data", str(path), "--methods", "mad", "--mad", "du", *argv])
    assert seen == [want]


def test_train_config_fields_are_the_flags():
    """mod.train's TrainConfig fields are dest names of its flags; every other flag is a run input or
    an adapter flag (AdapterConfig); train_config fills each field from its flag."""
    import dataclasses
    from mod.train import TrainConfig, get_parser, train_config
    dests = vars(get_parser().parse_args(["--data", "d.json", "--out", "o"]))
    train = [f.name for f in dataclasses.fields(TrainConfig)]
    adapter = vars(_adapter_parser().parse_args([]))
    inputs = {"model", "data", "image_root", "skip_bad", "out", "overwrite", "device", "dtype", "threads"}
    assert set(train) <= set(dests)
    assert set(dests) == set(train) | set(adapter) | inputs
    argv = ["--data", "d.json", "--out", "o", "--steps", "7", "--warmup-steps", "2", "--aux-coef", "0.5",
            "--log-every", "3", "--loss-reduction", "sum", "--resume"]
    cfg = train_config(get_parser().parse_args(argv))
    assert (cfg.steps, cfg.warmup, cfg.aux_coef, cfg.log_every, cfg.loss_reduction, cfg.resume) == (7, 2, 0.5, 3, "sum", True)
    assert train_config(get_parser().parse_args(["--data", "d.json", "--out", "o"])).save_every > 0   # the flag's default


def _adapter_parser():
    from mod.train import add_adapter_args
    p = argparse.ArgumentParser()
    add_adapter_args(p)
    return p
