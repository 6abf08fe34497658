"""Metrics: accuracy, POPE precision/recall/F1, ANLS, paired bootstrap CIs, per-family tables.

Pure functions over strings and 0/1 vectors; no model code. Answer extraction lives in
`common.answers` (methods use it too) and is re-exported here for the evaluation library.

    bootstrap_ci([1, 0, 1, 1])                             -> (lo, hi)   95% percentile CI
    paired_bootstrap(correct_a, correct_b)                 -> {"diff", "ci_low", "ci_high", "n"}
"""
import numpy as np

from common.answers import (LETTERS, NUMBER_WORDS, _json_answer, answer_type_of, extract, gold_list,  # noqa: F401
                            is_correct, normalize, option_letters, option_pairs, record_answer_type, short_answer,
                            strip_reasoning)

def accuracy(correct):
    """Mean of a 0/1 (or bool) sequence; 0.0 for an empty one."""
    return float(np.mean(np.asarray(correct, dtype=np.float64))) if len(correct) else 0.0


def pope_prf(preds, golds):
    """POPE metrics with "yes" as the positive class.

    preds, golds: sequences of extracted answers ("yes"/"no"). A prediction other than
    "yes" counts as a negative (unlike the official POPE script, which maps any answer
    without "no"/"not" to yes; we extract first, see `extract(.., "yesno")`).
        precision = TP / (TP + FP)   recall = TP / (TP + FN)   F1 = 2PR / (P + R)
        yes_ratio = share of "yes" predictions (POPE reports it to expose yes-bias)
    Returns dict(precision, recall, f1, accuracy, yes_ratio, n); 0.0 where a denominator is 0.
    Raises ValueError on length mismatch."""
    if len(preds) != len(golds):
        raise ValueError(f"pope_prf: {len(preds)} predictions vs {len(golds)} gold answers")
    p = np.array([x == "yes" for x in preds], dtype=bool)  # dtype: an empty list would be float64
    g = np.array([x == "yes" for x in golds], dtype=bool)
    tp, fp, fn = int((p & g).sum()), int((p & ~g).sum()), int((~p & g).sum())
    prec = tp / (tp + fp) if tp + fp else 0.0
    rec = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    acc = float((p == g).mean()) if len(p) else 0.0
    return {"precision": prec, "recall": rec, "f1": f1, "accuracy": acc,
            "yes_ratio": float(p.mean()) if len(p) else 0.0, "n": len(p)}


def levenshtein(a, b):
    """Edit distance (insert / delete / substitute, each cost 1) between two strings."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def anls_score(pred, golds, threshold=0.5):
    """ANLS of one answer (ST-VQA, Biten et al. 2019; DocVQA):
        NL(g, p) = levenshtein(g, p) / max(|g|, |p|)     (strings lower-cased, spaces collapsed)
        s = max over gold answers g of (1 - NL if NL < threshold else 0)
    golds: a string or a list of acceptable answers. threshold 0.5 is the standard tau."""
    golds = [golds] if isinstance(golds, str) else list(golds)
    p = " ".join(pred.lower().split())
    best = 0.0
    for g in golds:
        g = " ".join(str(g).lower().split())
        nl = levenshtein(g, p) / max(len(g), len(p)) if (g or p) else 0.0
        best = max(best, 1.0 - nl if nl < threshold else 0.0)
    return best


def anls(preds, golds, threshold=0.5):
    """Mean `anls_score` over items; golds[i] is a string or a list of strings."""
    if len(preds) != len(golds):
        raise ValueError(f"anls: {len(preds)} predictions vs {len(golds)} gold answers")
    return float(np.mean([anls_score(p, g, threshold) for p, g in zip(preds, golds)])) if preds else 0.0


# ----------------------------------------------------------------------------- bootstrap

def _resampled_means(x, n_resamples, seed, chunk_elems=4_000_000):
    """Means of `n_resamples` bootstrap resamples (rows drawn with replacement) of x [n].
    Vectorised in chunks of resamples so memory stays ~chunk_elems indices. -> [n_resamples]."""
    n = len(x)
    rng = np.random.default_rng(seed)
    per = max(1, chunk_elems // max(n, 1))
    out = []
    for start in range(0, n_resamples, per):
        idx = rng.integers(0, n, size=(min(per, n_resamples - start), n))  # [b, n]
        out.append(x[idx].mean(axis=1))
    return np.concatenate(out)


def bootstrap_ci(correct, n_resamples=10_000, seed=0, level=0.95):
    """Percentile bootstrap CI of the mean of `correct` (0/1 per item).

    Draws n_resamples resamples of size n with replacement (numpy, seeded), takes each
    resample's mean, returns the (1-level)/2 and (1+level)/2 percentiles as (lo, hi).
    An empty input gives (0.0, 0.0)."""
    x = np.asarray(correct, dtype=np.float64)
    if not len(x):
        return 0.0, 0.0
    m = _resampled_means(x, n_resamples, seed)
    a = (1 - level) / 2 * 100
    return float(np.percentile(m, a)), float(np.percentile(m, 100 - a))


def paired_bootstrap(correct_a, correct_b, n_resamples=10_000, seed=0, level=0.95):
    """Paired bootstrap of the accuracy difference of system A over system B on the same items.

    d_i = a_i - b_i; the same resampled item indices are used for both systems (that is the
    pairing), so the CI is the percentile CI of mean(d) over resamples. A CI that excludes 0
    means the difference is significant at 1 - level.
    Returns dict(diff = mean(a) - mean(b), ci_low, ci_high, n). Raises ValueError on a
    length mismatch."""
    a = np.asarray(correct_a, dtype=np.float64)
    b = np.asarray(correct_b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired_bootstrap: {a.shape} vs {b.shape}; both systems must score the same items")
    d = a - b
    lo, hi = bootstrap_ci(d, n_resamples, seed, level)
    return {"diff": float(d.mean()) if len(d) else 0.0, "ci_low": lo, "ci_high": hi, "n": len(d)}


# ----------------------------------------------------------------------------- per-family tables

def by_family(results, key="correct"):
    """{family: [result[key], ...]} in first-seen order, plus "all" (every result) last."""
    out = {}
    for r in results:
        out.setdefault(r["family"], []).append(r[key])
    out["all"] = [r[key] for r in results]
    return out


def format_table(rows, metric="accuracy"):
    """Markdown table of report rows ({"model","family","metric","value","ci_low","ci_high","n"}):
    one line per family, one column per model, "value [ci_low, ci_high]" cells."""
    rows = [r for r in rows if r["metric"] == metric]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fams = list(dict.fromkeys(r["family"] for r in rows))
    fams = [f for f in fams if f != "all"] + (["all"] if "all" in fams else [])
    cell = {(r["model"], r["family"]): r for r in rows}
    lines = ["| family | n | " + " | ".join(models) + " |", "|---|---:|" + "---:|" * len(models)]
    for f in fams:
        n = next(cell[m, f]["n"] for m in models if (m, f) in cell)
        vals = []
        for m in models:
            r = cell.get((m, f))
            vals.append("" if r is None else f"{r['value']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]")
        lines.append(f"| {f} | {n} | " + " | ".join(vals) + " |")
    return "\n".join(lines)
