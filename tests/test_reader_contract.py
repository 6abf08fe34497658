"""The one reader contract (eval/README.md, "One reader contract"), tested once per reader:
LLaVA JSON, LLaVA JSONL, canonical JSONL and eval.convert's output. Every reader refuses
duplicate ids (multi-turn item ids included), reads both role vocabularies, refuses a gold
answer that is not text, and says what it changed with a count."""
import base64
import io
import json
import os

import pytest
from PIL import Image

from common.data import DataError, expand_turns, read_any, read_jsonl, read_llava_json
from eval.convert import convert
from helpers import error_of

READERS = {"llava_json": read_llava_json, "llava_jsonl": read_llava_json, "canonical": read_jsonl}


def write(tmp_path, kind, records, name="d"):
    """Records as a file of `kind` (json: one list; jsonl / canonical: one record per line)."""
    img = tmp_path / "a.png"
    if not img.exists():
        Image.new("RGB", (28, 28), "red").save(img)
    if kind == "llava_json":
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(records))
    else:
        p = tmp_path / f"{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(p)


def rec(kind, rid, q="Is it red?", a="yes", image="a.png", **extra):
    """One record of `kind` asking q with gold a."""
    if kind == "canonical":
        return dict({"id": rid, "image": image, "question": q, "answer": a}, **extra)
    return dict({"id": rid, "image": image, "conversations": [{"from": "human", "value": "<image>\n" + q},
                                                              {"from": "gpt", "value": a}]}, **extra)


@pytest.mark.parametrize("kind", READERS)
def test_duplicate_ids_are_refused(kind, tmp_path):
    p = write(tmp_path, kind, [rec(kind, "dup", a="yes"), rec(kind, "dup", a="no")])
    with pytest.raises(DataError, match="record dup: duplicate id"):
        READERS[kind](p)


@pytest.mark.parametrize("kind", ["llava_json", "llava_jsonl"])
def test_a_record_id_equal_to_a_multi_turn_item_id_is_refused(kind, tmp_path):
    """Record `a` with two turns answers as a#1, a#2: a record "a#1" would take its first item's
    results (a#1, a#2, a#1)."""
    two = {"id": "a", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nIs it red?"}, {"from": "gpt", "value": "yes"},
        {"from": "human", "value": "Is it blue?"}, {"from": "gpt", "value": "no"}]}
    p = write(tmp_path, kind, [two, rec(kind, "a#1")])
    with pytest.raises(DataError, match=r"record a#1: item id 'a#1' is taken twice \(also record a"):
        read_llava_json(p)
    ok = write(tmp_path, kind, [two, rec(kind, "b")], name="ok")
    assert [r["id"] for r in expand_turns(read_llava_json(ok))] == ["a#1", "a#2", "b"]


@pytest.mark.parametrize("kind", ["llava_json", "llava_jsonl"])
def test_both_role_vocabularies_keep_every_turn(kind, tmp_path, capsys):
    """user / assistant (ShareGPT) read as human / gpt: two items, none lost; a system turn is left
    out with a counted note; an unknown role is refused by name."""
    conv = [{"from": "system", "value": "Be brief."},
            {"from": "user", "value": "<image>\nIs it red?"}, {"from": "assistant", "value": "yes"},
            {"from": "human", "value": "Is it blue?"}, {"from": "gpt", "value": "no"}]
    p = write(tmp_path, kind, [{"id": "u", "image": "a.png", "conversations": conv}])
    capsys.readouterr()
    items = expand_turns(read_llava_json(p))
    assert [(r["question"], r["answer"]) for r in items] == [("Is it red?", "yes"), ("Is it blue?", "no")]
    assert items[0]["conversations"][0] == {"from": "human", "value": "<image>\nIs it red?"}
    assert "1 'system' turn(s) left out" in capsys.readouterr().err
    bad = write(tmp_path, kind, [{"id": "b", "image": "a.png", "conversations": [
        {"from": "bot", "value": "hi"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}], name="bad")
    with pytest.raises(DataError, match=r"record b: turn role\(s\) \['bot'\] are not known"):
        read_llava_json(bad)


def test_openai_messages_stay_refused_with_their_message(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"id": "m", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match="'messages' is the OpenAI chat format: rename it 'conversations'"):
        read_any(str(p))


def test_role_content_turns_get_the_rename(tmp_path):
    """'conversations' holding OpenAI-style {'role','content'} turns: refused with the rename."""
    p = tmp_path / "rc.jsonl"
    p.write_text(json.dumps({"id": "r", "image": "a.png", "conversations": [
        {"role": "user", "content": "<image>\nQ?"}, {"role": "assistant", "content": "yes"}]}) + "\n")
    with pytest.raises(DataError, match="rename each turn's 'role' / 'content' to 'from' / 'value'"):
        read_any(str(p))


@pytest.mark.parametrize("kind", READERS)
@pytest.mark.parametrize("answer", [True, {"text": "yes"}, [["yes"]]])
def test_non_text_gold_answers_are_refused(kind, answer, tmp_path):
    r = rec(kind, "t")
    r["answer"] = answer
    with pytest.raises(DataError, match="record t: 'answer' must be a text"):
        READERS[kind](write(tmp_path, kind, [r]))


def test_llava_gold_answer_beside_the_conversation_follows_the_canonical_rules(tmp_path):
    p = write(tmp_path, "llava_json", [rec("llava_json", "n", a="There are 3.", answer=3),
                                       rec("llava_json", "l", answer=["1986", "1986."])])
    assert [r["answer"] for r in read_llava_json(p)] == ["3", ["1986", "1986."]]


@pytest.mark.parametrize("kind", READERS)
def test_stripped_placeholders_are_counted(kind, tmp_path, capsys):
    """Two <image> tags with one image: both removed, the image shown once, and a note says so;
    a text-only record's tag likewise."""
    q2 = "<image>\n<image>\nIs it red?" if kind == "canonical" else "<image>\nIs it red?"
    recs = [rec(kind, "two", q=q2), rec(kind, "plain")]
    if kind != "canonical":
        recs[0]["conversations"][0]["value"] = "<image>\n<image>\nIs it red?"
    text_only = rec(kind, "txt", q="<image> What is 2+2?", a="4", image=None)
    if kind != "canonical":
        text_only["conversations"][0]["value"] = "<image> What is 2+2?"
    capsys.readouterr()
    out = READERS[kind](write(tmp_path, kind, recs + [text_only]))
    assert [r["question"] for r in out] == ["Is it red?", "Is it red?", "What is 2+2?"]
    err = capsys.readouterr().err
    assert "1 record(s) with one image but several '<image>' placeholders" in err
    assert "1 text-only record(s) with '<image>' placeholders: removed" in err
    capsys.readouterr()
    READERS[kind](write(tmp_path, kind, [rec(kind, "plain")], name="clean"))
    assert "note:" not in capsys.readouterr().err        # nothing changed, nothing said


def test_converter_output_follows_the_contract(tmp_path, capsys):
    """eval.convert refuses what the readers refuse (duplicate ids) before writing anything, counts
    the rows --require-image leaves out, and its output reads back through read_jsonl."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buf, "PNG")
    img = {"bytes": base64.b64encode(buf.getvalue()).decode(), "path": None}
    rows = [{"question_id": 1, "question": "Is there a cat?", "answer": "yes", "image": img},
            {"question_id": 2, "question": "Is there a dog?", "answer": "no", "image": None}]
    src, out = tmp_path / "pope.jsonl", str(tmp_path / "out.jsonl")
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    convert("pope", str(src), out, require_image=True)
    assert "1 row(s) without an image left out (--require-image)" in capsys.readouterr().err
    assert [r["id"] for r in read_jsonl(out)] == ["1"]
    dup = tmp_path / "dup.jsonl"
    dup.write_text("".join(json.dumps(dict(r, question_id=1)) + "\n" for r in rows))
    with pytest.raises(ValueError, match="duplicate id '1'"):
        convert("pope", str(dup), str(tmp_path / "dup_out.jsonl"))
    assert not os.path.exists(tmp_path / "dup_out.jsonl")


def test_mod_infer_misled_refuses_duplicate_ids_before_loading(tmp_path, capsys):
    """Two records "dup" (gold yes / no): `--methods misled` looked the misleading prior up by id,
    so the first was misled with its own answer. Now the read refuses them, before the model."""
    from mod import infer as minfer
    p = write(tmp_path, "llava_json", [rec("llava_json", "dup", a="yes"), rec("llava_json", "dup", a="no")])
    err = error_of(minfer.main, ["--model", str(tmp_path / "no-such-model"), "--data", p, "--methods", "misled", "--adapter", str(tmp_path / "no-such-adapter"),
                                 "--out", str(tmp_path / "r.json")], capsys)
    assert "record dup: duplicate id" in err and "no-such-model" not in err


def test_limit_cuts_before_any_image_is_decoded(tmp_path, monkeypatch):
    """--limit N decodes only the first N records' images (a first look at a large file was as slow
    as reading all of it): the image check sees N records, for both formats."""
    from common import data
    seen = []
    monkeypatch.setattr(data, "check_record_images", lambda recs, path, skip_bad=False: seen.append(len(recs)) or recs)
    rows = [{"id": f"q{i}", "image": f"{i}.png", "question": "Is it red?", "answer": "yes"} for i in range(5)]
    jl = tmp_path / "b.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    lj = tmp_path / "l.json"
    lj.write_text(json.dumps([{"id": f"l{i}", "image": f"{i}.png", "conversations": [
        {"from": "human", "value": "<image>\nIs it red?"}, {"from": "gpt", "value": "yes"}]} for i in range(5)]))
    for f, first in ((jl, ["q0", "q1"]), (lj, ["l0", "l1"])):
        assert [r["id"] for r in data.read_records(str(f), limit=2)] == first
        assert len(data.read_records(str(f))) == 5
    assert seen == [2, 5, 2, 5]
