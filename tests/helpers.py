"""Small helpers shared by the hardening tests (imported as `helpers`: pytest puts tests/ on sys.path)."""
import hashlib
import os

import pytest


def snapshot(root):
    """{relative path: sha1} of every file under root ({} if it does not exist)."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha1(fh.read()).hexdigest()
    return out


def error_of(main, argv, capsys):
    """Run a CLI main in-process, expect exit status 2, return its stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err
