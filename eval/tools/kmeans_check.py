"""Sub-MoE's k-means (rolemerge.comparators.kmeans) against scikit-learn's KMeans on 30 synthetic cases.

    python -m eval.tools.kmeans_check --sklearn-python VENV/bin/python --out eval/results/rolemerge/kmeans_check.json

scikit-learn is not a dependency: it runs in its own venv (`python -m venv VENV && VENV/bin/pip install
numpy scikit-learn`), called once as a subprocess on the cases written to a temporary .npz. Both sides
cluster the same rows with k-means++ seeding, n_init 10, random_state / seed 42; the inertia of each
side's labels (sum of squared distances to the label means) is compared. Cases (`cases`): 15 Sub-MoE
distance matrices 1 - cos of clustered expert outputs and 15 Gaussian blob sets, N from 8 to 128,
K = round(r N), r in .25 / .5 / .625 / .75. Goal: ours no worse (within 1e-9 relative) in >= 27 of 30.
"""
import json
import os
import subprocess
import tempfile

import numpy as np
import torch

from common.cli import entry_parser, run_cli
from common.files import atomic_write_text
from rolemerge.comparators import kmeans

SKLEARN = """
import json, sys
import numpy as np
from sklearn.cluster import KMeans
import sklearn
d = np.load(sys.argv[1])
out = []
for i in range(int(d["n"])):
    X, K = d[f"X{i}"], int(d[f"K{i}"])
    out.append(KMeans(K, init="k-means++", n_init=10, random_state=42).fit(X).labels_.tolist())
print(json.dumps({"labels": out, "sklearn": sklearn.__version__}))
"""


def cases(n=30, seed=2026):
    """The synthetic cases: [(kind, X [N, F] float64, K)], deterministic (numpy PCG64, `seed`)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        N = (8, 16, 32, 64, 128)[i % 5]
        K = max(2, round(N * (0.25, 0.5, 0.625, 0.75)[(i // 5) % 4]))
        if i < n // 2:      # Sub-MoE's input: rows of 1 - cos of expert outputs with some shared directions
            C = max(2, N // 4)
            Y = rng.standard_normal((C, 16))[rng.integers(0, C, N)] + 0.7 * rng.standard_normal((N, 16))
            Y /= np.linalg.norm(Y, axis=1, keepdims=True)
            X = 1.0 - Y @ Y.T
            np.fill_diagonal(X, 0.0)
            out.append(("submoe", X, K))
        else:               # overlapping Gaussian blobs in 4 dimensions
            C = max(2, N // 6)
            X = 3.0 * rng.standard_normal((C, 4))[rng.integers(0, C, N)] + rng.standard_normal((N, 4))
            out.append(("blobs", X, K))
    return out


def inertia(X, labels):
    """Sum over clusters of squared distances to the cluster mean (the labels' own centres)."""
    X, labels = np.asarray(X, dtype=np.float64), np.asarray(labels)
    return float(sum(((X[labels == c] - X[labels == c].mean(0)) ** 2).sum() for c in np.unique(labels)))


def ours(cs):
    """Our inertia per case (seed 42, n_init 10, as Sub-MoE runs it)."""
    return [inertia(X, kmeans(torch.from_numpy(X), K, n_init=10, seed=42).numpy()) for _, X, K in cs]


def main(argv=None):
    ap = entry_parser("eval.tools.kmeans_check", __doc__)
    ap.add_argument("--sklearn-python", required=True, help="python of a venv with numpy and scikit-learn")
    ap.add_argument("--out", required=True, help="result file to write (eval/report.py format)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    a = ap.parse_args(argv)
    if os.path.exists(a.out) and not a.overwrite:
        ap.error(f"{a.out} exists; pass --overwrite to replace it")
    cs = cases()
    with tempfile.TemporaryDirectory() as tmp:
        f = os.path.join(tmp, "cases.npz")
        np.savez(f, n=len(cs), **{f"X{i}": X for i, (_, X, _) in enumerate(cs)},
                 **{f"K{i}": K for i, (_, _, K) in enumerate(cs)})
        try:
            res = subprocess.run([a.sklearn_python, "-c", SKLEARN, f], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            ap.exit(2, f"error: scikit-learn run failed with --sklearn-python {a.sklearn_python}: "
                       f"{getattr(e, 'stderr', '') or e}; make it with python -m venv VENV && "
                       f"VENV/bin/pip install numpy scikit-learn\n")
    sk = json.loads(res.stdout)
    mine = ours(cs)
    rows = []
    for i, ((kind, X, K), o, lab) in enumerate(zip(cs, mine, sk["labels"])):
        s = inertia(X, lab)
        rows.append({"case": i, "kind": kind, "N": X.shape[0], "F": X.shape[1], "K": K, "x_sum": round(float(X.sum()), 9),
                     "inertia_ours": o, "inertia_sklearn": s, "ratio": o / s if s else 1.0,
                     "no_worse": o <= s * (1 + 1e-9)})
    ok = sum(r["no_worse"] for r in rows)
    rows.append({"kind": "summary", "no_worse": ok, "cases": len(rows), "max_ratio": max(r["ratio"] for r in rows),
                 "sklearn": sk["sklearn"]})
    src = (f"python -m eval.tools.kmeans_check --sklearn-python VENV/bin/python --out {a.out} (VENV: numpy + "
           f"scikit-learn {sk['sklearn']}); inertia = sum of squared distances to each side's label means")
    atomic_write_text(a.out, json.dumps({"experiment": "submoe_kmeans_vs_sklearn", "source": src, "rows": rows},
                                        indent=1) + "\n")
    print(f"ours no worse than scikit-learn {sk['sklearn']} in {ok} of {len(cs)} cases; "
          f"max ratio {rows[-1]['max_ratio']:.4f}")


if __name__ == "__main__":
    run_cli(main)
