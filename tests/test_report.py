"""README tables equal what `python -m eval.report` renders from `eval/results/`, and the
renderer itself is pinned by hand cases (a table that cannot drift from its result files)."""
import json
import re
from pathlib import Path

import pytest

from eval import report

ROOT = Path(__file__).resolve().parent.parent


def test_readme_tables_equal_the_results():
    stale = [str(p) for p, (old, new) in report.build_readmes().items() if old != new]
    assert not stale, f"README tables differ from eval/results/: {stale}; run python -m eval.report"


def test_every_result_file_says_where_its_numbers_come_from():
    for p in report.RESULTS.rglob("*.json"):
        if p.name == "tables.json":
            continue
        d = json.loads(p.read_text())
        assert d.get("source") and isinstance(d.get("rows"), list) and d["rows"], p


def test_columns_and_pivot_by_hand(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    rows = [{"arm": "MoD", "metric": "single", "value": 0.5, "ci_low": 0.25, "ci_high": 0.75},
            {"arm": "MoD", "metric": "misled", "value": 0.125, "ci_low": None, "ci_high": None},
            {"arm": "LoRA", "metric": "single", "value": 0.5, "ci_low": 0.375, "ci_high": 0.625}]
    (tmp_path / "r.json").write_text(json.dumps({"source": "hand", "rows": rows}))
    cols = {"name": "t", "file": "r.json", "where": {"metric": "single"},
            "columns": [["arm", "{arm}"], ["acc", "{value:.3f} [{ci_low:.2f}, {ci_high:.2f}]"]]}
    assert report.render_table(cols) == "| arm | acc |\n|---|---|\n| MoD | 0.500 [0.25, 0.75] |\n| LoRA | 0.500 [0.38, 0.62] |\n"
    piv = {"name": "p", "file": "r.json", "pivot": {"row": "arm", "col": "metric", "cell": "{value:.2f} [{ci_low:.2f}]",
                                                      "corner": "arm", "cols": {"single": "one round"}}}
    assert report.render_table(piv) == ("| arm | one round | misled |\n|---|---|---|\n"
                                        "| MoD | 0.50 [0.25] | - |\n| LoRA | 0.50 [0.38] | - |\n")
    with pytest.raises(report.ReportError, match="no record"):
        report.render_table({**cols, "where": {"metric": "none"}})


def test_a_verdict_that_says_more_than_its_ci_and_seeds_is_refused(tmp_path, monkeypatch):
    """A record whose verdict word disagrees with eval.metrics.verdict on its own CI and per-seed
    effects stops the render; records without per-seed effects or numeric CIs are not checked."""
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    rows = [{"claim": "a", "verdict": "supported", "ci_low": 0.01, "ci_high": 0.1, "per_seed": [0.05, 0.02]},
            {"claim": "b", "verdict": "supported", "ci_low": 0.01, "ci_high": 0.1, "per_seed": [0.09, -0.01]},
            {"claim": "c", "verdict": "supported", "ci_low": -0.2, "ci_high": -0.01, "per_seed": [-0.1], "sign": -1},
            {"claim": "d", "verdict": "supported at every rho", "effect": "+0.1 [+0.01, +0.2]"}]
    (tmp_path / "r.json").write_text(json.dumps({"source": "hand", "rows": rows}))
    spec = lambda claims: {"name": "v", "file": "r.json", "where": {"claim": claims}, "columns": [["v", "{verdict}"]]}
    assert report.render_table(spec(["a", "c", "d"])).count("supported") == 3
    with pytest.raises(report.ReportError, match=r"v: a record says 'supported'.*give 'inconclusive'"):
        report.render_table(spec(["b"]))                 # one seed goes the other way


def test_marker_rewrite_and_missing_marker(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path / "res")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "r.json").write_text(json.dumps({"source": "hand", "rows": [{"a": 1}]}))
    spec = {"readme": "R.md", "tables": [{"name": "x/t", "file": "r.json", "columns": [["a", "{a}"]]}]}
    (tmp_path / "res" / "tables.json").write_text(json.dumps(spec))
    (tmp_path / "R.md").write_text("intro\n<!-- table x/t -->\nold\n<!-- /table -->\nend\n")
    (old, new), = report.build_readmes().values()
    assert new == "intro\n<!-- table x/t -->\n| a |\n|---|\n| 1 |\n<!-- /table -->\nend\n" and old != new
    (tmp_path / "R.md").write_text("no markers\n")
    with pytest.raises(report.ReportError, match="no marker"):
        report.build_readmes()


READMES = ("README.md", "mod/README.md", "rolemerge/README.md", "mole/README.md", "common/README.md",
           "eval/README.md", "eval/tools/README.md")


def reading_minutes(text):
    """N of the "Reading time: about N minutes" note in a README's first five lines, or None."""
    m = re.search(r"^Reading time: about (\d+) minutes?\b", "\n".join(text.splitlines()[:5]), re.M)
    return int(m.group(1)) if m else None


def test_reading_minutes_reads_the_note_in_the_first_lines_only():
    assert reading_minutes("# T\n\nReading time: about 7 minutes.\n") == 7
    assert reading_minutes("# T\n\nReading time: about 1 minute.\n") == 1
    assert reading_minutes("# T\n" + "x\n" * 5 + "Reading time: about 7 minutes.\n") is None
    assert reading_minutes("# T\n\nabout 7 minutes\n") is None


@pytest.mark.parametrize("readme", READMES)
def test_readme_states_its_reading_time(readme):
    """Each README opens with "Reading time: about N minutes", N = words / 200 (`wc -w`), within
    one minute (so a small edit does not need a new note)."""
    text = (report.ROOT / readme).read_text()
    n, words = reading_minutes(text), len(text.split())
    assert n is not None, f"{readme}: no 'Reading time: about N minutes' in its first lines"
    assert abs(n - words / 200) <= 1, f"{readme}: says {n} minutes, {words} words read in {words / 200:.1f}"


def test_top_readme_layout_names_every_module():
    """The top README's layout tree has a line for every module of common/, the methods and eval/
    (eval/toys and eval/tools by name on their lines)."""
    text = (ROOT / "README.md").read_text()
    tree = text.split("## Layout", 1)[1].split("```")[1]
    missing = [str(p.relative_to(ROOT)) for folder in ("common", "mod", "rolemerge", "mole", "eval", "eval/toys",
                                                          "eval/tools")
               for p in sorted((ROOT / folder).glob("*.py"))
               if p.name != "__init__.py" and not re.search(rf"(^|[\s,(]){re.escape(p.name)}\b", tree, re.M)]
    assert not missing, f"README.md's layout tree misses {missing}"
