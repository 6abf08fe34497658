"""Predictions kept per batch and `--resume` (common.predictions, every inference entry point).

A stopped long run used to lose every prediction: eval.evaluate wrote its results only at the
end. Now each finished batch is a line of OUT.partial, and the same command with --resume
computes only the missing batches. Each entry point is stopped by SIGINT after its first batch
is on disk and resumed: the predictions equal an uninterrupted run's, byte for byte."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from common import shapes as world
from common.cli import Interrupted, RunError
from common.predictions import PredictionLog, fingerprint, model_digest, rng_state, set_rng_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECS = [{"id": f"r{i}", "question": f"q{i}", "answer": "a", "images": []} for i in range(5)]


def _batches(calls):
    def fn(i):
        calls.append(i)
        return [{"i": i, "x": 0.1 * i}]
    return fn


# ----------------------------------------------------------------------------- the log

def test_finished_batches_are_on_disk_and_a_resume_computes_only_the_rest(tmp_path):
    out = str(tmp_path / "r.json")
    fp = fingerprint(RECS, batch_size=2)
    calls = []
    with pytest.raises(RuntimeError):
        with PredictionLog(out, fp) as log:
            log.run("generate", 5, lambda i: _batches(calls)(i) if i < 3 else (_ for _ in ()).throw(RuntimeError))
    lines = open(out + ".partial").read().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["fingerprint"] == fp        # header + batches 0, 1, 2
    assert [json.loads(x)["batch"] for x in lines[1:]] == [0, 1, 2]
    with open(out + ".partial", "a") as f:
        f.write('{"phase": "generate", "batch": 3, "sec')                      # killed mid-write: a torn line
    calls2 = []
    with PredictionLog(out, fp, resume=True) as log:
        got = log.run("generate", 5, _batches(calls2))
        assert log.seconds("generate") >= 0
    assert calls2 == [3, 4]                                                     # the torn batch is redone
    assert got == [{"i": i, "x": 0.1 * i} for i in range(5)]
    with PredictionLog(out, fp, resume=True) as log:                            # the torn bytes were cut off
        assert [b["batch"] for b in log.stored("generate")] == [0, 1, 2, 3, 4]
        log.finish()
    assert not os.path.exists(out + ".partial")


def test_refusals_before_anything_runs(tmp_path):
    out = str(tmp_path / "r.json")
    fp = fingerprint(RECS, batch_size=2, max_new_tokens=8)
    with pytest.raises(RunError, match="--resume needs --out"):
        PredictionLog(None, fp, resume=True)
    with pytest.raises(RuntimeError):                 # a run that fails before its first batch (a wrong --model)
        with PredictionLog(out, fp):
            raise RuntimeError
    assert not os.path.exists(out + ".partial")       # leaves nothing a rerun would have to --resume
    with pytest.raises(RunError, match=r"no interrupted run to continue .*r.json.partial does not exist; no run"):
        PredictionLog(out, fp, resume=True)
    with PredictionLog(out, fp) as log:
        log.run("generate", 1, _batches([]))
    with pytest.raises(RunError, match=r"holds an interrupted run \(1 finished batch\(es\)\); pass --resume"):
        PredictionLog(out, fp)                                                  # never overwritten silently
    for other, what in ((fingerprint(RECS, batch_size=4, max_new_tokens=8), "batch_size: saved 2, now 4"),
                        (fingerprint(RECS[:4], batch_size=2, max_new_tokens=8), "data: saved '5 records"),
                        (fingerprint([dict(RECS[0], answer="b")] + RECS[1:], batch_size=2, max_new_tokens=8),
                         "data: saved '5 records, sha1"),
                        (fingerprint(RECS, batch_size=2, max_new_tokens=8, model="m"), "model: only in one")):
        with pytest.raises(RunError, match=rf"--resume: .*r.json.partial was written with other settings \({what}"):
            PredictionLog(out, other, resume=True)


def test_a_signal_stops_after_the_batch_it_arrives_in(tmp_path):
    """SIGINT during batch 1 lets batch 1 finish and be kept, then stops: exit 130 via Interrupted."""
    out = str(tmp_path / "r.json")
    fp = fingerprint(RECS)
    calls = []

    def fn(i):
        calls.append(i)
        if i == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return [i]
    with pytest.raises(Interrupted, match=r"interrupted after batch 2 of 5 of generate \(SIGINT\).*--resume") as e:
        with PredictionLog(out, fp) as log:
            log.run("generate", 5, fn)
    assert e.value.signum == signal.SIGINT and calls == [0, 1]
    with PredictionLog(out, fp, resume=True) as log:
        assert log.run("generate", 5, fn) == [0, 1, 2, 3, 4] and calls == [0, 1, 2, 3, 4]


def test_resume_on_other_weights_is_refused(tmp_path):
    """The same checkpoint path with a retrained shard, or with a file added, is another model."""
    out = str(tmp_path / "r.json")
    m = {"model.safetensors": "aaa", "config.json": "ccc"}
    with PredictionLog(out, fingerprint(RECS, model=m)) as log:
        log.run("generate", 1, _batches([]))
    for other, what in (({**m, "model.safetensors": "bbb"}, "model: model.safetensors differ"),
                        ({**m, "model-2.safetensors": "ddd"}, "model: model-2.safetensors differ")):
        with pytest.raises(RunError, match=rf"other settings \({what}\)"):
            PredictionLog(out, fingerprint(RECS, model=other), resume=True)


def test_model_digest_tells_retrained_weights_apart(tmp_path):
    src = os.path.join(REPO, "common", "tiny", "dense")
    a = tmp_path / "a"
    shutil.copytree(src, a)
    assert model_digest(str(a)) == model_digest("tiny-dense")                  # a copy is the same model
    with open(a / "model.safetensors", "r+b") as f:                              # one byte of the last tensor
        f.seek(-3, 2)
        b = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([b[0] ^ 1]))
    assert model_digest(str(a)) != model_digest("tiny-dense")
    assert model_digest("org/hub-id") == "org/hub-id" and model_digest("") is None


def test_rng_state_round_trip():
    import torch
    torch.manual_seed(3)
    s = json.loads(json.dumps(rng_state()))
    x = torch.rand(4)
    set_rng_state(s)
    assert torch.equal(torch.rand(4), x)


# ----------------------------------------------------------------------------- every entry point

@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    world.generate_split(str(d), "test", 6)
    return d


def _interrupt_and_resume(entry, argv, out, main, tmp_path, min_lines=2):
    """Run `python -m entry argv --out out` in a subprocess, SIGINT it once the first batch is
    on disk (OUT.partial has a batch line), expect exit 130 and fewer batches than a full
    run; then `main(argv + --out out --resume)` in this process. Returns the resumed run's
    --out text and the number of batches the stopped run had kept."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", entry, *argv, "--out", out, "--threads", "1"], cwd=REPO, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    partial = out + ".partial"
    t = time.time()
    while p.poll() is None and time.time() - t < 300:
        if os.path.exists(partial) and open(partial).read().count("\n") >= min_lines:
            p.send_signal(signal.SIGINT)
            break
        time.sleep(0.01)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err
    assert "continue with the same command and --resume" in err and "Traceback" not in err
    kept = open(partial).read().count("\n") - 1
    main(argv + ["--out", out, "--threads", "1", "--resume"])
    assert not os.path.exists(partial)
    with open(out) as f:
        return f.read(), kept


def _same(a, b, drop):
    """Two JSON outputs equal byte for byte once the wall-clock fields `drop` are removed."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in drop}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return json.dumps(strip(json.loads(a)), indent=1) == json.dumps(strip(json.loads(b)), indent=1)


def test_evaluate_resumes_to_the_uninterrupted_predictions(shapes, tmp_path):
    from eval.evaluate import main
    argv = ["--model", "tiny-dense", "--data", str(shapes / "test.json"), "--batch-size", "1",
            "--max-new-tokens", "24"]
    main(argv + ["--out", str(tmp_path / "ref.json"), "--threads", "1"])
    ref = (tmp_path / "ref.json").read_text()
    got, kept = _interrupt_and_resume("eval.evaluate", argv, str(tmp_path / "r.json"), main, tmp_path)
    assert 1 <= kept < 6 + 2                                     # 6 generation + 2 option batches
    assert _same(got, ref, {"wall_s"}) and json.loads(got)["results"] == json.loads(ref)["results"]


def test_mod_infer_resumes_sampled_debate_to_the_same_draws(shapes, tmp_path):
    """MAD samples: the random state after each batch is kept, so the resumed draws are the
    uninterrupted run's (without it the texts after the stop differ)."""
    from mod.infer import main
    argv = ["--model", "tiny-chat", "--data", str(shapes / "test.json"), "--methods", "mad", "--mad", "du", "--rounds", "1",
            "--batch-size", "2", "--max-new-tokens", "6", "--limit", "4"]
    main(argv + ["--out", str(tmp_path / "ref.json"), "--threads", "1"])
    ref = (tmp_path / "ref.json").read_text()
    got, kept = _interrupt_and_resume("mod.infer", argv, str(tmp_path / "r.json"), main, tmp_path)
    assert 1 <= kept < 5 * 2                                     # 5 calls (2 answers, 2 debate, judge) x 2 batches
    assert _same(got, ref, {"wall_s"})


def test_rolemerge_infer_resumes_to_the_uninterrupted_predictions(shapes, tmp_path):
    from rolemerge.infer import main
    argv = ["--model", "tiny-moe", "--data", str(shapes / "test.json"), "--batch-size", "1", "--max-new-tokens", "24"]
    main(argv + ["--out", str(tmp_path / "ref.json"), "--threads", "1"])
    ref = (tmp_path / "ref.json").read_text()
    got, kept = _interrupt_and_resume("rolemerge.infer", argv, str(tmp_path / "r.json"), main, tmp_path)
    assert 1 <= kept < 6
    assert _same(got, ref, {"load_s"}) and json.loads(got)["predictions"] == json.loads(ref)["predictions"]


def test_mole_infer_resumes_to_the_uninterrupted_predictions(shapes, tmp_path):
    import mole.train as mt
    from mole.infer import main
    world.generate_split(str(tmp_path / "tr"), "train", 4)
    ckpt = tmp_path / "mole"
    mt.main(["--data", str(tmp_path / "tr"), "--out", str(ckpt), "--batch-size", "2", "--stage1-epochs", "0.5",
             "--stage2-epochs", "0.5", "--quiet", "--device", "cpu", "--threads", "1"])
    argv = ["--ckpt", str(ckpt), "--data", str(shapes / "test.json"), "--batch-size", "1", "--max-new-tokens", "24",
            "--intervention", "random"]
    main(argv + ["--out", str(tmp_path / "ref.json"), "--threads", "1"])
    ref = (tmp_path / "ref.json").read_text()
    got, kept = _interrupt_and_resume("mole.infer", argv, str(tmp_path / "r.json"), main, tmp_path)
    assert 1 <= kept < 6
    assert got == ref                                            # no clock in mole.infer's output: every byte


def test_sampled_rounds_resume_the_random_stream(shapes, tmp_path, monkeypatch):
    """mod.infer.run_rounds with two sampled calls at temperature 5 (draws far from greedy):
    a run stopped after 3 batches and resumed gives the uninterrupted run's texts. Without
    restoring the random state kept with the last finished batch the resumed draws differ."""
    import torch
    from common import backbone as bb
    from common.data import read_records
    from mod import infer
    model, proc = bb.load_backbone("tiny-chat")
    recs = read_records(str(shapes / "test.json"))[:4]
    fns = [lambda r, h: r["question"], lambda r, h: r["question"] + " " + h[0]]
    kw = [{"do_sample": True, "temperature": 5.0}] * 2

    def rounds(out, resume=False):
        torch.manual_seed(0)
        with PredictionLog(str(out), fingerprint(recs), resume) as log:
            return infer.run_rounds(model, proc, recs, fns, batch_size=2, max_new_tokens=4, sample_kw=kw, log=log)
    ref = rounds(tmp_path / "a.json")
    real, n = infer._generate, [0]

    def failing(*a, **k):
        n[0] += 1
        if n[0] == 4:
            raise RuntimeError("stopped")
        return real(*a, **k)
    monkeypatch.setattr(infer, "_generate", failing)
    with pytest.raises(RuntimeError):
        rounds(tmp_path / "b.json")
    monkeypatch.setattr(infer, "_generate", real)
    assert open(tmp_path / "b.json.partial").read().count("\n") == 4       # header + 3 batches
    assert rounds(tmp_path / "b.json", resume=True) == ref
