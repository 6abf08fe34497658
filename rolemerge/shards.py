"""The safetensors side of the streaming merge: reading headers and tensors without loading a
model, byte copies, the MoE layout found in the tensor names, and the output folder written
atomically (`<out>.tmp`, renamed into place when complete).

No transformers: `streaming_config` reads config.json as JSON, so the streaming merge never pays
transformers' import.
"""
import json
import math
import os
import re
import shutil
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from common.checkpoint import CheckpointError, check_safetensors, checked_weights, safetensors_files
from common.files import follow_umask, name_path
from rolemerge import blocks as blk
from rolemerge.blocks import CalibrationError, MergeError

REPORT = "rolemerge_report.json"
TMP_MARK = ".rolemerge-tmp"  # written first into `<out>.tmp`: a leftover temp folder is ours to delete
WEIGHT_FILES = re.compile(r".*\.safetensors$|.*\.safetensors\.index\.json$|.*\.bin$|.*\.bin\.index\.json$")
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
FLOATS = ("F32", "F16", "BF16", "F64")
RE_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<rest>.+)$")
RE_FUSED = re.compile(r"^(?P<pre>.*\.experts)\.(?P<rest>gate_up_proj|down_proj)$")
RE_ROUTER = re.compile(r"^(?P<blk>.*)\.gate\.(?P<rest>weight|e_score_correction_bias)$")
CHUNK = 64 << 20


# ----------------------------------------------------------------------------- reading

def read_header(path):
    """safetensors header -> ({name: {dtype, shape, data_offsets}}, data_start, metadata).
    Raises MergeError naming the file when it is truncated or corrupt (its size must match
    the header exactly), so no tensor is ever read past the end of a short file."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _HEADERS:                  # a run reads every header 2-3 times: parse it once
        try:
            if len(_HEADERS) > 1024:
                _HEADERS.clear()
            _HEADERS[key] = check_safetensors(path)
        except CheckpointError as e:
            raise MergeError(str(e)) from None
    return _HEADERS[key]


_HEADERS = {}


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
    return headers, where, {blk.layer_index(b + "."): dict(v, block=b) for b, v in layers.items()}


def expert_config(config):
    """The (sub-)dict of a config.json that holds the routed-expert count."""
    for sub in (config.get("text_config") or {}, config.get("language_config") or {}, config):
        if any(f in sub for f in blk.EXPERT_FIELDS):
            return sub
    raise MergeError(f"config.json ({config.get('model_type')}) has none of the expert-count fields {blk.EXPERT_FIELDS}")


def streaming_config(path):
    """The checks of `calibrate.load_config` without transformers: config.json is JSON of a supported
    family and the safetensors shards are complete. Raises CalibrationError like it."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CalibrationError(f"{path}: cannot read its config.json ({e}); not a valid JSON file") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CalibrationError(f"{path}: cannot read its config.json (no model_type)")
    blk.check_supported(SimpleNamespace(model_type=config["model_type"]))
    check_weights(path)
    return config


def check_weights(path):
    """`common.checkpoint.checked_weights` (complete safetensors shards, no pickle) with its
    CheckpointError raised as CalibrationError, the message kept."""
    try:
        checked_weights(path)
    except CheckpointError as e:
        raise CalibrationError(str(e)) from None


def read_config(path):
    """config.json of a checkpoint directory as a dict (`streaming_config` checked it)."""
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def router_weights(path):
    """Every MoE layer's router weight [N, H] from the files, in layer order."""
    headers, where, layers = scan_checkpoint(path)
    out = []
    for lidx in sorted(layers):
        key = [x for x in layers[lidx]["router"] if x.endswith(".weight")][0]
        out.append(read_tensor(os.path.join(path, where[key]), headers[where[key]][1], headers[where[key]][0][key]))
    return out


def streaming_info(path, config):
    """The model description check_stats compares against, from files only."""
    headers, where, layers = scan_checkpoint(path)
    if not layers:
        raise MergeError(f"{path}: no routed-expert tensors found in the safetensors files")
    first = layers[min(layers)]
    rkey = [k for k in first["router"] if k.endswith(".weight")][0]
    entries, start = headers[where[rkey]]
    w = read_tensor(os.path.join(path, where[rkey]), start, entries[rkey])
    tc = expert_config(config)
    return {"model_type": config["model_type"], "num_experts": int(w.shape[0]), "top_k": int(tc["num_experts_per_tok"]),
            "layers": sorted(layers), "fingerprint": blk.router_fingerprint(w)}


def coalesce(ranges, gap):
    """Sorted [(start, end)] byte ranges -> fewer ranges, joining neighbours at most `gap` apart."""
    out = []
    for a, b in sorted(ranges):
        if out and a - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def read_layer(files, headers, where, streams, bufs, slot, gap=1 << 20):
    """Read every expert input of one layer into the reused buffer bufs[slot] with one pread
    per run of nearby tensors (gaps <= 1 MiB are read through); returns, per stream, a dict
    {e: tensor view}. Runs in the prefetch thread, so reading overlaps merging and writing."""
    want = {}                                   # (key, row) -> (shard, start, end, dtype, shape)
    for _, dt, shape, src_of, *_ in streams:
        for key, row in src_of.values():
            entries, start = headers[where[key]]
            a, b = entries[key]["data_offsets"]
            if row is not None:
                n = (b - a) // entries[key]["shape"][0]
                a, b = a + row * n, a + (row + 1) * n
            want[key, row] = (where[key], start + a, start + b, DTYPES[dt], shape)
    runs = {}
    for shard in {v[0] for v in want.values()}:
        runs[shard] = coalesce([(v[1], v[2]) for v in want.values() if v[0] == shard], gap)
    need = sum(b - a + 8 for r in runs.values() for a, b in r)
    if bufs[slot] is None or bufs[slot].numel() < need:
        bufs[slot] = None                       # drop the old buffer before allocating the new one
        bufs[slot] = torch.empty(need, dtype=torch.uint8)
    buf, pos, at = bufs[slot], 0, {}
    mv = memoryview(buf.numpy())
    for shard, rs in sorted(runs.items()):
        fd = files[shard].fileno()
        for a, b in rs:
            pos += (a - pos) % 8                # same alignment as in the file: dtype views stay aligned
            done = 0
            while done < b - a:
                n = os.preadv(fd, [mv[pos + done:pos + b - a]], a + done)
                if n == 0:
                    raise MergeError(f"{files[shard].name}: short read at {a + done}; the file is truncated")
                done += n
            at[shard, a, b] = pos
            pos += b - a
    starts = {shard: [a for a, _ in rs] for shard, rs in runs.items()}
    out = []
    for _, dt, shape, src_of, *_ in streams:
        views = {}
        for e, (key, row) in src_of.items():
            shard, a, b, dtype, shp = want[key, row]
            i = max(j for j, s0 in enumerate(starts[shard]) if s0 <= a)
            r0, r1 = runs[shard][i]
            p = at[shard, r0, r1] + a - r0
            raw = buf[p:p + b - a]
            if p % dtype.itemsize:               # a misaligned tensor in the file: copy it out
                raw = raw.clone()
            views[e] = raw.view(dtype).view(shp) if b > a else torch.empty(shp, dtype=dtype)
        out.append(views)
    return out


def write_one(f, item):
    """Append one piece of output to the open shard f: ("copy", src file, offset, nbytes), a
    byte range copied in the kernel, or a merged tensor."""
    if isinstance(item, tuple):
        copy_bytes(item[1], f, item[2], item[3])
    elif item.numel():
        f.write(memoryview(item.contiguous().reshape(-1).view(torch.uint8).numpy()))


def copy_side_files(src, dst):
    """Copy tokenizer / processor / chat-template files (everything but weights and files
    already written to dst)."""
    for f in sorted(os.listdir(src)):
        s, d = os.path.join(src, f), os.path.join(dst, f)
        if os.path.isfile(s) and not WEIGHT_FILES.match(f) and not os.path.exists(d):
            shutil.copy2(s, d)


# ----------------------------------------------------------------------------- the output folder

def is_ours(path, marks):
    """True if nothing is at `path`, or it is a real directory that is empty or holds one of `marks`."""
    if not os.path.lexists(path):
        return True
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    names = os.listdir(path)
    return not names or any(m in names for m in marks)


def start_tmp(tmp):
    """A fresh `<out>.tmp` (a killed earlier run's partial one is deleted: `run_merge` checked it is ours)
    holding TMP_MARK first, so that a kill from here on leaves a folder a rerun may delete."""
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    open(os.path.join(tmp, TMP_MARK), "w").close()


@contextmanager
def no_tmp_after_io_error(tmp, out):
    """Around the writing part of `run_merge`: an I/O error (a full disk, `[Errno 27] File too
    large`, a read-only folder, no permission; safetensors' own I/O errors too) removes `tmp`
    (ours: `run_merge` checked it) and becomes a MergeError naming the file, so the command
    ends in `error: ...`, exit 2, with nothing at `out` and no temporary left."""
    try:
        yield
    except Exception as e:
        err = name_path(e, tmp)
        if not isinstance(err, OSError):
            raise
        if is_ours(tmp, (TMP_MARK, REPORT)):
            shutil.rmtree(tmp, ignore_errors=True)
        raise MergeError(f"{err.filename}: {err.strerror or err} (errno {err.errno}) while merging into {out}; "
                         f"removed {tmp}, nothing was written to {out}: free space, or choose a --out on a disk "
                         f"you can write to") from None


def check_out(out, src, overwrite):
    """Refuse, before anything is read or written, an `out` that is the input checkpoint (or a
    folder holding it), that exists without `overwrite`, or that is not ours to replace: only a
    previous RoleMerge output (holding REPORT) or an empty folder is replaced, a leftover
    `<out>.tmp` deleted only if it holds TMP_MARK or REPORT, `<out>.old` only if it holds REPORT.
    Raises MergeError saying what to do."""
    real_out, real_src = os.path.realpath(out), os.path.realpath(src)
    if real_out == real_src or os.path.commonpath([real_out, real_src]) == real_out:
        raise MergeError(f"--out {out} is the input checkpoint (or a folder holding it); write the merged model "
                         f"to a new directory")
    if os.path.lexists(out):
        if not overwrite:
            raise MergeError(f"--out {out} already exists; pass --overwrite to replace it, or choose another --out")
        if not os.path.isdir(out) or os.path.islink(out) or (
                os.listdir(out) and not os.path.exists(os.path.join(out, REPORT))):
            raise MergeError(f"{out} exists and is not a RoleMerge output (no {REPORT}); refusing to delete it "
                             f"even with --overwrite: choose a new --out")
    tmp, old = out + ".tmp", out + ".old"
    if not is_ours(tmp, (TMP_MARK, REPORT)):
        raise MergeError(f"{tmp} exists and is not a RoleMerge temp folder (no {TMP_MARK} or {REPORT}); refusing "
                         f"to delete it: move it away or choose a new --out")
    if overwrite and os.path.lexists(out) and not is_ours(old, (REPORT,)):
        raise MergeError(f"{old} exists and is not a previous RoleMerge output (no {REPORT}); refusing to delete "
                         f"it even with --overwrite: move it away or choose a new --out")


def publish(tmp, out, report):
    """Finish the output: write `report` as the last file of `tmp` (its presence marks a complete
    output), drop TMP_MARK, give every file the user's umask (save_pretrained writes weights
    0600) and rename `tmp` to `out` (a previous output at `out` goes through `<out>.old`)."""
    with open(os.path.join(tmp, REPORT), "w") as f:
        json.dump(report, f, indent=1)
    os.remove(os.path.join(tmp, TMP_MARK))                # the report marks it from here on
    follow_umask(tmp)
    if os.path.exists(out):                               # --overwrite over a previous output
        old = out + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


def shard_header(tensors):
    """The bytes that open a safetensors file holding `tensors` [(name, dtype name, shape)] in
    that order (8-byte little-endian length, JSON header padded to 8 bytes) and the size of its
    data in bytes."""
    hdr, off = {}, 0
    for name, dt, shape in tensors:
        size = math.prod(shape) * DTYPES[dt].itemsize
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + size]}
        off += size
    hb = json.dumps({"__metadata__": {"format": "pt"}, **hdr}, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return len(hb).to_bytes(8, "little") + hb, off


def write_index(dst, total, weight_map):
    """model.safetensors.index.json of a sharded output: total data bytes and {tensor: shard}."""
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
