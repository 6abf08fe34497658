"""Scoring of the MoLE stage-1 bottleneck experiment (eval/toys/mole.py): per-cell transcription."""
import torch

from eval.toys.mole import cell_accuracy, cells_of
from helpers import tol

# float64 means, sample sds and MDDs over <= 20 items: 2 x 20 + 8 steps of values <= 2 (accuracies, CEs)
EXACT = tol(torch.float64, 2 * 20 + 8, 2.0)

GOLD = ("tl red circle + tc empty - tr empty - ml empty - mc blue square - mr empty - bl empty - bc empty - "
        "br empty -. Answer: yes")


def test_cells_of_parses_every_cell_first_mention_wins():
    c = cells_of(GOLD)
    assert len(c) == 9 and c["tl"] == "red circle" and c["mc"] == "blue square" and c["br"] == "empty"
    assert cells_of("tl empty - tl red circle")["tl"] == "empty"
    assert cells_of("1tl red circle") == {}  # a spatial mark is not a cell tag


def test_cell_accuracy_hand_values():
    assert cell_accuracy(GOLD, GOLD) == 1.0
    all_empty = " ".join(f"{t} empty -" for t in ("tl", "tc", "tr", "ml", "mc", "mr", "bl", "bc", "br"))
    assert cell_accuracy(all_empty, GOLD) == 7 / 9  # the two object cells are wrong
    assert cell_accuracy(all_empty, GOLD, objects_only=True) == 0.0
    half = GOLD.replace("mc blue square", "mc blue circle")
    assert cell_accuracy(half, GOLD, objects_only=True) == 0.5  # colour right, shape wrong: wrong
    assert cell_accuracy("tl red circle", GOLD) == 1 / 9  # missing cells count as wrong


def test_toys_mole_takes_model_and_threads_and_calls_train_with_model(monkeypatch, tmp_path):
    """eval.toys.mole has the entry-point vocabulary (--model, --threads) and hands mole.train
    --model and --threads."""
    import eval.toys.mole as tm
    from mole import train as mt
    seen = []

    def fake_main(argv):
        seen.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(mt, "main", fake_main)
    monkeypatch.setattr(tm, "set_threads", lambda threads, model: seen.append(("threads", threads, model)) or 1)
    monkeypatch.setattr(tm.world, "ensure_splits", lambda *a, **k: None)
    monkeypatch.setattr(tm.data, "read_llava_json", lambda *a, **k: [])
    try:
        tm.main(["--quick", "--model", "tiny-dense", "--threads", "1", "--out", str(tmp_path)])
    except SystemExit:
        pass
    assert seen[0] == ("threads", 1, "tiny-dense")
    argv = next(x for x in seen if isinstance(x, list))
    assert argv[argv.index("--model") + 1] == "tiny-dense"
    assert argv[argv.index("--threads") + 1] == "1"


def test_pick_lr_best_validation_accuracy_and_the_preregistered_tie_rule():
    from eval.toys.mole import pick_lr
    assert pick_lr({5e-4: 0.60, 2e-3: 0.62, 5e-3: 0.65}) == 5e-3          # highest wins, not the default
    assert pick_lr({5e-4: 0.70, 2e-3: 0.62, 5e-3: 0.65}) == 5e-4
    assert pick_lr({5e-4: 0.99, 2e-3: 0.99, 5e-3: 0.98}) == 2e-3          # tie including the table's lr: keep it
    assert pick_lr({5e-4: 0.90, 2e-3: 0.80, 5e-3: 0.90}) == 5e-4          # tie without it: the lowest
    import pytest
    with pytest.raises(ValueError, match="no lr sweep"):
        pick_lr({})


def _fake(path, row, seed, lr, correct):
    import json
    import os
    os.makedirs(os.path.dirname(path), exist_ok=True)
    items = [{"id": f"t{i}", "family": "count", "correct": bool(c)} for i, c in enumerate(correct)]
    with open(path, "w") as f:
        json.dump({"row": row, "seed": seed, "lr": lr, "items": items}, f)


def test_summarise_lr_reads_each_row_at_its_picked_lr_only(tmp_path):
    """Sweep picks 5e-3 for MoLE, 2e-3 for SFT and, by the tie rule, for plain latents (tied
    with 5e-4): the summary takes MoLE (and its ablation)
    from table_lr0.005, SFT from table, never the other lr's files, and compares the ablation
    with MoLE at the same lr."""
    import eval.toys.mole as tm
    out = str(tmp_path)
    n = 20
    for row in tm.LR_SWEPT:
        for lr in tm.LR_GRID:
            acc = {"mole": {5e-3: 9}, "plain_latent": {5e-4: 7}}.get(row, {}).get(lr, 5 if lr != 2e-3 else 7)
            _fake(f"{out}/lr_sweep/{row}_lr{lr:g}.json", row, 0, lr, [1] * acc + [0] * (10 - acc))
    for lr, good in ((2e-3, 4), (5e-3, 15)):  # MoLE: 4/20 at 2e-3, 15/20 at 5e-3
        d = tm.lr_dir(out, lr)
        for seed in (0, 1):
            _fake(f"{d}/mole_seed{seed}.json", "mole", seed, lr, [1] * good + [0] * (n - good))
            _fake(f"{d}/no_esva_seed{seed}.json", "no_esva", seed, lr, [1] * (good - 2) + [0] * (n - good + 2))
            _fake(f"{d}/sft_seed{seed}.json", "sft", seed, lr, [1] * (n - (lr == 5e-3) * 10) + [0] * ((lr == 5e-3) * 10))
    s = tm.summarise_lr(out)
    assert s["picked_lr"] == {"sft": 2e-3, "sft_placeholders": 2e-3, "plain_latent": 2e-3, "mole": 5e-3}
    rows = {r["row"]: r for r in s["rows"]}
    assert rows["mole"]["lr"] == 5e-3 and rows["mole"]["mean"]["acc"] == 15 / 20
    assert rows["sft"]["lr"] == 2e-3 and rows["sft"]["mean"]["acc"] == 1.0
    assert rows["no_esva"]["lr"] == 5e-3 and abs(rows["no_esva"]["vs_mole"]["mean"]["diff"] + 2 / 20) <= EXACT
    sd = (1.8 / 19) ** 0.5  # per-item differences: two -1, eighteen 0 (sample sd)
    m = rows["no_esva"]["vs_mole"]["mean"]
    assert abs(m["sd"] - sd) <= EXACT and abs(m["mdd"] - 2.8 * sd / 20 ** 0.5) <= EXACT
    assert rows["mole"]["vs_sft"]["seeds"] == [0, 1] and abs(rows["mole"]["vs_sft"]["mean"]["diff"] + 5 / 20) <= EXACT
    assert (tmp_path / "results_lr.json").exists() and (tmp_path / "table_lr_acc.png").exists()
    md = tm.lr_markdown(s)
    assert "| mole | 0.500 | 0.700 | 0.900 | 0.005 |" in md
    assert "| ESVA helps: MoLE minus no_esva | 0,1 | +0.100 [" in md and "| Q2 MoLE minus SFT + 8 placeholders | - |" in md


def test_shared_items_needs_the_same_text_and_the_same_image(tmp_path):
    """A validation item is a training item only if question, target and pixels are equal:
    the shapes text does not name object size, so equal text can be another image."""
    from PIL import Image
    from eval.toys.mole import shared_items
    for name, colour in (("a", "red"), ("b", "red"), ("c", "blue")):
        Image.new("RGB", (8, 8), colour).save(tmp_path / f"{name}.png")
    rec = lambda i, img, q="How many squares?": {"id": i, "image": str(tmp_path / img), "question": q,
                                                 "target": "tl empty -. Answer: 0"}
    train = [rec("t0", "a.png")]
    assert shared_items(train, [rec("v0", "b.png")]) == ["v0"]          # same text, same pixels
    assert shared_items(train, [rec("v1", "c.png")]) == []              # same text, other image
    assert shared_items(train, [rec("v2", "a.png", q="What colour?")]) == []  # same image, other question


def test_phases_of_the_other_part_are_refused(capsys):
    import pytest
    import eval.toys.mole as tm
    for argv in (["--phase", "sweep"], ["--part", "bottleneck", "--phase", "lr"], ["--phase", "lr", "--quick"],
                 ["--phase", "lr", "--max-minutes", "0"]):
        with pytest.raises(SystemExit) as e:
            tm.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "is for --part bottleneck" in err and "is for the full table" in err and "--max-minutes" in err


def test_verdict_follows_the_one_rule():
    """eval.toys.mole.verdict is eval.metrics.verdict on the seed-averaged two-level CI and the
    per-seed differences (no longer each seed's own CI, the pre-registered rule before 2026-12-02)."""
    from eval.toys.mole import verdict
    d = lambda x, lo, hi: {"diff": x, "ci_low": lo, "ci_high": hi}
    cmp = lambda per, mean: {"per_seed": {str(i): p for i, p in enumerate(per)}, "mean": mean,
                             "seeds": list(range(len(per)))}
    up, down, small, neg = d(0.1, 0.05, 0.15), d(-0.1, -0.15, -0.05), d(0.02, -0.01, 0.05), d(-0.01, -0.04, 0.02)
    assert verdict(cmp([up, up, up], up)) == "supported"
    assert verdict(cmp([up, small, up], up)) == "supported"      # a seed's own CI may reach 0; its sign agrees
    assert verdict(cmp([up, neg, up], up)) == "inconclusive"     # one seed's difference has the other sign
    assert verdict(cmp([up, up], small)) == "inconclusive"       # the seed-level CI reaches 0
    assert verdict(cmp([down, down], down)) == "contradicted"
    assert verdict(cmp([down, down], down), sign=-1) == "supported"  # "MoLE minus the ablation > 0"
    assert verdict(cmp([up], up)) == "supported (1 seed: questions-only bootstrap)"


def test_phase_data_prepares_data_and_base_and_trains_nothing(monkeypatch, tmp_path, capsys):
    """--phase data: the splits and the base row only (so one process per --seeds can share --out)."""
    import eval.toys.mole as tm
    from mole import train as mt
    calls = []
    monkeypatch.setattr(tm.world, "ensure_splits", lambda d, sizes: calls.append(("splits", dict(sizes))))
    monkeypatch.setattr(tm.data, "read_llava_json", lambda *a, **k: [])
    monkeypatch.setattr(tm, "_base_row", lambda tab_dir, *a: calls.append(("base", tab_dir)))
    monkeypatch.setattr(mt, "main", lambda argv: calls.append(("train", argv)))
    tm.main(["--phase", "data", "--out", str(tmp_path), "--data", str(tmp_path / "d"), "--threads", "1"])
    assert calls == [("splits", {"train": 1280, "test": 500}), ("base", str(tmp_path / "table"))]
    assert "are ready" in capsys.readouterr().out


def _items(correct, **extra):
    return [dict({"correct": bool(c), "family": "f"}, **{k: bool(v[i]) for k, v in extra.items()})
            for i, c in enumerate(correct)]


def test_headroom_check_applies_both_preregistered_bars(tmp_path, monkeypatch):
    import json
    import eval.toys.mole as tm
    monkeypatch.setattr(tm.data, "read_llava_json", lambda *a, **k: [])
    (tmp_path / "lr_sweep").mkdir()
    write = lambda name, c: (tmp_path / name).write_text(json.dumps({"items": _items(c)}))
    write("headroom_base_val.json", [1] * 7 + [0] * 3)        # 0.70: at the bar, passes
    write("lr_sweep/sft_lr0.002.json", [1] * 8 + [0] * 2)     # 0.80
    write("lr_sweep/sft_lr0.005.json", [1] * 17 + [0] * 3)    # 0.85: at the bar, passes
    out = tm.headroom_check(str(tmp_path), str(tmp_path))
    assert out["base"]["acc"] == 0.7 and out["sft"]["0.005"]["acc"] == 0.85 and out["passes"]
    write("lr_sweep/sft_lr0.005.json", [1] * 9 + [0] * 1)     # 0.90 at one lr: fails
    assert not tm.headroom_check(str(tmp_path), str(tmp_path))["passes"]
    write("lr_sweep/sft_lr0.005.json", [1] * 8 + [0] * 2)
    write("headroom_base_val.json", [1] * 8 + [0] * 2)        # base 0.80: fails
    assert not tm.headroom_check(str(tmp_path), str(tmp_path))["passes"]
    assert json.loads((tmp_path / "headroom.json").read_text())["passes"] is False


def test_swapped_gives_each_record_the_next_image():
    from eval.toys.mole import swapped
    recs = [{"id": i, "image": f"im{i}", "images": [f"im{i}"], "question": f"q{i}"} for i in range(3)]
    assert [(r["question"], r["image"]) for r in swapped(recs)] == [("q0", "im1"), ("q1", "im2"), ("q2", "im0")]
    # mole.infer reads the "images" list (common.data's records carry both)
    from common.data import record_images
    assert [record_images(r) for r in swapped(recs)] == [["im1"], ["im2"], ["im0"]]
    assert recs[0]["image"] == "im0" and recs[0]["images"] == ["im0"]  # the input is not changed
    assert swapped([{"id": 0, "image": "a"}, {"id": 1, "image": "b"}])[0]["images"] == ["b"]


def test_summarise_control_floor_and_comparison_with_plain_latents(tmp_path):
    """own minus swapped is the floor test; vs plain latents is paired per seed (hand values)."""
    import json
    import eval.toys.mole as tm
    n = 40
    def write(split, arm, seed, own, swap):
        r = {"arm": arm, "lr": 0.002, "seed": seed, "split": split, "steps": 3, "train_s": 1.0,
             "ce_log": [[1, 2.0], [2, 1.0]], "latent_sim_x100": 1.0, "attn_kl_x100": 2.0, "routing_entropy": 0.5,
             "grad_norms": {"latent": 0.1}, "items": _items(own, correct_swapped=swap)}
        (tmp_path / f"{split}_{arm}_lr0.002_seed{seed}.json").write_text(json.dumps(r))
    for seed in (0, 1):
        write("test", "plain_latent", seed, [1] * 10 + [0] * 30, [1] * 10 + [0] * 30)   # at the floor
        write("test", "mole", seed, [1] * 30 + [0] * 10, [1] * 10 + [0] * 30)           # 0.75 vs 0.25
        for arm, ce in (("plain_latent", 1.0), ("mole", 0.5)):  # answer-word CE: MoLE 0.5 nats lower
            p = tmp_path / f"test_{arm}_lr0.002_seed{seed}.json"
            r = json.loads(p.read_text())
            for x in r["items"]:
                x["answer_ce"], x["answer_ce_swapped"] = ce, 2.0
            p.write_text(json.dumps(r))
    write("val", "mole", 0, [1] * 5 + [0] * 35, [0] * n)
    write("test", "no_router", 0, [1] * 11 + [0] * 29, [1] * 10 + [0] * 30)  # +0.025, CI [0, +0.075]: not off the floor
    s = tm.summarise_control(str(tmp_path))
    rows = {(r["arm"], r["seed"]): r for r in s["rows"]}
    assert s["sweep_val_acc"] == {"mole": {"0.002": 0.125}}
    p, m = rows[("plain_latent", 0)], rows[("mole", 1)]
    assert p["own_minus_swapped"]["diff"] == 0 and p["own_minus_swapped"]["ci_low"] == 0
    assert m["own"]["acc"] == 0.75 and m["swapped"]["acc"] == 0.25
    assert abs(m["own_minus_swapped"]["diff"] - 0.5) <= EXACT and m["own_minus_swapped"]["ci_low"] > 0
    assert abs(m["vs_plain"]["diff"] - 0.5) <= EXACT and m["end_ce"] == 1.5
    assert s["vs_plain"]["mole"]["seeds"] == [0, 1] and tm.verdict(s["vs_plain"]["mole"]) == "supported"
    assert "| mole minus plain latents | 0,1 | +0.500" in tm.control_markdown(s)
    assert abs(m["ce_vs_plain"]["diff"] + 0.5) <= EXACT and abs(m["ce_swapped_minus_own"]["diff"] - 1.5) <= EXACT
    assert tm.verdict(s["ce_vs_plain"]["mole"], -1) == "supported"   # lower CE is better
    rows = tm.export_control(str(tmp_path), str(tmp_path / "res"), "log#x")
    arm = {(r.get("arm"), r.get("seed")): r for r in rows}
    assert arm[("mole", 0)]["leaves_floor"] and not arm[("plain_latent", 0)]["leaves_floor"]
    assert not arm[("no_router", 0)]["leaves_floor"] and arm[("no_router", 0)]["own_minus_swapped"].startswith("+0.025")
    claim = next(r for r in rows if r["kind"] == "claim" and "minus plain latents, accuracy" in r["claim"])
    floor = {r["claim"].split(" leaves")[0]: r for r in rows if "leaves the floor" in r.get("claim", "")}
    assert floor["MoLE"]["verdict"] == "supported"                        # +0.5 in both seeds
    assert floor["plain latents"]["verdict"].startswith("inconclusive")   # own = swapped
    assert claim["verdict"] == "supported" and claim["effect"].startswith("+0.500") and claim["seeds"] == 2
    per_q = json.loads((tmp_path / "res" / "control_per_question.json").read_text())
    assert per_q["correct"]["mole/seed1"]["swapped"] == [1] * 10 + [0] * 30


def test_headroom_and_control_refuse_other_phases(capsys):
    import pytest
    import eval.toys.mole as tm
    for argv in (["--part", "control", "--phase", "check"], ["--part", "headroom", "--phase", "lr"],
                 ["--part", "control", "--max-minutes", "-1"], ["--part", "bottleneck", "--max-minutes", "5"]):
        with pytest.raises(SystemExit) as e:
            tm.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--part control takes --phase all, summary" in err and "must be > 0" in err
    assert "--max-minutes goes with --phase lr or --part headroom / control" in err


def test_majority_per_form_is_the_image_blind_answer():
    from eval.toys.mole import majority_per_form
    qa = [("Is the red circle big?", "yes"), ("Is the blue square small?", "no"), ("Is the green circle big?", "no"),
          ("How many big shapes are there?", "1"), ("How many small shapes are there?", "2"),
          ("How many small shapes are there?", "1"), ("What colour is the circle?", "red")]
    got = majority_per_form([{"question": q, "answer": a} for q, a in qa])
    assert got == ["no", "no", "no", "1", "1", "1", "red"]


def test_run_order_main_rows_and_interventions_per_seed_then_the_ablations(monkeypatch, tmp_path):
    """run(): for each seed the main rows (the interventions right after mole), then for each seed
    the ablations; quick mode: sft, plain latents and MoLE of seed 0, no interventions."""
    import eval.toys.mole as tm
    calls = []
    monkeypatch.setattr(tm, "_ensure_data", lambda *a: None)
    monkeypatch.setattr(tm.data, "read_llava_json", lambda *a, **k: [])
    monkeypatch.setattr(tm, "_base_row", lambda *a: calls.append("base"))
    monkeypatch.setattr(tm, "_table_one", lambda name, flags, seed, *a: calls.append((name, seed)) or
                        ({"items": [{"correct": True}]}, None, 1))
    monkeypatch.setattr(tm, "_interventions", lambda tab_dir, seed, *a: calls.append(("interventions", seed)))
    monkeypatch.setattr(tm, "summarise_table", lambda *a: "summary")
    assert tm.run(False, str(tmp_path / "d"), str(tmp_path), seeds=(0, 1)) == "summary"
    want = ["base"]
    for s in (0, 1):
        for n in tm.TABLE_MAIN:
            want += [(n, s), ("interventions", s)] if n == "mole" else [(n, s)]
    want += [(n, s) for s in (0, 1) for n in tm.ABLATIONS]
    assert calls == want
    calls.clear()
    tm.run(True, str(tmp_path / "d"), str(tmp_path), seeds=(0, 1))
    assert calls == [("sft", 0), ("plain_latent", 0), ("mole", 0)]


def test_run_lr_order_interventions_after_mole_at_its_picked_lr(monkeypatch, tmp_path):
    """run_lr with a complete sweep: per seed the main rows at their picked lr with MoLE's
    interventions right after it, then per seed the ablations at MoLE's lr."""
    import eval.toys.mole as tm
    calls = []
    monkeypatch.setattr(tm, "_ensure_data", lambda *a: None)
    monkeypatch.setattr(tm.world, "ensure_splits", lambda *a: None)
    monkeypatch.setattr(tm.data, "read_llava_json", lambda *a, **k: [])
    sweep = {n: {lr: (1.0 if lr == 5e-3 else 0.5) for lr in tm.LR_GRID} for n in tm.LR_SWEPT}
    monkeypatch.setattr(tm, "read_sweep", lambda out_dir: sweep)
    monkeypatch.setattr(tm, "_table_one", lambda name, flags, seed, *a, lr=None, path=None: (
        calls.append((name, seed, lr)) if path is None else None) or ({"items": [], "steps_s": 0}, None, 1))
    monkeypatch.setattr(tm, "_interventions", lambda tab_dir, seed, *a: calls.append(("interventions", seed, tab_dir)))
    monkeypatch.setattr(tm, "summarise_lr", lambda *a: "summary")
    assert tm.run_lr(str(tmp_path / "d"), str(tmp_path), seeds=(2, 0)) == "summary"
    want = []
    for s in (2, 0):
        for n in tm.LR_SWEPT:
            want.append((n, s, 5e-3))
            if n == "mole":
                want.append(("interventions", s, tm.lr_dir(str(tmp_path), 5e-3)))
    want += [(n, s, 5e-3) for s in (2, 0) for n in tm.ABLATIONS]
    assert calls == want
