"""The shapes world's size family and answer-only targets (the MoLE headroom and positive-control data)."""
import json
import random

import pytest

from common import shapes as world

SCENE = [world.Obj(0, "red", "circle", 10), world.Obj(4, "blue", "square", 13), world.Obj(8, "blue", "square", 10)]


def test_size_questions_have_hand_computed_answers():
    seen = {}
    for seed in range(200):
        qa = world.make_question(random.Random(seed), SCENE, "size")
        if qa is not None:
            seen[qa[0]] = qa[1]
    # the two blue squares share a name, so only the red circle is asked about by name
    assert seen == {"Is the red circle big?": "no", "Is the red circle small?": "yes",
                    "How many big shapes are there?": "1", "How many small shapes are there?": "2"}
    # no uniquely named object: the by-name form cannot be asked, the count form still can
    twins = [world.Obj(0, "red", "circle", 10), world.Obj(1, "red", "circle", 13)]
    assert {world.make_question(random.Random(s), twins, "size") for s in range(50)} == {
        None, ("How many big shapes are there?", "1"), ("How many small shapes are there?", "1")}


def test_size_marks_flag_the_asked_object_or_the_asked_size():
    m = lambda q: " ".join(world.marks(SCENE, q))
    assert m("Is the red circle big?") == "+ - - - - - - - -"
    assert m("Is the red circle small?") == "+ - - - - - - - -"
    assert m("How many big shapes are there?") == "- - - - + - - - -"
    assert m("How many small shapes are there?") == "+ - - - - - - - +"
    # the families it must not swallow keep their own marks
    assert m("Is the blue square above the red circle?") == "2tl - - - 1mc - - - 1br"
    assert m("How many blue shapes are there?") == "- - - - + - - - +"


def test_generate_split_families_and_answer_only_targets(tmp_path):
    recs = world.generate_split(str(tmp_path), "val", 40, families=("size",), look=False)
    assert {r["family"] for r in recs} == {"size"}
    for r in recs:
        q = r["conversations"][0]["value"]
        assert r["conversations"][1]["value"] == f"Answer: {r['answer']}"
        assert q.endswith((" big?", " small?")) or q.startswith("<image>\nHow many ")
        assert r["answer"] in {"yes", "no", "0", "1", "2", "3", "4"}
    both = world.generate_split(str(tmp_path / "b"), "val", 40, families=("size", "colour"))
    assert {r["family"] for r in both} == {"size", "colour"}
    assert all(" Answer: " in r["conversations"][1]["value"] for r in both)  # look step, then the answer
    with open(tmp_path / "val.json") as f:
        assert json.load(f) == recs
    with pytest.raises(ValueError, match="unknown families.*'sise'"):
        world.generate_split(str(tmp_path), "val", 4, families=("sise",))


def test_default_splits_never_draw_the_extra_families(tmp_path):
    recs = world.generate_split(str(tmp_path), "train", 60)
    assert {r["family"] for r in recs} <= set(world.FAMILIES)
    assert not set(world.EXTRA_FAMILIES) & set(world.FAMILIES)
