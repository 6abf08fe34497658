"""Scale benchmark of the RoleMerge streaming merge (issue item 7; not a test).

    python -m eval.bench_rolemerge                       # ~1.2 GB synthetic checkpoint, 1-2 minutes
    python -m eval.bench_rolemerge --layers 48 --hidden 2048 --moe-intermediate 768   # Qwen3-30B-A3B experts (~58 GB)

1. writes a synthetic Qwen3-MoE checkpoint (random bf16 weights, the real per-expert key
   names `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, 128 experts, several
   shards) and random phase-separated routing statistics stamped for it;
2. measures the raw sequential read throughput of the shard files (the physical limit);
3. merges it to rho = .5 with `python -m rolemerge.merge --streaming` in a child process and
   reports its wall time, throughput (checkpoint bytes / wall time) and peak RSS, next to
   the child's RSS after imports (the interpreter + torch floor) and the bound the design
   aims at: floor + one shard + one layer's experts.
Page cache: every file is fsync'ed and dropped from the cache with posix_fadvise(DONTNEED)
before each timed read, so both timings read from the device (as far as the kernel obliges).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

# ru_maxrss survives fork + exec on Linux (it would report the parent's peak): read VmHWM,
# the high-water mark of this process's own address space, instead
CHILD = r"""
import json, sys, time
hwm = lambda: int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
from rolemerge import merge as mg
base = hwm()
t = time.perf_counter()
rep = mg.run_merge(sys.argv[1], sys.argv[2], sys.argv[3], rho=float(sys.argv[4]), streaming=True)
print(json.dumps({"seconds": time.perf_counter() - t, "rss_floor_kb": base, "K": rep["K"], "peak_rss_kb": hwm()}))
"""


def drop_cache(paths):
    """Ask the kernel to forget the cached pages of these files (clean pages only)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_checkpoint(path, layers, hidden, inter, experts, top_k, shard_gb, seed=0):
    """Synthetic Qwen3-MoE checkpoint + its config; returns the shard paths."""
    from safetensors.torch import save_file
    from rolemerge import calibrate as cal
    os.makedirs(path)
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)
    vocab, heads, hd = 1024, 8, hidden // 8
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hd,
              "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": inter,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "dtype": "bfloat16",
              "max_position_embeddings": 4096, "tie_word_embeddings": False}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    # tensors in layer order, flushed into a new shard whenever the current one is full
    def tensors():
        yield "model.embed_tokens.weight", rnd(vocab, hidden)
        for l in range(layers):
            p = f"model.layers.{l}."
            for n, s in (("self_attn.q_proj.weight", (heads * hd, hidden)), ("self_attn.k_proj.weight", (heads * hd, hidden)),
                         ("self_attn.v_proj.weight", (heads * hd, hidden)), ("self_attn.o_proj.weight", (hidden, heads * hd))):
                yield p + n, rnd(*s)
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                yield p + n, torch.ones(hidden, dtype=torch.bfloat16)
            for n in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                yield p + n, torch.ones(hd, dtype=torch.bfloat16)
            yield p + "mlp.gate.weight", rnd(experts, hidden)
            for e in range(experts):
                yield p + f"mlp.experts.{e}.gate_proj.weight", rnd(inter, hidden)
                yield p + f"mlp.experts.{e}.up_proj.weight", rnd(inter, hidden)
                yield p + f"mlp.experts.{e}.down_proj.weight", rnd(hidden, inter)
        yield "model.norm.weight", torch.ones(hidden, dtype=torch.bfloat16)
        yield "lm_head.weight", rnd(vocab, hidden)
    shards, cur, size, limit = [], {}, 0, shard_gb * 1e9
    def flush():
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(cur, os.path.join(path, name), metadata={"format": "pt"})
        shards.append((name, list(cur)))
    for k, t in tensors():
        if size and size + t.numel() * 2 > limit:
            flush()
            cur, size = {}, 0
        cur[k] = t
        size += t.numel() * 2
    flush()
    wmap = {k: n for n, keys in shards for k in keys}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wmap}, f)
    first_router = None
    from safetensors import safe_open
    with safe_open(os.path.join(path, wmap["model.layers.0.mlp.gate.weight"]), "pt") as f:
        first_router = f.get_tensor("model.layers.0.mlp.gate.weight")
    return [os.path.join(path, n) for n, _ in shards], cal.router_fingerprint(first_router)


def write_stats(path, layers, experts, top_k, fingerprint, seed=0):
    """Random phase-separated counts (Dirichlet-ish skew per phase) stamped for the checkpoint."""
    from rolemerge import calibrate as cal
    g = torch.Generator().manual_seed(seed)
    counts = (torch.rand(layers, 3, experts, generator=g) ** 4 * 1000).long()
    stats = {"model_id": "synthetic", "model_type": "qwen3_moe", "layer_names": [f"model.layers.{l}.mlp" for l in range(layers)],
             "layers": list(range(layers)), "num_experts": experts, "top_k": top_k, "fingerprint": fingerprint,
             "buckets": ["image", "question", "answer"],
             "sources": {"synthetic": {"counts": counts, "tokens": counts.sum(-1)[0] // top_k, "examples": 0}}}
    cal.save_stats(stats, path)


def raw_read(paths, buf_mb=64):
    """Sequential read of every file into one reused buffer; returns (bytes, seconds)."""
    buf, n = bytearray(buf_mb << 20), 0
    t = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    break
                n += k
    return n, time.perf_counter() - t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="out/bench_rolemerge", help="work directory (checkpoint, stats, merged output)")
    p.add_argument("--layers", type=int, default=16, help="MoE layers")
    p.add_argument("--hidden", type=int, default=512, help="hidden size")
    p.add_argument("--moe-intermediate", type=int, default=192, help="expert intermediate size")
    p.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--shard-gb", type=float, default=0.3, help="shard size in GB")
    p.add_argument("--rho", type=float, default=0.5, help="retention ratio of the merge")
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and merged output")
    a = p.parse_args(argv)
    src, out, stats = os.path.join(a.dir, "src"), os.path.join(a.dir, "merged"), os.path.join(a.dir, "stats.safetensors")
    shutil.rmtree(a.dir, ignore_errors=True)
    t = time.perf_counter()
    shards, fp = write_checkpoint(src, a.layers, a.hidden, a.moe_intermediate, a.experts, a.top_k, a.shard_gb)
    write_stats(stats, a.layers, a.experts, a.top_k, fp)
    total = sum(os.path.getsize(s) for s in shards)
    print(f"synthetic checkpoint: {total / 1e9:.2f} GB in {len(shards)} shards, written in {time.perf_counter() - t:.0f}s")
    drop_cache(shards)
    nbytes, secs = raw_read(shards)
    raw = nbytes / secs / 1e9
    drop_cache(shards)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", CHILD, src, stats, out, str(a.rho)], capture_output=True, text=True,
                         env=env)
    if res.returncode:
        raise SystemExit(f"merge failed:\n{res.stderr[-3000:]}")
    m = json.loads(res.stdout.strip().splitlines()[-1])
    merged = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    shard_max = max(os.path.getsize(s) for s in shards)
    layer_experts = a.experts * 3 * a.hidden * a.moe_intermediate * 2
    floor, peak = m["rss_floor_kb"] * 1024, m["peak_rss_kb"] * 1024
    merge_gbs = total / m["seconds"] / 1e9
    res = {"checkpoint_gb": total / 1e9, "shards": len(shards), "largest_shard_gb": shard_max / 1e9,
           "layer_experts_gb": layer_experts / 1e9, "merged_gb": merged / 1e9, "K": m["K"], "N": a.experts,
           "raw_read_gb_s": raw, "merge_s": m["seconds"], "merge_gb_s": merge_gbs, "throughput_ratio": merge_gbs / raw,
           "peak_rss_gb": peak / 1e9, "rss_floor_gb": floor / 1e9, "peak_above_floor_gb": (peak - floor) / 1e9,
           "rss_bound_gb": (floor + shard_max + layer_experts) / 1e9,
           "peak_rss_over_bound": peak / (floor + shard_max + layer_experts)}
    print(json.dumps(res, indent=1))
    print(f"merge {merge_gbs:.2f} GB/s vs raw read {raw:.2f} GB/s (ratio {res['throughput_ratio']:.2f}, goal >= 0.5); "
          f"peak RSS {peak / 1e9:.2f} GB (floor {floor / 1e9:.2f} GB; bound floor+shard+layer "
          f"{res['rss_bound_gb']:.2f} GB, ratio {res['peak_rss_over_bound']:.2f}, goal < 1)")
    with open(os.path.join(a.dir, "bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    if not a.keep:
        shutil.rmtree(src)
        shutil.rmtree(out)
    return res


if __name__ == "__main__":
    main()
