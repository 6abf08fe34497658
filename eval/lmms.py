"""lmms-eval models for this repo's methods, and a shapes task in lmms-eval's format.

lmms-eval (EvolvingLMMs-Lab/lmms-eval, the harness most MoE-VLM papers report with) knows
neither a MoD-adapted base nor a MoLE checkpoint. This file adds both as lmms-eval "simple"
models; it is the only file that imports lmms-eval, and only when a model class is first
used (`import eval.lmms` works without lmms-eval installed):

    mod    a base VLM + MoD adapters (mod.train):  pretrained=BASE,adapter=DIR,method=single|multi[,rounds=1]
    mole   a MoLE (or its SFT control) checkpoint (mole.train):  pretrained=CKPT[,base=BASE]

Both take batch_size=N, device=cpu|cuda, dtype=auto|float32|bfloat16 and threads=N too.
A merged RoleMerge checkpoint needs no class of ours: it is a plain transformers
directory (lmms-eval's stock Qwen-VL classes load it; see mod/README.md, "lmms-eval").

    python -m eval.lmms make-task --data out/data/test.json --out out/lmms/tasks   # the shapes task
    python -m eval.lmms --model mod --model_args pretrained=tiny-chat,adapter=out/mod/run,method=single \
        --tasks shapes --include_path out/lmms/tasks --batch_size 64 --output_path out/lmms/results
    python -m eval.lmms --model mole --model_args pretrained=out/mole/mole --tasks shapes,shapes_mc ...

Any arguments but `make-task` go to lmms-eval's own command line after `mod` and `mole` are
registered (lmms-eval 0.7 resolves `--model` through its model registry; a class path is not
accepted there). From Python: `register()`, then `lmms_eval.evaluator.simple_evaluate(model="mod", ...)`.

What a request becomes (lmms-eval 0.7's simple-model interface, `Instance.args`):
  generate_until  (context, gen_kwargs, doc_to_visual, doc_id, task, split): the context is the
                  user turn, doc_to_visual(doc) its images (0 or 1: our models take one image);
                  greedy generation up to gen_kwargs["max_new_tokens"] (default 48, as
                  eval.evaluate), cut at the first of gen_kwargs["until"]. MoD wraps the context
                  in its JSON / debate prompts (mod.infer: single = Alg. 2 round 0, multi = +rounds).
  loglikelihood   (context, continuation, doc_to_visual, doc_id, task, split): the continuation
                  is scored as the start of the assistant turn. Returned as (negative summed
                  log-probability, is_greedy): lmms-eval 0.7's multiple_choice picks the option
                  with the *smallest* value (its LLaVA classes return a loss), not the largest
                  log-likelihood that its base-class docstring describes. lmms-eval 0.7.3 also
                  turns a returned (float, bool) pair into a string (unwrap_generation_output,
                  meant for generations): the pair goes back wrapped in its GenerationResult.
Sampling (temperature > 0) is refused: every score in this repo is greedy.
"""
import importlib.util
import json
import os
import sys

import torch
from PIL import Image
from tqdm import tqdm

from common.backbone import generate, load_backbone
from common.cli import add_limit, entry_parser, fail, run_cli, set_threads
from common.data import IMAGE_ROOT_HELP, SKIP_BAD_HELP, atomic_write_text, load_image, read_any
from eval.evaluate import options_of
from eval.metrics import extract, gold_list, is_correct, option_letters
from mod.model import load_adapters
from mod.prompts import debate_prompt, single_prompt
from mole.checkpoint import load_mole, recorded_base
from mole.infer import generate as mole_generate
from mole.model import MoLE as _Net
# deferred: lmms_eval (optional, not in requirements.txt: `import eval.lmms` works without it; the model
# classes and the command line need it)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"mod": "MoD", "mole": "MoLE"}  # lmms-eval model id -> class name in this module
DEFAULT_MAX_NEW_TOKENS = 48              # eval.evaluate's default generation budget


# ----------------------------------------------------------------------------- the task (no lmms-eval needed)

def record_to_doc(record):
    """One lmms-eval document (a flat JSON object) of a record from `common.data.read_any`:
    {"id", "image" (absolute path, "" for a text-only record), "question", "answers" (list of
    acceptable answers), "target" (the first), "family", "options" ([[letter, text], ...], []
    unless multiple choice: the record's own or the lettered options in its question, as
    `eval.evaluate.options_of` reads them), "gold" (index of the gold option, -1 without)}.
    Raises ValueError for a record with several images or several turns (the shapes task, and
    our model classes, take one image and one question per document)."""
    if len(record.get("images") or []) > 1 or record.get("history"):
        raise ValueError(f"record {record['id']}: several images or turns; the lmms-eval task takes one image "
                         f"and one question per record")
    opts = [[L, t] for L, t in options_of(record)]
    golds = gold_list(record["answer"])
    gold = -1
    if opts:
        letters = option_letters(opts, golds)
        g = extract(golds[0], "letter", letters, opts)
        gold = next((i for i, (L, _) in enumerate(opts) if L == g), -1)
    return {"id": str(record["id"]), "image": os.path.abspath(record["image"]) if record.get("image") else "",
            "question": record["question"], "answers": golds, "target": golds[0],
            "family": record.get("family") or "all", "options": opts, "gold": gold}


def doc_to_visual(doc):
    """The document's images as RGB PIL images ([] for a text-only one), read by
    `common.data.load_image`, the loader of every entry point (EXIF, 16-bit, alpha)."""
    return [load_image(doc["image"], doc["id"])] if doc["image"] else []


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    """The user turn: the question as eval.evaluate asks it (options already in its text)."""
    return doc["question"]


def doc_to_target(doc):
    """Generation tasks: the first gold answer; multiple choice: the gold option's index."""
    return doc["gold"] if doc["options"] else doc["target"]


def doc_to_choice(doc):
    """The option letters of a multiple-choice document (continuations scored after "")."""
    return [L for L, _ in doc["options"]]


def process_results(doc, results):
    """{"accuracy": 1.0 or 0.0}: the generated text scored by `eval.metrics.is_correct`, the
    scorer of eval.evaluate (answer-type aware, any acceptable answer, the record's options)."""
    opts = [tuple(o) for o in doc["options"]] or None
    return {"accuracy": float(is_correct(results[0], doc["answers"], doc["family"], opts))}


def _yaml(task, data_file, output_type, max_new_tokens):
    """Task YAML text (strings written as JSON, which YAML reads as they are)."""
    q = json.dumps
    lines = [f"task: {q(task)}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
             f"    test: {q(os.path.abspath(data_file))}", "test_split: test", f"output_type: {output_type}",
             "doc_to_visual: !function utils.doc_to_visual", "doc_to_text: !function utils.doc_to_text",
             "doc_to_target: !function utils.doc_to_target"]
    if output_type == "generate_until":
        lines += ["generation_kwargs:", f"  max_new_tokens: {int(max_new_tokens)}", "  temperature: 0",
                  "  do_sample: false", "  until: []", "process_results: !function utils.process_results",
                  "metric_list:", "  - metric: accuracy", "    aggregation: mean", "    higher_is_better: true"]
    else:
        lines += ["doc_to_choice: !function utils.doc_to_choice", 'target_delimiter: ""', "metric_list:",
                  "  - metric: acc", "    aggregation: mean", "    higher_is_better: true"]
    return "\n".join(lines + ["metadata:", "  version: 0"]) + "\n"


UTILS = f'''"""Task functions of the shapes lmms-eval task: the ones of eval/lmms.py in this repo."""
import sys
if {REPO!r} not in sys.path:
    sys.path.insert(0, {REPO!r})
from eval.lmms import doc_to_choice, doc_to_target, doc_to_text, doc_to_visual, process_results  # noqa: E402,F401
'''


def build_task(records, out_dir, name="shapes", max_new_tokens=DEFAULT_MAX_NEW_TOKENS, overwrite=False):
    """Write an lmms-eval task folder for `records` (from `common.data.read_any`):
        OUT/NAME.jsonl + NAME.yaml       generate_until on every record, metric "accuracy"
        OUT/NAME_mc.jsonl + NAME_mc.yaml multiple_choice (option log-likelihood, metric "acc")
                                         on the records with options, if any
        OUT/utils.py                     the task functions (this module's; adds this repo to sys.path)
    Run it with `--tasks NAME[,NAME_mc] --include_path OUT`. Returns {task name: [doc ids]}.
    Raises FileExistsError if a file would be replaced without `overwrite`, ValueError for a
    record the task cannot hold (`record_to_doc`) or no records."""
    if not records:
        raise ValueError("no records to build a task from")
    docs = [record_to_doc(r) for r in records]
    sets = {name: docs}
    mc = [d for d in docs if d["options"]]
    if mc:
        sets[f"{name}_mc"] = mc
    files = {}
    for task, ds in sets.items():
        data = os.path.join(out_dir, f"{task}.jsonl")
        files[data] = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in ds)
        kind = "multiple_choice" if task.endswith("_mc") and task != name else "generate_until"
        files[os.path.join(out_dir, f"{task}.yaml")] = _yaml(task, data, kind, max_new_tokens)
    files[os.path.join(out_dir, "utils.py")] = UTILS
    clash = [p for p in files if os.path.exists(p)] if not overwrite else []
    if clash:
        raise FileExistsError(f"{clash[0]} exists; pass overwrite=True (--overwrite) to replace the task files")
    os.makedirs(out_dir, exist_ok=True)
    for p, text in files.items():
        atomic_write_text(p, text)
    return {task: [d["id"] for d in ds] for task, ds in sets.items()}


# ----------------------------------------------------------------------------- scoring helpers (torch only)

def cut_at(text, until):
    """`text` up to the first occurrence of any stop string in `until` (str, list or None)."""
    stops = [until] if isinstance(until, str) else list(until or [])
    cuts = [text.index(s) for s in stops if s and s in text]
    return text[:min(cuts)] if cuts else text


def greedy_budget(gen_kwargs):
    """max_new_tokens of lmms-eval generation kwargs (default 48). Raises ValueError for
    sampling (temperature > 0, do_sample, several beams): our scores are greedy."""
    g = dict(gen_kwargs or {})
    if float(g.get("temperature") or 0) > 0 or g.get("do_sample") in (True, "true", "True") \
            or int(g.get("num_beams") or 1) > 1:
        raise ValueError(f"only greedy decoding is supported (got {g}); set temperature: 0, do_sample: false, "
                         f"num_beams: 1 in the task's generation_kwargs")
    return int(g.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)


def _one_image(visuals, where):
    """The single image of a request (None for none). Raises ValueError for several, or for
    something that is not an image (video paths, audio)."""
    vs = [v for v in (visuals or []) if v is not None]
    if len(vs) > 1:
        raise ValueError(f"{where}: {len(vs)} images in one request; these models take one image per question")
    if vs and not isinstance(vs[0], Image.Image):
        raise ValueError(f"{where}: visual of type {type(vs[0]).__name__} is not an image (videos/audio unsupported)")
    return vs[0].convert("RGB") if vs else None


def loglik_plain(model, proc, rows, batch_size=32):
    """Summed log-probability of each continuation after its context, teacher-forced.

    rows: [(image or None, context, continuation)]; the context is the user turn
    (`VLProcessor.prompt_ids`) and the continuation the start of the assistant turn
    (`VLProcessor.text_ids`, tokenized separately as lm-eval-harness does). Right padding,
    one forward per batch:  logp = sum_t log softmax(logits[t-1])[ids[t]] over the
    continuation positions t;  greedy = every continuation token is the argmax there.
    Returns [(logp, greedy)] in order. Raises ValueError for an empty continuation."""
    out = []
    dev = model.device
    for s in range(0, len(rows), batch_size):
        chunk = rows[s:s + batch_size]
        imgs = [im for im, _, _ in chunk if im is not None]
        vis, counts = proc.vision(imgs) if imgs else ({}, [])
        counts = iter(counts)
        n_img = [next(counts) if im is not None else 0 for im, _, _ in chunk]
        ids, conts = [], []
        for (im, ctx, cont), n in zip(chunk, n_img):
            c = proc.text_ids(cont)
            if not c:
                raise ValueError(f"empty continuation {cont!r} after context {ctx[:60]!r}")
            ids.append(proc.prompt_ids(ctx, n) + c)
            conts.append(len(c))
        batch = proc.pad(ids, "right", vis)
        input_ids = batch["input_ids"]
        with torch.no_grad():
            logits = model(**{k: v.to(dev) for k, v in batch.items()}).logits.float()
        for row, (x, n) in enumerate(zip(ids, conts)):
            pos = torch.arange(len(x) - n, len(x), device=logits.device)  # continuation positions t
            tgt = input_ids[row, len(x) - n:len(x)].to(logits.device)
            lp = torch.log_softmax(logits[row, pos - 1], -1)               # token t predicted at t-1
            out.append((float(lp.gather(-1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all())))
    return out


def loglik_mole(mole, rows, stage, batch_size=32):
    """`loglik_plain` through MoLE's path (latent tokens between the question and the
    assistant header, routing, ESVA, the stage's attention topology): one teacher-forced
    `MoLE.forward` per batch over image + question + Z_vis + Z_sum + header + continuation.
    rows: [(image, context, continuation)], an image in every row. Returns [(logp, greedy)]."""
    out = []
    for s in range(0, len(rows), batch_size):
        chunk = rows[s:s + batch_size]
        if any(im is None for im, _, _ in chunk):
            raise ValueError("MoLE needs one image per request (its latent experts read visual tokens)")
        batch = mole.encode([im for im, _, _ in chunk], [c for _, c, _ in chunk], answers=[a for _, _, a in chunk])
        batch = {k: v.to(mole.model.device) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = mole(batch, stage)["logits"].float()
        for row in range(len(chunk)):
            pos = (labels[row] != -100).nonzero().flatten()[:-1]  # the continuation: drop the appended <|im_end|>
            if len(pos) == 0:
                raise ValueError(f"empty continuation {chunk[row][2]!r}")
            tgt = labels[row, pos]
            lp = torch.log_softmax(logits[row, pos - 1], -1)
            out.append((float(lp.gather(-1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all())))
    return out


# ----------------------------------------------------------------------------- the model classes (lmms-eval inside)

def _make_classes():
    """Define MoD and MoLE as subclasses of lmms-eval's `lmms` (imports lmms-eval)."""
    # lmms-eval 0.7.3 passes every response through unwrap_generation_output, which turns a
    # loglikelihood pair (float, bool) into its str(); a GenerationResult's .text passes unchanged
    from lmms_eval.api.instance import GenerationResult, unwrap_generation_output
    from lmms_eval.api.model import lmms
    mangled = not isinstance(unwrap_generation_output((-1.0, True))[0], tuple)

    def _ll_result(pair):
        return GenerationResult(text=pair) if mangled else pair

    class _Ours(lmms):
        """Shared request plumbing; subclasses set self.model / self.proc and implement
        `_generate(images, questions, max_new_tokens)` and `_loglik(rows)`."""
        is_simple = True  # lmms-eval "simple" model: doc_to_visual + a text context per request

        def __init__(self, batch_size=16, device=None, dtype="auto", threads=None, model_name=None):
            super().__init__()
            self.batch_size_per_gpu = int(batch_size)
            self._device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.dtype = None if dtype in (None, "auto") else getattr(torch, dtype)
            set_threads(None if threads in (None, "") else int(threads), model_name)

        @property
        def batch_size(self):
            return self.batch_size_per_gpu

        @property
        def device(self):
            return self._device

        def _visual(self, req):
            ctx, _, doc_to_visual, doc_id, task, split = req.args[:6]
            return _one_image(doc_to_visual(self.task_dict[task][split][doc_id]), f"{task} doc {doc_id}")

        def generate_until(self, requests):
            """Greedy answers, in request order, batched `batch_size` at a time within runs
            of requests that share generation kwargs."""
            res = [None] * len(requests)
            groups = {}
            for i, req in enumerate(requests):
                groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
            bar = tqdm(total=len(requests), desc="generate", disable=self.rank != 0)
            for idx in groups.values():
                kw = requests[idx[0]].args[1]
                budget = greedy_budget(kw)
                for s in range(0, len(idx), self.batch_size):
                    part = idx[s:s + self.batch_size]
                    texts = self._generate([self._visual(requests[i]) for i in part],
                                           [requests[i].args[0] for i in part], budget)
                    for i, t in zip(part, texts):
                        res[i] = cut_at(t, kw.get("until"))
                    bar.update(len(part))
            bar.close()
            return res

        def loglikelihood(self, requests):
            """[(-sum log p(continuation | context, image), is_greedy)] in request order (see
            the module docstring for the sign)."""
            rows = [(self._visual(r), r.args[0], r.args[1]) for r in requests]
            return [_ll_result((-lp, greedy)) for lp, greedy in self._loglik(rows)]

        def generate_until_multi_round(self, requests):
            raise NotImplementedError("multi-round tasks are not supported; MoD's debate rounds are method=multi")

    class MoD(_Ours):
        """A base VLM with MoD adapters (mod.train), answering as mod.infer does:
        method=single (MoD-Single, one round with the JSON instruction) or method=multi
        (MoD-Multi, `rounds` debate rounds over its own earlier answers, Alg. 2).
        model_args: pretrained (base: checkpoint dir or tiny-chat / tiny-dense), adapter
        (dir from mod.train), method, rounds (default 1), batch_size, device, dtype, threads."""

        def __init__(self, pretrained="tiny-chat", adapter="", method="single", rounds=1, batch_size=16,
                     device=None, dtype="auto", threads=None, trust_remote_code=False, **kwargs):
            if kwargs:
                raise ValueError(f"mod: unknown model_args {sorted(kwargs)}; known: pretrained, adapter, method, "
                                 f"rounds, batch_size, device, dtype, threads, trust_remote_code")
            if method not in ("single", "multi"):
                raise ValueError(f"mod: method must be single or multi, got {method!r}")
            if not adapter:
                raise ValueError("mod: needs adapter=DIR (an adapter directory written by mod.train)")
            super().__init__(batch_size, device, dtype, threads, pretrained)
            self.model, self.proc = load_backbone(pretrained, dtype=self.dtype, device=self.device,
                                                  trust_remote_code=str(trust_remote_code).lower() == "true")
            load_adapters(self.model, adapter)  # refuses adapters trained on another base
            self.model.eval()
            self.method, self.rounds = method, int(rounds) if method == "multi" else 0

        def _generate(self, images, questions, max_new_tokens):
            hist = [[] for _ in questions]
            for k in range(self.rounds + 1):  # round 0: single prompt; round k: debate over rounds < k
                prompts = [single_prompt(q) if k == 0 else debate_prompt(q, h) for q, h in zip(questions, hist)]
                texts, _ = generate(self.model, self.proc, images, prompts, max_new_tokens)
                for h, t in zip(hist, texts):
                    h.append(t)
            return [h[-1] for h in hist]

        def _loglik(self, rows):
            return loglik_plain(self.model, self.proc, rows, self.batch_size)

    class MoLE(_Ours):
        """A MoLE checkpoint (mole.train), answering as mole.infer does (latent prefix, the
        checkpoint's inference stage, KV cache). An SFT-control checkpoint answers as the
        plain VLM. model_args: pretrained (the checkpoint dir), base (another copy of its
        base VLM; default the one it records), batch_size, device, threads."""

        def __init__(self, pretrained="", base=None, batch_size=16, device=None, threads=None, dtype="auto",
                     **kwargs):
            if kwargs:
                raise ValueError(f"mole: unknown model_args {sorted(kwargs)}; known: pretrained, base, batch_size, "
                                 f"device, threads")
            if not pretrained:
                raise ValueError("mole: needs pretrained=CKPT (a checkpoint directory written by mole.train)")
            if dtype not in (None, "auto"):
                raise ValueError("mole: dtype is set by the checkpoint (its base's own dtype); leave it out")
            super().__init__(batch_size, device, "auto", threads, base or recorded_base(pretrained))
            self.net, self.proc, self.stage = load_mole(pretrained, device=self.device, base=base)
            self.is_mole = isinstance(self.net, _Net)

        def _generate(self, images, questions, max_new_tokens):
            if self.is_mole:
                if any(im is None for im in images):
                    raise ValueError("mole: every request needs one image (its latent experts read visual tokens)")
                return mole_generate(self.net, images, questions, stage=self.stage, max_new_tokens=max_new_tokens)[0]
            return generate(self.net, self.proc, images, questions, max_new_tokens)[0]

        def _loglik(self, rows):
            if self.is_mole:
                return loglik_mole(self.net, rows, self.stage, self.batch_size)
            return loglik_plain(self.net, self.proc, rows, self.batch_size)

    return {"MoD": MoD, "MoLE": MoLE}


_CLASSES = {}
INSTALL = 'install it in its own venv: pip install lmms-eval==0.7.3 "filelock<4" (mod/README.md, "lmms-eval")'


def __getattr__(name):
    """`eval.lmms.MoD` / `eval.lmms.MoLE`: built (and lmms-eval imported) on first access."""
    if name in MODELS.values():
        if not _CLASSES:
            try:
                _CLASSES.update(_make_classes())
            except ImportError as e:
                raise ImportError(f"eval.lmms.{name} needs lmms-eval ({e}); {INSTALL}") from e
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register():
    """Register `mod` and `mole` in lmms-eval's model registry (0.7: `MODEL_REGISTRY_V2`),
    so that `--model mod` / `simple_evaluate(model="mole")` find them. Imports lmms-eval."""
    from lmms_eval.models import MODEL_REGISTRY_V2
    from lmms_eval.models.registry_v2 import ModelManifest
    for model_id, cls in MODELS.items():
        MODEL_REGISTRY_V2.register_manifest(ModelManifest(model_id=model_id, simple_class_path=f"eval.lmms.{cls}"),
                                            overwrite=True)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["make-task"]:
        p = entry_parser("eval.lmms make-task", "Write an lmms-eval task folder (YAML + JSONL + utils.py) from a "
                                                "benchmark file of ours (LLaVA JSON or canonical JSONL).")
        p.add_argument("--data", required=True, help="benchmark file (e.g. out/data/test.json)")
        p.add_argument("--image-root", default=None, help=IMAGE_ROOT_HELP)
        p.add_argument("--out", required=True, help="task folder (pass it to lmms-eval as --include_path)")
        p.add_argument("--name", default="shapes", help="task name (NAME and NAME_mc)")
        add_limit(p)
        p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="generation budget")
        p.add_argument("--overwrite", action="store_true", help="replace existing task files")
        p.add_argument("--skip-bad", action="store_true", help=SKIP_BAD_HELP)
        a = p.parse_args(argv[1:])

        def run():
            made = build_task(read_any(a.data, a.image_root, skip_bad=a.skip_bad, limit=a.limit), a.out, a.name, a.max_new_tokens, a.overwrite)
            for task, ids in made.items():
                print(f"{task}: {len(ids)} documents")
            print(f"wrote {a.out}: run with --tasks {','.join(made)} --include_path {a.out}")
        return run_cli(run)  # bad data, existing task files: error: ..., exit 2
    if importlib.util.find_spec("lmms_eval") is None:
        fail(f"python -m eval.lmms runs lmms-eval, which is not installed here; {INSTALL}")
    register()
    from lmms_eval.__main__ import cli_evaluate
    sys.argv = ["lmms-eval"] + argv
    return cli_evaluate()


if __name__ == "__main__":
    main()
