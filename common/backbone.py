"""Backbones: load a real Qwen-VL checkpoint, or build the embedded tiny default.

Both paths end in the same objects: a `transformers` model and a `VLProcessor`
(tokenizer + image processor + the token ids the model needs). Scripts never care which.

    model, proc = load_backbone("/path/to/Qwen2.5-VL-3B-Instruct")   # real checkpoint
    model, proc = load_backbone("tiny-dense")                        # committed tiny default
    batch = proc.encode(examples, train=True)                        # labels on the answer only
    out = model(**batch)

The tiny defaults are real `transformers` architectures (Qwen3-VL dense, Qwen3-VL-MoE),
built here with a byte-level BPE tokenizer and a Qwen2-VL image processor, pretrained by
`python -m eval.tools.pretrain` and saved with `save_pretrained` under `common/tiny/`.
"""
import hashlib
import json
import os
import random
import sys

import torch

from common import shapes
from common.checkpoint import CheckpointError, checked_weights
from common.data import follow_umask
from common.tiny import TINY, TINY_DIR  # noqa: F401  (bb.TINY: the tiny bases by name)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SUPPORTED_VLMS = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "llava_next")


class BackboneError(ValueError):
    """A checkpoint cannot be used; the message says why and what to do."""


# ----------------------------------------------------------------------------- tokenizer / images

def build_tokenizer(vocab_size=400, seed=0):
    """Byte-level BPE tokenizer trained in memory on shapes-world text (any text encodes:
    unknown words fall back to bytes), with the Qwen special tokens, one added token per
    object name / option / spatial mark (`common.shapes.mark_tokens`) and a chat template.
    Returns a `Qwen2Tokenizer`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    rng, corpus = random.Random(seed), []
    for _ in range(3000):
        scene, family, q, a = shapes.sample_example(rng)
        corpus += [q, shapes.target_text(scene, a, q)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    m = json.loads(bpe.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=m["vocab"], merges=[tuple(x) for x in m["merges"]], unk_token="<|endoftext|>",
                         eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    # Object names ("red circle"), option texts ("A. red circle") and spatial marks ("1tl") are
    # single tokens, so every step of the look-then-answer target is a one-hop lookup for the
    # 4-layer model instead of a multi-token match (see README, "How the tiny bases learn").
    tok.add_tokens([" " + w for w in shapes.mark_tokens()])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_image_processor(image_size=84, patch_size=14, merge_size=2):
    """Qwen2-VL image processor with patch `patch_size` / merge `merge_size` that keeps
    `image_size` images as they are (image tokens = (image_size / (patch_size * merge_size))^2)."""
    from transformers import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": max(image_size, 112) ** 2},
                                    patch_size=patch_size, temporal_patch_size=2, merge_size=merge_size)


# ----------------------------------------------------------------------------- processor

class VLProcessor:
    """Tokenizer + image processor + the model's special-token ids, and the one place that
    turns (image, question[, answer]) examples into model inputs.

    Prompt format (Qwen chat, no system turn):
        <|im_start|>user\\n<|vision_start|><|image_pad|>*n<|vision_end|>{question}<|im_end|>\\n
        <|im_start|>assistant\\n{answer}<|im_end|>
    """
    mm_token_types = True  # Qwen-VL takes mm_token_type_ids; `patchify` gives its pixel layout

    def __init__(self, tokenizer, image_processor, config):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token_id = config.image_token_id
        self.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id
        self.merge = getattr(image_processor, "merge_size", 1)
        self._ids = {}

    def _tok(self, text, escape=False):
        """Token ids of `text`; escape=True (user text: questions, answers) tokenizes
        special-token strings such as "<|image_pad|>" as the characters they are made of, so a
        question can never inject an image / turn marker (template text keeps them special)."""
        key = (text, escape)
        if key not in self._ids:  # prompts/templates repeat: cache their ids
            ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=escape)["input_ids"]
            if len(self._ids) > 100_000:
                self._ids.clear()
            self._ids[key] = ids
        return self._ids[key]

    def text_ids(self, text):
        """Token ids of user text (a question, an answer, an option letter): special-token
        strings escaped (`_tok`). Every entry point tokenizes user text through here."""
        return self._tok(text, escape=True)

    def images(self, images):
        """list of PIL images -> (pixel_values [sum patches, C*T*p*p], image_grid_thw [N,3]).

        The one image path of every entry point: the image processor's own resize rules
        (min / max pixels, sides a multiple of patch * merge) decide each image's grid. When all
        images share one size that the processor keeps as it is (e.g. the shapes world's 84x84),
        the pixels are patchified in torch (`patchify`, equal to the processor's output) instead
        of by PIL, which is much faster; any other size (a 2800x2100 photo, mixed sizes) goes
        through the processor, so an image gives the same visual tokens whatever file or batch
        it comes in."""
        ip = self.image_processor
        if images and self._keeps_size(images[0].size) and len({im.size for im in images}) == 1:
            import numpy as np
            return patchify(torch.from_numpy(np.stack([np.asarray(im.convert("RGB")) for im in images])),
                            patch=ip.patch_size, temporal=ip.temporal_patch_size, merge=ip.merge_size,
                            mean=tuple(ip.image_mean), std=tuple(ip.image_std))
        out = ip(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def vision(self, images=None, pixels=None):
        """Vision inputs of N images (PIL list via `images`, or `pixels` = (pixel_values,
        image_grid_thw) already made, e.g. by `images` or `patchify`) -> ({tensor name: tensor}
        for the model, [image tokens per image]). Subclasses for other families (LLaVA-NeXT)
        override this one method."""
        pixel_values, grid = pixels if pixels is not None else self.images(images)
        return {"pixel_values": pixel_values, "image_grid_thw": grid}, (grid.prod(-1) // self.merge ** 2).tolist()

    def _keeps_size(self, size):
        """True if the (PIL) Qwen2-VL image processor leaves a (width, height) image unresized."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (Qwen2VLImageProcessorPil,
                                                                                smart_resize)
        ip = self.image_processor
        if type(ip) is not Qwen2VLImageProcessorPil or ip.do_resize is False:
            return False
        w, h = size
        if max(w, h) > 200 * min(w, h):
            return False
        return smart_resize(h, w, ip.patch_size * ip.merge_size, ip.size.shortest_edge, ip.size.longest_edge) == (h, w)

    def prompt_ids(self, question, n_image_tokens, history=()):
        """Prompt token ids (Qwen chat): the user turn with `n_image_tokens` image pads (none
        and no vision markers when 0: a text-only record), earlier (question, answer) turns of
        `history` if any, then the assistant header."""
        return self.prompt_and_labels(question, n_image_tokens, history)[0]

    def prompt_and_labels(self, question, n_image_tokens, history=()):
        """(ids, labels) of `prompt_ids`; labels are -100 except on the answers of `history`
        (+ their <|im_end|>): a multi-turn record trains on every gpt turn."""
        ids = self._tok("<|im_start|>user\n")
        if n_image_tokens:
            ids = ids + self._tok("<|vision_start|>") + [self.image_token_id] * n_image_tokens + \
                self._tok("<|vision_end|>")
        labels = [-100] * len(ids)
        head = self._tok("<|im_end|>\n<|im_start|>assistant\n")
        for q, a in history:
            ask, ans, nxt = self.text_ids(q) + head, self.text_ids(a) + [self.eos_token_id], \
                self._tok("\n<|im_start|>user\n")
            ids = ids + ask + ans + nxt
            labels = labels + [-100] * len(ask) + ans + [-100] * len(nxt)
        ask = self.text_ids(question) + head
        return ids + ask, labels + [-100] * len(ask)

    def encode(self, images, questions, answers=None, padding_side=None, pixels=None, history=None):
        """Batch inputs for the model.

        images: list of PIL images, one per row, None for a text-only row (or images=None with
        `pixels=(pixel_values, image_grid_thw)` given for every row; with both, `pixels` holds the
        rows whose image is not None, in order); questions: list[str]; answers: list[str] or
        None; history: None or per row a list of earlier (question, answer) turns (multi-turn
        records).
        With answers (training): right padding, `labels` = -100 except on every answer turn
        (history answers included) + its <|im_end|>.
        Without (generation): left padding, so every row's last token is its prompt's end.
        Returns input_ids, attention_mask, the vision tensors of `vision` (none when no row has
        an image) and, for Qwen-VL (`mm_token_types`), mm_token_type_ids (1 at image tokens; the
        model silently falls back to 1-D positions without it). User text is escaped (`text_ids`).
        Raises ValueError if all labels would be masked (empty answers)."""
        has = [True] * len(questions) if images is None else [im is not None for im in images]
        shown = None if images is None else [im for im in images if im is not None]
        vis, counts = self.vision(shown, pixels) if any(has) else ({}, [])
        counts = iter(counts)
        n_img = [next(counts) if h else 0 for h in has]
        rows, labels = [], []
        for i, q in enumerate(questions):
            p, lab = self.prompt_and_labels(q, n_img[i], history[i] if history else ())
            if answers is None:
                rows.append(p)
                continue
            a = self.text_ids(answers[i]) + [self.eos_token_id]
            rows.append(p + a)
            labels.append(lab + a)
        side = padding_side or ("right" if answers is not None else "left")
        L = max(map(len, rows))
        pad = lambda r, v: (r + [v] * (L - len(r))) if side == "right" else ([v] * (L - len(r)) + r)
        input_ids = torch.tensor([pad(r, self.pad_token_id) for r in rows])
        mask = torch.tensor([pad([1] * len(r), 0) for r in rows])
        batch = {"input_ids": input_ids, "attention_mask": mask, **vis}
        if self.mm_token_types:
            batch["mm_token_type_ids"] = (input_ids == self.image_token_id).long() * mask
        if answers is not None:
            batch["labels"] = torch.tensor([pad(r, -100) for r in labels])
        return batch

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save_pretrained(self, path):
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)


class LlavaNextVLProcessor(VLProcessor):
    """`VLProcessor` for LLaVA-NeXT (any-resolution tiles + a newline token per row): the same
    prompt format, but `vision` returns pixel_values [N, tiles, 3, h, w] and image_sizes [N, 2]
    and counts each image's tokens with transformers' `LlavaNextProcessor` rule (base tile + the
    unpadded high-resolution tiles + one newline per row). No mm_token_type_ids."""
    mm_token_types = False

    def __init__(self, tokenizer, image_processor, config):
        from transformers import LlavaNextProcessor
        super().__init__(tokenizer, image_processor, config)
        # CLIP's CLS token counts as an additional image token, which the "default" strategy drops again
        self.counter = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                          patch_size=config.vision_config.patch_size, num_additional_image_tokens=1,
                                          vision_feature_select_strategy=config.vision_feature_select_strategy,
                                          image_token=tokenizer.convert_ids_to_tokens(config.image_token_id))

    def vision(self, images=None, pixels=None):
        if pixels is not None:
            raise ValueError("LLaVA-NeXT images go through its image processor, not `patchify` pixels")
        out = self.image_processor(images=images, return_tensors="pt")
        n = self.counter._get_num_multimodal_tokens(image_sizes=out["image_sizes"].tolist())["num_image_tokens"]
        return {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}, list(n)


def make_processor(tokenizer, image_processor, config):
    """The `VLProcessor` (subclass) for a model config."""
    cls = LlavaNextVLProcessor if config.model_type == "llava_next" else VLProcessor
    return cls(tokenizer, image_processor, config)


def patchify(images_uint8, patch=14, temporal=2, merge=2, mean=(0.48145466, 0.4578275, 0.40821073),
             std=(0.26862954, 0.26130258, 0.27577711)):
    """Qwen2-VL patch layout in torch, for a batch of same-size images that need no resize.

    images_uint8: [N, H, W, 3] uint8 with H, W multiples of patch*merge.
    Returns (pixel_values [N*gh*gw, 3*temporal*patch*patch], image_grid_thw [N, 3]); equal
    to `Qwen2VLImageProcessorPil` output (tested) at a fraction of the cost."""
    N, H, W, _ = images_uint8.shape
    x = (images_uint8.float() / 255 - torch.tensor(mean)) / torch.tensor(std)  # N H W C
    x = x.permute(0, 3, 1, 2).unsqueeze(1).expand(N, temporal, 3, H, W)  # N T C H W
    gh, gw = H // patch, W // patch
    x = x.reshape(N, 1, temporal, 3, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)  # N t gh/m gw/m m m C T p p
    pv = x.reshape(N * gh * gw, 3 * temporal * patch * patch)
    return pv, torch.tensor([[1, gh, gw]] * N)


# ----------------------------------------------------------------------------- tiny configs

def tiny_config(arch, tokenizer, hidden=128, layers=4, experts=8, top_k=2, patch_size=14, merge_size=2,
                expert_width=None):
    """Config of a tiny VLM of a real transformers architecture.

    expert_width: each routed expert's intermediate size (qwen3_vl_moe; default `hidden`);
    32 experts of width 32 hold as many expert parameters as 8 of width 128 (fine-grained experts).
    patch_size / merge_size: the vision tower's patch and spatial merge (Qwen3-VL archs only);
    the 84 px shapes image gives (84 / (patch_size * merge_size))^2 image tokens (14/2: 9,
    7/1: 144).
    arch: "qwen3_vl" (dense, the default base), "qwen3_vl_moe" (MoE, `experts` top-`top_k`),
    "qwen2_5_vl" (for tests / method code on the papers' architecture; rope_theta=3 with
    mrope_section [2,7,7] so height/width get usable rotary frequencies, see NOTES), or
    "llava_next" (LLaVA-NeXT: CLIP tower, one 28 px any-resolution tile, Llama decoder).
    Raises ValueError on an unknown arch."""
    from transformers import AutoConfig
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    vocab, half = len(tokenizer), hidden // 8  # half of head_dim: the rotary pairs M-RoPE splits
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                tie_word_embeddings=False)
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        hw = 5 * half // 16  # Qwen3-VL's [24, 20, 20] split, scaled to the tiny head_dim
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [half - 2 * hw, hw, hw],
                                   "mrope_interleaved": True}
        if arch == "qwen3_vl_moe":
            text.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_width or hidden,
                        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.01)
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=patch_size,
                      spatial_merge_size=merge_size, temporal_patch_size=2, out_hidden_size=hidden,
                      num_position_embeddings=(84 // patch_size) ** 2, deepstack_visual_indexes=[1])
    elif arch == "qwen2_5_vl":
        hw = (half - 2) // 2
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 3.0, "mrope_section": [2, hw, hw]}
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden, window_size=112,
                      fullatt_block_indexes=[1])
    elif arch == "llava_next":  # the MoD paper's second family (LLaVA-1.6): CLIP tower + Llama decoder
        text = {k: v for k, v in text.items() if k != "tie_word_embeddings"}
        text.update(model_type="llama", rope_theta=1e4)
        vision = dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, image_size=28, patch_size=14, projection_dim=64)
        from transformers import LlavaNextConfig
        return LlavaNextConfig(text_config=text, vision_config=vision, image_token_index=ids["image_token_id"],
                               image_grid_pinpoints=[[28, 28]], vision_feature_layer=-1, tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose qwen3_vl, qwen3_vl_moe, qwen2_5_vl or llava_next")
    return AutoConfig.for_model(arch, text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def build_tiny(arch="qwen3_vl", seed=0, **kw):
    """Randomly initialised tiny VLM + its VLProcessor (nothing downloaded)."""
    from transformers import AutoModelForImageTextToText
    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_config(arch, tok, **kw))
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tok.pad_token_id
    if arch == "llava_next":  # 28 px tiles: 84x84 shapes images become 10 image tokens
        from transformers import LlavaNextImageProcessorPil
        improc = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                            image_grid_pinpoints=[[28, 28]])
        return model, LlavaNextVLProcessor(tok, improc, model.config)
    improc = build_image_processor(patch_size=kw.get("patch_size", 14), merge_size=kw.get("merge_size", 2))
    return model, VLProcessor(tok, improc, model.config)


# ----------------------------------------------------------------------------- loading

def resolve(path):
    """'tiny-dense' / 'tiny-moe' / 'tiny-chat' -> committed directory; anything else unchanged."""
    return TINY.get(path, path)


def load_backbone(path, dtype=None, device="cpu", trust_remote_code=False, device_map=None):
    """Load a VLM + VLProcessor from a local directory (or hub id, where the hub is reachable).

    path: directory holding config.json + *.safetensors + tokenizer + preprocessor config,
    or "tiny-dense" / "tiny-moe" / "tiny-chat" for the committed defaults.
    dtype: torch dtype or None (the checkpoint's own); device: "cpu", "cuda", ...;
    trust_remote_code: off unless the user asks (it executes code shipped with the checkpoint).
    A missing `path` whose `{path}.old` holds config.json (a save_backbone killed between its
    renames) loads `{path}.old`, with a note on stderr.
    Raises BackboneError for a missing directory, a directory without config.json or with an
    unreadable one, an architecture outside SUPPORTED_VLMS (or one that needs
    trust_remote_code), weights only in pickle files (pytorch_model.bin: pickles can run code,
    so they are never loaded), and a truncated / corrupt safetensors file (named)."""
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
    path = resolve(path)
    old = path.rstrip("/") + ".old"
    if not os.path.exists(path) and os.path.exists(os.path.join(old, "config.json")):  # see save_backbone
        print(f"note: {path} is missing; loading {old}, the checkpoint a save_backbone interrupted between its "
              f"two renames left there", file=sys.stderr)
        path = old
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise BackboneError(f"{path} has no config.json: not a save_pretrained checkpoint directory "
                                f"(point --model at the folder that holds config.json and *.safetensors)")
    elif path in TINY.values():
        raise BackboneError(f"{path} missing: the committed tiny checkpoint is gone; restore it with git "
                            f"or rebuild it with `python -m eval.tools.pretrain` (README)")
    elif path.startswith((".", os.sep, "~")) or path.count("/") != 1 or os.path.isdir(path.split("/")[0]):
        # (one slash under a local folder, `ckpt/qwen25v1`, is a typo of a local path, not a hub id)
        import difflib
        parent, name = os.path.split(path.rstrip("/"))
        here = sorted(os.listdir(parent)) if parent and os.path.isdir(parent) else []
        near = difflib.get_close_matches(name, here, n=1, cutoff=0.6) if here else \
            difflib.get_close_matches(path, list(TINY), n=1, cutoff=0.7)
        hint = (f" (did you mean {os.path.join(parent, near[0]) if here else near[0]}?)" if near else
                f" ({parent}/ holds {here[:8]})" if here else
                " (a local directory, a hub id org/name, tiny-dense, tiny-moe or tiny-chat)")
        raise BackboneError(f"{path}: no such checkpoint directory{hint}")
    # else: a hub id "org/name", resolved by transformers (needs network or a local HF cache)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # bad JSON, no/unknown model_type, custom code without the flag
        why = str(e).splitlines()[0].rstrip(". ")
        if not os.path.isdir(path) and ("connect" in why.lower() or "offline" in why.lower()):
            raise BackboneError(f"{path}: the model hub cannot be reached and the checkpoint is not in the local "
                                f"cache ({why}); download it where there is network and pass its local "
                                f"save_pretrained directory as --model") from None
        raise BackboneError(f"{path}: cannot read its config.json ({why}). Supported VLMs: "
                            f"{', '.join(SUPPORTED_VLMS)}; checkpoints with their own code need "
                            f"--trust-remote-code (it runs that code)") from None
    if config.model_type not in SUPPORTED_VLMS and not trust_remote_code:
        raise BackboneError(f"{path}: architecture {config.model_type!r} is not supported; supported VLMs: "
                            f"{', '.join(SUPPORTED_VLMS)}")
    if os.path.isdir(path):
        try:  # headers only: a truncated shard is named here, not by a raw safetensors error mid-load
            checked_weights(path)
        except CheckpointError as e:
            raise BackboneError(str(e)) from None
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, device_map=device_map, trust_remote_code=trust_remote_code, use_safetensors=True)
    if device_map is None:
        model.to(device)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    improc = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model.eval(), make_processor(tok, improc, model.config)


def save_backbone(model, proc, path):
    """save_pretrained model + tokenizer + image processor into `path` atomically
    (written to a temp dir, then renamed over; an existing `path` is moved aside first, so
    at every instant one complete checkpoint is at `path` or at `path.old`)."""
    import shutil
    path = path.rstrip("/")
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    proc.save_pretrained(tmp)
    follow_umask(tmp)
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def base_identity(model):
    """What trained adapters / latent modules depend on in their base VLM: architecture, text
    width, depth, vocabulary and a fingerprint of the weights (`weights_fingerprint`), plus
    the path it was loaded from (for messages only: a moved checkpoint is the same base)."""
    t = model.config.get_text_config()
    return {"model_type": model.config.model_type, "hidden_size": t.hidden_size,
            "num_hidden_layers": t.num_hidden_layers, "vocab_size": t.vocab_size,
            "weights": weights_fingerprint(model),
            "name_or_path": getattr(model.config, "_name_or_path", "") or ""}


@torch.no_grad()
def weights_fingerprint(model, n=4096):
    """'sha256 X' over n evenly strided values of the input embedding matrix, rounded to
    bf16 (a bf16 load of an fp32 checkpoint is the same base) and hashed as fp32 bytes:
    tells apart two bases of one config with other weights (tiny-dense / tiny-chat) and costs
    one n-value copy even for a 150k x 4096 embedding. A fine-tune that left the embedding
    untouched (e.g. merged LoRA) is not told apart."""
    w = model.get_input_embeddings().weight.detach().reshape(-1)  # (vocab * hidden,), a view
    sample = w[::max(1, w.numel() // n)][:n].to(torch.bfloat16).float().cpu()
    return "sha256 " + hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]


def identity_mismatch(saved, now):
    """Why a base of identity `now` cannot stand in for the `saved` one, [] if it can:
    ['key saved vs now'] for each differing key (name_or_path ignored); the weights only when
    all else matches (other weights of another architecture say nothing new). Keys that
    `saved` lacks (recorded before they existed) are not compared."""
    diff = [f"{k} {saved[k]!r} vs {now.get(k)!r}" for k in saved
            if k not in ("name_or_path", "weights") and saved[k] != now.get(k)]
    if not diff and saved.get("weights", now.get("weights")) != now.get("weights"):
        diff = [f"same architecture and size, but the weights differ: embedding {saved['weights']} vs "
                f"{now.get('weights')}"]
    return diff


def text_model(model):
    """The decoder stack of a transformers VLM or causal LM: the module whose `layers` are the
    decoder layers. Looked up as `model.model.language_model` (Qwen-VL, LLaVA(-NeXT), Gemma3,
    Mistral3, InternVL), `model.model.text_model` (Idefics3, SmolVLM), `model.language_model`
    (Llama4: a causal LM, whose `.model` is taken), `model.model` (causal LMs); never a vision
    tower. Raises ValueError naming the class when none holds a `layers` torch.nn.ModuleList.
    (`mod.model` and `mole.adapters` keep copies, so each copies on its own; tested equal.)"""
    inner = getattr(model, "model", None)
    for found in (getattr(inner, "language_model", None), getattr(inner, "text_model", None),
                  getattr(model, "language_model", None), getattr(model, "text_model", None), inner, model):
        for m in (found, getattr(found, "model", None)):  # a causal LM wraps its decoder in `.model`
            if isinstance(getattr(m, "layers", None), torch.nn.ModuleList):
                return m
    raise ValueError(f"{type(model).__name__}: no decoder stack found (looked for model.language_model, "
                     f"model.text_model, language_model, model with a `layers` ModuleList); this family is "
                     f"not supported")


@torch.no_grad()
def generate(model, proc, images, questions, max_new_tokens=48, pixels=None, history=None, **gen_kw):
    """Batched greedy generation (left padding). Returns (texts, n_generated_tokens list).
    images: PIL images, None for a text-only row; history: per row earlier (question, answer)
    turns or None (`VLProcessor.encode`). Bounded by `max_new_tokens` even if the model never
    emits <|im_end|>."""
    batch = proc.encode(images, questions, pixels=pixels, history=history)
    batch = {k: v.to(model.device) for k, v in batch.items()}
    gen_kw.setdefault("do_sample", False)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, eos_token_id=proc.eos_token_id,
                         pad_token_id=proc.pad_token_id, **gen_kw)
    new = out[:, batch["input_ids"].shape[1]:]
    texts, lens = [], []
    for row in new.tolist():
        n = row.index(proc.eos_token_id) + 1 if proc.eos_token_id in row else len(row)
        texts.append(proc.decode(row[:n]))
        lens.append(n)
    return texts, lens
