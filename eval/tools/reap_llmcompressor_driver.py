"""llmcompressor's REAP on a saved model: the half of `eval.tools.bench_reap_llmcompressor` that runs in
the bench's own venv (llmcompressor 0.14.0.1 and the transformers it pins). Imports nothing from
this repository. Not a test; started by the bench as

    <venv>/bin/python eval/tools/reap_llmcompressor_driver.py SPEC.json

SPEC: {"model": dir, "calib": safetensors file (input_ids.{i}, attention_mask.{i} [B, L]),
"keep": [K, ...], "runs": {name: {"pipeline": null | "basic" | "sequential", "unpadded": bool}},
"out": json path, "threads": int}. For every run and K it loads the model afresh (float32), calls
`llmcompressor.oneshot` with `REAPPruningModifier(sparsity=(N - K) / N)` and everything else at
its defaults, and writes {run: {K: {layer: {"kept": [...], "saliency": [N], "count": [N]}}}}.
`unpadded`: every sequence becomes its own batch with the padding cut off (so llmcompressor sees
exactly the non-padding tokens). The saliency is read from the modifier's tracker just before it
prunes each layer (a wrapper around `on_sequential_epoch_end`; the modifier is not changed).
"""
import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

# deferred: llmcompressor (optional: installed only in the bench's own venv, so this file imports without it)


def main(spec_path):
    import llmcompressor
    from llmcompressor import oneshot
    from llmcompressor.modifiers.pruning.reap import REAPPruningModifier
    spec = json.load(open(spec_path))
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
    torch.set_num_threads(spec["threads"])

    seen = {}                                   # layer name -> saliency / count before its pruning
    original = REAPPruningModifier.on_sequential_epoch_end

    def recording(self, state, event, **kw):
        for name, tracker in self._saliency_trackers.items():
            if tracker.total_count > 0:
                seen[name] = {"saliency": tracker.mean_saliency.tolist(),
                              "count": tracker.count.to("cpu", torch.float64).tolist()}
        return original(self, state, event, **kw)
    REAPPruningModifier.on_sequential_epoch_end = recording

    calib = load_file(spec["calib"])
    padded = [{"input_ids": calib[f"input_ids.{i}"], "attention_mask": calib[f"attention_mask.{i}"]}
              for i in range(len(calib) // 2)]
    unpadded = [{"input_ids": b["input_ids"][r][m.bool()][None], "attention_mask": m[m.bool()][None]}
                for b in padded for r, m in enumerate(b["attention_mask"])]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    out = {"versions": {"llmcompressor": llmcompressor.__version__, "torch": torch.__version__,
                        "transformers": transformers.__version__}, "runs": {}}
    for run, cfg in spec["runs"].items():
        out["runs"][run] = {}
        for K in spec["keep"]:
            model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
            N = model.config.num_experts
            sparsity = (N - K) / N
            if int(N * sparsity) != N - K:       # the modifier drops int(N * sparsity) experts
                sparsity = (N - K + 1e-6) / N
            report = os.path.join(os.path.dirname(spec["out"]), f"llmc_{run}_K{K}.json")
            seen.clear()
            kw = {} if cfg["pipeline"] is None else {"pipeline": cfg["pipeline"]}
            # batch_size=None: the DataLoader yields our prepared batches unchanged
            oneshot(model=model, processor=tok, recipe=REAPPruningModifier(sparsity=sparsity, report_path=report),
                    dataset=DataLoader(unpadded if cfg["unpadded"] else padded, batch_size=None), **kw)
            kept = json.load(open(report))
            out["runs"][run][str(K)] = {name: {"kept": kept[name], **seen[name]} for name in sorted(kept)}
            print(f"llmcompressor {run} K={K}: kept {[len(v) for v in kept.values()]} per layer", flush=True)
    tmp = spec["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, spec["out"])


if __name__ == "__main__":
    main(sys.argv[1])
