"""One flag vocabulary: every entry point's parser is read (what its `--help` prints), and each
flag that two or more entry points share must have one meaning (MEANINGS) and one default, or a
documented reason for different defaults. eval/README.md's "Shared flags" table is rendered from
the parsers and MEANINGS and must equal what is committed (`render_table`; the assertion message
holds the table to paste). `--device` / `--dtype` / `--device-map` are left out: they come from
`common.cli.add_device_args`."""
import argparse
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = ("common.shapes", "eval.convert", "eval.evaluate", "eval.scores", "eval.quickstart", "mod.data",
                "mod.train", "mod.infer", "mod.params", "mole.train", "mole.infer", "mole.diagnostics",
                "rolemerge.calibrate", "rolemerge.merge", "rolemerge.infer", "eval.tools.pretrain", "eval.toys.mod",
                "eval.toys.mole", "eval.toys.rolemerge")
SKIP = {"--help", "--device", "--dtype", "--device-map"}
TRAINERS = ("mod.train", "mole.train", "eval.tools.pretrain")   # the entry points with an optimizer step

# flag -> (its one meaning, why the defaults differ or None when they must not)
MEANINGS = {
    "--arms": ("comma list of the toy's arms to run", "each toy's own arm list (empty: all)"),
    "--batch-size": ("records processed together: in training the records of one optimizer step (all processes "
                     "and --grad-accum micro-batches together), elsewhere one generation / forward batch",
                     "sized to each command's memory and data: training steps of the method's recipe, generation "
                     "batches of the tiny bases"),
    "--benchmark": ("a benchmark name of eval.scores' scorers", None),
    "--ckpt": ("a mole.train checkpoint directory", None),
    "--clip": ("gradient-norm clip (0 = off)", None),
    "--compile": ("torch.compile the method's hot path", None),
    "--data": ("the data file (or shapes folder) to read", "a required input, or the shapes folder the "
               "command generates / reads by default"),
    "--grad-accum": ("micro-batches each process splits its share of an optimizer step into", None),
    "--image-root": ("folder relative image paths resolve against", None),
    "--limit": ("use only the first N records (0 = all)", "a first look at a large file: 100 for the diagnostics, "
                "128 per calibration file (the RoleMerge paper's size); all elsewhere"),
    "--lora-alpha": ("peft's lora_alpha: the adapter output is scaled by lora_alpha / r",
                     "each default is 2 r (scaling 2): MoD's r = 4, MoLE's LoRA r = 8"),
    "--lr": ("peak learning rate (AdamW, warmup, then decay)", "toy-scale defaults of each recipe; MoLE requires it "
             "on a real base (none)"),
    "--mad-rounds": ("debate rounds of the multi-agent-debate baseline", "eval.toys.mod sweeps several"),
    "--max-minutes": ("a run-length limit: no training or scoring starts after this many minutes (rerun the same "
                      "command to continue)", None),
    "--max-new-tokens": ("cap on generated tokens per answer", "each command's answers: shapes answers (48), debate "
                         "JSON (64-96), calibration decoding (32)"),
    "--method": ("which method the command runs (adapter, MoLE variant, merge method), or in eval.scores the "
                 "mod.infer method whose predictions are scored", "each command's own method list"),
    "--methods": ("comma list of methods to run", "each command's own method list"),
    "--model": ("the base model: a checkpoint directory, a hub id or a tiny base name", "the tiny base each "
                "method is built on; required where any base works"),
    "--n-test": ("test examples", None),
    "--n-train": ("training records", "common.shapes generates 2000; mole.train uses all (0)"),
    "--out": ("where the command writes (file or folder, named in its help)", "each command's own output path"),
    "--overwrite": ("replace an existing output (else it is refused)", None),
    "--part": ("which part of the toy reproduction to run", "each toy's own parts"),
    "--quick": ("quick mode: checks the code paths, no claim", None),
    "--r": ("peft's r: adapter rank (MoD: top-r rank-1 experts, the rank of the mixture; LoRA rank)",
            "the papers' defaults: MoD r = 4, MoLE's LoRA r = 8"),
    "--results": ("where a toy writes its committed result rows (eval.report format)",
                  "each toy's own place: a result file (eval.toys.rolemerge) or a folder under eval/results/"),
    "--resume": ("continue an interrupted run from its checkpoint / OUT.partial", None),
    "--retrain-base": ("retrain the tiny base(s) first", "eval.toys.rolemerge takes the folder to train into"),
    "--save-every": ("also checkpoint every N optimizer steps (0 = only at the end)", None),
    "--seed": ("random seed of the run", None),
    "--seeds": ("comma list of seeds to run", "each toy's own seed set"),
    "--skip-bad": ("leave out records with an unusable image, with a note", None),
    "--steps": ("optimizer steps", "mod.train trains adapters (300), eval.tools.pretrain a whole base (6000)"),
    "--threads": ("torch CPU threads (default: 1 for the tiny bases, every usable core otherwise)", None),
    "--top-k": ("experts selected per token by a router", None),
    "--trust-remote-code": ("allow code shipped with a checkpoint", None),
    "--warmup-ratio": ("linear warmup as a fraction of all optimizer steps (0-1)", None),
    "--weight-decay": ("AdamW weight decay", None),
}
TAKES_A_VALUE_SOMEWHERE = {"--retrain-base"}   # a switch, except eval.toys.rolemerge's (the folder: MEANINGS)
FORBIDDEN = {"--warmup": "steps in one entry point, a fraction in another: --warmup-steps / --warmup-ratio",
             "--lora-r": "peft names the rank r: --r"}


class _Parser(Exception):
    pass


def parser_of(module, monkeypatch):
    """The argparse parser a module's main() builds (parse_args is stopped before it parses)."""
    def stop(self, *a, **k):
        raise _Parser(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    main = importlib.import_module(module).main
    try:
        main([]) if main.__code__.co_argcount else main()
    except _Parser as e:
        return e.args[0]
    raise AssertionError(f"{module}.main() built no parser")


@pytest.fixture(scope="module")
def flags():
    """{flag: {entry point: (default, help, is_switch)}} of the flags `--help` lists."""
    mp = pytest.MonkeyPatch()
    out = {}
    try:
        for ep in ENTRY_POINTS:
            p = parser_of(ep, mp)
            shown = p.format_help()
            for a in p._actions:
                if a.help == argparse.SUPPRESS:
                    continue
                for o in a.option_strings:
                    if o.startswith("--") and o not in SKIP:
                        assert o in shown, (ep, o)
                        out.setdefault(o, {})[ep] = (a.default, a.help or "", a.nargs == 0)
    finally:
        mp.undo()
    return out


def _fmt(v):
    if v in (None, ""):
        return "none"
    v = str(v)
    return f"`{v[:40]},...`" if len(v) > 48 else f"`{v}`"


def render_table(flags):
    """The markdown of eval/README.md's shared-flag table."""
    lines = ["| flag | meaning | default |", "|---|---|---|"]
    for flag in sorted(f for f, eps in flags.items() if len(eps) > 1):
        meaning, reason = MEANINGS[flag]
        by_default = {}
        for ep, (d, _, _) in flags[flag].items():
            by_default.setdefault(_fmt(d), []).append(ep)
        if len(by_default) == 1:
            default = next(iter(by_default))
        else:
            default = "; ".join(f"{d} ({', '.join(eps)})" for d, eps in by_default.items()) + f": {reason}"
        lines.append(f"| `{flag}` | {meaning} | {default} |")
    return "\n".join(lines)


def test_each_shared_flag_has_one_meaning_and_one_default_or_a_reason(flags):
    shared = {f: eps for f, eps in flags.items() if len(eps) > 1}
    missing = sorted(set(shared) - set(MEANINGS))
    assert not missing, f"shared flags without a meaning in MEANINGS: {missing}"
    for flag, eps in shared.items():
        defaults = {repr(d) for d, _, _ in eps.values()}
        assert len(defaults) == 1 or MEANINGS[flag][1], f"{flag}: defaults differ {dict(eps)} with no reason"
        assert len({sw for _, _, sw in eps.values()}) == 1 or flag in TAKES_A_VALUE_SOMEWHERE, \
            f"{flag} is a switch in some entry points only"


def test_the_old_two_meaning_flags_are_gone(flags):
    """--batch-size was the micro-batch in mod.train and the global batch in mole.train; --warmup
    steps in MoD and a fraction in MoLE; --r vs --lora-r for one LoRA rank."""
    for flag, why in FORBIDDEN.items():
        assert flag not in flags, f"{flag} is listed by {sorted(flags.get(flag, {}))}: {why}"
    for ep in TRAINERS:
        assert "records per optimizer step" in flags["--batch-size"][ep][1], ep
    assert all("fraction" in h for _, h, _ in flags["--warmup-ratio"].values())
    assert "optimizer steps" in flags["--warmup-steps"]["mod.train"][1]
    assert flags["--save-every"]["mod.train"][0] == flags["--save-every"]["mole.train"][0]


# Old spellings the entry points accepted besides the current ones (with a deprecation warning; pretrain's
# --no-look as a synonym of --look none) before the first release; now unknown arguments.
OLD_SPELLINGS = {"eval.evaluate": ("--base", "--n"), "eval.quickstart": ("--fresh",), "mod.data": ("--k",),
                 "mod.train": ("--warmup",), "mole.train": ("--base", "--warmup", "--lora-r"),
                 "mole.infer": ("--base", "--n"), "mole.diagnostics": ("--base", "--n"),
                 "rolemerge.calibrate": ("--n", "--force"), "rolemerge.merge": ("--force",),
                 "rolemerge.infer": ("--n",), "eval.tools.pretrain": ("--warmup", "--fresh", "--ckpt-every", "--no-look"),
                 "eval.tools.lm_harness_check": ("--fresh",), "eval.tools.lmms_check": ("--fresh",),
                 "eval.toys.mod": ("--base",), "eval.toys.mole": ("--base",), "eval.toys.rolemerge": ("--base",)}


@pytest.mark.parametrize("module", sorted(OLD_SPELLINGS))
def test_old_flag_spellings_are_unknown_arguments(module, capsys):
    """No alias survives: each old spelling is argparse's error (exit 2), neither a warning nor an
    abbreviation of a longer flag (--warmup of --warmup-steps)."""
    with pytest.MonkeyPatch.context() as mp:
        p = parser_of(module, mp)
    for a in p._actions + p._mutually_exclusive_groups:
        a.required = False       # only the old flag is on the command line
    for old in OLD_SPELLINGS[module]:
        with pytest.raises(SystemExit) as e:
            p.parse_args([old, "1"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and re.search(rf"(unrecognized arguments|ambiguous option): {old}\b", err), (old, err)


def test_readme_flag_table_is_the_rendered_one(flags):
    text = open(os.path.join(ROOT, "eval", "README.md"), encoding="utf-8").read()
    m = re.search(r"<!-- shared-flags -->\n(.*?)\n<!-- /shared-flags -->", text, re.S)
    want = render_table(flags)
    assert m, "eval/README.md has no <!-- shared-flags --> block; add it with:\n" + want
    assert m.group(1) == want, "eval/README.md's shared-flag table differs from the parsers; replace it with:\n" + want


def test_resume_of_a_checkpoint_written_before_batch_size_counted_the_whole_step(tmp_path, capsys):
    """A mod.train checkpoint written when --batch-size was per process and micro-batch (no
    batch_size_unit in its settings) resumes under today's meaning: its batch size reads as
    batch_size x grad_accum x world_size, so the same run spelled today continues and the old
    number is refused by name."""
    import json
    from common import shapes
    from helpers import error_of
    from mod import train as mtrain
    shapes.generate_split(str(tmp_path), "train", 8)
    out = tmp_path / "run"
    argv = ["--model", "tiny-dense", "--data", str(tmp_path / "train.json"), "--out", str(out), "--steps", "2",
            "--grad-accum", "2", "--threads", "1"]
    mtrain.main(argv + ["--batch-size", "4"])
    state = out / "ckpt" / "state.json"
    st = json.loads(state.read_text())
    assert st["settings"]["batch_size"] == 4 and st["settings"]["batch_size_unit"] == "optimizer step"
    del st["settings"]["batch_size_unit"]
    st["settings"]["batch_size"] = 2                      # as the old mod.train wrote it: 2 per micro-batch
    state.write_text(json.dumps(st))
    assert mtrain.main(argv + ["--batch-size", "4", "--resume"])["steps"] == 0
    err = error_of(mtrain.main, argv + ["--batch-size", "2", "--resume"], capsys)
    assert "batch_size: saved 4, now 2" in err
