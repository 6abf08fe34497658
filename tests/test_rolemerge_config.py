"""MergeConfig: the settings of `python -m rolemerge.merge`, one field per flag, filled in one place."""
import dataclasses

from rolemerge import merge as mg
from rolemerge import planning
from rolemerge.planning import MergeConfig

FIELDS = [f.name for f in dataclasses.fields(MergeConfig)]


def test_merge_config_fields_are_the_flags_dest_names():
    dests = {a.dest for a in mg.parser()._actions if a.dest != "help"}
    assert set(FIELDS) == dests


def test_merge_config_defaults_are_the_flags_defaults():
    p = mg.parser()
    assert {f: getattr(MergeConfig(), f) for f in FIELDS} == {f: p.get_default(f) for f in FIELDS}


def test_config_from_args_carries_every_flag():
    a = mg.parser().parse_args(["--model", "m", "--stats", "s1", "s2", "--out", "o", "--k", "4", "--method", "hcsmoe",
                                "--router", "average", "--distance", "cosine", "--adaptive", "--lam", "0.1",
                                "--linkage", "average", "--seed", "3", "--in-memory", "--overwrite", "--dtype",
                                "bfloat16", "--threads", "2"])
    assert mg.config_from_args(a) == MergeConfig(
        model="m", stats=["s1", "s2"], out="o", k=4, method="hcsmoe", router="average", distance="cosine",
        adaptive=True, lam=0.1, linkage="average", seed=3, in_memory=True, overwrite=True, dtype="bfloat16", threads=2)


def test_check_config_refuses_what_no_merge_runs_with():
    for bad, msg in ((dict(linkage="ward"), "unknown linkage 'ward'"), (dict(method="x"), "unknown method 'x'"),
                     (dict(router="x"), "unknown router operator 'x'"), (dict(distance="x"), "unknown distance 'x'"),
                     (dict(adaptive=True), "layer-adaptive expert counts are M-SMoE's"),
                     (dict(method="msmoe", router="average", adaptive=True), "need --router bound"),
                     (dict(lam=float("nan")), "must be a finite number >= 0"), (dict(lam=-1.0), "lambda=-1.0")):
        try:
            planning.check_config(MergeConfig(**bad))
        except planning.MergeError as e:
            assert msg in str(e), (bad, str(e))
        else:
            raise AssertionError(f"{bad} was accepted")
    assert planning.check_config(MergeConfig(method="msmoe", adaptive=True)) == "bound"
