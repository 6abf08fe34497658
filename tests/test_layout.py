"""The repository's layout rules, checked on the source (AST), not by convention:

- arrows point down: `common/` imports nothing above it; no file in `common/`, `mod/`, `rolemerge/`,
  `mole/` imports `eval/`; a method never imports another method;
- inference and diagnostics do not import training modules;
- `common/` has no import cycle (imports inside functions count too);
- the text speaks of the methods and the experiments, not of how it was produced: no times of day,
  work-period or issue numbers, machine availability or load, or internal paper numbering outside
  `eval/logs/`.
"""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("mod", "rolemerge", "mole")
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


def test_common_has_no_import_cycle():
    mods = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in py_files("common")}
    graph = {m: {d for d, _, _ in imports(p) for d in (d, d.rsplit(".", 1)[0]) if d in mods and d != m}
             for m, p in mods.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles in common/: " + "; ".join(cycles)


def test_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    """The cycle check can fail: two modules importing each other are reported."""
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "a.py").write_text("from common.b import x\n")
    (tmp_path / "common" / "b.py").write_text("def f():\n    from common import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="common.a -> common.b -> common.a|common.b -> common.a -> common.b"):
        test_common_has_no_import_cycle()


# Words about how the text was produced, not about the methods: times of day, work periods,
# issue numbers, machine availability / load, the internal numbering of the papers.
NARRATION = [
    (r"\b\d{1,2}:\d{2}(:\d{2})?\s*UTC\b", "a time of day"),
    (r"\b(session|stop)[ -]?\d+\b", "a work-period number"),
    (r"\bissue[ -]?(item[ -]?)?#?\d+", "an issue number"),
    (r"\bissue item\b", "an issue item"),
    (r"\bpaper[ _-]?00\d\b", "the internal paper numbering"),
    (r"\bload (average )?(of )?~?\d", "the machine's load"),
    (r"\b(was|were|is) (not )?lent\b|\bno GPU was\b|\bengineers' jobs\b|\bbusy with other jobs\b", "machine availability"),    (r"(?<![\w./])(/work/|/root/|/home/[\w-]+/)", "a path of one machine (defaults belong under out/)"),
]
TEXT = (".py", ".md", ".sh", ".txt")


def tracked_text_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    out += subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                          text=True).stdout.split()
    return [ROOT / f for f in out if f.endswith(TEXT) and not f.startswith("eval/logs/") and (ROOT / f).is_file()
            and f != "tests/test_layout.py"]


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
    for s in ("pre-registered 10:35 UTC", "session 4 results", "stop 21", "issue 13", "MoD issue item 7",
              "paper 002", "load average 2.8", "no GPU was lent to this task", "six engineers' jobs",
              "default /work/venv-lmms", "see /root/x", "(/home/ana/data)"):
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
