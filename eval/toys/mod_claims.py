"""MoD's verdict rows from committed per-question files, by the two-level rule.

Every run the MoD toy scores (one arm, one seed, one metric) is kept in a small per-question
file under `eval/results/mod/<part>_per_question/` (`save_runs`): the score of each test
question (0/1 correctness as a string "0110...", or a list of reals such as the mechanism
tasks' per-token error) and a key into the file's `ids` table (the question ids, or a
fingerprint of the test inputs), so that two arms can be checked to score the same questions
in the same order. `rebuild_claims` recomputes every row of `eval/results/mod/claims.json` whose
two arms have all registered seeds in those files, with `eval.metrics.two_level_bootstrap`
(seeds, then questions within each seed) and `eval.metrics.verdict`; a row without them keeps
its old numbers. Nothing is trained:

    python -m eval.toys.mod --part claims      # claims.json, main_setting.json's comparisons, rerun_check.json
    python -m eval.report                      # then the README tables

`reproduction` compares each rerun (arm, seed) with the value committed before the per-question
files existed (`mechanism.json`, `main_setting.json`, `paper_rounds.json`).
"""
import json
import os

import numpy as np

from common.data import atomic_write_text
from eval.metrics import bootstrap_ci, two_level_bootstrap, verdict

SEEDS = (0, 1, 2)          # the registered seeds of every MoD verdict
MECH = "mechanism_per_question"
MAIN = "main_per_question/main.json"
# claim (as in claims.json) -> the per-question file, A and B as (arm, metric), the predicted sign of
# A - B, and what follows the verdict word (the rounds rows name the rounds).
CLAIMS = {
    "H1: MoD beats MoE-LoRA at equal parameters": (MAIN, ("MoD", "single"), ("MoE-LoRA token", "single"), 1, ""),
    "MoD beats LoRA at equal parameters": (MAIN, ("MoD", "single"), ("LoRA r=17 (matched)", "single"), 1, ""),
    "MoD beats MoE-LoRA with window routing": (MAIN, ("MoD", "single"), ("MoE-LoRA window", "single"), 1, ""),
    "MoD resists a misleading prior better than MoE-LoRA": (MAIN, ("MoD", "misled_own"),
                                                            ("MoE-LoRA token", "misled_own"), 1, ""),
    "dual routers beat one shared router, end to end": (MAIN, ("MoD", "single"), ("MoD shared router", "single"),
                                                        1, ""),
    "dual routers beat one shared router, pairing task": (f"{MECH}/pairing.json", ("MoD shared router", "test error"),
                                                          ("MoD (dual routers)", "test error"), 1, ""),
    "window (momentum) routing beats token routing": (f"{MECH}/stance.json", ("window W=16", "test error"),
                                                      ("token W=1", "test error"), -1, ""),
    "window routing beats region routing": (f"{MECH}/stance.json", ("region W=16", "test error"),
                                            ("window W=16", "test error"), 1, ""),
    "T_rev / T_rob data make MoD resist a wrong prior": (MAIN, ("MoD", "misled_own"),
                                                         ("MoD T_pos only", "misled_own"), 1, ""),
    "the viewpoint-shift mix raises single-round accuracy": (MAIN, ("MoD", "single"), ("MoD T_pos only", "single"),
                                                             1, ""),
    "T_rob adds to T_pos + T_rev": (MAIN, ("MoD", "misled_own"), ("MoD T_pos+T_rev", "misled_own"), 1, ""),
    "MoD-Multi (paper: one debate round) beats MoD-Single": (MAIN, ("MoD", "multi1"), ("MoD", "single"), 1, ""),
    "MoD-Multi with 2 debate rounds (not the paper's) beats MoD-Single": (MAIN, ("MoD", "multi2"), ("MoD", "single"),
                                                                          1, " (rounds=2, three generations)"),
    "more debate rounds keep helping": (MAIN, ("MoD", "multi3"), ("MoD", "single"), 1,
                                        " at rounds=3 (four generations)"),
}
SWITCH_CLAIM = "momentum switching lowers the expert switch rate"
SWITCH_ARMS = ("token W=1", "window W=4", "window W=16", "window W=64")   # W = 1 / 4 / 16 / 64
TWO_LEVEL = "two-level"                # the "CI resamples" cell of a recomputed row: seeds, then questions
RERUN_LOG = ("eval/logs/mod.md#2026-12-02-mods-verdicts-under-the-two-level-rule-the-registered-runs-rerun-with-"
             "their-per-question-outputs-kept-pre-registered")     # the entry a recomputed row links to
SOURCE_NOTE = ("Rows with a per_question field: recomputed from that committed per-question file by "
               "`python -m eval.toys.mod --part claims` (eval.toys.mod_claims): two-level paired bootstrap, "
               "seeds then questions (eval.metrics.two_level_bootstrap), verdict by eval.metrics.verdict; "
               "rows without it keep the CI described above (questions only).")


def encode(scores):
    """0/1 scores -> a string of "0" / "1" (compact); any other number -> a list of floats."""
    vals = [float(x) for x in scores]
    return "".join("1" if v else "0" for v in vals) if all(v in (0.0, 1.0) for v in vals) else vals


def decode(scores):
    """The inverse of `encode`: a "0110" string -> [0, 1, 1, 0]; a list is returned as floats."""
    return [int(c) for c in scores] if isinstance(scores, str) else [float(x) for x in scores]


def _key(run):
    return run["arm"], run["seed"], run["metric"]


def save_runs(path, header, ids, runs, overwrite=False):
    """Merge `runs` into the per-question file `path` (made when missing) and write it atomically,
    one run per line. header: the file's description ({"part", "metric", "items", "source", ...});
    ids {key: question ids (list) or a fingerprint (str)}; runs [{"arm", "seed", "metric",
    "ids": a key of ids, "scores": per-question scores, any other fields}], scores encoded by
    `encode`. Runs already in the file are kept; a run with the same (arm, seed, metric) and other
    scores or ids raises ValueError unless `overwrite` (then the new one replaces it), and so does
    an ids key whose content differs. Returns the merged {"ids", "rows"}."""
    old = load_runs(path) if os.path.exists(path) else {"ids": {}, "rows": []}
    for k, v in ids.items():
        if k in old["ids"] and old["ids"][k] != v and not overwrite:
            raise ValueError(f"{path}: ids {k!r} differ from the ones on file; pass --overwrite to replace them")
    merged_ids = {**old["ids"], **ids}
    by_key = {_key(r): r for r in old["rows"]}
    for r in runs:
        r = dict(r, scores=encode(r["scores"]))
        if r["ids"] not in merged_ids:
            raise ValueError(f"{path}: run {_key(r)} names ids {r['ids']!r}, which the file does not have")
        was = by_key.get(_key(r))
        if was is not None and (was["scores"] != r["scores"] or was["ids"] != r["ids"]) and not overwrite:
            raise ValueError(f"{path}: {_key(r)} is on file with other scores; pass --overwrite to replace it")
        by_key[_key(r)] = r
    body = {k: v for k, v in header.items() if k not in ("ids", "rows")}
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in body.items()]
    lines.append(f' "ids": {json.dumps(merged_ids)},')
    rows = [f"  {json.dumps(r)}" for _, r in sorted(by_key.items(), key=lambda kv: (str(kv[0][0]), kv[0][1:]))]
    text = "{\n" + "\n".join(lines) + '\n "rows": [\n' + ",\n".join(rows) + "\n ]\n}\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write_text(path, text)
    return {"ids": merged_ids, "rows": list(by_key.values())}


def load_runs(path):
    """A per-question file as a dict ({"ids", "rows", header fields}). Raises ValueError naming the
    file when it cannot be read or lacks "ids" / "rows"."""
    try:
        with open(path) as fh:
            data = json.load(fh)
        data["ids"], data["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a per-question file ({e}); rewrite it with the toy's run part") from e
    return data


def seed_scores(data, arm, metric):
    """{seed: (ids, scores)} of one arm and metric in a per-question file's dict."""
    return {r["seed"]: (data["ids"][r["ids"]], decode(r["scores"]))
            for r in data["rows"] if r["arm"] == arm and r["metric"] == metric}


def compare(data, a, b, seeds=SEEDS):
    """A minus B, (arm, metric) each, over `seeds` by `two_level_bootstrap`; None when a seed of
    either side is missing. Raises ValueError when A and B score different questions in a seed
    (their ids differ): the pairing the bootstrap relies on."""
    sa, sb = seed_scores(data, *a), seed_scores(data, *b)
    if any(s not in sa or s not in sb for s in seeds):
        return None
    for s in seeds:
        if sa[s][0] != sb[s][0]:
            raise ValueError(f"{a} and {b} score different questions in seed {s}: no paired comparison")
    return two_level_bootstrap([sa[s][1] for s in seeds], [sb[s][1] for s in seeds])


def _numbers(pb):
    """The fields a recomputed row takes from a `two_level_bootstrap` result, 6 decimals; n = questions per seed."""
    r6 = lambda x: round(float(x), 6)
    return dict(value=r6(pb["diff"]), ci_low=r6(pb["ci_low"]), ci_high=r6(pb["ci_high"]),
                per_seed=[r6(x) for x in pb["per_seed"]], seeds=pb["seeds"], n=pb["n"] // pb["seeds"])


def claim_row(row, data, spec, where):
    """`row` (a claims.json record) with its numbers recomputed from `data` by the two-level rule,
    or None when a registered seed of either arm is missing; n = questions per seed."""
    _, a, b, sign, suffix = spec
    pb = compare(data, a, b)
    if pb is None:
        return None
    return dict(row, verdict=verdict(pb, sign) + suffix, effect=f"{pb['diff']:+.3f} [{pb['ci_low']:+.3f}, "
                f"{pb['ci_high']:+.3f}]", **_numbers(pb), sign=sign, bootstrap=TWO_LEVEL, per_question=where,
                log=RERUN_LOG)


def switch_row(row, data, where):
    """The switch-rate claim from the stance runs: mean over the seeds of each W's switch rate;
    supported when it falls strictly from W = 1 to 64, else contradicted. None when a run is missing."""
    rates = []
    for arm in SWITCH_ARMS:
        got = {r["seed"]: r.get("switch_rate") for r in data["rows"] if r["arm"] == arm}
        if any(got.get(s) is None for s in SEEDS):
            return None
        rates.append(float(np.mean([got[s] for s in SEEDS])))
    falls = all(x > y for x, y in zip(rates, rates[1:]))
    return dict(row, verdict="supported" if falls else "contradicted", effect=" / ".join(f"{x:.3f}" for x in rates),
                seeds=len(SEEDS), per_question=where, log=RERUN_LOG)


def rebuild_claims(results_dir="eval/results/mod", log=print):
    """Rewrite results_dir/claims.json: every MoD row of `CLAIMS` (and the switch-rate row) whose
    per-question file holds both arms at every registered seed is recomputed (`claim_row`); the
    other rows are left as they are. Returns (rows recomputed, rows kept) as claim lists."""
    path = os.path.join(results_dir, "claims.json")
    with open(path) as fh:
        claims = json.load(fh)
    cache, done, kept = {}, [], []

    def data_of(rel):
        f = os.path.join(results_dir, rel)
        if f not in cache:
            cache[f] = load_runs(f) if os.path.exists(f) else None
        return cache[f], rel

    rows = []
    for row in claims["rows"]:
        new = None
        if row.get("method") == "MoD" and (row["claim"] in CLAIMS or row["claim"] == SWITCH_CLAIM):
            rel = CLAIMS[row["claim"]][0] if row["claim"] in CLAIMS else f"{MECH}/stance.json"
            data, where = data_of(rel)
            if data is not None:
                new = (claim_row(row, data, CLAIMS[row["claim"]], where) if row["claim"] in CLAIMS
                       else switch_row(row, data, where))
        (done if new else kept).append(row["claim"])
        rows.append(new or row)
    claims["rows"] = rows
    if done and SOURCE_NOTE not in claims["source"]:
        claims["source"] += " " + SOURCE_NOTE
    atomic_write_text(path, json.dumps(claims, indent=1, ensure_ascii=False) + "\n")
    log(f"{path}: {len(done)} rows from per-question files, {len(kept)} kept")
    return done, kept


# main_setting.json's paired comparisons (the table mod/main_compare): hypothesis -> A, B as (arm, metric or
# None = the row's metric); predicted A - B > 0 for every one
COMPARE = {"H1 MoD > MoE-LoRA token": (("MoD", None), ("MoE-LoRA token", None)),
           "H2 MoD > LoRA r=17 matched": (("MoD", None), ("LoRA r=17 (matched)", None)),
           "H3 MoD > LoRA r=4": (("MoD", None), ("LoRA r=4 (rank r)", None)),
           "H4 MoD > MoE-LoRA window": (("MoD", None), ("MoE-LoRA window", None)),
           "H5 MoD (dual) > MoD shared router": (("MoD", None), ("MoD shared router", None)),
           "H6a MoD (all three) > T_pos only": (("MoD", None), ("MoD T_pos only", None)),
           "H6b T_pos + T_rev > T_pos only": (("MoD T_pos+T_rev", None), ("MoD T_pos only", None)),
           "H6c MoD (all three) > T_pos + T_rev": (("MoD", None), ("MoD T_pos+T_rev", None)),
           "H7 MoD-Multi rounds=2 (three generations) > MoD-Single": (("MoD", "multi2"), ("MoD", "single")),
           "H7' MoD-Multi rounds=3 (four generations) > MoD-Single": (("MoD", "multi3"), ("MoD", "single"))}
METRIC_OF = {"single": "single", "misled_own": "misled_own", "misled_other": "misled_ood"}   # result file -> toy


def rebuild_compare(results_dir="eval/results/mod", log=print):
    """Rewrite the paired comparisons of results_dir/main_setting.json (kind "compare") whose two
    arms have every registered seed in the main per-question file: value, CI, per-seed effects,
    n and verdict by the two-level rule, "bootstrap" = TWO_LEVEL; the other comparisons keep
    their numbers and get "bootstrap" = "questions". Returns the hypotheses rewritten (with metric);
    [] when there is no main_setting.json."""
    path, pq = os.path.join(results_dir, "main_setting.json"), os.path.join(results_dir, MAIN)
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        res = json.load(fh)
    data = load_runs(pq) if os.path.exists(pq) else None
    done = []
    for row in res["rows"]:
        if row.get("kind") != "compare":
            continue
        (arm_a, ma), (arm_b, mb) = COMPARE[row["hypothesis"]]
        m = METRIC_OF[row["metric"]]
        pb = compare(data, (arm_a, ma or m), (arm_b, mb or m)) if data else None
        if pb is None:
            row.setdefault("bootstrap", "questions")
            continue
        row.update(**_numbers(pb), verdict=verdict(pb, 1), bootstrap=TWO_LEVEL, per_question=MAIN)
        done.append(f"{row['hypothesis']} ({row['metric']})")
    note = SOURCE_NOTE.replace("Rows with", "Compare rows with")
    if done and note not in res["source"]:
        res["source"] += ". " + note
    atomic_write_text(path, json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    log(f"{path}: {len(done)} comparisons from the per-question file")
    return done


# committed arm name (mechanism.json / main_setting.json) -> the toy's arm name
MECH_NAMES = {"MoD (dual routers), top-2 of 4+4": "MoD (dual routers)",
              "MoE-LoRA token, 6 rank-1 experts, top-2": "MoE-LoRA token", "LoRA rank 9 (matched)": "LoRA r=9 (matched)",
              "LoRA rank 2": "LoRA r=2", "window W=16 (default)": "window W=16"}
MAIN_NAMES = {"MoE-LoRA window W=16": ("MoE-LoRA window", None), "MoD, T_pos only (200 samples)": ("MoD T_pos only", None),
              "MoD, T_pos + T_rev (400 samples)": ("MoD T_pos+T_rev", None),
              "MoD-Multi, rounds=2 (three generations)": ("MoD", "multi2"),
              "MoD-Multi, rounds=3 (four generations)": ("MoD", "multi3"),
              "MoD-Multi (paper: 1 debate round)": ("MoD", "multi1")}


def reproduction(results_dir="eval/results/mod"):
    """Each rerun (arm, seed, metric) in the per-question files beside the committed per-seed value
    (3 decimals): [{"part", "arm", "seed", "metric", "committed", "rerun", "equal"}], equal when the
    rerun's mean rounds to the committed value. Runs without a committed value are left out."""
    committed = {}
    for fname, names in (("mechanism.json", MECH_NAMES), ("main_setting.json", MAIN_NAMES),
                         ("paper_rounds.json", MAIN_NAMES)):
        f = os.path.join(results_dir, fname)
        if not os.path.exists(f):
            continue
        with open(f) as fh:
            for r in json.load(fh)["rows"]:
                if r.get("kind") != "arm" or not isinstance(r.get("seed"), int):
                    continue
                arm, metric = (names.get(r["arm"], (r["arm"], None)) if fname != "mechanism.json"
                               else (names.get(r["arm"], r["arm"]), None))
                metric = metric or {"misled_other": "misled_ood"}.get(r["metric"], r["metric"])
                if r["arm"] == "MoD-Single":
                    arm = "MoD"
                value = r.get("committed", {}).get("value", r["value"])   # rewritten rows keep the old one
                committed[(fname != "mechanism.json", r.get("task"), arm, r["seed"], metric)] = value
    out = []
    for part, rel in (("mechanism", f"{MECH}/pairing.json"), ("mechanism", f"{MECH}/stance.json"),
                      ("main", MAIN)):
        f = os.path.join(results_dir, rel)
        if not os.path.exists(f):
            continue
        data = load_runs(f)
        for r in data["rows"]:
            key = (part == "main", data.get("task"), r["arm"], r["seed"], r["metric"])
            if key not in committed:
                continue
            mean = float(np.mean(decode(r["scores"])))
            out.append({"part": part if part == "main" else f"mechanism/{data.get('task')}", "arm": r["arm"],
                        "seed": r["seed"], "metric": r["metric"], "committed": committed[key], "rerun": round(mean, 6),
                        "equal": round(mean, 3) == round(committed[key], 3)})
    return out


def write_check(results_dir="eval/results/mod", log=print):
    """results_dir/rerun_check.json: the `reproduction` rows and how many are equal. Returns the rows."""
    rows = reproduction(results_dir)
    n_eq = sum(r["equal"] for r in rows)
    atomic_write_text(os.path.join(results_dir, "rerun_check.json"), json.dumps({
        "experiment": "rerun_check", "source": "python -m eval.toys.mod --part claims: each (arm, seed, metric) of the "
        "per-question files beside its committed per-seed value (mechanism.json, main_setting.json, "
        "paper_rounds.json), equal at 3 decimals", "equal": n_eq, "total": len(rows), "rows": rows}, indent=1) + "\n")
    log(f"reproduction: {n_eq} of {len(rows)} rerun (arm, seed, metric) equal to the committed value (3 decimals)")
    return rows


def rebuild_arms(results_dir="eval/results/mod", log=print):
    """Rewrite the arm rows of results_dir/main_setting.json (kind "arm": per seed and "pooled", the
    table mod/main_arms) whose arm has every registered seed in the main per-question file: per
    seed the accuracy, pooled the seed-averaged item correctness with its 95% bootstrap CI (as
    before), 3 decimals; the label ends in " (rerun)", "per_question" names the file and
    "committed" keeps the registered run's numbers (`reproduction` reads them). Other
    arm rows (the frozen base, arms not rerun) are kept. Returns the (arm, metric) pairs rewritten."""
    path, pq = os.path.join(results_dir, "main_setting.json"), os.path.join(results_dir, MAIN)
    if not (os.path.exists(path) and os.path.exists(pq)):
        return []
    with open(path) as fh:
        res = json.load(fh)
    data, done = load_runs(pq), []
    for row in res["rows"]:
        if row.get("kind") != "arm":
            continue
        arm, metric = MAIN_NAMES.get(row["arm"], (row["arm"], None))
        sc = seed_scores(data, arm, metric or METRIC_OF.get(row["metric"], row["metric"]))
        if any(s not in sc for s in SEEDS):
            continue
        row.setdefault("committed", {k: row.get(k) for k in ("value", "ci_low", "ci_high", "n") if k in row})
        if row["seed"] == "pooled":
            c = np.mean([sc[s][1] for s in SEEDS], axis=0)      # seed-averaged correctness per question
            lo, hi = bootstrap_ci(c)
            row.update(value=round(float(c.mean()), 3), ci_low=round(lo, 3), ci_high=round(hi, 3), n=len(c))
            done.append((row["arm"], row["metric"]))
        else:
            row.update(value=round(float(np.mean(sc[row["seed"]][1])), 3), n=len(sc[row["seed"]][1]))
        if not row["label"].endswith(" (rerun)"):
            row["label"] += " (rerun)"
        row["per_question"] = MAIN
    atomic_write_text(path, json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    log(f"{path}: {len(done)} arm rows from the per-question file")
    return done


def rebuild(results_dir="eval/results/mod", log=print):
    """Everything MoD's verdict tables read, from the per-question files alone: claims.json
    (`rebuild_claims`), main_setting.json's comparisons and arm rows (`rebuild_compare`,
    `rebuild_arms`) and rerun_check.json (`write_check`). Trains nothing."""
    rebuild_claims(results_dir, log)
    rebuild_compare(results_dir, log)
    rebuild_arms(results_dir, log)
    write_check(results_dir, log)
