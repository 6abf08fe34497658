"""Merge the routed experts of an MoE checkpoint into a smaller one (paper §4.3-4.4, App. B.2).

    python -m rolemerge.merge --model tiny-moe --stats out/rolemerge/stats.safetensors \\
        --rho 0.5 --out out/rolemerge/tiny-moe-rho0.5
    python -m rolemerge.merge ... --streaming          # from the safetensors shards alone

Input: routing statistics (rolemerge.calibrate), a checkpoint directory and the retention
ratio rho (K = round(rho N) experts kept in every MoE layer) or K itself. Output: a
`save_pretrained` directory whose config carries K experts, loadable with plain
`from_pretrained`, the tokenizer / processor files copied, and `rolemerge_report.json`
(groups, weights, kappa / lambda / tau, ACR and expert-phase MI retention per layer).

Every merged expert is  Theta_G = sum_{e in G} omega_e Theta_e  and its router row (and
DeepSeek-V3's score-correction bias) r_G = sum_{e in G} omega_e r_e with the same weights
(§4.4); attention, shared experts, dense layers and the vision tower are untouched.

Two paths with identical output tensors (tested):
- in memory: load the model, replace the fused expert / router parameters, save_pretrained;
- streaming: read the safetensors headers, byte-copy untouched tensors, read only the expert
  tensors of one layer at a time (pread, no mmap) and write merged shards. Works for the
  per-expert on-disk layout (Qwen2/3-MoE, OLMoE, DeepSeek: experts.N.*_proj.weight; Mixtral:
  block_sparse_moe.experts.N.w1/w2/w3) and the fused one (Qwen3-VL-MoE: experts.gate_up_proj).
Memory of the streaming path: one layer's merged experts plus one I/O buffer.

The groupings are planned all at once from the stats (all layers share lambda's mean); every
step is deterministic, so the same inputs give byte-identical tensors.
"""
import argparse
import json
import math
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from rolemerge import calibrate as cal
from rolemerge import model as rm

REPORT = "rolemerge_report.json"
TMP_MARK = ".rolemerge-tmp"  # written first into `<out>.tmp`: a leftover temp folder is ours to delete

WEIGHT_FILES = re.compile(r".*\.safetensors$|.*\.safetensors\.index\.json$|.*\.bin$|.*\.bin\.index\.json$")


def _ours(path, marks):
    """True if nothing is at `path`, or it is a real directory that is empty or holds one of `marks`."""
    if not os.path.lexists(path):
        return True
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    names = os.listdir(path)
    return not names or any(m in names for m in marks)


def _start_tmp(tmp):
    """A fresh `<out>.tmp` (a killed earlier run's partial one is deleted: `run_merge` checked it is ours)
    holding TMP_MARK first, so that a kill from here on leaves a folder a rerun may delete."""
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    open(os.path.join(tmp, TMP_MARK), "w").close()


class MergeError(ValueError):
    """The merge cannot run as asked; the message says why."""


# ----------------------------------------------------------------------------- planning

def target_k(n_experts, top_k, rho=None, k=None):
    """K from rho (round half up of rho N) or K itself. Raises MergeError for rho outside
    (0, 1], K outside [top_k, N] (a router cannot pick top_k of fewer than top_k experts)."""
    check_rho_k(rho, k)
    if rho is not None:
        k = int(math.floor(rho * n_experts + 0.5))
    if k > n_experts:
        raise MergeError(f"K={k} exceeds the {n_experts} experts per layer")
    if k < top_k:
        raise MergeError(f"K={k} is smaller than the model's top_k={top_k}: every token routes to {top_k} experts, "
                         f"so at least {top_k} must remain (use a larger rho)")
    return k


def check_rho_k(rho=None, k=None):
    """The checks on rho / K that need no model: exactly one given, rho in (0, 1], K >= 1."""
    if (rho is None) == (k is None):
        raise MergeError("give exactly one of rho and K")
    if rho is not None and not 0 < rho <= 1:   # also refuses nan
        raise MergeError(f"rho={rho} must be in (0, 1] (the fraction of experts kept per layer)")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise MergeError(f"K={k!r} must be one int for every layer: per-layer K is not supported "
                         f"(a transformers config holds a single expert count)")
    if k is not None and k < 1:
        raise MergeError(f"K={k} must be a positive number of experts")


def check_stats(stats, info):
    """Raise MergeError if the stats were recorded on another model than `info` describes
    (cal.model_info or the streaming equivalent)."""
    for key in ("model_type", "num_experts", "top_k", "layers", "fingerprint"):
        if stats[key] != info[key]:
            raise MergeError(f"statistics were recorded on a different model ({key}: stats {stats[key]!r} vs "
                             f"checkpoint {info[key]!r}; stats model {stats['model_id']!r}); recalibrate on this one")


def check_k_family(model_type, tc, K):
    """DeepSeek group-limited routing splits experts into n_group equal groups: K must divide.
    tc: the text config as a dict."""
    grouped = model_type == "deepseek_v3" or tc.get("topk_method") == "group_limited_greedy"
    n_group = tc.get("n_group") or 1
    if grouped and K % n_group:
        raise MergeError(f"K={K} is not a multiple of n_group={n_group} (group-limited routing of this model)")


def make_plan(stats, K, method="rolemerge", lam=0.03, linkage="single", seed=0, routers=None, features=None):
    """Groups, weights and diagnostics for every MoE layer.

    stats: cal.load_stats output; routers: callable -> list of [N, H] router weights (only
    called for the frequency baseline); features: per-layer `rolemerge.baselines.collect_features`
    output (only for msmoe / hcsmoe / reap). Returns a dict with 'groups' [L][G][members],
    'weights' [L][G][w], 'layers' (per-layer diagnostics) and summary ACR / MI retention."""
    counts = cal.total_counts(stats).double()                    # [L, B, N]
    groups, info = rm.plan(counts, K, method, lam, linkage, seed, routers() if method == "frequency" else None,
                           features)
    mass = counts.sum(1)                                          # [L, N]
    weights = [rm.merge_weights(mass[l], g) for l, g in enumerate(groups)]
    records = [(n, s["counts"].double()) for n, s in stats["sources"].items()]
    layers, acrs, mi_num, mi_den = [], [], 0.0, 0.0
    covers = all(sum(len(x) for x in g) == stats["num_experts"] for g in groups)   # False for pruning
    for l, g in enumerate(groups):
        acr_l = {n: rm.acr(rm.phase_distributions(c[l])[-1], g) for n, c in records}
        acrs += list(acr_l.values())
        for _, c in records:
            P_e, q = rm.role_profiles(rm.phase_distributions(c[l]))
            mi_den += rm.mutual_information(P_e, q)
            mi_num += rm.mutual_information(P_e, q, g) if covers else 0.0
        layers.append(dict(info[l], name=stats["layer_names"][l], groups=g, weights=weights[l], acr=acr_l,
                           mi_retention=rm.mi_retention([c[l] for _, c in records], g) if covers else None))
    # MI retention compares groupings of all experts; pruning drops experts, so it has none
    mi = (mi_num / mi_den if mi_den > 0 else 1.0) if covers else None
    return {"method": method, "K": K, "N": stats["num_experts"], "lambda": lam, "linkage": linkage, "seed": seed,
            "groups": groups, "weights": weights, "layers": layers, "acr_mean": sum(acrs) / len(acrs),
            "mi_retention": mi}


# ----------------------------------------------------------------------------- tensor merge

def weighted_sum(tensors, weights, dtype):
    """sum_i w_i t_i accumulated in float32 in the given order, cast to dtype. The one place
    both paths merge tensors, so their outputs agree bit for bit."""
    acc = tensors[0].to(torch.float32) * weights[0]
    for t, w in zip(tensors[1:], weights[1:]):
        acc.add_(t, alpha=w)                     # promotes t to float32 inside the kernel
    return acc.to(dtype)


def merge_stacked(x, groups, weights):
    """x [N, ...] (expert axis first) -> [G, ...] merged with the group weights."""
    return torch.stack([weighted_sum([x[e] for e in g], w, x.dtype) for g, w in zip(groups, weights)])


@torch.no_grad()
def merge_model(model, plan):
    """In-memory merge: replace every MoE block's expert tensors, router rows (and router
    score-correction bias) by their group merges; update the expert counts in modules and
    config. model is changed in place and returned."""
    blocks = cal.moe_blocks(model)
    K = len(plan["groups"][0])
    for (name, block), groups, weights in zip(blocks, plan["groups"], plan["weights"]):
        dev = block.gate.weight.device
        for mod, pname in ((block.experts, "gate_up_proj"), (block.experts, "down_proj"), (block.gate, "weight")):
            p = getattr(mod, pname)
            setattr(mod, pname, torch.nn.Parameter(merge_stacked(p.detach().cpu(), groups, weights).to(dev),
                                                   requires_grad=False))
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            block.gate.e_score_correction_bias = merge_stacked(bias.cpu(), groups, weights).to(dev)
        for mod in (block, block.gate, block.experts):
            for attr in cal.EXPERT_FIELDS:
                if isinstance(getattr(mod, attr, None), int):
                    setattr(mod, attr, K)
    setattr(cal.text_config(model.config), cal.expert_count_field(model.config), K)
    return model


def copy_side_files(src, dst):
    """Copy tokenizer / processor / chat-template files (everything but weights and files
    already written to dst)."""
    for f in sorted(os.listdir(src)):
        s, d = os.path.join(src, f), os.path.join(dst, f)
        if os.path.isfile(s) and not WEIGHT_FILES.match(f) and not os.path.exists(d):
            shutil.copy2(s, d)


def load_model_for_merge(path, dtype=None):
    """The model alone (no processor) of a supported checkpoint, in eval mode; safetensors
    only, no checkpoint code (`cal.load_config` checks the directory first)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    config = cal.load_config(path)
    vlm = config.model_type in cal.VLM_TYPES + ("deepseek_ocr2",)
    cls = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=dtype, trust_remote_code=False, use_safetensors=True).eval()


# ----------------------------------------------------------------------------- streaming I/O

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
FLOATS = ("F32", "F16", "BF16", "F64")
RE_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<rest>.+)$")
RE_FUSED = re.compile(r"^(?P<pre>.*\.experts)\.(?P<rest>gate_up_proj|down_proj)$")
RE_ROUTER = re.compile(r"^(?P<blk>.*)\.gate\.(?P<rest>weight|e_score_correction_bias)$")
CHUNK = 64 << 20


def read_header(path):
    """safetensors header -> ({name: {dtype, shape, data_offsets}}, data_start, metadata).
    Raises MergeError naming the file when it is truncated or corrupt (its size must match
    the header exactly), so no tensor is ever read past the end of a short file."""
    from common.checkpoint import CheckpointError, check_safetensors
    try:
        return check_safetensors(path)
    except CheckpointError as e:
        raise MergeError(str(e)) from None


def read_tensor(path, start, entry, index=None):
    """Read one tensor (or row `index` of its first axis) with pread into fresh memory."""
    dt = DTYPES[entry["dtype"]]
    shape = list(entry["shape"])
    a, b = entry["data_offsets"]
    if index is not None:
        row = (b - a) // shape[0]
        a, b, shape = a + index * row, a + (index + 1) * row, shape[1:]
    buf = bytearray(b - a)
    with open(path, "rb") as f:
        f.seek(start + a)
        if f.readinto(buf) != len(buf):   # the file shrank after read_header checked it
            raise MergeError(f"{path}: short read ({len(buf)} bytes at {start + a}); the file is truncated")
    return torch.frombuffer(buf, dtype=torch.uint8).view(dt).reshape(shape) if buf else torch.empty(shape, dtype=dt)


def copy_bytes(src, dst_f, offset, n):
    """Copy n bytes of file src from offset into the open file dst_f (in-kernel when possible)."""
    with open(src, "rb") as f:
        left = n
        if hasattr(os, "copy_file_range"):
            dst_f.flush()
            while left:
                done = os.copy_file_range(f.fileno(), dst_f.fileno(), min(left, CHUNK), offset + n - left)
                if done == 0:
                    break
                left -= done
            dst_f.seek(0, os.SEEK_END)
        f.seek(offset + n - left)
        while left:
            chunk = f.read(min(left, CHUNK))
            if not chunk:                 # end of file: never loop forever or pad with nothing
                raise MergeError(f"{src}: ends {left} bytes early; the file is truncated")
            dst_f.write(chunk)
            left -= len(chunk)


def shard_files(path):
    """[(shard file name)] of a safetensors checkpoint directory (index or single file)."""
    from common.checkpoint import CheckpointError, safetensors_files
    try:
        files = safetensors_files(path)
    except CheckpointError as e:
        raise MergeError(str(e)) from None
    if not files:
        raise MergeError(f"{path}: no *.safetensors weights (streaming reads safetensors only; pickled .bin "
                         f"files are never loaded)")
    return [os.path.basename(f) for f in files]


def scan_checkpoint(path):
    """Headers of every shard and the MoE layout found in the tensor names.

    Returns (headers {shard: (entries, data_start)}, where {key: shard},
    layers {layer_index: {"experts": {key: (kind, e or None, rest)}, "router": [keys]}})."""
    headers, where = {}, {}
    for s in shard_files(path):
        entries, start, _ = read_header(os.path.join(path, s))
        headers[s] = (entries, start)
        for k in entries:
            where[k] = s
    layers = {}
    for k in where:
        m = RE_EXPERT.match(k) or RE_FUSED.match(k)
        if m:
            pre = m.group("pre")
            lay = layers.setdefault(pre[:-len(".experts")], {"experts": {}, "router": []})
            lay["experts"][k] = (int(m.group("e")) if "e" in m.groupdict() else None, m.group("rest"))
    for k in where:
        m = RE_ROUTER.match(k)
        if m and m.group("blk") in layers:
            layers[m.group("blk")]["router"].append(k)
    return headers, where, {cal.layer_index(b + "."): dict(v, block=b) for b, v in layers.items()}


def _expert_config(config):
    """The (sub-)dict of a config.json that holds the routed-expert count."""
    for sub in (config.get("text_config") or {}, config):
        if any(f in sub for f in cal.EXPERT_FIELDS):
            return sub
    raise MergeError(f"config.json ({config.get('model_type')}) has none of the expert-count fields {cal.EXPERT_FIELDS}")


def streaming_info(path, config):
    """The model description check_stats compares against, from files only."""
    headers, where, layers = scan_checkpoint(path)
    if not layers:
        raise MergeError(f"{path}: no routed-expert tensors found in the safetensors files")
    first = layers[min(layers)]
    rkey = [k for k in first["router"] if k.endswith(".weight")][0]
    entries, start = headers[where[rkey]]
    w = read_tensor(os.path.join(path, where[rkey]), start, entries[rkey])
    tc = _expert_config(config)
    return {"model_type": config["model_type"], "num_experts": int(w.shape[0]), "top_k": int(tc["num_experts_per_tok"]),
            "layers": sorted(layers), "fingerprint": cal.router_fingerprint(w)}


def merge_streaming(src, dst, plan):
    """Merge from the checkpoint files alone into dst (created if missing; holds nothing else yet).

    Output shard i holds the untouched tensors of input shard i (byte copies) and the merged
    experts / routers of every MoE layer whose router lives in shard i. Raises MergeError for
    quantised or non-float expert tensors."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    headers, where, layers = scan_checkpoint(src)
    order = sorted(layers)
    K = len(plan["groups"][0])
    # --- plan every output tensor: name -> (dtype, shape, producer)
    out = {s: {} for s in headers}
    merged_keys = set()
    for li, lidx in enumerate(order):
        lay, groups, weights = layers[lidx], plan["groups"][li], plan["weights"][li]
        home = where[lay["router"][0]] if lay["router"] else where[next(iter(lay["experts"]))]
        per_rest = {}
        for k, (e, rest) in lay["experts"].items():
            per_rest.setdefault(rest, {})[e] = k
            merged_keys.add(k)
        for rest, by_e in sorted(per_rest.items()):
            if None in by_e:                     # fused [N, ...]
                k = by_e[None]
                ent = headers[where[k]][0][k]
                if ent["dtype"] not in FLOATS:
                    raise MergeError(f"{k}: dtype {ent['dtype']} (quantised experts are not supported)")
                out[home][k] = (ent["dtype"], [K] + ent["shape"][1:], ("fused", k, groups, weights))
            else:                                # per expert: experts.{g}.{rest}
                ent = headers[where[by_e[0]]][0][by_e[0]]
                if ent["dtype"] not in FLOATS:
                    raise MergeError(f"{by_e[0]}: dtype {ent['dtype']} (quantised experts are not supported)")
                for g, (grp, w) in enumerate(zip(groups, weights)):
                    name = f"{lay['block']}.experts.{g}.{rest}"
                    out[home][name] = (ent["dtype"], ent["shape"], ("sum", [by_e[e] for e in grp], w))
        for k in lay["router"]:
            merged_keys.add(k)
            ent = headers[where[k]][0][k]
            out[home][k] = (ent["dtype"], [K] + ent["shape"][1:], ("fused", k, groups, weights))
    for s, (entries, _) in headers.items():
        for k, ent in entries.items():
            if k not in merged_keys:
                out[s][k] = (ent["dtype"], ent["shape"], ("copy", k))
    # --- write shards: header first (sizes are known), then the data in header order
    os.makedirs(dst, exist_ok=True)
    weight_map, total = {}, 0
    for s in sorted(headers):
        if not out[s]:
            continue
        names = sorted(out[s])
        hdr, off = {"__metadata__": {"format": "pt"}}, 0
        for n in names:
            dt, shape, _ = out[s][n]
            size = math.prod(shape) * torch.empty((), dtype=DTYPES[dt]).element_size()
            hdr[n] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + size]}
            off += size
            weight_map[n] = s
        total += off
        hb = json.dumps(hdr, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(os.path.join(dst, s), "wb") as f:
            f.write(len(hb).to_bytes(8, "little"))
            f.write(hb)
            specs = [out[s][n] for n in names]
            with ThreadPoolExecutor(1) as pool:      # read tensor i+1 while merging / writing tensor i
                nxt = pool.submit(_read_inputs, src, headers, where, specs[0])
                for i, spec in enumerate(specs):
                    inputs = nxt.result()
                    if i + 1 < len(specs):
                        nxt = pool.submit(_read_inputs, src, headers, where, specs[i + 1])
                    _write_one(f, src, headers, where, spec, inputs)
    # --- config, index, side files
    sub = _expert_config(config)
    sub[next(f for f in cal.EXPERT_FIELDS if f in sub)] = K
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    copy_side_files(src, dst)


def _read_inputs(src, headers, where, spec):
    """The expert tensors one output tensor is merged from (None for a byte copy).
    Runs in the prefetch thread, so reading overlaps merging and writing."""
    prod = spec[2]
    if prod[0] == "copy":
        return None
    rd = lambda k, e=None: read_tensor(os.path.join(src, where[k]), headers[where[k]][1], headers[where[k]][0][k], e)
    if prod[0] == "sum":
        return [rd(k) for k in prod[1]]
    return [[rd(prod[1], e) for e in g] for g in prod[2]]   # fused: rows of one [N, ...] tensor


def _write_one(f, src, headers, where, spec, inputs):
    """Append one output tensor's bytes to the open shard f: a byte copy, or the merge of
    `inputs` (from _read_inputs) with the group weights."""
    dt, shape, prod = spec
    if prod[0] == "copy":
        k = prod[1]
        entries, start = headers[where[k]]
        a, b = entries[k]["data_offsets"]
        copy_bytes(os.path.join(src, where[k]), f, start + a, b - a)
        return
    if prod[0] == "sum":
        t = weighted_sum(inputs, prod[2], DTYPES[dt])
    else:
        t = torch.stack([weighted_sum(x, w, DTYPES[dt]) for x, w in zip(inputs, prod[3])])
    if t.numel():
        f.write(t.contiguous().view(torch.uint8).numpy())


# ----------------------------------------------------------------------------- entry point

def run_merge(model_path, stats_paths, out, rho=None, k=None, method="rolemerge", lam=0.03, linkage="single",
              seed=0, streaming=False, force=False, dtype=None, features=None):
    """Plan + merge + save + report. Returns the report dict. Raises MergeError / CalibrationError.

    The output is written to `{out}.tmp` and renamed to `out` only when complete (report
    last), so a killed run never leaves a directory at `out`; a rerun starts the `.tmp` over
    and gives the same bytes. `force` replaces only a previous RoleMerge output (a directory
    holding rolemerge_report.json) or an empty directory, never other data; likewise a leftover
    `{out}.tmp` is deleted only if it holds TMP_MARK or the report, `{out}.old` only if it holds the report."""
    from common import backbone as bb
    src = bb.resolve(model_path)
    if not os.path.exists(os.path.join(src, "config.json")):
        raise MergeError(f"{src}: no config.json (not a save_pretrained checkpoint directory)")
    check_rho_k(rho, k)
    if linkage not in rm.LINKAGES:   # every method, before any loading
        raise MergeError(f"unknown linkage {linkage!r}; choose from {rm.LINKAGES}")
    if method in rm.FEATURE_METHODS and features is None:
        raise MergeError(f"method {method!r} needs calibration features (expert outputs, router logits): collect "
                         f"them with rolemerge.baselines.collect_features and pass run_merge(features=...)")
    if not (lam >= 0 and math.isfinite(lam)):
        raise MergeError(f"lambda={lam} must be a finite number >= 0 (paper: 0.03)")
    if streaming and dtype is not None:
        raise MergeError("--dtype applies to the in-memory merge only; the streaming path keeps every tensor's "
                         "dtype from the checkpoint files")
    out = out.rstrip("/") or out
    real_out, real_src = os.path.realpath(out), os.path.realpath(src)
    if real_out == real_src or os.path.commonpath([real_out, real_src]) == real_out:
        raise MergeError(f"--out {out} is the input checkpoint (or a folder holding it); write the merged model "
                         f"to a new directory")
    if os.path.lexists(out):
        if not force:
            raise MergeError(f"{out} exists; pass --force to overwrite it")
        if not os.path.isdir(out) or os.path.islink(out) or (
                os.listdir(out) and not os.path.exists(os.path.join(out, REPORT))):
            raise MergeError(f"{out} exists and is not a RoleMerge output (no {REPORT}); refusing to delete it "
                             f"even with --force: choose a new --out")
    tmp, old = out + ".tmp", out + ".old"
    if not _ours(tmp, (TMP_MARK, REPORT)):
        raise MergeError(f"{tmp} exists and is not a RoleMerge temp folder (no {TMP_MARK} or {REPORT}); refusing "
                         f"to delete it: move it away or choose a new --out")
    if force and os.path.lexists(out) and not _ours(old, (REPORT,)):
        raise MergeError(f"{old} exists and is not a previous RoleMerge output (no {REPORT}); refusing to delete "
                         f"it even with --force: move it away or choose a new --out")
    cal.load_config(src)                     # readable, supported family, complete safetensors shards
    stats = cal.load_stats(stats_paths)
    t0 = time.time()
    if streaming:
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
        info = streaming_info(src, config)
        check_stats(stats, info)
        K = target_k(info["num_experts"], info["top_k"], rho, k)
        check_k_family(config["model_type"], _expert_config(config), K)

        def routers():
            headers, where, layers = scan_checkpoint(src)
            out_r = []
            for lidx in sorted(layers):
                key = [x for x in layers[lidx]["router"] if x.endswith(".weight")][0]
                out_r.append(read_tensor(os.path.join(src, where[key]), headers[where[key]][1], headers[where[key]][0][key]))
            return out_r
        plan = make_plan(stats, K, method, lam, linkage, seed, routers, features)
        _start_tmp(tmp)
        merge_streaming(src, tmp, plan)
    else:
        model = load_model_for_merge(src, dtype)
        info = cal.model_info(model, model_path)
        check_stats(stats, info)
        K = target_k(info["num_experts"], info["top_k"], rho, k)
        check_k_family(model.config.model_type, cal.text_config(model.config).to_dict(), K)
        plan = make_plan(stats, K, method, lam, linkage, seed,
                         lambda: [b.gate.weight.detach().float().cpu() for _, b in cal.moe_blocks(model)], features)
        merge_model(model, plan)
        _start_tmp(tmp)
        model.save_pretrained(tmp)
        copy_side_files(src, tmp)
    report = dict(plan, model=str(model_path), stats=list(stats_paths) if not isinstance(stats_paths, str)
                  else [stats_paths], streaming=streaming, merge_seconds=time.time() - t0)
    with open(os.path.join(tmp, REPORT), "w") as f:      # last file: its presence marks a complete output
        json.dump(report, f, indent=1)
    os.remove(os.path.join(tmp, TMP_MARK))                # the report marks it from here on
    if os.path.exists(out):                               # --force over a previous output
        old = out + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (or tiny-moe)")
    p.add_argument("--stats", nargs="+", required=True, help="stats file(s) from rolemerge.calibrate; all are summed")
    p.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--rho", type=float, help="expert retention ratio in (0, 1]; K = round(rho * N) per layer")
    g.add_argument("--k", type=int, help="experts kept per MoE layer (transformers configs hold one count for all layers)")
    p.add_argument("--method", default="rolemerge", choices=rm.METHODS,
                   help="rolemerge (paper); controls no_phase_split / lambda0 / permuted / kmeans; "
                        "baselines frequency (global-frequency merging) / prune (frequency pruning)")
    p.add_argument("--lam", type=float, default=0.03, help="mean collision weight lambda over layers (paper .03)")
    p.add_argument("--linkage", default="single", choices=rm.LINKAGES, help="group dissimilarity (paper: single)")
    p.add_argument("--seed", type=int, default=0, help="seed of the permuted / kmeans controls")
    p.add_argument("--streaming", action="store_true",
                   help="merge from the safetensors shards without loading the model (bounded memory)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="load dtype of the in-memory path (auto: the checkpoint's own; the streaming path always "
                        "keeps the checkpoint's dtypes)")
    a = p.parse_args(argv)
    from common.cli import fail
    try:
        rep = run_merge(a.model, a.stats, a.out, a.rho, a.k, a.method, a.lam, a.linkage, a.seed, a.streaming,
                        a.force, None if a.dtype == "auto" else getattr(torch, a.dtype))
    except (MergeError, cal.CalibrationError) as e:
        fail(e)  # `error: ...`, exit status 2
    print(f"merged {rep['N']} -> {rep['K']} experts per layer ({rep['method']}) in {rep['merge_seconds']:.1f}s: "
          f"{a.out}; ACR {100 * rep['acr_mean']:.1f}%, expert-phase MI retention {rep['mi_retention']}")


if __name__ == "__main__":
    main()
