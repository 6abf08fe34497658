"""Rebuild every README table and figure from the committed result files in `eval/results/`.

    python -m eval.report            # rewrite the marked README tables and the figures
    python -m eval.report --check    # exit 1 and name every table that differs (what the test runs)

Result files. `eval/results/<method>/<experiment>.json` holds `{"experiment", "source", "rows"}`;
`rows` is a flat list of records, one per (arm, seed, metric) or per claim, with the fields its
tables use (typically `arm, seed, metric, value, ci_low, ci_high, n`). `source` says which command
produced the numbers.

Table specs. `eval/results/<method>/tables.json` (and `eval/results/tables.json` for the top
README) lists `{"readme": path, "tables": [...], "figures": [...]}`. A table is

    {"name": "mod/verdicts", "file": "mod/main.json", "where": {"kind": "verdict"},
     "columns": [["claim", "{claim}"], ["effect [95% CI]", "{value:+.3f} [{ci_low:+.3f}, {ci_high:+.3f}]"]]}

one row per selected record, or with `"pivot": {"row": field, "col": field, "cell": template,
"corner": header, "cols": {value: header}}` a row per distinct `row` value and a column per
distinct `col` value (first-appearance order). `file` (or a list of files, rows concatenated)
is relative to `eval/results/`; `where`
keeps records whose field equals the value (or is in the list). A cell whose template names a
missing or null field prints `-`. In the README the table sits between `<!-- table NAME -->` and
`<!-- /table -->`, which this script rewrites and nothing else.

A figure is `{"path": "mod/x.png", "kind": "bar", "file", "where", "label": template,
"title", "ylabel"}` (bars of `value` with `ci_low`/`ci_high`) or `"kind": "line"` with
`"series": template, "x": field` (points of `value`); paths are relative to `eval/results/`.
Figures without a spec (routing heatmaps, grouping maps) are the toys' own PNGs, committed as drawn.

Verdicts. A selected record that carries a verdict word ("supported" / "contradicted" /
"inconclusive"), a numeric `ci_low` / `ci_high` and a `per_seed` list must agree with the one rule of
every toy (`eval.metrics.verdict`, direction `sign`, default +1): a table never says more than its CI
and its seeds.
"""
import json
import re
import string
import sys
from pathlib import Path

from common.cli import entry_parser
from common.data import atomic_write_text
from eval.metrics import verdict as verdict_rule
from eval.plots import bar_ci_png, line_png

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "eval" / "results"
MARK = re.compile(r"(<!-- table (?P<name>[\w./-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


class ReportError(Exception):
    pass


def _rows(spec, cache):
    rows = []
    for f in spec["file"] if isinstance(spec["file"], list) else [spec["file"]]:
        path = RESULTS / f
        if path not in cache:
            try:
                cache[path] = json.loads(path.read_text())["rows"]
            except (OSError, ValueError, KeyError) as e:
                raise ReportError(f"{spec.get('name', spec.get('path'))}: cannot read rows of {path}: {e}")
        rows += cache[path]
    keep = []
    for r in rows:
        ok = True
        for k, v in spec.get("where", {}).items():
            ok &= (r.get(k) in v) if isinstance(v, list) else (r.get(k) == v)
        if ok:
            keep.append(r)
    if not keep:
        raise ReportError(f"{spec.get('name', spec.get('path'))}: no record of {spec['file']} matches {spec.get('where')}")
    for r in keep:
        check_verdict(r, spec.get("name", spec.get("path")))
    return keep


def check_verdict(record, where=""):
    """ReportError when `record` states a verdict word that its own CI and per-seed effects do not
    give under eval.metrics.verdict (records without a verdict word, a numeric CI or a per_seed
    list are not checked)."""
    v, per = record.get("verdict"), record.get("per_seed")
    if v not in ("supported", "contradicted", "inconclusive") or not isinstance(per, list) \
            or not all(isinstance(record.get(k), (int, float)) for k in ("ci_low", "ci_high")):
        return
    want = verdict_rule(record, record.get("sign", 1))
    if v != want:
        raise ReportError(f"{where}: a record says {v!r}, but its CI [{record['ci_low']}, {record['ci_high']}] and "
                          f"per-seed effects {per} give {want!r} (eval.metrics.verdict); fix the result file")


def cell(template, record):
    """Fill a str.format template from a record; '-' when a field it names is missing or null."""
    names = [f for _, f, _, _ in string.Formatter().parse(template) if f]
    if any(record.get(f) is None for f in names):
        return "-"
    return template.format(**record)


def render_table(spec, cache=None):
    """Markdown of one table spec (see the module docstring), ending in a newline."""
    rows = _rows(spec, {} if cache is None else cache)
    if "pivot" in spec:
        p = spec["pivot"]
        keys, cols = [], []
        for r in rows:
            if r[p["row"]] not in keys:
                keys.append(r[p["row"]])
            if r[p["col"]] not in cols:
                cols.append(r[p["col"]])
        names = p.get("cols", {})
        lines = ["| " + " | ".join([p.get("corner", p["row"])] + [names.get(c, str(c)) for c in cols]) + " |",
                 "|" + "---|" * (len(cols) + 1)]
        for k in keys:
            got = {r[p["col"]]: r for r in rows if r[p["row"]] == k}
            lines.append("| " + " | ".join([str(k)] + [cell(p["cell"], got[c]) if c in got else "-" for c in cols]) + " |")
    else:
        cols = spec["columns"]
        lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(cell(t, r) for _, t in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def specs():
    """Every tables.json under eval/results/, as (spec file, parsed spec)."""
    return [(p, json.loads(p.read_text())) for p in sorted(RESULTS.rglob("tables.json"))]


def build_readmes():
    """{readme path: (old text, new text)} with every marked table re-rendered."""
    cache, out = {}, {}
    for src, spec in specs():
        readme = ROOT / spec["readme"]
        old = out[readme][1] if readme in out else readme.read_text()
        tables = {t["name"]: render_table(t, cache) for t in spec.get("tables", [])}
        seen = set()

        def sub(m):
            if m["name"] not in tables:
                return m.group(0)
            seen.add(m["name"])
            return m.group(1) + tables[m["name"]] + m.group(4)

        new = MARK.sub(sub, old)
        missing = set(tables) - seen
        if missing:
            raise ReportError(f"{spec['readme']} has no marker for {sorted(missing)} (from {src.relative_to(ROOT)}); "
                              f"add '<!-- table NAME -->' and '<!-- /table -->' lines where each table goes")
        out[readme] = (out[readme][0] if readme in out else old, new)
    return out


def draw_figures():
    cache, written = {}, []
    for _, spec in specs():
        for f in spec.get("figures", []):
            rows = _rows(f, cache)
            path = RESULTS / f["path"]
            if f["kind"] == "bar":
                bars = [(cell(f["label"], r), r["value"], r.get("ci_low"), r.get("ci_high")) for r in rows]
                bar_ci_png(bars, path, title=f.get("title", ""), ylabel=f.get("ylabel", ""),
                           width=max(640, 110 * len(bars)))  # room for each arm's label
            else:
                series = {}
                for r in rows:
                    series.setdefault(cell(f["series"], r), []).append((r[f["x"]], r["value"]))
                line_png(series, path, title=f.get("title", ""), xlabel=f.get("xlabel", f["x"]),
                         ylabel=f.get("ylabel", ""), logx=f.get("logx", False))
            written.append(path)
    return written


def main(argv=None):
    ap = entry_parser("eval.report", __doc__)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a README table differs")
    args = ap.parse_args(argv)
    try:
        readmes = build_readmes()
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stale = [p for p, (old, new) in readmes.items() if old != new]
    if args.check:
        for p in stale:
            print(f"stale: {p.relative_to(ROOT)} (run python -m eval.report)")
        return 1 if stale else 0
    for p in stale:
        atomic_write_text(p, readmes[p][1])
    figs = draw_figures()
    print(f"{len(readmes)} READMEs ({len(stale)} rewritten), {len(figs)} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
