"""Tiny random VLMs of several transformers families, built offline, for the family tests of
MoLE and MoD (imported as `tiny_vlms`: pytest puts tests/ on sys.path).

Each builder returns a model in eval mode (and, where the family's processor builds without
torchvision or extra packages, that real processor class with a chat template in the family's
format). Qwen2.5-VL's processor is the real `Qwen2_5_VLProcessor` without its video processor
(NOTES: the video processor needs torchvision)."""
import torch
from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                          Idefics3Processor, InternVLConfig, InternVLForConditionalGeneration, Llama4Config,
                          Llama4ForConditionalGeneration, LlavaConfig, LlavaForConditionalGeneration,
                          LlavaNextImageProcessorPil, LlavaNextProcessor, Mistral3Config,
                          Mistral3ForConditionalGeneration, PreTrainedTokenizerFast, ProcessorMixin,
                          Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, SmolVLMConfig,
                          SmolVLMForConditionalGeneration)

from common.backbone import build_image_processor, build_tiny, build_tokenizer, tiny_config

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)

# Qwen2.5-VL's chat template (system turn included), trimmed to images and text
QWEN25_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Idefics3's chat template (User: / Assistant: turns, <end_of_utterance>)
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


class Qwen25VLImageProcessor(Qwen2_5_VLProcessor):
    """The real Qwen2_5_VLProcessor for images, without its video processor (NOTES)."""

    def __init__(self, image_processor, tokenizer, chat_template=None):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    @classmethod
    def get_attributes(cls):
        return ["image_processor", "tokenizer"]


def qwen25_vl(layers=2, sliding_window=None, seed=0):
    """Tiny Qwen2.5-VL (M-RoPE; 84 px image -> 9 image tokens) + the real processor. With
    sliding_window, the even layers attend over a sliding window of that many tokens."""
    tok = build_tokenizer()
    cfg = tiny_config("qwen2_5_vl", tok, hidden=64, layers=layers)
    if sliding_window:
        t = cfg.text_config
        t.use_sliding_window, t.sliding_window = True, sliding_window
        t.layer_types = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    return model, Qwen25VLImageProcessor(build_image_processor(), tok, chat_template=QWEN25_TEMPLATE)


def _idefics3_tokenizer():
    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer().backend_tokenizer, eos_token="<end_of_utterance>",
                                  pad_token="<|endoftext|>", bos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]})
    return tok


def _idefics3_like(cls, config_cls, seed):
    tok = _idefics3_tokenizer()
    ip = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 28},
                                   max_image_size={"longest_edge": 28})
    proc = Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE)
    cfg = config_cls(text_config=dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **TEXT),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=28, patch_size=7),
                     scale_factor=2, image_token_id=proc.image_token_id)
    torch.manual_seed(seed)
    return cls(cfg).eval(), proc


def idefics3(seed=0):
    """Tiny Idefics3 (SigLIP-like tower, Llama decoder; a 28 px image -> 4 image tokens) + the
    real Idefics3Processor (no image splitting)."""
    return _idefics3_like(Idefics3ForConditionalGeneration, Idefics3Config, seed)


def smolvlm(seed=0):
    """Tiny SmolVLM (Idefics3's layout, `model.model.text_model`). SmolVLMProcessor needs the
    num2words package (not installed here): its inputs are built by the Idefics3Processor,
    whose image format SmolVLM shares."""
    return _idefics3_like(SmolVLMForConditionalGeneration, SmolVLMConfig, seed)


def llama4(seed=0):
    """Tiny Llama4 VLM (MoE decoder with chunked attention layers; `model.language_model` is a
    causal LM). Its processor needs torchvision: model only."""
    cfg = Llama4Config(
        text_config=dict(vocab_size=300, intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1,
                         interleave_moe_layer_step=1, attention_chunk_size=8, pad_token_id=0, **TEXT),
        vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=7, vision_output_dim=32, projector_input_dim=32,
                           projector_output_dim=32, pixel_shuffle_ratio=0.5),
        image_token_index=299)
    torch.manual_seed(seed)
    return Llama4ForConditionalGeneration(cfg).eval()


def mistral3(seed=0):
    """Tiny Mistral3 (Pixtral tower, Mistral decoder). Model only."""
    cfg = Mistral3Config(text_config=dict(model_type="mistral", vocab_size=300, **TEXT),
                         vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=7,
                                            head_dim=16),
                         image_token_index=299, spatial_merge_size=2)
    torch.manual_seed(seed)
    return Mistral3ForConditionalGeneration(cfg).eval()


def internvl(seed=0):
    """Tiny InternVL (InternViT tower, Qwen2 decoder). Model only."""
    cfg = InternVLConfig(text_config=dict(model_type="qwen2", vocab_size=300, **TEXT),
                         vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, image_size=[28, 28], patch_size=[7, 7]),
                         image_token_id=299)
    torch.manual_seed(seed)
    return InternVLForConditionalGeneration(cfg).eval()


def llava(seed=0):
    """Tiny LLaVA-1.5 (CLIP tower, Llama decoder). Model only."""
    cfg = LlavaConfig(text_config=dict(model_type="llama", vocab_size=300, **TEXT),
                      vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=7,
                                         projection_dim=32),
                      image_token_index=299)
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(cfg).eval()


def repo_tiny(arch):
    """A family the repo builds itself (`common.backbone.build_tiny`): model only."""
    return build_tiny(arch, hidden=64, layers=2)[0].eval()


# LLaVA-NeXT's (Vicuna) chat template: "USER: <image>\n... ASSISTANT:"
LLAVA_NEXT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'user' %} {% else %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def llava_next(seed=0):
    """Tiny LLaVA-NeXT (`common.backbone.build_tiny`: CLIP tower, Llama decoder, one 28 px tile)
    + the real LlavaNextProcessor over a tokenizer with `<image>` and `</s>` and a Vicuna template."""
    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer().backend_tokenizer, eos_token="</s>",
                                  pad_token="<|endoftext|>", bos_token="<s>")
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "</s>", "<s>"]})
    model = build_tiny("llava_next", hidden=64, layers=2, seed=seed)[0]
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.config.image_token_index = model.config.image_token_id = tok.convert_tokens_to_ids("<image>")
    ip = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                    image_grid_pinpoints=[[28, 28]])
    proc = LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=14, num_additional_image_tokens=1,
                              vision_feature_select_strategy=model.config.vision_feature_select_strategy,
                              image_token="<image>", chat_template=LLAVA_NEXT_TEMPLATE)
    return model.eval(), proc
