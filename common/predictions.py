"""Predictions kept as a run goes, and `--resume` of a stopped run (every inference entry point).

With `--out R`, each finished batch's predictions are appended to `R.partial` (JSONL: a header
line with the run's fingerprint, then one line per batch, each flushed and fsync'd before the
next batch starts), so a run stopped at any point (Ctrl-C, SIGTERM, a crash, SIGKILL, a full
disk) keeps every finished batch. The same command with `--resume` takes the finished batches
from the file and computes only the rest; the batches are the same, so the final predictions
are identical to an uninterrupted run's. The final `R` is written atomically and `R.partial`
removed after it.

    with PredictionLog(out, fingerprint(model=..., data=records, batch_size=...), resume) as log:
        preds = log.run("generate", n_batches, lambda i: predict(batches[i]))
        atomic_write_text(out, ...)
        log.finish()

Inside the block, Ctrl-C / SIGTERM finish the batch under way, keep it and stop with
`Interrupted` (exit 130 / 143, "continue with --resume"); a second Ctrl-C stops at once (the
batches finished before it are kept). A resume with other settings, another model or other
data is refused, naming what differs. Without `--out` nothing is written (and `--resume` is
refused).
"""
import base64
import hashlib
import json
import os
import signal
import time
from contextlib import nullcontext

import numpy as np
import torch
from tqdm import tqdm

from common.cli import Interrupted, RunError, sigterm_flag
from common.data import atomic_write_text, name_path
from common.tiny import TINY

FORMAT = "predictions-partial/1"
_CHUNK = 1 << 20  # bytes hashed at each end of a weight file


def file_digest(path):
    """sha1 (12 hex digits) of a file's size, its first and its last MiB: retrained weights
    differ there (the tensors at the end), and a 16 GB shard costs 2 MiB of reading."""
    h = hashlib.sha1()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_CHUNK))
        if size > 2 * _CHUNK:
            f.seek(size - _CHUNK)
        h.update(f.read(_CHUNK))
    return h.hexdigest()[:12]


def model_digest(path):
    """Identity of a checkpoint for a resume check: for a directory, the digest of every
    top-level *.json and *.safetensors file (`file_digest`), so another or retrained
    checkpoint at the same path is told apart while a copied one is not; a committed tiny
    name is resolved first; anything else (a hub id) is its text."""
    if not path:
        return None
    d = TINY.get(path, path)
    if not os.path.isdir(d):
        return str(path)
    files = sorted(f for f in os.listdir(d) if f.endswith((".json", ".safetensors")) and
                   os.path.isfile(os.path.join(d, f)))
    return {f: file_digest(os.path.join(d, f)) for f in files}


def records_digest(records):
    """'N records, sha1 X' over what a prediction depends on: id, question, history, gold
    answer, family, options, and the name and size of each image file (a moved data folder
    still resumes, another image of the same name does not)."""
    h = hashlib.sha1()
    for r in records:
        imgs = [[os.path.basename(p), os.path.getsize(p) if os.path.exists(p) else None] for p in r.get("images") or []]
        h.update(json.dumps([r.get("id"), r.get("question"), r.get("history"), r.get("answer"), r.get("family"),
                             r.get("options"), imgs], default=str).encode())
    return f"{len(records)} records, sha1 {h.hexdigest()[:12]}"


def fingerprint(records, **settings):
    """The fingerprint a `PredictionLog` stores and checks on --resume: the settings given
    (JSON-able values: flags, `model_digest`s) plus "data": `records_digest(records)`."""
    return {**settings, "data": records_digest(records)}


class PredictionLog:
    """The predictions of the finished batches of one run, kept in `{out}.partial` (see the
    module docstring); with out=None they are kept in memory only.

    out: the final output path (or None); fp: `fingerprint(...)`; resume: --resume.
    Raises RunError (before anything is computed) for --resume without --out, --resume with
    no `.partial` to continue, a `.partial` of an earlier run without --resume (it is never
    overwritten silently), a `.partial` written with other settings / model / data, and an
    unreadable one (a torn last line, from a kill mid-write, is dropped: that batch is redone)."""

    def __init__(self, out, fp, resume=False):
        self.out, self.fp = out, fp
        self.path = f"{out}.partial" if out else None
        self.done = {}  # phase -> [{"phase", "batch", "seconds", "results"[, "state"]}, ...] in batch order
        self._file, self._flag = None, {"stop": False}
        if self.path is None:
            if resume:
                raise RunError("--resume needs --out: predictions are kept in OUT.partial only when --out is given")
            return
        if os.path.isdir(self.path):
            raise RunError(f"{self.path} is a directory; it is where --out {out} keeps finished batches: move it")
        exists = os.path.exists(self.path)
        if resume and not exists:
            what = f"{out} is a finished run" if os.path.exists(out) else "no run was started with this --out"
            raise RunError(f"--resume: there is no interrupted run to continue ({self.path} does not exist; {what}); "
                           f"run without --resume")
        if exists and not resume:
            n = self._read(check=False)
            raise RunError(f"{self.path} holds an interrupted run ({n} finished batch(es)); pass --resume to continue "
                           f"it (the same flags), or delete that file to start over")
        if exists:
            self._read(check=True)
        # a fresh run creates the file with its first finished batch: a run that fails before
        # (a wrong --model, a bad flag) leaves nothing that a rerun would have to --resume

    # ------------------------------------------------------------------ the file
    def _write(self, obj):
        try:
            self._file.write(json.dumps(obj, ensure_ascii=False) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:  # a full disk: the file keeps its finished batches (a torn last line is redone)
            raise name_path(e, self.path)

    def _open(self):
        """The file, opened for appending; created (its header written atomically) if new."""
        if self._file is None:
            if not os.path.exists(self.path):
                atomic_write_text(self.path, json.dumps({"format": FORMAT, "fingerprint": self.fp},
                                                        ensure_ascii=False) + "\n")
            self._file = open(self.path, "a", encoding="utf-8")

    def _read(self, check):
        """Load the finished batches; check: compare the fingerprint, drop a torn last line.
        Returns the number of batches."""
        with open(self.path, "rb") as f:
            raw = f.read()
        lines = raw.split(b"\n")
        torn = lines.pop()  # b"" when the file ends with a newline, else a line cut short
        keep = len(raw) - len(torn)
        rows = []
        for k, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except ValueError:
                if k == len(lines) - 1 and not torn:
                    keep -= len(line) + 1  # the last complete-looking line is unreadable: redo that batch
                    break
                raise RunError(f"{self.path}: line {k + 1} is unreadable; delete the file to start over") from None
        if not rows or not isinstance(rows[0], dict) or rows[0].get("format") != FORMAT:
            raise RunError(f"{self.path} is not a predictions file of this repo (no header); delete it or choose "
                           f"another --out")
        batches = rows[1:]
        if check:
            diff = _strict_diff(rows[0]["fingerprint"], self.fp)
            gone = sorted(set(rows[0]["fingerprint"]) ^ set(self.fp))
            if diff or gone:
                what = "; ".join(diff + [f"{k}: only in one of them" for k in gone])
                raise RunError(f"--resume: {self.path} was written with other settings ({what}); rerun with the "
                               f"saved flags, model and data to continue it, or delete it to start over")
            if keep < len(raw):
                with open(self.path, "r+b") as f:
                    f.truncate(keep)
            for b in batches:
                got = self.done.setdefault(b["phase"], [])
                if b["batch"] != len(got):
                    raise RunError(f"{self.path}: batch {b['batch']} of {b['phase']!r} follows batch {len(got) - 1}; "
                                   f"the file is damaged: delete it to start over")
                got.append(b)
        return len(batches)

    # ------------------------------------------------------------------ running
    def __enter__(self):
        self._ctx = sigterm_flag("finishing this batch and keeping its predictions") if self.path else nullcontext(
            {"stop": False})
        self._flag = self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        if self._file is not None:
            self._file.close()
            self._file = None
        return False

    def stored(self, phase):
        """The finished batches of `phase`: [{"batch", "seconds", "results"[, "state"]}, ...]."""
        return self.done.setdefault(phase, [])

    def seconds(self, phase):
        """Compute seconds of the finished batches of `phase` and of its sub-phases ("phase/...")."""
        return sum(b["seconds"] for p, got in self.done.items() if p == phase or p.startswith(phase + "/")
                   for b in got)

    def scope(self, prefix):
        """This log with every phase name prefixed by "prefix/" (one method's passes of a run)."""
        return _Scope(self, prefix)

    def run(self, phase, n, fn, desc=None, state=None):
        """[*fn(0), *fn(1), ..., *fn(n - 1)]: fn(i) -> the JSON-able results of batch i (a list).
        Batches finished by an earlier, stopped run are taken from the file; each new one is
        appended (fsync'd) as it finishes (a progress bar titled `desc`, none for desc=False), with
        state() when given (e.g. the random generators'
        state after it, `rng_state`). After a batch, a pending Ctrl-C / SIGTERM stops the run
        with `Interrupted`; a second Ctrl-C stops at once, also as `Interrupted`."""
        got = self.stored(phase)
        if len(got) > n:
            raise RunError(f"{self.path}: {len(got)} batches of {phase!r} stored, the run has {n}; delete it to "
                           f"start over")
        bar = tqdm(total=n, initial=len(got), desc=desc or phase, unit="batch", leave=False, disable=desc is False)
        try:
            for i in range(len(got), n):
                t = time.perf_counter()
                res = list(fn(i))
                row = {"phase": phase, "batch": i, "seconds": time.perf_counter() - t, "results": res}
                if state is not None:
                    row["state"] = state()
                if self.path is not None:
                    self._open()
                    self._write(row)
                got.append(row)
                bar.update(1)
                if self._flag["stop"]:
                    raise Interrupted(f"interrupted after batch {i + 1} of {n} of {phase} ({self._flag['stop']}); the "
                                      f"finished batches are in {self.path}; continue with the same command and "
                                      f"--resume", self._flag["signum"])
        except KeyboardInterrupt:
            if self.path is None:
                raise
            raise Interrupted(f"stopped at once in batch {len(got) + 1} of {n} of {phase} (a second Ctrl-C); the "
                              f"finished batches are in {self.path}; continue with the same command and --resume",
                              signal.SIGINT) from None
        finally:
            bar.close()
        return [x for b in got for x in b["results"]]

    def finish(self):
        """The run is complete and its final output written: remove `{out}.partial`."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.path and os.path.exists(self.path):
            os.remove(self.path)


def _strict_diff(saved, now):
    """['key: saved X, now Y'] for the keys both define whose values differ; for a dict value
    (a `model_digest`) only its differing entries are named (a file added or removed counts)."""
    out = []
    for k in sorted(saved.keys() & now.keys()):
        a, b = saved[k], now[k]
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            files = sorted(f for f in a.keys() | b.keys() if a.get(f) != b.get(f))
            out.append(f"{k}: {', '.join(files)} differ")
        else:
            out.append(f"{k}: saved {a!r}, now {b!r}")
    return out


class _Scope:
    """`PredictionLog.scope`: run / stored / seconds with phase names under a prefix."""

    def __init__(self, log, prefix):
        self.log, self.prefix = log, prefix

    def run(self, phase, *args, **kw):
        return self.log.run(f"{self.prefix}/{phase}", *args, **kw)

    def stored(self, phase):
        return self.log.stored(f"{self.prefix}/{phase}")

    def seconds(self, phase=""):
        return self.log.seconds(f"{self.prefix}/{phase}" if phase else self.prefix)


def rng_state():
    """torch's CPU (and, once initialised, every CUDA device's) random state as JSON-able text,
    stored with each batch of a sampled pass so that `--resume` continues the same stream."""
    out = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state):
    """Restore a state saved by `rng_state`."""
    as_tensor = lambda t: torch.from_numpy(np.frombuffer(base64.b64decode(t), dtype=np.uint8).copy())
    torch.set_rng_state(as_tensor(state["cpu"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([as_tensor(t) for t in state["cuda"]])
