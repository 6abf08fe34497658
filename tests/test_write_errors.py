"""Every OSError from writing (a full disk: ENOSPC, `[Errno 27] File too large`; a read-only
folder; no permission) ends in `error: ...` naming the path, exit 2, with no temporary left
behind. Simulated: `builtins.open` under the output folder gives files whose `write` fails, or
fails to open them; safetensors' own writer raises its I/O error."""
import builtins
import errno
import os

import pytest
from safetensors import SafetensorError

from common import data, shapes
from common.cli import run_cli
from helpers import error_of
from rolemerge import calibrate as cal
from rolemerge import merge as mg
from rolemerge import stats as rstats

ON_WRITE = (errno.ENOSPC, errno.EFBIG)   # the disk fills up while writing
ON_OPEN = (errno.EROFS, errno.EACCES)    # the folder cannot be written at all


class _FullFile:
    """A file whose writes fail with `err` (no file name, as a real full disk raises it)."""

    def __init__(self, f, err):
        self._f, self._err = f, err

    def write(self, *a):
        raise OSError(self._err, os.strerror(self._err))

    def __getattr__(self, k):
        return getattr(self._f, k)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self._f.close()


def fail_writes(monkeypatch, under, err):
    """Files opened for writing below `under` fail with `err`: at open (ON_OPEN) or write."""
    real = builtins.open
    under = os.path.abspath(str(under))

    def fake(path, mode="r", *a, **kw):
        if isinstance(path, (str, os.PathLike)) and os.path.abspath(str(path)).startswith(under) and \
                any(c in mode for c in "wax+"):
            if err in ON_OPEN:
                raise OSError(err, os.strerror(err), str(path))
            return _FullFile(real(path, mode, *a, **kw), err)
        return real(path, mode, *a, **kw)
    monkeypatch.setattr(builtins, "open", fake)


def _safetensors_fails(monkeypatch, module, name="save_file"):
    def fake(*a, **kw):
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
    monkeypatch.setattr(module, name, fake)


@pytest.fixture(scope="module")
def stats(tmp_path_factory):
    root = tmp_path_factory.mktemp("w")
    model, proc = cal.load_model("tiny-moe")
    shapes.generate_split(str(root), "val", 2)
    recs = data.read_llava_json(str(root / "val.json"))
    st = cal.calibrate(model, proc, {"val": recs}, batch_size=2, max_new_tokens=3, model_id="tiny-moe",
                       progress=False)
    rstats.save_stats(st, str(root / "stats.safetensors"))
    return str(root / "stats.safetensors")


def last_error(text):
    """The `error: ...` part of stderr (progress bars come before it)."""
    assert "error: " in text, text
    return text[text.rindex("error: "):]


def _left(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


@pytest.mark.parametrize("err", ON_WRITE + ON_OPEN)
def test_streaming_merge_on_a_full_disk(stats, err, tmp_path, monkeypatch, capsys):
    """Was: `OSError: [Errno 27] File too large` as a traceback, exit 1, and OUT.tmp left."""
    out = tmp_path / "disk" / "merged"
    out.parent.mkdir()
    fail_writes(monkeypatch, out.parent, err)
    msg = last_error(error_of(mg.main, ["--model", "tiny-moe", "--stats", stats, "--rho", "0.5", "--out", str(out),
                             "--threads", "1"], capsys))
    assert msg.startswith("error: ") and str(out) in msg and os.strerror(err) in msg, msg
    assert _left(out.parent) == []                        # no OUT, no OUT.tmp


def test_in_memory_merge_on_a_full_disk(stats, tmp_path, monkeypatch, capsys):
    """save_pretrained's safetensors writer raises its own error type, not an OSError."""
    import transformers.modeling_utils as mu
    _safetensors_fails(monkeypatch, mu, "safe_save_file")
    out = tmp_path / "merged"
    msg = last_error(error_of(mg.main, ["--model", "tiny-moe", "--stats", stats, "--rho", "0.5", "--out", str(out),
                             "--in-memory", "--threads", "1"], capsys))
    assert "File too large (errno 27)" in msg and f"{out}.tmp" in msg and "write elsewhere" not in msg
    assert _left(tmp_path) == []


@pytest.mark.parametrize("err", ON_WRITE + ON_OPEN)
def test_evaluate_results_on_a_full_disk(err, tmp_path, monkeypatch, capsys):
    from eval import evaluate
    shapes.generate_split(str(tmp_path), "test", 2)
    res = tmp_path / "res"
    res.mkdir()
    fail_writes(monkeypatch, res, err)
    msg = last_error(error_of(lambda argv: run_cli(evaluate.main, argv), ["--model", "tiny-dense", "--data", str(tmp_path / "test.json"), "--out",
                                   str(res / "r.json"), "--limit", "2", "--max-new-tokens", "2", "--threads", "1"],
                   capsys))
    assert msg.startswith("error: ") and str(res / "r.json") in msg and os.strerror(err) in msg, msg
    assert [f for f in _left(res) if ".tmp" in f] == []


def test_training_checkpoint_on_a_full_disk(tmp_path, monkeypatch, capsys):
    """mod.train's checkpoint (safetensors inside save_train_state): error names the checkpoint,
    and its half-written ckpt.tmp is removed."""
    import common.checkpoint as ck
    from mod import train as mtrain
    shapes.generate_split(str(tmp_path), "train", 4)
    _safetensors_fails(monkeypatch, ck)
    out = tmp_path / "run"
    msg = last_error(error_of(mtrain.main, ["--model", "tiny-dense", "--data", str(tmp_path / "train.json"), "--out", str(out),
                                 "--steps", "1", "--batch-size", "2", "--threads", "1"], capsys))
    assert "File too large" in msg and str(out / "ckpt") in msg and "write elsewhere" in msg, msg
    assert "ckpt.tmp" not in _left(out)


def test_mod_adapters_on_a_full_disk(tmp_path, monkeypatch, capsys):
    """The adapter files written after training (mod.model's safetensors writer): `error:` naming
    the run folder, no temporary adapter file left."""
    import mod.model as mm
    from mod import train as mtrain
    shapes.generate_split(str(tmp_path), "train", 4)
    _safetensors_fails(monkeypatch, mm)
    out = tmp_path / "run"
    msg = last_error(error_of(mtrain.main, ["--model", "tiny-dense", "--data", str(tmp_path / "train.json"), "--out",
                                            str(out), "--steps", "1", "--batch-size", "2", "--threads", "1"], capsys))
    assert "File too large" in msg and str(out) in msg, msg
    assert not [f for f in _left(out) if ".tmp" in f]
