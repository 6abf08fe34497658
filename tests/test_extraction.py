"""Answer extraction on real-style VLM outputs: one table row per convention of
`eval.metrics.extract` (README, "Data formats and scoring"), then exact values of reported cases
(wrapped answers, answers on the next line, reasoning blocks, five options, gold lists)."""
import json

import pytest
from PIL import Image

from eval.metrics import anls, extract, is_correct, short_answer

OPTS = ["red circle", "blue square", "green triangle", "yellow circle"]

# (model output, answer type, expected extraction, allowed letters or None for the default A-D)
TABLE = [
    # wrappers: markdown, quotes, code, boxed, JSON
    ("Answer: **D**", "letter", "D", None),
    ("**Answer:** B", "letter", "B", None),
    ("**Answer**: C", "letter", "C", None),
    ("Answer: `A`", "letter", "A", None),
    ("[D]", "letter", "D", None),
    ('I would say "Yes".', "yesno", "yes", None),
    ("**Yes**", "yesno", "yes", None),
    ("The answer is **no**.", "yesno", "no", None),
    ("Final Answer: $\\boxed{7}$", "number", "7", None),
    ("The final answer is \\boxed{C}.", "letter", "C", None),
    ('```json\n{"Reasoning": "two cats on the sofa", "Answer": "2"}\n```', "number", "2", None),
    ('{"Reasoning": "I see a red circle top left", "Answer": "(C)"}', "letter", "C", None),
    ('{"Reasoning": "tl red circle", "Answer": "yes"', "yesno", "yes", None),            # cut-off debate JSON
    ("### Answer\n**E**", "letter", "E", "ABCDE"),
    ("> Answer: 'red'", "word", "red", None),
    ("**Blue**", "word", "blue", None),
    # position: next line, leading newline, marker late, several markers
    ("Answer:\nB", "letter", "B", None),
    ("\nYes", "yesno", "yes", None),
    ("\n\n  3", "number", "3", None),
    ("Answer:\n\n(C) green triangle", "letter", "C", None),
    ("The circle is red.\nAnswer: no", "yesno", "no", None),
    ("Answer: yes\nExplanation: no other shape is red.", "yesno", "yes", None),
    ("Explanation: the dog is brown.\nFinal answer: brown", "word", "brown", None),
    ("Answer: B. The square is on the left. That is my answer.", "letter", "B", None),
    ("Let me look at the image.\nThere are 4 squares.", "number", "4", None),      # span has none: last in text
    ("I think it is.\nThe image clearly shows a dog, yes.", "yesno", "yes", None),   # VLMEvalKit whole-text rule
    # reasoning blocks
    ("<think>\nThe Answer could be A\n</think>\n\nB", "letter", "B", None),
    ("<think>Counting: 1, 2, 3, 4, 5.</think>\nThere are three circles.", "number", "3", None),
    ("The dog is behind the fence, so no.</think>\n\nYes", "yesno", "yes", None),    # opening tag was in the prompt
    ("<think>No wait.</think><think>Yes, I see it.</think>Answer: No", "yesno", "no", None),
    ("<think>\nOption A looks wrong.\n</think>\nThe correct option is (D).", "letter", "D", None),
    ("<think>\nIs there a cat? Maybe yes.\n", "yesno", "", None),                     # unclosed: no answer
    # letters, including beyond D
    ("E. blue square", "letter", "E", "ABCDE"),
    ("E. blue square", "letter", "e blue square", "ABCD"),                           # no option E: no letter
    ("(E)", "letter", "E", "ABCDE"),
    ("F", "letter", "F", "ABCDEF"),
    ("The answer is E", "letter", "E", "ABCDE"),
    ("G: seven", "letter", "G", "ABCDEFGH"),
    ("I", "letter", "I", "ABCDEFGHI"),
    ("I think the answer is (B).", "letter", "B", None),
    ("I choose C because it is red.", "letter", "C", None),                          # "I" is the pronoun
    ("A. red circle", "letter", "A", None),
    ("A red circle", "letter", "red circle", None),                                  # "A" is the article
    ("b", "letter", "B", None),
    ("B) cat", "letter", "B", None),
    ("Option C is correct.", "letter", "C", None),
    ("C is correct.", "letter", "C", None),
    ("The answer is C.", "letter", "C", None),
    # yes / no forms
    ("Yes, there is a red circle.", "yesno", "yes", None),
    ("No.", "yesno", "no", None),
    ("YES", "yesno", "yes", None),
    ("no, there isn't", "yesno", "no", None),
    ("There is no red circle in the image.", "yesno", "no", None),
    ("Yes. There is no other circle.", "yesno", "yes", None),                        # first word of the span
    ("The circle is to the left.\nSo the answer is yes.", "yesno", "yes", None),
    ("Nope", "yesno", "nope", None),                                                 # only yes/no count
    ("Not at all.", "yesno", "not at all", None),
    ("Yesterday it was.", "yesno", "yesterday it was", None),
    # numbers and number words
    ("three", "number", "3", None),
    ("There are Ten.", "number", "10", None),
    ("Answer: 3 circles", "number", "3", None),
    ("1,000", "number", "1000", None),
    ("2.0", "number", "2", None),
    ("-4", "number", "-4", None),
    ("0.5", "number", "0.5", None),
    ("None.", "number", "0", None),
    ("twelve", "number", "12", None),
    ("There are two red squares and one blue circle.", "number", "2", None),
    ("$1,250.50", "number", "1250.5", None),
    ("The year is 1986.", "number", "1986", None),
    ("tl red circle + tc empty - 1tl 2mc. Answer: 2", "number", "2", None),
    ("tl red circle + 1tl", "number", "tl red circle 1tl", None),                  # marks are not numbers
    # free text
    ("Answer: The Red.", "word", "red", None),
    ("Two dogs", "word", "2 dogs", None),
]


def _extract(text, answer_type, letters):
    return extract(text, answer_type) if letters is None else extract(text, answer_type, letters)


@pytest.mark.parametrize("text,answer_type,want,letters", TABLE)
def test_extraction_table(text, answer_type, want, letters):
    assert _extract(text, answer_type, letters) == want


def test_table_is_wide():
    assert len(TABLE) >= 40
    assert {t for _, t, _, _ in TABLE} == {"letter", "yesno", "number", "word"}
    assert sum("<think>" in x or "</think>" in x for x, *_ in TABLE) >= 5
    assert sum(L is not None and len(L) > 4 for *_, L in TABLE) >= 5


def test_option_text_and_article():
    """VLMEvalKit can_infer_text: exactly one option's text in the answer gives its letter;
    "A red circle" is option A when that is option A's text, the article otherwise."""
    assert extract("The blue square.", "letter", options=OPTS) == "B"
    assert extract("A red circle", "letter", options=OPTS) == "A"
    assert extract("A blue square", "letter", options=OPTS) == "B"
    assert extract("red circle or blue square", "letter", options=OPTS) == "red circle or blue square"


def test_short_answer_keeps_quotes_and_lines():
    assert short_answer('I would say "Yes".').lower().endswith('"yes')
    assert short_answer("x. Answer: first\nsecond line") == "first"
    assert short_answer('{"Reasoning": "r", "Answer": "B"}') == "B"


# ----------------------------------------------------------------------------- reported cases, exact values

def test_issue_wrapped_answers():
    assert extract("Answer: **D**", "letter") == "D"
    assert extract("**Answer:** B", "letter") == "B"
    assert extract('I would say "Yes".', "yesno") == "yes"
    assert is_correct("Answer: **D**", "D", "mc") and is_correct('I would say "Yes".', "yes", "existence")


def test_issue_next_line():
    assert extract("Answer:\nB", "letter") == "B"
    assert extract("\nYes", "yesno") == "yes"
    assert is_correct("Answer:\nB", "B", "mc") and is_correct("\nYes", "yes", "existence")


def test_issue_reasoning_block():
    out = "<think>\nThe Answer could be A\n</think>\n\nB"
    assert is_correct(out, "B", "mc") and not is_correct(out, "A", "mc")


def test_issue_five_options():
    assert is_correct("E. blue square", "E", "mc")                                  # letters widened by the gold
    opts = [("A", "red circle"), ("B", "green square"), ("C", "red square"), ("D", "yellow circle"),
            ("E", "blue square")]
    assert is_correct("E. blue square", "E", "mc", options=opts)
    assert is_correct("blue square", "E", "mc", options=opts)                       # option text -> E
    assert not is_correct("E. blue square", "D", "mc", options=opts)


def test_issue_gold_list_through_reader(tmp_path):
    from eval.evaluate import extra_metrics, majority_answers
    from eval.readers import read_any
    Image.new("RGB", (28, 28)).save(tmp_path / "p.png")
    rows = [{"id": "d1", "image": "p.png", "question": "What year?", "answer": ["1986", "1986."]},
            {"id": "d2", "image": "p.png", "question": "What year?", "answer": "1990"},
            {"id": "d3", "image": "p.png", "question": "Which?", "answer": ["E", "blue square"], "family": "mc",
             "options": ["red circle", "green square", "red square", "yellow circle", "blue square"]}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    d1, d2, d3 = read_any(str(tmp_path / "b.jsonl"))
    assert d1["answer"] == ["1986", "1986."] and d1["target"] == "1986"           # first gold trains
    assert d2["answer"] == "1990" and d2["target"] == "1990"
    assert d3["answer"] == ["E", "E"] and d3["target"] == "E"                       # option text -> letter
    assert is_correct("1986", d1["answer"], d1["family"]) and is_correct("1986.", d1["answer"], d1["family"])
    assert not is_correct("1987", d1["answer"], d1["family"])
    assert anls(["1986"], [d1["answer"]]) == 1.0
    res = [{"family": d1["family"], "pred": "Answer: 1986", "answer": d1["answer"]},
           {"family": d2["family"], "pred": "1990", "answer": d2["answer"]}]
    assert extra_metrics(res)[1]["unlabelled"] == 1.0            # records without a family
    # majority: the answer acceptable for the most records
    best = majority_answers([{"family": "all", "answer": ["x", "y"]}, {"family": "all", "answer": "y"},
                             {"family": "all", "answer": "x"}, {"family": "all", "answer": ["y", "z"]}])
    assert best["all"] == ("y", [True, True, False, True])


def test_reader_refuses_bad_answers(tmp_path):
    from common.data import DataError
    from eval.readers import read_jsonl
    Image.new("RGB", (28, 28)).save(tmp_path / "p.png")
    for bad, msg in [([], r"lacks required field\(s\) \['answer'\]"), (["1986", ""], "list of acceptable"),
                     ({"text": "x"}, "list of acceptable"), (True, "yes/no answers as text")]:
        (tmp_path / "b.jsonl").write_text(json.dumps({"id": "q1", "image": "p.png", "question": "?", "answer": bad}))
        with pytest.raises(DataError, match=msg):
            read_jsonl(str(tmp_path / "b.jsonl"))
