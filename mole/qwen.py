"""MoLE's adapter for the repo's `common.backbone.VLProcessor` (every supported family, each in
its own chat template): Qwen2-VL / Qwen2.5-VL / Qwen3-VL(-MoE) with M-RoPE positions from
`get_rope_index`, and the 1-D-position families (LLaVA, LLaVA-NeXT, Gemma3). The latents go
right before the template's tail (end of the user turn + assistant header, `VLProcessor.tail_ids`):

    <|im_start|>user\\n<|vision_start|> V <|vision_end|> Q | latents | <|im_end|>\\n<|im_start|>assistant\\n Y   (Qwen)

`MoLE(model, proc)` with such a processor picks `QwenVLAdapter` by itself; everything here
is what `mole.model.MoLE` did for Qwen before the adapter interface existed (same ids, same
positions, same batch keys)."""
from mole.model import VLMAdapter, cumulative_positions


class QwenVLAdapter(VLMAdapter):
    """`VLMAdapter` over a `common.backbone.VLProcessor` (or its subclass
    `mole.checkpoint.PlaceholderProcessor`).

    model: the VLM; proc: its VLProcessor. Positions: M-RoPE ids [3,B,L] from the model's
    `get_rope_index` when it has one (Qwen-VL), else the cumulative attention mask [B,L]."""

    def __init__(self, model, proc):
        self.model, self.proc = model, proc
        self.image_token_id = proc.image_token_id
        self.pad_token_id, self.eos_token_id = proc.pad_token_id, proc.eos_token_id
        self._tail = proc.tail_ids()
        self._rope = getattr(getattr(model, "model", None), "get_rope_index", None)

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
        """Prompt ids with every image (n_tokens: visual tokens per image, in order) where the
        chat template puts it (`VLProcessor.prompt_ids`): several images go at the question's
        "<image>" placeholders (one per image; a newline right after one is dropped), or first
        when it has none, so "<image>\\n<image>\\nQ" and "Q" give the same ids.
        Raises ValueError for a placeholder count that is neither 0 nor the image count."""
        return self.proc.prompt_ids(question, list(n_tokens))

    def batch_extras(self, input_ids, attention_mask):
        """The family's token-type tensors (`VLProcessor.extras`: mm_token_type_ids for Qwen-VL,
        token_type_ids for Gemma3; none for LLaVA)."""
        return self.proc.extras(input_ids, attention_mask)

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
