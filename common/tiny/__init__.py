"""The committed tiny bases: the names `--model` accepts for them and their folders.

tiny-dense / tiny-moe: a dense Qwen3-VL and a Qwen3-VL-MoE pretrained on the shapes world by
`eval/tools/pretrain.py`; tiny-chat: tiny-dense continued on the single-JSON and debate prompt
formats (mod/README.md). moe32 is the 32-expert base of RoleMerge's toy."""
import os

TINY_DIR = os.path.dirname(os.path.abspath(__file__))
# tiny-chat: tiny-dense continued on the single-JSON and debate prompt formats (mod/README.md)
TINY = {"tiny-dense": os.path.join(TINY_DIR, "dense"), "tiny-moe": os.path.join(TINY_DIR, "moe"),
        "tiny-chat": os.path.join(TINY_DIR, "chat")}
