"""mole/model.py + mole/adapters.py + common/routing.py are a copy unit: model.py imports the
standard library, torch, common.routing and mole.adapters only (adapters below it: never the
reverse), adapters.py the standard library, torch and transformers; copied alone into another
project, they import without the rest of the repository."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"mole/model.py": {"torch", "common.routing", "mole.adapters"},
           "mole/adapters.py": {"torch", "transformers"}}


def _imports(path):
    """[(module, line)] of every import and the lines of imports not at module level."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    names, nested = [], []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if id(node) not in top:
                nested.append(node.lineno)
            names += [(a.name, node.lineno) for a in node.names] if isinstance(node, ast.Import) \
                else [(node.module or "", node.lineno)]
    return names, nested


def test_model_and_adapters_import_only_their_allowed_modules():
    for f, allowed in ALLOWED.items():
        names, nested = _imports(ROOT / f)
        assert not nested, f"{f}: imports inside functions / blocks at lines {nested}"
        bad = [(m, line) for m, line in names if m.split(".")[0] not in sys.stdlib_module_names
               and not any(m == a or m.startswith(a + ".") for a in allowed)]
        assert not bad, f"{f}: imports outside {sorted(allowed)} and the standard library: {bad}"


def test_copied_files_alone_import(tmp_path):
    for d, files in (("common", ["routing.py"]), ("mole", ["model.py", "adapters.py"])):
        (tmp_path / d).mkdir()
        (tmp_path / d / "__init__.py").write_text("")
        for f in files:
            shutil.copy(ROOT / d / f, tmp_path / d / f)
    child = ("import sys\nimport mole.model as m\n"
             "assert m.MoLE and m.text_model and m.model_positions\n"
             "assert not [k for k in sys.modules if k.startswith(('eval', 'mod', 'rolemerge', 'common.backbone', "
             "'common.data'))], sorted(sys.modules)\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
