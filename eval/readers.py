"""Benchmark readers, re-exported from `common.data` where they live (every entry point, the
method folders included, reads data through them, and `common/` imports nothing from `eval/`).

Two on-disk formats, both giving the record dicts described in `common.data` and in the
README ("Records"):

  canonical JSONL (one record per line, images in a folder next to it or under --image-root):
      {"id": "q1", "image": "images/q1.png", "question": "Is there a dog?", "answer": "yes",
       "family": "existence",                      # optional, default "unlabelled"
       "options": ["cat", "dog", "cow", "pig"]}    # optional, multiple choice
  LLaVA conversation JSON/JSONL (`read_llava_json`), what `common.data` writes.

`read_any` picks the reader from the file's content.
"""
from common.data import REQUIRED, parse_options, read_any, read_jsonl, read_llava_json
