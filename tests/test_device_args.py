"""`--device` / `--dtype` / `--device-map` (common/cli.py `add_device_args`, `load_kwargs`): one
meaning in every entry point that loads a model, and the values reach the loader."""
import importlib
import re

import pytest
import torch

from common import shapes
from common.cli import add_device_args, entry_parser, load_kwargs
from rolemerge import calibrate

# entry point -> has --device-map (the ones that load a large model for inference)
ENTRY_POINTS = {"mod.data": False, "mod.train": False, "mod.infer": False, "mole.train": False, "mole.infer": False,
                "mole.diagnostics": False, "rolemerge.calibrate": True, "rolemerge.infer": True,
                "eval.evaluate": True, "eval.lm_harness": True}
FLAGS = ("--device", "--dtype", "--device-map")


def flag_help(text):
    """{flag: its help entry, whitespace collapsed} of an argparse --help text, for FLAGS."""
    out = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s+(--[a-z-]+)", line)
        if m and m.group(1) in FLAGS:
            block = [line]
            for nxt in lines[i + 1:]:
                if re.match(r"\s+-", nxt) or not nxt.strip():
                    break
                block.append(nxt)
            out[m.group(1)] = " ".join(" ".join(block).split())
    return out


def help_of(module, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_every_model_loading_entry_point_has_the_device_flags_with_one_meaning(module, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")   # the same line wrapping for every parser
    want_parser = entry_parser("x", "")
    add_device_args(want_parser, device_map=ENTRY_POINTS[module])
    want = flag_help(want_parser.format_help())
    got = flag_help(help_of(module, capsys))
    assert set(want) == ({"--device", "--dtype", "--device-map"} if ENTRY_POINTS[module] else {"--device", "--dtype"})
    assert got == want, module


def test_device_default_and_load_kwargs():
    p = entry_parser("x", "")
    add_device_args(p, device_map=True)
    a = p.parse_args([])
    assert a.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert load_kwargs(a) == {"dtype": None, "device": a.device, "device_map": None}
    a = p.parse_args(["--device", "cuda:1", "--dtype", "bfloat16", "--device-map", "auto"])
    assert load_kwargs(a) == {"dtype": torch.bfloat16, "device": "cuda:1", "device_map": "auto"}
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "float64"])                        # not a choice
    q = entry_parser("x", "")
    add_device_args(q)
    assert load_kwargs(q.parse_args(["--dtype", "float16"]))["device_map"] is None   # no --device-map here


class Loaded(Exception):
    """Raised by the fake loaders: the entry point got as far as loading, with these arguments."""


def fake_loader(*args, **kw):
    raise Loaded(args, kw)


def test_mod_data_passes_device_and_dtype_to_the_loader(tmp_path, monkeypatch):
    from mod import data as mod_data
    shapes.generate_split(str(tmp_path), "train", 2)
    monkeypatch.setattr(mod_data, "load_backbone", fake_loader)
    with pytest.raises(Loaded) as e:
        mod_data.main(["--data", str(tmp_path / "train.json"), "--out", str(tmp_path / "out.json"),
                       "--device", "cuda:3", "--dtype", "bfloat16"])
    args, kw = e.value.args
    assert args == ("tiny-chat",) and kw == {"dtype": torch.bfloat16, "device": "cuda:3", "device_map": None}


def test_rolemerge_infer_passes_device_dtype_and_device_map_to_the_loader(tmp_path, monkeypatch):
    from rolemerge import infer
    shapes.generate_split(str(tmp_path), "test", 2)
    monkeypatch.setattr(calibrate, "load_model", fake_loader)
    with pytest.raises(Loaded) as e:
        infer.main(["--model", "tiny-moe", "--data", str(tmp_path / "test.json"), "--device", "cuda",
                    "--dtype", "float16", "--device-map", "auto"])
    args, kw = e.value.args
    assert args == ("tiny-moe",) and kw == {"dtype": torch.float16, "device": "cuda", "device_map": "auto"}
