"""The command-line programs the READMEs tell a user to run exist in the pinned environment
(the console scripts installed next to this Python): huggingface-hub 2.x installs `hf`, not
`huggingface-cli`."""
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# console scripts of the pinned packages that a README may name (python / pip are the interpreter's)
PROGRAMS = ("hf", "huggingface-cli", "torchrun", "transformers", "transformers-cli", "accelerate")


def test_every_program_a_readme_names_is_installed():
    bin_dir = os.path.dirname(sys.executable)
    named = {}
    for path in glob.glob(os.path.join(ROOT, "**", "*.md"), recursive=True):
        if f"{os.sep}logs{os.sep}" in path:   # dated logs record what was run then
            continue
        text = open(path, encoding="utf-8").read()
        for prog in PROGRAMS:
            if re.search(rf"(^|[`\s]){re.escape(prog)} [a-z-]", text, re.M):
                named.setdefault(prog, []).append(os.path.relpath(path, ROOT))
    missing = {p: where for p, where in named.items() if not os.path.exists(os.path.join(bin_dir, p))}
    assert not missing, f"READMEs name programs the pinned environment does not have: {missing}"
    assert "hf" in named   # the data download command is there
