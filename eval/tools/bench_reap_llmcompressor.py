"""Our REAP against llmcompressor's `REAPPruningModifier` on the same model and calibration data
(a bench, not a test; llmcompressor is no dependency of this repository).

    nice -n 10 python -m eval.tools.bench_reap_llmcompressor            # ~30 s; a first run also installs (~2 min in all)

1. creates (or reuses) a separate venv, `--venv` (default out/reap_llmcompressor/venv), with
   llmcompressor==0.14.0.1 and the transformers it pins (<= 5.17; ours is 5.24). torch is not
   installed there: the package index only has CUDA builds of torch for Linux (several GB) and
   the CPU wheel index is not reachable from this machine, so the venv gets a `.pth` file that
   puts this interpreter's torch (2.13.0, inside llmcompressor's range 2.10-2.14) on its path
   through a folder of symlinks holding torch alone (none of our other packages);
2. builds a tiny Qwen3-MoE offline (4 layers, 16 experts, top-4, norm_topk_prob, seeded random
   weights, float32, safetensors + a word-level tokenizer) and fixed calibration batches with
   right padding (8 batches x 4 sequences of 6-32 tokens);
3. runs llmcompressor's REAP in the venv (`eval/tools/reap_llmcompressor_driver.py`, a subprocess) and
   ours (`rolemerge.baselines`) here, for every K in `--keep`:
     ours                    our definition: non-padding tokens, one pass over the full model
     ours_unmasked           every position, padding included, one pass
     ours_seq                non-padding tokens; layer by layer: each layer pruned to its kept
                             experts before the next layer's saliency is measured
     ours_nomask_seq         every position, layer by layer, and no attention mask at all
                             (every position attends to every position)
     llmc_default            oneshot() defaults: the sequential pipeline (propagate_error: the
                             next layer is calibrated on the pruned layer's outputs), every
                             position; measured here: its decoder layers get no attention mask
     llmc_basic              pipeline="basic": one pass over the full model, every position
     llmc_basic_unpadded     pipeline="basic" on the same sequences one per batch with the
                             padding cut off: exactly the tokens `ours` counts
   llmcompressor knobs: only `sparsity` = (N - K) / N (it drops int(N x sparsity) experts) and
   `report_path` (to read the kept experts); `moe_calibrate_all_experts` stays at its default
   (True: every expert runs on every token; its saliency still sums over routed tokens only);
4. prints, per pair of runs and K, the share of layers whose kept sets are identical, the mean
   Jaccard index, the largest saliency difference (absolute and relative) and routed-count
   difference, the smallest saliency gap at the cut (K-th minus (K+1)-th largest: a difference
   smaller than that cannot reorder the kept set), and the kept sets per layer; writes
   `report.json` in `--out`.
"""
import json
import os
import subprocess
import sys
import time
from importlib import metadata

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from common.cli import add_threads, entry_parser, fail, number, run_cli, set_threads
from common.files import atomic_write_text
from rolemerge import baselines as bl
from rolemerge import blocks as blk
from rolemerge.merging import merge_block

VERSION = "0.14.0.1"
TORCH_RANGE = ((2, 10), (2, 14))     # llmcompressor 0.14.0.1: torch>=2.10.0,<=2.14.0
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
             mlp_only_layers=[], initializer_range=0.1, tie_word_embeddings=False)
RUNS = {"llmc_default": {"pipeline": None, "unpadded": False},
        "llmc_basic": {"pipeline": "basic", "unpadded": False},
        "llmc_basic_unpadded": {"pipeline": "basic", "unpadded": True}}
# our runs: (count non-padding positions only, prune layer by layer, usual attention mask)
OURS = {"ours": (True, False, True), "ours_unmasked": (False, False, True),
        "ours_seq": (True, True, True), "ours_nomask_seq": (False, True, False)}
# (ours, theirs, what the two have in common)
PAIRS = [("ours", "llmc_default", "each at its defaults"),
         ("ours", "llmc_basic_unpadded", "same non-padding tokens, one pass"),
         ("ours_unmasked", "llmc_basic", "every position, one pass"),
         ("ours_nomask_seq", "llmc_default", "every position, layer by layer, no attention mask"),
         # what each difference alone changes, on our side
         ("ours", "ours_unmasked", "only: padding positions counted"),
         ("ours", "ours_seq", "only: layer-by-layer pruning")]
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reap_llmcompressor_driver.py")


# ----------------------------------------------------------------------------- the venv

def venv_python(venv):
    return os.path.join(venv, "bin", "python")


def installed_version(venv):
    """llmcompressor's version in `venv`, or None (no venv, not installed, broken)."""
    try:
        r = subprocess.run([venv_python(venv), "-c", "import importlib.metadata as m; print(m.version('llmcompressor'))"],
                           capture_output=True, text=True, timeout=120)
    except OSError:
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def ensure_venv(venv):
    """Create `venv` with llmcompressor==VERSION unless it is already there (see module doc, step
    1). Raises RuntimeError with pip's last lines when the install fails."""
    if installed_version(venv) == VERSION:
        print(f"reusing {venv} (llmcompressor {VERSION})")
        return
    tv = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if not TORCH_RANGE[0] <= tv <= TORCH_RANGE[1]:
        raise RuntimeError(f"this torch {torch.__version__} is outside llmcompressor {VERSION}'s range 2.10-2.14; "
                           "run the bench from a venv with torch in that range")
    print(f"creating {venv} and installing llmcompressor=={VERSION} (a few minutes)", flush=True)
    if not os.path.exists(venv_python(venv)):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    site = subprocess.run([venv_python(venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    shared = os.path.abspath(os.path.join(venv, "shared_torch"))
    os.makedirs(shared, exist_ok=True)
    here = os.path.dirname(os.path.dirname(torch.__file__))
    names = {"torch", "functorch", "torchgen", f"torch-{metadata.version('torch')}.dist-info"}
    for n in sorted(names):
        if os.path.exists(os.path.join(here, n)) and not os.path.lexists(os.path.join(shared, n)):
            os.symlink(os.path.join(here, n), os.path.join(shared, n))
    with open(os.path.join(site, "shared_torch.pth"), "w") as f:
        f.write(shared + "\n")
    log = os.path.join(os.path.dirname(os.path.abspath(venv)), "pip.log")
    with open(log, "w") as f:
        r = subprocess.run([venv_python(venv), "-m", "pip", "install", "--disable-pip-version-check",
                            f"llmcompressor=={VERSION}"], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0 or installed_version(venv) != VERSION:
        tail = open(log).read().splitlines()[-15:]
        raise RuntimeError(f"installing llmcompressor=={VERSION} into {venv} failed (log {log}):\n" + "\n".join(tail))


# ----------------------------------------------------------------------------- model and data

def build_model(path, seed):
    """Tiny Qwen3-MoE (SHAPE) with seeded random float32 weights and a word-level tokenizer
    (token i = "t{i}", t0 = padding), saved to `path` as safetensors."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, pad_token_id=0)).eval()
    model.save_pretrained(path)
    t = Tokenizer(WordLevel({f"t{i}": i for i in range(SHAPE["vocab_size"])}, unk_token="t1"))
    t.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=t, pad_token="t0", unk_token="t1").save_pretrained(path)


def calibration_batches(seed, n_batches=8, batch=4, lengths=(6, 32)):
    """Fixed token batches: `n_batches` x `batch` sequences of random tokens 1..V-1 with lengths
    in `lengths`, right-padded with 0 -> list of {"input_ids", "attention_mask"} [batch, L]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        lens = torch.randint(lengths[0], lengths[1] + 1, (batch,), generator=g)
        L = int(lens.max())
        mask = (torch.arange(L)[None] < lens[:, None]).long()
        ids = torch.randint(1, SHAPE["vocab_size"], (batch, L), generator=g) * mask
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


# ----------------------------------------------------------------------------- ours

def prune_layer(block, keep):
    """Remove every expert of a Qwen3-MoE sparse block except `keep` (router rows and expert
    tensors), as llmcompressor's prune step does; the block keeps working with len(keep) experts.
    Pruning is RoleMerge's block merge with singleton groups of weight 1 (`rolemerge.merging.merge_block`)."""
    merge_block(block, [[e] for e in keep], [[1.0] for _ in keep])


@torch.no_grad()
def features(model, batches, masked, attention):
    """`rolemerge.baselines` features per MoE layer. masked: count non-padding positions only
    (our `collect_features`), else every position (what llmcompressor's hooks see); attention:
    the model gets its usual causal + padding mask, else an all-zero additive 4D mask (every
    position attends to every position: what llmcompressor's sequential pipeline ran, see README)."""
    if masked and attention:
        return bl.collect_features(model, batches)
    rec = bl.FeatureRecorder(model)
    try:
        for b in batches:
            rec.mask = b["attention_mask"].reshape(-1).bool() if masked else None
            B, L = b["input_ids"].shape
            model(**(b if attention else {"input_ids": b["input_ids"], "attention_mask": torch.zeros(B, 1, L, L)}))
    finally:
        rec.remove()
    return rec.feats


def entry(feats, K):
    s = bl.reap_saliency(feats["reap_sum"], feats["count"])
    return {"kept": [g[0] for g in bl.reap_groups(s, K)], "saliency": s.tolist(), "count": feats["count"].tolist()}


def run_ours(path, batches, keep):
    """{run: {K: {layer name: {"kept", "saliency", "count"}}}} for every run in OURS."""
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    names = [n for n, _ in blk.moe_blocks(load())]
    out = {}
    for run, (masked, layerwise, attention) in OURS.items():
        if not layerwise:                       # one pass; the kept sets of every K from the same saliency
            feats = features(load(), batches, masked, attention)
            out[run] = {str(K): {n: entry(f, K) for n, f in zip(names, feats)} for K in keep}
            continue
        out[run] = {}
        for K in keep:                          # layer l measured after layers < l were pruned to K
            model, res = load(), {}
            for li, name in enumerate(names):
                res[name] = entry(features(model, batches, masked, attention)[li], K)
                prune_layer(blk.moe_blocks(model)[li][1], res[name]["kept"])
            out[run][str(K)] = res
    return out


# ----------------------------------------------------------------------------- comparison

def cut_gap(saliency, K):
    """Saliency gap at the cut: K-th minus (K+1)-th largest (inf when K = N)."""
    s = sorted(saliency, reverse=True)
    return s[K - 1] - s[K] if K < len(s) else float("inf")


def compare(a, b):
    """Agreement of two runs at one K ({layer: entry} each): share of layers with identical kept
    sets, mean Jaccard, max |dS|, max |dS| / S, max |d count|, smallest cut gap (of `a`)."""
    same, jac, ds, rel, dc, gap = 0, [], 0.0, 0.0, 0.0, float("inf")
    for name in a:
        x, y = a[name], b[name]
        sx, sy = set(x["kept"]), set(y["kept"])
        same += sx == sy
        jac.append(len(sx & sy) / len(sx | sy))
        for u, v in zip(x["saliency"], y["saliency"]):
            ds = max(ds, abs(u - v))
            rel = max(rel, abs(u - v) / max(abs(u), abs(v), 1e-300))
        dc = max(dc, max(abs(u - v) for u, v in zip(x["count"], y["count"])))
        gap = min(gap, cut_gap(x["saliency"], len(x["kept"])))
    return {"identical": same / len(a), "jaccard": sum(jac) / len(jac), "max_abs_dS": ds, "max_rel_dS": rel,
            "max_abs_dcount": dc, "min_cut_gap": gap}


def report(results, keep):
    """Print the agreement tables and kept sets; return the summary rows."""
    rows = []
    print("\n| run a | run b | in common | K | identical layers | mean Jaccard | max abs dS | max rel dS "
          "| max d count | min cut gap |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ours, theirs, why in PAIRS:
        for K in keep:
            c = compare(results[ours][str(K)], results[theirs][str(K)])
            rows.append({"ours": ours, "theirs": theirs, "K": K, **c})
            print(f"| {ours} | {theirs} | {why} | {K} | {c['identical']:.2f} | {c['jaccard']:.3f} | "
                  f"{c['max_abs_dS']:.2e} | {c['max_rel_dS']:.2e} | {c['max_abs_dcount']:.0f} | {c['min_cut_gap']:.2e} |")
    for ours, theirs, _ in PAIRS[:1] + PAIRS[3:4]:
        print(f"\nkept experts per layer: {ours} vs {theirs}")
        for K in keep:
            for name, x in results[ours][str(K)].items():
                y = results[theirs][str(K)][name]
                diff = "" if set(x["kept"]) == set(y["kept"]) else \
                    f"   only ours {sorted(set(x['kept']) - set(y['kept']))}, only theirs {sorted(set(y['kept']) - set(x['kept']))}"
                print(f"  K={K:2d} {name}: {x['kept']}{' == same' if not diff else ' vs ' + str(y['kept'])}{diff}")
    return rows


def main():
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--out", default="out/reap_llmcompressor", help="folder for the model, data, venv and report.json")
    p.add_argument("--venv", default=None, help="llmcompressor's venv (default: OUT/venv); created if missing, else reused")
    p.add_argument("--keep", type=number(min=1), nargs="+", default=[12, 8, 4],
                   help=f"experts kept per layer (K of N={SHAPE['num_experts']}; >= top_k {SHAPE['num_experts_per_tok']})")
    p.add_argument("--seed", type=number(min=0), default=0, help="seed of the model weights and calibration tokens")
    add_threads(p)
    a = p.parse_args()
    bad = [K for K in a.keep if not SHAPE["num_experts_per_tok"] <= K < SHAPE["num_experts"]]
    if bad:
        fail(f"--keep {bad}: each K must be in [{SHAPE['num_experts_per_tok']}, {SHAPE['num_experts'] - 1}] "
             "(llmcompressor needs at least one expert dropped and top_k kept)")
    threads = set_threads(1 if a.threads is None else a.threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    venv = a.venv or os.path.join(a.out, "venv")
    t0 = time.perf_counter()
    run_cli(ensure_venv, venv)
    model_dir, calib = os.path.join(a.out, "model"), os.path.join(a.out, "calib.safetensors")
    build_model(model_dir, a.seed)
    batches = calibration_batches(a.seed)
    save_file({f"{k}.{i}": v.contiguous() for i, b in enumerate(batches) for k, v in b.items()}, calib)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    total = sum(b["attention_mask"].numel() for b in batches)
    print(f"model {model_dir}: Qwen3-MoE {SHAPE['num_hidden_layers']} layers x {SHAPE['num_experts']} experts, "
          f"top-{SHAPE['num_experts_per_tok']}; calibration {len(batches)} batches, {real} tokens + {total - real} padding")
    theirs_json = os.path.join(a.out, "llmcompressor.json")
    spec = {"model": model_dir, "calib": calib, "keep": a.keep, "runs": RUNS, "out": theirs_json, "threads": threads}
    atomic_write_text(os.path.join(a.out, "spec.json"), json.dumps(spec))
    # -P: the driver's folder (eval/, whose module names could shadow packages) stays off sys.path
    r = subprocess.run([venv_python(venv), "-P", DRIVER, os.path.join(a.out, "spec.json")],
                       env={**os.environ, "PYTHONPATH": ""}, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"llmcompressor's run failed (exit {r.returncode}):\n" + "\n".join(r.stderr.splitlines()[-25:]))
    print("\n".join(line for line in r.stdout.splitlines() if line.startswith("llmcompressor ")))
    theirs = json.load(open(theirs_json))
    results = {**run_ours(model_dir, batches, a.keep), **theirs["runs"]}
    rows = report(results, a.keep)
    print(f"\nversions: ours torch {torch.__version__}, transformers {__import__('transformers').__version__}; "
          f"bench venv {theirs['versions']}; {time.perf_counter() - t0:.0f} s")
    atomic_write_text(os.path.join(a.out, "report.json"), json.dumps(
        {"shape": SHAPE, "seed": a.seed, "keep": a.keep, "tokens": real, "padding": total - real,
         "versions": theirs["versions"], "agreement": rows, "results": results}, indent=1))


if __name__ == "__main__":
    main()
