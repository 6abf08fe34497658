"""The "Reproducing the paper's table" sections of mod/, rolemerge/ and mole/README.md, command by
command, on the tiny models: benchmark sources in the public schemas (made from the shapes
world) -> eval.convert -> train / calibrate / merge -> evaluate -> eval.scores. Each call
below mirrors one README command with tiny paths and sizes; the numbers are meaningless (the
tiny bases only know the shapes world), the plumbing is what is checked."""
import base64
import io
import json
import random

import pytest

from common import data as D
from common import shapes as sw
from eval import convert, evaluate, scores


def _cell(im):
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return {"bytes": base64.b64encode(buf.getvalue()).decode(), "path": None}


def shapes_sources(folder, n=3, seed=0):
    """Tiny exports in the public schemas of the benchmarks the READMEs use, written to
    folder/<benchmark>.jsonl: every question an existence question about a shapes scene."""
    rng = random.Random(seed)
    rows = {b: [] for b in ("scienceqa", "pope", "mme", "textvqa", "chartqa", "infovqa", "mmmu", "ocrbench",
                            "blink", "vstar", "realworldqa", "mmlu")}
    for i in range(n):
        scene = sw.sample_scene(rng)
        img = _cell(sw.render(scene))
        (q1, a1), (q2, a2) = sw.make_question(rng, scene, "existence") or ("Is there a red circle?", "no"), \
            (f"Is there a {scene[0].name}?", "yes")
        rows["scienceqa"].append({"image": img if i % 2 == 0 else None, "question": q1, "choices": ["yes", "no"],
                                  "answer": ["yes", "no"].index(a1), "hint": "", "subject": "natural science"})
        rows["pope"].append({"question_id": i, "question": q1, "answer": a1, "category": "random", "image": img})
        for q, a in ((q1, a1), (q2, a2)):
            rows["mme"].append({"question_id": f"existence/{i:04d}.png", "question": f"{q} Please answer yes or no.",
                                "answer": a.capitalize(), "category": "existence", "image": img})
        rows["textvqa"].append({"question_id": i, "question": "what colour is the first object?",
                                "answers": [scene[0].colour] * 10, "image": img})
        rows["chartqa"].append({"question": "How many objects?", "answer": str(len(scene)), "type": "human_test",
                                "image": img})
        rows["infovqa"].append({"questionId": i, "question": "What colour?", "answers": [scene[0].colour], "image": img})
        rows["mmmu"].append({"id": f"validation_Art_{i}", "question": f"<image 1> {q1}", "options": "['yes', 'no']",
                             "answer": "AB"[["yes", "no"].index(a1)], "question_type": "multiple-choice",
                             "image_1": img})
        rows["ocrbench"].append({"question": "what is written?", "answer": ["red"], "question_type": "Doc-oriented VQA",
                                 "dataset": "docVQA", "image": img})
        rows["blink"].append({"idx": f"val_Counting_{i}", "sub_task": "Counting", "choices": ["first", "second"],
                              "answer": "(A)", "prompt": f"{q1}\n(A) first\n(B) second", "image_1": img,
                              "image_2": _cell(sw.render(sw.sample_scene(rng)))})
        rows["mmlu"].append({"question": "What is 2 + 2?", "subject": "elementary_mathematics",
                             "choices": ["3", "4", "5", "6"], "answer": 1})
        rows["vstar"].append({"question_id": i, "text": f"{q1} (A) yes (B) no", "label": "AB"[["yes", "no"].index(a1)],
                              "category": "direct_attributes", "image": img})
        rows["realworldqa"].append({"question": f"{q1}\nA. yes\nB. no", "answer": "AB"[["yes", "no"].index(a1)],
                                    "image": img})
    for b, rs in rows.items():
        (folder / f"{b}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    (root / "src").mkdir()
    shapes_sources(root / "src")
    return root


def conv(root, bench, *extra):
    """`python -m eval.convert --benchmark B --src <export> --out root/bench/B.jsonl ...`"""
    src = next(p for p in root.parents if (p / "src").is_dir()) / "src" / f"{bench}.jsonl"
    out = str(root / "bench" / f"{bench}.jsonl")
    convert.main(["--benchmark", bench, "--src", str(src), "--out", out, *extra])
    return out


def test_mod_section(world, capsys):
    """mod/README.md, "Reproducing the paper's table"."""
    from mod import data as mdata, infer, train
    r, base = world / "mod", "tiny-chat"   # README: /ckpt/Qwen2.5-VL-3B-Instruct
    r.mkdir()
    sqa = conv(r, "scienceqa", "--require-image")
    pope, mme, mmlu = conv(r, "pope"), conv(r, "mme"), conv(r, "mmlu")
    vs = str(r / "vs.json")
    mdata.main(["--model", base, "--data", sqa, "--out", vs, "--num-return-sequences", "2", "--max-new-tokens", "8", "--threads", "1"])
    from mod import params
    capsys.readouterr()
    params.main(["--model", "common/tiny/chat", "--flags"])   # MOELORA=$(python -m mod.params --model $BASE --flags)
    moelora = capsys.readouterr().out.split()
    assert moelora == ["--method", "moelora"]
    for method, flags in (("mod", []), ("moelora", moelora)):
        train.main(["--model", base, "--data", vs, "--out", str(r / method), "--steps", "2", "--batch-size", "2",
                    "--seed", "0", *flags, "--threads", "1"])
    for bench, methods in ((pope, "base,single,multi,mad,sc"), (mme, "multi")):  # every method once
        preds = bench + ".preds.json"
        infer.main(["--model", base, "--adapter", str(r / "mod"), "--data", bench, "--methods", methods,
                    "--rounds", "1", "--max-new-tokens", "4", "--out", preds, "--threads", "1"])
        got = scores.main(["--data", bench, "--preds", preds, "--out", preds + ".scores.json"])
        assert set(got) == set(methods.split(","))
    assert "perception" in got["multi"]["mme"]
    infer.main(["--model", base, "--adapter", str(r / "moelora"), "--data", pope, "--methods", "single",
                "--max-new-tokens", "8", "--out", str(r / "moelora.json"), "--threads", "1"])
    assert "pope" in scores.main(["--data", pope, "--preds", str(r / "moelora.json")])["single"]
    evaluate.main(["--model", base, "--data", mmlu, "--out", str(r / "base_mmlu.json"), "--max-new-tokens", "4",
                   "--threads", "1"])
    assert "mmlu" in json.loads((r / "base_mmlu.json").read_text())["benchmarks"]


def test_rolemerge_section(world):
    """rolemerge/README.md, "Reproducing the paper's table"."""
    from rolemerge import calibrate, merge
    r = world / "rm"
    r.mkdir()
    tcs = [conv(r, "textvqa", "--limit", "2"), conv(r, "chartqa", "--limit", "2"),
           conv(r, "scienceqa", "--require-image", "--limit", "2")]
    calibrate.main(["--model", "tiny-moe", "--data", *tcs, "--limit", "2", "--max-new-tokens", "4",
                    "--out", str(r / "stats.safetensors"), "--dtype", "float32", "--threads", "1", "--features"])
    for m in ("rolemerge", "hcsmoe", "submoe"):   # step 3's loop, one ratio, three of its methods
        merge.main(["--model", "tiny-moe", "--stats", str(r / "stats.safetensors"), "--rho", "0.5", "--method", m,
                    "--router", "average", "--out", str(r / ("merged" if m == "rolemerge" else m)), "--threads", "1"])
    benches = {"infovqa": conv(r, "infovqa", "--limit", "2"), "mmmu": conv(r, "mmmu", "--multi-image", "concat"),
               "ocrbench": conv(r, "ocrbench")}
    for m in ("tiny-moe", str(r / "merged")):
        for bench, data in benches.items() if m != "tiny-moe" else list(benches.items())[:1]:
            out = str(r / f"{bench}_{len(m)}.json")
            evaluate.main(["--model", m, "--data", data, "--batch-size", "1", "--max-new-tokens", "4",
                           "--dtype", "float32", "--out", out, "--threads", "1"])
            got = json.loads(open(out).read())["benchmarks"][bench]
            assert got == scores.main(["--data", data, "--preds", out])["model"][bench]


def test_mole_section(world):
    """mole/README.md, "Reproducing the paper's table"."""
    from mole import infer, train
    r = world / "mole"
    r.mkdir()
    sw.generate_split(str(r / "covt"), "train", 16)   # README: the CoVT subset as LLaVA JSON
    common = ["--model", "tiny-dense", "--data", str(r / "covt"), "--batch-size", "8", "--quiet", "--device", "cpu",
              "--threads", "1"]
    train.main(common + ["--out", str(r / "mole"), "--stage1-epochs", "1", "--stage2-epochs", "1", "--n-vis", "2",
                         "--n-sum", "2"])
    train.main(common + ["--out", str(r / "sft"), "--method", "sft", "--stage1-epochs", "0", "--stage2-epochs", "1"])
    for bench in ("blink", "vstar", "realworldqa", "pope"):   # every benchmark once; each row on one of them
        data = conv(r, bench, "--multi-image", "concat")
        if bench == "blink":
            base = str(r / f"{bench}.base.json")
            evaluate.main(["--model", "tiny-dense", "--data", data, "--max-new-tokens", "4", "--out", base,
                           "--threads", "1"])
            assert bench in json.loads(open(base).read())["benchmarks"]
        for run in ("mole", "sft") if bench == "pope" else ("mole",):
            preds = str(r / f"{bench}.{run}.json")
            infer.main(["--ckpt", str(r / run), "--data", data, "--max-new-tokens", "4", "--out", preds,
                        "--threads", "1"])
            assert bench in scores.main(["--data", data, "--preds", preds, "--out", preds + ".scores"])["model"]
