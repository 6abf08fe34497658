"""eval.lm_harness without lm-eval installed: the Text3 requests (Winogrande's partial
evaluation included), the harness's pair tokenization, our log-likelihood scorer on a model
whose log-probabilities are known by hand, acc / acc_norm, the local task YAMLs, the
agreement comparison of eval.tools.lm_harness_check and the result file."""
import json
import math
import types

import pytest
import torch
from helpers import error_of, logits_tol, tol

from common.cli import run_cli
from eval import lm_harness as lh


# ----------------------------------------------------------------------------- requests (the harness's templates)

def test_arc_easy_requests_question_answer_template_and_digit_labels():
    doc = {"question": "Which is red?", "choices": {"text": ["a", "b c", "d"], "label": ["1", "2", "3"]},
           "answerKey": "2"}
    ctxs, conts, gold, choices = lh.requests("arc_easy", doc)
    assert ctxs == ["Question: Which is red?\nAnswer:"] * 3
    assert conts == [" a", " b c", " d"]           # target_delimiter " " + choice text
    assert gold == 1 and choices == ["a", "b c", "d"]


def test_piqa_requests():
    doc = {"goal": "To open a jar,", "sol1": "twist the lid.", "sol2": "kick it.", "label": 1}
    assert lh.requests("piqa", doc) == (["Question: To open a jar,\nAnswer:"] * 2, [" twist the lid.", " kick it."], 1,
                                        ["twist the lid.", "kick it."])


def test_winogrande_partial_evaluation():
    doc = {"sentence": "Ann gave Bea the book because _ was  done reading.", "option1": "Ann", "option2": "Bea",
           "answer": "1"}
    ctxs, conts, gold, _ = lh.requests("winogrande", doc)
    # the options fill the blank inside the *context*; only the words after the blank are scored
    assert ctxs == ["Ann gave Bea the book because Ann", "Ann gave Bea the book because Bea"]
    assert conts == [" was  done reading.", " was  done reading."]
    assert gold == 0
    assert lh.requests("winogrande", dict(doc, answer="2"))[2] == 1


def test_requests_errors_name_the_schema():
    with pytest.raises(lh.HarnessError, match="schema"):
        lh.requests("piqa", {"goal": "x"})
    with pytest.raises(lh.HarnessError, match="schema"):   # gold not among the labels
        lh.requests("arc_easy", {"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "B"})
    with pytest.raises(lh.HarnessError, match="unknown task"):
        lh.requests("hellaswag", {})


# ----------------------------------------------------------------------------- tokenization of a pair

class MergeTok:
    """Character tokenizer with one merge: "ab" is one token (id 99); others ord(c); with
    `bos` a Llama-style BOS (id 1, text "<s>") is prepended unless add_special_tokens=False."""
    eos_token_id, pad_token_id = 3, 0

    def __init__(self, bos=False):
        self.bos_token_id = 1 if bos else None

    def decode(self, i):
        return {1: "<s>", 3: "</s>"}[i]

    def encode(self, s, add_special_tokens=True):
        out, i = [1] if add_special_tokens and self.bos_token_id else [], 0
        while i < len(s):
            if s[i:i + 2] == "ab":
                out.append(99)
                i += 2
            else:
                out.append(ord(s[i]))
                i += 1
        return out


def test_encode_pair_moves_trailing_space_and_scores_a_boundary_merge_with_the_continuation():
    tok = MergeTok()
    assert lh.encode_pair(tok, "xy ", "z") == ([ord("x"), ord("y")], [ord(" "), ord("z")])
    # "ca" | "bd": whole = [c, 99, d], context = [c, a] -> continuation = whole[2:] = [d] (the merged "ab"
    # token is skipped, as the harness does: whole[len(context ids):])
    assert lh.encode_pair(tok, "ca", "bd") == ([ord("c"), ord("a")], [ord("d")])
    assert lh.encode_pair(tok, "", "ab") == ([3], [99])  # empty context: EOS (no BOS) as prefix
    bos = MergeTok(bos=True)                               # the tokenizer's own BOS goes on the context
    assert lh.encode_pair(bos, "xy ", "z") == ([1, ord("x"), ord("y")], [ord(" "), ord("z")])
    assert lh.encode_pair(bos, "", "z") == ([1], [ord("z")])
    assert lh.encode_pair(bos, "<s>x", "y") == ([ord(c) for c in "<s>x"], [ord("y")])  # already starts with BOS text


# ----------------------------------------------------------------------------- the scorer on a bigram model

class Bigram(torch.nn.Module):
    """logits[t] = table[ids[t]] + pos[t]: the log-probability of a sequence is known by hand
    (and depends on where the input starts, so a missing left cut shows)."""

    def __init__(self, vocab=128, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(256, vocab, generator=g))
        self.config = types.SimpleNamespace(max_position_embeddings=256)

    def forward(self, input_ids, attention_mask=None):
        return types.SimpleNamespace(logits=self.table[input_ids] + self.pos[:input_ids.shape[1]])


class CharTok:
    bos_token_id, eos_token_id, pad_token_id = None, 3, 0

    def decode(self, i):
        return "</s>"

    def encode(self, s, add_special_tokens=True):
        return [ord(c) for c in s]


def by_hand(model, ctx, cont):
    """sum over the continuation of log softmax(table[prev] + pos[position of prev])[next]."""
    ids = [ord(c) for c in ctx + cont]
    t_, p_ = model.table.detach(), model.pos.detach()
    return sum(float(torch.log_softmax(t_[ids[t - 1]] + p_[t - 1], -1)[ids[t]]) for t in range(len(ctx), len(ids)))


def ll_tol(model, cont):
    """fp32 log-likelihood of a continuation of n characters under the bigram, against the hand sum:
    each logit one addition (table + pos), each log-softmax V + 4 steps of the largest |logit|, n summed."""
    n = len(cont)
    scale = (model.table.abs().max() + model.pos.abs().max()).item()
    return tol(torch.float32, model.table.shape[1] + 4 + n, n * scale)


def test_loglikelihoods_equal_the_hand_sum_and_do_not_depend_on_batching():
    model, tok = Bigram(), CharTok()
    pairs = [("Question: q\nAnswer:", " yes"), ("ab", " c"), ("a much longer context here", " x y z")]
    got = lh.loglikelihoods(model, tok, pairs, batch_size=3)
    for (ctx, cont), (ll, _) in zip(pairs, got):
        assert ll == pytest.approx(by_hand(model, ctx, cont), rel=0, abs=ll_tol(model, cont))
    one = lh.loglikelihoods(model, tok, pairs, batch_size=1)
    for (ctx, cont), (a, _), (b, _) in zip(pairs, one, got):
        assert a == pytest.approx(b, rel=0, abs=2 * ll_tol(model, cont))     # both sides round
    # greedy: every continuation token is the argmax after its predecessor
    nxt = int((model.table[ord("a")] + model.pos[0]).argmax())
    assert lh.loglikelihoods(model, tok, [("a", chr(nxt))])[0][1] is True


def test_loglikelihoods_cut_long_inputs_on_the_left_as_the_harness_does():
    model, tok = Bigram(), CharTok()
    ll = lh.loglikelihoods(model, tok, [("abcdefgh", "ij")], max_length=4)[0][0]
    # input "fghi" predicts h->i, i->j
    assert ll == pytest.approx(by_hand(model, "fgh", "ij"), rel=0, abs=ll_tol(model, "ij"))


def test_winogrande_scores_only_the_continuation():
    model, tok = Bigram(), CharTok()
    doc = {"sentence": "Al met Bo so _ left.", "option1": "Al", "option2": "Bo", "answer": "2"}
    rows, metrics = lh.score_docs(model, tok, "winogrande", [doc])
    want = [by_hand(model, "Al met Bo so Al", " left."), by_hand(model, "Al met Bo so Bo", " left.")]
    assert rows[0]["lls"] == pytest.approx(want, rel=0, abs=ll_tol(model, " left."))
    assert metrics == {"acc": float(int(want[1] > want[0]))}


def test_pick_acc_and_acc_norm_differ_by_character_length():
    # lls -4 (4 chars: -1/char) and -6 (12 chars: -0.5/char): acc picks 0, acc_norm picks 1
    assert lh.pick([-4.0, -6.0], ["abcd", "abcdefghijkl"], gold=1) == {"acc": 0.0, "acc_norm": 1.0, "pred": 0,
                                                                     "pred_norm": 1}
    assert lh.pick([-1.0, -1.0], ["a", "b"], gold=0)["pred"] == 0   # ties: the first
    # the length is the choice's, without the target delimiter: -1/1 < -2.2/3 (with " ": -1/2 > -2.2/4)
    assert lh.pick([-1.0, -2.2], ["a", "abc"], gold=1)["pred_norm"] == 1


def test_score_docs_on_synthetic_documents_of_every_task():
    model, tok = Bigram(), CharTok()
    for task, docs in lh.synthetic_docs(6).items():
        rows, metrics = lh.score_docs(model, tok, task, docs, batch_size=4)
        assert len(rows) == 6 and set(metrics) == set(lh.METRICS[task])
        for r, d in zip(rows, docs):
            ctxs, conts, gold, _ = lh.requests(task, d)
            for ll, c, o in zip(r["lls"], ctxs, conts):
                assert ll == pytest.approx(by_hand(model, c, o), rel=0, abs=ll_tol(model, o))
            assert r["gold"] == gold


# ----------------------------------------------------------------------------- local task YAMLs

ARC_YAML = """tag:
  - ai2_arc
task: arc_easy
dataset_path: allenai/ai2_arc
dataset_name: ARC-Easy
output_type: multiple_choice
training_split: train
validation_split: validation
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{choices.label.index(answerKey)}}"
doc_to_choice: "{{choices.text}}"
metric_list:
  - metric: acc
    aggregation: mean
metadata:
  version: 1.0
"""


def test_local_task_yaml_reads_the_file_and_keeps_the_templates(tmp_path):
    text = lh.local_task_yaml(ARC_YAML, "arc_easy_local", str(tmp_path / "arc.jsonl"))
    lines = text.splitlines()
    assert lines[0] == 'task: "arc_easy_local"' and "dataset_path: json" in lines
    assert f'    test: "{tmp_path / "arc.jsonl"}"' in lines and "test_split: test" in lines
    for kept in ('doc_to_text: "Question: {{question}}\\nAnswer:"', 'doc_to_choice: "{{choices.text}}"',
                 "  - metric: acc", "output_type: multiple_choice"):
        assert kept in lines
    for gone in ("ai2_arc", "ARC-Easy", "training_split", "validation_split", "task: arc_easy"):
        assert not any(gone in l for l in lines), gone
    assert sum(l.startswith("test_split") for l in lines) == 1


# ----------------------------------------------------------------------------- agreement rows

def test_compare_equal_within_tolerance_and_each_way_of_differing():
    ours = [{"doc": 0, "lls": [-1.0, -2.0], "pred": 0}, {"doc": 1, "lls": [-3.0, -1.0], "pred": 1}]
    theirs = {0: [-1.00002, -2.0], 1: [-3.0, -0.99999]}
    row = lh.compare(ours, {"acc": 0.5}, theirs, {"acc": 0.5})
    # 1.00002 - 1.0 in float64: the literal's rounding and the subtraction's, of values near 1
    diff_tol = tol(torch.float64, 2, 1.0)
    assert row["equal"] and row["preds_differ"] == 0
    assert row["max_abs_ll_diff"] == pytest.approx(2e-5, rel=0, abs=diff_tol)
    assert not lh.compare(ours, {"acc": 0.5}, {0: [-1.001, -2.0], 1: [-3.0, -1.0]}, {"acc": 0.5})["equal"]
    flip = lh.compare(ours, {"acc": 0.5}, {0: [-2.5, -2.0], 1: [-3.0, -1.0]}, {"acc": 0.5}, tol=1.0)
    assert flip["preds_differ"] == 1 and not flip["equal"]
    assert not lh.compare(ours, {"acc": 0.5}, theirs, {"acc": 1.0})["equal"]       # metric differs
    assert not lh.compare(ours, {"acc": 0.5}, {0: [-1.0, -2.0]}, {"acc": 0.5})["equal"]  # a document missing


# ----------------------------------------------------------------------------- result file

def rows_of(accs):
    out = []
    for task, acc in accs.items():
        m = {"acc": acc, "acc_stderr": 0.01, "n": 1000, **({"acc_norm": acc / 2} if task != "winogrande" else {})}
        out += lh.result_rows("m", task, m)
    return out


def test_result_rows_and_text3_mean_of_acc():
    rows = rows_of({"arc_easy": 0.7, "piqa": 0.8})
    assert [(r["task"], r["metric"], r["paper"]) for r in rows] == [
        ("arc_easy", "acc", True), ("arc_easy", "acc_norm", False), ("piqa", "acc", True), ("piqa", "acc_norm", False)]
    assert rows[0]["score"] == pytest.approx(70.0)
    assert lh.text3_row(rows) is None                              # winogrande still missing
    t3 = lh.text3_row(rows + rows_of({"winogrande": 0.6}))
    assert t3["score"] == pytest.approx(70.0) and t3["n"] == 3000   # (70 + 80 + 60) / 3, acc_norm not used


def test_result_file_resumes_and_refuses_other_settings(tmp_path):
    out = str(tmp_path / "r.json")
    settings = {"model": "m", "limit": 1000, "dtype": "auto", "lm_eval": "0.4.13", "num_fewshot": 0,
                "tasks": list(lh.TEXT3)}
    assert lh.load_result(out, settings) == ([], {})
    rows = rows_of({"arc_easy": 0.7, "piqa": 0.8, "winogrande": 0.6})
    lh.write_result(out, settings, rows, {"piqa": []}, "python -m eval.lm_harness --model m")
    saved = json.load(open(out))
    assert saved["experiment"] == "text3" and saved["rows"][-1]["task"] == "text3"
    assert not list(tmp_path.glob("*.tmp*"))
    got, samples = lh.load_result(out, dict(settings, tasks=["piqa"]))   # another task subset resumes
    assert got == rows and samples == {"piqa": []}
    with pytest.raises(lh.HarnessError, match="limit: saved 1000, now 20"):
        lh.load_result(out, dict(settings, limit=20))
    assert lh.load_result(out, dict(settings, limit=20), overwrite=True) == ([], {})
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(lh.HarnessError, match="not a result file"):
        lh.load_result(str(tmp_path / "x.json"), settings)


def test_cli_without_lm_eval_names_the_venv_command(tmp_path, capsys):
    pytest.importorskip("torch")
    try:
        import lm_eval  # noqa: F401
        pytest.skip("lm-eval is installed here")
    except ImportError:
        pass
    err = error_of(lambda argv: run_cli(lh.main, argv), ["--model", "tiny-moe", "--out", str(tmp_path / "t.json")],
                   capsys)
    assert "lm-eval 0.4.13" in err and "eval.tools.lm_harness_check" in err and "Traceback" not in err
    assert not (tmp_path / "t.json").exists()
    err = error_of(lambda argv: run_cli(lh.main, argv), ["--model", "tiny-moe", "--tasks", "hellaswag"], capsys)
    assert "not a Text3 task" in err


def test_tiny_moe_vlm_scores_text_alone_padding_does_not_leak():
    """load_lm on the committed Qwen3-VL-MoE (image-text-to-text class, called on text): a
    right-padded batch gives each pair's unpadded single-sequence log-likelihood."""
    model, tok = lh.load_lm("tiny-moe")
    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    pairs = [("Question: Which shape is red?\nAnswer:", " the circle"), ("The cat sat on the", " mat."),
             ("A much longer context that will force padding of the two shorter rows in this batch,", " yes")]
    batched = [ll for ll, _ in lh.loglikelihoods(model, tok, pairs, batch_size=3)]
    L = max(sum(len(x) for x in lh.encode_pair(tok, ctx, cont)) for ctx, cont in pairs)
    for (ctx, cont), ll in zip(pairs, batched):
        c, o = lh.encode_pair(tok, ctx, cont)
        ids = torch.tensor([c + o])
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()[0]
        lp = torch.log_softmax(logits, -1)
        want = sum(float(lp[len(c) + k - 1, t]) for k, t in enumerate(o))
        # each log-prob moves by at most 2 x the logits' error; then the log-softmax and the sum
        bound = 2 * len(o) * logits_tol(model, L, logits) + tol(torch.float32, logits.shape[-1] + len(o), abs(want))
        assert ll == pytest.approx(want, rel=0, abs=bound)


def test_load_lm_errors(tmp_path):
    with pytest.raises(lh.HarnessError, match="no such checkpoint"):
        lh.load_lm(str(tmp_path / "nope"))
    (tmp_path / "c").mkdir()
    with pytest.raises(lh.HarnessError, match="no config.json"):
        lh.load_lm(str(tmp_path / "c"))
