"""Scale benchmark of the RoleMerge streaming merge (not a test).

    python -m eval.tools.bench_rolemerge                       # ~1.2 GB synthetic checkpoint, 1-2 minutes
    python -m eval.tools.bench_rolemerge --layers 48 --hidden 2048 --moe-intermediate 768   # Qwen3-30B-A3B experts (~58 GB)

1. writes a synthetic Qwen3-MoE checkpoint (random bf16 weights, the real per-expert key
   names `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, 128 experts, several
   shards) and random phase-separated routing statistics stamped for it;
2. times, side by side in one run: a raw sequential read of the shard files (the physical
   limit), a plain safetensors copy (`load_file` + `save_file` of every shard, in a child
   process: what any tool that rewrites a checkpoint pays), and the merge to rho = .5 with
   `rolemerge.merge.run_merge` (streaming, the default) in a child process (planning included);
3. prints merge / copy and merge / raw-read time ratios (goal: merge <= 1.5 x copy), the
   planning seconds alone, and the peak RSS of copy and merge next to the child's RSS after
   imports (the interpreter + torch floor) and the bound the design aims at: floor + one
   shard + one layer's experts.
Page cache: every file is fsync'ed and dropped from the cache with posix_fadvise(DONTNEED)
before each timed read (`--warm` keeps it warm instead: the files are read once first), so
all three read from the same place.
"""
import json
import os
import shutil
import subprocess
import sys
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.cli import entry_parser
from common.files import atomic_write_text
from rolemerge import blocks as blk
from rolemerge import planning
from rolemerge import stats as rstats

# ru_maxrss survives fork + exec on Linux (it would report the parent's peak): read VmHWM,
# the high-water mark of this process's own address space, instead
CHILD = r"""
import json, sys, time
hwm = lambda: int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
from rolemerge import merge as mg
from rolemerge.planning import MergeConfig
base = hwm()
t = time.perf_counter()
rep = mg.run_merge(MergeConfig(model=sys.argv[1], stats=sys.argv[2], out=sys.argv[3], rho=float(sys.argv[4])))
print(json.dumps({"seconds": time.perf_counter() - t, "rss_floor_kb": base, "K": rep["K"], "peak_rss_kb": hwm(),
                  "plan_seconds": rep.get("plan_seconds")}))
"""
# the baseline every checkpoint rewriter pays: safetensors' own load + save of each shard
COPY = r"""
import json, os, sys, time
hwm = lambda: int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
import torch
from safetensors.torch import load_file, save_file
base = hwm()
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
t = time.perf_counter()
for s in sorted(os.listdir(src)):
    if s.endswith(".safetensors"):
        save_file(load_file(os.path.join(src, s)), os.path.join(dst, s), metadata={"format": "pt"})
print(json.dumps({"seconds": time.perf_counter() - t, "rss_floor_kb": base, "peak_rss_kb": hwm()}))
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
    with safe_open(os.path.join(path, wmap["model.layers.0.mlp.gate.weight"]), "pt") as f:
        first_router = f.get_tensor("model.layers.0.mlp.gate.weight")
    return [os.path.join(path, n) for n, _ in shards], blk.router_fingerprint(first_router)


def write_stats(path, layers, experts, top_k, fingerprint, seed=0):
    """Random phase-separated counts (Dirichlet-ish skew per phase) stamped for the checkpoint."""
    g = torch.Generator().manual_seed(seed)
    counts = (torch.rand(layers, 3, experts, generator=g) ** 4 * 1000).long()
    stats = {"model_id": "synthetic", "model_type": "qwen3_moe", "layer_names": [f"model.layers.{l}.mlp" for l in range(layers)],
             "layers": list(range(layers)), "num_experts": experts, "top_k": top_k, "fingerprint": fingerprint,
             "buckets": ["image", "question", "answer"],
             "sources": {"synthetic": {"counts": counts, "tokens": counts.sum(-1)[0] // top_k, "examples": 0}}}
    rstats.save_stats(stats, path)


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


def child(code, *args):
    """Run `code` in a fresh interpreter (its own RSS high-water mark); returns its JSON line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = entry_parser(__spec__.name, __doc__)
    p.add_argument("--dir", default="out/bench_rolemerge", help="work directory (checkpoint, stats, merged output)")
    p.add_argument("--layers", type=int, default=16, help="MoE layers")
    p.add_argument("--hidden", type=int, default=512, help="hidden size")
    p.add_argument("--moe-intermediate", type=int, default=192, help="expert intermediate size")
    p.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--shard-gb", type=float, default=0.3, help="shard size in GB")
    p.add_argument("--rho", type=float, default=0.5, help="retention ratio of the merge")
    p.add_argument("--warm", action="store_true", help="time reads from the page cache instead of the device")
    p.add_argument("--repeat", type=int, default=1, help="timed rounds (raw, copy, merge each); the best is kept")
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and merged output")
    a = p.parse_args(argv)
    src, out, stats = os.path.join(a.dir, "src"), os.path.join(a.dir, "merged"), os.path.join(a.dir, "stats.safetensors")
    cp = os.path.join(a.dir, "copy")
    shutil.rmtree(a.dir, ignore_errors=True)
    t = time.perf_counter()
    shards, fp = write_checkpoint(src, a.layers, a.hidden, a.moe_intermediate, a.experts, a.top_k, a.shard_gb)
    write_stats(stats, a.layers, a.experts, a.top_k, fp)
    total = sum(os.path.getsize(s) for s in shards)
    print(f"synthetic checkpoint: {total / 1e9:.2f} GB in {len(shards)} shards, written in {time.perf_counter() - t:.0f}s; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    prep = (lambda: raw_read(shards)) if a.warm else (lambda: drop_cache(shards))
    raws, copies, merges = [], [], []
    for _ in range(a.repeat):
        prep()
        nbytes, secs = raw_read(shards)
        raws.append(secs)
        prep()
        shutil.rmtree(cp, ignore_errors=True)
        copies.append(child(COPY, src, cp))
        prep()
        shutil.rmtree(out, ignore_errors=True)
        merges.append(child(CHILD, src, stats, out, a.rho))
    raw_s = min(raws)
    c = min(copies, key=lambda r: r["seconds"])
    m = min(merges, key=lambda r: r["seconds"])
    merged = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    shard_max = max(os.path.getsize(s) for s in shards)
    layer_experts = a.experts * 3 * a.hidden * a.moe_intermediate * 2
    floor, peak = m["rss_floor_kb"] * 1024, m["peak_rss_kb"] * 1024
    res = {"checkpoint_gb": total / 1e9, "shards": len(shards), "largest_shard_gb": shard_max / 1e9,
           "layer_experts_gb": layer_experts / 1e9, "merged_gb": merged / 1e9, "K": m["K"], "N": a.experts,
           "cache": "warm" if a.warm else "dropped", "load_average": os.getloadavg()[0], "repeat": a.repeat,
           "raw_read_s": raw_s, "raw_read_gb_s": total / raw_s / 1e9, "copy_s": c["seconds"], "merge_s": m["seconds"],
           "plan_s": m["plan_seconds"], "merge_over_copy": m["seconds"] / c["seconds"], "merge_over_raw": m["seconds"] / raw_s,
           "copy_over_raw": c["seconds"] / raw_s, "copy_peak_rss_gb": c["peak_rss_kb"] * 1024 / 1e9,
           "peak_rss_gb": peak / 1e9, "rss_floor_gb": floor / 1e9, "peak_above_floor_gb": (peak - floor) / 1e9,
           "rss_bound_gb": (floor + shard_max + layer_experts) / 1e9,
           "peak_rss_over_bound": peak / (floor + shard_max + layer_experts)}
    print(json.dumps(res, indent=1))
    print(f"merge {m['seconds']:.2f}s (planning {m['plan_seconds']:.2f}s) | safetensors copy {c['seconds']:.2f}s | "
          f"raw read {raw_s:.2f}s  ->  merge/copy {res['merge_over_copy']:.2f} (goal <= 1.5), merge/raw "
          f"{res['merge_over_raw']:.2f}, copy/raw {res['copy_over_raw']:.2f}")
    print(f"peak RSS: merge {peak / 1e9:.2f} GB, copy {res['copy_peak_rss_gb']:.2f} GB (floor {floor / 1e9:.2f} GB; "
          f"bound floor+shard+layer {res['rss_bound_gb']:.2f} GB, merge/bound {res['peak_rss_over_bound']:.2f}, goal < 1)")
    # planning alone at Qwen3-30B-A3B's shape (48 MoE layers x 128 experts), in this process
    s48 = os.path.join(a.dir, "stats48.safetensors")
    write_stats(s48, 48, 128, a.top_k, fp)
    st = rstats.load_stats([s48])
    t, c = time.perf_counter(), time.process_time()
    planning.make_plan(st, 64)
    res.update(plan48_wall_s=time.perf_counter() - t, plan48_cpu_s=time.process_time() - c)
    print(f"planning 48 layers x 128 experts (K = 64): {res['plan48_wall_s']:.2f}s wall, {res['plan48_cpu_s']:.2f}s CPU "
          f"(goal <= 1 s)")
    atomic_write_text(os.path.join(a.dir, "bench.json"), json.dumps(res, indent=1))
    if not a.keep:
        for d in (src, out, cp):
            shutil.rmtree(d)
    return res


if __name__ == "__main__":
    main()
