"""MoLE with several images per question (LLaVA "images" list, one vision block per image):
encode, routing over the visual tokens of every image, cached generation, and a two-image
record that trains and infers end to end on the tiny base."""
import json
import random

import torch

from common import data
from common import shapes
from common.backbone import build_tiny
from mole import train as mt
from mole.infer import evaluate, generate
from mole.model import VIS, ZVIS, MoLE, MoLEConfig

from helpers import logits_tol


def two_image_examples(n, seed=0):
    """n questions "Is there a <object> in both images?" over two rendered scenes each.
    Returns (scene pairs, questions, answers)."""
    rng = random.Random(seed)
    pairs, qs, ans = [], [], []
    for _ in range(n):
        a, b = shapes.sample_scene(rng), shapes.sample_scene(rng)
        name = rng.choice([o.name for o in a])
        both = name in {o.name for o in b}
        pairs.append((a, b))
        qs.append(f"Is there a {name} in both images?")
        ans.append("yes" if both else "no")
    return pairs, qs, ans


def make(layers=2, **cfg):
    model, proc = build_tiny("qwen3_vl", seed=0, layers=layers)
    mole = MoLE(model.eval(), proc, MoLEConfig(**cfg))
    g = torch.Generator().manual_seed(1)
    for e in mole.esva:
        e.gamma.data = torch.randn(e.gamma.shape, generator=g)
    return mole


@torch.no_grad()
def test_encode_puts_one_vision_block_per_image():
    mole = make()
    pairs, qs, ans = two_image_examples(2)
    imgs = [[shapes.render(a), shapes.render(b)] for a, b in pairs[:1]] + [shapes.render(pairs[1][0])]
    batch = mole.encode(imgs, qs, ans)
    tok = mole.proc.tokenizer.convert_tokens_to_ids
    vs, ve = tok("<|vision_start|>"), tok("<|vision_end|>")
    ids = batch["input_ids"]
    assert batch["image_grid_thw"].shape[0] == 3
    n_tok = int(batch["image_grid_thw"][0].prod()) // mole.proc.merge ** 2
    assert [(ids[i] == vs).sum().item() for i in range(2)] == [2, 1]
    assert [(ids[i] == ve).sum().item() for i in range(2)] == [2, 1]
    assert [(ids[i] == mole.proc.image_token_id).sum().item() for i in range(2)] == [2 * n_tok, n_tok]
    # row 0: <vs> img <ve> <vs> img <ve> question ...; a one-image row is exactly the one-image encoding
    first = ids[0].tolist()
    s = first.index(vs)
    assert first[s:s + 2 * n_tok + 4] == ([vs] + [mole.proc.image_token_id] * n_tok + [ve]) * 2
    one = mole.encode([imgs[1]], qs[1:], ans[1:])
    assert one["input_ids"][0].tolist() == ids[1, : one["input_ids"].shape[1]].tolist()
    # placeholders as the readers keep them: "<image>\n<image>\nQ" is the same prompt as "Q";
    # placeholders inside the text put each block where its placeholder is
    ph = mole.encode(imgs[:1], ["<image>\n<image>\n" + qs[0]], ans[:1])["input_ids"][0].tolist()
    assert ph == first[: len(ph)] and all(t == mole.proc.pad_token_id for t in first[len(ph):])
    mid = mole.encode(imgs[:1], ["Left: <image> Right: <image> " + qs[0]], ans[:1])["input_ids"][0].tolist()
    left, right = mole.proc.text_ids("Left: "), mole.proc.text_ids(" Right: ")
    s2 = mid.index(vs)
    assert mid[s2 - len(left):s2] == left and mid[s2 + n_tok + 2: s2 + n_tok + 2 + len(right)] == right
    assert mid[s2 + n_tok + 2 + len(right)] == vs and mid.count(vs) == 2
    try:
        mole.encode(imgs[:1], ["<image> " + qs[0]], ans[:1])
        raise AssertionError("expected ValueError")
    except ValueError as e:
        assert "2 images has 1 '<image>' placeholders" in str(e)
    # counts that do not add up are refused
    pv, grid = mole.proc.images([shapes.render(a) for a, _ in pairs])
    try:
        mole.encode(None, qs, ans, pixels=(pv, grid), n_images=[2, 1])
        raise AssertionError("expected ValueError")
    except ValueError as e:
        assert "image counts [2, 1] do not fit 2 images" in str(e)


@torch.no_grad()
def test_visual_experts_route_over_both_images():
    """Stage 1: Z_vis read the visual tokens of both images (routing covers both blocks), and
    a change in the second image reaches the Z_vis rows; one layer, so the answer rows could
    only see it through direct attention, which the bottleneck blocks."""
    mole = make(layers=1)
    pairs, qs, ans = two_image_examples(2, seed=1)
    imgs = [[shapes.render(a), shapes.render(b)] for a, b in pairs]
    batch = mole.encode(imgs, qs, ans)
    out = mole(batch, 1, record=True)
    st = out["pass"]
    sel, _ = st.route[0]
    vis = st.is_vis
    assert (sel.sum(-1)[vis] == mole.cfg.top_k).all()  # every visual token of both images is routed
    n = int(vis[0].sum()) // 2
    second = vis.long().cumsum(1) > n  # positions of the second image's tokens (and after)
    assert (st.attn[0][:, :, :, :][(vis & second)[:, None, None].expand_as(st.attn[0])] > 0).any()
    # change only the second image of row 0
    imgs2 = [[imgs[0][0], shapes.render(pairs[1][1])], imgs[1]]
    b2 = mole.encode(imgs2, qs, ans)
    o2 = mole(b2, 1)
    zv = out["types"] == ZVIS
    bound = logits_tol(mole.model, zv.shape[1], out["logits"])  # rounding of another batch's kernels
    assert (out["logits"][0][zv[0]] - o2["logits"][0][zv[0]]).abs().max() > bound
    torch.testing.assert_close(out["logits"][1], o2["logits"][1], rtol=0, atol=bound)  # row 1 untouched
    after = (out["types"][0] != VIS) & (torch.arange(zv.shape[1]) > zv[0].nonzero().max())
    # bottleneck holds: the masked keys add exact zeros, the rest is the same arithmetic
    assert torch.equal(out["logits"][0][after], o2["logits"][0][after])


@torch.no_grad()
def test_two_image_cached_generation_equals_uncached_forward():
    mole = make()
    pairs, qs, _ = two_image_examples(2, seed=2)
    imgs = [[shapes.render(a), shapes.render(b)] for a, b in pairs]
    texts, lens, steps, full = generate(mole, imgs, qs, stage=2, max_new_tokens=4, stop_at_eos=False,
                                        return_logits=True)
    prompt = mole.encode(imgs, qs)
    L, n = prompt["input_ids"].shape[1], steps.shape[1]
    am = torch.cat([prompt["attention_mask"], torch.ones(2, n - 1, dtype=torch.long)], 1)
    fb = dict(prompt, input_ids=full[:, : L + n - 1], attention_mask=am,
              mm_token_type_ids=torch.cat([prompt["mm_token_type_ids"], torch.zeros(2, n - 1, dtype=torch.long)], 1))
    logits = mole(fb, 2)["logits"][:, L - 1:].float()
    torch.testing.assert_close(logits, steps, rtol=0, atol=logits_tol(mole.model, L + n, logits))


def test_two_image_records_train_and_infer_end_to_end(tmp_path):
    # a LLaVA file with an image list (one <image> placeholder per image), read from disk by the
    # one reader (common.data.read_records: relative paths against the data file's folder)
    pairs, qs, ans = two_image_examples(8, seed=3)
    rows = []
    for i, ((a, b), q, y) in enumerate(zip(pairs, qs, ans)):
        names = []
        for k, scene in enumerate((a, b)):
            shapes.render(scene).save(tmp_path / f"im{i}_{k}.png")
            names.append(f"im{i}_{k}.png")
        rows.append({"id": f"two_{i}", "image": names, "family": "existence",
                     "conversations": [{"from": "human", "value": f"<image>\n<image>\n{q}"},
                                       {"from": "gpt", "value": y}]})
    f = tmp_path / "train.json"
    f.write_text(json.dumps(rows))
    recs = data.read_records(str(f))
    assert [len(r["images"]) for r in recs] == [2] * 8 and recs[0]["images"][1] == str(tmp_path / "im0_1.png")
    out = tmp_path / "run"
    net, proc, log = mt.main(["--data", str(f), "--out", str(out), "--batch-size", "4", "--stage1-epochs", "1",
                              "--stage2-epochs", "1", "--quiet", "--device", "cpu"])
    assert [r["stage"] for r in log] == [1, 1, 2, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    net2, _, stage = mt.load_mole(str(out))
    res = evaluate(net2, recs, stage=stage, max_new_tokens=4)
    assert [r["id"] for r in res] == [r["id"] for r in recs] and all(r["n_tokens"] >= 1 for r in res)
    # the command-line entry points take the same file (check_support lets several images through)
    from mole import diagnostics, infer
    cli = infer.main(["--ckpt", str(out), "--data", str(f), "--max-new-tokens", "4", "--device", "cpu"])
    assert [r["pred"] for r in cli] == [r["pred"] for r in res]
    diag = diagnostics.main(["--ckpt", str(out), "--data", str(f), "--limit", "4", "--device", "cpu"])
    assert diag["n"] == 4
    # the SFT control takes one image per record and says so
    err = None
    try:
        mt.train(mt.parse_config(["--data", str(f), "--out", str(tmp_path / "sft"), "--method", "sft",
                                  "--quiet", "--device", "cpu"]))
    except ValueError as e:
        err = str(e)
    assert err and "--method sft takes one image per record" in err


def test_data_fingerprint_covers_every_image():
    from common.cli import data_fingerprint
    r = {"question": "q", "target": "t", "image": "/d/a.png"}
    assert data_fingerprint([r]) == data_fingerprint([dict(r, images=["/d/a.png"])])  # one image: as before
    assert data_fingerprint([dict(r, images=["/d/a.png", "/d/b.png"])]) != \
        data_fingerprint([dict(r, images=["/d/a.png", "/d/c.png"])])
