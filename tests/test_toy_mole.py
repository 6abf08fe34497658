"""Scoring of the MoLE stage-1 bottleneck experiment (eval/toy_mole.py): per-cell transcription."""
from eval.toy_mole import cell_accuracy, cells_of

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


def test_toy_mole_takes_model_and_threads_and_calls_train_with_model(monkeypatch, capsys, tmp_path):
    """eval.toy_mole has the entry-point vocabulary (--model, --base deprecated, --threads) and
    hands mole.train --model, never the deprecated --base."""
    import eval.toy_mole as tm
    from mole import train as mt
    seen = []

    def fake_main(argv):
        seen.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(mt, "main", fake_main)
    monkeypatch.setattr(tm, "set_threads", lambda threads, model: seen.append(("threads", threads, model)) or 1)
    monkeypatch.setattr(tm.data, "ensure_splits", lambda *a, **k: None)
    monkeypatch.setattr(tm.data, "read_llava_json", lambda *a, **k: [])
    for flag in ("--model", "--base"):
        seen.clear()
        try:
            tm.main(["--quick", flag, "tiny-dense", "--threads", "1", "--out", str(tmp_path)])
        except SystemExit:
            pass
        assert seen[0] == ("threads", 1, "tiny-dense")
        argv = next(x for x in seen if isinstance(x, list))
        assert argv[argv.index("--model") + 1] == "tiny-dense" and "--base" not in argv
        assert argv[argv.index("--threads") + 1] == "1"
    assert "--base is deprecated; use --model" in capsys.readouterr().err
