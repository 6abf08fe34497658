"""Self-debate inference with MoD (paper Alg. 2, App. B.5) and the external baselines.

    base         the frozen base model, one round on the plain question (its own format)
    base-json    the frozen base model on MoD-Single's prompt (question + JSON instruction): the
                 fair baseline of MoD-Single, since both see the same prompt
    MoD-Single   one round: question + JSON instruction
    MoD-Multi    K debate rounds: round k sees the question, the debate prompt and the
                 model's own responses of rounds 0..k-1 (Alg. 2), final answer = last round
    MAD          multi-agent debate on the base model, two protocols (--mad):
      liang      Liang et al.'s official protocol (the paper's MAD, B.4; the default): an
                 affirmative and a negative debater, a moderator after every round that can end
                 the debate, at most 3 rounds (--mad-rounds), temperature 0, every agent keeps
                 its whole conversation, a two-step judge when the moderator never decides
      du         Du-style debate: 2 sampled debaters (T = 0.7) answer, then see each other's
                 latest response for `rounds` rounds (--mad-rounds, default --rounds); a greedy
                 judge reads both final responses and decides
    SC           self-correction on the base model: answer, then review the own answer

Every method returns per-question results {id, family, pred, correct, n_tokens} and the
wall time; `n_tokens` sums all generated tokens of all calls for that question.
Answers are read with `common.answers.is_correct_for` (the record's options and answer type), which parses the JSON and falls back to
the text after the last "Answer" when the JSON is malformed.

    python -m mod.infer --model tiny-chat --adapter out/mod/run --data out/data/test.json --rounds 1
"""
import json
import math
import os
import random
import time

import torch
from PIL import Image, ImageDraw

from common.backbone import generate, load_backbone
from common.cli import (add_limit, add_overwrite, add_threads, check_out_file, check_overwrite, entry_parser, number, run_cli,
                        set_threads)
from common.cli import add_device_args, load_kwargs
from common.data import IMAGE_ROOT_HELP, SKIP_BAD_HELP, Batcher, atomic_write_text, check_support, read_records
from common.predictions import PredictionLog, fingerprint, model_digest, rng_state, set_rng_state
from common.routing import switch_rate
from common.answers import is_correct_for
from mod.data import (debate_prompt, debater_prompt, judge_prompt, review_prompt, single_prompt, to_json_response,
                      wrong_response)
from mod.model import CONFIG_NAME, adapter_layers, load_adapters, routing_context
from mod.prompts import ROUND_NAMES, liang_decision, liang_prompt


def _generate(model, proc, batcher, recs, questions, max_new_tokens, **kw):
    return generate(model, proc, batcher.image_list(recs), questions, max_new_tokens, **kw)


def run_rounds(model, proc, records, prompt_fns, batch_size=64, max_new_tokens=96, sample_kw=None, log=None,
               phase="rounds"):
    """Generic multi-call driver. prompt_fns: list of functions (record, history) -> prompt,
    one per call; each call's output is appended to that record's history.
    sample_kw: per-call generation kwargs list (None = greedy). Returns (histories, tokens).
    log: a `common.predictions.PredictionLog` (or its `scope`) keeping each finished batch of
    each call as phase "{phase}/{call}"; with sampled calls the random state after each batch
    is kept too, so a resumed run draws what the uninterrupted one draws."""
    log = log or PredictionLog(None, None)
    kws = sample_kw or [{}] * len(prompt_fns)
    n_batches = -(-len(records) // batch_size)
    sampled = any(kw.get("do_sample") for kw in kws)
    if sampled:  # resume: the random stream continues after the last finished batch
        last = None
        for c in range(len(prompt_fns)):
            got = log.stored(f"{phase}/{c}")
            last = got[-1]["state"] if got else last
            if len(got) < n_batches:
                break
        if last is not None:
            set_rng_state(last)
    hist = [[] for _ in records]
    toks = [0] * len(records)
    for c, (fn, kw) in enumerate(zip(prompt_fns, kws)):
        def one(b, fn=fn, kw=kw):
            i = b * batch_size
            recs = records[i:i + batch_size]
            qs = [fn(r, hist[i + j]) for j, r in enumerate(recs)]
            texts, lens = _generate(model, proc, Batcher(proc, recs), recs, qs, max_new_tokens, **kw)
            return [[t, n] for t, n in zip(texts, lens)]
        outs = log.run(f"{phase}/{c}", n_batches, one, desc=f"{phase} call {c + 1}/{len(prompt_fns)}",
                       state=rng_state if sampled else None)
        for j, (t, n) in enumerate(outs):
            hist[j].append(t)
            toks[j] += n
    return hist, toks


def _results(records, finals, toks):
    return [{"id": r["id"], "family": r["family"], "pred": f, "answer": r["answer"],
             "correct": bool(is_correct_for(r, f)), "n_tokens": n}
            for r, f, n in zip(records, finals, toks)]


@torch.no_grad()
def mod_debate(model, proc, records, rounds=0, batch_size=64, max_new_tokens=96, log=None):
    """MoD-Single (rounds=0) or MoD-Multi (rounds=K >= 1), Alg. 2. Returns (results, wall_s).
    log: as in `run_rounds` (every method below takes it too)."""
    t0 = time.time()
    fns = [lambda r, h: single_prompt(r["question"])]
    fns += [lambda r, h: debate_prompt(r["question"], h)] * rounds
    hist, toks = run_rounds(model, proc, records, fns, batch_size, max_new_tokens, log=log)
    return _results(records, [h[-1] for h in hist], toks), time.time() - t0


@torch.no_grad()
def plain(model, proc, records, batch_size=64, max_new_tokens=96, json_prompt=False, log=None):
    """One greedy round on the plain question (the base model's own format) or with the JSON
    instruction (adapters trained on debate data). Returns (results, wall_s)."""
    t0 = time.time()
    fn = (lambda r, h: single_prompt(r["question"])) if json_prompt else (lambda r, h: r["question"])
    hist, toks = run_rounds(model, proc, records, [fn], batch_size, max_new_tokens, log=log)
    return _results(records, [h[-1] for h in hist], toks), time.time() - t0


@torch.no_grad()
def misled(model, proc, records, batch_size=64, max_new_tokens=96, seed=0, log=None):
    """Robustness to a misleading prior (what T_rev / T_rob train, §3.2): one greedy round on the
    debate prompt with a single *wrong* prior response (`mod.data.wrong_response`, seeded, in
    the debate JSON form). Returns (results, wall_s)."""
    rng = random.Random(seed)
    wrong = {r["id"]: wrong_response(rng, r["question"], r["answer"], r["family"]) for r in records}
    t0 = time.time()
    fn = lambda r, h: debate_prompt(r["question"], [to_json_response(wrong[r["id"]])])
    hist, toks = run_rounds(model, proc, records, [fn], batch_size, max_new_tokens, log=log)
    return _results(records, [h[-1] for h in hist], toks), time.time() - t0


@torch.no_grad()
def self_correction(model, proc, records, batch_size=64, max_new_tokens=96, log=None):
    """Answer, then "review your previous answer" (one correction round). Returns (results, wall_s)."""
    t0 = time.time()
    review = lambda r, h: review_prompt(r["question"], h[0])
    hist, toks = run_rounds(model, proc, records, [lambda r, h: r["question"], review], batch_size, max_new_tokens,
                            log=log)
    return _results(records, [h[-1] for h in hist], toks), time.time() - t0


@torch.no_grad()
def multi_agent_debate(model, proc, records, rounds=1, temperature=0.7, batch_size=64, max_new_tokens=96, seed=0,
                       log=None):
    """MAD, Du-style (`--mad du`): debaters 1 and 2 (temperature sampling) answer; for `rounds`
    rounds each sees the other's latest response with the debate prompt; a greedy judge reads
    both final responses. Not Liang et al.'s protocol (`liang_debate`, the paper's MAD).
    History layout: [d1_0, d2_0, d1_1, d2_1, ..., judge]. Returns (results, wall_s)."""
    t0 = time.time()
    torch.manual_seed(seed)
    fns = [lambda r, h: r["question"]] * 2
    for k in range(rounds):
        for me in (0, 1):  # debater `me` reads the other's response of the previous round
            fns.append(lambda r, h, k=k, me=me: debater_prompt(r["question"], h[2 * k + 1 - me], h[2 * k + me]))
    fns.append(lambda r, h: judge_prompt(r["question"], h[-2], h[-1]))
    sample = {"do_sample": True, "temperature": temperature}
    kw = [sample] * (len(fns) - 1) + [{}]
    hist, toks = run_rounds(model, proc, records, fns, batch_size, max_new_tokens, kw, log=log)
    return _results(records, [h[-1] for h in hist], toks), time.time() - t0


def _opening(meta, event):
    """An agent's first user turn: its meta prompt (a system message in the official code; the
    generation helper has no system turn, so it leads the first user turn), then the event."""
    return f"{meta}\n\n{event}"


@torch.no_grad()
def liang_debate(model, proc, records, max_rounds=3, batch_size=64, max_new_tokens=96, log=None):
    """MAD as Liang et al.'s official code runs it (github Skytliang/Multi-Agents-Debate,
    `interactive.py`, prompts `mod.prompts.LIANG_PROMPTS`), batched across questions.

    Agents are conversations on the same frozen model, each kept whole (full memory: every
    earlier turn is passed as `history`, the image in the first user turn of each):
      round 1      affirmative: meta + the question; negative: meta + the affirmative's answer +
                   "You disagree with my answer. Provide your answer and reasons."; moderator:
                   meta + both answers, asked for {"Whether there is a preference", "Supported
                   Side", "Reason", "debate_answer"}
      rounds 2..   affirmative reads the negative's last answer, then the negative reads the
                   affirmative's new one ("Do you agree with my perspective?"), then the moderator
      stop         a question leaves the debate once its moderator gives a non-empty
                   `debate_answer` (`liang_decision`); the others go on, at most `max_rounds`
      judge        questions still undecided: a new agent (the moderator's meta prompt) reads
                   both sides' **first-round** answers (as the official code does) and lists the
                   candidates, then, in the same conversation, answers in JSON; its
                   `debate_answer` is final (its raw reply when it wrote no JSON)
    Greedy decoding (temperature 0), at most `max_new_tokens` per reply. Returns (results, wall_s);
    each result also has "rounds" (rounds run) and "decided_by" ("moderator" / "judge");
    n_tokens sums every reply of every agent for that question. log: as in `run_rounds` (a
    resumed run rebuilds the same active questions from the stored replies)."""
    if max_rounds < 1:
        raise ValueError(f"liang_debate needs max_rounds >= 1 (round 1 is the debaters' first answers), got {max_rounds}")
    t0 = time.time()
    log = log or PredictionLog(None, None)
    n = len(records)
    topic = [r["question"] for r in records]
    conv = {a: [[] for _ in records] for a in ("affirmative", "negative", "moderator", "judge")}
    toks = [0] * n

    def ask(phase, agent, idx, users):
        """One batched turn of `agent` for the questions `idx`; users[i] = question i's new user
        turn. Appends (turn, reply) to each conversation; returns {i: reply}."""
        def one(b):
            sel = idx[b * batch_size:(b + 1) * batch_size]
            recs = [records[i] for i in sel]
            texts, lens = _generate(model, proc, Batcher(proc, recs), recs, [users[i] for i in sel], max_new_tokens,
                                    history=[list(conv[agent][i]) for i in sel], do_sample=False)
            return [[t, k] for t, k in zip(texts, lens)]
        outs = log.run(phase, -(-len(idx) // batch_size), one, desc=f"liang {phase}")
        for i, (t, k) in zip(idx, outs):
            conv[agent][i].append((users[i], t))
            toks[i] += k
        return {i: t for i, (t, _) in zip(idx, outs)}

    player_meta = {i: liang_prompt("player_meta_prompt", debate_topic=topic[i]) for i in range(n)}
    mod_meta = {i: liang_prompt("moderator_meta_prompt", debate_topic=topic[i]) for i in range(n)}
    active, final, rounds, first = list(range(n)), [None] * n, [0] * n, {}
    aff, neg = {}, {}
    for k in range(max_rounds):
        if k == 0:
            aff = ask("r1/affirmative", "affirmative", active, {i: _opening(
                player_meta[i], liang_prompt("affirmative_prompt", debate_topic=topic[i])) for i in active})
            neg = ask("r1/negative", "negative", active, {i: _opening(
                player_meta[i], liang_prompt("negative_prompt", aff_ans=aff[i])) for i in active})
            first = {i: (aff[i], neg[i]) for i in active}
        else:
            aff = ask(f"r{k + 1}/affirmative", "affirmative", active,
                      {i: liang_prompt("debate_prompt", oppo_ans=neg[i]) for i in active})
            neg = ask(f"r{k + 1}/negative", "negative", active,
                      {i: liang_prompt("debate_prompt", oppo_ans=aff[i]) for i in active})
        turn = {i: liang_prompt("moderator_prompt", round=ROUND_NAMES[k], aff_ans=aff[i], neg_ans=neg[i])
                for i in active}
        said = ask(f"r{k + 1}/moderator", "moderator", active,
                   {i: _opening(mod_meta[i], turn[i]) if k == 0 else turn[i] for i in active})
        for i in active:
            rounds[i] = k + 1
            final[i] = liang_decision(said[i]) or None   # "" = no preference: the debate goes on
        active = [i for i in active if final[i] is None]
        if not active:
            break
    if active:   # the two-step judge on the first round's answers
        ask("judge/candidates", "judge", active, {i: _opening(mod_meta[i], liang_prompt(
            "judge_prompt_last1", aff_ans=first[i][0], neg_ans=first[i][1])) for i in active})
        said = ask("judge/answer", "judge", active,
                   {i: liang_prompt("judge_prompt_last2", debate_topic=topic[i]) for i in active})
        for i in active:
            got = liang_decision(said[i])
            final[i] = said[i] if got is None else got
    judged = set(active)
    res = _results(records, final, toks)
    for i, r in enumerate(res):
        r.update(rounds=rounds[i], decided_by="judge" if i in judged else "moderator")
    return res, time.time() - t0


# ----------------------------------------------------------------------------- diagnostics

@torch.no_grad()
def routing_trace(model, proc, records, batch_size=64, max_new_tokens=96):
    """Greedy MoD-Single generation with routing recorded.

    Returns {"switch_rate": mean over layers of the fraction of adjacent *generated* tokens
    whose top-1 A expert differs, "switch_rate_B": same for router B,
    "share_A"/"share_B": [layers][E] share of top-r selections per expert over generated
    tokens, "by_family_A"/"by_family_B": {family: [E] share averaged over layers}}."""
    ctx = routing_context(model)
    layers = adapter_layers(model)
    sizes = sorted({m.cfg.num_experts for _, m in layers})
    if len(sizes) > 1:
        raise ValueError(f"routing_trace compares expert shares across layers, which needs one expert count; "
                         f"these adapters have {sizes} (experts_pattern): trace a model without it")
    E, names = sizes[0], [m.name for _, m in layers]
    batcher = Batcher(proc, records)
    counts = {s: torch.zeros(len(names), E) for s in "AB"}
    fam_counts = {s: {} for s in "AB"}
    sw = {s: [] for s in "AB"}
    for i in range(0, len(records), batch_size):
        recs = records[i:i + batch_size]
        ctx.record, ctx.trace = True, []
        try:
            texts, lens = _generate(model, proc, batcher, recs, [single_prompt(r["question"]) for r in recs],
                                    max_new_tokens)
        finally:
            ctx.record = False
        steps = [t for t in ctx.trace if t[1].shape[1] == 1]  # decoding steps: one token each
        # decoding step s feeds generated token s: real while s < the row's generated length
        n_layers = len(names)
        for li, name in enumerate(names):
            mine = [t for t in steps if t[0] == name]
            if not mine:
                continue
            ia = torch.cat([t[1] for t in mine], 1)  # [B, steps, r]
            ib = torch.cat([t[2] for t in mine], 1)
            valid = torch.arange(ia.shape[1])[None] < torch.tensor(lens)[:, None]
            for s, idx in (("A", ia), ("B", ib)):
                sw[s].append(switch_rate(idx[..., 0], valid))
                onehot = torch.zeros(*idx.shape[:2], E).scatter_(-1, idx, 1.0) * valid[..., None]
                counts[s][li] += onehot.sum((0, 1))
                for j, r in enumerate(recs):
                    fam_counts[s].setdefault(r["family"], torch.zeros(E)).add_(onehot[j].sum(0) / n_layers)
    share = {s: (counts[s] / counts[s].sum(-1, keepdim=True).clamp(min=1)).tolist() for s in "AB"}
    fam = {s: {f: (c / c.sum().clamp(min=1)).tolist() for f, c in fam_counts[s].items()} for s in "AB"}
    mean = lambda xs: float(sum(xs) / len(xs)) if xs else 0.0
    return {"switch_rate": mean(sw["A"]), "switch_rate_B": mean(sw["B"]), "share_A": share["A"],
            "share_B": share["B"], "by_family_A": fam["A"], "by_family_B": fam["B"]}


def usage_entropy(share):
    """Mean over layers of the normalised entropy (0 = one expert, 1 = uniform) of expert shares."""
    ents = []
    for row in share:
        h = -sum(p * math.log(p) for p in row if p > 0)
        ents.append(h / math.log(len(row)))
    return sum(ents) / len(ents) if ents else 0.0


def heatmap_png(by_family, path, cell=28):
    """Per-category expert-activation heatmap (rows: families, columns: experts), Pillow only.
    Darker = larger share; the share (in %) is written in each cell."""
    fams = sorted(by_family)
    E = len(next(iter(by_family.values()))) if fams else 0
    left, top = 80, 20
    img = Image.new("RGB", (left + E * cell + 10, top + len(fams) * cell + 10), "white")
    d = ImageDraw.Draw(img)
    vmax = max((max(v) for v in by_family.values()), default=1) or 1
    for e in range(E):
        d.text((left + e * cell + 8, 4), f"e{e}", fill="black")
    for i, f in enumerate(fams):
        d.text((4, top + i * cell + 8), f[:11], fill="black")
        for e, v in enumerate(by_family[f]):
            g = int(255 * (1 - v / vmax))
            x, y = left + e * cell, top + i * cell
            d.rectangle([x, y, x + cell - 1, y + cell - 1], fill=(g, g, 255))
            d.text((x + 3, y + 8), f"{100 * v:.0f}", fill="black" if g > 120 else "white")
    tmp = f"{path}.tmp{os.getpid()}"
    img.save(tmp, format="PNG")
    os.replace(tmp, path)  # never a half-written PNG under the asked name
    return path


def summarize(name, results, wall_s):
    acc = sum(r["correct"] for r in results) / max(1, len(results))
    toks = sum(r["n_tokens"] for r in results) / max(1, len(results))
    return {"method": name, "accuracy": acc, "tokens_per_q": toks, "wall_s": wall_s, "n": len(results)}


METHODS = ("base", "base-json", "single", "multi", "mad", "sc", "base-misled", "misled")
MAD_PROTOCOLS = ("liang", "du")
LIANG_MAX_ROUNDS = 3   # the official code's max_round


def main(argv=None):
    p = entry_parser(__spec__.name, "MoD-Single / MoD-Multi self-debate, MAD and self-correction.")
    p.add_argument("--model", default="tiny-chat", help="base model: checkpoint dir or tiny-chat / tiny-dense")
    p.add_argument("--adapter", default="", help="adapter dir from mod.train (empty: base-model methods only)")
    p.add_argument("--data", required=True, help="questions (LLaVA JSON/JSONL or canonical JSONL)")
    p.add_argument("--image-root", default=None, help=IMAGE_ROOT_HELP)
    p.add_argument("--methods", default="single,multi,mad,sc",
                   help="comma list of: single, multi, misled (need --adapter); base, base-json, mad, sc, "
                   "base-misled (the frozen base model). base = the plain question; base-json = the adapters' "
                   "JSON prompt (the fair baseline of single, as eval.toys.mod's base-json row); misled = one "
                   "debate round whose only prior response is wrong")
    p.add_argument("--rounds", type=number(min=0), default=1, help="debate rounds of MoD-Multi (paper: 1; and of MAD "
                   "unless --mad-rounds)")
    p.add_argument("--mad", choices=MAD_PROTOCOLS, default="liang",
                   help="the protocol of method mad: liang = Liang et al.'s official one (the paper's MAD: affirmative "
                   "and negative debaters, a moderator that can end the debate after each round, a two-step judge when "
                   "it never does, greedy, full memory); du = Du-style (2 sampled debaters, a judge)")
    p.add_argument("--mad-rounds", type=number(min=0), default=None, help="debate rounds of MAD: with --mad liang the "
                   "most rounds, the first included (default 3, the official code's); with --mad du the exchanges after "
                   "the first answers (default: --rounds)")
    add_limit(p, what="questions")
    p.add_argument("--batch-size", type=number(min=1), default=64, help="generation batch size")
    p.add_argument("--max-new-tokens", type=number(min=1), default=96, help="cap per generated response")
    add_device_args(p)
    p.add_argument("--heatmap", default="", help="write a per-family router-A heatmap PNG here (needs --adapter)")
    p.add_argument("--out", default="", help="write summaries + per-question results as JSON here")
    p.add_argument("--resume", action="store_true",
                   help="continue a stopped run from its last finished batch (OUT.partial; the same flags)")
    add_overwrite(p, "--out / --heatmap")
    p.add_argument("--skip-bad", action="store_true", help=SKIP_BAD_HELP)
    add_threads(p)
    args = p.parse_args(argv)
    set_threads(args.threads, args.model)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:  # before any model loads or runs
        p.error(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
    if args.mad == "liang" and args.mad_rounds == 0:
        p.error("--mad liang needs --mad-rounds >= 1 (its first round is the affirmative's and negative's answers); "
                "leave it out for the official 3")
    if not args.adapter and ({"single", "multi", "misled"} & set(methods) or args.heatmap):
        need = sorted({"single", "multi", "misled"} & set(methods)) + (["--heatmap"] if args.heatmap else [])
        p.error(f"these need --adapter: {', '.join(need)} (train one with mod.train); without an adapter run only "
                f"the base-model rows: --methods base,base-json,mad,sc")
    return run_cli(run, args, methods)  # DataError, BackboneError, adapter on the wrong base, files: error: ...


def _mad_rounds(args):
    """MAD's debate rounds: --mad-rounds, else 3 for --mad liang (the official code's max_round)
    and --rounds for --mad du."""
    if args.mad_rounds is not None:
        return args.mad_rounds
    return LIANG_MAX_ROUNDS if args.mad == "liang" else args.rounds


def run(args, methods):
    """The body of `main` for parsed flags. Returns the JSON-able summaries + results."""
    for flag, path in (("--out", args.out), ("--heatmap", args.heatmap)):  # fail now, not after the whole run
        if path:
            check_out_file(path, flag)
            check_overwrite(path, args.overwrite, args.resume, flag)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    records = read_records(args.data, args.image_root, args.skip_bad, limit=args.limit)  # every image decoded
    check_support(records, "mod.infer", text_only=True)  # at most one image, one turn per record: before any model loads
    if {"misled", "base-misled"} & set(methods):  # every method's data check before any method runs
        for r in records:
            wrong_response(random.Random(0), r["question"], r["answer"], r["family"])  # DataError: not shapes
    if args.adapter:   # a wrong --adapter path is refused before any model loads
        if not os.path.exists(os.path.join(args.adapter, CONFIG_NAME)):
            raise FileNotFoundError(f"{args.adapter}: no {CONFIG_NAME} (not an adapter directory written by "
                                    f"mod.train or peft)")
    fp = fingerprint(records, model=model_digest(args.model), adapter=model_digest(args.adapter), methods=methods,
                     rounds=args.rounds, mad=args.mad, mad_rounds=_mad_rounds(args), batch_size=args.batch_size,
                     max_new_tokens=args.max_new_tokens,
                     device=args.device)
    with PredictionLog(args.out or None, fp, args.resume) as log:  # refusals before any model loads
        return _run_methods(args, methods, records, log)


def _run_methods(args, methods, records, log):
    """Load the models, run each method (every finished batch kept in `log`), write --out."""
    base, proc = load_backbone(args.model, **load_kwargs(args))
    tuned = None
    if args.adapter:
        tuned, _ = load_backbone(args.model, **load_kwargs(args))
        load_adapters(tuned, args.adapter)  # refuses adapters trained on another base
        tuned.eval()
    bs, mnt = args.batch_size, args.max_new_tokens
    drivers = {"base": lambda log: plain(base, proc, records, bs, mnt, log=log),
               "base-json": lambda log: plain(base, proc, records, bs, mnt, json_prompt=True, log=log),
               "single": lambda log: mod_debate(tuned, proc, records, 0, bs, mnt, log=log),
               "multi": lambda log: mod_debate(tuned, proc, records, args.rounds, bs, mnt, log=log),
               "mad": (lambda log: liang_debate(base, proc, records, _mad_rounds(args), bs, mnt, log=log))
               if args.mad == "liang" else
               (lambda log: multi_agent_debate(base, proc, records, _mad_rounds(args), batch_size=bs,
                                               max_new_tokens=mnt, log=log)),
               "sc": lambda log: self_correction(base, proc, records, bs, mnt, log=log),
               "base-misled": lambda log: misled(base, proc, records, bs, mnt, log=log),
               "misled": lambda log: misled(tuned, proc, records, bs, mnt, log=log)}
    out = {"summaries": [], "results": {}, "complete": False}
    print(f"{'method':11s} {'acc':>6s} {'tok/q':>7s} {'wall s':>7s}")
    for m in methods:
        res, _ = drivers[m](log.scope(m))
        s = summarize(m, res, log.seconds(m))  # compute time of its batches, resumed ones included
        out["summaries"].append(s)
        out["results"][m] = res
        print(f"{m:11s} {s['accuracy']:6.3f} {s['tokens_per_q']:7.1f} {s['wall_s']:7.1f}")
        if args.out:  # each finished method is on disk at once: a later failure loses nothing
            atomic_write_text(args.out, json.dumps(out, indent=1))
    out["complete"] = True
    if args.heatmap:
        diag = routing_trace(tuned, proc, records, args.batch_size, args.max_new_tokens)
        heatmap_png(diag["by_family_A"], args.heatmap)
        print(f"switch rate {diag['switch_rate']:.3f}; heatmap {args.heatmap}")
    if args.out:
        atomic_write_text(args.out, json.dumps(out, indent=1))
    log.finish()
    return out


if __name__ == "__main__":
    main()
