"""File helpers with no dependency beyond the standard library: permissions and atomic writes.

`follow_umask` gives written weights the mode a plain `open()` would; `atomic_target` /
`atomic_write_text` write a file so that a reader sees the old one or the complete new one;
`name_path` makes a failed write's error name its file.
"""
import os
import re
from contextlib import contextmanager, suppress


def follow_umask(path):
    """Give `path` (a file, or every file and folder under a directory) the mode a plain
    `open()` / `os.makedirs` would: 0o666 / 0o777 minus the user's umask. safetensors' writer
    (and so `save_pretrained`) creates its files 0600, which collaborators on a shared
    cluster cannot read; every writer of weights in this repo calls this before its rename."""
    mask = os.umask(0)
    os.umask(mask)
    if not os.path.isdir(path):
        os.chmod(path, 0o666 & ~mask)
        return
    for root, dirs, files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)


@contextmanager
def atomic_target(path):
    """Yields a temp path next to `path` to write to (its folder created if missing); renames it
    onto `path` when the block succeeds and removes it when the block or the rename fails (a
    full disk, `path` being a directory), so `path` is either untouched or complete. An
    I/O error is raised as an OSError naming `path` (`name_path`)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        yield tmp
        follow_umask(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with suppress(OSError):
            os.remove(tmp)
        err = name_path(e, path)
        if err is e:
            raise
        raise err from None


def name_path(e, path):
    """A failed write as an OSError that names its file, so `error: ...` says which one: an
    OSError that names none (a `write` on a full disk raises ENOSPC / EFBIG without one) gets
    `path`; safetensors' own I/O error (`SafetensorError: ... I/O error: File too large (os
    error 27)`) becomes OSError(27, 'File too large', path). Any other exception is returned as
    it is."""
    if isinstance(e, OSError):
        if e.filename is None:
            e.filename = str(path)
        return e
    m = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(e))
    return OSError(int(m.group(2)), m.group(1), str(path)) if m else e


def atomic_write_text(path, text):
    """Write `text` to `path` atomically (`atomic_target`)."""
    with atomic_target(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
