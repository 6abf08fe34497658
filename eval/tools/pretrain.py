"""Pretrain the embedded tiny base VLMs from scratch on the shapes world.

    python -m eval.tools.pretrain --arch qwen3_vl     --out common/tiny/dense   # dense base
    python -m eval.tools.pretrain --arch qwen3_vl_moe --out common/tiny/moe     # MoE base
    python -m eval.tools.pretrain --init common/tiny/dense --chat-mix 1,1,2,1,1 --wrong-priors 0 \
        --steps 800 --batch-size 16 --lr 1e-3 --out common/tiny/chat        # chat base (MoD toy)

Fresh examples every step (seeded by step, so a resumed run sees the same data), AdamW with
warmup + cosine, a progress bar, an atomic checkpoint every --save-every steps in
`{out}.ckpt/` and automatic resume from it. The result is `save_pretrained` into --out and
loads through `common.backbone.load_backbone` exactly like a real checkpoint.
The recipe and its measured time are in the README ("How the tiny base models learn").

`--init DIR --chat-mix w1,..,w5` continues a saved base on the prompt shapes the MoD toy
needs (`chat_example`): the plain question, the JSON instruction, the debate prompt with
prior responses, the self-correction review and the multi-agent-debate turns. It stands in for
the instruction following a real VLM brings to the paper's experiments. Prior responses are
the gold one or, with probability --wrong-priors, a wrong one (another scene's marks, a wrong
answer); the target is always correct. The committed `tiny-chat` used --wrong-priors 0: it
only ever saw agreeing priors and so learned to lean on them (misled by a wrong prior, as the
MoD paper says real VLMs are), which is what viewpoint-shift training is meant to fix.
"""
import json
import os
import random
import shutil
import time

import numpy as np
import torch
from tqdm import tqdm

from common import backbone as bb
from common import data, shapes
from common.checkpoint import CheckpointError, load_train_state, save_train_state
from common.cli import SAVE_EVERY, add_threads, entry_parser, fail, number, set_threads, step_tokens, token_ce
from common.schedule import lr_at
from mod import prompts as vs

LOOKS = ("full", "objects", "none")


def look_target(look, scene, answer, question):
    """The assistant turn a base is trained on, by look step: "full" (`shapes.target_text`, all nine
    cells marked), "objects" (`shapes.short_target_text`, the occupied cells only), "none" (the short
    "Answer: {answer}"). Raises ValueError for an unknown look."""
    if look == "full":
        return shapes.target_text(scene, answer, question)
    if look == "objects":
        return shapes.short_target_text(scene, answer, question)
    if look == "none":
        return f"Answer: {answer}"
    raise ValueError(f"unknown look {look!r}; choose from {LOOKS}")


def encode_examples(proc, ex, prompts=None, targets=None, look="full"):
    """(scene, family, question, answer) tuples -> training batch (rendered, patchified with the
    processor's patch / merge size through `VLProcessor.images`, the one image path, encoded).
    prompts / targets: per-example texts (default: the question and `look_target(look, ...)`)."""
    default = lambda s, a, q: look_target(look, s, a, q)
    return proc.encode([shapes.render(s) for s, _, _, _ in ex], prompts or [q for _, _, q, _ in ex],
                       targets or [default(s, a, q) for s, _, q, a in ex])


CHAT_FORMATS = ("plain", "json", "debate", "review", "mad")


def chat_example(rng, ex, fmt, wrong_priors=0.5):
    """(prompt, target, answer tail) of one shapes example `ex` = (scene, family, q, a) in the
    prompt shape `fmt` (one of CHAT_FORMATS; the shapes `mod.infer` uses):
      plain   the question                                   -> "marks. Answer: a"
      json    the question + JSON instruction                -> {"Reasoning": marks, "Answer": a}
      debate  question + debate prompt + 1-2 JSON priors     -> JSON
      review  question + a previous answer + review request  -> "marks. Answer: a"
      mad     a debater's turn or the judge's, 1-2 priors    -> "marks. Answer: a"
    A prior is the gold response or, with probability `wrong_priors`, a wrong one: the marks of
    another random scene for the same question and a wrong answer. With wrong_priors=0 every
    prior agrees with the target, so copying the prior's answer is as good as reading the image
    and the base may learn to anchor on priors. The answer tail is the target's
    last characters that hold the short answer (weighted by --answer-weight)."""
    scene, family, q, a = ex
    gold = shapes.target_text(scene, a, q)

    def response(as_json):
        text = gold if rng.random() < 1 - wrong_priors else vs.wrong_response(rng, q, a, family)
        return vs.to_json_response(text) if as_json else text

    if fmt == "plain":
        return q, gold, " " + a
    if fmt == "json":
        return vs.single_prompt(q), vs.to_json_response(gold), a + '"}'
    if fmt == "debate":
        return vs.debate_prompt(q, [response(True) for _ in range(rng.randint(1, 2))]), vs.to_json_response(gold), a + '"}'
    if fmt == "review":
        return vs.review_prompt(q, response(False)), gold, " " + a
    if rng.random() < 0.5:
        return vs.debater_prompt(q, response(False), response(False)), gold, " " + a
    return vs.judge_prompt(q, response(False), response(False)), gold, " " + a


def make_batch(proc, step, batch_size, seed, chat_mix=None, wrong_priors=0.5, look="full"):
    """Training batch for `step` (deterministic in (seed, step)), plus `answer_mask` [B, L]:
    True at the label positions of the final short answer and <|im_end|> (after "Answer:").
    chat_mix: None (the plain format only) or weights over CHAT_FORMATS (`chat_example`)."""
    rng = random.Random(seed * 1_000_003 + step)
    ex = [shapes.sample_example(rng) for _ in range(batch_size)]
    if chat_mix is None:
        batch = encode_examples(proc, ex, look=look)
        tails = [" " + a for _, _, _, a in ex]
    else:
        rows = [chat_example(rng, e, rng.choices(CHAT_FORMATS, weights=chat_mix)[0], wrong_priors) for e in ex]
        batch = encode_examples(proc, ex, [r[0] for r in rows], [r[1] for r in rows])
        tails = [r[2] for r in rows]
    ends = (batch["labels"] != -100).long().cumsum(1).max(1).values  # label tokens per row
    n_ans = torch.tensor([len(proc._tok(t)) + 1 for t in tails])  # " yes" + <|im_end|>
    rank = (batch["labels"] != -100).long().cumsum(1)
    answer_mask = (batch["labels"] != -100) & (rank > (ends - n_ans)[:, None])
    return batch, answer_mask


def answer_ce(logits, labels, answer_mask, n_tokens=None):
    """Next-token cross-entropy over the answer positions only (fp32): their mean, or with
    `n_tokens` their sum divided by it (the answer tokens of a whole optimizer step)."""
    lg, lab, m = logits[:, :-1], labels[:, 1:], answer_mask[:, 1:]
    if n_tokens is None:
        return torch.nn.functional.cross_entropy(lg[m].float(), lab[m])
    return torch.nn.functional.cross_entropy(lg[m].float(), lab[m], reduction="sum") / n_tokens


def accumulate(model, batch, answer_mask, grad_accum=1, answer_weight=1.0, is_moe=False):
    """Forward + backward of one optimizer step, its batch split into `grad_accum` micro-batches
    (rows i::grad_accum). loss = CE over all answer-turn tokens + answer_weight * CE over the
    short-answer tokens (the marked scene is ~32 of ~36 target tokens, so the answer gets its own
    term), each summed and divided by its token count over the whole step (`common.cli.token_ce`):
    1 x 4, 2 x 2 and 4 x 1 give the same gradient. The MoE router aux loss
    (router_aux_loss_coef * aux, a per-micro-batch mean) weighs 1 / grad_accum per micro-batch.
    Returns the step's loss (a detached scalar tensor)."""
    B = batch["input_ids"].shape[0]
    parts = [list(range(m, B, grad_accum)) for m in range(min(grad_accum, B))]
    n_lab = step_tokens([batch["labels"]])
    n_ans = max(float(answer_mask[:, 1:].sum()), 1.0)
    total = 0.0
    for rows in parts:
        mb = {k: (v[rows] if k not in ("pixel_values", "image_grid_thw") else v) for k, v in batch.items()}
        mb.update(_pixels_of(batch, rows))
        out = model(**{k: v for k, v in mb.items() if k != "labels"}, output_router_logits=is_moe)
        loss = token_ce(out.logits, mb["labels"], n_lab) + answer_weight * answer_ce(out.logits, mb["labels"],
                                                                                       answer_mask[rows], n_ans)
        if is_moe:
            loss = loss + model.config.get_text_config().router_aux_loss_coef * out.aux_loss / len(parts)
        loss.backward()
        total = total + loss.detach()
    return total


def _pixels_of(batch, rows):
    """pixel_values / image_grid_thw of the images of `rows` (one image per row)."""
    grid = batch["image_grid_thw"]
    n = grid.prod(-1)
    start = torch.cumsum(n, 0) - n
    return {"pixel_values": torch.cat([batch["pixel_values"][start[i]:start[i] + n[i]] for i in rows]),
            "image_grid_thw": grid[rows]}


@torch.no_grad()
def teacher_forced_eval(model, proc, n=400, seed=12345, batch_size=100, look="full"):
    """Fast validation: per family, the share of examples whose *whole* target (marked scene +
    answer) is the greedy argmax under teacher forcing (= greedy generation reproduces it
    exactly; a lower bound on answer accuracy), and answer-token accuracy given the true look
    step (the short answer after "Answer:" when the marked scene before it is given)."""
    model.eval()
    rng = random.Random(seed)
    ex = [shapes.sample_example(rng) for _ in range(n)]
    full, ans = {}, {}
    for i in range(0, n, batch_size):
        chunk = ex[i:i + batch_size]
        b = encode_examples(proc, chunk, look=look)
        logits = model(**{k: v for k, v in b.items() if k != "labels"}).logits
        pred, lab = logits[:, :-1].argmax(-1), b["labels"][:, 1:]
        for j, (s, fam, q, a) in enumerate(chunk):
            m = lab[j] != -100
            ok = (pred[j][m] == lab[j][m])
            n_ans = len(proc._tok(a)) + 1  # answer tokens + <|im_end|>
            full.setdefault(fam, []).append(bool(ok.all()))
            ans.setdefault(fam, []).append(bool(ok[-n_ans:].all()))
    model.train()
    return {f: {"full": float(np.mean(full[f])), "answer": float(np.mean(ans[f]))} for f in sorted(full)}


# Settings a resumed run must share with the checkpoint (the rest, e.g. --stop-at, may change).
RECIPE_KEYS = ("arch", "steps", "batch_size", "lr", "warmup", "hidden", "layers", "experts", "top_k", "seed",
               "answer_weight", "init", "chat_mix", "wrong_priors", "patch_size", "merge_size", "look",
               "expert_width")


def main():
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--arch", default="qwen3_vl", choices=["qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl"],
                   help="transformers architecture of the tiny base")
    p.add_argument("--out", required=True, help="save_pretrained directory of the result")
    p.add_argument("--steps", type=int, default=6000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32,
                   help="records per optimizer step, --grad-accum micro-batches together")
    p.add_argument("--grad-accum", type=number(min=1), default=1,
                   help="split each step's batch into this many micro-batches (memory); the loss is normalised by "
                        "the label tokens of the whole step, so the gradient is the same")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW, warmup + cosine)")
    p.add_argument("--warmup-ratio", dest="warmup", type=float, default=0.05,
                   help="linear warmup as a fraction of all optimizer steps (0-1)")
    p.add_argument("--hidden", type=int, default=128, help="text hidden size")
    p.add_argument("--layers", type=int, default=4, help="text decoder layers")
    p.add_argument("--experts", type=int, default=8, help="routed experts per layer (MoE arch)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (MoE arch)")
    p.add_argument("--patch-size", type=int, default=14, help="vision patch size (84 px image: 14 -> 6x6 patches)")
    p.add_argument("--merge-size", type=int, default=2,
                   help="vision spatial merge; image tokens = (84 / (patch * merge))^2 (14/2: 9, 7/1: 144)")
    p.add_argument("--expert-width", type=int, default=0,
                   help="routed expert intermediate size (MoE arch; 0 = --hidden)")
    p.add_argument("--look", default="full", choices=LOOKS,
                   help="assistant turn: full (all nine cells marked, then the answer), objects (the occupied "
                        "cells only: a short look step), none (the short 'Answer: yes' only)")
    p.add_argument("--answer-weight", type=float, default=1.0,
                   help="weight of the extra CE term on the short answer after 'Answer:' (0 = plain CE)")
    p.add_argument("--stop-at", type=int, default=0,
                   help="stop after this step and save (the lr schedule still spans --steps; 0 = run all)")
    p.add_argument("--seed", type=int, default=0, help="init + data seed")
    p.add_argument("--init", default="", help="continue from this saved base (checkpoint dir or tiny-dense) "
                   "instead of a fresh --arch model; its architecture and tokenizer are kept")
    p.add_argument("--chat-mix", default="", help="weights of the prompt shapes plain,json,debate,review,mad "
                   "(e.g. 1,1,2,1,1; empty = the plain shape only; see chat_example)")
    p.add_argument("--wrong-priors", type=number(float, min=0), default=0.5,
                   help="with --chat-mix: probability that a prior response in a prompt is wrong (0 = all agree)")
    p.add_argument("--overwrite", dest="fresh", action="store_true",
                   help="discard an existing {out}.ckpt and start over (default: continue it)")
    add_threads(p)
    p.add_argument("--eval-every", type=int, default=500, help="teacher-forced validation every N steps")
    p.add_argument("--save-every", dest="ckpt_every", type=int, default=SAVE_EVERY,
                   help="also checkpoint (atomically) every N optimizer steps (0 = only at the end)")
    a = p.parse_args()
    set_threads(a.threads)  # the tiny bases: one thread unless asked
    chat_mix = None
    if a.chat_mix:
        try:
            chat_mix = [float(w) for w in a.chat_mix.split(",")]
        except ValueError:
            chat_mix = []
        if len(chat_mix) != len(CHAT_FORMATS) or min(chat_mix) < 0 or sum(chat_mix) <= 0:
            p.error(f"--chat-mix needs {len(CHAT_FORMATS)} non-negative weights for {','.join(CHAT_FORMATS)}, "
                    f"not all zero (got {a.chat_mix!r})")
    if a.wrong_priors > 1:
        p.error(f"--wrong-priors is a probability in [0, 1], got {a.wrong_priors}")
    if a.init:
        torch.manual_seed(a.seed)
        model, proc = bb.load_backbone(a.init)
        a.arch = model.config.model_type
    else:
        kw = dict(patch_size=a.patch_size, merge_size=a.merge_size) if a.arch.startswith("qwen3_vl") else {}
        if a.expert_width:
            kw["expert_width"] = a.expert_width
        model, proc = bb.build_tiny(a.arch, seed=a.seed, hidden=a.hidden, layers=a.layers,
                                    experts=a.experts, top_k=a.top_k, **kw)
    is_moe = a.arch.endswith("moe")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=0.01)
    ckpt, step, log = a.out.rstrip("/") + ".ckpt", 0, []
    if a.fresh:
        shutil.rmtree(ckpt, ignore_errors=True)
    recipe = {k: getattr(a, k) for k in RECIPE_KEYS}
    if a.init:  # the starting weights, not the path they were read from
        recipe["init"] = bb.base_identity(model)["weights"]
    try:
        tensors, state = load_train_state(ckpt, opt)
    except CheckpointError as e:
        fail(f"{e}; or pass --overwrite to start over")
    if tensors is not None:
        saved = state["recipe"]
        diff = {k: (saved.get(k), v) for k, v in recipe.items() if saved.get(k) != v}
        if diff:
            fail(f"{ckpt} was written with other settings {diff} (saved, now); "
                             f"rerun with those settings to resume, or pass --overwrite to start over")
        model.load_state_dict(tensors)
        step, log = state["step"], state["log"]
        print(f"resumed from {ckpt} at step {step}")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{a.arch}: {n_params / 1e6:.2f} M parameters, {a.steps} steps of {a.batch_size}")
    model.train()
    warmup = max(1, int(a.warmup * a.steps))
    t0, bar = time.time(), tqdm(total=a.steps, initial=step, desc=f"pretrain {a.arch}")
    last = min(a.steps, a.stop_at) if a.stop_at else a.steps
    while step < last:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.steps, a.lr, warmup)
        batch, answer_mask = make_batch(proc, step, a.batch_size, a.seed, chat_mix, a.wrong_priors, a.look)
        loss = accumulate(model, batch, answer_mask, a.grad_accum, a.answer_weight, is_moe)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss at step {step}; last good checkpoint kept in {ckpt}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % a.eval_every == 0 or step == last:
            ev = teacher_forced_eval(model, proc, look=a.look)
            log.append({"step": step, "loss": loss.item(), "minutes": (time.time() - t0) / 60, "val": ev})
            tqdm.write(f"step {step} loss {loss.item():.3f} " + " ".join(
                f"{f}={v['answer']:.2f}/{v['full']:.2f}" for f, v in ev.items()))
        if (a.ckpt_every and step % a.ckpt_every == 0) or step == last:
            save_train_state(ckpt, model.state_dict(), opt, {"step": step, "log": log, "recipe": recipe})
    bar.close()
    model.eval()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    bb.save_backbone(model, proc, a.out)
    data.atomic_write_text(os.path.join(a.out, "pretrain_log.json"), json.dumps({"args": vars(a), "log": log}, indent=1))
    print(f"saved {a.out}")


if __name__ == "__main__":
    try:
        main()
    except (data.DataError, bb.BackboneError) as e:
        fail(e)
