"""Latent diagnostics (paper, "Do the latents become more complementary?" and "Are the
latents used for answer generation?").

    sim, kl = latent_stats(mole, records, stage=2)      # both x100, averaged over examples
    res = mole.infer.evaluate(mole, records, intervention="mask")   # interventions live in infer

    python -m mole.diagnostics --ckpt out/mole/mole --data out/data/test.json --limit 100 --out diag.json

* latent similarity: mean pairwise squared cosine between the final-layer hidden states of
  the latent tokens (all E + S), x100. Lower = less redundant.
* attention-pattern KL: for each layer and each latent visual expert, its attention over
  the visual tokens (mean over heads, renormalised over the visual columns, smoothed by
  eps so sparse routed patterns give finite values), then KL(p_i || p_j) averaged over
  ordered pairs i != j and layers, x100. Higher = more diverse. The paper's exact
  formulation (its App. A.6) is not in our copy of the paper; this is the plain reading.
"""
import json

import torch

from common import data
from common.cli import add_device_args, load_kwargs
from common.cli import (add_limit, add_overwrite, add_threads, check_out_file, check_overwrite, entry_parser, number, run_cli,
                        set_threads)
from common.data import atomic_write_text, check_support, load_record_images, read_records
from mole.checkpoint import load_mole, recorded_base
from mole.model import ZSUM, ZVIS, MoLE


def pairwise_sq_cos(h):
    """h: [B, n, d] -> [B] mean over pairs i < j of cos^2(h_i, h_j) (0 if n < 2)."""
    n = h.shape[1]
    if n < 2:
        return h.new_zeros(h.shape[0])
    u = torch.nn.functional.normalize(h.float(), dim=-1)
    c2 = (u @ u.transpose(1, 2)).square()
    iu = torch.triu_indices(n, n, 1)
    return c2[:, iu[0], iu[1]].mean(-1)


def pairwise_kl(p, eps=1e-4):
    """p: [B, n, V] non-negative attention over V visual tokens (rows need not sum to 1).
    Rows are renormalised, smoothed p <- (p + eps) / (1 + V eps), and KL(p_i || p_j) is
    averaged over ordered pairs i != j. Returns [B] (0 if n < 2)."""
    B, n, V = p.shape
    if n < 2:
        return p.new_zeros(B)
    p = p.float() / p.float().sum(-1, keepdim=True).clamp(min=1e-12)
    p = (p + eps) / (1 + V * eps)
    logp = p.log()
    kl = (p[:, :, None] * (logp[:, :, None] - logp[:, None, :])).sum(-1)  # [B,n,n]
    return kl.sum((1, 2)) / (n * (n - 1))


@torch.no_grad()
def latent_stats(mole, records, stage=2, batch_size=64):
    """(similarity x100, attention KL x100) of a MoLE model over `records` (LLaVA records
    with images, of any sizes: each record's KL is taken over its own visual tokens). Runs the
    prefill with Z_vis attention recorded in every layer; per-record values are averaged, so
    the result does not depend on `batch_size`."""
    sims, kls = [], []
    for i in range(0, len(records), batch_size):
        chunk = records[i:i + batch_size]
        imgs = [load_record_images(r) for r in chunk]
        batch = {k: v.to(mole.model.device) for k, v in mole.encode(imgs, [r["question"] for r in chunk]).items()}
        out = mole(batch, stage, record=True, hidden=True)
        types, st = out["types"], out["pass"]
        lat = (types == ZVIS) | (types == ZSUM)
        B, n = lat.shape[0], int(lat[0].sum())
        sims.append(pairwise_sq_cos(out["hidden"][lat].view(B, n, -1)))
        vis = st.is_vis                                   # [B, L]; images of other sizes: other counts per row
        per_layer = []
        for layer, p in sorted(st.attn.items()):  # p: [B,H,E,L]
            pm = p.mean(1)                                # [B,E,L]
            per_layer.append(torch.cat([pairwise_kl(pm[b][:, vis[b]][None]) for b in range(B)]))  # each [1,E,nv_b]
        kls.append(torch.stack(per_layer).mean(0))
    return 100 * torch.cat(sims).mean().item(), 100 * torch.cat(kls).mean().item()


def main(argv=None):
    """Command line: a mole.train checkpoint + data -> printed (and optionally JSON) diagnostics."""
    p = entry_parser(__spec__.name, "MoLE latent diagnostics: latent similarity and attention-pattern KL "
                                    "(both x100) of a mole.train checkpoint on a data file.")
    p.add_argument("--ckpt", required=True, help="MoLE checkpoint directory written by mole.train")
    p.add_argument("--model", default=None, help="base VLM to load (default: the one recorded in the checkpoint)")
    p.add_argument("--data", required=True, help="LLaVA JSON/JSONL or canonical JSONL with images")
    p.add_argument("--image-root", default=None, help=data.IMAGE_ROOT_HELP)
    p.add_argument("--skip-bad", action="store_true", help=data.SKIP_BAD_HELP)
    add_limit(p, default=100, dest="n")
    add_threads(p)
    p.add_argument("--stage", type=int, choices=(1, 2), default=None,
                   help="attention stage (default: the checkpoint's, 2 unless stage 2 never ran)")
    p.add_argument("--batch-size", type=number(min=1), default=64, help="records per forward pass")
    add_device_args(p)
    p.add_argument("--out", default="", help="also write the numbers to this JSON file")
    add_overwrite(p)
    return run_cli(run, p.parse_args(argv))  # DataError, BackboneError, bad checkpoint, files: error: ...


def run(a):
    """The body of `main` for parsed flags. Returns the numbers as a dict."""
    set_threads(a.threads, a.model or recorded_base(a.ckpt))
    if a.out:
        check_out_file(a.out)
        check_overwrite(a.out, a.overwrite)
    recs = read_records(a.data, a.image_root, a.skip_bad, limit=a.n)
    check_support(recs, "mole.diagnostics", multi_image=True)  # before the model loads
    net, _, stage = load_mole(a.ckpt, device=a.device, base=a.model, dtype=load_kwargs(a)["dtype"])
    if not isinstance(net, MoLE):
        raise ValueError(f"{a.ckpt} is a --method sft checkpoint: it has no latent tokens to diagnose")
    stage = a.stage or stage
    sim, kl = latent_stats(net, recs, stage=stage, batch_size=a.batch_size)
    res = {"ckpt": a.ckpt, "data": a.data, "n": len(recs), "stage": stage,
           "latent_similarity_x100": sim, "attention_kl_x100": kl}
    print(f"{len(recs)} records, stage {stage}: latent similarity x100 {sim:.2f} (lower = less redundant), "
          f"attention KL x100 {kl:.2f} (higher = more diverse)")
    if a.out:
        atomic_write_text(a.out, json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
