"""The model-family side of MoLE, below `mole/model.py` (which imports this module, never the
reverse): what MoLE takes from transformers and from the wrapped VLM, and the prompt adapters.

From the model itself (its class and config, never from which processor built the inputs):
  * `text_model(model)`: the decoder stack. Qwen2/2.5/3-VL, LLaVA(-NeXT), Gemma3, Mistral3,
    InternVL: `model.model.language_model`; Idefics3 / SmolVLM: `model.model.text_model`; Llama4:
    `model.language_model.model`; a causal LM: `model.model`. Anything else: ValueError naming it.
  * `token_type_inputs(model, input_ids)`: the token-type tensors the model's forward takes,
    rebuilt from the ids after the latents are inserted (latents count as text), as the family's
    processor builds them: Qwen-VL `mm_token_type_ids` (1 image, 2 video tokens; `get_rope_index`
    reads them), Gemma3 `token_type_ids` (1 at image tokens: its bidirectional image blocks).
  * `model_positions(model, input_ids, attention_mask, batch)`: the model's own position ids:
    M-RoPE [3,B,L] from its `get_rope_index` (Qwen2/2.5/3-VL; latents count as text tokens), else
    1-D [B,L] from the attention mask (`cumulative_positions`, what `generate` gives Gemma3, LLaVA,
    Idefics3: none of them has a position function of its own).
  * Attention: `register_attention(name, fn)` registers MoLE's attention function with a mask
    builder (`base_mask`) that always materialises the base's own boolean mask, so the function
    gets, per layer, exactly the mask the base would use (causal, padding, sliding window, Gemma3's
    bidirectional image blocks) and applies MoLE's topology on top of it.
    `sdpa_attention_forward` is transformers' SDPA kernel.
  * `check_served(model)`: ValueError naming a family that cannot be served (`UNSERVED`).

From the processor (how prompts are built around the images, where the latents go): a
`VLMAdapter`. `ChatVLMAdapter` takes any transformers multimodal processor with a chat template
(Gemma3, Qwen2.5-VL, LLaVA(-NeXT), Idefics3, ...); `QwenVLAdapter` the repo's `VLProcessor`
(`common.backbone`: every supported family in its own chat template). `adapter_for` picks one."""
import inspect

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

__all__ = ["TEXT_KEYS", "UNSERVED", "ChatVLMAdapter", "QwenVLAdapter", "VLMAdapter", "adapter_for", "base_mask",
           "check_served", "cumulative_positions", "model_positions", "register_attention",
           "sdpa_attention_forward", "text_model", "token_type_inputs"]

# batch entries that are not the model's vision inputs (token types are rebuilt from the ids)
TEXT_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids")

# families MoLE cannot serve, by config.model_type, with the reason
UNSERVED = {
    "llama4": "transformers' Llama4ForConditionalGeneration.forward fails on every call in the pinned version "
              "(it reads `image_outputs` from its language model's output, which has no such field)",
}


# ----------------------------------------------------------------------------- the model's decoder

def text_model(model):
    """The decoder stack of a transformers VLM or causal LM: the module whose `layers` are the
    decoder layers. Looked up as `model.model.language_model` (Qwen-VL, LLaVA(-NeXT), Gemma3,
    Mistral3, InternVL), `model.model.text_model` (Idefics3, SmolVLM), `model.language_model`
    (Llama4: a causal LM, whose `.model` is taken), `model.model` (causal LMs); never a vision
    tower. Raises ValueError naming the class when none holds a `layers` nn.ModuleList.
    (Same function as `common.backbone.text_model` and `mod.model.text_model`: each copy unit
    keeps its own; tested equal.)"""
    inner = getattr(model, "model", None)
    for found in (getattr(inner, "language_model", None), getattr(inner, "text_model", None),
                  getattr(model, "language_model", None), getattr(model, "text_model", None), inner, model):
        for m in (found, getattr(found, "model", None)):  # a causal LM wraps its decoder in `.model`
            if isinstance(getattr(m, "layers", None), torch.nn.ModuleList):
                return m
    raise ValueError(f"{type(model).__name__}: no decoder stack found (looked for model.language_model, "
                     f"model.text_model, language_model, model with a `layers` ModuleList); this family is "
                     f"not supported")


def check_served(model):
    """Raise ValueError if MoLE cannot serve this family (`UNSERVED`, by config.model_type)."""
    why = UNSERVED.get(getattr(model.config, "model_type", None))
    if why:
        raise ValueError(f"{type(model).__name__}: MoLE cannot serve this family: {why}")


# ----------------------------------------------------------------------------- inputs from the model

def cumulative_positions(attention_mask):
    """Plain 1-D position ids [B,L] of a padded batch: cumulative attention mask - 1 (0 on
    left pads), so every row counts from 0 at its first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _config_id(cfg, *names):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return None


def image_token_id(model):
    """The id of the model's image tokens (config image_token_id / image_token_index), or None."""
    return _config_id(model.config, "image_token_id", "image_token_index")


def _forward_params(model):
    return inspect.signature(type(model).forward).parameters


def token_type_inputs(model, input_ids):
    """The token-type tensors the model's forward takes, from the ids (long [B,L]; latent ids past
    the vocabulary count as text): `mm_token_type_ids` (1 image, 2 video tokens: Qwen-VL, whose
    `get_rope_index` reads them) and/or `token_type_ids` (1 at image tokens: Gemma3, whose image
    blocks attend bidirectionally), each only if the forward has that parameter. Returns a dict
    (empty for LLaVA, Idefics3, ...)."""
    params, cfg, out = _forward_params(model), model.config, {}
    img = (input_ids == image_token_id(model)).long()
    if "mm_token_type_ids" in params:
        vid = _config_id(cfg, "video_token_id", "video_token_index")
        out["mm_token_type_ids"] = img + 2 * (input_ids == vid).long() if vid is not None else img
    if "token_type_ids" in params:
        out["token_type_ids"] = img
    return out


def model_positions(model, input_ids, attention_mask, batch):
    """The model's own position ids for a MoLE sequence (needed explicitly: MoLE passes
    inputs_embeds). With `model.model.get_rope_index` (Qwen2/2.5/3-VL M-RoPE): its [3,B,L]
    ids from the token types (`token_type_inputs`: latents are text) and the batch's
    image_grid_thw / video_grid_thw; else `cumulative_positions` [B,L] (models whose positions
    are the token count: Gemma3, LLaVA, Idefics3, ...).
    input_ids [B,L] (latent ids >= vocab allowed), attention_mask [B,L], batch: the vision inputs."""
    rope = getattr(getattr(model, "model", None), "get_rope_index", None)
    if rope is None:
        return cumulative_positions(attention_mask)
    types = token_type_inputs(model, input_ids).get("mm_token_type_ids")
    if types is None:
        types = (input_ids == image_token_id(model)).long()
    vocab = model.get_input_embeddings().weight.shape[0]
    pos, _ = rope(input_ids.clamp(max=vocab - 1), types * attention_mask.long(),
                  image_grid_thw=batch.get("image_grid_thw"), video_grid_thw=batch.get("video_grid_thw"),
                  attention_mask=attention_mask)
    return pos


# ----------------------------------------------------------------------------- attention registration

def base_mask(*args, **kwargs):
    """transformers' SDPA mask builder (boolean [B,1,Q,K], True = attend) that never skips
    materialising the mask (`allow_is_causal_skip=False`): the registered attention function
    always gets the base's own mask of the layer, never None."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_attention(name, fn):
    """Register `fn` as transformers attention implementation `name`, with `base_mask` as its
    mask builder (a name missing from AttentionMaskInterface makes transformers build no mask:
    padding would silently vanish)."""
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, base_mask)


# ----------------------------------------------------------------------------- prompt adapters (processor side)

class VLMAdapter:
    """The processor side of MoLE: how prompts are built around the images, where the latents
    go, which id marks a visual token. `MoLE` touches the processor only through this interface.

    Attributes: proc (the processor, kept as `MoLE.proc`), image_token_id (the id of every
    visual token in input_ids), pad_token_id, eos_token_id (ends an answer; labels include it).
    Methods:
      tail_ids() -> list[int]: the ids every prompt ends with (the assistant header); the
        latents are inserted right before them;
      prompts(images, questions, pixels=None, n_images=None) -> (rows, vision): per question
        its prompt ids (image tokens expanded, ending with tail_ids()) and the vision tensors
        of the batch as a dict (what the model takes besides ids, e.g. pixel_values);
      text_ids(text) -> ids of user text; answer_ids(text) -> an answer's ids, terminator
        included (the labelled span); decode(ids) -> str;
      model_inputs(batch) -> the batch's vision tensors (every entry but ids, mask, labels and
        token types), which the VLM's forward gets next to inputs_embeds, the attention mask,
        positions and the token types of `token_type_inputs`.
    Positions and token types come from the model (`model_positions`, `token_type_inputs`),
    never from the adapter: the same model gets the same positions from any processor.
    Subclasses: `QwenVLAdapter` (the repo's VLProcessor: the checkpoint's chat template) and
    `ChatVLMAdapter` (a transformers multimodal processor with a chat template)."""

    proc = None
    image_token_id = pad_token_id = eos_token_id = None

    def tail_ids(self):
        raise NotImplementedError

    def prompts(self, images, questions, pixels=None, n_images=None):
        raise NotImplementedError

    def text_ids(self, text):
        raise NotImplementedError

    def decode(self, ids):
        raise NotImplementedError

    def answer_ids(self, answer):
        """The ids of an assistant answer, terminator included (labels); default: its text ids +
        eos_token_id."""
        return self.text_ids(answer) + [self.eos_token_id]

    def model_inputs(self, batch):
        return {k: v for k, v in batch.items() if k not in TEXT_KEYS}


class ChatVLMAdapter(VLMAdapter):
    """Generic `VLMAdapter` for a transformers multimodal processor (`ProcessorMixin`: a
    tokenizer with a chat template + an image processor; Gemma3Processor, LlavaProcessor, ...)
    and its VLM (positions and token types come from the model, whatever its family).

    model: the VLM (its config's image_token_id / image_token_index marks visual tokens);
    processor: its processor. Prompts are the chat template's user turn (one {"type": "image"}
    entry per image, at the question's "<image>" placeholders if it has one per image, else
    first) + generation prompt; the processor expands the image tokens. The tail (assistant
    header) is what the template puts after the user text; the answer terminator
    (eos_token_id) is the first token the template puts after an assistant answer (e.g.
    Gemma's <end_of_turn>), else the tokenizer's eos. Unlike `QwenVLAdapter`, user text is not
    escaped (special-token strings in a question stay special); pixels= is not supported."""

    _Q, _A = "\x00MoLE-question\x00", "\x00MoLE-answer\x00"

    def __init__(self, model, processor):
        self.model, self.proc = model, processor
        tok = self.tok = getattr(processor, "tokenizer", processor)
        self.image_token_id = image_token_id(model)
        if self.image_token_id is None:
            raise ValueError(f"{type(model).__name__}: its config names no image_token_id / image_token_index; "
                             f"pass a VLMAdapter that sets image_token_id")
        user = [{"role": "user", "content": [{"type": "text", "text": self._Q}]}]
        head = processor.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        self._tail = tok(head.split(self._Q, 1)[1], add_special_tokens=False)["input_ids"]
        if not self._tail:
            raise ValueError("the chat template puts nothing after the user text: no place for the latents")
        eos = None
        try:
            chat = processor.apply_chat_template(
                user + [{"role": "assistant", "content": [{"type": "text", "text": self._A}]}], tokenize=False)
            after = tok(chat.split(self._A, 1)[1], add_special_tokens=False)["input_ids"] if self._A in chat else []
            eos = after[0] if after else None
        except Exception:  # a template without an assistant turn: fall back to the tokenizer's eos
            pass
        self.eos_token_id = eos if eos is not None else tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_token_id

    def tail_ids(self):
        return list(self._tail)

    def text_ids(self, text):
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def _content(self, question, k):
        n_ph = question.count("<image>")
        if n_ph not in (0, k):
            raise ValueError(f"a question with {k} images has {n_ph} '<image>' placeholders; put one "
                             f"per image, in order (or none: the images then come first)")
        segs = question.replace("<image>\n", "<image>").split("<image>") if n_ph else [""] * k + [question]
        content = [{"type": "text", "text": segs[0]}] if segs[0] else []
        for seg in segs[1:]:
            content.append({"type": "image"})
            if seg:
                content.append({"type": "text", "text": seg})
        return content

    def prompts(self, images, questions, pixels=None, n_images=None):
        """Per question the processor's prompt ids and the batch's vision tensors (every output
        of the processor but ids, mask and token types). Raises ValueError with pixels= or a
        question without an image."""
        if pixels is not None:
            raise ValueError("ChatVLMAdapter takes PIL images (images=...), not pre-made pixels")
        per_q = [list(im) if isinstance(im, (list, tuple)) else [im] for im in images]
        if len(per_q) != len(questions) or any(not x or any(im is None for im in x) for x in per_q):
            raise ValueError(f"{len(questions)} questions need one or more images each")
        texts = [self.proc.apply_chat_template([{"role": "user", "content": self._content(q, len(x))}],
                                               add_generation_prompt=True, tokenize=False)
                 for q, x in zip(questions, per_q)]
        out = self.proc(text=texts, images=per_q, return_tensors="pt", padding=True, add_special_tokens=False)
        am = out["attention_mask"].bool()
        rows = [out["input_ids"][i][am[i]].tolist() for i in range(len(texts))]
        return rows, {k: v for k, v in out.items() if k not in TEXT_KEYS}


class QwenVLAdapter(VLMAdapter):
    """`VLMAdapter` over a `common.backbone.VLProcessor` (or its subclass
    `mole.checkpoint.PlaceholderProcessor`): every supported family in its own chat template;
    the latents go right before the template's tail (end of the user turn + assistant header,
    `VLProcessor.tail_ids`).

    model: the VLM; proc: its VLProcessor (its prompt format; positions and token types come
    from the model, as for every adapter)."""

    def __init__(self, model, proc):
        self.model, self.proc = model, proc
        self.image_token_id = proc.image_token_id
        self.pad_token_id, self.eos_token_id = proc.pad_token_id, proc.eos_token_id
        self._tail = proc.tail_ids()

    def tail_ids(self):
        return list(self._tail)

    def text_ids(self, text):
        return self.proc.text_ids(text)

    def decode(self, ids):
        return self.proc.decode(ids)

    def answer_ids(self, answer):
        """The answer's ids as the chat template writes them, terminator included."""
        return self.proc.answer_tokens(answer)

    def prompts(self, images, questions, pixels=None, n_images=None):
        """Per question the prompt ids (every image where the template puts it, `_prompt_ids`)
        and the vision tensors of all images (`VLProcessor.vision`: pixel_values + image_grid_thw for Qwen-VL,
        pixel_values + image_sizes for LLaVA-NeXT). pixels=(pixel_values, image_grid_thw) instead
        of images: the grid rows are the images in order, n_images (one count per question;
        default 1 each) says how many belong to each question.
        Raises ValueError if the image counts do not add up."""
        proc = self.proc
        if pixels is None:
            per_q = [im if isinstance(im, (list, tuple)) else [im] for im in images]
            n_images = [len(x) for x in per_q]
            vis, n_tok = proc.vision([im for x in per_q for im in x])
        else:
            vis, n_tok = proc.vision(pixels=pixels)
            n_images = list(n_images) if n_images is not None else [1] * len(questions)
        if len(n_images) != len(questions) or sum(n_images) != len(n_tok) or min(n_images, default=1) < 1:
            raise ValueError(f"{len(questions)} questions with image counts {n_images} do not fit "
                             f"{len(n_tok)} images (every question needs >= 1 image)")
        rows, start = [], 0
        for q, k in zip(questions, n_images):
            rows.append(self._prompt_ids(q, n_tok[start:start + k]))
            start += k
        return rows, vis

    def _prompt_ids(self, question, n_tokens):
        """Prompt ids with every image (n_tokens: visual tokens per image, in order) where the
        chat template puts it (`VLProcessor.prompt_ids`): several images go at the question's
        "<image>" placeholders (one per image; a newline right after one is dropped), or first
        when it has none, so "<image>\\n<image>\\nQ" and "Q" give the same ids.
        Raises ValueError for a placeholder count that is neither 0 nor the image count."""
        return self.proc.prompt_ids(question, list(n_tokens))


def adapter_for(model, proc):
    """The `VLMAdapter` of (model, proc): proc itself if it is one; `QwenVLAdapter` for the
    repo's `VLProcessor` (anything with `prompt_and_labels`); else `ChatVLMAdapter` (a
    transformers processor with a chat template). Only the prompt format depends on this
    choice; positions, token types and attention come from the model."""
    if isinstance(proc, VLMAdapter):
        return proc
    if hasattr(proc, "prompt_and_labels"):
        return QwenVLAdapter(model, proc)
    return ChatVLMAdapter(model, proc)
