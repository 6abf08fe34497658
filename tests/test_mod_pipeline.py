"""MoD data synthesis, training loop (exact resume) and inference drivers on a tiny model."""
import json
import os
import random

import pytest
import torch

from common import data
from common import shapes
from common.backbone import build_tiny
from helpers import tol
from mod import data as vs
from mod.infer import heatmap_png, mod_debate, multi_agent_debate, routing_trace, self_correction, usage_entropy
from mod.model import AdapterConfig, adapter_state_dict, attach
from mod.train import TrainConfig, fit


def test_json_response_and_prompts():
    r = json.loads(vs.to_json_response("tl red circle, tc empty. Answer: yes"))
    assert r == {"Reasoning": "tl red circle, tc empty", "Answer": "yes"}
    assert json.loads(vs.to_json_response('{"Reasoning": "x", "Answer": "3"}'))["Answer"] == "3"
    p = vs.debate_prompt("How many?", ["a", "b"])
    assert p.index("How many?") < p.index(vs.DEBATE_PROMPT) < p.index("Response 1: a") < p.index("Response 2: b")
    assert vs.debate_prompt("Q?", []) == vs.single_prompt("Q?")
    # malformed JSON still yields the answer
    assert vs.is_correct('{"Reasoning": "tl red circle", "Answer": "yes"', "yes", "existence")
    assert not vs.is_correct('{"Reasoning": "tl red circle", "Answer": "no"}', "yes", "existence")


def test_synthesize_categories():
    recs = [{"id": "a", "image": "x.png", "family": "count", "answer": "2", "question": "How many?"}]
    pos, neg = ['{"Reasoning": "r", "Answer": "2"}'], ['{"Reasoning": "w", "Answer": "3"}']
    out, counts = vs.synthesize(recs * 1, [(pos, neg)], n_per_question=300, ratios=(1, 1, 1), max_priors=3)
    assert sum(counts.values()) == 300 and min(counts.values()) > 60
    for o in out:
        human, target = o["conversations"][0]["value"], o["conversations"][1]["value"]
        assert target == pos[0]  # the target always comes from P+
        n_pos, n_neg = human.count('"Answer": "2"'), human.count('"Answer": "3"')
        assert n_pos + n_neg == o["n_priors"]
        if o["category"] == "pos":
            assert n_neg == 0
        elif o["category"] == "rev":
            assert n_pos == 0 and n_neg >= 1
        else:
            assert n_pos >= 1 and n_neg >= 1
    # no incorrect pool: only T_pos can be formed
    _, counts = vs.synthesize(recs, [(pos, [])], n_per_question=10)
    assert set(counts) == {"pos"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("shapes"))
    shapes.generate_split(d, "train", 12)
    records = data.read_llava_json(os.path.join(d, "train.json"))
    base, proc = build_tiny("qwen2_5_vl", hidden=64, layers=2)
    return base.eval(), proc, records


def test_sampling_pools_and_training_resume(setup, tmp_path):
    base, proc, records = setup
    samples = vs.sample_responses(base, proc, records[:4], k=2, max_new_tokens=6)
    pools, n_gold = vs.build_pools(records[:4], samples)
    assert len(pools) == 4 and all(pos for pos, _ in pools)  # an empty P+ gets the gold response
    no_correct = sum(not any(vs.is_correct(t, r["answer"], r["family"]) for t in s) for r, s in zip(records, samples))
    assert n_gold == no_correct
    train_recs, counts = vs.synthesize(records[:4], pools, n_per_question=3)
    assert sum(counts.values()) == len(train_recs) == 12
    path = tmp_path / "vs.json"
    path.write_text(json.dumps(train_recs))
    train_recs = data.read_llava_json(str(path))

    def trained(steps, out, resume=False, init=None):
        import copy
        m = copy.deepcopy(base)
        torch.manual_seed(0)
        attach(m, AdapterConfig(window=4))
        if init is not None:
            m.load_state_dict(init, strict=False)
        res = fit(m, proc, train_recs, str(out), TrainConfig(steps=steps, batch_size=3, warmup=2, resume=resume), quiet=True)
        return m, res

    straight, res = trained(4, tmp_path / "a")
    assert res["steps"] == 4 and res["loss"] > 0 and res["aux"] > 0
    half, _ = trained(2, tmp_path / "b")
    # a fresh process would build a new model: different init, then --resume loads the ckpt
    from mod.train import fit as fit_again
    import copy
    m = copy.deepcopy(base)
    torch.manual_seed(123)
    attach(m, AdapterConfig(window=4))
    fit_again(m, proc, train_recs, str(tmp_path / "b"), TrainConfig(steps=4, batch_size=3, warmup=2, resume=True), quiet=True)
    a, b = adapter_state_dict(straight), adapter_state_dict(m)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert len((tmp_path / "a" / "log.jsonl").read_text().splitlines()) >= 2


def test_inference_drivers_and_diagnostics(setup, tmp_path):
    base, proc, records = setup
    import copy
    model = copy.deepcopy(base)
    attach(model, AdapterConfig(window=4))
    recs = records[:3]
    single, _ = mod_debate(model, proc, recs, rounds=0, max_new_tokens=5)
    multi, wall = mod_debate(model, proc, recs, rounds=1, max_new_tokens=5)
    assert all(m["n_tokens"] > s["n_tokens"] for s, m in zip(single, multi)) and wall > 0
    mad, _ = multi_agent_debate(base, proc, recs, rounds=1, max_new_tokens=4)
    assert all(r["n_tokens"] > 4 * 4 for r in mad)  # 2 + 2 debater calls + judge
    sc, _ = self_correction(base, proc, recs, max_new_tokens=4)
    assert all(4 < r["n_tokens"] <= 8 for r in sc)
    diag = routing_trace(model, proc, recs, max_new_tokens=6)
    assert 0.0 <= diag["switch_rate"] <= 1.0
    assert all(abs(sum(row) - 1) <= tol(torch.float32, len(row) + 1) for row in diag["share_A"])  # shares of 1
    assert 0 < usage_entropy(diag["share_A"]) <= 1
    png = heatmap_png(diag["by_family_A"], str(tmp_path / "h.png"))
    assert os.path.getsize(png) > 100


def test_command_line_entry_points(tmp_path, capsys):
    """mod.data -> mod.train -> mod.infer through their argparse mains on a saved tiny base."""
    from common.backbone import save_backbone
    from mod import data as mdata, infer, train
    base, proc = build_tiny("qwen3_vl", hidden=64, layers=2)
    save_backbone(base, proc, str(tmp_path / "base"))
    shapes.generate_split(str(tmp_path / "d"), "train", 6)
    shapes.generate_split(str(tmp_path / "d"), "test", 3)
    vsj = str(tmp_path / "vs.json")
    mdata.main(["--model", str(tmp_path / "base"), "--data", str(tmp_path / "d" / "train.json"), "--out", vsj,
                "--num-return-sequences", "2", "--max-new-tokens", "8"])
    assert "T_pos" in capsys.readouterr().out
    train.main(["--model", str(tmp_path / "base"), "--data", vsj, "--out", str(tmp_path / "run"), "--steps", "2",
                "--batch-size", "2", "--window", "4", "--granularity", "region"])
    assert os.path.exists(tmp_path / "run" / "adapter_model.safetensors")
    infer.main(["--model", str(tmp_path / "base"), "--adapter", str(tmp_path / "run"), "--data",
                str(tmp_path / "d" / "test.json"), "--methods", "base,single,multi,sc", "--max-new-tokens", "4",
                "--heatmap", str(tmp_path / "h.png"), "--out", str(tmp_path / "res.json")])
    out = json.loads((tmp_path / "res.json").read_text())
    assert [s["method"] for s in out["summaries"]] == ["base", "single", "multi", "sc"]
    assert os.path.exists(tmp_path / "h.png")


def test_wrong_response_and_misled_prompt(setup, monkeypatch):
    from common.answers import final_answer
    from mod import data as vs
    from mod import infer
    rng = random.Random(0)
    for fam, gold in (("existence", "yes"), ("count", "2"), ("colour", "red"), ("mc", "C"), ("spatial", "no")):
        for _ in range(20):
            w = vs.wrong_response(rng, "Q?", gold, fam)
            assert final_answer(w) != gold and final_answer(w) in vs.ANSWER_SPACE[fam]
    base, proc, records = setup
    seen = []
    real = infer._generate
    monkeypatch.setattr(infer, "_generate", lambda m, p, b, recs, qs, n, **kw: (seen.extend(qs), real(m, p, b, recs, qs, n, **kw))[1])
    res, _ = infer.misled(base, proc, records[:2], max_new_tokens=3)
    assert len(res) == 2 and len(seen) == 2
    for r, q in zip(records[:2], seen):  # the only prior is a JSON response with a wrong answer
        prior = q.split("Response 1: ")[1].split("\n")[0]
        assert q.startswith(r["question"] + "\n" + vs.DEBATE_PROMPT) and final_answer(prior) != str(r["answer"])


def test_resume_past_the_requested_steps_and_overwrite_after_checks(tmp_path, capsys):
    """--resume with fewer --steps than the run has done is refused (it used to rewind the step
    counter over later weights); --overwrite with a bad --model keeps the old run."""
    from common.backbone import save_backbone
    from mod import train
    base, proc = build_tiny("qwen3_vl", hidden=64, layers=2)
    save_backbone(base, proc, str(tmp_path / "base"))
    shapes.generate_split(str(tmp_path / "d"), "train", 6)
    args = ["--model", str(tmp_path / "base"), "--data", str(tmp_path / "d" / "train.json"), "--out",
            str(tmp_path / "run"), "--batch-size", "2", "--warmup-steps", "20", "--save-every", "1"]
    train.main(args + ["--steps", "4"])
    with pytest.raises(SystemExit) as e:
        train.main(args + ["--steps", "2", "--resume"])
    assert e.value.code == 2
    assert "is at step 4, past --steps 2; pass --steps 4 (its run) or more" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "ckpt" / "state.json").read_text())["step"] == 4
    assert train.main(args + ["--steps", "6", "--resume"])["steps"] == 2  # inside warmup: a longer run is exact
    before = sorted(os.listdir(tmp_path / "run"))
    with pytest.raises(SystemExit):
        train.main(args[:1] + [str(tmp_path / "nope")] + args[2:] + ["--steps", "6", "--overwrite"])
    assert sorted(os.listdir(tmp_path / "run")) == before  # the typo cost nothing


def test_misled_refuses_a_family_without_an_answer_space():
    with pytest.raises(data.DataError, match="shapes-world family .* got 'all'"):
        vs.wrong_response(random.Random(0), "Q?", "cat", "all")
