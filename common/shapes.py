"""The synthetic "shapes" world: scenes, images, questions, targets and the seeded splits.

An image is a 3x3 grid of 28x28 cells (84x84 px, black background). With patch 14 and
2x2 spatial merge each cell is exactly one merged visual token, so the tiny models can
learn the world from scratch on CPU (see README, "How the tiny base models learn").
Each of 1-4 objects (circle / square / triangle, 4 colours, 2 sizes) sits in its own cell.

Five question families mirror the papers' benchmarks (the tiny bases are pretrained on them):

    existence  yes/no     "Is there a red circle?"      (POPE-like; half the negatives adversarial)
    count      number     "How many circles are there?"
    colour     open word  "What colour is the square?"  (the asked shape is unique)
    spatial    yes/no     "Is the red circle to the left of the blue square?"
    mc         letter     "Which object is at the top left? A. ... B. ... C. ... D. ..."

One more family (`EXTRA_FAMILIES`, never in the default splits) asks for a fine detail that
the look step does not transcribe, the object's size (half-extent 10 px = small, 13 px = big):
    size       yes/no     "Is the red circle big?" / number "How many small shapes are there?"
`generate_split(..., families=, look=False)` writes other task mixes, and answer-only targets
("Answer: red") for the stage-1 bottleneck experiments.

Answers "look, then answer": the target lists every cell with its content and a mark saying
whether the question is about it (`marks`), then the answer:
    "tl red circle + tc empty - ... br empty -. Answer: yes"
`final_answer` extracts the part after "Answer:". Records are written as
images + LLaVA-style conversation JSON, the format real instruction data uses, so
`read_llava_json` serves both.

    python -m common.shapes --out out/data        # train / val / test images + LLaVA JSON
"""
import hashlib
import json
import os
import random
import re
from dataclasses import dataclass

from PIL import Image, ImageDraw

from common.cli import fail, number, entry_parser
from common.data import atomic_write_text

COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 240), "yellow": (235, 220, 40)}
SHAPES = ("circle", "square", "triangle")
ROWS, COLS = ("top", "middle", "bottom"), ("left", "center", "right")
CELL_TAGS = [r[0] + c[0] for r in ROWS for c in COLS]  # tl tc tr ml mc mr bl bc br
OBJECT_NAMES = [f"{c} {s}" for c in COLOURS for s in SHAPES]  # the 12 objects, "red circle", ...
CELL = 28
GRID = 3
IMAGE_SIZE = CELL * GRID
FAMILIES = ("existence", "count", "colour", "spatial", "mc")
EXTRA_FAMILIES = ("size",)  # not in the default splits: the MoLE headroom experiment (eval/logs/mole.md)
SIZE_WORDS = {10: "small", 13: "big"}  # Obj.size (half-extent, px) -> the word the size family uses
LETTERS = "ABCD"


@dataclass(frozen=True)
class Obj:
    cell: int  # 0..8, raster order
    colour: str
    shape: str
    size: int  # half-extent in px

    @property
    def name(self):
        return f"{self.colour} {self.shape}"

    @property
    def row(self):
        return self.cell // GRID

    @property
    def col(self):
        return self.cell % GRID


def sample_scene(rng, min_objects=1, max_objects=4):
    """Random scene: a list of `Obj` in distinct cells, sorted by cell."""
    n = rng.randint(min_objects, max_objects)
    cells = sorted(rng.sample(range(GRID * GRID), n))
    return [Obj(c, rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice((10, 13))) for c in cells]


def render(scene):
    """Draw a scene -> RGB PIL image of IMAGE_SIZE x IMAGE_SIZE."""
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (0, 0, 0))
    d = ImageDraw.Draw(img)
    for o in scene:
        cx, cy, s = o.col * CELL + CELL // 2, o.row * CELL + CELL // 2, o.size
        fill = COLOURS[o.colour]
        if o.shape == "circle":
            d.ellipse([cx - s, cy - s, cx + s, cy + s], fill=fill)
        elif o.shape == "square":
            d.rectangle([cx - s + 2, cy - s + 2, cx + s - 2, cy + s - 2], fill=fill)
        else:
            d.polygon([(cx, cy - s), (cx - s, cy + s - 1), (cx + s, cy + s - 1)], fill=fill)
    return img


def describe(scene):
    """The scene as text, every cell in raster order: 'tl red circle tc empty ...'."""
    by_cell = {o.cell: o.name for o in scene}
    return " ".join(f"{CELL_TAGS[c]} {by_cell.get(c, 'empty')}" for c in range(GRID * GRID))


def _unique(scene, key):
    counts = {}
    for o in scene:
        counts[key(o)] = counts.get(key(o), 0) + 1
    return [o for o in scene if counts[key(o)] == 1]


def make_question(rng, scene, family):
    """One (question, answer) of `family` about `scene`, or None if the scene cannot host it."""
    names = {o.name for o in scene}
    if family == "existence":
        if rng.random() < 0.5:
            o = rng.choice(scene)
            return f"Is there a {o.name}?", "yes"
        if rng.random() < 0.5:  # adversarial: a present shape in an absent colour or vice versa
            o = rng.choice(scene)
            cands = [f"{c} {o.shape}" for c in COLOURS] + [f"{o.colour} {s}" for s in SHAPES]
        else:
            cands = list(OBJECT_NAMES)
        cands = [c for c in cands if c not in names]
        return (f"Is there a {rng.choice(cands)}?", "no") if cands else None
    if family == "count":
        if rng.random() < 0.5:
            s = rng.choice(SHAPES)
            return f"How many {s}s are there?", str(sum(o.shape == s for o in scene))
        c = rng.choice(list(COLOURS))
        return f"How many {c} shapes are there?", str(sum(o.colour == c for o in scene))
    if family == "colour":
        u = _unique(scene, lambda o: o.shape)
        if not u:
            return None
        o = rng.choice(u)
        return f"What colour is the {o.shape}?", o.colour
    if family == "spatial":
        u = _unique(scene, lambda o: o.name)
        if len(u) < 2:
            return None
        a, b = rng.sample(u, 2)
        if rng.random() < 0.5:
            if a.col == b.col:
                return None
            return f"Is the {a.name} to the left of the {b.name}?", "yes" if a.col < b.col else "no"
        if a.row == b.row:
            return None
        return f"Is the {a.name} above the {b.name}?", "yes" if a.row < b.row else "no"
    if family == "mc":
        o = rng.choice(scene)
        others = [n for n in OBJECT_NAMES if n != o.name]
        opts = rng.sample(others, 3) + [o.name]
        rng.shuffle(opts)
        listed = " ".join(f"{L}. {t}" for L, t in zip(LETTERS, opts))
        q = f"Which object is at the {ROWS[o.row]} {COLS[o.col]}? {listed} Answer with the letter."
        return q, LETTERS[opts.index(o.name)]
    if family == "size":
        if rng.random() < 0.5:
            u = _unique(scene, lambda o: o.name)
            if not u:
                return None
            o, w = rng.choice(u), rng.choice(sorted(SIZE_WORDS.values()))
            return f"Is the {o.name} {w}?", "yes" if SIZE_WORDS[o.size] == w else "no"
        w = rng.choice(sorted(SIZE_WORDS.values()))
        return f"How many {w} shapes are there?", str(sum(SIZE_WORDS[o.size] == w for o in scene))
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES + EXTRA_FAMILIES}")


def marks(scene, question):
    """Per-cell marks the base models write after each cell's content: which cells the
    question is about. One string per cell (raster order):

        existence "Is there a red circle?"       "+" where the cell holds a red circle, else "-"
        count     "How many circles / red shapes" "+" where the cell matches, else "-"
        colour    "What colour is the square?"    "+" where the cell holds a square, else "-"
        spatial   "Is the A ... the B?"           "1tl" / "2mc" (object 1 or 2 and its cell), else "-"
        mc        "Which object is at the top left? A. .. B. .."  the matching option's letter
                  at the asked cell, else "-"
        size      "Is the red circle big?"          "+" at the named object, else "-";
                  "How many big shapes are there?"  "+" where the object has that size, else "-"
    Each mark compares the content just written with one place in the question (a local,
    one-hop step for a 4-layer model), and the answer then reads the marks (see README)."""
    by_cell = {o.cell: o for o in scene}
    cells = range(GRID * GRID)
    pm = lambda pred: ["+" if c in by_cell and pred(by_cell[c]) else "-" for c in cells]
    m = re.fullmatch(r"Is the (.+) (big|small)\?", question)
    if m:  # before spatial's "Is the "
        return pm(lambda o: o.name == m.group(1))
    m = re.fullmatch(r"How many (big|small) shapes are there\?", question)
    if m:  # before count's "How many ... shapes" (a colour)
        return pm(lambda o: SIZE_WORDS[o.size] == m.group(1))
    if question.startswith("Is there a "):
        name = question[len("Is there a "):-1]
        return pm(lambda o: o.name == name)
    if question.startswith("How many "):
        what = question[len("How many "):].split(" are there")[0]  # "circles" / "red shapes"
        if what.endswith(" shapes"):
            return pm(lambda o: o.colour == what.split()[0])
        return pm(lambda o: o.shape + "s" == what)
    if question.startswith("What colour is the "):
        shape = question[len("What colour is the "):-1]
        return pm(lambda o: o.shape == shape)
    if question.startswith("Is the "):
        found = sorted((question.index(f"the {n} " if f"the {n} " in question else f"the {n}?"), n)
                       for n in OBJECT_NAMES if f"the {n} " in question or f"the {n}?" in question)
        order = {n: str(k + 1) for k, (_, n) in enumerate(found)}
        return [order[by_cell[c].name] + CELL_TAGS[c] if c in by_cell and by_cell[c].name in order else "-"
                for c in cells]
    if question.startswith("Which object is at the "):
        r, c = question[len("Which object is at the "):].split("?")[0].split()
        cell = ROWS.index(r) * GRID + COLS.index(c)
        opts = dict((t[1], t[0]) for t in (o.split(". ", 1) for o in question.split("? ", 1)[1].split(" Answer")[0]
                                           .replace(" A. ", "|A. ").replace(" B. ", "|B. ").replace(" C. ", "|C. ")
                                           .replace(" D. ", "|D. ").lstrip("|").split("|")))
        return [opts.get(by_cell[k].name, "-") if k == cell and k in by_cell else "-" for k in cells]
    return ["-"] * len(cells)


def mark_tokens():
    """Words the tokenizer keeps whole: object names, option texts and spatial marks."""
    return (OBJECT_NAMES + [f"{L}. {n}" for L in LETTERS for n in OBJECT_NAMES]
            + [f"{k}{t}" for k in "12" for t in CELL_TAGS])


def target_text(scene, answer, question=""):
    """The assistant turn the base models are trained on: look (every cell with its content and
    its mark for `question`), then answer:
        "tl red circle + tc empty - ... br empty -. Answer: yes"."""
    by_cell = {o.cell: o.name for o in scene}
    cells = " ".join(f"{CELL_TAGS[c]} {by_cell.get(c, 'empty')} {m}" for c, m in enumerate(marks(scene, question)))
    return f"{cells}. Answer: {answer}"


def short_target_text(scene, answer, question=""):
    """The short look step (the RoleMerge base with the paper's structure): only the occupied
    cells, each with its content and its mark for `question`, then the answer:
        "tl red circle + br blue square -. Answer: yes" (1-4 objects: ~5-20 tokens, against
    ~36 for `target_text`'s nine cells)."""
    by_cell = {o.cell: o.name for o in scene}
    cells = " ".join(f"{CELL_TAGS[c]} {by_cell[c]} {m}" for c, m in enumerate(marks(scene, question)) if c in by_cell)
    return f"{cells}. Answer: {answer}"


def short_look(look):
    """A record's full look step (its "scene" field, `target_text` before " Answer:") -> the short
    one of `short_target_text` before " Answer:": "tl red circle + tc empty - ... br empty -." ->
    "tl red circle +." Raises ValueError on text that is not a nine-cell look step."""
    words, out, i = look.rstrip(".").split(), [], 0
    for tag in CELL_TAGS:
        if i >= len(words) or words[i] != tag:
            raise ValueError(f"not a nine-cell look step (expected {tag!r} at word {i}): {look!r}")
        if words[i + 1] == "empty":
            i += 3
        else:
            out.append(" ".join(words[i:i + 4]))
            i += 4
    if i != len(words):
        raise ValueError(f"not a nine-cell look step (extra words after br): {look!r}")
    return " ".join(out) + "."


def sample_example(rng, families=FAMILIES):
    """(scene, family, question, answer) with a uniformly chosen family; resamples scenes
    until the family fits (spatial needs two uniquely named objects, etc.)."""
    family = rng.choice(families)
    while True:
        scene = sample_scene(rng, 2 if family == "spatial" else 1)
        qa = make_question(rng, scene, family)
        if qa is not None:
            return scene, family, qa[0], qa[1]


SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2}


def split_of(scene, question):
    """The split an (image, question) pair belongs to, fixed by a hash of the scene (every
    object's cell, colour, shape and size: the image) and the question: "test" for 1 pair in
    10, "val" for 1 in 10, else "train". `generate_split` keeps only its own split's pairs, so
    train / val / test never share a pair, whatever their sizes and seeds."""
    key = json.dumps([[o.cell, o.colour, o.shape, o.size] for o in scene] + [question])
    h = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % 10
    return "test" if h == 0 else "val" if h == 1 else "train"


def generate_split(out_dir, split, n, seed=None, overwrite=False, families=FAMILIES, look=True):
    """Write `n` examples of `split` to out_dir/{split}.json + out_dir/images/{split}_*.png.

    families: the question families drawn from (uniformly; any of FAMILIES + EXTRA_FAMILIES).
    look: the target is the look step then the answer (`target_text`, what the tiny bases are
    pretrained on); False: the answer only, "Answer: red" (so the answer is the only place
    where the image has to reach the text). Raises ValueError for an unknown family.

    Disjoint by construction: only (image, question) pairs whose `split_of` is `split` are
    kept, so no pair of one split appears in another. Seeded: the same (split, n, seed) gives the same files. Written atomically
    (temp file + rename). An existing image of the same name is kept (the same seed draws
    the same scene) unless `overwrite`, which also redraws them and removes this split's
    images numbered n and above (left by a larger earlier run). Returns the list of records."""
    bad = [f for f in families if f not in FAMILIES + EXTRA_FAMILIES]
    if bad or not families:
        raise ValueError(f"unknown families {bad or families!r}; choose from {FAMILIES + EXTRA_FAMILIES}")
    rng = random.Random(SPLIT_SEEDS[split] * 1_000_003 + (seed or 0))
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    if overwrite:
        for f in _split_images(out_dir, split):
            if int(f[len(split) + 1:-4]) >= n:
                os.remove(os.path.join(out_dir, "images", f))
    records = []
    for i in range(n):
        scene, family, q, a = sample_example(rng, families)
        while split_of(scene, q) != split:
            scene, family, q, a = sample_example(rng, families)
        name = f"images/{split}_{i:06d}.png"
        path = os.path.join(out_dir, name)
        if overwrite or not os.path.exists(path):
            render(scene).save(path + ".tmp.png")
            os.replace(path + ".tmp.png", path)
        records.append({
            "id": f"{split}_{i:06d}", "image": name, "family": family, "answer": a,
            "scene": target_text(scene, a, q).rsplit(" Answer:", 1)[0],  # the look step (marked scene)
            "conversations": [{"from": "human", "value": f"<image>\n{q}"},
                              {"from": "gpt", "value": target_text(scene, a, q) if look else f"Answer: {a}"}],
        })
    atomic_write_text(os.path.join(out_dir, f"{split}.json"), json.dumps(records, indent=1))
    return records


def _split_images(out_dir, split):
    """Names of the images `generate_split` writes for `split` that exist in out_dir/images."""
    d = os.path.join(out_dir, "images")
    pat = re.compile(rf"{re.escape(split)}_\d{{6}}\.png")
    return sorted(f for f in os.listdir(d) if pat.fullmatch(f)) if os.path.isdir(d) else []


def ensure_splits(data_dir, sizes):
    """Generate the shapes splits of `sizes` ({split: n}) that are missing in `data_dir`.

    Existing split files are never overwritten (they may be the user's own data): when one
    holds fewer records than asked, the caller simply gets fewer, and a note says so."""
    for split, n in sizes.items():
        path = os.path.join(data_dir, f"{split}.json")
        if not os.path.exists(path):
            generate_split(data_dir, split, n)
            continue
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            text = f.read()
        try:
            have = len(json.loads(text)) if text.lstrip().startswith("[") else len(text.splitlines())
        except json.JSONDecodeError:
            have = n  # malformed: the reader reports it with the record
        if have < n:
            print(f"[data] {path} has {have} records (< {n} asked); using them as they are")




def main(argv=None):
    p = entry_parser(__spec__.name, "Generate the synthetic shapes dataset (images + LLaVA JSON).")
    p.add_argument("--out", default="out/data", help="output directory")
    p.add_argument("--n-train", type=number(min=1), default=2000, help="training examples")
    p.add_argument("--n-val", type=number(min=1), default=500, help="validation examples")
    p.add_argument("--n-test", type=number(min=1), default=500, help="test examples")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the split files and images already in --out (default: refuse)")
    a = p.parse_args(argv)
    splits = (("train", a.n_train), ("val", a.n_val), ("test", a.n_test))
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        fail(f"--out {a.out} is a file; give a directory")
    if not a.overwrite:  # before anything is written: they may be the user's own data
        there = [os.path.join(a.out, f"{s}.json") for s, _ in splits
                 if os.path.exists(os.path.join(a.out, f"{s}.json"))]
        there += [os.path.join(a.out, "images", f) for s, _ in splits for f in _split_images(a.out, s)]
        if there:
            more = f" and {len(there) - 1} more file(s) of a dataset" if len(there) > 1 else ""
            fail(f"{there[0]} already exists{more}; pass --overwrite to replace them, or choose another --out")
    for split, n in splits:
        generate_split(a.out, split, n, overwrite=a.overwrite)
        print(f"wrote {n} {split} examples to {a.out}/{split}.json")


if __name__ == "__main__":
    main()

