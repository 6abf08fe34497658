"""The repository's layout rules, checked on the source (AST), not by convention:

- arrows point down: `common/` imports nothing above it; no file in `common/`, `mod/`, `rolemerge/`,
  `mole/` imports `eval/`; a method never imports another method;
- inference and diagnostics do not import training modules;
- no package has an import cycle (imports inside functions count too);
- imports sit at the top of a file: one inside a function only for a module the file's single
  `# deferred: MODULE[, MODULE...] (reason)` line names (an optional package, a measured
  start-up cost);
- the text speaks of the methods and the experiments, not of how it was produced: no times of day,
  work-period or issue numbers, machine availability or load, or internal paper numbering outside
  `eval/logs/`.
"""
import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("mod", "rolemerge", "mole")
PACKAGES = ("common", "eval", *METHODS)
INFERENCE = ("mod/infer.py", "mole/infer.py", "mole/diagnostics.py", "rolemerge/infer.py")
TRAINING = ("mod.train", "mole.train")


def imports(path):
    """[(module imported, line, at module level)] of a Python file, absolute names."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, node.lineno, id(node) in top))
            out += [(f"{node.module}.{a.name}", node.lineno, id(node) in top) for a in node.names]
    return out


def py_files(*folders):
    return [p for f in folders for p in sorted((ROOT / f).rglob("*.py"))]


def top(name):
    return name.split(".")[0]


def test_arrows_point_down():
    bad = []
    for p in py_files("common", *METHODS):
        here = p.relative_to(ROOT).parts[0]
        for mod, line, _ in imports(p):
            t = top(mod)
            if t == "eval" or (here == "common" and t in METHODS) or (here in METHODS and t in METHODS and t != here):
                bad.append(f"{p.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "imports against the layout (common <- methods <- eval):\n" + "\n".join(bad)


def test_inference_does_not_import_training():
    bad = [f"{f}:{line} imports {mod}" for f in INFERENCE for mod, line, _ in imports(ROOT / f)
           if any(mod == t or mod.startswith(t + ".") for t in TRAINING)]
    assert not bad, "\n".join(bad)


def module_name(path, root):
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def import_cycles(root, folders):
    """The import cycles among the modules under `folders` of `root`, as 'a -> b -> a' strings;
    every import counts (inside functions too)."""
    files = {module_name(p, root): p for f in folders for p in sorted((root / f).rglob("*.py"))}
    graph = {m: {d for d, _, _ in imports(p) for d in (d, d.rsplit(".", 1)[0]) if d in files and d != m}
             for m, p in files.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(files):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_package_has_an_import_cycle():
    cycles = import_cycles(ROOT, PACKAGES)
    assert not cycles, "import cycles (a helper both sides need goes below both): " + "; ".join(cycles)


def test_cycle_finder_finds_a_cycle(tmp_path):
    """The cycle check can fail: two modules importing each other are reported, also when one
    of the imports sits inside a function, in any package."""
    (tmp_path / "mole").mkdir()
    (tmp_path / "mole" / "a.py").write_text("from mole.b import x\n")
    (tmp_path / "mole" / "b.py").write_text("def f():\n    from mole import a\n")
    (tmp_path / "mole" / "c.py").write_text("from mole import a\n")
    assert import_cycles(tmp_path, ["mole"]) == ["mole.a -> mole.b -> mole.a"]


DEFERRED = re.compile(r"^# deferred: ([\w.]+(?:, [\w.]+)*) \(\S")


def deferred_problems(root, folders):
    """['file:line: ...'] for each import inside a function whose module the file's `# deferred:`
    line does not name (a named package covers its submodules), and for a file with more than one
    such line or one that does not read `# deferred: a, b.c (reason)`."""
    bad = []
    for p in (p for f in folders for p in sorted((root / f).rglob("*.py"))):
        rel = str(p.relative_to(root))
        text = p.read_text()
        lines = [line for line in text.splitlines() if line.startswith("# deferred:")]
        m = DEFERRED.match(lines[0]) if lines else None
        if len(lines) > 1 or (lines and not m):
            bad.append(f"{rel}: one '# deferred: module, module (reason)' line per file, got {lines}")
        named = m.group(1).split(", ") if m else []
        tree = ast.parse(text, rel)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else  # from a import b: a.b
                        [f"{node.module or '.'}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom)
                        else [])
                for mod in mods:
                    if not any(mod == n or mod.startswith(n + ".") for n in named):
                        bad.append(f"{rel}:{node.lineno}: import of {mod} inside {fn.name}()")
    return sorted(set(bad))


def test_imports_are_at_the_top():
    bad = deferred_problems(ROOT, PACKAGES)
    assert not bad, ("imports inside functions: move them to the top of the file, or name an optional package "
                     "on the file's '# deferred: ... (reason)' line:\n" + "\n".join(bad))


def test_deferred_import_check_can_fail(tmp_path):
    (tmp_path / "eval").mkdir()
    ok = "import os\n# deferred: peft, lm_eval (optional, not in requirements.txt)\n\ndef f():\n    import peft\n" \
         "    from lm_eval.models import HFLM\n"
    (tmp_path / "eval" / "ok.py").write_text(ok)
    (tmp_path / "eval" / "late.py").write_text("def f():\n    import torch\n")
    (tmp_path / "eval" / "other.py").write_text(ok.replace("import peft", "import peftx"))
    (tmp_path / "eval" / "twice.py").write_text("# deferred: peft (a)\n# deferred: torch (b)\n")
    (tmp_path / "eval" / "noreason.py").write_text("# deferred: peft\n")
    bad = deferred_problems(tmp_path, ["eval"])
    assert [b.split(":")[0] for b in bad] == ["eval/late.py", "eval/noreason.py", "eval/other.py", "eval/twice.py"]
    assert "eval/late.py:2: import of torch inside f()" in bad and "eval/other.py:5: import of peftx inside f()" in bad


# Words about how the text was produced, not about the methods: times of day, work periods,
# issue numbers, machine availability / load, the internal numbering of the papers. This file is
# checked like every other: the patterns use character classes ([ ], [k], [t]) and the failing
# cases below are joined from parts, so that its own text holds none of the words it looks for.
NARRATION = [
    (r"\b\d{1,2}:\d{2}(:\d{2})?\s*UTC\b", "a time of day"),
    (r"\b(session|stop)[ -]?\d+\b", "a work-period number"),
    (r"\bissue[ -]?(item[ -]?)?#?\d+", "an issue number"),
    (r"\bissue[ ]item\b", "an item of an issue"),
    (r"\bpaper[ _-]?00\d\b", "the internal paper numbering"),
    (r"\bload (average )?(of )?~?\d", "the machine's load"),
    (r"\b(was|were|is) (not )?lent\b|\bno GPU was\b|\bengineers' jobs\b|\bbusy with other jobs\b", "machine availability"),
    (r"(?<![\w./])(/wor[k]/|/roo[t]/|/home/[\w-]+/)", "a path of one machine (defaults belong under out/)"),
]
TEXT = (".py", ".md", ".sh", ".txt")


def tracked_text_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    out += subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                          text=True).stdout.split()
    return [ROOT / f for f in out if f.endswith(TEXT) and not f.startswith("eval/logs/") and (ROOT / f).is_file()]


def narration(text):
    """[(line number, what, matched text)] of the narration patterns in a text."""
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        for rx, what in NARRATION:
            m = re.search(rx, line, re.I)
            if m:
                hits.append((i, what, m.group(0)))
    return hits


def test_narration_patterns_can_fail():
    words = [("pre-registered 10:35", "UTC"), ("session", "4 results"), ("stop", "21"), ("issue", "13"),
             ("MoD issue", "item 7"), ("paper", "002"), ("load average", "2.8"), ("no GPU", "was", "lent to this task"),
             ("six engineers'", "jobs")]
    paths = [("default ", "work", "venv-lmms"), ("see ", "root", "x"), ("(", "home", "ana", "data)")]
    for s in [" ".join(w) for w in words] + ["/".join(p) for p in paths]:
        assert narration(s), s
    for s in ("--stop-at HH:MM (UTC)", "top-4 routing over 32 experts", "paper's Table 1", "a 7B model", "out/venv-lmms", "cp ~/Pictures/a.jpg mine/"):
        assert not narration(s), s


def test_no_words_about_how_the_text_was_produced():
    bad = [f"{p.relative_to(ROOT)}:{i}: {what} ({m!r})" for p in tracked_text_files()
           for i, what, m in narration(p.read_text(errors="replace"))]
    assert not bad, "words about how the text was produced (they belong in eval/logs/ at most):\n" + "\n".join(bad[:40])


def test_tests_are_named_by_unit():
    names = [p.name for p in (ROOT / "tests").glob("test_*.py")]
    bad = [n for n in names if re.search(r"hardening|review|newcomer|issue|session|fix", n)]
    assert not bad, bad
