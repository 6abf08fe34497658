"""Batched greedy generation with MoLE's latent prefix and the KV cache, plus the paper's
latent interventions (random / shuffled latent values, latent KV masked from the answer).

    python -m mole.infer --ckpt out/mole/mole --data out/data/test.json --limit 200

Prefill runs in two parts: (1) image + question + Z_vis + Z_sum through the MoLE path
(routing, ESVA, topology), (2) the assistant header as ordinary text rows. Between the two
the latents' cached keys/values can be intervened on. Decoding then feeds one answer token
at a time through plain SDPA: the model builds its own mask (causal, padding, sliding window)
from the 2-D attention mask and the cache, restricted to the columns the stage allows
(`mole_columns`; stage 1: no visual columns), with the model's own positions (last + 1).
The cache is the model's own (`DynamicCache(config=...)`: a sliding-window layer keeps only its
window). Tested equal to one uncached forward, also past a sliding window.
"""
import json
import time

import torch
from transformers import DynamicCache

from common import backbone as bb
from common.answers import is_correct_for, score
from common.cli import add_device_args, load_kwargs
from common.cli import (add_limit, add_overwrite, add_threads, check_out_file, check_overwrite, entry_parser, number, run_cli,
                        set_threads)
from common.data import (IMAGE_ROOT_HELP, SKIP_BAD_HELP, atomic_write_text, check_support, load_record_images,
                         read_records)
from common.predictions import PredictionLog, fingerprint, model_digest
from mole.checkpoint import load_mole, recorded_base, recorded_method
from mole.model import ZSUM, ZVIS, MoLE, column_mask

INTERVENTIONS = ("none", "random", "shuffle", "mask")


def _intervene(cache, cols, length, kind, gen):
    """Replace the cached K and V of the latent columns `cols` (list of ints, positions in a
    sequence of `length` tokens) in every layer; a sliding-window layer holds only the newest
    of them, so a column maps to its place among those (and is skipped if dropped already).
    random: Gaussian with the latents' own per-layer mean/std; shuffle: permute the entries
    within each latent vector (heads x head_dim flattened), a fresh permutation per vector."""
    for layer in cache.layers:
        held = layer.keys.shape[2]  # the last `held` of the `length` columns
        here = [c - (length - held) for c in cols if c >= length - held]
        if not here:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [B,Hkv,L,D]
            z = t[:, :, here].transpose(1, 2)  # [B,n,Hkv,D]
            B, n, Hk, D = z.shape
            flat = z.reshape(B, n, Hk * D)
            if kind == "random":
                new = flat.mean() + flat.std() * torch.randn(flat.shape, generator=gen).to(flat)
            else:
                perm = torch.rand(B, n, Hk * D, generator=gen).argsort(-1).to(flat.device)
                new = flat.gather(-1, perm)
            t = t.clone()
            t[:, :, here] = new.view(B, n, Hk, D).transpose(1, 2)
            setattr(layer, name, t)


@torch.no_grad()
def generate(mole, images, questions, stage=2, max_new_tokens=48, pixels=None, intervention="none", seed=0,
             stop_at_eos=True, return_logits=False):
    """Greedy answers for a batch (left padding).

    images: one entry per question, a PIL image or a list of PIL images (or None with
    pixels=(pixel_values, image_grid_thw), one image per question); stage: 1 or 2
    (which attention the answer rows get); intervention: one of INTERVENTIONS.
    Returns (texts, n_generated_tokens) and, with return_logits, also the per-step logits
    [B, steps, V] and the full token ids [B, L + steps] (for the cache test)."""
    if intervention not in INTERVENTIONS:
        raise ValueError(f"intervention must be one of {INTERVENTIONS}, got {intervention!r}")
    dev = mole.model.device
    batch = {k: v.to(dev) for k, v in mole.encode(images, questions, pixels=pixels).items()}
    ids, am = batch["input_ids"], batch["attention_mask"]
    B, L = ids.shape
    T = len(mole.tail_ids)
    cut = L - T  # left padding: every row ends with the same assistant header
    types = mole.token_types(ids, am)
    latent = (types == ZVIS) | (types == ZSUM)
    pos = mole.positions(batch)
    cache = DynamicCache(config=mole.model.config.get_text_config())

    # 1. prefill head + latents through the MoLE path
    head = dict(batch, input_ids=ids[:, :cut], attention_mask=am[:, :cut],
                **{k: batch[k][:, :cut] for k in ("mm_token_type_ids", "token_type_ids") if k in batch})
    mole(head, stage, cache=cache)
    if intervention in ("random", "shuffle"):
        cols = latent[0].nonzero().flatten().tolist()  # same columns in every row (left padding)
        _intervene(cache, cols, cut, intervention, torch.Generator().manual_seed(seed))

    # 2. the assistant header, then one token at a time: plain text rows under the model's own mask
    # (causal, padding, sliding window), restricted to the columns text rows may read
    keep = column_mask(types, stage)  # [B,L] columns later text rows may read
    if intervention == "mask":
        keep &= ~latent
    out = mole.model(input_ids=ids[:, cut:], attention_mask=am, position_ids=pos[..., cut:], cache=cache,
                     use_cache=True, mole_columns=keep)
    last = pos[..., -1:]  # [3,B,1] (M-RoPE) or [B,1]
    steps, tokens = [], []
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    for t in range(max_new_tokens):
        logit = out.logits[:, -1].float()
        steps.append(logit)
        nxt = logit.argmax(-1)
        tokens.append(nxt)
        done |= nxt == mole.adapter.eos_token_id
        if (stop_at_eos and bool(done.all())) or t == max_new_tokens - 1:
            break
        keep = torch.cat([keep, torch.ones(B, 1, dtype=torch.bool, device=dev)], 1)
        am = torch.cat([am, torch.ones(B, 1, dtype=am.dtype, device=dev)], 1)
        last = last + 1
        out = mole.model(input_ids=nxt[:, None], attention_mask=am, position_ids=last, cache=cache, use_cache=True,
                         mole_columns=keep)
    new = torch.stack(tokens, 1)
    texts, lens = [], []
    for row in new.tolist():
        eos = mole.adapter.eos_token_id
        n = row.index(eos) + 1 if eos in row else len(row)
        texts.append(mole.adapter.decode(row[:n]))
        lens.append(n)
    if return_logits:
        return texts, lens, torch.stack(steps, 1), torch.cat([ids, new], 1)
    return texts, lens


def evaluate(mole, records, stage=2, batch_size=64, max_new_tokens=48, intervention="none", desc="mole", log=None):
    """Greedy answers for LLaVA records (common.data.read_llava_json) -> list of dicts
    {id, family, pred, answer, correct, n_tokens}, scored with `common.answers.is_correct_for`
    (the same rule as `eval.evaluate`). The intervention of the batch starting at record i
    is seeded with i. log: a `common.predictions.PredictionLog` keeping each finished batch
    (phase "generate") and holding those of a resumed run."""

    def one(b):
        i = b * batch_size
        chunk = records[i:i + batch_size]
        imgs = [load_record_images(r) for r in chunk]  # one list per record (several images allowed)
        texts, lens = generate(mole, imgs, [r["question"] for r in chunk], stage=stage,
                               max_new_tokens=max_new_tokens, intervention=intervention, seed=i)
        return [{"id": r["id"], "family": r["family"], "pred": t, "answer": r["answer"],
                 "correct": is_correct_for(r, t), "n_tokens": n}
                for r, t, n in zip(chunk, texts, lens)]

    return (log or PredictionLog(None, None)).run("generate", -(-len(records) // batch_size), one, desc)


def evaluate_sft(model, proc, records, batch_size=64, max_new_tokens=48, log=None):
    """An SFT checkpoint (the plain VLM): standard greedy generation, the fields
    `eval.evaluate` writes ({id, family, pred, answer, answer_type, extracted, correct,
    n_tokens[, benchmark]}). log: as in `evaluate`."""

    def one(b):
        chunk = records[b * batch_size:(b + 1) * batch_size]
        texts, lens = bb.generate(model, proc, [r["image"] and load_record_images(r)[0] for r in chunk],
                                  [r["question"] for r in chunk], max_new_tokens)
        return [{"id": r["id"], "family": r["family"], "pred": t, "answer": r["answer"], **score(r, t),
                 "n_tokens": n, **({"benchmark": r["benchmark"]} if r.get("benchmark") else {})}
                for r, t, n in zip(chunk, texts, lens)]

    return (log or PredictionLog(None, None)).run("generate", -(-len(records) // batch_size), one, "sft")


def main(argv=None):
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--ckpt", required=True, help="MoLE checkpoint directory written by mole.train")
    p.add_argument("--model", default=None,
                   help="base VLM to load (default: the one recorded in the checkpoint; must be the same model)")
    p.add_argument("--data", required=True, help="LLaVA-format JSON/JSONL (e.g. out/data/test.json) or canonical JSONL")
    p.add_argument("--image-root", default=None, help=IMAGE_ROOT_HELP)
    add_limit(p, dest="n")
    add_threads(p)
    p.add_argument("--batch-size", type=number(min=1), default=64, help="generation batch size")
    p.add_argument("--max-new-tokens", type=number(min=1), default=48, help="generation length limit")
    p.add_argument("--intervention", default="none", choices=INTERVENTIONS, help="latent intervention")
    add_device_args(p)
    p.add_argument("--out", default="", help="write per-example predictions to this JSON file")
    p.add_argument("--resume", action="store_true",
                   help="continue a stopped run from its last finished batch (OUT.partial; the same flags)")
    add_overwrite(p)
    p.add_argument("--skip-bad", action="store_true", help=SKIP_BAD_HELP)
    a = p.parse_args(argv)
    return run_cli(run, a)  # DataError, BackboneError, bad checkpoint, files: error: ...


def run(a):
    """The body of `main` for parsed flags. Returns the per-example results."""
    set_threads(a.threads, a.model or recorded_base(a.ckpt))
    if a.out:  # fail now, not after the whole evaluation
        check_out_file(a.out)
        check_overwrite(a.out, a.overwrite, a.resume)
    recs = read_records(a.data, a.image_root, a.skip_bad, limit=a.n)  # every kept image decoded now
    # one turn per record, before the model loads; a MoLE checkpoint takes several images per
    # record (Z_vis routed over all), the SFT control one
    check_support(recs, "mole.infer", multi_image=recorded_method(a.ckpt) != "sft")
    fp = fingerprint(recs, ckpt=model_digest(a.ckpt), model=model_digest(a.model), intervention=a.intervention,
                     batch_size=a.batch_size, max_new_tokens=a.max_new_tokens, device=a.device)
    with PredictionLog(a.out or None, fp, a.resume) as log:  # refusals before the model loads
        mole, proc, stage = load_mole(a.ckpt, device=a.device, base=a.model, dtype=load_kwargs(a)["dtype"])
        t = time.time()
        if isinstance(mole, MoLE):
            res = evaluate(mole, recs, stage=stage, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                           intervention=a.intervention, log=log)
        else:  # an SFT checkpoint: the plain VLM, standard generation
            res = evaluate_sft(mole, proc, recs, a.batch_size, a.max_new_tokens, log=log)
        _report(res, t, a)
        if a.out:
            atomic_write_text(a.out, json.dumps(res, indent=1))
        log.finish()
    return res


def _report(res, t, a):
    """Print accuracy overall and per family."""
    acc = sum(r["correct"] for r in res) / max(len(res), 1)
    print(f"accuracy {acc:.3f} on {len(res)} ({time.time() - t:.1f} s, intervention={a.intervention})")
    for fam in sorted({r["family"] for r in res}):
        sub = [r["correct"] for r in res if r["family"] == fam]
        print(f"  {fam:10s} {sum(sub) / len(sub):.3f} (n={len(sub)})")


if __name__ == "__main__":
    main()
