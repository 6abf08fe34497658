"""Bad images stop every data-reading entry point at read time, before any model loads, with
every bad record named at once; `--skip-bad` leaves them out and says how many.

A truncated JPEG keeps its header: a header-only check passed it, and `eval.evaluate` loaded
the model, generated 64 of 71 records and stopped at the batch holding it, writing nothing;
`rolemerge.infer` ended in a traceback (exit 1)."""
import importlib
import json
import os

import numpy as np
import pytest
from PIL import Image

from common import data
from common import shapes as world

CONV = [{"from": "human", "value": "<image>\nIs there a red circle?"}, {"from": "gpt", "value": "yes"}]


def _truncated_jpeg(path):
    a = np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8)
    Image.fromarray(a).save(path, quality=90)
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2])                 # a download cut short: the header is intact
    with Image.open(path) as im:
        assert im.size == (128, 96)


@pytest.fixture()
def bad_data(tmp_path):
    """A LLaVA JSON of 6 good shapes records, one truncated JPEG and one 0-byte PNG."""
    d = tmp_path / "d"
    world.generate_split(str(d), "test", 6)
    _truncated_jpeg(d / "images" / "trunc.jpg")
    (d / "images" / "zero.png").write_bytes(b"")
    recs = json.loads((d / "test.json").read_text())
    recs += [dict(recs[0], id="trunc", image="images/trunc.jpg"), dict(recs[1], id="zero", image="images/zero.png")]
    (d / "bad.json").write_text(json.dumps(recs))
    return d


def test_reader_decodes_pixels_and_lists_every_bad_record(bad_data, capsys):
    """Every bad record in one message (id, file, what is wrong), missing files too; --skip-bad
    keeps the good ones, in order, and prints the count; a record sharing a bad file is named too."""
    recs = json.loads((bad_data / "bad.json").read_text())
    recs.append(dict(recs[2], id="gone", image="images/missing.png"))
    recs.append(dict(recs[3], id="trunc2", image="images/trunc.jpg"))
    (bad_data / "more.json").write_text(json.dumps(recs))
    with pytest.raises(data.DataError) as e:
        data.read_records(str(bad_data / "more.json"))
    msg = str(e.value)
    assert msg.startswith(f"{bad_data / 'more.json'}: 4 of 10 record(s) with a missing or unusable image")
    assert "--skip-bad" in msg
    lines = msg.split("\n")[1:]
    assert [ln.split(":")[0].strip() for ln in lines] == ["record trunc", "record zero", "record gone", "record trunc2"]
    assert f"cannot read image {bad_data / 'images' / 'trunc.jpg'} (OSError: image file is truncated" in lines[0]
    assert f"image {bad_data / 'images' / 'zero.png'} is an empty (0-byte) file" in lines[1]
    assert f"image {bad_data / 'images' / 'missing.png'} not found (relative paths resolve against --image-root" in lines[2]
    capsys.readouterr()
    kept = data.read_records(str(bad_data / "more.json"), skip_bad=True)
    assert [r["id"] for r in kept] == [f"test_{i:06d}" for i in range(6)]
    err = capsys.readouterr().err
    assert "note: --skip-bad: left out 4 of 10 record(s)" in err and "record zero:" in err
    # the same for canonical JSONL
    (bad_data / "c.jsonl").write_text("\n".join(json.dumps({"id": f"q{i}", "image": f"images/{n}", "question": "?",
                                                            "answer": "a"})
                                                for i, n in enumerate(["test_000000.png", "zero.png", "trunc.jpg"])))
    with pytest.raises(data.DataError, match=r"2 of 3 record\(s\)[^\n]*\n  record q1: [^\n]*0-byte[^\n]*\n  record q2: "
                                             r"cannot read image .*truncated"):
        data.read_jsonl(str(bad_data / "c.jsonl"))
    assert [r["id"] for r in data.read_jsonl(str(bad_data / "c.jsonl"), skip_bad=True)] == ["q0"]
    # nothing left: still an error
    (bad_data / "all_bad.json").write_text(json.dumps([r for r in recs if r["id"] in ("zero", "trunc")]))
    with pytest.raises(data.DataError, match="every record .2. has a missing or unusable image"):
        data.read_records(str(bad_data / "all_bad.json"), skip_bad=True)


def test_the_check_decodes_each_file_once_with_bounded_memory(tmp_path, monkeypatch):
    """One decode per distinct file (30 records on 3 files: 3 decodes), and each decoded image
    is closed before the check returns (no image is kept)."""
    for k in range(3):
        Image.new("RGB", (40, 30), (k * 80, 0, 0)).save(tmp_path / f"{k}.png")
    (tmp_path / "d.json").write_text(json.dumps([{"id": f"r{i}", "image": f"{i % 3}.png", "conversations": CONV}
                                                 for i in range(30)]))
    calls, alive = [], []
    real = data._open_image

    def spy(path, rid="?"):
        im = real(path, rid)
        calls.append(path)
        alive.append(im)
        return im
    monkeypatch.setattr(data, "_open_image", spy)
    recs = data.read_records(str(tmp_path / "d.json"))
    assert len(recs) == 30 and sorted(calls) == sorted(str(tmp_path / f"{k}.png") for k in range(3))
    for im in alive:                                       # closed: Pillow refuses to read a closed image
        with pytest.raises(ValueError):
            im.getpixel((0, 0))


# (entry point, argv): the model never exists, so an error about it would mean the data check came after
ENTRIES = [
    ("eval.evaluate", ["--model", "nowhere", "--out", "OUT/r.json"]),
    ("mod.infer", ["--model", "nowhere", "--methods", "base", "--out", "OUT/r.json"]),
    ("mod.data", ["--model", "nowhere", "--out", "OUT/x.json"]),
    ("mod.train", ["--model", "nowhere", "--out", "OUT"]),
    ("mole.infer", ["--ckpt", "nowhere", "--out", "OUT/r.json"]),
    ("mole.diagnostics", ["--ckpt", "nowhere", "--out", "OUT/r.json"]),
    ("mole.train", ["--model", "nowhere", "--out", "OUT"]),
    ("rolemerge.calibrate", ["--model", "nowhere", "--out", "OUT/s.safetensors"]),
    ("rolemerge.infer", ["--model", "nowhere", "--out", "OUT/r.json"]),
    ("eval.lmms", ["make-task", "--out", "OUT"]),
]


@pytest.mark.parametrize("entry,argv", ENTRIES, ids=[e for e, _ in ENTRIES])
def test_every_entry_point_names_both_bad_images_before_the_model(entry, argv, bad_data, tmp_path, capsys):
    """A truncated JPEG and a 0-byte image among good ones: `error:` listing both, exit 2, no
    traceback, nothing written at --out; with --skip-bad reading goes on (the note counts 2
    left out) and the run stops at the missing model instead."""
    from common.cli import run_cli
    main = importlib.import_module(entry).main
    out = tmp_path / "o"
    argv = [a.replace("OUT", str(out)) for a in argv] + ["--data", str(bad_data / "bad.json"), "--threads", "1"]
    if entry == "eval.lmms":
        argv = argv[:-2]
    call = (lambda av: run_cli(main, av)) if entry == "eval.evaluate" else main
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        call(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err
    assert "2 of 8 record(s) with a missing or unusable image" in err
    assert "record trunc: cannot read image" in err and "truncated" in err
    assert "record zero: image" in err and "0-byte" in err
    assert not [f for f in out.rglob("*") if f.is_file()] if out.exists() else True   # no file at --out
    if entry == "eval.lmms":                                 # no model: the task is written without the two
        call(argv + ["--skip-bad"])
        assert "note: --skip-bad: left out 2 of 8 record(s)" in capsys.readouterr().err
        docs = (out / "shapes.jsonl").read_text()
        assert docs.count("\n") == 6 and "trunc.jpg" not in docs and "zero.png" not in docs
        return
    with pytest.raises(SystemExit) as e:
        call(argv + ["--skip-bad"])
    err = capsys.readouterr().err
    assert "note: --skip-bad: left out 2 of 8 record(s)" in err, err
    assert e.value.code == 2 and "nowhere" in err.split("note:")[1]   # then the missing model stops it


def test_rolemerge_infer_on_a_truncated_image_is_an_error_not_a_traceback(bad_data, tmp_path):
    """The reported case, end to end with the real tiny MoE and only the truncated JPEG bad
    (it used to end in a traceback, exit 1, after the model had loaded): exit 2 and `error:`,
    before the model loads (nothing at --out, no .partial)."""
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    recs = [r for r in json.loads((bad_data / "bad.json").read_text()) if r["id"] != "zero"]
    (bad_data / "trunc.json").write_text(json.dumps(recs))
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "rolemerge.infer", "--model", "tiny-moe", "--data",
                        str(bad_data / "trunc.json"), "--out", str(out), "--threads", "1"], cwd=repo,
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert "1 of 7 record(s)" in r.stderr and "record trunc: cannot read image" in r.stderr
    assert not out.exists() and not os.path.exists(f"{out}.partial")


def test_evaluate_limit_decodes_only_the_records_it_evaluates(bad_data, tmp_path, capsys):
    """`eval.evaluate --limit N`: the two bad images are records 7 and 8, past the limit, so the
    run goes on to the (missing) model; records inside the limit are still checked first."""
    from common.cli import run_cli
    from eval.evaluate import main
    argv = ["--model", "nowhere", "--data", str(bad_data / "bad.json"), "--threads", "1",
            "--out", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit) as e:
        run_cli(main, argv + ["--limit", "6"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "nowhere" in err and "unusable image" not in err, err
    with pytest.raises(SystemExit) as e:
        run_cli(main, argv + ["--limit", "7"])          # the truncated JPEG is item 7
    err = capsys.readouterr().err
    assert e.value.code == 2 and "1 of 7 record(s) with a missing or unusable image" in err, err
