import json
import random

import pytest

from common import data
from common import answers
from common import shapes as world


def test_splits_are_seeded_and_distinct(tmp_path):
    a = world.generate_split(tmp_path / "a", "val", 20)
    b = world.generate_split(tmp_path / "b", "val", 20)
    c = world.generate_split(tmp_path / "c", "test", 20)
    strip = lambda rs: [(r["conversations"], r["family"]) for r in rs]
    assert strip(a) == strip(b)
    assert strip(a) != strip(c)
    assert (tmp_path / "a" / "images" / "val_000000.png").read_bytes() == \
        (tmp_path / "b" / "images" / "val_000000.png").read_bytes()


def test_describe_and_answers_are_consistent():
    scene = [world.Obj(0, "red", "circle", 10), world.Obj(4, "blue", "square", 13), world.Obj(8, "red", "square", 10)]
    assert world.describe(scene) == ("tl red circle tc empty tr empty ml empty mc blue square mr empty "
                                    "bl empty bc empty br red square")
    rng = random.Random(0)
    for _ in range(50):
        q, a = world.make_question(rng, scene, "count")
        if "squares" in q:
            assert a == "2"
        elif "circles" in q:
            assert a == "1"
        elif "triangles" in q:
            assert a == "0"
    for _ in range(20):
        q, a = world.make_question(rng, scene, "colour")  # circle is the only unique shape
        assert (q, a) == ("What colour is the circle?", "red")
        q, a = world.make_question(rng, scene, "spatial") or ("", "")
        if q == "Is the red circle to the left of the blue square?":
            assert a == "yes"
        if q == "Is the red square above the red circle?":
            assert a == "no"


def test_existence_has_adversarial_negatives_and_is_balanced():
    rng = random.Random(1)
    answers, adversarial = [], 0
    for _ in range(2000):
        scene = world.sample_scene(rng)
        q, a = world.make_question(rng, scene, "existence")
        answers.append(a)
        asked = q[len("Is there a "):-1]
        if a == "no":
            assert asked not in {o.name for o in scene}
            colour, shape = asked.split()
            adversarial += any(o.colour == colour or o.shape == shape for o in scene)
    assert 0.45 < answers.count("yes") / len(answers) < 0.6
    assert adversarial > 300


def test_mc_has_four_lettered_options_one_correct():
    rng = random.Random(2)
    for _ in range(100):
        scene = world.sample_scene(rng)
        q, a = world.make_question(rng, scene, "mc")
        assert all(f"{L}. " in q for L in "ABCD") and a in "ABCD"
        chosen = q.split(f"{a}. ")[1].split(" ")[:2]
        assert " ".join(chosen) in {o.name for o in scene}


def test_final_answer():
    assert answers.final_answer("tl red circle, tc empty. Answer: yes") == "yes"
    assert answers.final_answer('{"Reasoning": "x", "Answer": "B"}') == "B"
    assert answers.final_answer("3") == "3"


def test_reader_errors_name_the_record(tmp_path):
    (tmp_path / "images").mkdir()
    good = {"id": "r1", "image": "images/x.png", "conversations": [
        {"from": "human", "value": "<image>\nQ?"}, {"from": "gpt", "value": "A"}]}
    world.render([]).save(tmp_path / "images" / "x.png")
    p = tmp_path / "d.json"
    p.write_text(json.dumps([good]))
    r = data.read_llava_json(str(p))[0]
    assert (r["question"], r["answer"]) == ("Q?", "A")

    p.write_text(json.dumps([good, {"id": "r2", "conversations": [{"from": "human", "value": "Q"}]}]))
    with pytest.raises(data.DataError, match="r2.*'gpt'"):
        data.read_llava_json(str(p))
    p.write_text(json.dumps([{**good, "id": "r3", "image": "images/missing.png"}]))
    with pytest.raises(data.DataError, match="r3.*not found"):
        data.read_llava_json(str(p))
    p.write_text("[{not json")
    with pytest.raises(data.DataError, match="not valid JSON"):
        data.read_llava_json(str(p))
    (tmp_path / "images" / "bad.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(data.DataError, match="r9.*cannot read image"):
        data.load_image(str(tmp_path / "images" / "bad.png"), "r9")


def test_marks_flag_the_cells_the_question_is_about():
    scene = [world.Obj(0, "red", "circle", 10), world.Obj(4, "blue", "square", 13), world.Obj(8, "red", "square", 10)]
    m = lambda q: " ".join(world.marks(scene, q))
    assert m("Is there a red circle?") == "+ - - - - - - - -"
    assert m("Is there a green circle?") == "- - - - - - - - -"
    assert m("How many squares are there?") == "- - - - + - - - +"
    assert m("How many red shapes are there?") == "+ - - - - - - - +"
    assert m("What colour is the circle?") == "+ - - - - - - - -"
    assert m("Is the red square above the red circle?") == "2tl - - - - - - - 1br"
    assert m("Which object is at the middle center? A. red circle B. blue square C. x D. y Answer with the letter."
             ) == "- - - - B - - - -"
    assert world.target_text(scene, "yes", "Is there a red circle?") == (
        "tl red circle + tc empty - tr empty - ml empty - mc blue square - mr empty - bl empty - bc empty - "
        "br red square -. Answer: yes")


def test_bad_images_fail_at_read_time_and_16bit_is_rescaled(tmp_path):
    import numpy as np
    from PIL import Image
    (tmp_path / "images").mkdir()
    conv = [{"from": "human", "value": "<image>\nQ?"}, {"from": "gpt", "value": "A"}]
    (tmp_path / "images" / "empty.png").write_bytes(b"")
    (tmp_path / "images" / "junk.png").write_bytes(b"not an image at all")
    for name, msg in (("empty.png", "0-byte"), ("junk.png", "cannot read image")):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps([{"id": "r7", "image": f"images/{name}", "conversations": conv}]))
        with pytest.raises(data.DataError, match=f"r7.*{msg}"):
            data.read_llava_json(str(p))
    a = np.zeros((8, 8), dtype=np.uint16)
    a[:, 4:] = 1000  # a dim 16-bit image: half 0, half 1000 of 65535
    Image.fromarray(a).save(tmp_path / "images" / "g16.png")
    rgb = np.asarray(data.load_image(str(tmp_path / "images" / "g16.png")))
    assert rgb.shape == (8, 8, 3) and rgb[0, 0, 0] == 0 and rgb[0, 7, 0] == 255


def test_a_csv_file_is_named_as_such(tmp_path):
    """A reported gap: a CSV got "line 1 is not valid JSON"; it is now named, with the converter to use."""
    f = tmp_path / "bench.csv"
    f.write_text("question,answer\nwhat?,yes\n")
    with pytest.raises(data.DataError, match=r"bench.csv: a CSV file; records are read from a JSON list or JSONL"):
        data.load_records(str(f))
