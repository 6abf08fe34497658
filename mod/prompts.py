"""Prompt shapes shared by MoD inference / data synthesis (`mod/`) and the chat pretraining of
the tiny base (`eval.tools.pretrain`): the debate prompt and JSON response format of "Mixture of
Debaters: Learn to Debate at Architectural Level in Multi-Agent Reasoning" (arXiv 2606.29425;
§3.2, Alg. 2, App. B), self-correction and multi-agent-debate turns, and the shapes world's
wrong responses used as misleading priors.
"""
import ast
import json
import re

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


# Multi-agent debate as Liang et al. run it (EMNLP 2024; official code github.com/Skytliang/
# Multi-Agents-Debate, `interactive.py` with `code/utils/config4all.json`): the prompt texts of
# that config, verbatim, with its ##placeholders##; the debate topic is the record's question.
# `mod.infer.liang_debate` fills them (`liang_prompt`); every text of the protocol is here.
LIANG_PROMPTS = {
    "player_meta_prompt": "You are a debater. Hello and welcome to the debate. It's not necessary to fully agree "
                          "with each other's perspectives, as our objective is to find the correct answer.\n"
                          "The debate topic is stated as follows:\n##debate_topic##",
    "moderator_meta_prompt": "You are a moderator. There will be two debaters involved in a debate. They will present "
                             "their answers and discuss their perspectives on the following topic: "
                             "\"##debate_topic##\"\nAt the end of each round, you will evaluate answers and decide "
                             "which is correct.",
    "affirmative_prompt": "##debate_topic##",
    "negative_prompt": "##aff_ans##\n\nYou disagree with my answer. Provide your answer and reasons.",
    "moderator_prompt": "Now the ##round## round of debate for both sides has ended.\n\nAffirmative side arguing:\n"
                        "##aff_ans##\n\nNegative side arguing: ##neg_ans##\n\nYou, as the moderator, will evaluate "
                        "both sides' answers and determine if there is a clear preference for an answer candidate. "
                        "If so, please summarize your reasons for supporting affirmative/negative side and give the "
                        "final answer that you think is correct, and the debate will conclude. If not, the debate "
                        "will continue to the next round. Now please output your answer in json format, with the "
                        "format as follows: {\"Whether there is a preference\": \"Yes or No\", \"Supported Side\": "
                        "\"Affirmative or Negative\", \"Reason\": \"\", \"debate_answer\": \"\"}. Please strictly "
                        "output in JSON format, do not output irrelevant content.",
    "judge_prompt_last1": "Affirmative side arguing: ##aff_ans##\n\nNegative side arguing: ##neg_ans##\n\nNow, what "
                          "answer candidates do we have? Present them without reasons.",
    "judge_prompt_last2": "Therefore, ##debate_topic##\nPlease summarize your reasons and give the final answer that "
                          "you think is correct. Now please output your answer in json format, with the format as "
                          "follows: {\"Reason\": \"\", \"debate_answer\": \"\"}. Please strictly output in JSON "
                          "format, do not output irrelevant content.",
    "debate_prompt": "##oppo_ans##\n\nDo you agree with my perspective? Please provide your reasons and answer.",
}
ROUND_NAMES = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")


def liang_prompt(key, **fill):
    """LIANG_PROMPTS[key] with each ##name## replaced by fill[name] (e.g. debate_topic, aff_ans,
    neg_ans, oppo_ans, round). Raises KeyError for a placeholder left unfilled."""
    text = LIANG_PROMPTS[key]
    missing = [n for n in re.findall(r"##(\w+)##", text) if n not in fill]
    if missing:
        raise KeyError(f"liang_prompt({key!r}): placeholder ##{missing[0]}## not filled")
    for name, value in fill.items():
        text = text.replace(f"##{name}##", str(value))
    return text


def liang_decision(text):
    """The `debate_answer` of a moderator's or judge's JSON reply, stripped; None when the reply
    holds no such JSON object. The object is the text from its first "{" to its last "}" (a
    ```json fence or a sentence around it is ignored), read as JSON, else as a Python literal
    (the official code reads it with `eval`). "" (an empty answer) means "no preference"."""
    lo, hi = text.find("{"), text.rfind("}")
    if lo < 0 or hi < lo:
        return None
    body = text[lo:hi + 1]
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        try:
            obj = ast.literal_eval(body)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
    if not isinstance(obj, dict) or "debate_answer" not in obj:
        return None
    return str(obj["debate_answer"]).strip()
