"""mod/ and mole/ stay easy to change, checked on the source (AST): settings travel as config
objects (no function takes more than 10 parameters), and a file's dependencies are its first
lines (an import inside a function only where the file says why, once, in a `# deferred:`
comment naming the module)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted(p for folder in ("mod", "mole") for p in (ROOT / folder).glob("*.py"))
MAX_PARAMS = 10


def long_signatures(path):
    """[(function, number of parameters)] of the functions in `path` taking more than MAX_PARAMS."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            if n > MAX_PARAMS:
                out.append((getattr(node, "name", "lambda"), n))
    return out


def undeclared_inner_imports(path):
    """['line: module'] of imports inside functions that the file's one `# deferred:` comment (with
    its continuation lines) does not name; every inner import when the file has none or several."""
    text = path.read_text()
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("# deferred:")]
    said = ""
    if len(starts) == 1:
        i = starts[0]
        while i < len(lines) and lines[i].lstrip().startswith("#"):
            said += lines[i] + " "
            i += 1
    tree = ast.parse(text, str(path))
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or "."] if isinstance(node, ast.ImportFrom) else [])
            out += [f"{node.lineno}: {m}" for m in names if m not in said]
    return sorted(set(out))


def test_no_function_takes_more_than_10_parameters():
    bad = [f"{p.relative_to(ROOT)}: {name} ({n})" for p in FILES for name, n in long_signatures(p)]
    assert not bad, "functions with more than 10 parameters (pass a config object instead):\n" + "\n".join(bad)


def test_imports_are_at_the_top_or_deferred_with_a_reason():
    bad = [f"{p.relative_to(ROOT)}:{x}" for p in FILES for x in undeclared_inner_imports(p)]
    assert not bad, "imports inside functions without a `# deferred:` reason naming them:\n" + "\n".join(bad)


def test_the_checks_can_fail(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f(a, b, c, d, e, f, g, h, i, j, k=1):\n    import json\n    from os import path\n")
    assert long_signatures(f) == [("f", 11)]
    assert undeclared_inner_imports(f) == ["2: json", "3: os"]
    f.write_text("# deferred: json is slow to import here\ndef f():\n    import json\n    import os\n")
    assert undeclared_inner_imports(f) == ["4: os"]
    f.write_text("# deferred: json\n# deferred: json again\ndef f():\n    import json\n")
    assert undeclared_inner_imports(f) == ["4: json"]
