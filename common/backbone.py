"""Backbones: load a real checkpoint of a supported VLM family (`FAMILIES`: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL(-MoE), LLaVA-1.5, LLaVA-NeXT, Gemma3), or build the embedded tiny default.

Both paths end in the same objects: a `transformers` model and a `VLProcessor`, a thin wrapper
over the checkpoint's own transformers processor (its chat template, image processor and
image-token expansion, stop tokens from its generation config). Scripts never care which.

    model, proc = load_backbone("/path/to/Qwen2.5-VL-3B-Instruct")   # real checkpoint
    model, proc = load_backbone("tiny-dense")                        # committed tiny default
    batch = proc.encode(images, questions, answers)                  # labels on the answers only
    out = model(**batch)

The tiny defaults are real `transformers` architectures (Qwen3-VL dense, Qwen3-VL-MoE),
built here with a byte-level BPE tokenizer and a Qwen2-VL image processor, pretrained by
`python -m eval.tools.pretrain` and saved with `save_pretrained` under `common/tiny/`.
"""
import difflib
import hashlib
import io
import json
import math
import os
import random
import shutil
import sys

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (AutoConfig, AutoModelForImageTextToText, LlavaNextConfig, LlavaNextImageProcessorPil,
                          ProcessorMixin, Qwen2Tokenizer)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize
from transformers.utils.chat_template_utils import _get_control_token_patterns, encode_marked_chat, mark_control_tokens

from common import shapes
from common.checkpoint import CheckpointError, checked_weights
from common.data import follow_umask
from common.tiny import TINY, TINY_DIR  # noqa: F401  (bb.TINY: the tiny bases by name)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (  # the tiny bases' own template (saved with them): Qwen's ChatML, no system turn
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class BackboneError(ValueError):
    """A checkpoint cannot be used; the message says why and what to do."""


# ----------------------------------------------------------------------------- tokenizer / images

def build_tokenizer(vocab_size=400, seed=0):
    """Byte-level BPE tokenizer trained in memory on shapes-world text (any text encodes:
    unknown words fall back to bytes), with the Qwen special tokens, one added token per
    object name / option / spatial mark (`common.shapes.mark_tokens`) and a chat template.
    Returns a `Qwen2Tokenizer`."""
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
    return Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": max(image_size, 112) ** 2},
                                    patch_size=patch_size, temporal_patch_size=2, merge_size=merge_size)


# ----------------------------------------------------------------------------- processor

def _image_only(cls):
    """`cls` (a Qwen-VL processor class) without its video part: the real class (its chat
    template, image-token expansion, mm_token_type_ids), built from an image processor and a
    tokenizer only, because its video processor needs torchvision (not installed beside this torch)."""

    class ImageOnly(cls):
        @classmethod
        def get_attributes(klass):
            return ["image_processor", "tokenizer"]

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    return ImageOnly


# model_type -> the processor class that serves it: "image-only" ones are the Qwen-VL classes
# without their video part (`_image_only`); the others load with AutoProcessor as they are.
FAMILIES = {"qwen2_5_vl": ("Qwen2_5_VLProcessor", True), "qwen2_vl": ("Qwen2VLProcessor", True),
            "qwen3_vl": ("Qwen3VLProcessor", True), "qwen3_vl_moe": ("Qwen3VLProcessor", True),
            "llava_next": ("LlavaNextProcessor", False), "llava": ("LlavaProcessor", False),
            "gemma3": ("Gemma3Processor", False)}
SUPPORTED_VLMS = tuple(FAMILIES)
# the text MoEs RoleMerge merges, which `eval.evaluate` also scores (`load_backbone(..., text_lms=True)`)
TEXT_LMS = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3")


def processor_class(model_type):
    """The transformers processor class serving `model_type` (a key of FAMILIES)."""
    name, image_only = FAMILIES[model_type]
    cls = getattr(transformers, name)
    return _image_only(cls) if image_only else cls


def build_hf_processor(tokenizer, image_processor, config, chat_template=None):
    """The family's real transformers processor from its parts (tokenizer, image processor,
    model config), for checkpoints that ship no processor_config.json (the tiny bases, test
    models). LLaVA(-NeXT) take the vision tower's patch size and feature strategy from the
    config (CLIP's CLS token counts as one additional image token, which the "default" strategy
    drops again); Gemma3 its tokens per image. Raises KeyError for a model_type outside FAMILIES."""
    cls = processor_class(config.model_type)
    template = chat_template or tokenizer.chat_template
    if config.model_type in ("llava", "llava_next"):
        return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template,
                   patch_size=config.vision_config.patch_size, num_additional_image_tokens=1,
                   vision_feature_select_strategy=config.vision_feature_select_strategy,
                   image_token=tokenizer.convert_ids_to_tokens(config.image_token_index))
    if config.model_type == "gemma3":
        return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template,
                   image_seq_length=config.mm_tokens_per_image)
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def _ids(x):
    """An int / list of ints / None as a list."""
    return [] if x is None else [int(v) for v in (x if isinstance(x, (list, tuple)) else [x])]


class VLProcessor:
    """The one place that turns (image, question[, answer]) examples into model inputs, for
    every supported family, through the checkpoint's own transformers processor (`processor`):
    its chat template (`apply_chat_template` with the generation prompt), its image processor
    and image-token expansion (`replace_image_token`), its token-type ids. Nothing here writes
    a family's format by hand.

    processor: the family's `ProcessorMixin` (`processor_class` / `build_hf_processor`), or
    for a text LM (`TEXT_LMS`) its tokenizer alone (string contents, no images, no token types);
    config: the model config (`image_token_id` / `image_token_index`: the id of every visual
    token in input_ids); generation_config: the checkpoint's (its `eos_token_id`: the stop ids).

    Attributes: tokenizer, image_processor, image_token_id, stop_ids (every id that ends
    generation: generation_config's eos ids, else the tokenizer's eos), eos_token_id (the
    answer terminator: the first stop id the template writes after an assistant answer, e.g.
    <|im_end|>, </s>, <end_of_turn>; labels include it), pad_token_id (the tokenizer's pad,
    else generation_config's, else eos), model_input_keys (the token-type tensors the processor
    returns, e.g. mm_token_type_ids for Qwen-VL, token_type_ids for Gemma3), system (a system
    turn to write, None: only what the template adds), images_kwargs (image-processor
    settings on top of the saved ones, e.g. lmms-eval's size bounds), jpeg_quality (JPEG
    re-encoding of each image before it is processed, None: none) and pre_resize ((factor,
    min_pixels, max_pixels) of a resize before the image processor, `fit_to_grid`; None: none);
    see `eval.evaluate.apply_prompt_settings`.
    Raises BackboneError when the processor has no chat template."""

    def __init__(self, processor, config, generation_config=None):
        self.processor, self.config = processor, config
        self.tokenizer = tok = getattr(processor, "tokenizer", processor)  # a text LM: its tokenizer alone
        self.image_processor = getattr(processor, "image_processor", None)
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = getattr(config, "image_token_index", None)
        self.image_token = None if self.image_token_id is None else tok.convert_ids_to_tokens(self.image_token_id)
        gen = generation_config
        self.stop_ids = _ids(getattr(gen, "eos_token_id", None)) or _ids(tok.eos_token_id)
        pad = tok.pad_token_id if tok.pad_token_id is not None else getattr(gen, "pad_token_id", None)
        self.merge = getattr(self.image_processor, "merge_size", 1)
        self.images_kwargs = {}  # extra image-processor settings (e.g. size bounds), see `vision`
        self.system = None  # a system turn to write (None: only what the template itself adds)
        self.jpeg_quality = None  # re-encode each image as JPEG at this quality first (None: as given), see `vision`
        self.pre_resize = None  # (factor, min_pixels, max_pixels): resize each image first (`fit_to_grid`)
        self._cache = {}
        if not self.chat_template:
            raise BackboneError(f"{config.model_type}: the checkpoint's processor has no chat template; prompts are "
                                f"built with the checkpoint's own template (use an instruct / chat checkpoint, or "
                                f"save one as chat_template.jinja next to it)")
        self.eos_token_id = self._terminator()
        self.pad_token_id = pad if pad is not None else self.eos_token_id
        probe = processor(text=["x"], return_tensors="pt") if self.image_processor is not None else {}
        self.model_input_keys = [k for k in ("mm_token_type_ids", "token_type_ids") if k in probe]  # the family's

    # ------------------------------------------------------------------ text

    def _tok(self, text, escape=False):
        """Token ids of `text` with no BOS; escape=True tokenizes special-token strings such as
        "<|image_pad|>" as the characters they are made of."""
        key = ("tok", text, escape)
        if key not in self._cache:
            ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=escape)["input_ids"]
            self._remember(key, ids)
        return self._cache[key]

    def _remember(self, key, value):
        if len(self._cache) > 100_000:  # prompts repeat across epochs: keep their ids, bounded
            self._cache.clear()
        self._cache[key] = value

    def text_ids(self, text):
        """Token ids of user text (an option letter, a continuation): special-token strings
        escaped. Every entry point tokenizes loose user text through here."""
        return self._tok(text, escape=True)

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def image_text(self, n):
        """The text one image of `n` visual tokens takes in a prompt, as the processor expands
        it: Gemma3 `\\n\\n<start_of_image>` + n soft tokens + `<end_of_image>\\n\\n` (n fixed),
        the others n copies of the image token. Raises ValueError for a Gemma3 count that is
        not its tokens per image."""
        p = self.processor
        if hasattr(p, "full_image_sequence"):
            if n != p.image_seq_length:
                raise ValueError(f"{type(p).__name__} gives every image {p.image_seq_length} tokens, not {n}")
            return p.full_image_sequence
        return p.image_token * n

    def messages(self, question, n_images, history=(), answer=None):
        """The conversation of one record in transformers' chat format: [system turn
        (`self.system`, when set),] the first
        user turn holds the images ({"type": "image"} each), then earlier (question, answer)
        turns of `history`, the question, and the answer if given. Several images: a question
        with one "<image>" placeholder per image gets each image at its placeholder (a newline
        right after one is dropped), one without gets them first. Raises ValueError for a
        placeholder count that is neither 0 nor the image count."""
        turns = [(q, a) for q, a in history] + [(question, answer)]
        text = (lambda t: t) if self.image_processor is None else (lambda t: [{"type": "text", "text": t}])
        msgs = [{"role": "system", "content": text(self.system)}] if self.system else []
        for k, (q, a) in enumerate(turns):  # a text LM's template reads string contents
            content = text(q) if self.image_processor is None else self._content(q, n_images if k == 0 else 0)
            msgs.append({"role": "user", "content": content})
            if a is not None:
                msgs.append({"role": "assistant", "content": text(a)})
        return msgs

    @staticmethod
    def _content(question, k):
        n_ph = question.count("<image>") if k > 1 else 0
        if k > 1 and n_ph not in (0, k):
            raise ValueError(f"a question with {k} images has {n_ph} '<image>' placeholders; put one "
                             f"per image, in order (or none: the images then come first)")
        segs = question.replace("<image>\n", "<image>").split("<image>") if n_ph else [""] * k + [question]
        content = [{"type": "text", "text": segs[0]}] if segs[0] else []
        for seg in segs[1:]:
            content.append({"type": "image"})
            if seg:
                content.append({"type": "text", "text": seg})
        return content or [{"type": "text", "text": ""}]

    def render(self, msgs, add_generation_prompt):
        """The chat template's text of `msgs` (the checkpoint's `apply_chat_template`)."""
        return self.processor.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False)

    @property
    def chat_template(self):
        return self.processor.chat_template

    def _encode_chat(self, msgs, n_tokens, add_generation_prompt):
        """Token ids of a conversation exactly as the processor's `apply_chat_template(...,
        tokenize=True)` gives them: the template's text, each image placeholder expanded to
        `image_text(n)` (n_tokens: visual tokens per image, in order), a BOS only where the
        tokenizer adds one and the template does not write it. Special-token strings in user
        text (questions, answers) are encoded as text, never as control tokens
        (`sanitize_control_tokens`), so a question can never inject an image or a turn marker."""
        key = ("chat", json.dumps(msgs), tuple(n_tokens), add_generation_prompt)
        if key in self._cache:
            return self._cache[key]
        tok, p = self.tokenizer, self.processor
        texts = [c if isinstance(c, str) else c.get("text", "") for m in msgs for c in
                 ([m["content"]] if isinstance(m["content"], str) else m["content"])]
        marked = any(control_re(tok, self.chat_template).search(t) for t in texts)
        if marked:
            msgs = mark_control_tokens(msgs, control_re(tok, self.chat_template))
        text = self.render(msgs, add_generation_prompt)
        if n_tokens:
            text = p.get_text_with_replacements([text], [self.image_text(n) for n in n_tokens])[0][0]
        add = not (tok.bos_token is not None and text.startswith(tok.bos_token))
        if marked:
            ids = (tok("", add_special_tokens=True)["input_ids"] if add else []) + encode_marked_chat(tok, text)
        else:
            ids = tok(text, add_special_tokens=add)["input_ids"]
        self._remember(key, ids)
        return ids

    def _terminator(self):
        """The stop id the template writes right after an assistant answer (e.g. <|im_end|>),
        else the first stop id."""
        msgs = self.messages("q", 0, answer="a")
        full, head = self._encode_chat(msgs, [], False), self._encode_chat(msgs[:-1], [], True)
        after = [t for t in full[_common(full, head):] if t in self.stop_ids]
        return after[0] if after else self.stop_ids[0]

    def answer_span(self, msgs, n_tokens, k):
        """(start, end, extra) of assistant turn `k` (0-based, counting only assistant turns) in
        `_encode_chat(msgs, n_tokens, False)`: start where the conversation's ids leave those of
        its generation prompt (the template decides, no marker is hard-coded), end right after
        the turn's first stop id (`stop_ids`), extra = []. A template that writes no end token
        after an answer (llava-1.5-hf's and llava-v1.6-vicuna-hf's write "answer ") ends the span
        at the answer's last non-blank token and gives extra = [eos_token_id], the terminator
        that the original LLaVA training appends, so a trained model learns to stop."""
        at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"][k]
        full = self._encode_chat(msgs, n_tokens, False)
        head = self._encode_chat(msgs[:at], n_tokens, True)
        turn = self._encode_chat(msgs[:at + 1], n_tokens, False)
        start = _common(full, head)
        end = min(_common(full, turn), len(turn))
        stops = [i for i in range(start, end) if full[i] in self.stop_ids]
        if stops:
            return start, stops[0] + 1, []
        while end > start and not self.tokenizer.decode(full[end - 1:end]).strip():
            end -= 1
        return start, end, [self.eos_token_id]

    def prompt_ids(self, question, n_image_tokens, history=()):
        """Prompt token ids: the chat template with the generation prompt, one image of
        `n_image_tokens` tokens (an int; a list for several images; 0 / [] for a text-only
        record), earlier (question, answer) turns of `history` if any."""
        return self.prompt_and_labels(question, n_image_tokens, history)[0]

    def prompt_and_labels(self, question, n_image_tokens, history=()):
        """(ids, labels) of `prompt_ids`; labels are -100 except on the answers of `history`
        (each answer's span as `answer_span` finds it): a multi-turn record trains on every
        assistant turn."""
        n = _counts(n_image_tokens)
        msgs = self.messages(question, len(n), history)
        ids = self._encode_chat(msgs, n, True)
        labels = [-100] * len(ids)
        for k in range(len(history)):  # (a history answer's appended terminator, if any, is not in the prompt)
            s, e, _ = self.answer_span(msgs, n, k)
            full = self._encode_chat(msgs, n, False)
            if ids[s:e] == full[s:e]:
                labels[s:e] = ids[s:e]
        return ids, labels

    def answer_ids(self, question, n_image_tokens, answer, history=()):
        """(ids, labels) of prompt + answer: the prompt of `prompt_and_labels`, then the
        answer's tokens as the template writes them up to and including its terminator."""
        n = _counts(n_image_tokens)
        conv = self.messages(question, len(n), history, answer=answer)
        s, e, extra = self.answer_span(conv, n, len(history))
        answer_ids = self._encode_chat(conv, n, False)[s:e] + extra
        ids, labels = self.prompt_and_labels(question, n_image_tokens, history)
        head = self._encode_chat(conv[:-1], n, True)
        cut = len(ids) - (len(head) - s)  # the prompt may carry more (placeholders) or merge one token
        return ids[:cut] + answer_ids, labels[:cut] + answer_ids

    def answer_tokens(self, answer):
        """The ids of `answer` as the template writes an assistant answer after its generation
        prompt, up to and including its terminator (`answer_span` of a one-turn conversation)."""
        conv = self.messages("?", 0, answer=answer)
        s, e, extra = self.answer_span(conv, [], 0)
        return self._encode_chat(conv, [], False)[s:e] + extra

    def tail_ids(self):
        """The ids every prompt ends with after the user's text (end of the user turn + the
        generation prompt: the assistant header), found as the common end of two prompts."""
        if "tail" not in self._cache:
            a, b = (self._encode_chat(self.messages(q, 0), [], True) for q in ("x?", "y."))
            n = 0
            while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
                n += 1
            self._cache["tail"] = a[len(a) - n:]
        return list(self._cache["tail"])

    # ------------------------------------------------------------------ images

    def images(self, images):
        """list of PIL images -> (pixel_values [sum patches, C*T*p*p], image_grid_thw [N,3]),
        for the Qwen-VL families (`vision` is the one image path for every family).

        The image processor's own resize rules (min / max pixels, sides a multiple of patch *
        merge) decide each image's grid. When all images share one size that the processor
        keeps as it is (e.g. the shapes world's 84x84), the pixels are patchified in torch
        (`patchify`, equal to the processor's output: tested) instead of by PIL, which is much
        faster."""
        vis, _ = self.vision(images)
        return vis["pixel_values"], vis["image_grid_thw"]

    def vision(self, images=None, pixels=None):
        """Vision inputs of N images -> ({tensor name: tensor} for the model, [visual tokens per
        image]).

        images: PIL list, through the processor's image processor (its own kwargs, plus
        `images_kwargs`) and its `replace_image_token` for the counts; or pixels: what
        `vision` returned already (a (dict, counts) pair), or for Qwen-VL (pixel_values,
        image_grid_thw). Tensors the processor only uses to count tokens (Gemma3's num_crops)
        are left out."""
        if pixels is not None:
            if isinstance(pixels[0], dict):
                return pixels
            pv, grid = pixels
            return {"pixel_values": pv, "image_grid_thw": grid}, (grid.prod(-1) // self.merge ** 2).tolist()
        p, ip = self.processor, self.image_processor
        if self.jpeg_quality:
            images = [jpeg_roundtrip(im, self.jpeg_quality) for im in images]
        if self.pre_resize:
            images = [fit_to_grid(im, *self.pre_resize) for im in images]
        if not self.images_kwargs and self._keeps_size(images[0].size) and len({im.size for im in images}) == 1:
            pv, grid = patchify(torch.from_numpy(np.stack([np.asarray(im.convert("RGB")) for im in images])),
                                patch=ip.patch_size, temporal=ip.temporal_patch_size, merge=ip.merge_size,
                                mean=tuple(ip.image_mean), std=tuple(ip.image_std))
            return self.vision(pixels=(pv, grid))
        kw = p._merge_kwargs(tokenizer_init_kwargs=self.tokenizer.init_kwargs, return_tensors="pt",
                             **self.images_kwargs)["images_kwargs"]
        vis, repl = p._process_images(images, **kw)
        counts = [r.count(self.image_token) for r in repl]
        return {k: v for k, v in vis.items() if k not in p.unused_input_names}, counts

    def _keeps_size(self, size):
        """True if the (PIL) Qwen2-VL image processor leaves a (width, height) image unresized."""
        ip = self.image_processor
        if type(ip) is not Qwen2VLImageProcessorPil or ip.do_resize is False:
            return False
        w, h = size
        if max(w, h) > 200 * min(w, h):
            return False
        return smart_resize(h, w, ip.patch_size * ip.merge_size, ip.size.shortest_edge, ip.size.longest_edge) == (h, w)

    # ------------------------------------------------------------------ batches

    def extras(self, input_ids, attention_mask):
        """The token-type tensors the family's processor returns (`model_input_keys`), from the
        ids: the processor's own `create_mm_token_type_ids` (1 at image tokens), 0 on padding."""
        if not self.model_input_keys:
            return {}
        types = torch.tensor(self.processor.create_mm_token_type_ids(input_ids.tolist())) * attention_mask
        return {k: types for k in self.model_input_keys}

    def pad(self, rows, side, vis=None, labels=None):
        """A padded batch of id rows: input_ids, attention_mask, token types (`extras`), the
        vision tensors `vis`, and labels (-100 on padding) when given."""
        L = max(map(len, rows))
        pad = lambda r, v: (r + [v] * (L - len(r))) if side == "right" else ([v] * (L - len(r)) + r)
        input_ids = torch.tensor([pad(r, self.pad_token_id) for r in rows])
        mask = torch.tensor([pad([1] * len(r), 0) for r in rows])
        batch = {"input_ids": input_ids, "attention_mask": mask, **(vis or {}), **self.extras(input_ids, mask)}
        if labels is not None:
            batch["labels"] = torch.tensor([pad(r, -100) for r in labels])
        return batch

    def encode(self, images, questions, answers=None, padding_side=None, pixels=None, history=None):
        """Batch inputs for the model.

        images: list of PIL images, one per row, None for a text-only row (or images=None with
        `pixels` given for every row; with both, `pixels` holds the rows whose image is not None,
        in order: a `vision` result, or Qwen-VL's (pixel_values, image_grid_thw)); questions:
        list[str]; answers: list[str] or None; history: None or per row a list of earlier
        (question, answer) turns (multi-turn records).
        With answers (training): right padding, `labels` = -100 except on every answer turn
        (history answers included) up to and including its terminator (`answer_span`).
        Without (generation): left padding, so every row's last token is its prompt's end.
        Returns input_ids, attention_mask, the vision tensors (none when no row has an image)
        and the family's token-type tensors (`extras`). Raises ValueError if all labels would
        be masked (empty answers)."""
        has = [True] * len(questions) if images is None else [im is not None for im in images]
        if any(has) and self.image_processor is None:
            raise ValueError(f"{self.config.model_type} is a text model: it takes no images (the records with an "
                             f"image need a VLM)")
        shown = None if images is None else [im for im in images if im is not None]
        vis, counts = self.vision(shown, pixels) if any(has) else ({}, [])
        counts = iter(counts)
        n_img = [next(counts) if h else 0 for h in has]
        rows, labels = [], []
        for i, q in enumerate(questions):
            h = history[i] if history else ()
            if answers is None:
                rows.append(self.prompt_ids(q, n_img[i], h))
            else:
                r, lab = self.answer_ids(q, n_img[i], answers[i], h)
                rows.append(r)
                labels.append(lab)
        side = padding_side or ("right" if answers is not None else "left")
        return self.pad(rows, side, vis, labels if answers is not None else None)

    def save_pretrained(self, path):
        """Tokenizer (with the chat template), image processor and, for families whose
        processor loads with AutoProcessor, its processor_config.json."""
        self.tokenizer.save_pretrained(path)
        if self.image_processor is None:
            return
        self.image_processor.save_pretrained(path)
        if not FAMILIES[self.config.model_type][1]:
            self.processor.save_pretrained(path)


def jpeg_roundtrip(image, quality):
    """`image` (PIL) saved as an RGB JPEG at `quality` and read back as RGB, as lmms-eval's simple
    model classes send images (a JPEG data URL, decoded again before the processor)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=quality)
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def fit_to_grid(image, factor, min_pixels, max_pixels):
    """`image` (PIL) resized (bicubic) so both sides are multiples of `factor` and its area lies in
    [min_pixels, max_pixels], keeping the aspect ratio: qwen_vl_utils' `fetch_image` /
    `smart_resize` (0.0.14), the resize lmms-eval's Qwen-VL classes apply before the processor.
    Raises ValueError for an aspect ratio above 200."""
    w, h = image.size
    if max(h, w) / min(h, w) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(h, w) / min(h, w)}")
    hb, wb = max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor)
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb, wb = math.floor(h / beta / factor) * factor, math.floor(w / beta / factor) * factor
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return image.resize((wb, hb), Image.Resampling.BICUBIC)


def _counts(n):
    """Visual tokens per image as a list: an int n -> [n] (0 -> [], no image)."""
    return list(n) if isinstance(n, (list, tuple)) else ([n] if n else [])


def _common(a, b):
    """Length of the common prefix of two id lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def control_re(tokenizer, chat_template):
    """Regex of the control tokens `sanitize_control_tokens` encodes as text in user input."""
    return _get_control_token_patterns(tokenizer._get_control_tokens(chat_template))[0]


def make_processor(tokenizer, image_processor, config, generation_config=None):
    """The `VLProcessor` of a model config from a tokenizer and an image processor."""
    return VLProcessor(build_hf_processor(tokenizer, image_processor, config), config, generation_config)


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
        return LlavaNextConfig(text_config=text, vision_config=vision, image_token_index=ids["image_token_id"],
                               image_grid_pinpoints=[[28, 28]], vision_feature_layer=-1, tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose qwen3_vl, qwen3_vl_moe, qwen2_5_vl or llava_next")
    return AutoConfig.for_model(arch, text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def build_tiny(arch="qwen3_vl", seed=0, **kw):
    """Randomly initialised tiny VLM + its VLProcessor (nothing downloaded)."""
    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_config(arch, tok, **kw))
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tok.pad_token_id
    if arch == "llava_next":  # 28 px tiles: 84x84 shapes images become 10 image tokens
        improc = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                            image_grid_pinpoints=[[28, 28]])
    else:
        improc = build_image_processor(patch_size=kw.get("patch_size", 14), merge_size=kw.get("merge_size", 2))
    return model, make_processor(tok, improc, model.config, model.generation_config)


# ----------------------------------------------------------------------------- loading

def resolve(path):
    """'tiny-dense' / 'tiny-moe' / 'tiny-chat' -> committed directory; anything else unchanged."""
    return TINY.get(path, path)


def load_backbone(path, dtype=None, device="cpu", trust_remote_code=False, device_map=None, text_lms=False):
    """Load a VLM + VLProcessor from a local directory (or hub id, where the hub is reachable).

    path: directory holding config.json + *.safetensors + tokenizer + preprocessor config,
    or "tiny-dense" / "tiny-moe" / "tiny-chat" for the committed defaults.
    dtype: torch dtype or None (the checkpoint's own); device: "cpu", "cuda", ...;
    trust_remote_code: off unless the user asks (it executes code shipped with the checkpoint).
    text_lms: also load the text MoEs of `TEXT_LMS` (a causal LM + a VLProcessor over its
    tokenizer and chat template; records without images only).
    A missing `path` whose `{path}.old` holds config.json (a save_backbone killed between its
    renames) loads `{path}.old`, with a note on stderr.
    Raises BackboneError for a missing directory, a directory without config.json or with an
    unreadable one, an architecture outside SUPPORTED_VLMS (or one that needs
    trust_remote_code), weights only in pickle files (pytorch_model.bin: pickles can run code,
    so they are never loaded), and a truncated / corrupt safetensors file (named)."""
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
    text_lm = text_lms and config.model_type in TEXT_LMS
    if config.model_type not in SUPPORTED_VLMS and not text_lm and not trust_remote_code:
        also = f"; text MoEs: {', '.join(TEXT_LMS)}" if text_lms else ""
        raise BackboneError(f"{path}: architecture {config.model_type!r} is not supported; supported VLMs: "
                            f"{', '.join(SUPPORTED_VLMS)}{also}")
    if os.path.isdir(path):
        try:  # headers only: a truncated shard is named here, not by a raw safetensors error mid-load
            checked_weights(path)
        except CheckpointError as e:
            raise BackboneError(str(e)) from None
    if text_lm:
        processor = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if not processor.chat_template:
            raise BackboneError(f"{path}: its tokenizer has no chat template; prompts are built with the "
                                f"checkpoint's own template (use an instruct / chat checkpoint)")
    else:
        processor = load_processor(path, config, trust_remote_code)  # before the weights: a bad one fails fast
        if not processor.chat_template:
            raise BackboneError(f"{path}: its processor has no chat template; prompts are built with the "
                                f"checkpoint's own template (use an instruct / chat checkpoint)")
    model = (transformers.AutoModelForCausalLM if text_lm else AutoModelForImageTextToText).from_pretrained(
        path, dtype=dtype, device_map=device_map, trust_remote_code=trust_remote_code, use_safetensors=True)
    if device_map is None:
        model.to(device)
    return model.eval(), VLProcessor(processor, model.config, model.generation_config)


def checkpoint_model_type(path):
    """The model_type in a checkpoint directory's config.json (tiny names resolved), None when
    there is none to read (a hub id, a missing or unreadable file): a cheap look before loading."""
    try:
        with open(os.path.join(resolve(path), "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def load_processor(path, config, trust_remote_code=False):
    """The family's real transformers processor of a checkpoint (`FAMILIES`): with its
    processor_config.json (or a hub id) the class's own `from_pretrained`; without one (the
    tiny bases, test checkpoints) built from the checkpoint's tokenizer, image processor and
    chat template (`build_hf_processor`). A model_type outside FAMILIES (trust_remote_code
    only) loads with AutoProcessor."""
    if config.model_type not in FAMILIES:
        return transformers.AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "processor_config.json")):
        return processor_class(config.model_type).from_pretrained(path, trust_remote_code=trust_remote_code)
    tok = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    improc = transformers.AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    template = None  # a processor-level template file wins over the tokenizer's, as in from_pretrained
    if os.path.exists(os.path.join(path, "chat_template.json")):
        with open(os.path.join(path, "chat_template.json")) as f:
            template = json.load(f).get("chat_template")
    return build_hf_processor(tok, improc, config, template)


def save_backbone(model, proc, path):
    """save_pretrained model + tokenizer + image processor into `path` atomically
    (written to a temp dir, then renamed over; an existing `path` is moved aside first, so
    at every instant one complete checkpoint is at `path` or at `path.old`)."""
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
    turns or None (`VLProcessor.encode`). Stops at any of the checkpoint's stop ids
    (`VLProcessor.stop_ids`, e.g. LLaVA-NeXT's </s>, Gemma3's <end_of_turn>); a row's text and
    count end at its first one (counted). Bounded by `max_new_tokens` even if the model never
    emits one."""
    batch = proc.encode(images, questions, pixels=pixels, history=history)
    batch = {k: v.to(model.device) for k, v in batch.items()}
    gen_kw.setdefault("do_sample", False)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, eos_token_id=proc.stop_ids,
                         pad_token_id=proc.pad_token_id, **gen_kw)
    new = out[:, batch["input_ids"].shape[1]:]
    texts, lens = [], []
    for row in new.tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in proc.stop_ids), len(row))
        texts.append(proc.decode(row[:n]))
        lens.append(n)
    return texts, lens
