"""Metrics: accuracy, POPE precision/recall/F1, ANLS, paired bootstrap CIs, verdicts, per-family tables.

Pure functions over strings and 0/1 vectors; no model code. Answer extraction lives in
`common.answers` (methods use it too) and is re-exported here for the evaluation library.

    bootstrap_ci([1, 0, 1, 1])                             -> (lo, hi)   95% percentile CI
    paired_bootstrap(correct_a, correct_b)                 -> {"diff", "ci_low", "ci_high", "n"}
    two_level_bootstrap(seeds_a, seeds_b)                  -> same + {"seeds", "per_seed", "bootstrap"}
    verdict(two_level_bootstrap(...), sign=+1)             -> "supported" / "contradicted" / "inconclusive"

The verdict rule of every toy (eval/toys/*.py): a comparison over seeds is resampled at two
levels (seeds with replacement, then questions within each drawn seed, the same questions for
both arms), and "supported" / "contradicted" need that CI to exclude 0 AND every seed's own
effect to share its sign. With one seed the bootstrap is the one-level (questions only) one and
the result says so.
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
    seed: an int or a numpy Generator (used as is). Vectorised in chunks of resamples so memory
    stays ~chunk_elems indices. -> [n_resamples]."""
    n = len(x)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
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


def two_level_bootstrap(seeds_a, seeds_b, n_resamples=10_000, seed=0, level=0.95):
    """Two-level paired bootstrap of arm A minus arm B over seeds and questions.

    seeds_a, seeds_b: one sequence of per-question scores (0/1 or real) per seed, [S][n_s];
    seeds_a[s][i] and seeds_b[s][i] are question i under seed s (the pairing). The effect is
        diff = (1/S) sum_s mean_i (a_si - b_si)          (every seed weighs the same)
    Each of n_resamples resamples draws S seeds with replacement, then, for every drawn seed,
    n_s questions with replacement (the same question indices for A and B: paired), and takes
    the same mean; the CI is the (1-level)/2, (1+level)/2 percentile pair of these means. So it
    carries the seed-to-seed spread as well as the question noise, which a bootstrap of the
    pooled questions ignores.
    With one seed there is no seed level: the result is `paired_bootstrap` (questions only) of
    that seed, and "bootstrap" says so.
    Returns dict(diff, ci_low, ci_high, n = questions over all seeds, seeds = S, per_seed =
    [mean_i(a_si - b_si)], bootstrap = the level(s) resampled, in words).
    Raises ValueError when there is no seed, the arms have different seed counts, a seed has no
    question, or A and B differ in length within a seed."""
    if len(seeds_a) != len(seeds_b):
        raise ValueError(f"two_level_bootstrap: {len(seeds_a)} seeds for A vs {len(seeds_b)} for B; "
                         "pass the same seeds for both arms")
    if not len(seeds_a):
        raise ValueError("two_level_bootstrap: no seed; pass one list of per-question scores per seed")
    ds = []
    for s, (a, b) in enumerate(zip(seeds_a, seeds_b)):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape or not len(a):
            raise ValueError(f"two_level_bootstrap: seed {s} has {a.shape} vs {b.shape} scores; both arms must "
                             "score the same, non-empty list of questions in every seed")
        ds.append(a - b)
    per_seed = [float(d.mean()) for d in ds]
    S = len(ds)
    if S == 1:
        out = paired_bootstrap(seeds_a[0], seeds_b[0], n_resamples, seed, level)
        return dict(out, seeds=1, per_seed=per_seed, bootstrap="one-level (1 seed: questions only)")
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, S, size=(n_resamples, S))       # [B, S] the seeds each resample draws
    total = np.zeros(n_resamples)
    for s, d in enumerate(ds):
        rows = np.nonzero(pick == s)[0]                     # one entry per time seed s was drawn
        np.add.at(total, rows, _resampled_means(d, len(rows), rng))   # its own question resample each time
    means = total / S
    a = (1 - level) / 2 * 100
    return {"diff": float(np.mean(per_seed)), "ci_low": float(np.percentile(means, a)),
            "ci_high": float(np.percentile(means, 100 - a)), "n": int(sum(len(d) for d in ds)), "seeds": S,
            "per_seed": per_seed, "bootstrap": f"two-level ({S} seeds, then questions)"}


def two_level_task_equal_bootstrap(seeds_a, seeds_b, seeds_tasks, n_resamples=10_000, seed=0, level=0.95):
    """`two_level_bootstrap` with every task weighted equally (RoleMerge App. D.2), arm A minus arm B.

    seeds_a, seeds_b: per-question scores per seed, [S][n_s], paired as in `two_level_bootstrap`;
    seeds_tasks: each question's task, [S][n_s]; every seed must hold the same set of tasks. The
    effect of seed s is the equal-weight mean of its per-task differences, and seeds weigh the same:
        e_s  = (1/T) sum_t mean_{i in t} (a_si - b_si)        diff = (1/S) sum_s e_s
    (a task with more questions gets no more weight). Each of n_resamples resamples draws S seeds
    with replacement, then, for every drawn seed, the questions of each task with replacement
    within that task (the same indices for A and B), and takes the same mean; the CI is the
    (1-level)/2, (1+level)/2 percentile pair. With one seed only the questions are resampled
    (within tasks), and "bootstrap" says so.
    Returns dict(diff, ci_low, ci_high, n = questions over all seeds, tasks = T, seeds = S,
    per_seed = [e_s], bootstrap = the level(s) resampled, in words).
    Raises ValueError when there is no seed, the three inputs have different seed counts, a seed
    has no question or lengths that differ, or the seeds hold different task sets."""
    if not (len(seeds_a) == len(seeds_b) == len(seeds_tasks)):
        raise ValueError(f"two_level_task_equal_bootstrap: {len(seeds_a)} seeds for A, {len(seeds_b)} for B and "
                         f"{len(seeds_tasks)} task lists; pass one of each per seed")
    if not len(seeds_a):
        raise ValueError("two_level_task_equal_bootstrap: no seed; pass one list of per-question scores per seed")
    names, strata = None, []                                 # strata[s][t]: the differences of task t in seed s
    for s, (a, b, t) in enumerate(zip(seeds_a, seeds_b, seeds_tasks)):
        a, b, t = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), list(t)
        if not (a.shape == b.shape == (len(t),)) or not len(t):
            raise ValueError(f"two_level_task_equal_bootstrap: seed {s} has {a.shape} vs {b.shape} scores and "
                             f"{len(t)} tasks; both arms must score the same, non-empty list of questions, "
                             "one task each")
        if names is None:
            names = list(dict.fromkeys(t))
        elif set(t) != set(names):
            raise ValueError(f"two_level_task_equal_bootstrap: seed {s} has tasks {sorted(set(t))}, seed 0 "
                             f"{sorted(names)}; every seed must hold the same tasks")
        d, tt = a - b, np.asarray(t, dtype=object)
        strata.append([d[tt == n] for n in names])
    T, S = len(names), len(strata)
    per_seed = [float(np.mean([x.mean() for x in xs])) for xs in strata]
    n = int(sum(len(x) for xs in strata for x in xs))
    rng = np.random.default_rng(seed)
    if S == 1:                                               # no seed level: every resample holds seed 0 once
        pick, how = np.zeros((n_resamples, 1), dtype=np.int64), "one-level (1 seed: questions only)"
    else:
        pick, how = rng.integers(0, S, size=(n_resamples, S)), f"two-level ({S} seeds, then questions)"  # [B, S]
    total = np.zeros(n_resamples)
    for s, xs in enumerate(strata):
        rows = np.nonzero(pick == s)[0]                      # one entry per time seed s was drawn
        e = sum(_resampled_means(x, len(rows), rng) for x in xs) / T    # its task-equal mean, each time
        np.add.at(total, rows, e)
    means = total / S
    q = (1 - level) / 2 * 100
    return {"diff": float(np.mean(per_seed)), "ci_low": float(np.percentile(means, q)),
            "ci_high": float(np.percentile(means, 100 - q)), "n": n, "tasks": T, "seeds": S,
            "per_seed": per_seed, "bootstrap": how}


def verdict(result, sign=1):
    """The verdict rule of every toy on a comparison `result` ({"ci_low", "ci_high", "per_seed"},
    e.g. from `two_level_bootstrap`) of the claim "sign * (A - B) > 0":
        "supported"     sign * CI entirely above 0 AND sign * every seed's effect > 0
        "contradicted"  sign * CI entirely below 0 AND sign * every seed's effect < 0
        "inconclusive"  otherwise (a seed at exactly 0 shares no sign)
    `per_seed` missing or empty: the CI alone decides."""
    lo, hi = sorted((sign * result["ci_low"], sign * result["ci_high"]))
    per = [sign * x for x in result.get("per_seed") or []]
    if lo > 0 and all(x > 0 for x in per):
        return "supported"
    if hi < 0 and all(x < 0 for x in per):
        return "contradicted"
    return "inconclusive"


def verdict_text(result, sign=1):
    """`verdict` for a table cell: with one seed it adds that only questions were resampled."""
    v = verdict(result, sign)
    return v + " (1 seed: questions-only bootstrap)" if result.get("seeds") == 1 else v


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
