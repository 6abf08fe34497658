"""RoleMerge's statistics files: phase-separated routing counts written by rolemerge.calibrate.

A stats file is a safetensors file (counts/<source> [L, B, N] and tokens/<source> [B], int64)
whose metadata (key "rolemerge") holds the model id, family, MoE layer names, top-k, expert
count, router fingerprint and examples per source; a readable .json summary sits next to it.
"""
import json
import os

from safetensors import safe_open

from common.checkpoint import CheckpointError, atomic_save_file, check_safetensors
from common.files import atomic_write_text
from rolemerge.blocks import CalibrationError

META_KEY = "rolemerge"


def check_nonempty(stats):
    """Raise CalibrationError if a phase bucket received no token over all sources."""
    tot = sum(s["tokens"] for s in stats["sources"].values())
    for b, n in zip(stats["buckets"], tot.tolist()):
        if n == 0:
            why, fix = {
                "image": ("the records have no images", ": add records with images (an `image` field) to a --data "
                          "file; one source with images beside text-only sources is enough"),
                "answer": ("no generated token was fed back: raise --max-new-tokens (>= 2) or check that the model "
                           "does not stop at once", ""),
            }.get(b, ("the prompts are empty", ": add records with a non-empty `question`"))
            raise CalibrationError(f"phase bucket {b!r} is empty over all calibration sources ({why}){fix}; "
                                   f"RoleMerge needs routing counts of every phase")


def save_stats(stats, path):
    """Write stats to `path` (safetensors: counts/<src>, tokens/<src>; metadata JSON) and a
    readable `path` with .json suffix next to it."""
    meta = {k: v for k, v in stats.items() if k not in ("sources", "features")}
    meta["examples"] = {n: s["examples"] for n, s in stats["sources"].items()}
    tensors = {}
    for n, s in stats["sources"].items():
        tensors[f"counts/{n}"] = s["counts"].contiguous()
        tensors[f"tokens/{n}"] = s["tokens"].contiguous()
    atomic_save_file(tensors, path, metadata={META_KEY: json.dumps(meta)})   # temp file + rename
    summary = dict(meta, tokens={n: dict(zip(stats["buckets"], s["tokens"].tolist()))
                                 for n, s in stats["sources"].items()})
    atomic_write_text(summary_path(path), json.dumps(summary, indent=1))


def summary_path(path):
    """The readable .json summary written next to a stats file."""
    return os.path.splitext(path)[0] + ".json"


def load_stats(paths):
    """Read and combine one or more stats files of the same model. Sources with the same name
    in several files are summed. Raises CalibrationError for a missing, truncated or foreign
    file, counts whose shape disagrees with the file's own metadata, files of different
    models, and a phase bucket that is empty over all sources."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    if not paths:
        raise CalibrationError("no stats file given (run python -m rolemerge.calibrate first)")
    stats = None
    for p in paths:
        if not os.path.exists(p):
            raise CalibrationError(f"{p}: stats file not found (run python -m rolemerge.calibrate first)")
        try:
            check_safetensors(p)
            with safe_open(p, "pt") as f:
                md = f.metadata() or {}
                if META_KEY not in md:
                    raise CalibrationError(f"{p}: not a RoleMerge stats file (no '{META_KEY}' metadata)")
                meta = json.loads(md[META_KEY])
                sources = {n: {"counts": f.get_tensor(f"counts/{n}"), "tokens": f.get_tensor(f"tokens/{n}"),
                               "examples": e} for n, e in meta.pop("examples").items()}
            shape = [len(meta["layer_names"]), len(meta["buckets"]), meta["num_experts"]]
        except (CheckpointError, ValueError, KeyError, TypeError) as e:
            if isinstance(e, CalibrationError):
                raise
            raise CalibrationError(f"{p}: unreadable stats file ({e.__class__.__name__}: {e}); "
                                   f"recalibrate with python -m rolemerge.calibrate") from None
        for n, s in sources.items():
            if list(s["counts"].shape) != shape or list(s["tokens"].shape) != shape[1:2] or (s["counts"] < 0).any():
                raise CalibrationError(f"{p}: counts of source {n!r} have shape {list(s['counts'].shape)}, but the "
                                       f"file's metadata says [layers, buckets, experts] = {shape} (non-negative); "
                                       f"the file was edited or is corrupt: recalibrate")
        if stats is None:
            stats = dict(meta, sources=sources)
            continue
        for key in ("model_type", "layer_names", "num_experts", "top_k", "fingerprint", "buckets"):
            if stats[key] != meta[key]:
                raise CalibrationError(f"{p}: {key} differs from {paths[0]} ({meta[key]} vs {stats[key]}): "
                                       f"stats of different models cannot be combined")
        for n, s in sources.items():
            if n in stats["sources"]:
                t = stats["sources"][n]
                stats["sources"][n] = {"counts": t["counts"] + s["counts"], "tokens": t["tokens"] + s["tokens"],
                                       "examples": t["examples"] + s["examples"]}
            else:
                stats["sources"][n] = s
    check_nonempty(stats)
    return stats


def total_counts(stats):
    """counts [L, B, N] summed over all sources."""
    return sum(s["counts"] for s in stats["sources"].values())
