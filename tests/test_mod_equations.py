"""MoD: hand-computed pins for what the review's mutations survived (scaling, aux padding mask,
MoD-Multi history), the review's fixes (token-level MoE-LoRA default, fp32 router logits under
autocast), text-only records and the LLaVA-NeXT family through mod.train / mod.infer."""
import json
import math
import os

import pytest
import torch

from common import data
from common import shapes as world
from common.backbone import build_tiny, save_backbone
from helpers import tol
from mod.model import AdapterConfig, MoDLinear, RoutingContext


def _layer(din, dout, **kw):
    base = torch.nn.Linear(din, dout, bias=False)
    with torch.no_grad():
        base.weight.zero_()  # the output is the adapter's term alone
    return MoDLinear(base, AdapterConfig(**kw), RoutingContext())


def test_lora_scaling_is_alpha_over_r():
    """h = (alpha / r) B A x with r = 2, alpha = 8: scale 4, by hand."""
    layer = _layer(2, 2, method="lora", r=2, lora_alpha=8.0)
    with torch.no_grad():
        layer.lora_A.copy_(torch.eye(2)), layer.lora_B.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        out = layer(torch.tensor([[[1.0, 1.0]]]))
    assert out[0, 0].tolist() == [4.0, 8.0]  # alpha alone (8) would give [8, 16]


def test_mod_scaling_is_alpha_over_r_by_hand():
    """MoD with E = r = 2, alpha = 4 (scale 2), A = B = I, both routers [[1, 0], [0, 0]] so the
    logits of x = (2, 4) are (2, 0) for both pools: I_A = I_B = (0, 1), g = softmax(2, 0) = (p, 1-p),
    h = 2 * (p * 2 * e_0 + (1 - p) * 4 * e_1)   (eq. 4-6, token routing)."""
    layer = _layer(2, 2, method="mod", num_experts=2, r=2, lora_alpha=4.0, granularity="token")
    with torch.no_grad():
        layer.A.copy_(torch.eye(2)), layer.B.copy_(torch.eye(2))
        router = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
        layer.router_A.copy_(router), layer.router_B.copy_(router)
        out = layer(torch.tensor([[[2.0, 4.0]]]))
    p = 1 / (1 + math.exp(-2))
    # fp32: a softmax of two logits, the gate, B A x and the scale: 8 rounding steps, relative
    assert out[0, 0].tolist() == pytest.approx([2 * p * 2, 2 * (1 - p) * 4], rel=tol(torch.float32, 8), abs=0)


@pytest.mark.parametrize("method", ["mod", "moelora"])
def test_aux_loss_inside_the_layer_ignores_padding(method):
    """Token routing: a left-padded batch has the aux loss of its real tokens laid out in one
    unpadded row. The pads hold large values that route them all to one expert, so counting
    them would change f and P."""
    torch.manual_seed(0)
    layer = _layer(6, 5, method=method, num_experts=4, r=2, granularity="token", router_init_std=1.0)
    layer.train()
    real0, real1 = torch.randn(6, 6), torch.randn(4, 6)
    pads = torch.full((2, 6), 50.0)
    x = torch.stack([real0, torch.cat([pads, real1])])  # [2, 6, 6], row 1 left-padded by 2
    mask = torch.tensor([[True] * 6, [False] * 2 + [True] * 4])
    layer.ctx.mask, layer.ctx.aux = mask, []
    layer(x)
    padded = layer.ctx.aux[0]
    layer.ctx.mask, layer.ctx.aux = None, []
    layer(torch.cat([real0, real1])[None])  # [1, 10, 6], no padding
    # the same tokens in other batch shapes: the router logits (a length-6 dot, scale sum |x_i w_i|) move
    # the softmax by at most their error; f and P are means over 10 tokens, aux a sum over 4 experts
    real = torch.cat([real0, real1])
    s_route = max((real.abs() @ w.detach().abs().T).max().item()
                  for n, w in layer.named_parameters() if n.startswith("router"))
    rel = 2 * tol(torch.float32, 6, s_route) + tol(torch.float32, 10 + 4 + 4)  # |d log p / d logit| <= 2
    assert padded.item() == pytest.approx(layer.ctx.aux[0].item(), rel=rel, abs=0)


def test_mod_multi_round_k_sees_the_whole_history(monkeypatch):
    """Alg. 2: round k's prompt lists every earlier response of the record (rounds >= 2)."""
    from mod import data as vs
    from mod import infer
    seen = []

    def fake(model, proc, batcher, recs, questions, max_new_tokens, **kw):
        call = len(seen)
        seen.append(list(questions))
        return [f'{{"Reasoning": "r{call}", "Answer": "{call}"}}' for _ in recs], [3] * len(recs)

    monkeypatch.setattr(infer, "_generate", fake)
    recs = [{"id": "q1", "image": None, "question": "How many?", "answer": "2", "family": "count"}]
    res, _ = infer.mod_debate(None, None, recs, rounds=3)
    answers = [f'{{"Reasoning": "r{c}", "Answer": "{c}"}}' for c in range(4)]
    assert seen[0] == [vs.single_prompt("How many?")]
    for k in (1, 2, 3):
        assert seen[k] == [vs.debate_prompt("How many?", answers[:k])]  # all k earlier responses
    assert res[0]["pred"] == answers[3] and res[0]["n_tokens"] == 12


def test_moelora_routes_per_token_by_default_and_window_is_explicit():
    assert AdapterConfig(method="moelora").granularity == "token" and AdapterConfig(method="moelora").route_window == 1
    assert AdapterConfig(method="mod").granularity == "window" and AdapterConfig(method="mod").route_window == 16
    assert AdapterConfig(method="moelora", granularity="window").route_window == 16
    import argparse
    from mod.train import add_adapter_args, adapter_config
    p = argparse.ArgumentParser()
    add_adapter_args(p)
    assert adapter_config(p.parse_args(["--method", "moelora"])).granularity == "token"
    assert adapter_config(p.parse_args([])).granularity == "window"


@pytest.mark.parametrize("method", ["mod", "moelora"])
def test_router_logits_are_fp32_under_autocast(method):
    """bf16 autocast must not reach the router: its logits equal the fp32 product exactly."""
    torch.manual_seed(0)
    layer = _layer(64, 8, method=method, num_experts=8, r=2, granularity="token", router_init_std=1.0)
    x = torch.randn(2, 5, 64)
    w = layer.router if method == "moelora" else torch.cat([layer.router_A, layer.router_B])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer.router_logits(x)
        layer(x)  # the whole adapter still runs under autocast
    assert got.dtype == torch.float32
    assert torch.equal(got, (x @ w.T).float())


# ----------------------------------------------------------------------------- end to end

def _text_only_and_image_records(d):
    """LLaVA JSON with image records and text-only ones (no "image" key / "image": null)."""
    recs = world.generate_split(d, "train", 4)
    text = [{"id": f"t{i}", "family": "mmlu", "answer": "B", "image": None,
             "conversations": [{"from": "human", "value": f"Which letter is second? A B C D ({i})"},
                               {"from": "gpt", "value": '{"Reasoning": "order", "Answer": "B"}'}]} for i in range(3)]
    del text[0]["image"]
    path = os.path.join(d, "mixed.json")
    data.atomic_write_text(path, json.dumps(recs + text))
    return path


@pytest.mark.parametrize("arch", ["qwen3_vl", "llava_next"])
def test_train_and_infer_text_only_and_llava_next(tmp_path, arch):
    """mod.train -> mod.infer through their mains on a saved tiny base (Qwen3-VL, and the paper's
    second family LLaVA-NeXT), on data mixing image records with text-only ones."""
    from mod import infer, train
    base, proc = build_tiny(arch, hidden=64, layers=2)
    save_backbone(base, proc, str(tmp_path / "base"))
    path = _text_only_and_image_records(str(tmp_path / "d"))
    res = train.main(["--model", str(tmp_path / "base"), "--data", path, "--out", str(tmp_path / "run"),
                      "--steps", "3", "--batch-size", "4", "--window", "4"])
    assert all(math.isfinite(r["loss"]) for r in res["log"])
    out = infer.main(["--model", str(tmp_path / "base"), "--adapter", str(tmp_path / "run"), "--data", path,
                      "--methods", "base,single,multi", "--max-new-tokens", "3", "--batch-size", "4"])
    assert [len(v) for v in out["results"].values()] == [7, 7, 7]
    assert {r["id"] for r in out["results"]["multi"]} >= {"t0", "t1", "t2", "train_000000"}


def test_llava_next_image_tokens_match_the_model():
    """The processor's image-token count is what the model's vision features fill (a mismatch
    raises in the forward), for a batch mixing an image row with a text-only row."""
    model, proc = build_tiny("llava_next", hidden=64, layers=2)
    ims = [world.render(world.sample_scene(__import__("random").Random(0))), None]
    batch = proc.encode(ims, ["What colour?", "No image here."], answers=["red", "ok"])
    assert set(batch) == {"input_ids", "attention_mask", "pixel_values", "image_sizes", "labels"}
    assert (batch["input_ids"][1] == proc.image_token_id).sum() == 0
    assert (batch["input_ids"][0] == proc.image_token_id).sum() == 10  # 2x2 base tile + 2x2 tile + 2 newlines
    assert torch.isfinite(model(**batch).loss)


def test_text_only_rows_have_no_vision_markers():
    """A text-only row's prompt is the plain chat turn (no <|vision_start|>, no image tokens),
    also next to an image row in the same batch."""
    _, proc = build_tiny("qwen3_vl", hidden=64, layers=2)
    vs_id = proc.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    img = world.render(world.sample_scene(__import__("random").Random(0)))
    batch = proc.encode([img, None], ["What colour?", "No image here."])
    ids = batch["input_ids"]
    assert (ids[1] == vs_id).sum() == 0 and (ids[1] == proc.image_token_id).sum() == 0
    assert (ids[0] == vs_id).sum() == 1 and batch["image_grid_thw"].shape[0] == 1
    alone = proc.encode([None], ["No image here."])
    assert set(alone) == {"input_ids", "attention_mask", "mm_token_type_ids"}
    assert alone["input_ids"][0].tolist() == proc.prompt_ids("No image here.", 0)


def test_toy_mod_takes_model_and_threads(monkeypatch):
    """eval.toys.mod speaks the entry points' vocabulary: --model and --threads."""
    from eval.toys import mod as toy_mod
    seen, before = [], torch.get_num_threads()
    monkeypatch.setattr(toy_mod, "run", lambda quick, data_dir, out_dir, model: seen.append(model) or [])
    try:
        toy_mod.main(["--quick", "--model", "m1", "--threads", "1"])
    finally:
        torch.set_num_threads(before)
    assert seen == ["m1"]


def test_debate_paired_comparison_over_seeds():
    """eval.toys.mod_debate._paired: the seed-averaged item difference, per-seed differences and
    the all-seeds-agree flag, on a hand case (4 items, 2 seeds)."""
    from eval.toys.mod_debate import _paired
    r = lambda *c: [{"correct": bool(x)} for x in c]
    a = {0: r(1, 1, 0, 1), 1: r(1, 0, 0, 1)}
    b = {0: r(1, 0, 0, 0), 1: r(0, 0, 0, 1)}
    pb = _paired(a, b, [0, 1])
    assert pb["per_seed"] == [0.5, 0.25] and pb["seeds_agree"] and pb["n"] == 4
    assert pb["diff"] == pytest.approx(0.375)   # items: (1-.5) + (.5-0) + 0 + (1-.5) = 1.5, / 4
    b[1] = r(1, 0, 1, 1)                          # seed 1 now goes the other way: -0.25
    pb = _paired(a, b, [0, 1])                    # items: 0 + .5 - .5 + .5 = .5, / 4
    assert pb["per_seed"] == [0.5, -0.25] and not pb["seeds_agree"] and pb["diff"] == pytest.approx(0.125)
    assert _paired(a, b, [0])["seeds_agree"] and _paired(a, b, [0])["seeds"] == [0]


def test_debate_lr_validation_questions_are_disjoint_from_train_and_test(tmp_path, capsys):
    """eval.toys.mod_debate.val_questions: the shapes val split's questions, skipping any that
    shares an id, an image or its question-and-target text with a training / test question;
    too few left is an error."""
    from common.shapes import generate_split
    from eval.toys.mod_debate import _pair_key, val_questions
    train = generate_split(str(tmp_path), "train", 30)
    test = generate_split(str(tmp_path), "test", 30)
    generate_split(str(tmp_path), "val", 12)
    val, dropped = val_questions(str(tmp_path), 10, train, test)
    assert [r["id"] for r in val] == [f"val_{i:06d}" for i in range(10)] and dropped == []
    taken = {_pair_key(r) for r in train + test}
    assert not [r for r in val if _pair_key(r) in taken]
    twin = dict(val[0], id="test_x", image="images/x.png")              # same question and scene text, other file
    val2, dropped = val_questions(str(tmp_path), 10, train, test + val[3:4] + [twin])
    assert dropped == ["val_000000", "val_000003"]
    assert [r["id"] for r in val2] == [f"val_{i:06d}" for i in (1, 2, 4, 5, 6, 7, 8, 9, 10, 11)]
    with pytest.raises(ValueError, match="11 records not in the training / test questions, 12 asked"):
        val_questions(str(tmp_path), 12, [twin])


def test_debate_lr_pick_and_verdict():
    """eval.toys.mod_debate.pick_lr: the highest mean of validation single-round and misled
    accuracy, ties to the smaller lr; verdict: the pre-registered 3-seed criterion."""
    from eval.toys.mod_debate import pick_lr, selection_score, verdict
    grid = {2e-3: {"single": 0.70, "misled_own": 0.30},   # mean 0.50
            5e-3: {"single": 0.66, "misled_own": 0.40},   # mean 0.53: the pick (single alone would pick 2e-3)
            1e-2: {"single": 0.72, "misled_own": 0.20}}   # mean 0.46
    assert selection_score(grid[5e-3]) == pytest.approx(0.53)
    assert pick_lr(grid) == 5e-3
    assert pick_lr(grid, ("single",)) == 1e-2
    grid[1e-2] = {"single": 0.60, "misled_own": 0.46}     # mean 0.53 too: the tie goes to the smaller lr
    assert pick_lr(grid) == 5e-3
    with pytest.raises(ValueError):
        pick_lr({})
    pb = lambda lo, hi, per: {"ci_low": lo, "ci_high": hi, "per_seed": per}   # eval.metrics.verdict's rule
    assert verdict(pb(0.01, 0.05, [0.02, 0.03, 0.04])) == "supported"
    assert verdict(pb(-0.05, -0.01, [-0.02, -0.03, -0.04])) == "contradicted"
    assert verdict(pb(0.01, 0.05, [0.02, 0.03, -0.01])) == "inconclusive"    # the CI alone is not enough
    assert verdict(pb(-0.01, 0.05, [0.02, 0.03, 0.04])) == "inconclusive"
    assert verdict(pb(-0.05, -0.01, [-0.02, -0.03, -0.04]), sign=-1) == "supported"


def test_debate_prep_made_for_fewer_test_questions_is_refused(tmp_path):
    """eval.toys.mod_debate.prepare: a prep.json whose own wrong answers cover fewer test questions
    than asked raises ValueError naming both sizes and the fix (a prep.json without n_test is the
    300-question one of the earlier runs); one that covers as many or more is used as it is."""
    from eval.toys.mod_debate import prepare, SETTINGS
    prep = {"train_vs": [], "mix": {}, "mix_share": {}, "gold_filled": 0, "json_sample_accuracy": 0.5, "own_wrong": {}}
    (tmp_path / "prep.json").write_text(json.dumps(prep))
    test = [{"id": f"t{i}"} for i in range(600)]
    with pytest.raises(ValueError, match=r"first 300 test questions, 600 asked.*--debate-test 300"):
        prepare(str(tmp_path), None, None, [], test, SETTINGS, log=lambda *a: None)
    assert prepare(str(tmp_path), None, None, [], test[:300], SETTINGS, log=lambda *a: None) == prep
    (tmp_path / "prep.json").write_text(json.dumps(dict(prep, n_test=600)))
    assert prepare(str(tmp_path), None, None, [], test, SETTINGS, log=lambda *a: None)["n_test"] == 600


def test_debate_lr_picks_flag_is_checked(tmp_path, capsys):
    """`--debate-picks` takes ARM=LR with a known arm and a positive lr; anything else: exit 2 naming the form."""
    from eval.toys import mod as toy_mod
    for bad in ("MoD:1e-2", "Nope=1e-2", "MoD=abc", "MoD=-1e-2"):
        with pytest.raises(SystemExit) as e:
            toy_mod.main(["--part", "debate-lr", "--debate-picks", bad, "--out", str(tmp_path)])
        assert e.value.code == 2
        assert "--debate-picks" in capsys.readouterr().err


def test_debate_lr_other_arms_are_compared_with_mod_and_moelora():
    """eval.toys.mod_debate.compare_arms: every further arm as MoD minus arm (3-seed verdict, MoD >
    arm predicted) and arm minus MoE-LoRA token (higher / lower / not resolved), paired over the
    seeds both have; fewer than 3 seeds: partial, no verdict. Hand case: 4 items, 3 seeds."""
    from eval.toys.mod_debate import ARMS, compare_arms
    r = lambda *c: [{"correct": bool(x)} for x in c]
    per = {"MoD": {"single": {s: r(1, 1, 1, 1) for s in (0, 1, 2)}},
           "MoE-LoRA token": {"single": {0: r(0, 0, 0, 1), 1: r(0, 0, 0, 0), 2: r(0, 0, 0, 0)}},
           "X": {"single": {0: r(1, 0, 0, 0), 1: r(0, 1, 0, 0), 2: r(0, 0, 0, 1)}},   # 0.25 each seed
           "Y": {"single": {0: r(1, 1, 0, 0), 5: r(1, 1, 1, 1)}}}                       # seed 5: nobody else has it
    out = compare_arms(per)
    assert set(out) == {"X", "Y"}
    x = out["X"]["single"]
    assert x["vs_MoD"]["diff"] == pytest.approx(0.75) and x["vs_MoD"]["per_seed"] == [0.75] * 3
    assert x["vs_MoD"]["ci_low"] > 0 and x["vs_MoD"]["verdict"] == "supported"
    assert x["vs_MoE-LoRA token"]["diff"] == pytest.approx(1 / 6)      # X minus MoE-LoRA: items 1/3, 1/3, 0, 0
    assert x["vs_MoE-LoRA token"]["per_seed"] == [0.0, 0.25, 0.25]
    assert x["vs_MoE-LoRA token"]["verdict"] == "not resolved"         # seed 0 has no sign
    per["MoE-LoRA token"]["single"] = {s: r(1, 1, 1, 1) for s in (0, 1, 2)}
    assert compare_arms(per)["X"]["single"]["vs_MoE-LoRA token"]["verdict"] == "lower"
    per["MoD"]["single"] = {s: r(0, 0, 0, 0) for s in (0, 1, 2)}
    # MoD minus X: -0.25 each seed, but one item in four: a two-level resample draws none of the three
    # seeds' wrong items with probability (3/4)^12 = 3.2 % > 2.5 %, so the CI reaches 0: inconclusive
    low = compare_arms(per)["X"]["single"]["vs_MoD"]
    assert low["per_seed"] == [-0.25] * 3 and low["ci_high"] == 0.0 and low["verdict"] == "inconclusive"
    per["X"]["single"] = {s: r(1, 1, 0, 0) for s in (0, 1, 2)}       # -0.5 each seed: (1/2)^12 < 2.5 %
    assert compare_arms(per)["X"]["single"]["vs_MoD"]["verdict"] == "contradicted"
    y = out["Y"]["single"]["vs_MoD"]
    assert y["seeds"] == [0] and y["diff"] == pytest.approx(0.5) and y["verdict"] == "partial (1 seed)"
    assert ARMS["LoRA r=4 (rank r)"] == ("LoRA_r4", {"method": "lora", "r": 4, "lora_alpha": 8.0})


def test_debate_paper_table_layout():
    """eval.toys.mod_debate.paper_table: the paper's main-table layout: one row per method (single
    round first, MoD-Multi rows after the arms, misled rows last), one column per family then
    "all", each cell mean ± the half-width of its 95% CI; a family an arm lacks is blank."""
    from eval.toys.mod_debate import paper_table
    cell = lambda a, lo, hi: {"accuracy": a, "ci_low": lo, "ci_high": hi}
    row = lambda a, fams, seeds=(0, 1, 2): dict(cell(a, a - 0.1, a + 0.1), seeds=list(seeds), by_family=fams)
    test = {"MoD": {"single": row(0.7, {"count": cell(0.8, 0.6, 0.9), "colour": cell(0.6, 0.5, 0.7)}),
                    "multi2": row(0.65, {"count": cell(0.7, 0.6, 0.8), "colour": cell(0.6, 0.4, 0.8)}),
                    "misled_own": row(0.5, {"count": cell(0.5, 0.3, 0.7)})},
            "base": {"single": row(0.75, {"count": cell(0.9, 0.8, 1.0), "colour": cell(0.6, 0.5, 0.7)}, seeds=(0,))}}
    lines = paper_table(test).splitlines()
    assert lines[0] == "| method | seeds | colour | count | all |"
    assert lines[2] == "| MoD | 3 | 0.600 ± 0.100 | 0.800 ± 0.150 | 0.700 ± 0.100 |"
    assert lines[3] == "| base | 1 | 0.600 ± 0.100 | 0.900 ± 0.100 | 0.750 ± 0.100 |"
    assert lines[4].startswith("| MoD-Multi, 2 rounds | 3 | 0.600 ± 0.200 | 0.700 ± 0.100 |")
    assert lines[5] == "| MoD, misled, own wrong answer | 3 |  | 0.500 ± 0.200 | 0.500 ± 0.100 |"
    assert len(lines) == 6
