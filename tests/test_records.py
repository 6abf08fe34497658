"""Records in, the right model inputs and training signals out :
the record contract, text-only / multi-turn / multi-image rules per entry point, --image-root,
special-token strings in questions, EXIF orientation, one image path, fp32 adapters,
token-normalised gradient accumulation, disjoint shapes splits and the layering of common/."""
import ast
import json
import os

import pytest
import torch
from PIL import Image

from common import backbone as bb
from common import data
from common import shapes as world
from helpers import adapter_depth, decoder_depth, error_of, logits_tol, tol

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONV = [{"from": "human", "value": "<image>\nIs there a red circle?"}, {"from": "gpt", "value": "yes"}]
TWO_TURNS = [{"from": "human", "value": "<image>\nIs there a red circle?"}, {"from": "gpt", "value": "yes"},
             {"from": "human", "value": "How many circles are there?"}, {"from": "gpt", "value": "2"}]


@pytest.fixture(scope="module")
def tiny():
    return bb.load_backbone("tiny-dense")


@pytest.fixture(scope="module")
def small():
    """A fresh (random) 1-layer Qwen3-VL + processor; tests deep-copy the model before changing it."""
    return bb.build_tiny("qwen3_vl", hidden=32, layers=1)


def _write(path, records):
    path.write_text(json.dumps(records) if str(path).endswith(".json") else
                    "\n".join(json.dumps(r) for r in records))
    return str(path)


def _img(path, size=(84, 84), colour=(200, 30, 30)):
    Image.new("RGB", size, colour).save(path)
    return str(path)


# ----------------------------------------------------------------------------- record contract

def test_every_reader_gives_images_list_and_first_image(tmp_path):
    _img(tmp_path / "a.png"), _img(tmp_path / "b.png")
    ll = data.read_records(_write(tmp_path / "l.json", [
        {"id": "one", "image": "a.png", "conversations": CONV},
        {"id": "two", "image": ["a.png", "b.png"], "conversations": [
            {"from": "human", "value": "<image>\n<image>\nSame colour?"}, {"from": "gpt", "value": "yes"}]},
        {"id": "txt", "conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]}]))
    a, b = str(tmp_path / "a.png"), str(tmp_path / "b.png")
    assert [(r["images"], r["image"]) for r in ll] == [([a], a), ([a, b], a), ([], None)]
    assert ll[1]["question"] == "<image>\n<image>\nSame colour?"  # placeholders kept: one per image
    assert ll[0]["question"] == "Is there a red circle?" and ll[2]["question"] == "What is 2+2?"
    cj = data.read_records(_write(tmp_path / "c.jsonl", [
        {"id": "m", "image": ["a.png", "b.png"], "question": "Same colour?", "answer": "yes"},
        {"id": "t", "question": "Which is a mammal? A. cat B. fish", "answer": "A"}]))  # ScienceQA-style text-only
    assert [(r["images"], r["image"]) for r in cj] == [([a, b], a), ([], None)]
    assert all(r["history"] == [] for r in ll + cj)


def test_shared_refusals_name_the_kind_and_the_fix(tmp_path):
    recs = [{"id": "t", "images": [], "image": None, "history": []},
            {"id": "m", "images": ["a", "b"], "image": "a", "history": []},
            {"id": "c", "images": ["a"], "image": "a", "history": [["q", "a"]]}]
    with pytest.raises(data.DataError, match=r"^mole.infer: 1 record\(s\) with no image \(a text-only record\), "
                                             r"e.g. \['t'\]: it needs one image per record"):
        data.check_support(recs, "mole.infer")
    with pytest.raises(data.DataError, match=r"^x: 1 record\(s\) with several images, e.g. \['m'\]: it takes one "
                                             r"image per record; split such records"):
        data.check_support(recs, "x", text_only=True)
    with pytest.raises(data.DataError, match=r"^x: 1 record\(s\) with several question/answer turns, e.g. \['c'\]"):
        data.check_support(recs, "x", text_only=True, multi_image=True)
    data.check_support(recs, "x", text_only=True, multi_image=True, multi_turn=True)


def _text_only(tmp_path):
    return _write(tmp_path / "t.json", [{"id": "sq1", "family": "mc", "conversations": [
        {"from": "human", "value": "Which is a mammal? A. cat B. fish C. frog D. crab Answer with the letter."},
        {"from": "gpt", "value": "Answer: A"}]}])


@pytest.mark.parametrize("entry,argv", [
    ("mole.infer", ["--ckpt", "nowhere"]), ("mole.train", ["--model", "nowhere", "--out", "OUT"])])
def test_text_only_records_are_refused_before_the_model_loads(entry, argv, tmp_path, capsys):
    """mole.infer used to crash with a TypeError after loading the model; every entry point that
    needs an image says so first (the model path 'nowhere' is never reached)."""
    import importlib
    main = importlib.import_module(entry).main
    argv = [a.replace("OUT", str(tmp_path / "o")) for a in argv] + ["--data", _text_only(tmp_path)]
    err = error_of(main, argv, capsys)
    assert f"error: {entry}: 1 record(s) with no image (a text-only record), e.g. ['sq1']" in err


@pytest.mark.parametrize("entry,argv", [
    ("mod.infer", ["--model", "nowhere", "--methods", "base"]), ("mod.train", ["--model", "nowhere", "--out", "OUT"]),
    ("mod.data", ["--model", "nowhere", "--out", "OUT/x.json"])])
def test_text_only_records_pass_mods_record_check(entry, argv, tmp_path, capsys):
    """MoD takes text-only records (the paper's MMLU rows): its entry points read them and stop
    at the (missing) model, not at the record check; tests/test_mod_equations.py trains and infers
    on them end to end."""
    import importlib
    main = importlib.import_module(entry).main
    argv = [a.replace("OUT", str(tmp_path / "o")) for a in argv] + ["--data", _text_only(tmp_path)]
    err = error_of(main, argv, capsys)
    assert "text-only" not in err and "nowhere" in err


def test_text_only_records_run_in_eval_and_rolemerge(tmp_path, tiny):
    from eval.evaluate import evaluate, score_options
    from rolemerge import infer as rinfer
    model, proc = tiny
    recs = data.read_records(_text_only(tmp_path))
    res = evaluate(model, proc, recs, max_new_tokens=3)
    assert res[0]["id"] == "sq1" and res[0]["n_tokens"] >= 1
    batch = proc.encode([None], [recs[0]["question"]])
    assert "pixel_values" not in batch and not (batch["input_ids"] == proc.image_token_id).any()
    assert len(score_options(model, proc, recs)[0]["scores"]) == 4
    moe, mproc = bb.load_backbone("tiny-moe")
    out = rinfer.predict(moe, mproc, recs, max_new_tokens=3, progress=False)  # used to raise TypeError
    assert out[0]["id"] == "sq1" and out[0]["n_tokens"] >= 1


def test_calibrate_takes_text_only_records_on_a_vlm(tmp_path):
    from rolemerge import calibrate as cal
    moe, mproc = bb.load_backbone("tiny-moe")
    world.generate_split(str(tmp_path), "val", 2)
    recs = data.read_records(str(tmp_path / "val.json")) + data.read_records(_text_only(tmp_path))
    stats = cal.calibrate(moe, mproc, {"v": recs}, max_new_tokens=3, progress=False)
    assert stats["sources"]["v"]["examples"] == 3 and all(stats["sources"]["v"]["tokens"] > 0)


# ----------------------------------------------------------------------------- multi-turn

def test_multi_turn_record_keeps_every_pair(tmp_path):
    _img(tmp_path / "a.png")
    r, = data.read_records(_write(tmp_path / "m.json", [{"id": "rid", "image": "a.png", "conversations": TWO_TURNS}]))
    assert (r["question"], r["target"], r["history"]) == ("How many circles are there?", "2",
                                                          [["Is there a red circle?", "yes"]])
    items = data.expand_turns([r])
    assert [(i["id"], i["question"], i["answer"], i["history"]) for i in items] == [
        ("rid#1", "Is there a red circle?", "yes", []),
        ("rid#2", "How many circles are there?", "2", [["Is there a red circle?", "yes"]])]
    bad = [{"id": "x", "image": "a.png", "conversations": TWO_TURNS[:3]}]  # ends on a question
    with pytest.raises(data.DataError, match=r"record x: turns go \['human', 'gpt', 'human'\]; a conversation "
                                             r"alternates human, gpt"):
        data.read_records(_write(tmp_path / "bad.json", bad))


def test_multi_turn_training_labels_every_gpt_turn(tiny):
    model, proc = tiny
    im = world.render(world.sample_scene(__import__("random").Random(0)))
    b = proc.encode([im], ["How many circles are there?"], ["2"], history=[[["Is there a red circle?", "yes"]]])
    labelled = b["labels"][0][b["labels"][0] != -100].tolist()
    assert labelled == proc.text_ids("yes") + [proc.eos_token_id] + proc.text_ids("2") + [proc.eos_token_id]
    text = proc.tokenizer.decode(b["input_ids"][0])
    assert text.index("Is there a red circle?") < text.index("yes") < text.index("How many circles")
    assert text.count("<|im_start|>user") == 2 and text.count("<|im_start|>assistant") == 2
    single = proc.encode([im], ["Q?"], ["2"])  # the single-turn prompt is unchanged
    assert single["input_ids"][0].tolist() == proc.prompt_ids("Q?", 9) + proc.text_ids("2") + [proc.eos_token_id]


def test_mod_batcher_trains_on_every_turn(tmp_path, tiny):
    from mod.train import Batcher, load_records
    model, proc = tiny
    _img(tmp_path / "a.png")
    recs = load_records(_write(tmp_path / "m.json", [{"id": "rid", "image": "a.png", "conversations": TWO_TURNS}]))
    b = Batcher(proc, recs).encode(recs, answers=[r["target"] for r in recs])
    assert (b["labels"] != -100).sum() == len(proc.text_ids("yes")) + len(proc.text_ids("2")) + 2


def test_evaluate_scores_each_pair_as_its_own_item(tmp_path):
    from eval import evaluate as ev
    _img(tmp_path / "a.png")
    d = _write(tmp_path / "m.json", [{"id": "rid", "image": "a.png", "conversations": TWO_TURNS}])
    out = tmp_path / "r.json"
    ev.main(["--model", "tiny-dense", "--data", d, "--max-new-tokens", "2", "--no-loglik", "--out", str(out)])
    res = json.loads(out.read_text())["results"]
    assert [(r["id"], r["answer"]) for r in res] == [("rid#1", "yes"), ("rid#2", "2")]


@pytest.mark.parametrize("entry,argv", [("mole.infer", ["--ckpt", "nowhere"]),
                                        ("mod.infer", ["--model", "nowhere", "--methods", "base"]),
                                        ("mole.train", ["--model", "nowhere", "--out", "OUT"]),
                                        ("mod.data", ["--model", "nowhere", "--out", "OUT/x.json"])])
def test_multi_turn_refused_where_not_supported(entry, argv, tmp_path, capsys):
    import importlib
    _img(tmp_path / "a.png")
    d = _write(tmp_path / "m.json", [{"id": "rid", "image": "a.png", "conversations": TWO_TURNS}])
    argv = [a.replace("OUT", str(tmp_path / "o")) for a in argv] + ["--data", d]
    err = error_of(importlib.import_module(entry).main, argv, capsys)
    assert f"error: {entry}: 1 record(s) with several question/answer turns, e.g. ['rid']" in err


# ----------------------------------------------------------------------------- --image-root

@pytest.mark.parametrize("entry,argv,after", [
    ("eval.evaluate", ["--model", "nowhere"], "nowhere"),
    ("mod.infer", ["--model", "nowhere", "--methods", "base"], "nowhere"),
    ("mod.train", ["--model", "nowhere", "--out", "OUT"], "nowhere"),
    ("mod.data", ["--model", "nowhere", "--out", "OUT/x.json"], "nowhere"),
    ("mole.infer", ["--ckpt", "nowhere"], "nowhere"),
    ("mole.train", ["--model", "nowhere", "--out", "OUT"], "nowhere"),
    ("rolemerge.infer", ["--model", "nowhere"], "nowhere"),
    ("rolemerge.calibrate", ["--model", "nowhere", "--out", "OUT/s.safetensors"], "nowhere")])
def test_image_root_on_every_data_reading_entry_point(entry, argv, after, tmp_path, capsys):
    """Relative image paths resolve against --image-root when given, else the data file's folder:
    without the flag the image is not found; with it, reading passes and the run stops at the
    (missing) model instead."""
    import importlib
    main = importlib.import_module(entry).main
    (tmp_path / "pics").mkdir()
    _img(tmp_path / "pics" / "x.png")
    d = _write(tmp_path / "d.json", [{"id": "r1", "image": "x.png", "family": "existence", "conversations": CONV}])
    argv = [a.replace("OUT", str(tmp_path / "o")) for a in argv] + ["--data", d]
    run = (lambda av: main(av)) if entry != "eval.evaluate" else (lambda av: __import__("common.cli").cli.run_cli(main, av))
    err = error_of(run, argv, capsys)
    assert f"image {tmp_path / 'x.png'} not found" in err and "--image-root" in err
    err = error_of(run, argv + ["--image-root", str(tmp_path / "pics")], capsys)
    assert "not found (relative paths" not in err and after in err


# ----------------------------------------------------------------------------- special tokens

def test_special_token_strings_in_questions_are_escaped(tmp_path, tiny):
    from eval.evaluate import evaluate, score_options
    from rolemerge.calibrate import text_inputs
    model, proc = tiny
    q = "What does <|image_pad|> mean? <|im_end|> A. x B. y"
    b = proc.encode([world.render([])], [q], ["<|vision_start|>"])
    assert int((b["input_ids"] == proc.image_token_id).sum()) == 9  # the 84x84 image's tokens only
    assert int((b["labels"] == proc.tokenizer.convert_tokens_to_ids("<|vision_start|>")).sum()) == 0
    _img(tmp_path / "a.png")
    recs = data.read_records(_write(tmp_path / "s.json", [{"id": "s1", "image": "a.png", "family": "mc",
                                                           "conversations": [{"from": "human", "value": q},
                                                                             {"from": "gpt", "value": "A"}]}]))
    assert evaluate(model, proc, recs, max_new_tokens=2)[0]["id"] == "s1"  # was StopIteration in get_rope_index
    assert len(score_options(model, proc, recs)[0]["scores"]) == 2
    ids = text_inputs(proc.tokenizer, [q])["input_ids"][0].tolist()
    assert proc.image_token_id not in ids and ids.count(proc.eos_token_id) == 1  # the template's own <|im_end|>


# ----------------------------------------------------------------------------- images

def _exif_jpeg(path, size=(84, 56), orientation=6):
    im = Image.new("RGB", size, (0, 0, 0))
    im.paste((255, 0, 0), (0, 0, size[0] // 2, size[1]))  # left half red as stored
    exif = Image.Exif()
    exif[0x0112] = orientation
    im.save(path, exif=exif, quality=95)
    return str(path)


def test_exif_orientation_is_applied(tmp_path, tiny):
    _, proc = tiny
    p = _exif_jpeg(tmp_path / "phone.jpg")
    im = data.load_image(p)
    assert im.size == (56, 84)  # Orientation 6: rotate 90 degrees clockwise to display
    assert im.getpixel((28, 5))[0] > 200 and im.getpixel((28, 80))[0] < 50  # stored left half is now on top
    assert proc.images([im])[1].tolist() == [[1, 6, 4]]  # 84 high, 56 wide reaches the model


def _photo(path, size):
    im = Image.new("RGB", size, (20, 40, 60))
    im.paste((240, 200, 10), (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    im.save(path)
    return str(path)


def test_one_image_path_same_visual_tokens_everywhere(tmp_path, tiny):
    """A 2800x2100 photo gives the processor's 12 visual tokens in every entry point, alone, in a
    file of same-size photos (where mod.train used to skip the resize: 7,500 tokens) and next
    to other sizes; 84x84 images take the torch fast path with the processor's exact pixels."""
    from mod.train import Batcher
    from mole.train import Loader
    _, proc = tiny
    big = [_photo(tmp_path / "p.jpg", (2800, 2100))] * 2  # two records, one same-size photo file
    small = _img(tmp_path / "s.png")
    ref = proc.image_processor(images=[data.load_image(big[0])], return_tensors="pt")
    assert ref["image_grid_thw"].tolist() == [[1, 6, 8]]  # 12 merged tokens
    recs = [{"id": f"r{i}", "image": p, "images": [p], "question": "Q?", "target": "A", "history": []}
            for i, p in enumerate(big + [small])]
    for file in (recs[:2], recs):  # same-size photos only, then mixed sizes
        b = Batcher(proc, file).encode(file, answers=["A"] * len(file))
        assert b["image_grid_thw"][0].tolist() == [1, 6, 8]
        assert torch.equal(b["pixel_values"][:48], ref["pixel_values"])
        loader = Loader(file, len(file), 0)
        _, ims = loader.batch(0)  # one list of images per record (a MoLE record may hold several)
        assert sorted(g.tolist() for g in proc.images([im for per in ims for im in per])[1])[-1] == [1, 6, 8]
    eighty = [world.render(world.sample_scene(__import__("random").Random(i))) for i in range(3)]
    fast, slow = proc.images(eighty), proc.image_processor(images=eighty, return_tensors="pt")
    assert torch.equal(fast[1], slow["image_grid_thw"])
    # rescale, normalise (x / 255 - mean) / std: 4 fp32 steps of the largest |value|
    torch.testing.assert_close(fast[0], slow["pixel_values"], rtol=0, atol=tol(torch.float32, 4, fast[0].abs().max()))


# ----------------------------------------------------------------------------- training signals

def test_adapters_are_fp32_on_a_bf16_base(tmp_path, small):
    import copy
    _tiny_bf16 = lambda: (copy.deepcopy(small[0]).to(torch.bfloat16), small[1])
    from mod.model import AdapterConfig, attach, load_adapters, save_adapters
    from mole.lora import add_lora
    for method in ("mod", "lora", "moelora"):
        model, proc = _tiny_bf16()
        attach(model, AdapterConfig(method=method))
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert trainable and all(p.dtype == torch.float32 for p in trainable)
        b = proc.encode([world.render([])], ["Q?"], ["yes"])
        out = model(**b)
        assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    save_adapters(model, str(tmp_path / "ad"))
    from safetensors.torch import load_file
    assert {v.dtype for v in load_file(str(tmp_path / "ad" / "adapter_model.safetensors")).values()} == {torch.float32}
    fresh, _ = _tiny_bf16()
    load_adapters(fresh, str(tmp_path / "ad"))  # fp32 tensors into fp32 adapters on a bf16 base
    assert all(p.dtype == torch.float32 for p in fresh.parameters() if p.requires_grad)
    model, proc = _tiny_bf16()
    add_lora(bb.text_model(model), r=4, lora_alpha=8)
    lora = [m for n, m in model.named_modules() if n.endswith("q_proj")][0]
    assert lora.lora_A.weight.dtype == lora.lora_B.weight.dtype == torch.float32
    with torch.no_grad():
        lora.lora_B.weight.normal_(std=0.1)  # A receives a gradient once B is nonzero
    model.requires_grad_(False)
    for p in (lora.lora_A.weight, lora.lora_B.weight):
        p.requires_grad_(True)
    opt = torch.optim.AdamW([lora.lora_A.weight, lora.lora_B.weight], lr=2e-4)
    before = lora.lora_A.weight.detach().clone()
    model(**proc.encode([world.render([])], ["Q?"], ["yes"])).loss.backward()
    opt.step()
    changed = (lora.lora_A.weight != before).float().mean().item()
    assert changed == 1.0  # bf16 weights left ~29% of the entries unchanged at this lr


def _four_batches(proc, answers):
    import random
    rng = random.Random(0)
    ims = [world.render(world.sample_scene(rng)) for _ in answers]
    qs = [f"Question {i}?" for i in range(len(answers))]
    return lambda rows: proc.encode([ims[i] for i in rows], [qs[i] for i in rows], [answers[i] for i in rows])


SPLITS = ([[0, 1, 2, 3]], [[0, 1], [2, 3]], [[0], [1], [2], [3]])
ANSWERS = ["a", "a much longer answer with many more label tokens " * 3, "b c", "yes"]


def _grads(params):
    g = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
    for p in params:
        p.grad = None
    return g


def _grad_depth(model, batch):
    """fp32 steps behind a gradient of the 4-record step: the forward's (decoder_depth with the
    adapters', over the longest record) twice, as the backward retraces it, plus the sum over all tokens."""
    n = batch["input_ids"].numel()
    return 2 * decoder_depth(model.config, batch["input_ids"].shape[1], adapter_depth(model)) + n


def _same_grads(gs, depth):
    """The gradient vectors of the splits agree within `depth` fp32 steps of the first one's norm
    (the rounding of other micro-batch shapes); a per-micro-batch normalisation moves them by more
    (2.9% of the norm in the pretrain case, against a bound of 0.02%)."""
    for g in gs[1:]:
        err = (g - gs[0]).norm()
        assert err <= tol(torch.float32, depth, gs[0].norm()), float(err / gs[0].norm())


def test_grad_accum_normalises_by_step_tokens_mod(small):
    import copy
    from mod.model import AdapterConfig, attach
    from mod.train import accumulate
    model, proc = copy.deepcopy(small[0]), small[1]
    attach(model, AdapterConfig(method="mod", aux_coef=0.0))
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad and n.endswith(".B"):
                p.normal_(std=0.1)
    model.train()
    enc = _four_batches(proc, ANSWERS)
    gs = []
    for split in SPLITS:
        accumulate(model, model, [enc(rows) for rows in split])
        gs.append(_grads(params))
    _same_grads(gs, _grad_depth(model, enc([0, 1, 2, 3])))


def test_grad_accum_normalises_by_step_tokens_mole(small):
    import copy
    from mole.model import MoLE, MoLEConfig
    from mole.train import accumulate
    model, proc = copy.deepcopy(small[0]), small[1]
    model.requires_grad_(False)
    mole = MoLE(model, proc, MoLEConfig(lambda_balance=0, lambda_z=0, lambda_div=0)).train()
    params = [p for p in mole.parameters() if p.requires_grad]
    enc = _four_batches(proc, ANSWERS)
    gs = []
    for split in SPLITS:
        batches = []
        for rows in split:
            b = enc(rows)
            batches.append(mole.encode(None, [f"Question {i}?" for i in rows], [ANSWERS[i] for i in rows],
                                       pixels=(b["pixel_values"], b["image_grid_thw"])))
        accumulate(mole, batches, stage=2)
        gs.append(_grads(params))
    b = enc([0, 1, 2, 3])
    _same_grads(gs, _grad_depth(model, b) + 4 * (mole.cfg.n_vis + mole.cfg.n_sum))   # the latent rows too
    model.requires_grad_(True)  # the sft path: the plain VLM
    params = [p for p in model.parameters() if p.requires_grad]
    gs = []
    for split in SPLITS:
        accumulate(model, [enc(rows) for rows in split])
        gs.append(_grads(params))
    _same_grads(gs, _grad_depth(model, b))


def test_grad_accum_normalises_by_step_tokens_pretrain(small):
    import copy
    from eval.tools.pretrain import accumulate, make_batch
    model, proc = copy.deepcopy(small[0]), small[1]
    batch, answer_mask = make_batch(proc, 0, 4, 0, [1, 1, 1, 1, 1], 0.5)  # prompt shapes of unequal length
    assert len(set((batch["labels"] != -100).sum(1).tolist())) > 1
    params = list(model.parameters())
    gs, losses = [], []
    for g in (1, 2, 4):
        losses.append(float(accumulate(model, batch, answer_mask, g)))
        gs.append(_grads(params))
    _same_grads(gs, _grad_depth(model, batch))
    # the token-mean CE moves by at most 2 x the logits' error, plus its sum over the step's tokens
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    L = batch["input_ids"].shape[1]
    bound = 2 * logits_tol(model, L, logits) + tol(torch.float32, batch["input_ids"].numel() + logits.shape[-1],
                                                   max(losses))
    assert max(losses) - min(losses) <= bound


# ----------------------------------------------------------------------------- splits, layering

def test_shapes_splits_are_disjoint_by_construction(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(world, "render", lambda scene: seen.append(scene) or Image.new("RGB", (1, 1)))
    pairs = {}
    for split, n in (("train", 2000), ("test", 500), ("val", 100)):
        start = len(seen)
        recs = world.generate_split(str(tmp_path), split, n)
        pairs[split] = {(tuple(s), r["conversations"][0]["value"]) for s, r in zip(seen[start:], recs)}
        assert all(world.split_of(list(s), q.split("\n", 1)[1]) == split for s, q in pairs[split])
    assert not pairs["train"] & pairs["test"] and not pairs["train"] & pairs["val"] and not pairs["val"] & pairs["test"]


def test_common_imports_nothing_from_above():
    """common/ is the ground floor: no import (module level or inside a function) of eval/,
    mod/, mole/ or rolemerge/."""
    bad = []
    for f in sorted(os.listdir(os.path.join(REPO, "common"))):
        if not f.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(REPO, "common", f)).read())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{f}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("eval", "mod", "mole", "rolemerge")]
    assert bad == []


def test_docstrings_point_at_nothing_outside_the_repo():
    hits = []
    for d in ("common", "eval", "mod", "mole", "rolemerge"):
        for f in os.listdir(os.path.join(REPO, d)):
            if f.endswith(".py"):
                text = open(os.path.join(REPO, d, f)).read()
                hits += [f"{d}/{f}: {w}" for w in ("shared/", "papers/0", "NOTES-transformers", "DESIGN.md")
                         if w in text]
    assert hits == []


def test_final_answer_keeps_free_form_gold_whole():
    """A LLaVA record without an "answer" field takes its gold from the last gpt turn; a
    quote inside a free-form answer used to cut it ('The sign says ')."""
    from common.answers import final_answer
    assert final_answer('The sign says "STOP".') == 'The sign says "STOP".'
    assert final_answer("two lines\nof answer") == "two lines\nof answer"
    assert final_answer('{"Reasoning": "r", "Answer": "a \\"quoted\\" word"}') == 'a "quoted" word'
    assert final_answer('scene. Answer: "red".') == "red"
    assert final_answer('{"Reasoning": "r", "Answer": "B"') == "B"  # truncated JSON: marker rule
