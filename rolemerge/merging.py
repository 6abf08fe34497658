"""Merging one MoE layer's experts and router rows into their groups (paper §4.4): in memory on a
loaded model (`merge_model`), or streamed from the safetensors files (`merge_streaming`). Both
accumulate every merged tensor with `weighted_sum`, so their outputs agree bit for bit.
"""
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from rolemerge import blocks as blk
from rolemerge import comparators
from rolemerge import model as rm
from rolemerge import shards as sh
from rolemerge.blocks import MergeError

def weighted_sum(tensors, weights, dtype, acc=None, out=None):
    """sum_i w_i t_i accumulated in float32 in the given order, cast to dtype. The one place
    both paths merge tensors, so their outputs agree bit for bit. acc (float32) and out
    (dtype): optional scratch tensors of the tensors' shape, reused by the streaming path
    (a fresh large allocation page-faults on every call); the result is out when given."""
    acc = torch.empty(tensors[0].shape, dtype=torch.float32) if acc is None else acc
    acc.copy_(tensors[0]).mul_(weights[0])
    for t, w in zip(tensors[1:], weights[1:]):
        acc.add_(t, alpha=w)                     # promotes t to float32 inside the kernel
    return acc.to(dtype) if out is None else out.copy_(acc)


def merge_stacked(x, groups, weights):
    """x [N, ...] (expert axis first) -> [G, ...] merged with the group weights."""
    return torch.stack([weighted_sum([x[e] for e in g], w, x.dtype) for g, w in zip(groups, weights)])


def slot_groups(groups, weights, N, router):
    """(groups, weights) of the output expert slots: the K groups themselves ("average"), or
    with the "bound" operator one slot per original expert e holding its group's merge (N slots,
    members of a group hold identical tensors). Raises MergeError if bound and a group misses an expert."""
    if router != "bound":
        return groups, weights
    of = {e: i for i, g in enumerate(groups) for e in g}
    if sorted(of) != list(range(N)):
        raise MergeError("the bound router operator needs groups that cover every expert")
    return [groups[of[e]] for e in range(N)], [weights[of[e]] for e in range(N)]


def own_merge(plan, li, W, K):
    """The hook for a method that produces its own tensors (rolemerge/comparators.py): layer li's
    canonical float32 tensors W (gate [N, I, H], up [N, I, H], down [N, H, I], router [N, H],
    optional bias [N]) -> `comparators.merge_layer(method, W, feats, K)` with that layer's
    features; the returned groups (and frequency weights from them) are stored in the plan.
    Returns the merged dict (gate / up / down [K, ...], router [K, H] or None, bias or None).
    Raises MergeError when the comparator returns the wrong number of groups or shapes."""
    feats = (plan.get("_features") or [None] * (li + 1))[li]
    out = comparators.merge_layer(plan["method"], W, feats, K)
    groups = sorted(sorted(int(e) for e in g) for g in out["groups"])
    if len(groups) != K or any(out[k].shape[0] != K for k in ("gate", "up", "down")):
        raise MergeError(f"comparator {plan['method']!r} returned {len(groups)} groups / "
                         f"{out['gate'].shape[0]} experts at layer {li}, expected K={K}")
    order = sorted(range(K), key=lambda i: sorted(out["groups"][i]))   # tensors follow the sorted groups
    res = {k: out[k][order] for k in ("gate", "up", "down")}
    for k in ("router", "bias"):
        res[k] = out.get(k)[order] if out.get(k) is not None else None
    if plan["groups"] is None:
        plan["groups"] = [None] * len(plan["info"])
        plan["weights"] = [None] * len(plan["info"])
    plan["groups"][li] = groups
    plan["weights"][li] = rm.merge_weights(plan["_mass"][li], groups)
    return res


@torch.no_grad()
def merge_block(block, groups, weights, routing=None, router="average", own=None):
    """One MoE block in place: its expert tensors, router rows (and router score-correction
    bias) become their group merges (groups [K] lists of expert indices, weights [K] lists of
    their merge weights; singleton groups with weight 1 prune), and the expert counts of the
    block's modules become K. routing: the plan's group-limited routing fields, if any.
    router "bound": the N expert slots stay, slot e holding the merge of e's group, and the
    router (N rows) is untouched (the M-SMoE / HC-SMoE codes' operator). own: a method's own
    merged tensors (`own_merge`: gate / up / down [K, ...] float32, router / bias or None ->
    the weighted average of the member rows), cast to the block's dtype."""
    N, dev = block.gate.weight.shape[0], block.gate.weight.device
    gu, down = block.experts.gate_up_proj, block.experts.down_proj
    if own is None:
        gu_m = merge_stacked(gu.detach().cpu(), groups, weights)
        down_m = merge_stacked(down.detach().cpu(), groups, weights)
    else:
        gu_m = torch.cat([own["gate"], own["up"]], 1).to(gu.dtype)
        down_m = own["down"].to(down.dtype)
    if router == "bound":
        sg, _ = slot_groups(groups, weights, N, router)
        lut = torch.tensor([groups.index(g) for g in sg])
        block.experts.gate_up_proj = torch.nn.Parameter(gu_m[lut].to(dev), requires_grad=False)
        block.experts.down_proj = torch.nn.Parameter(down_m[lut].to(dev), requires_grad=False)
        return
    K = len(groups)
    block.experts.gate_up_proj = torch.nn.Parameter(gu_m.to(dev), requires_grad=False)
    block.experts.down_proj = torch.nn.Parameter(down_m.to(dev), requires_grad=False)
    r = own.get("router") if own else None
    r = r.to(block.gate.weight.dtype) if r is not None else merge_stacked(block.gate.weight.detach().cpu(), groups,
                                                                         weights)
    block.gate.weight = torch.nn.Parameter(r.to(dev), requires_grad=False)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor):
        ob = own.get("bias") if own else None
        block.gate.e_score_correction_bias = (ob.to(bias.dtype) if ob is not None else
                                              merge_stacked(bias.cpu(), groups, weights)).to(dev)
    for mod in (block, block.gate, block.experts):
        for attr in blk.EXPERT_FIELDS:
            if isinstance(getattr(mod, attr, None), int):
                setattr(mod, attr, K)
    for attr, v in {"num_group": (routing or {}).get("n_group"),
                    "topk_group": (routing or {}).get("topk_group")}.items():
        if v is not None:
            setattr(block.gate, attr, v)


def canonical_block(block):
    """A loaded MoE block's tensors in the canonical float32 layout of `own_merge`."""
    gu = block.experts.gate_up_proj.detach().float().cpu()
    I = gu.shape[1] // 2
    W = {"gate": gu[:, :I], "up": gu[:, I:], "down": block.experts.down_proj.detach().float().cpu(),
         "router": block.gate.weight.detach().float().cpu()}
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor):
        W["bias"] = bias.detach().float().cpu()
    return W


@torch.no_grad()
def merge_model(model, plan):
    """In-memory merge: `merge_block` on every MoE block with the plan's groups and weights (a
    comparator's own tensors through `own_merge`) and router operator; update the expert counts
    in the config (unchanged with the bound operator: N slots). model is changed in place and
    returned. Raises CalibrationError (`blk.check_mergeable`) before any change when a block,
    router, expert-count field or the plan is not one the merge understands."""
    blk.check_mergeable(model, plan)
    K, op = plan.get("K") or len(plan["groups"][0]), plan.get("router", "average")
    for li, (name, block) in enumerate(blk.moe_blocks(model)):
        own = own_merge(plan, li, canonical_block(block), K) if plan.get("own") else None
        merge_block(block, plan["groups"][li], plan["weights"][li], plan.get("routing"), op, own)
    if op == "bound":
        return model
    tc = blk.text_config(model.config)
    setattr(tc, blk.expert_count_field(model.config), K)
    for f, v in plan.get("routing", {}).items():
        setattr(tc, f, v)
    return model


# ----------------------------------------------------------------------------- streaming

PARTS = {"gate_proj.weight": "gate", "up_proj.weight": "up", "down_proj.weight": "down",   # per-expert keys
         "w1.weight": "gate", "w3.weight": "up", "w2.weight": "down"}                        # Mixtral


def _fused_canonical(gu_shape, down_shape, H):
    """True if fused per-expert shapes are transformers 5's [2I, H] / [H, I] (the layout
    save_pretrained writes), False for the transposed [H, 2I] / [I, H] of some hub files."""
    if down_shape[0] != down_shape[1]:
        return down_shape[0] == H
    return gu_shape[1] == H


def _canonical_streams(streams, x, H):
    """Layer tensors read by read_layer (expert streams only) -> canonical float32 W parts
    gate / up [N, I, H], down [N, H, I]. Raises MergeError for an expert tensor that is none
    of the known projections (the own-tensor hook needs to know every part)."""
    W = {}
    fused = {st[5]: (st, v) for st, v in zip(streams, x) if st[4] == "fused"}
    for st, v in zip(streams, x):
        if st[4] != "expert":
            continue
        if st[5] not in PARTS:
            raise MergeError(f"expert tensor {st[5]!r} is not a known projection {sorted(PARTS)}; methods with their "
                             f"own merge operator need gate / up / down projections")
        W[PARTS[st[5]]] = torch.stack([v[e].float() for e in range(len(v))])
    if fused:
        (gst, gv), (dst_, dv) = fused["gate_up_proj"], fused["down_proj"]
        canon = _fused_canonical(gst[2], dst_[2], H)
        gu = torch.stack([gv[e].float() if canon else gv[e].float().T for e in range(len(gv))])
        I = gu.shape[1] // 2
        W.update(gate=gu[:, :I], up=gu[:, I:],
                 down=torch.stack([dv[e].float() if canon else dv[e].float().T for e in range(len(dv))]))
    return W


def _own_tensor(st, merged, g):
    """Output tensor for slot group index g of one stream from a method's own merged tensors,
    in the stream's own layout (per-expert, fused canonical or transposed, router rows)."""
    kind, rest = st[4], st[5]
    if kind == "expert":
        return merged[PARTS[rest]][g]
    if kind == "fused":
        canon = st[6]
        t = torch.cat([merged["gate"][g], merged["up"][g]], 0) if rest == "gate_up_proj" else merged["down"][g]
        return t if canon else t.T
    return merged["router" if rest == "weight" else "bias"][g]


def check_streamable(src, plan):
    """The streaming path's `blk.check_mergeable`: raise before anything is written unless
    config.json is a supported family with its expert-count field, every MoE layer found in the
    tensor names has one router weight [N, H] and all N experts (per-expert keys 0..N-1 or fused
    [N, ...] tensors), N equals the config's count and the plan has one layer per MoE layer
    (groups checked like check_mergeable). Raises CalibrationError / MergeError."""
    config = sh.streaming_config(src)
    sub = sh.expert_config(config)
    N = sub[next(f for f in blk.EXPERT_FIELDS if f in sub)]
    headers, where, layers = sh.scan_checkpoint(src)
    rows = lambda k: headers[where[k]][0][k]["shape"][:1]                   # noqa: E731
    fam = f"{blk.SUPPORTED[config['model_type']]} [{config['model_type']}]"
    if plan.get("own") and plan.get("groups") is None:   # a comparator groups each layer while it merges
        return
    if len(layers) != len(plan["groups"]):
        raise MergeError(f"{fam}: the plan has {len(plan['groups'])} layers, the checkpoint {len(layers)} MoE layers")
    for lidx, lay in sorted(layers.items()):
        routers = [k for k in lay["router"] if k.endswith(".weight")]
        idx = {e for e, _ in lay["experts"].values() if e is not None}
        fused = [k for k, (e, _) in lay["experts"].items() if e is None] + list(lay["router"])
        if len(routers) != 1 or (idx and idx != set(range(N))) or any(rows(k) != [N] for k in fused):
            raise MergeError(f"{fam}: layer {lidx} has routers {routers} and experts {sorted(idx)}; the merge needs "
                             f"one `gate.weight` and experts 0..{N - 1} (config: {N})")
    for g in plan["groups"]:
        flat = [e for grp in g for e in grp]
        same_k = plan.get("router") == "bound" or len(g) == len(plan["groups"][0])   # bound: per-layer K may differ
        if not same_k or not all(g) or len(set(flat)) != len(flat) or not all(
                0 <= e < N for e in flat):
            raise MergeError(f"{fam}: the plan's groups must be non-empty, disjoint, in [0, {N}) and as many per layer")


def merge_streaming(src, dst, plan):
    """Merge from the checkpoint files alone into dst (created if missing; holds nothing else yet).

    Output shard i holds the untouched tensors of input shard i (in-kernel byte copies of
    coalesced ranges, first) and then the merged experts / routers of every MoE layer whose
    router lives in shard i. One layer's expert bytes are read with a few large preads into a
    reused buffer while the previous layer merges (two buffers, one prefetch thread, one
    hand-off per layer); merging reuses one float32 accumulator (no fresh allocation per
    tensor). The "bound" router operator writes N expert slots (slot e = the merge of e's
    group) and copies the router untouched. A method with its own tensors (plan "own") gets each
    layer's tensors in the canonical layout through `own_merge`; they are written back in the
    file's layout and dtype. Raises MergeError for quantised or non-float expert tensors, and
    (`check_streamable`) before anything is written for a layout or plan it does not understand."""
    check_streamable(src, plan)                                    # 1. scan (refused before anything is written)
    headers, where, layers = sh.scan_checkpoint(src)
    K, op = plan.get("K") or len(plan["groups"][0]), plan.get("router", "average")
    N = next(headers[where[k]][0][k]["shape"][0] for k in layers[min(layers)]["router"] if k.endswith(".weight"))
    jobs, merged = _plan_streams(headers, where, layers, N if op == "bound" else K, K, op)   # 2. plan the outputs
    os.makedirs(dst, exist_ok=True)
    files = {s: open(os.path.join(src, s), "rb") for s in headers}
    weight_map, total = {}, 0
    try:
        with ThreadPoolExecutor(1) as pool:                         # 3. merge each layer, write the shards
            work = _Work(src, headers, where, files, pool, plan, K, N)
            for s in sorted(headers):
                total += _write_shard(work, dst, s, jobs[s], merged, weight_map)
    finally:
        for fh in files.values():
            fh.close()
    _write_config(src, dst, plan, K, op)                           # 4. config, index, side files
    if os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        sh.write_index(dst, total, weight_map)
    sh.copy_side_files(src, dst)


class _Work:
    """What every layer of one streaming merge shares: the input shards (headers, open files), the
    prefetch thread, the plan, K and N, and the reused buffers (two input buffers, one float32
    accumulator, one output scratch)."""

    def __init__(self, src, headers, where, files, pool, plan, K, N):
        self.src, self.headers, self.where, self.files, self.pool = src, headers, where, files, pool
        self.plan, self.K, self.N = plan, K, N
        self.op, self.own = plan.get("router", "average"), plan.get("own", False)
        self.bufs, self.acc = [None, None], [torch.empty(0), None]

    def read(self, streams, slot):
        """Start reading one layer's expert bytes into bufs[slot] in the prefetch thread."""
        return self.pool.submit(sh.read_layer, self.files, self.headers, self.where, streams, self.bufs, slot)

    def tensor(self, key):
        """One whole tensor of the input, as float32."""
        entries, start = self.headers[self.where[key]]
        return sh.read_tensor(os.path.join(self.src, self.where[key]), start, entries[key]).float()


def _plan_streams(headers, where, layers, S, K, op):
    """Every output of the merge, per home shard (the shard of the layer's router): a list of
    (layer position, streams, router keys). A stream is one merged tensor family (per-expert
    `experts.{g}.{rest}`, or a fused [N, ...] tensor / router merged row-wise) = (outputs
    [(name, shape)], dtype, input shape of one expert, {e: (key, row or None)}, kind, rest[,
    canonical]); S output expert slots. Returns (jobs, the set of input keys merged). Raises
    MergeError for quantised or non-float expert tensors."""
    jobs = {s: [] for s in headers}
    merged_keys = set()
    for li, lidx in enumerate(sorted(layers)):
        lay = layers[lidx]
        home = where[lay["router"][0]] if lay["router"] else where[next(iter(lay["experts"]))]
        per_rest, streams = {}, []
        for k, (e, rest) in lay["experts"].items():
            per_rest.setdefault(rest, {})[e] = k
        rkeys = {sh.RE_ROUTER.match(k).group("rest"): k for k in lay["router"]}
        H = headers[where[rkeys["weight"]]][0][rkeys["weight"]]["shape"][1]
        fused = [(rest, by_e[None]) for rest, by_e in sorted(per_rest.items()) if None in by_e]
        fshape = {rest: headers[where[k]][0][k]["shape"][1:] for rest, k in fused}
        canon = _fused_canonical(fshape["gate_up_proj"], fshape["down_proj"], H) if len(fshape) == 2 else True
        for rest, by_e in sorted(per_rest.items()):
            if None not in by_e:
                ent = headers[where[by_e[0]]][0][by_e[0]]
                if ent["dtype"] not in sh.FLOATS:
                    raise MergeError(f"{by_e[0]}: dtype {ent['dtype']} (quantised experts are not supported)")
                streams.append(([(f"{lay['block']}.experts.{g}.{rest}", ent["shape"]) for g in range(S)],
                                ent["dtype"], ent["shape"], {e: (k, None) for e, k in by_e.items()}, "expert", rest))
        for kind, rest, k in ([("fused", r, k) for r, k in fused] +
                              ([("router", sh.RE_ROUTER.match(k).group("rest"), k) for k in lay["router"]]
                               if op != "bound" else [])):
            ent = headers[where[k]][0][k]
            if ent["dtype"] not in sh.FLOATS:
                raise MergeError(f"{k}: dtype {ent['dtype']} (quantised experts are not supported)")
            n_out = S if kind == "fused" else K
            streams.append(([(k, [n_out] + ent["shape"][1:])], ent["dtype"], ent["shape"][1:],
                            {e: (k, e) for e in range(ent["shape"][0])}, kind, rest, canon))
        merged_keys.update(k for st in streams for k, _ in st[3].values())
        routers = {("router" if r == "weight" else "bias"): k for r, k in rkeys.items()}
        jobs[home].append((li, streams, routers))
    return jobs, merged_keys


def _write_shard(work, dst, s, jobs, merged_keys, weight_map):
    """Output shard `s`: its header (sizes are known), the untouched tensors of input shard `s`
    (in-kernel byte copies of coalesced ranges), then the merged tensors of every layer in
    `jobs`, the next layer's read overlapping this layer's merge. Adds the shard's tensor names
    to weight_map; returns the shard's data bytes (0 when it has nothing to hold)."""
    entries, start = work.headers[s]
    copies = sorted((k for k in entries if k not in merged_keys), key=lambda k: entries[k]["data_offsets"])
    if not copies and not jobs:
        return 0
    tensors = ([(k, entries[k]["dtype"], entries[k]["shape"]) for k in copies] +
               [(n, st[1], shape) for _, streams, _ in jobs for st in streams for n, shape in st[0]])
    hb, size = sh.shard_header(tensors)
    weight_map.update((n, s) for n, _, _ in tensors)
    with open(os.path.join(dst, s), "wb") as f:
        f.write(hb)
        nxt = work.read(jobs[0][1], 0) if jobs else None
        for a, b in sh.coalesce([(start + entries[k]["data_offsets"][0], start + entries[k]["data_offsets"][1])
                                 for k in copies], gap=0):
            sh.write_one(f, ("copy", os.path.join(work.src, s), a, b - a))
        for i, (li, streams, routers) in enumerate(jobs):
            inputs = nxt.result()
            own = None
            if work.own:        # before the prefetch of the next layer reuses the other buffer
                rt = {n: work.tensor(k) for n, k in routers.items()}
                W = dict(_canonical_streams(streams, inputs, rt["router"].shape[1]), **rt)
                own = own_merge(work.plan, li, W, work.K)
            if i + 1 < len(jobs):
                nxt = work.read(jobs[i + 1][1], (i + 1) % 2)
            _merge_layer(work, f, li, streams, inputs, own)
    return size


def _merge_layer(work, f, li, streams, inputs, own):
    """Write one layer's merged streams to the open shard f: each output slot's weighted sum of
    its group's inputs (bound: N slots, slot e = the merge of e's group), or a method's own
    tensors (`own`, from `own_merge`) in the stream's layout and dtype."""
    groups, weights = work.plan["groups"][li], work.plan["weights"][li]
    sgroups, sweights = slot_groups(groups, weights, work.N, work.op)
    gidx = [groups.index(g) for g in sgroups]
    acc = work.acc
    for st, x in zip(streams, inputs):
        dt, shape, kind = st[1], st[2], st[4]
        slots = list(zip(sgroups, sweights)) if kind != "router" else list(zip(groups, weights))
        if own is not None and kind != "router":
            for g in gidx:
                sh.write_one(f, _own_tensor(st, own, g).to(sh.DTYPES[dt]))
            continue
        if own is not None and own["router" if st[5] == "weight" else "bias"] is not None:
            for g in range(work.K):
                sh.write_one(f, _own_tensor(st, own, g).to(sh.DTYPES[dt]))
            continue
        n = math.prod(shape)
        if acc[0].numel() < n:
            acc[0], acc[1] = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float64)
        a32, o = acc[0][:n].view(shape), acc[1].view(torch.uint8)[:n * sh.DTYPES[dt].itemsize]
        o = o.view(sh.DTYPES[dt]).view(shape)
        for grp, w in slots:
            sh.write_one(f, weighted_sum([x[e] for e in grp], w, sh.DTYPES[dt], acc=a32, out=o))


def _write_config(src, dst, plan, K, op):
    """config.json of the merged model: the expert count K and the rewritten routing fields
    (unchanged with the bound operator: N slots)."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    sub = sh.expert_config(config)
    if op != "bound":
        sub[next(f for f in blk.EXPERT_FIELDS if f in sub)] = K
        sub.update(plan.get("routing", {}))
    for f, v in sub.items():           # DeepSeek-VL2 configs may repeat language fields at the top level
        if sub is not config and f in blk.EXPERT_FIELDS + ("n_group", "topk_group") and f in config:
            config[f] = v
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
