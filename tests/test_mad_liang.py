"""MAD as Liang et al.'s official protocol (`mod.infer.liang_debate`, `--mad liang`) on a stub
model: a fake `generate` answers from a script keyed by the agent's role and records every call
(its new user turn, the conversation before it, the decoding settings)."""
import json

import pytest

from common import data, shapes
from common.backbone import build_tiny
from mod import infer
from mod.infer import liang_debate, multi_agent_debate
from mod.prompts import LIANG_PROMPTS, liang_decision, liang_prompt

NEG_INSTRUCTION = "You disagree with my answer. Provide your answer and reasons."


def records(n=2):
    return [{"id": f"q{i}", "family": "existence", "answer": "yes", "image": None,
             "question": f"Is there a red circle? (question {i})"} for i in range(n)]


def role(question, history):
    """Which agent a call comes from, read from its conversation's first user turn."""
    first = history[0][0] if history else question
    if first.startswith("You are a debater."):
        return "negative" if NEG_INSTRUCTION in first else "affirmative"
    if "what answer candidates" in first:
        return "judge"
    return "moderator"


class Stub:
    """A fake `common.backbone.generate`: replies `script(role, qid, turn)`; turn = the agent's
    number of earlier turns. Every call is kept as (role, qid, question, history, kwargs)."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def __call__(self, model, proc, images, questions, max_new_tokens, history=None, **kw):
        out = []
        for q, h in zip(questions, history):
            r = role(q, h)
            qid = next(t for t in ("question 0", "question 1", "question 2") if t in (h[0][0] if h else q))
            self.calls.append((r, qid, q, list(h), kw))
            out.append(self.script(r, qid, len(h)))
        return out, [len(t.split()) for t in out]


def undecided(r, qid, turn):
    if r == "moderator":
        return json.dumps({"Whether there is a preference": "No", "Supported Side": "", "Reason": "", "debate_answer": ""})
    if r == "judge":
        return "yes or no" if turn == 0 else json.dumps({"Reason": "r", "debate_answer": "yes"})
    return f"{r} round {turn + 1} says no"


def run(monkeypatch, script, n=2, **kw):
    stub = Stub(script)
    monkeypatch.setattr(infer, "generate", stub)
    res, wall = liang_debate(None, None, records(n), **kw)
    return res, stub.calls


def test_round_one_roles_and_the_negatives_instruction(monkeypatch):
    """Affirmative answers the question; the negative reads the affirmative's answer and is told to
    disagree; the moderator reads both; in that order."""
    decide = lambda r, qid, turn: json.dumps({"debate_answer": "yes"}) if r == "moderator" else f"{r} says no"
    res, calls = run(monkeypatch, decide, n=1)
    assert [c[0] for c in calls] == ["affirmative", "negative", "moderator"]
    topic = records(1)[0]["question"]
    aff, neg, mod = calls
    assert aff[2] == liang_prompt("player_meta_prompt", debate_topic=topic) + "\n\n" + topic
    assert neg[2] == (liang_prompt("player_meta_prompt", debate_topic=topic) + "\n\naffirmative says no\n\n"
                      + NEG_INSTRUCTION)
    assert mod[2].startswith(liang_prompt("moderator_meta_prompt", debate_topic=topic) + "\n\nNow the first round")
    assert "Affirmative side arguing:\naffirmative says no\n\nNegative side arguing: negative says no" in mod[2]
    assert res[0]["pred"] == "yes" and res[0]["correct"] and res[0]["decided_by"] == "moderator"
    assert res[0]["n_tokens"] == 3 + 3 + 2   # every reply of every agent (the stub counts words)


def test_the_moderator_ends_a_debate_early_and_only_that_one(monkeypatch):
    """Question 0's moderator decides in round 1, question 1's in round 2: question 0 leaves the
    batch (no round-2 call), question 1 runs two rounds; each final answer is its moderator's."""
    def script(r, qid, turn):
        if r != "moderator":
            return f"{r} {turn}"
        if qid == "question 0" or turn == 1:
            return '```json\n{"Whether there is a preference": "Yes", "debate_answer": "yes"}\n```'
        return json.dumps({"Whether there is a preference": "No", "debate_answer": ""})
    res, calls = run(monkeypatch, script)
    assert [(r["rounds"], r["decided_by"], r["pred"]) for r in res] == [(1, "moderator", "yes"), (2, "moderator", "yes")]
    assert sum(c[1] == "question 0" for c in calls) == 3            # aff, neg, moderator: round 1 only
    assert sum(c[1] == "question 1" for c in calls) == 6
    assert not any(c[0] == "judge" for c in calls)
    assert "Now the second round" in [c for c in calls if c[1] == "question 1" and c[0] == "moderator"][1][2]


def test_at_most_three_rounds_then_the_two_step_judge(monkeypatch):
    """A moderator that never decides: exactly 3 rounds, then the judge lists the candidates from
    both sides' first-round answers and, in the same conversation, answers in JSON."""
    res, calls = run(monkeypatch, undecided, n=1)
    assert [c[0] for c in calls] == ["affirmative", "negative", "moderator"] * 3 + ["judge", "judge"]
    assert res[0]["rounds"] == 3 and res[0]["decided_by"] == "judge" and res[0]["pred"] == "yes"
    topic = records(1)[0]["question"]
    first, second = calls[-2], calls[-1]
    assert first[2] == liang_prompt("moderator_meta_prompt", debate_topic=topic) + "\n\n" + liang_prompt(
        "judge_prompt_last1", aff_ans="affirmative round 1 says no", neg_ans="negative round 1 says no")
    assert first[3] == []
    assert second[2] == liang_prompt("judge_prompt_last2", debate_topic=topic) and second[2].startswith("Therefore, " + topic)
    assert second[3] == [(first[2], "yes or no")]
    words = lambda r, turn: len(undecided(r, "question 0", turn).split())
    assert res[0]["n_tokens"] == sum(words(r, t) for t in range(3) for r in ("affirmative", "negative", "moderator")) \
        + words("judge", 0) + words("judge", 1)   # 9 debate turns + the judge's two


def test_the_round_limit_follows_max_rounds(monkeypatch):
    _, calls = run(monkeypatch, undecided, n=1, max_rounds=2)
    assert [c[0] for c in calls] == ["affirmative", "negative", "moderator"] * 2 + ["judge", "judge"]
    with pytest.raises(ValueError, match="max_rounds >= 1"):
        liang_debate(None, None, records(1), max_rounds=0)


def test_a_judge_without_json_is_scored_on_its_reply(monkeypatch):
    script = lambda r, qid, turn: "scene. Answer: yes" if r == "judge" else undecided(r, qid, turn)
    res, _ = run(monkeypatch, script, n=1)
    assert res[0]["pred"] == "scene. Answer: yes" and res[0]["correct"]


def test_every_agent_keeps_its_whole_conversation(monkeypatch):
    """Round 3's affirmative sees its rounds 1-2 turns; the negative answers the affirmative's
    reply of the same round; the moderator's round-3 call carries its rounds 1-2."""
    res, calls = run(monkeypatch, undecided, n=1)
    aff = [c for c in calls if c[0] == "affirmative"]
    neg = [c for c in calls if c[0] == "negative"]
    mod = [c for c in calls if c[0] == "moderator"]
    assert aff[2][3] == [(aff[0][2], "affirmative round 1 says no"), (aff[1][2], "affirmative round 2 says no")]
    assert aff[1][2] == liang_prompt("debate_prompt", oppo_ans="negative round 1 says no")
    assert neg[1][2] == liang_prompt("debate_prompt", oppo_ans="affirmative round 2 says no")
    assert neg[2][3] == [(neg[0][2], "negative round 1 says no"), (neg[1][2], "negative round 2 says no")]
    assert [t for t, _ in mod[2][3]] == [mod[0][2], mod[1][2]] and "Now the third round" in mod[2][2]


def test_greedy_decoding(monkeypatch):
    """Temperature 0: every Liang call decodes greedily (the Du-style debaters sample)."""
    _, calls = run(monkeypatch, undecided, n=1)
    assert calls and all(c[4].get("do_sample") is False and "temperature" not in c[4] for c in calls)
    seen = []
    monkeypatch.setattr(infer, "generate", lambda m, p, ims, qs, mnt, **kw: (seen.append(kw) or ["a"] * len(qs), [1] * len(qs)))
    multi_agent_debate(None, None, records(1), rounds=1)
    assert seen[0].get("do_sample") is True


def test_batches_give_the_same_debates(monkeypatch):
    """Batch size changes nothing but how the calls are grouped."""
    def script(r, qid, turn):
        if r == "moderator" and qid == "question 1":
            return json.dumps({"debate_answer": "yes"})
        return undecided(r, qid, turn)
    one, _ = run(monkeypatch, script, n=3, batch_size=1)
    many, _ = run(monkeypatch, script, n=3, batch_size=2)
    assert one == many and [r["rounds"] for r in one] == [3, 1, 3]


@pytest.mark.parametrize("text, want", [
    ('{"Whether there is a preference": "Yes", "Supported Side": "Negative", "Reason": "r", "debate_answer": " no "}', "no"),
    ('Sure:\n```json\n{"debate_answer": "B"}\n```', "B"),
    ("{'Reason': 'r', 'debate_answer': 'yes'}", "yes"),                 # a Python literal: the code's eval reads it
    ('{"Whether there is a preference": "No", "debate_answer": ""}', ""),
    ('{"Whether there is a preference": "Yes"}', None),
    ("tl empty - tc red circle +. Answer: yes", None),
    ("{not json at all}", None),
])
def test_liang_decision(text, want):
    assert liang_decision(text) == want


def test_prompts_are_the_official_ones():
    """The negative's instruction and the moderator's JSON keys, as in the official config."""
    assert LIANG_PROMPTS["negative_prompt"] == "##aff_ans##\n\n" + NEG_INSTRUCTION
    assert '"debate_answer": ""}' in LIANG_PROMPTS["moderator_prompt"]
    with pytest.raises(KeyError, match="aff_ans"):
        liang_prompt("negative_prompt")


def _questions(tmp_path):
    path = tmp_path / "q.json"
    path.write_text(json.dumps([{"id": "t0", "family": "mmlu", "answer": "B", "image": None,
                                 "conversations": [{"from": "human", "value": "Second letter? A B C"},
                                                   {"from": "gpt", "value": "B"}]}]))
    return str(path)


@pytest.mark.parametrize("argv, want", [([], ("liang", 3)), (["--mad-rounds", "2"], ("liang", 2)),
                                        (["--mad", "du"], ("du", 1)), (["--mad", "du", "--rounds", "2"], ("du", 2))])
def test_mad_flag_picks_the_protocol(tmp_path, monkeypatch, argv, want):
    """mod.infer --methods mad runs Liang's protocol by default (3 rounds at most), Du-style with --mad du."""
    seen = []
    monkeypatch.setattr(infer, "load_backbone", lambda *a, **k: (None, None))
    monkeypatch.setattr(infer, "liang_debate", lambda m, p, recs, rounds, *a, **kw: (seen.append(("liang", rounds)) or [], 0.0))
    monkeypatch.setattr(infer, "multi_agent_debate", lambda m, p, recs, rounds, **kw: (seen.append(("du", rounds)) or [], 0.0))
    infer.main(["--data", _questions(tmp_path), "--methods", "mad", *argv])
    assert seen == [want]


def test_liang_needs_a_round(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        infer.main(["--data", _questions(tmp_path), "--methods", "mad", "--mad-rounds", "0"])
    assert e.value.code == 2 and "--mad liang needs --mad-rounds >= 1" in capsys.readouterr().err


def test_a_stopped_debate_resumes_to_the_same_result(monkeypatch, tmp_path):
    """Stopped during round 1's moderator turns, resumed from OUT.partial: no finished batch is
    asked again and the debates (who leaves after round 1, the judge's inputs) come out as in
    the uninterrupted run."""
    from common.cli import Interrupted
    from common.predictions import PredictionLog

    def script(r, qid, turn):
        return json.dumps({"debate_answer": "yes"}) if r == "moderator" and qid == "question 1" else undecided(r, qid, turn)
    ref, ref_calls = run(monkeypatch, script, n=3, batch_size=2)
    stub = Stub(script)

    def stopping(*a, **kw):
        if len(stub.calls) >= 7:   # after 8 rows: both debaters' round 1 and the moderator's first batch
            raise KeyboardInterrupt
        return stub(*a, **kw)
    out = str(tmp_path / "r.json")
    monkeypatch.setattr(infer, "generate", stopping)
    with pytest.raises(Interrupted):
        with PredictionLog(out, {"run": 1}) as log:
            liang_debate(None, None, records(3), batch_size=2, log=log)
    asked = len(stub.calls)
    monkeypatch.setattr(infer, "generate", stub)
    with PredictionLog(out, {"run": 1}, resume=True) as log:
        got, _ = liang_debate(None, None, records(3), batch_size=2, log=log)
    assert asked == 8 and got == ref
    assert len(stub.calls) == len(ref_calls)   # both parts together asked what one run asks: nothing twice


def test_on_a_tiny_vlm_with_images(tmp_path):
    """The real generation path: images in every agent's first turn, the conversations passed as
    history; batch size changes nothing; a base that writes no moderator JSON debates 3 rounds
    and is judged (11 replies per question, each within the cap)."""
    shapes.generate_split(str(tmp_path), "train", 3)
    recs = data.read_llava_json(str(tmp_path / "train.json"))
    base, proc = build_tiny("qwen2_5_vl", hidden=64, layers=2)
    one, _ = liang_debate(base.eval(), proc, recs, batch_size=1, max_new_tokens=3)
    many, _ = liang_debate(base, proc, recs, batch_size=3, max_new_tokens=3)
    assert [(r["pred"], r["n_tokens"]) for r in one] == [(r["pred"], r["n_tokens"]) for r in many]
    assert all(r["rounds"] == 3 and r["decided_by"] == "judge" and 11 <= r["n_tokens"] <= 33 for r in one)


@pytest.mark.parametrize("ratios, want", [([0.10, 0.13], "reproduced"), ([0.10, 0.5], "direction only"),
                                          ([0.5, 1.0], "not reproduced")])
def test_ratio_reading(ratios, want):
    from eval.toys.mod_mad import ratio_reading
    assert ratio_reading(ratios, 0.13) == want


def test_protocol_rows_hand_computed(tmp_path):
    """Two seeds, two questions: MoD-Multi 10 tokens and 1 s per question, Liang (one greedy run
    for both seeds) 100 tokens and 4 s, Du 20 / 25 tokens and 2 s: ratios 0.1 (reproduced
    against 0.13) and 0.5 / 0.4 (direction only); walls 0.25 and 0.5."""
    from eval.toys.mod_mad import protocol_rows
    runs = tmp_path / "protocols" / "runs"
    runs.mkdir(parents=True)

    def put(arm, seed, toks, wall, correct, extra=None):
        res = [dict({"correct": c, "n_tokens": toks}, **(extra or {})) for c in correct]
        name = f"{arm}_b64.json" if arm == "mad_liang" else f"{arm}_b64_s{seed}.json"
        (runs / name).write_text(json.dumps({"arm": arm, "seed": seed, "batch_size": 64, "n": len(res), "wall_s": wall,
                                             "threads": 1, "results": res}))
    for s in (0, 1):
        put("mod_multi1", s, 10, 2.0, [True, True])
        put("mad_du", s, 20 + 5 * (s == 0), 4.0, [True, False])
    put("mad_liang", 0, 100, 8.0, [False, False], {"rounds": 3, "decided_by": "judge"})
    rows, st = protocol_rows(str(tmp_path))
    ratio = {(r["key"], r["what"]): r for r in rows if r["kind"] == "protocol_ratio"}
    assert ratio[("mad_liang", "tokens")]["per_seed"] == [0.1, 0.1] and ratio[("mad_liang", "tokens")]["reading"] == "reproduced (2 seeds of 3)"
    assert ratio[("mad_liang", "wall")]["value"] == 0.25 and ratio[("mad_liang", "wall")]["reading"] == "reproduced (2 seeds of 3)"
    assert ratio[("mad_du", "tokens")]["per_seed"] == [0.4, 0.5] and ratio[("mad_du", "tokens")]["reading"] == "direction only (2 seeds of 3)"
    assert ratio[("mad_du", "wall")]["value"] == 0.5
    arm = {r["key"]: r for r in rows if r["kind"] == "protocol_arm"}
    assert arm["mad_liang"]["tokens_per_q"] == 100 and arm["mad_liang"]["judged_share"] == 1.0
    assert arm["mad_du"]["tokens_per_q"] == 22.5 and arm["mad_du"]["value"] == 0.5
    acc = {r["key"]: r for r in rows if r["kind"] == "protocol_accuracy"}
    assert acc["mad_liang"]["value"] == 1.0 and acc["mad_liang"]["per_seed"] == [1.0, 1.0]
    assert acc["mad_liang"]["verdict"] == "partial (2 seeds)" and st["seeds"] == [0, 1]
