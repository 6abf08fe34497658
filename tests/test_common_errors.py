"""Bad inputs to the shared readers and loaders (common/data.py, common/backbone.py,
common/checkpoint.py) and to eval.evaluate: every one ends in a message that names the
problem and the fix, and nothing on disk is lost or half-written.

Cases already covered elsewhere are not repeated here: missing / junk / 0-byte image and a
record without an answer turn (test_data.py), missing config.json, a non-existent path and
a typo of a tiny name (test_backbone.py)."""
import json
import os
import shutil
import struct
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from common import backbone as bb
from common import checkpoint as ck
from common import data
from common import shapes as world
from eval import evaluate as ev
from eval.readers import read_any, read_jsonl
from helpers import error_of

CONV = [{"from": "human", "value": "<image>\nIs there a red circle?"}, {"from": "gpt", "value": "Answer: yes"}]


def _png_header_only(path, w, h):
    """A PNG whose header declares w x h pixels and whose pixel data is a few bytes: what a
    decompression bomb looks like to a reader (tiny file, huge image)."""
    chunk = lambda kind, body: (struct.pack(">I", len(body)) + kind + body
                                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


def _llava(path, image, rid="r1"):
    path.write_text(json.dumps([{"id": rid, "image": image, "conversations": CONV}]))
    return str(path)


# ----------------------------------------------------------------------------- images

@pytest.mark.parametrize("mode", ["L", "I;16", "RGBA", "LA", "P", "1x1"])
def test_image_modes_convert_and_go_through_the_processor(tmp_path, mode):
    """greyscale / 16-bit / alpha / palette / 1x1 images load as 8-bit RGB and the processor
    accepts them (1x1 is resized up to its minimum, 56 x 56 = 4 x 4 patches)."""
    p = tmp_path / "im.png"
    if mode == "I;16":
        a = np.zeros((28, 28), np.uint16)
        a[:, 14:] = 3000
        Image.fromarray(a).save(p)
    elif mode == "RGBA":   # left half: red, fully transparent; right half: opaque blue
        a = np.zeros((28, 28, 4), np.uint8)
        a[:, :14] = (255, 0, 0, 0)
        a[:, 14:] = (0, 0, 255, 255)
        Image.fromarray(a, "RGBA").save(p)
    elif mode == "LA":
        Image.new("LA", (28, 28), (10, 0)).save(p)
    elif mode == "P":
        Image.new("RGB", (28, 28), (0, 200, 0)).convert("P").save(p)
    elif mode == "1x1":
        Image.new("RGB", (1, 1), (255, 0, 0)).save(p)
    else:
        Image.new("L", (28, 28), 128).save(p)
    im = data.load_image(str(p), "r1")
    assert im.mode == "RGB"
    px = np.asarray(im)
    if mode == "I;16":
        assert px[0, 0, 0] == 0 and px[0, 27, 0] == 255        # rescaled, not clipped to black / white
    if mode == "RGBA":   # transparent pixels become the white background, not the hidden red
        assert tuple(px[0, 0]) == (255, 255, 255) and tuple(px[0, 27]) == (0, 0, 255)
    if mode == "LA":
        assert tuple(px[0, 0]) == (255, 255, 255)
    out = bb.build_image_processor()(images=[im], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]   # 28 x 28 and 1 x 1 both resized up to 56 x 56
    assert torch.isfinite(out["pixel_values"]).all()


@pytest.mark.parametrize("size", [(10000, 10000), (20000, 20000)])
def test_huge_image_is_refused_before_decoding(tmp_path, size):
    """10000 x 10000 (PIL only warns) and 20000 x 20000 (PIL's DecompressionBombError, not an
    OSError) both end in one DataError naming the size and the fix, at read time, without
    decoding a pixel."""
    (tmp_path / "images").mkdir()
    _png_header_only(tmp_path / "images" / "big.png", *size)
    assert os.path.getsize(tmp_path / "images" / "big.png") < 1000
    path = _llava(tmp_path / "d.json", "images/big.png")
    detail = "10000 x 10000 = 100 Mpx" if size[0] == 10000 else "400 Mpx"   # the latter from PIL's own refusal
    msg = (rf"record r1: image .*big.png is too large \({detail}\), above the 89 Mpx limit \(a possible "
           rf"decompression bomb\); downscale it first")
    with pytest.raises(data.DataError, match=msg):
        data.read_llava_json(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # and no DecompressionBombWarning on the way
        with pytest.raises(data.DataError, match=msg):
            data.load_image(str(tmp_path / "images" / "big.png"), "r1")


def test_extreme_aspect_ratio_fails_at_read_time(tmp_path):
    """1000 x 2 would pass the reader and then crash the Qwen processor mid-run with
    'absolute aspect ratio must be smaller than 200'."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (1000, 2)).save(tmp_path / "images" / "strip.png")
    with pytest.raises(data.DataError, match=r"record r1: image .*strip.png is 1000 x 2, aspect ratio above 200:1.*"
                                             r"crop or pad it"):
        data.read_llava_json(_llava(tmp_path / "d.json", "images/strip.png"))


def test_truncated_image_fails_the_read_time_check_although_its_header_is_intact(tmp_path):
    """A download cut short keeps its header: a header-only check passed it and the run
    stopped at its batch, after the model had loaded. check_image decodes the pixels."""
    p = tmp_path / "cut.png"
    a = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(a).save(p)
    p.write_bytes(p.read_bytes()[:400])                 # a download cut short
    with Image.open(p) as im:
        assert im.size == (64, 64)                      # header intact
    for check in (data.check_image, data.load_image):
        with pytest.raises(data.DataError, match=r"record r5: cannot read image .*cut.png \(OSError: .*truncated"):
            check(str(p), "r5")


def test_canonical_jsonl_checks_image_files_too(tmp_path):
    """read_jsonl used to check only existence: a 0-byte or junk image failed hours later."""
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "junk.png").write_bytes(b"<html>404</html>")
    for name, msg in (("empty.png", r"image .*empty.png is an empty \(0-byte\) file; re-export or drop"),
                      ("junk.png", r"cannot read image .*junk.png \(UnidentifiedImageError")):
        (tmp_path / "b.jsonl").write_text(json.dumps({"id": "q1", "image": name, "question": "?", "answer": "a"}))
        with pytest.raises(data.DataError, match=f"record q1: {msg}"):
            read_jsonl(str(tmp_path / "b.jsonl"))


# ----------------------------------------------------------------------------- records

def test_jsonl_bad_line_is_named_by_its_line_number(tmp_path):
    """Both readers name the file's line (json's own lineno is always 1 for a single line)."""
    good = json.dumps({"id": "a", "conversations": CONV})
    p = tmp_path / "d.jsonl"
    p.write_text(f"{good}\n\n{good}\n{{\"id\": \"b\", \"conversations\": [\n")
    for read in (data.read_llava_json, read_any):
        with pytest.raises(data.DataError, match=r"d.jsonl: line 4 is not valid JSON \(.*column.*one record per line"):
            read(str(p))


def test_bad_json_and_non_text_and_missing_fields(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('[{"id": "a",\n "conversations": [}]')
    with pytest.raises(data.DataError, match=r"d.json: not valid JSON \(line 2, column \d+: .*\); expected a list"):
        data.read_llava_json(str(p))
    Image.new("RGB", (4, 4)).save(tmp_path / "img.png")     # an image passed as --data
    with pytest.raises(data.DataError, match="img.png: not a UTF-8 text file; expected a JSON list or JSONL"):
        read_any(str(tmp_path / "img.png"))
    p.write_text(json.dumps([{"id": "r4", "image": "x.png"}]))
    with pytest.raises(data.DataError, match=r"record r4 has no valid 'conversations' list"):
        data.read_llava_json(str(p))


def test_empty_llava_file_is_an_error(tmp_path):
    for text in ("", "[]", "\n\n"):
        (tmp_path / "empty.json").write_text(text)
        with pytest.raises(data.DataError, match="empty.json: no records"):
            data.read_llava_json(str(tmp_path / "empty.json"))


def test_evaluate_refuses_bad_records_and_flags_before_loading(tmp_path, capsys):
    """--model points nowhere: each error below must come before the model is touched."""
    world.generate_split(str(tmp_path), "val", 2)
    d = str(tmp_path / "val.json")
    before = open(d).read()
    for flag, val, msg in (("--limit", "-1", "--limit: must be >= 0, got -1"),  # 0 = all, as in every script
                           ("--batch-size", "0", "--batch-size must be a positive integer, got 0"),
                           ("--max-new-tokens", "-5", "--max-new-tokens must be a positive integer, got -5")):
        with pytest.raises(SystemExit) as e:
            ev.main(["--model", "nowhere", "--data", d, flag, val])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit):                     # results would overwrite the data
        ev.main(["--model", "nowhere", "--data", d, "--out", d])
    assert "--out" in capsys.readouterr().err and open(d).read() == before
    for text in ("", "[]", "\n\n"):
        (tmp_path / "empty.json").write_text(text)
        with pytest.raises(data.DataError, match="empty.json: no records"):
            ev.main(["--model", "nowhere", "--data", str(tmp_path / "empty.json")])
    rec = json.loads(before)[0]  # several images: refused with the shared message (text-only is supported)
    rec["image"], rec["conversations"][0]["value"] = [rec["image"]] * 2, "<image><image>\nQ?"
    (tmp_path / "multi.json").write_text(json.dumps([rec]))
    with pytest.raises(data.DataError, match=r"eval.evaluate: 1 record\(s\) with several images, e.g. \['val_000000'\]"):
        ev.main(["--model", "nowhere", "--data", str(tmp_path / "multi.json")])
    assert not os.path.exists("out/eval/nowhere_val.json")


def test_evaluate_notes_unknown_families(tmp_path, capsys):
    """A family outside the shapes answer types is scored as free text: said once, with the
    near miss, and the run goes on."""
    world.generate_split(str(tmp_path), "val", 2)
    recs = json.loads((tmp_path / "val.json").read_text())
    recs[0]["family"], recs[1]["family"] = "Count", "ocr"
    (tmp_path / "fam.json").write_text(json.dumps(recs))
    out = tmp_path / "r.json"
    ev.main(["--model", "tiny-dense", "--data", str(tmp_path / "fam.json"), "--max-new-tokens", "2",
             "--no-loglik", "--out", str(out)])
    printed = capsys.readouterr().out
    assert ("note: family 'Count' is not one of existence, count, colour, spatial, mc: its answers are scored as "
            "free text (normalised exact match); did you mean 'count'?") in printed
    assert "note: family 'ocr' is not one of" in printed and json.loads(out.read_text())["results"]


# ----------------------------------------------------------------------------- checkpoints

def _ckpt(tmp_path, name="ck", weights=True):
    """A copy of the committed tiny-dense checkpoint (config, tokenizer, processor, weights)."""
    dst = tmp_path / name
    shutil.copytree(bb.TINY["tiny-dense"], dst, ignore=None if weights else shutil.ignore_patterns("*.safetensors"))
    return dst


def test_unsupported_architecture_and_unreadable_config(tmp_path):
    d = _ckpt(tmp_path, weights=False)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="bert")))
    with pytest.raises(bb.BackboneError, match=r"architecture 'bert' is not supported; supported VLMs: qwen2_5_vl, "
                                               r"qwen2_vl, qwen3_vl, qwen3_vl_moe"):
        bb.load_backbone(str(d))
    shutil.copy(bb.TINY["tiny-dense"] + "/model.safetensors", d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(bb.BackboneError, match=r"cannot read its config.json \(.*not a valid JSON file\)\. "
                                               r"Supported VLMs"):
        bb.load_backbone(str(d))
    (d / "config.json").write_text("{}")
    with pytest.raises(bb.BackboneError, match=r"cannot read its config.json \(.*model_type.*\)\. Supported VLMs"):
        bb.load_backbone(str(d))


def test_truncated_shard_is_named_and_left_alone(tmp_path):
    d = _ckpt(tmp_path)
    f = d / "model.safetensors"
    full = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(full // 2)
    with pytest.raises(bb.BackboneError, match=rf"{f}: truncated or corrupt safetensors file: {full // 2} bytes on "
                                               rf"disk, its header describes {full}; re-download or re-save it"):
        bb.load_backbone(str(d))
    assert f.stat().st_size == full // 2                   # the loader never writes to the checkpoint
    with open(f, "r+b") as fh:
        fh.truncate(5)                                     # not even a header
    with pytest.raises(bb.BackboneError, match=r"model.safetensors: not a complete safetensors file \(5 bytes"):
        bb.load_backbone(str(d))


def test_index_listing_a_missing_shard(tmp_path):
    d = _ckpt(tmp_path, weights=False)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(bb.BackboneError, match=r"index.json lists \['model-00001-of-00002.safetensors', "
                                               r"'model-00002-of-00002.safetensors'\] but they are not in .*"
                                               r"incomplete download"):
        bb.load_backbone(str(d))


def test_train_state_corruption_is_named_and_nothing_is_deleted(tmp_path):
    path = str(tmp_path / "run")
    lin = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    ck.save_train_state(path, dict(lin.named_parameters()), opt, {"step": 3})
    tensors, state = ck.load_train_state(path, torch.optim.AdamW(lin.parameters()))
    assert state == {"step": 3} and set(tensors) == {"weight", "bias"}
    w = os.path.join(path, "model.safetensors")
    size = os.path.getsize(w)
    with open(w, "r+b") as f:
        f.truncate(size - 3)
    with pytest.raises(ck.CheckpointError, match=rf"{w}: truncated or corrupt safetensors file"):
        ck.load_train_state(path)
    shutil.rmtree(path)
    ck.save_train_state(path, dict(lin.named_parameters()), opt, {"step": 3})
    with open(os.path.join(path, "optim.pt"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ck.CheckpointError, match=r"optim.pt: refused or unreadable .*weights_only=True.*"
                                                 r"model.safetensors and state.json are kept"):
        ck.load_train_state(path, torch.optim.AdamW(lin.parameters()))
    (tmp_path / "run" / "state.json").write_text('{"step": ')
    with pytest.raises(ck.CheckpointError, match=r"state.json: not valid JSON .*the checkpoint is corrupt"):
        ck.load_train_state(path)
    assert sorted(os.listdir(path)) == ["model.safetensors", "optim.pt", "state.json"]


def test_base_identity_tells_bases_of_one_config_apart_by_their_weights():
    dense, chat, moe = (bb.base_identity(bb.load_backbone(n)[0]) for n in ("tiny-dense", "tiny-chat", "tiny-moe"))
    assert bb.base_identity(bb.load_backbone("tiny-dense")[0]) == dense and bb.identity_mismatch(dense, dense) == []
    assert {k for k in dense if dense[k] != chat[k]} == {"weights", "name_or_path"}
    assert bb.identity_mismatch(dense, chat) == [f"same architecture and size, but the weights differ: embedding "
                                                 f"{dense['weights']} vs {chat['weights']}"]
    assert bb.identity_mismatch(dense, moe) == ["model_type 'qwen3_vl' vs 'qwen3_vl_moe'"]  # weights: nothing new
    assert bb.identity_mismatch({k: v for k, v in dense.items() if k != "weights"}, chat) == []  # recorded before


# ----------------------------------------------------------------------------- python -m common.shapes, readers

def _tree(root):
    """{relative path: bytes} of every file under root."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            out[os.path.relpath(os.path.join(d, f), root)] = open(os.path.join(d, f), "rb").read()
    return out


def test_data_cli_refuses_to_overwrite_a_dataset_and_checks_its_counts(tmp_path, capsys):
    d = tmp_path / "d"
    small = ["--n-train", "3", "--n-val", "1", "--n-test", "1"]
    for flag in ("--n-train", "--n-val", "--n-test"):          # nothing written, --out never created
        for bad in ("-5", "0"):
            err = error_of(world.main, ["--out", str(d), flag, bad], capsys)
            assert f"argument {flag}: must be >= 1, got {bad}" in err
    assert not d.exists()
    world.main(["--out", str(d)] + small)
    before = _tree(d)
    err = error_of(world.main, ["--out", str(d), "--n-train", "2", "--n-val", "2", "--n-test", "2"], capsys)
    assert err == (f"error: {d / 'train.json'} already exists and 7 more file(s) of a dataset; pass --overwrite to "
                   f"replace them, or choose another --out\n")
    assert _tree(d) == before
    user = tmp_path / "user"                                    # the user's own test.json only: refused too
    user.mkdir()
    (user / "test.json").write_text("my data")
    err = error_of(world.main, ["--out", str(user)] + small, capsys)
    assert f"error: {user / 'test.json'} already exists; pass --overwrite" in err
    assert _tree(user) == {"test.json": b"my data"}
    world.main(["--out", str(d), "--n-train", "1", "--n-val", "1", "--n-test", "1", "--overwrite"])
    assert len(json.loads((d / "train.json").read_text())) == 1
    assert sorted(os.listdir(d / "images")) == ["test_000000.png", "train_000000.png", "val_000000.png"]
    world.ensure_splits(str(user), {"test": 2})                 # ensure_splits still never overwrites
    assert (user / "test.json").read_text() == "my data"


def test_multi_image_records_and_non_text_turns_are_named(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    p = tmp_path / "multi.json"
    p.write_text(json.dumps([{"id": "m1", "image": ["a.png", "a.png"], "conversations": CONV}]))
    with pytest.raises(data.DataError, match=r"record m1 has 2 images but 1 '<image>' placeholders"):
        data.read_llava_json(str(p))
    p.write_text(json.dumps([{"id": "v1", "image": "a.png",
                              "conversations": [CONV[0], {"from": "gpt", "value": 5}]}]))
    with pytest.raises(data.DataError, match=r"record v1: turn 1 \('from': 'gpt'\) has a 'value' of type int \(5\); "
                                             r"every turn's value must be text"):
        data.read_llava_json(str(p))
    p.write_text(json.dumps([{"id": "i1", "image": 7, "conversations": CONV}]))
    with pytest.raises(data.DataError, match=r"record i1: 'image' must be a file path or a list of file paths "
                                             r"\(text\), got int 7"):
        data.read_llava_json(str(p))


def test_utf8_bom_is_skipped_in_json_and_jsonl(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    rec = {"id": "b1", "image": "a.png", "conversations": CONV}
    bom = "\ufeff"
    (tmp_path / "l.json").write_text(bom + json.dumps([rec]), encoding="utf-8")
    (tmp_path / "l.jsonl").write_text(bom + json.dumps(rec) + "\n", encoding="utf-8")
    (tmp_path / "c.jsonl").write_text(bom + json.dumps({"id": "c1", "image": "a.png", "question": "Is there a red "
                                                        "circle?", "answer": "yes"}) + "\n", encoding="utf-8")
    assert [r["id"] for r in data.read_llava_json(str(tmp_path / "l.json"))] == ["b1"]
    assert [r["id"] for r in data.read_llava_json(str(tmp_path / "l.jsonl"))] == ["b1"]
    assert [r["id"] for r in read_jsonl(str(tmp_path / "c.jsonl"))] == ["c1"]
    assert [r["id"] for r in read_any(str(tmp_path / "c.jsonl"))] == ["c1"]
    assert [r["id"] for r in data.read_records(str(tmp_path / "l.json"))] == ["b1"]


def test_data_path_that_is_a_directory(tmp_path):
    with pytest.raises(data.DataError, match=rf"^{tmp_path} is a directory; pass the JSON/JSONL file "
                                             rf"\(e.g. {tmp_path / 'train.json'}\)$"):
        data.read_records(str(tmp_path))
    world.generate_split(str(tmp_path), "val", 1)                # suggests a split file that is there
    for read in (data.read_records, data.read_llava_json, read_any, read_jsonl):
        with pytest.raises(data.DataError, match=rf"^{tmp_path} is a directory; pass the JSON/JSONL file "
                                                 rf"\(e.g. {tmp_path / 'val.json'}\)$"):
            read(str(tmp_path))


def test_evaluate_checks_out_before_loading_and_leaves_no_temp_file(tmp_path, capsys):
    """--out a directory (or under a file): refused at once (--model nowhere is never reached);
    atomic_write_text removes its temp file when the rename fails."""
    world.generate_split(str(tmp_path), "val", 1)
    d = str(tmp_path / "val.json")
    (tmp_path / "res").mkdir()
    err = error_of(ev.main, ["--model", "nowhere", "--data", d, "--out", str(tmp_path / "res")], capsys)
    res = tmp_path / "res"
    assert f"error: --out {res} is a directory; give a file path, e.g. {res / 'results.json'}" in err
    err = error_of(ev.main, ["--model", "nowhere", "--data", d, "--out", d + "/r.json"], capsys)
    assert f"error: --out {d}/r.json: cannot create its folder {d}: {d} is a file, not a directory" in err
    with pytest.raises(IsADirectoryError):
        data.atomic_write_text(str(tmp_path / "res"), "x")
    assert sorted(os.listdir(tmp_path)) == ["images", "res", "val.json"] and os.listdir(tmp_path / "res") == []


def test_evaluate_user_errors_exit_with_status_2():
    """python -m eval.evaluate: `error: ...` without a traceback, status 2 as every other entry point."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "eval.evaluate", "--model", "nowhere", "--data", "no/such.json"],
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 2 and r.stderr == ("error: no/such.json: file not found; check the path (the toy shapes "
                                              "data, if that is what you want, is made by `python -m common.shapes "
                                              "--out DIR`)\n"), r.stderr


def test_atomic_save_file_leaves_no_temp_file_on_failure(tmp_path):
    target = tmp_path / "w.safetensors"
    target.mkdir()                                          # the rename fails
    with pytest.raises(OSError):
        ck.atomic_save_file({"a": torch.zeros(2)}, str(target))
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]


def test_load_backbone_falls_back_to_old_after_an_interrupted_save(tmp_path, capsys):
    shutil.copytree(bb.resolve("tiny-dense"), tmp_path / "base.old")  # killed between save_backbone's two renames
    model, _ = bb.load_backbone(str(tmp_path / "base"))
    assert model.config.model_type == "qwen3_vl"
    assert f"note: {tmp_path / 'base'} is missing; loading {tmp_path / 'base.old'}" in capsys.readouterr().err
