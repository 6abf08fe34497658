"""Mutation pass over the method equations: one target file against its own fast tests, with mutmut.

    python -m eval.tools.mutation --target rolemerge/model.py --mutmut VENV/bin/mutmut --equations   # run / resume
    python -m eval.tools.mutation --target rolemerge/model.py --mutmut VENV/bin/mutmut --summary --equations
    python -m eval.tools.mutation --target common/routing.py --mutmut VENV/bin/mutmut     # every mutant of the file

mutmut is a development tool, not a dependency: install it in its own venv (`python -m venv VENV &&
VENV/bin/pip install mutmut==3.8.1`) that also sees this project's packages (a `.pth` file naming the
project venv's site-packages, or `pip install -r requirements.txt` there). mutmut 3.8.1 reads its
settings from `setup.cfg` / `pyproject.toml` in the directory it runs in; this repository has
neither, so each target gets a work directory `out/mutation/<target>/` holding a generated
`setup.cfg`, links to the packages and mutmut's own state (`mutants/`). A rerun resumes there
(mutants already checked are skipped); named mutants are rerun whatever their state. mutmut maps
tests to the functions they call once: after adding a test function, `--fresh` starts over, or
remove `mutants/mutmut-stats.json` there and rerun the survivors by name.

Each mutant of the target runs the target's tests (`TARGETS`, minus `KEEP_OUT`) that call the
mutated function; a test failure kills it. `--equations` limits the pass to the functions of the
paper's equations (`EQUATIONS`). `EQUIVALENT` lists the survivors that behave like the original
for every input (a few only on CPU, the reason says so), each with its reason. The summary
(`out/mutation/<target>/summary.json`) counts mutants, killed, equivalent, timeouts, survived
(not equivalent) and not checked; the exit status is 1 while any survive or wait.
"""
import json
import os
import shutil
import subprocess
import sys

from common.cli import entry_parser, fail, number, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ["common", "mod", "mole", "rolemerge", "eval", "tests"]

# target -> its fast equation tests (the slow end-to-end tests stay out: each mutant reruns these).
TARGETS = {
    "common/routing.py": ["tests/test_routing.py", "tests/test_routing_mutants.py"],
    "rolemerge/model.py": ["tests/test_rolemerge.py", "tests/test_rolemerge_groups.py",
                           "tests/test_rolemerge_search.py", "tests/test_rolemerge_mutations.py",
                           "tests/test_rolemerge_mutants.py"],
    "mod/model.py": ["tests/test_mod_equations.py", "tests/test_mod_decode.py", "tests/test_mod_mutants.py",
                     "tests/test_mod_model_fast.py"],
    "mole/model.py": ["tests/test_mole_router.py", "tests/test_mole_mutants.py",
                      "tests/test_mole_model_fast.py"],   # test_mole.py: whole forwards
    "rolemerge/comparators.py": ["tests/test_rolemerge_comparators.py", "tests/test_rolemerge_hcsmoe.py",
                                 "tests/test_rolemerge_agglomerate.py", "tests/test_rolemerge_comparators_mutants.py",
                                 "tests/test_rolemerge_assign_mutants.py"],
}

# target -> pytest -k expression leaving out its slow end-to-end tests (whole merges on tiny checkpoints)
KEEP_OUT = {"rolemerge/model.py": "not group_limited_merge_loads_runs_routes_inside_groups",
            "mod/model.py": "not train_and_infer and not text_only_rows and not llava_next_image_tokens "
                            "and not debate_lr"}

# target -> the functions that implement the paper's equations (`--equations` mutates these only)
EQUATIONS = {
    "common/routing.py": ["topk_gates", "load_balance_loss", "z_loss", "window_mean", "region_mean", "switch_rate",
                          "rank_mean", "_count", "_flat_mask", "_rank_sums", "_ranged_mean"],
    "rolemerge/model.py": ["phase_distributions", "role_profiles", "_xlogy_ratio", "pair_loss", "normalise_by_max",
                           "mutual_information", "answer_concentration", "layer_lambdas", "collision",
                           "collision_increment", "_pair_collision", "collision_scale", "merge_weights", "acr",
                           "_group_index"],
    "mod/model.py": ["topr_gates", "combine_gates", "_decode_plan"],
    "rolemerge/comparators.py": ["output_cosines", "ream_sums", "frequency_weights", "submoe_similarity", "svd_merge",
                                 "nash_weights", "namex_merge", "mergemoe_down", "ream_saliency", "ream_distance"],
    "mole/model.py": ["esva_delta", "latent_scores", "diversity_loss", "topology_mask", "column_mask",
                      "init_latents", "embedding_output_scale"],
}

# mutant name -> why it behaves like the original for every input (checked by reading it).
EQUIVALENT = {
    # rolemerge/model.py (the grouping functions)
    "rolemerge.model.x_agglomerate__mutmut_107": "ci <= cj: J's diagonal is inf and never equals the finite minimum",
    "rolemerge.model.x_agglomerate__mutmut_113": "a tie-break key applied to a single candidate keeps it",
    "rolemerge.model.x_agglomerate__mutmut_121": "min over (ci, cj): groups sit at their smallest member and ci < cj, so "
                                                 "index pairs order like their sorted member lists",
    "rolemerge.model.x_agglomerate__mutmut_123": "as agglomerate__mutmut_121",
    "rolemerge.model.x_agglomerate__mutmut_24": "D keeps d_norm's diagonal: never read (J's diagonal inf, tie-breaks read "
                                                "ci < cj, Lance-Williams resets D[a, a], b retires)",
    "rolemerge.model.x_agglomerate__mutmut_29": "as agglomerate__mutmut_24",
    "rolemerge.model.x_agglomerate__mutmut_6": "N from shape[1]: d_norm is square",
    "rolemerge.model.x_agglomerate__mutmut_61": "the idx > a form for every column: the same terms subtracted in another "
                                                "order, equal in exact arithmetic (may differ in the last bit)",
    "rolemerge.model.x_agglomerate__mutmut_67": "idx <= a changes only dR[a, a], never read",
    "rolemerge.model.x_agglomerate__mutmut_170": "None stored in a bool array is False",
    "rolemerge.model.x_agglomerate__mutmut_73": "+ r in the first Delta R matrix: r is all zeros before the first merge",
    "rolemerge.model.x_agglomerate__mutmut_74": "as agglomerate__mutmut_73",
    "rolemerge.model.x_frequency_groups__mutmut_22": "normalize's default dim 1 is dim -1 of the 2-d router",
    "rolemerge.model.x_frequency_groups__mutmut_27": "dim +1 is dim -1 of the 2-d router",
    "rolemerge.model.x_kmeans_groups__mutmut_55": "multinomial normalises its weights: d2 * s and d2 / s draw alike "
                                                  "(exact arithmetic)",
    "rolemerge.model.x_kmeans_groups__mutmut_67": "cubed distances: the same argmin and farthest point",
    "rolemerge.model.x_kmeans_groups__mutmut_86": "bincount without minlength: indexing the counts by `new` reads only "
                                                  "labels some point has",
    "rolemerge.model.x_kmeans_groups__mutmut_90": "-2.0 instead of -1.0: any negative value is below every squared "
                                                  "distance",
    "rolemerge.model.x_kmeans_groups__mutmut_95": "never stopping early: once the assignment repeats, C and every later "
                                                  "assignment repeat",
    "rolemerge.model.x_kmeans_groups__mutmut_46": "the duplicates-only seeding repeats a used index: every point already "
                                                  "sits at distance 0 on an earlier centre, so the first argmin (first "
                                                  "minimum) and the repair never read the added centres, and C is then "
                                                  "recomputed from the assignment (cdist giving the same zeros in both "
                                                  "calls: exact per pair for N <= 25)",
    "rolemerge.model.x_mst_weight__mutmut_15": "a float64 done mask only serves as np.where's condition",
    "rolemerge.model.x_mst_weight__mutmut_17": "as mst_weight__mutmut_15",
    "rolemerge.model.x_partition_score__mutmut_13": "D keeps d_norm's diagonal: Prim never reads d[j, j] for j outside "
                                                    "the tree; the collision term does not use D",
    "rolemerge.model.x_partition_score__mutmut_18": "as partition_score__mutmut_13",
    "rolemerge.model.x_swap_search__mutmut_13": "as partition_score__mutmut_13",
    "rolemerge.model.x_swap_search__mutmut_18": "as partition_score__mutmut_13",
    "rolemerge.model.x_swap_search__mutmut_55": "j < i: at j = i both experts share a group and a == b skips them",
    "rolemerge.model.x_plan__mutmut_101": "d_EP computed for kmeans / frequency / prune too: never read there, no side effect",
    "rolemerge.model.x_plan__mutmut_104": "as plan__mutmut_101",
    "rolemerge.model.x_plan__mutmut_105": "as plan__mutmut_101",
    "rolemerge.model.x_plan__mutmut_106": "as plan__mutmut_101",
    "rolemerge.model.x_plan__mutmut_107": "as plan__mutmut_101",
    "rolemerge.model.x_plan__mutmut_108": "as plan__mutmut_101",
    "rolemerge.model.x_plan__mutmut_109": "as plan__mutmut_101",
    "rolemerge.model.x_plan__mutmut_86": "a prior scaled by a constant: q unchanged, d_EP scaled and divided out by "
                                         "normalise_by_max (exact arithmetic)",
    "rolemerge.model.x_plan__mutmut_88": "sum over axis +1 is axis -1 of the 2-d [B, N] counts",
    # common/routing.py
    "common.routing.x__flat_mask__mutmut_3": "a float all-ones mask instead of a bool one: the mask only multiplies "
                                             "float tensors and is summed, 1.0 and True give the same products and count",
    "common.routing.x__flat_mask__mutmut_6": "same as _flat_mask__mutmut_3 (torch.ones' default dtype is float32)",
    "common.routing.x__rank_sums__mutmut_3": "float32 sums on MPS become float64: the same on every device but MPS, "
                                             "which has no float64 (no MPS device to run it on here)",
    "common.routing.x__rank_sums__mutmut_6": "the MPS test never matches: as _rank_sums__mutmut_3",
    "common.routing.x__rank_sums__mutmut_7": "the MPS test never matches ('MPS' is not a device type): as _rank_sums__mutmut_3",
    "common.routing.x__rank_sums__mutmut_41": "pads write to slot T-1 instead of the dump slot: that slot is real only "
                                              "with exactly one pad, and then the later write (CPU scatter_ runs in index "
                                              "order) is the last real token's, or a trailing pad's equal prefix sum",
    "common.routing.x__rank_sums__mutmut_53": "one more dump slot that nothing writes or reads",
    "common.routing.x__rank_sums__mutmut_68": "S keeps the dump slot T+1; callers gather only ranks 0..T",
    "common.routing.x_region_mean__mutmut_35": "clamp(min=1) instead of 0 inside % W changes start only where the token "
                                               "number is <= 0, and there lo = (start - offset) is clamped to 0 either way",
    "common.routing.x_switch_rate__mutmut_3": "an int64 all-ones pair mask instead of bool: `&` with the bool "
                                              "difference and the count give the same numbers",
    "common.routing.x_switch_rate__mutmut_5": "same as switch_rate__mutmut_3 (ones_like keeps top1's int64)",
    "common.routing.x_topk_gates__mutmut_27": "topk's default dim is -1, the one written",
    # mod/model.py (equation functions)
    "mod.model.x_topr_gates__mutmut_5": "topk's default dim is -1, the one written",
    # mod/model.py (the rest of the file)
    "mod.model.xǁRoutingWindowǁstep__mutmut_8": "the memo kind 'plan' renamed (None): a kind is only a key, "
                                                     "distinct from 'count' either way",
    "mod.model.xǁRoutingWindowǁstep__mutmut_16": "as RoutingWindow.step__mutmut_8 ('XXplanXX')",
    "mod.model.xǁRoutingWindowǁstep__mutmut_17": "as RoutingWindow.step__mutmut_8 ('PLAN')",
    "mod.model.xǁRoutingWindowǁforward__mutmut_103": "the memo kind 'count' renamed (None): a kind is only a "
                                                          "key, distinct from 'plan' either way",
    "mod.model.xǁRoutingWindowǁforward__mutmut_111": "as RoutingWindow.forward__mutmut_103 ('XXcountXX')",
    "mod.model.xǁRoutingWindowǁforward__mutmut_112": "as RoutingWindow.forward__mutmut_103 ('COUNT')",
    "mod.model.xǁRoutingWindowǁforward__mutmut_52": "(n_seen + W + i) % W: differs from (n_seen - W + i) by 2W, "
                                                         "the same slot mod W",
    "mod.model.xǁRoutingWindowǁforward__mutmut_74": "the prefill offset None: region_mean reads None as 0",
    "mod.model.xǁRoutingWindowǁforward__mutmut_76": "a float zero offset: region_mean reads it through "
                                                         "torch.as_tensor(..., device=x.device).long()",
    "mod.model.xǁRoutingWindowǁforward__mutmut_77": "the zero offset on the default device: region_mean moves it "
                                                         "to x's device (torch.as_tensor(..., device=x.device))",
    "mod.model.xǁRoutingWindowǁforward__mutmut_79": "as RoutingWindow.forward__mutmut_76",
    "mod.model.xǁRoutingWindowǁforward__mutmut_80": "as RoutingWindow.forward__mutmut_77",
    "mod.model.xǁRoutingWindowǁ_update_cache__mutmut_3": "L <= W: at L = W it prepends W - L = 0 zero columns",
    "mod.model.xǁRoutingWindowǁ_update_cache__mutmut_48": "pads keyed -2 instead of -1: any negative key sorts "
                                                               "first and fails pos >= 0",
    "mod.model.xǁMoDLinearǁ_decode__mutmut_117": "gather over dim +1 of the 2-d [B, E] z: dim 1 is dim -1",
    "mod.model.xǁMoDLinearǁ_decode__mutmut_80": "scatter_ over dim +1 of the 2-d [B, E] weights: dim 1 is dim -1",
    "mod.model.xǁMoDLinearǁ_decode__mutmut_136": "bag offsets made on the default device: the same on CPU; a CUDA "
                                                       "input would fail (no GPU here; meta tensors do not check "
                                                       "devices)",
    "mod.model.xǁMoDLinearǁ_decode__mutmut_140": "as MoDLinear._decode__mutmut_136",
    "mod.model.xǁMoDLinearǁ_adapter_full__mutmut_32": "router probabilities also computed in eval: only the "
                                                            "training aux loss reads them",
    "mod.model.xǁMoDLinearǁ_adapter_full__mutmut_68": "w.to(None) keeps w's dtype, and x is fp32 here (forward "
                                                            "casts it), so w.to(x.dtype) is a no-op too",
    "mod.model.xǁMoDLinearǁ_adapter_full__mutmut_69": "flatten(+2) of the 4-d [B, T, E, k] is flatten(-2)",
    "mod.model.xǁMoDLinearǁforward__mutmut_5": "always x.float(): an fp32 x's .float() is x itself",
    "mod.model.xǁMoDLinearǁforward__mutmut_9": "always h.to(out.dtype): a no-op when the dtypes already match",
    "mod.model.x_attach__mutmut_26": "rsplit('.') without maxsplit: the last piece is the same",
    "mod.model.x_attach__mutmut_29": "rsplit('.', 2): the last piece is the same",
    "mod.model.x_attach__mutmut_42": "lm.get_submodule('') is lm itself",
    "mod.model.x_unload__mutmut_23": "lm.get_submodule('') is lm itself",
    "mod.model.x_base_identity__mutmut_18": "getattr's default None instead of '': both fall through `or ''`",
    "mod.model.x_compile_adapters__mutmut_6": "`bias is None` instead of `is not None` relabels the kinds: the same count",
    "mod.model.x__atomic_write__mutmut_12": "umask(1) instead of umask(0) to read the umask: it is put back at once and "
                                            "nothing is created in between",
    "mod.model.x__write_text__mutmut_10": "'UTF-8' names the same codec as 'utf-8'",
    # mole/model.py (equation functions)
    "mole.model.x_esva_delta__mutmut_11": "einsum subscripts in upper case: the same contraction",
    "mole.model.x_esva_delta__mutmut_22": "einsum subscripts in upper case: the same contraction",
    "mole.model.x_latent_scores__mutmut_10": "einsum subscripts in upper case: the same contraction",
    "mole.model.x_latent_scores__mutmut_39": "einsum subscripts in upper case: the same contraction",
    "mole.model.x_diversity_loss__mutmut_16": "einsum subscripts in upper case: the same contraction",
    "mole.model.x_latent_scores__mutmut_29": "float('-INF') is float('-inf')",
    "mole.model.x_init_latents__mutmut_17": "lat * 1.0 is lat bit for bit when the scale is 1",
    "mole.model.x_init_latents__mutmut_7": "the CPU generator's noise is not moved to the table's device: the same on "
                                           "CPU; a CUDA table would fail (no GPU here to test it)",
    "mole.model.x_topology_mask__mutmut_36": "base.to(None) keeps the documented bool base mask as it is",
    # mole/model.py (the rest of the file)
    "mole.model.xǁMoLEPassǁ__init____mutmut_22": "argsort's default dim -1 is dim 1 of the 2-d [B, L] types",
    "mole.model.xǁMoLEPassǁ__init____mutmut_24": "a stable argsort of the bool mask: False < True sorts like 0 < 1",
    "mole.model.xǁMoLEǁ__init____mutmut_48": "nn.Linear(bias=None): None is falsy, no bias either way",
    "mole.model.xǁMoLEǁencode__mutmut_40": "pad tests side == 'right' only: any other no-answer side pads left",
    "mole.model.xǁMoLEǁencode__mutmut_41": "as encode__mutmut_40",
    "mole.model.xǁMoLEǁforward__mutmut_101": "cross_entropy's default ignore_index is -100, the one written",
    "mole.model.xǁMoLEǁlatent_attention__mutmut_131": "einsum subscripts in upper case: the same contraction",
    "mole.model.xǁMoLEǁtoken_types__mutmut_14": "Z_vis also at j = n_vis: the next line sets every j >= n_vis to ZSUM",
    "mole.model.xǁMoLEǁzvis_positions__mutmut_8": "is_z also at j = n_vis: that Z_sum goes to slot n_vis, the dump slot "
                                                   "that non-latents use and the slice drops",
    "mole.model.xǁMoLEǁzvis_positions__mutmut_44": "one more dump slot that nothing writes; the slice keeps the first n_vis",
    "mole.model.xǁMoLEǁzvis_positions__mutmut_26": "positions on the default device: the same on CPU and meta (whose "
                                                    "scatter_ does not check devices); a CUDA batch would fail (no GPU "
                                                    "in this pass)",
    "mole.model.xǁMoLEǁzvis_positions__mutmut_28": "as zvis_positions__mutmut_26",
    # rolemerge/comparators.py (equation functions)
    "rolemerge.comparators.x_mergemoe_down__mutmut_15": "einsum subscripts in upper case: the same contraction",
    "rolemerge.comparators.x_mergemoe_down__mutmut_24": "einsum subscripts in upper case: the same contraction",
    "rolemerge.comparators.x_mergemoe_down__mutmut_33": "einsum subscripts in upper case: the same contraction",
    "rolemerge.comparators.x_mergemoe_down__mutmut_67": "einsum subscripts in upper case: the same contraction",
    "rolemerge.comparators.x_svd_merge__mutmut_25": "einsum subscripts in upper case: the same contraction",
    "rolemerge.comparators.x_svd_merge__mutmut_66": "einsum subscripts in upper case: the same contraction",
    "rolemerge.comparators.x_svd_merge__mutmut_45": "a full SVD instead of the thin one: only the top `rank` triplets "
                                                    "are kept, and U S V is unchanged by the paired signs",
    "rolemerge.comparators.x_svd_merge__mutmut_46": "as svd_merge__mutmut_45",
    "rolemerge.comparators.x_nash_weights__mutmut_10": "n from shape[1]: the Gram M is square",
    "rolemerge.comparators.x_mergemoe_down__mutmut_70": "I from shape[1]: P = h'^T h' is square",
    "rolemerge.comparators.x_nash_weights__mutmut_75": "a trial point with an exact 0 (and no negative) entry: -log 0 "
                                                       "makes f = +inf > the finite f(a), so it is halved either way",
    "rolemerge.comparators.x_nash_weights__mutmut_85": "t <= 1e-20: t is a power of two (1 halved), never exactly 1e-20",
    # the quadratic-phase test `0 <= grad . step < 1/16`: for a Gram M (what the docstring admits; f is then
    # self-concordant) the Hessian is definite, so grad . step = lambda^2 > 0 unless grad = 0 (already returned),
    # and for lambda^2 < 1/8 the full Newton step is feasible (Dikin: |step_i| <= lambda a_i) and lowers f by at
    # least lambda^2 + lambda + log(1 - lambda) >= .02 (Boyd & Vandenberghe 9.6.4), so the damped test accepts t = 1
    # too: moving the bound within (0, 1/8) or to 0 < changes no step
    "rolemerge.comparators.x_nash_weights__mutmut_65": "0 < lambda^2: for a Gram lambda^2 = 0 only at grad = 0, "
                                                       "which the residual test returned before",
    "rolemerge.comparators.x_nash_weights__mutmut_67": "lambda^2 <= 1/16: at 1/16 the damped test accepts the full "
                                                       "step (see above)",
    "rolemerge.comparators.x_nash_weights__mutmut_69": "bound 2/16: for lambda^2 < 1/8 the damped test accepts the "
                                                       "full step (see above)",
    "rolemerge.comparators.x_nash_weights__mutmut_70": "bound 1/17: in [1/17, 1/16) the damped test accepts the full "
                                                       "step (see above)",
    "rolemerge.comparators.x_nash_weights__mutmut_98": "final residual <= 1e-8: |x - 1| for a float x in [.5, 2] is a "
                                                       "multiple of 2^-53 and float(1e-8) is not (1e-8 * 2^53 = "
                                                       "90071992.55); outside [.5, 2] it is >= .5",
    "rolemerge.comparators.x_expert_hidden__mutmut_10": "einsum subscripts in upper case: the same contraction",
    "rolemerge.comparators.x_expert_hidden__mutmut_18": "einsum subscripts in upper case: the same contraction",
    "rolemerge.comparators.x__fill_empty__mutmut_9": "bincount without minlength: the counts are indexed by labels that "
                                                    "occur",
    "rolemerge.comparators.x__fill_empty__mutmut_31": "-2.0 instead of -1.0: any negative value is below every distance",
    "rolemerge.comparators.x_hartigan__mutmut_5": "numpy's astype(None) is float64",
    "rolemerge.comparators.x_hartigan__mutmut_9": "bincount without minlength: the labels hold K non-empty clusters "
                                                  "(documented input; kmeans passes _fill_empty's labels)",
    "rolemerge.comparators.x_hartigan__mutmut_17": "moved = None: only read as `not moved`, and None is false like False",
    "rolemerge.comparators.x_hartigan__mutmut_18": "never stopping early: a pass without a move changes nothing, so the "
                                                   "later passes repeat it",
    "rolemerge.comparators.x_kmeans_plusplus__mutmut_42": "multinomial normalises its weights: d2 * pot and d2 / pot "
                                                          "draw alike (exact arithmetic)",
    "rolemerge.comparators.x__mergemoe__mutmut_9": "mean outputs scaled by a positive constant: Euclidean linkage "
                                                   "merges the same pairs (exact arithmetic)",
    "rolemerge.comparators.x__mergemoe__mutmut_19": "as _mergemoe__mutmut_9 (max(tokens, 2) differs from max(tokens, 1) "
                                                    "only by a positive factor)",
    "rolemerge.comparators.x__ream__mutmut_158": "cost = instead of cost +=: cost is all zeros before, the same "
                                                 "float64 matrix either way",
    "rolemerge.comparators.x__ream__mutmut_146": "avg_freq also solved as an assignment: it builds no features, the "
                                                 "cost is all zeros and linear_assignment returns the identity for it "
                                                 "(the first of equal minima at every step)",
    "rolemerge.comparators.x__ream__mutmut_147": "as _ream__mutmut_146",
    "rolemerge.comparators.x_ream_groups__mutmut_36": "group_size > 1 for the branch: group_size 1 passes the capacity "
                                                      "check only at K = N, where every expert is a centroid and "
                                                      "neither branch assigns anything",
    "rolemerge.comparators.x_ream_groups__mutmut_60": "a later early exit: once every expert has a label the remaining "
                                                      "centroids find nothing unassigned and change nothing",
    "rolemerge.comparators.x_ream_groups__mutmut_61": "as ream_groups__mutmut_60",
    "rolemerge.comparators.x_submoe_groups__mutmut_4": "k-means on the rows of 1 + S instead of 1 - S: a reflection "
                                                       "and shift, the same Euclidean distances and variance "
                                                       "(exact arithmetic)",
    "rolemerge.comparators.x_submoe_groups__mutmut_5": "2 - S instead of 1 - S: every row shifted by the same vector, "
                                                       "the same distances and variance (exact arithmetic)",
    "rolemerge.comparators.x_linear_assignment__mutmut_8": "n from shape[1]: the matrix must be square, checked next "
                                                           "with the same message",
    "rolemerge.comparators.x_linear_assignment__mutmut_14": "one more row potential that nothing reads",
    "rolemerge.comparators.x_ream_weight_features__mutmut_39": "the column mean without keepdim: [3H] broadcasts over "
                                                               "the rows like [1, 3H]",
    "rolemerge.comparators.x_ream_weight_features__mutmut_41": "as ream_weight_features__mutmut_39",
    "rolemerge.comparators.xǁComparatorRecorderǁ_hook__mutmut_35":
        "need | {...} is always true: the block then also computes the outputs, but each sum is still gated by "
        "its own name",
    "rolemerge.comparators.xǁComparatorRecorderǁ_hook__mutmut_40":
        "REAM's need holds both REAM sums, so the set still meets it with one name misspelt",
    "rolemerge.comparators.xǁComparatorRecorderǁ_hook__mutmut_41": "as ComparatorRecorder._hook__mutmut_40",
    "rolemerge.comparators.xǁComparatorRecorderǁ_hook__mutmut_42": "as ComparatorRecorder._hook__mutmut_40",
    "rolemerge.comparators.xǁComparatorRecorderǁ_hook__mutmut_43": "as ComparatorRecorder._hook__mutmut_40",
    "rolemerge.comparators.xǁComparatorRecorderǁ__init____mutmut_7":
        "count and tokens are accumulated whatever need holds: need is asked only for the other names",
    "rolemerge.comparators.xǁComparatorRecorderǁ__init____mutmut_8": "as ComparatorRecorder.__init____mutmut_7",
    "rolemerge.comparators.xǁComparatorRecorderǁ__init____mutmut_9": "as ComparatorRecorder.__init____mutmut_7",
    "rolemerge.comparators.xǁComparatorRecorderǁ__init____mutmut_10": "as ComparatorRecorder.__init____mutmut_7",
    "rolemerge.comparators.x_output_cosines__mutmut_17": "n >= 0 instead of > 0: a zero output gives 0 / 1e-300 = 0 "
                                                         "either way",
    "rolemerge.comparators.x_output_cosines__mutmut_30": "einsum subscripts in upper case: the same contraction",
    "rolemerge.comparators.x_ream_sums__mutmut_6": "softmax over axis +1 instead of -1: the same axis of the 2-d [T, N] logits",
    "rolemerge.comparators.x_ream_distance__mutmut_8": "norm over axis +1 instead of -1: the same axis of the 2-d [N, H]",
    # rolemerge/model.py (equation functions)
    "rolemerge.model.x_phase_distributions__mutmut_11": "sum over axis +1 instead of -1: the same axis of the 2-d [B, N] counts",
    "rolemerge.model.x_phase_distributions__mutmut_20": "tot >= 0 instead of > 0: an all-zero row gives 0 / 1e-300 = 0 either way",
    "rolemerge.model.x__xlogy_ratio__mutmut_7": "a >= 0 instead of > 0: at a = 0 the product is 0 * finite = 0 either way",
    "rolemerge.model.x_role_profiles__mutmut_7": "the empty-phase test summed in p's own dtype: a sum of non-negative "
                                                 "numbers is > 0 in any float dtype iff one of them is",
    "rolemerge.model.x_role_profiles__mutmut_9": "as role_profiles__mutmut_7",
    "rolemerge.model.x_role_profiles__mutmut_10": "sum over axis +1 instead of -1: the same axis of the 2-d [B, N] p",
    "rolemerge.model.x_role_profiles__mutmut_22": "the fallback prior in float32: it is used only when p is all zero, "
                                                  "and multiplies zeros",
    "rolemerge.model.x_role_profiles__mutmut_25": "as role_profiles__mutmut_22",
    "rolemerge.model.x_role_profiles__mutmut_26": "the fallback prior's value (B instead of 1/B) multiplies an all-zero p",
    "rolemerge.model.x_role_profiles__mutmut_27": "the fallback prior's value (2/B instead of 1/B) multiplies an all-zero p",
    "rolemerge.model.x_role_profiles__mutmut_37": "P(e) summed over axis +1 instead of -1: the same axis of the "
                                                  "2-d joint [N, B]",
    "rolemerge.model.x_role_profiles__mutmut_46": "P(e) >= 0 instead of > 0: a zero-mass expert's joint row is 0, "
                                                  "0 / 1e-300 = 0 either way",
    "rolemerge.model.x_pair_loss__mutmut_12": "tot >= 0 instead of > 0: where P(i) + P(j) = 0 the numerator is 0 too, "
                                              "0 / 1e-300 = 0 either way",
    "rolemerge.model.x_pair_loss__mutmut_21": "zeros_like(Pi / qi) instead of zeros_like(Pi * qi): same shape and dtype, "
                                              "zeros_like ignores the values",
    "rolemerge.model.x_normalise_by_max__mutmut_2": "N from shape[1]: d is square",
    "rolemerge.model.x_normalise_by_max__mutmut_13": "the zero maximum in float32: only compared with 0, the result is "
                                                     "zeros_like(d) either way",
    "rolemerge.model.x_normalise_by_max__mutmut_15": "as normalise_by_max__mutmut_13",
    "rolemerge.model.x_mutual_information__mutmut_25": "P(B) as [B] instead of [1, B]: P(G) [G, 1] * P(B) broadcasts "
                                                       "to the same [G, B]",
    "rolemerge.model.x_mutual_information__mutmut_27": "as mutual_information__mutmut_25",
}

# mutmut's status words -> the summary's columns
COLUMNS = {"killed": "killed", "survived": "survived", "timeout": "timeout", "not checked": "not_checked",
           "no tests": "no_tests", "suspicious": "suspicious", "skipped": "skipped",
           "caught by type check": "killed", "segfault": "killed"}


def slug(target):
    """`common/routing.py` -> `common_routing` (the work directory's name)."""
    return target[:-3].replace("/", "_")


def setup_cfg(target, tests):
    """The `[mutmut]` section that mutates `target` alone and selects `tests` (mutmut 3.8.1 keys)."""
    lines = ["[mutmut]", "source_paths =", *[f"    {p}" for p in PACKAGES if p != "tests"],
             "only_mutate =", f"    {target}",
             "pytest_add_cli_args_test_selection =", *[f"    {t}" for t in tests],
             "pytest_add_cli_args =", "    -q", "    -p", "    no:cacheprovider",
             *(["    -k", f"    {KEEP_OUT[target]}"] if target in KEEP_OUT else []), ""]
    return "\n".join(lines)


def workdir(target, fresh):
    """out/mutation/<slug>/ with links to the packages and a generated setup.cfg; `fresh` drops mutmut's state."""
    tests = [t for t in TARGETS[target] if os.path.exists(os.path.join(ROOT, t))]
    d = os.path.join(ROOT, "out", "mutation", slug(target))
    if fresh and os.path.isdir(os.path.join(d, "mutants")):
        shutil.rmtree(os.path.join(d, "mutants"))
    os.makedirs(d, exist_ok=True)
    for p in PACKAGES:
        link = os.path.join(d, p)
        if not os.path.islink(link):
            os.symlink(os.path.join(ROOT, p), link)
    cfg = setup_cfg(target, tests)
    path = os.path.join(d, "setup.cfg")
    if not os.path.exists(path) or open(path).read() != cfg:
        with open(path, "w") as f:
            f.write(cfg)
    return d


def results(mutmut, d):
    """{mutant name: mutmut status} from `mutmut results --all true` in work directory `d`."""
    out = subprocess.run([mutmut, "results", "--all", "true"], cwd=d, capture_output=True, text=True, check=True)
    status = {}
    for line in out.stdout.splitlines():
        name, sep, word = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            status[name] = word.strip()
    return status


def summarise(target, status):
    """Counts per column; an equivalent survivor leaves `survived` for `equivalent`."""
    counts = {"mutants": len(status), "killed": 0, "equivalent": 0, "timeout": 0, "survived": 0,
              "not_checked": 0, "no_tests": 0, "suspicious": 0, "skipped": 0}
    survivors = []
    for name, word in sorted(status.items()):
        col = COLUMNS.get(word)
        if col is None:
            raise ValueError(f"unknown mutmut status {word!r} for {name}")
        if col in ("survived", "no_tests") and name in EQUIVALENT:
            col = "equivalent"
        elif col in ("survived", "no_tests"):
            survivors.append(name)
        counts[col] += 1
    return {"target": target, "tests": TARGETS[target], **counts, "survivors": survivors,
            "equivalent_reasons": {n: EQUIVALENT[n] for n in sorted(status) if n in EQUIVALENT}}


def main(args):
    if args.target not in TARGETS:
        fail(f"--target {args.target} has no test list; pick one of {', '.join(TARGETS)}")
    if shutil.which(args.mutmut) is None:
        fail(f"--mutmut {args.mutmut} not found; install mutmut==3.8.1 in its own venv and pass its bin/mutmut")
    d = workdir(args.target, args.fresh)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if not args.summary:
        names = list(args.mutants)
        if args.equations:
            if args.target not in EQUATIONS:
                fail(f"--equations: no equation list for {args.target}; name mutants instead")
            module = args.target[:-3].replace("/", ".")
            names += [f"{module}.x_{f}__mutmut_*" for f in EQUATIONS[args.target]]
        cmd = ["nice", "-n", str(args.nice), args.mutmut, "run", "--max-children", str(args.max_children), *names]
        rc = subprocess.run(cmd, cwd=d, env=env).returncode
        if rc != 0:
            fail(f"mutmut run exited {rc} in {d}; its output is above")
    status = results(args.mutmut, d)
    if args.equations and args.target in EQUATIONS:
        module = args.target[:-3].replace("/", ".")
        status = {n: w for n, w in status.items() if n.split("__mutmut_")[0] in
                  {f"{module}.x_{f}" for f in EQUATIONS[args.target]}}
    summary = summarise(args.target, status)
    summary["scope"] = "equation functions" if args.equations else "whole file"
    with open(os.path.join(d, "summary.json.tmp"), "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(os.path.join(d, "summary.json.tmp"), os.path.join(d, "summary.json"))
    print(json.dumps({k: v for k, v in summary.items() if k != "equivalent_reasons"}, indent=1))
    return 1 if summary["survived"] or summary["not_checked"] else 0


def parser():
    p = entry_parser(__spec__.name if __spec__ else "eval.tools.mutation", __doc__)
    p.add_argument("--target", required=True, help=f"the file to mutate: {', '.join(TARGETS)}")
    p.add_argument("--mutmut", default="mutmut", help="mutmut 3.8.1's executable (its own venv)")
    p.add_argument("--max-children", type=number(int, min=1), default=1, help="mutants tested at once")
    p.add_argument("--nice", type=number(int, min=0), default=10, help="niceness of the run")
    p.add_argument("--fresh", action="store_true", help="drop mutmut's state and start over")
    p.add_argument("--summary", action="store_true", help="only count the recorded results")
    p.add_argument("--equations", action="store_true",
                   help="mutate (and count) only the target's equation functions (EQUATIONS), not the whole file")
    p.add_argument("mutants", nargs="*", help="mutant names or globs to rerun, finished or not (default: every "
                                               "unfinished one; with --equations, every equation mutant reruns)")
    return p


if __name__ == "__main__":
    sys.exit(run_cli(main, parser().parse_args()))
