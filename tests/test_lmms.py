"""eval/lmms.py without lmms-eval: the lazy import, the shapes task it writes, the record ->
document mapping, and the model classes' request plumbing against a stand-in `lmms` base
class (the real lmms-eval run is `python -m eval.tools.lmms_check`, outside CI)."""
import ast
import json
import os
import random
import subprocess
import sys
import types

import pytest
import torch

from common import data
from common import shapes as world
from eval import lmms as L
from helpers import logits_tol, tol

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_only_eval_lmms_imports_lmms_eval_and_only_inside_functions():
    hits = {}
    walk = [(REPO, [], [f for f in os.listdir(REPO) if f.endswith(".py")])]
    for top in ("common", "eval", "mod", "mole", "rolemerge", "tests"):
        walk += list(os.walk(os.path.join(REPO, top)))
    for d, _, files in walk:
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            tree = ast.parse(open(path).read())
            top = set(id(n) for n in tree.body)
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n.split(".")[0] == "lmms_eval" for n in names):
                    hits.setdefault(os.path.relpath(path, REPO), []).append(id(node) in top)
    assert set(hits) <= {os.path.join("eval", "lmms.py"), os.path.join("tests", "test_lmms.py")}
    assert hits.get(os.path.join("eval", "lmms.py")) and not any(hits[os.path.join("eval", "lmms.py")])


def test_classes_need_lmms_eval_and_say_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "lmms_eval", None)  # import lmms_eval -> ImportError
    monkeypatch.setattr(L, "_CLASSES", {})
    with pytest.raises(ImportError, match="needs lmms-eval"):
        L.MoD
    with pytest.raises(AttributeError):
        L.NoSuchModel


def write_records(tmp_path):
    """A canonical JSONL with a yes/no, an options-as-text, a text-only and a multi-answer record."""
    img = world.render(world.sample_scene(random.Random(0)))
    img.save(tmp_path / "a.png")
    recs = [{"id": "y", "image": "a.png", "question": "Is there a red circle?", "answer": "yes", "family": "existence"},
            {"id": "m", "image": "a.png", "question": "Which animal barks?", "answer": "dog",
             "options": ["cat", "dog", "cow"], "family": "mc"},
            {"id": "t", "question": "What is 2+2?", "answer": "4", "family": "count"},
            {"id": "w", "image": "a.png", "question": "Name the colour.", "answer": ["red", "Red."], "family": "colour"}]
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_record_to_doc(tmp_path):
    recs = data.read_any(write_records(tmp_path))
    y, m, t, w = map(L.record_to_doc, recs)
    assert y == {"id": "y", "image": str(tmp_path / "a.png"), "question": "Is there a red circle?", "answers": ["yes"],
                 "target": "yes", "family": "existence", "options": [], "gold": -1}
    assert m["options"] == [["A", "cat"], ["B", "dog"], ["C", "cow"]] and m["gold"] == 1 and m["answers"] == ["B"]
    assert m["question"].endswith("A. cat B. dog C. cow Answer with the letter.")
    assert t["image"] == "" and w["answers"] == ["red", "Red."] and w["target"] == "red"
    # a shapes mc question lists its options in the text: read as eval.evaluate.options_of does
    shapes = {"id": "s", "image": None, "question": "Which object is at the top left? A. red circle B. blue square "
              "C. green circle D. empty Answer with the letter.", "answer": "C", "family": "mc"}
    assert L.record_to_doc(shapes)["gold"] == 2 and L.doc_to_choice(L.record_to_doc(shapes)) == list("ABCD")
    with pytest.raises(ValueError, match="several images"):
        L.record_to_doc(dict(recs[0], images=["a.png", "b.png"]))
    with pytest.raises(ValueError, match="several images or turns"):
        L.record_to_doc(dict(recs[0], history=[["q", "a"]]))


def test_task_functions():
    doc = {"id": "m", "image": "", "question": "Q?", "answers": ["B"], "target": "B", "family": "mc",
           "options": [["A", "cat"], ["B", "dog"]], "gold": 1}
    assert L.doc_to_text(doc) == "Q?" and L.doc_to_visual(doc) == [] and L.doc_to_target(doc) == 1
    assert L.process_results(doc, ["tl empty. Answer: B"]) == {"accuracy": 1.0}
    assert L.process_results(doc, ["Answer: A"]) == {"accuracy": 0.0}
    assert L.process_results(doc, ["the dog"]) == {"accuracy": 1.0}  # option text -> its letter, as eval.evaluate
    gen = dict(doc, options=[], gold=-1, answers=["3", "three"], family="count", target="3")
    assert L.doc_to_target(gen) == "3" and L.process_results(gen, ["Answer: three"]) == {"accuracy": 1.0}


def test_build_task_writes_a_loadable_task(tmp_path):
    import yaml
    src = write_records(tmp_path)
    out = tmp_path / "task"
    made = L.build_task(data.read_any(src), str(out), "toy", max_new_tokens=7)
    assert made == {"toy": ["y", "m", "t", "w"], "toy_mc": ["m"]}

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_constructor("!function", lambda loader, node: ("function", loader.construct_scalar(node)))
    gen = yaml.load((out / "toy.yaml").read_text(), Loader)
    assert gen["output_type"] == "generate_until" and gen["test_split"] == "test"
    assert gen["generation_kwargs"] == {"max_new_tokens": 7, "temperature": 0, "do_sample": False, "until": []}
    assert gen["dataset_kwargs"]["data_files"]["test"] == str(out / "toy.jsonl")
    assert gen["process_results"] == ("function", "utils.process_results")
    assert gen["metric_list"] == [{"metric": "accuracy", "aggregation": "mean", "higher_is_better": True}]
    mc = yaml.load((out / "toy_mc.yaml").read_text(), Loader)
    assert mc["output_type"] == "multiple_choice" and mc["target_delimiter"] == ""
    assert mc["doc_to_choice"] == ("function", "utils.doc_to_choice") and mc["metric_list"][0]["metric"] == "acc"
    docs = [json.loads(x) for x in (out / "toy.jsonl").read_text().splitlines()]
    assert docs == [L.record_to_doc(r) for r in data.read_any(src)]
    # utils.py imports this repo's task functions wherever lmms-eval loads it from
    spec = __import__("importlib.util").util.spec_from_file_location("toy_utils", out / "utils.py")
    mod = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.process_results is L.process_results and mod.doc_to_visual(docs[0])[0].size == (84, 84)
    with pytest.raises(FileExistsError):
        L.build_task(data.read_any(src), str(out), "toy")
    assert L.build_task(data.read_any(src)[:1], str(out), "toy", overwrite=True) == {"toy": ["y"]}


def test_make_task_cli_errors(tmp_path, capsys):
    src = write_records(tmp_path)
    L.main(["make-task", "--data", src, "--out", str(tmp_path / "t")])
    with pytest.raises(SystemExit) as e:
        L.main(["make-task", "--data", src, "--out", str(tmp_path / "t")])
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err


def test_cut_at_and_greedy_budget():
    assert L.cut_at("a. Answer: yes\n\nmore", ["\n\n"]) == "a. Answer: yes"
    assert L.cut_at("abcabc", ["c", "b"]) == "a" and L.cut_at("abc", "c") == "ab"
    assert L.cut_at("abc", []) == "abc" and L.cut_at("abc", None) == "abc" and L.cut_at("abc", [""]) == "abc"
    assert L.greedy_budget({}) == 48 and L.greedy_budget({"max_new_tokens": 5, "temperature": 0}) == 5
    for bad in ({"temperature": 0.7}, {"do_sample": True}, {"num_beams": 4}):
        with pytest.raises(ValueError, match="greedy"):
            L.greedy_budget(bad)


# ----------------------------------------------------------------------------- scoring against our own code

def shapes_records(tmp_path, n, family=None, seed=0):
    rng = random.Random(seed)
    recs = []
    while len(recs) < n:
        scene, fam, q, a = world.sample_example(rng)
        if family and fam != family:
            continue
        p = tmp_path / f"{len(recs)}.png"
        world.render(scene).save(p)
        recs.append({"id": str(len(recs)), "image": str(p), "images": [str(p)], "question": q, "answer": a,
                     "family": fam, "history": []})
    return recs


def test_loglik_plain_equals_eval_evaluate_score_options(tmp_path):
    from common.backbone import load_backbone
    from eval.evaluate import options_of, score_options
    model, proc = load_backbone("tiny-dense")
    recs = shapes_records(tmp_path, 2, "mc")
    ref = score_options(model, proc, recs, batch_size=5)
    rows = [(data.load_image(r["image"]), r["question"], letter) for r in recs for letter, _ in options_of(r)]
    got = L.loglik_plain(model, proc, rows, batch_size=5)
    # two forwards of other batch shapes: each log-prob of the (at most 2-token) letter moves by at most
    # 2 x the logits' error (helpers.logits_tol on the prompt's logits, 2 positions more), then the log-softmax
    batch = proc.encode([r[0] for r in rows[:1]], [rows[0][1]])
    with torch.no_grad():
        logits = model(**batch).logits
    n = batch["input_ids"].shape[1] + 2
    bound = 2 * 2 * logits_tol(model, n, logits) + tol(torch.float32, logits.shape[-1] + 2, logits.abs().max())
    assert [x for x, _ in got] == pytest.approx([s for r in ref for s in r["scores"]], rel=0, abs=bound)
    # greedy: the letter is the argmax of the first assistant token exactly for the best-scoring option
    for k, r in enumerate(ref):
        flags = [g for _, g in got[4 * k:4 * k + 4]]
        assert sum(flags) <= 1 and (not any(flags) or flags.index(True) == r["scores"].index(max(r["scores"])))
    with pytest.raises(ValueError, match="empty continuation"):
        L.loglik_plain(model, proc, [(None, "q", "")])


def test_loglik_mole_matches_cached_generation(tmp_path):
    from common.backbone import build_tiny
    from mole.infer import generate
    from mole.model import MoLE, MoLEConfig
    model, proc = build_tiny("qwen3_vl", seed=0, layers=2)
    mole = MoLE(model.eval(), proc, MoLEConfig())
    g = torch.Generator().manual_seed(1)
    for e in mole.esva:
        e.gamma.data = torch.randn(e.gamma.shape, generator=g)
    recs = shapes_records(tmp_path, 2)
    imgs = [data.load_image(r["image"]) for r in recs]
    for stage in (1, 2):
        texts, _, steps, ids = generate(mole, imgs, [r["question"] for r in recs], stage=stage, max_new_tokens=4,
                                        stop_at_eos=False, return_logits=True)
        new = ids[:, -4:]
        want = torch.log_softmax(steps, -1).gather(-1, new[..., None]).squeeze(-1).sum(-1)
        conts = [proc.decode(row) for row in new.tolist()]
        assert all(proc.text_ids(c) == row for c, row in zip(conts, new.tolist()))  # the text re-tokenizes the same
        got = L.loglik_mole(mole, [(im, r["question"], c) for im, r, c in zip(imgs, recs, conts)], stage)
        # 4 log-probs, each moved by at most 2 x the logits' error, then the log-softmax and the sum
        bound = 2 * 4 * logits_tol(model, ids.shape[1], steps) + tol(torch.float32, steps.shape[-1] + 4,
                                                                      want.abs().max())
        assert [x for x, _ in got] == pytest.approx(want.tolist(), rel=0, abs=bound)
        assert all(greedy for _, greedy in got)
    with pytest.raises(ValueError, match="one image"):
        L.loglik_mole(mole, [(None, "q", "a")], 2)


# ----------------------------------------------------------------------------- the classes, on a stand-in lmms

class FakeLmms:
    """What the classes use of lmms-eval's `lmms`: __init__, rank, task_dict."""

    def __init__(self):
        self.rank, self.task_dict = 0, {}


class Req:
    def __init__(self, *args):
        self.args = args


class FakeGenerationResult:
    def __init__(self, text, token_counts=None):
        self.text, self.token_counts = text, token_counts


def fake_unwrap_generation_output(output):
    """lmms-eval 0.7.3's: a GenerationResult gives its text, any other non-string its str()."""
    if isinstance(output, FakeGenerationResult):
        return output.text, output.token_counts
    return (output, None) if isinstance(output, str) else (str(output), None)


@pytest.fixture
def fake_lmms_eval(monkeypatch):
    pkg = types.ModuleType("lmms_eval")
    api = types.ModuleType("lmms_eval.api")
    model = types.ModuleType("lmms_eval.api.model")
    model.lmms = FakeLmms
    instance = types.ModuleType("lmms_eval.api.instance")
    instance.GenerationResult, instance.unwrap_generation_output = FakeGenerationResult, fake_unwrap_generation_output
    for name, m in (("lmms_eval", pkg), ("lmms_eval.api", api), ("lmms_eval.api.model", model),
                    ("lmms_eval.api.instance", instance)):
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(L, "_CLASSES", {})
    yield


def test_mod_class_answers_as_mod_infer(tmp_path, fake_lmms_eval):
    from common.backbone import load_backbone
    from mod.infer import mod_debate
    from mod.model import AdapterConfig, attach, save_adapters
    base, proc = load_backbone("tiny-chat")
    attach(base, AdapterConfig())
    g = torch.Generator().manual_seed(0)
    for n, p in base.named_parameters():
        if p.requires_grad:  # B starts at zero: make the adapter change the answers
            p.data = 0.3 * torch.randn(p.shape, generator=g)
    save_adapters(base, str(tmp_path / "ad"))
    recs = shapes_records(tmp_path, 3)
    docs = [L.record_to_doc(r) for r in recs]  # batch_size 2: a full and a partial batch
    for method, rounds in (("single", 0), ("multi", 1)):
        m = L.MoD(pretrained="tiny-chat", adapter=str(tmp_path / "ad"), method=method, rounds=1, batch_size=2,
                  device="cpu", threads=1)
        m.task_dict = {"toy": {"test": docs}}
        reqs = [Req(d["question"], {"max_new_tokens": 12, "until": []}, L.doc_to_visual, i, "toy", "test")
                for i, d in enumerate(docs)]
        ref, _ = mod_debate(m.model, m.proc, recs, rounds, batch_size=2, max_new_tokens=12)
        assert m.generate_until(reqs) == [r["pred"] for r in ref]
    # loglikelihood: (-sum log p, greedy), the sign lmms-eval's multiple_choice (argmin) expects
    ll = m.loglikelihood([Req(docs[0]["question"], "A", L.doc_to_visual, 0, "toy", "test")])
    want = L.loglik_plain(m.model, m.proc, [(data.load_image(recs[0]["image"]), docs[0]["question"], "A")])
    pairs = [fake_unwrap_generation_output(r)[0] for r in ll]   # the pair reaches the harness whole, not as a str
    assert pairs == [(-want[0][0], want[0][1])] and pairs[0][0] > 0
    with pytest.raises(ValueError, match="greedy"):
        m.generate_until([Req("q", {"temperature": 0.5}, L.doc_to_visual, 0, "toy", "test")])
    with pytest.raises(ValueError, match="2 images"):
        m._visual(Req("q", {}, lambda d: [data.load_image(recs[0]["image"])] * 2, 0, "toy", "test"))
    with pytest.raises(ValueError, match="method"):
        L.MoD(pretrained="tiny-chat", adapter="x", method="triple")
    with pytest.raises(ValueError, match="adapter"):
        L.MoD(pretrained="tiny-chat")
    with pytest.raises(ValueError, match="unknown model_args"):
        L.MoD(pretrained="tiny-chat", adapter="x", temprature=0)


def test_lmms_without_lmms_eval_says_how_to_install_it():
    """A reported bug: the top README's `python -m eval.lmms --model mod ...` ended in a
    ModuleNotFoundError traceback where lmms-eval is not installed (CI's venv)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('lmms_eval') is not None)"
    if subprocess.run([sys.executable, "-c", probe]).returncode:
        pytest.skip("lmms-eval is installed here")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "eval.lmms", "--model", "mod", "--tasks", "mmstar"], cwd=root,
                         capture_output=True, text=True)
    assert out.returncode == 2 and "pip install lmms-eval==0.7.3" in out.stderr and "Traceback" not in out.stderr
