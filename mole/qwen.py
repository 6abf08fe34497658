"""MoLE's adapter for the repo's `common.backbone.VLProcessor` (Qwen chat format): Qwen2-VL /
Qwen2.5-VL / Qwen3-VL(-MoE) with M-RoPE positions from `get_rope_index`, and LLaVA-NeXT
(`LlavaNextVLProcessor`, same chat format, plain 1-D positions).

    <|im_start|>user\\n<|vision_start|> V <|vision_end|> Q | latents | <|im_end|>\\n<|im_start|>assistant\\n Y

`MoLE(model, proc)` with such a processor picks `QwenVLAdapter` by itself; everything here
is what `mole.model.MoLE` did for Qwen before the adapter interface existed (same ids, same
positions, same batch keys)."""
from mole.model import VLMAdapter, cumulative_positions


class QwenVLAdapter(VLMAdapter):
    """`VLMAdapter` over a `common.backbone.VLProcessor` (or subclass: `LlavaNextVLProcessor`,
    `mole.checkpoint.PlaceholderProcessor`).

    model: the VLM; proc: its VLProcessor. Positions: M-RoPE ids [3,B,L] from the model's
    `get_rope_index` when it has one (Qwen-VL), else the cumulative attention mask [B,L]."""

    TAIL = "<|im_end|>\n<|im_start|>assistant\n"

    def __init__(self, model, proc):
        self.model, self.proc = model, proc
        self.image_token_id = proc.image_token_id
        self.pad_token_id, self.eos_token_id = proc.pad_token_id, proc.eos_token_id
        self._tail = proc.tokenizer(self.TAIL, add_special_tokens=False)["input_ids"]
        self._rope = getattr(getattr(model, "model", None), "get_rope_index", None)

    def tail_ids(self):
        return list(self._tail)

    def text_ids(self, text):
        return self.proc.text_ids(text)

    def decode(self, ids):
        return self.proc.decode(ids)

    def prompts(self, images, questions, pixels=None, n_images=None):
        """Per question the prompt ids (one vision block per image, `_prompt_ids`) and the vision
        tensors of all images (`VLProcessor.vision`: pixel_values + image_grid_thw for Qwen-VL,
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
        """Prompt ids with one vision block `<|vision_start|> pads <|vision_end|>` per image
        (n_tokens: image tokens per image, in order).

        One image: exactly `VLProcessor.prompt_ids`. Several images: a question that keeps one
        "<image>" placeholder per image (what `common.data` readers give for a multi-image
        record) gets each image's block at its placeholder (a newline right after a placeholder
        is dropped, as for one image); a question without placeholders gets all blocks first,
        then the question. So "<image>\\n<image>\\nQ" and "Q" give the same ids.
        Raises ValueError for a placeholder count that is neither 0 nor the image count."""
        proc, tail = self.proc, self._tail
        if len(n_tokens) == 1:
            return proc.prompt_ids(question, n_tokens[0])
        n_ph = question.count("<image>")
        if n_ph not in (0, len(n_tokens)):
            raise ValueError(f"a question with {len(n_tokens)} images has {n_ph} '<image>' placeholders; put one "
                             f"per image, in order (or none: the images then come first)")
        segs = question.replace("<image>\n", "<image>").split("<image>") if n_ph else [""] * len(n_tokens) + [question]
        tok = proc.tokenizer.convert_tokens_to_ids
        vs, ve = tok("<|vision_start|>"), tok("<|vision_end|>")
        empty = proc.prompt_ids("", 0)  # <|im_start|>user\n + the assistant header
        ids = empty[:len(empty) - len(tail)] + (proc.text_ids(segs[0]) if segs[0] else [])
        for n, seg in zip(n_tokens, segs[1:]):
            ids += [vs] + [proc.image_token_id] * n + [ve] + (proc.text_ids(seg) if seg else [])
        return ids + tail

    def batch_extras(self, input_ids, attention_mask):
        """mm_token_type_ids (1 at image tokens) for models that take them (Qwen-VL)."""
        if not getattr(self.proc, "mm_token_types", True):
            return {}
        return {"mm_token_type_ids": (input_ids == self.image_token_id).long() * attention_mask}

    def positions(self, input_ids, attention_mask, batch):
        """Explicit M-RoPE position ids [3,B,L] (needed with a 4D mask: transformers would
        index the 4D mask as 2D inside get_rope_index); latents count as text tokens.
        Without `get_rope_index` (LLaVA-NeXT): `cumulative_positions` [B,L]."""
        if self._rope is None:
            return cumulative_positions(attention_mask)
        vocab = self.model.get_input_embeddings().weight.shape[0]
        ids = input_ids.clamp(max=vocab - 1)
        pos, _ = self._rope(ids, batch["mm_token_type_ids"], image_grid_thw=batch["image_grid_thw"],
                            attention_mask=attention_mask)
        return pos
