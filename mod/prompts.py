"""Prompt shapes shared by MoD inference / data synthesis (`mod/`) and the chat pretraining of
the tiny base (`eval.tools.pretrain`): the debate prompt and JSON response format of "Mixture of
Debaters: Learn to Debate at Architectural Level in Multi-Agent Reasoning" (arXiv 2606.29425;
§3.2, Alg. 2, App. B), self-correction and multi-agent-debate turns, and the shapes world's
wrong responses used as misleading priors.
"""
import json

from common.data import DataError
from common.shapes import sample_scene, target_text
from common.answers import final_answer

DEBATE_PROMPT = "Review the following responses from other assistants and determine your final answer."
JSON_INSTRUCTION = 'Reply in JSON with the keys "Reasoning" and "Answer".'


def to_json_response(text):
    """A response in the debate format. Base-model outputs 'scene. Answer: X' become
    {"Reasoning": "scene", "Answer": "X"}; text already in that JSON form is normalised;
    anything else keeps its text as reasoning with `final_answer` as the answer."""
    t = text.strip()
    if t.startswith("{"):
        try:
            obj = json.loads(t)
            if isinstance(obj, dict) and "Answer" in obj:
                return json.dumps({"Reasoning": str(obj.get("Reasoning", "")), "Answer": str(obj["Answer"])}, ensure_ascii=False)
        except json.JSONDecodeError:
            pass
    reasoning = t.rsplit("Answer", 1)[0].strip().rstrip(".").strip() if "Answer" in t else t
    return json.dumps({"Reasoning": reasoning, "Answer": final_answer(t)}, ensure_ascii=False)


def single_prompt(question):
    """Round-0 prompt (MoD-Single, LoRA, MoE-LoRA): the question and the JSON instruction."""
    return f"{question}\n{JSON_INSTRUCTION}"


def debate_prompt(question, responses):
    """Q + D + prior responses (eq. 8 context; Alg. 2 line 9). No responses -> single_prompt."""
    if not responses:
        return single_prompt(question)
    listed = "\n".join(f"Response {i + 1}: {r}" for i, r in enumerate(responses))
    return f"{question}\n{DEBATE_PROMPT}\n{listed}\n{JSON_INSTRUCTION}"


def review_prompt(question, previous):
    """Self-correction round on the base model: the question, its previous answer, a review request."""
    return (f"{question}\nYour previous answer: {previous}\n"
            "Review your previous answer, find any mistakes and give your final answer.")


def debater_prompt(question, other, own):
    """Multi-agent debate: a debater reads the other debater's latest response and its own."""
    return f"{question}\n{DEBATE_PROMPT}\nResponse 1: {other}\nYour previous response: {own}"


def judge_prompt(question, first, second):
    """Multi-agent debate: the judge reads both debaters' final responses."""
    return f"{question}\nYou are the judge. {DEBATE_PROMPT}\nResponse 1: {first}\nResponse 2: {second}"


# Answers a response can give per family; a wrong response picks one that is not the gold one.
ANSWER_SPACE = {"existence": ["yes", "no"], "spatial": ["yes", "no"], "count": ["0", "1", "2", "3", "4"],
                "colour": ["red", "green", "blue", "yellow"], "mc": ["A", "B", "C", "D"]}


def wrong_response(rng, question, answer, family):
    """A plausible wrong response on the shapes world, in the base's plain format: the marked
    scene of another random scene for the same question and an answer other than `answer`
    ("tl empty - ... br red circle +. Answer: no"). Used as a misleading prior response.
    Raises DataError for a family outside the shapes world (no answer space to draw from)."""
    if family not in ANSWER_SPACE:
        raise DataError(f"misled prompts need a shapes-world family ({', '.join(ANSWER_SPACE)}) to draw a "
                             f"wrong answer from, got {family!r}; leave misled / base-misled out for this data")
    scene = sample_scene(rng)
    wrong = rng.choice([w for w in ANSWER_SPACE[family] if w != str(answer)])
    return target_text(scene, wrong, question)
