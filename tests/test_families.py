"""Every supported VLM family through one prompt path: each built tiny and offline with its real
transformers processor class, tokenizer class (Qwen2Tokenizer, LlamaTokenizer for the Vicuna and
Mistral LLaVAs, GemmaTokenizer) and a chat template in the family's real format, saved with
`save_pretrained` and loaded back with `common.backbone.load_backbone`, as a researcher's
checkpoint would be. Checks: prompt ids and every model input equal the processor's own
`apply_chat_template(..., tokenize=True)`; labels cover exactly the answer and its terminator;
generation stops at the family's end token; the entry points run on it."""
import importlib
import json
import os
import random
import string

import pytest
import torch
import transformers
from PIL import Image

from common import backbone as bb
from common import shapes
from common.cli import run_cli
from eval import evaluate
from helpers import error_of
from mod import data as mdata
from mod import infer as minfer
from mod import train as mtrain
from mole import diagnostics as odiag
from mole import infer as oinfer
from mole import train as otrain
from rolemerge import calibrate
from rolemerge import infer as rinfer

# Qwen2-VL / Qwen2.5-VL (Qwen2-VL-2B-Instruct, Qwen2.5-VL-3B-Instruct): a default system turn.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
# Qwen3-VL-Instruct (its tool-call and reasoning branches left out): no default system turn.
QWEN3_VL_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}{%- if messages[0].content is string %}"
    "{{- messages[0].content }}{%- else %}{%- for content in messages[0].content %}{%- if 'text' in content %}"
    "{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{%- elif 'text' in content %}{{- content.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.content is string %}{{- message.content }}{%- else %}"
    "{%- for item in message.content %}{%- if 'text' in item %}{{- item.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}")
# llava-1.5-7b-hf and llava-v1.6-vicuna-7b-hf (chat_template.json): the answer ends with a space, no </s>.
VICUNA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}{% for content in "
    "message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
    "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'ASSISTANT:' }}{% endif %}")
# llava-v1.6-mistral-7b-hf (chat_template.json).
MISTRAL_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<<SYS>>\n' + message['content'][0]['text'] "
    "+ '\n<</SYS>>\n\n' }}{% elif message['role'] == 'user' %}{{ '[INST] ' }}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'][0]['text'] + '</s> '}}{% else %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
# gemma-3-4b-it (tokenizer_config.json).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n")

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "llava_next_vicuna",
            "llava_next_mistral", "gemma3"]
# the token every family's assistant turn ends with (the Vicuna template writes none: </s> is appended)
TERMINATOR = {"qwen2_vl": "<|im_end|>", "qwen2_5_vl": "<|im_end|>", "qwen3_vl": "<|im_end|>",
              "qwen3_vl_moe": "<|im_end|>", "llava": "</s>", "llava_next_vicuna": "</s>",
              "llava_next_mistral": "</s>", "gemma3": "<end_of_turn>"}
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512)


def _sentencepiece_vocab(specials):
    """A byte-fallback sentencepiece-style vocabulary: specials, the 256 byte tokens, printable
    characters and the word-start mark; any text encodes (one token per character)."""
    chars = ["▁"] + [c for c in string.printable if c not in " \t\r\x0b\x0c"]
    return {t: i for i, t in enumerate(specials + [f"<0x{i:02X}>" for i in range(256)] + chars)}


def llama_tokenizer(template):
    tok = transformers.LlamaTokenizer(vocab=_sentencepiece_vocab(["<unk>", "<s>", "</s>"]), merges=[],
                                      add_bos_token=True)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = template
    return tok


def gemma_tokenizer():
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                "<end_of_image>", "<image_soft_token>"]
    tok = transformers.GemmaTokenizer(vocab=_sentencepiece_vocab(specials), merges=[], extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    tok.add_special_tokens({"additional_special_tokens": specials[5:]})
    tok.chat_template = GEMMA3_TEMPLATE
    return tok


def build_family(name, seed=0):
    """(model, transformers processor, generation eos ids) of a tiny random `name` VLM."""
    torch.manual_seed(seed)
    if name.startswith("qwen"):
        tok = bb.build_tokenizer()
        tok.chat_template = QWEN3_VL_TEMPLATE if name.startswith("qwen3") else QWEN2_VL_TEMPLATE
        arch = {"qwen2_vl": "qwen2_5_vl"}.get(name, name)
        cfg = bb.tiny_config(arch, tok, hidden=64, layers=2)
        if name == "qwen2_vl":  # Qwen2-VL: the Qwen2.5-VL text config, its own vision tower
            cfg = transformers.Qwen2VLConfig(
                text_config=cfg.text_config.to_dict(), vision_config=dict(
                    depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2),
                **{k: getattr(cfg, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                "vision_end_token_id")})
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
        proc = bb.build_hf_processor(tok, bb.build_image_processor(), cfg)
        eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    elif name.startswith("llava"):
        tok = llama_tokenizer(MISTRAL_TEMPLATE if name.endswith("mistral") else VICUNA_TEMPLATE)
        text = dict(TEXT, model_type="mistral" if name.endswith("mistral") else "llama", vocab_size=len(tok),
                    bos_token_id=1, eos_token_id=2, pad_token_id=None)
        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
        img = tok.convert_tokens_to_ids("<image>")
        if name == "llava":
            cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=img,
                                           vision_feature_layer=-1)
            ip = transformers.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        else:
            cfg = transformers.LlavaNextConfig(text_config=text, vision_config=vision, image_token_index=img,
                                               image_grid_pinpoints=[[28, 28], [28, 56]], vision_feature_layer=-1)
            ip = transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 28},
                                                         crop_size={"height": 28, "width": 28},
                                                         image_grid_pinpoints=[[28, 28], [28, 56]])
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
        proc = bb.build_hf_processor(tok, ip, cfg)
        eos = [2]
    else:
        tok = gemma_tokenizer()
        cfg = transformers.Gemma3Config(
            text_config=dict(TEXT, vocab_size=len(tok), sliding_window=8, pad_token_id=0, bos_token_id=2,
                             eos_token_id=1, layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=7),
            mm_tokens_per_image=4, image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
            eoi_token_index=tok.eoi_token_id)
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
        with torch.no_grad():  # Gemma3 initialises its projection to zero: the image would carry nothing
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.2)
        proc = bb.build_hf_processor(tok, transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), cfg)
        eos = [1, tok.convert_tokens_to_ids("<end_of_turn>")]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = proc.tokenizer.pad_token_id
    return model.eval(), proc


def save_family(name, path):
    """save_pretrained of model + processor, as a researcher's checkpoint directory: Qwen-VL
    saves tokenizer + image processor (its processor class needs a video processor here)."""
    model, proc = build_family(name)
    model.save_pretrained(path)
    if name.startswith("qwen"):
        proc.tokenizer.save_pretrained(path)
        proc.image_processor.save_pretrained(path)
    else:
        proc.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, checkpoint dir, model, VLProcessor) loaded by `load_backbone`."""
    path = save_family(request.param, str(tmp_path_factory.mktemp(request.param) / "ckpt"))
    model, proc = bb.load_backbone(path)
    return request.param, path, model, proc


def reference_processor(path):
    """The family's transformers processor loaded on its own (`processor_class(...).from_pretrained`)."""
    with open(os.path.join(path, "config.json")) as f:
        return bb.processor_class(json.load(f)["model_type"]).from_pretrained(path)


def examples(n=3, seed=0):
    rng = random.Random(seed)
    ex = [shapes.sample_example(rng) for _ in range(n)]
    ims = [shapes.render(s) for s, _, _, _ in ex]
    ims[1] = ims[1].resize((60, 30))  # another size: LLaVA-NeXT picks another tile grid
    return ims, [q for _, _, q, _ in ex], ["yes", "two", "A red circle."][:n]


def user(image, question):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


def test_prompt_ids_and_inputs_equal_the_processors_own(family):
    name, path, model, proc = family
    ref = reference_processor(path)
    ims, qs, _ = examples()
    for im, q in zip(ims, qs):
        want = ref.apply_chat_template(user(im, q), add_generation_prompt=True, tokenize=True, return_dict=True,
                                       return_tensors="pt")
        got = proc.encode([im], [q])
        assert got["input_ids"].tolist() == want["input_ids"].tolist(), name
        for k, v in want.items():
            if k != "attention_mask":
                assert torch.equal(got[k], v), (name, k)
        assert set(got) == set(want), name
    text = ref.apply_chat_template(user(ims[0], qs[0]), add_generation_prompt=True)
    if name in ("qwen2_vl", "qwen2_5_vl"):  # the template's own system turn is there
        assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    with torch.no_grad():  # the batch runs through the model as it is
        model(**proc.encode(ims, qs))


def test_markers_are_control_tokens_not_characters(family):
    """The template's markers are single tokens (on today's main a Llama tokenizer split the
    hard-coded <|im_start|> into characters); a question that spells one is kept as text."""
    name, _, _, proc = family
    ids = proc.prompt_ids("Q?", 0)
    assert proc.tokenizer.convert_tokens_to_ids(TERMINATOR[name]) == proc.eos_token_id
    assert proc.tokenizer.unk_token_id not in ids
    marker = "<start_of_turn>" if name == "gemma3" else "<image>" if "llava" in name else "<|im_start|>"
    sneaky = proc.prompt_ids(f"say {marker} now", 0)
    assert sneaky.count(proc.tokenizer.convert_tokens_to_ids(marker)) == ids.count(
        proc.tokenizer.convert_tokens_to_ids(marker))


def test_labels_cover_exactly_the_answer_and_its_terminator(family):
    name, path, _, proc = family
    ref = reference_processor(path)
    ims, qs, answers = examples()
    batch = proc.encode(ims, qs, answers)
    for i, (im, q, a) in enumerate(zip(ims, qs, answers)):
        conv = user(im, q) + [{"role": "assistant", "content": [{"type": "text", "text": a}]}]
        full = ref.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        head = ref.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"]
        full, head = (x[0] if isinstance(x[0], list) else x for x in (full, head))
        lab = batch["labels"][i][batch["labels"][i] != -100].tolist()
        term = proc.tokenizer.convert_tokens_to_ids(TERMINATOR[name])
        assert lab[-1] == term and lab.count(term) == 1, name
        if name in ("llava", "llava_next_vicuna"):  # the template writes "answer " and no end token
            assert full[:len(head)] == head and proc.tokenizer.decode(full[len(head):]).strip() == a
            assert proc.decode(lab) == a
        else:
            assert lab == full[len(head):len(head) + len(lab)], name
        n = int(batch["attention_mask"][i].sum())
        assert batch["input_ids"][i, :n].tolist()[:len(head)] == head  # prompt, then the labelled answer
        assert batch["input_ids"][i, n - len(lab):n].tolist() == lab


def test_generation_stops_at_the_familys_end_token(family):
    """A model that emits the family's end token at every step stops after 1 token (on today's
    main LLaVA-NeXT's stop token was <unk> and all max_new_tokens were generated)."""
    name, _, model, proc = family
    end = proc.tokenizer.convert_tokens_to_ids(TERMINATOR[name])
    calls = []
    hook = model.lm_head.register_forward_hook(
        lambda m, i, out: calls.append(1) or out.index_fill(-1, torch.tensor([end]), 1e4))
    try:
        ims, qs, _ = examples()
        texts, n = bb.generate(model, proc, ims, qs, max_new_tokens=24)
    finally:
        hook.remove()
    assert n == [1, 1, 1] and texts == ["", "", ""], name
    assert len(calls) == 1, name  # the model ran once: generation itself stopped, not only the count


@pytest.fixture(scope="module")
def shapes_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    shapes.generate_split(str(d), "train", 4)
    shapes.generate_split(str(d), "test", 3)
    return d


def test_every_entry_point_runs_on_the_family(family, shapes_data, tmp_path):
    """eval.evaluate, mod.data / train / infer, mole.train / infer / diagnostics from their
    command lines on the family's checkpoint (on today's main: Gemma3 refused, mole.train on
    LLaVA-NeXT KeyError 'image_grid_thw'); rolemerge.calibrate / infer on the MoE family."""
    name, ck, _, _ = family
    test, out = str(shapes_data / "test.json"), str(tmp_path)
    rows = evaluate.main(["--model", ck, "--data", test, "--out", out + "/ev.json", "--max-new-tokens", "3"])
    assert rows and json.load(open(out + "/ev.json"))["results"]
    mdata.main(["--model", ck, "--data", test, "--out", out + "/md.json", "--num-return-sequences", "2", "--max-new-tokens", "3"])
    res = mtrain.main(["--model", ck, "--data", str(shapes_data / "train.json"), "--out", out + "/mod", "--steps", "2",
                       "--batch-size", "2"])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in res["log"])
    minfer.main(["--model", ck, "--adapter", out + "/mod", "--data", test, "--methods", "base,single",
                 "--max-new-tokens", "3"])
    otrain.main(["--model", ck, "--data", str(shapes_data), "--out", out + "/mole", "--batch-size", "2",
                 "--stage1-epochs", "0.5", "--stage2-epochs", "0.5", "--quiet", "--device", "cpu"])
    oinfer.main(["--ckpt", out + "/mole", "--data", test, "--max-new-tokens", "3", "--device", "cpu"])
    odiag.main(["--ckpt", out + "/mole", "--data", test, "--device", "cpu"])
    if name == "qwen3_vl_moe":
        calibrate.main(["--model", ck, "--data", test, "--out", out + "/stats.safetensors", "--max-new-tokens", "3"])
        rinfer.main(["--model", ck, "--data", test, "--max-new-tokens", "3", "--out", out + "/ri.json"])


@pytest.mark.parametrize("entry", ["eval.evaluate", "mod.train", "mole.train"])
def test_a_family_outside_the_list_is_refused_by_name_before_loading(entry, tmp_path, shapes_data, capsys,
                                                                    monkeypatch):
    """A checkpoint of an unsupported family (here Idefics3: only its config.json, no weights)
    gets `error: ... 'idefics3' is not supported; supported VLMs: ...`, exit 2, before any
    processor or weights load."""
    ck = tmp_path / "idefics3"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"model_type": "idefics3"}))
    monkeypatch.setattr(bb, "load_processor", lambda *a, **k: pytest.fail("the processor loaded"))
    main = importlib.import_module(entry).main
    args = {"eval.evaluate": ["--data", str(shapes_data / "test.json"), "--out", str(tmp_path / "e.json")],
            "mod.train": ["--data", str(shapes_data / "train.json"), "--out", str(tmp_path / "r"), "--steps", "1"],
            "mole.train": ["--data", str(shapes_data), "--out", str(tmp_path / "m"), "--quiet", "--device", "cpu"]}
    err = error_of(lambda argv: run_cli(main, argv), ["--model", str(ck), *args[entry]], capsys)
    assert "error: " in err and "'idefics3' is not supported" in err
    assert all(f in err for f in ("qwen2_5_vl", "llava_next", "gemma3")), err


def test_evaluation_uses_lmms_evals_settings_for_qwen2_5_vl_unless_asked_otherwise(tmp_path_factory, tmp_path):
    """Qwen2.5-VL in eval.evaluate: lmms-eval's chat class's settings by default (the template's
    system turn, written once; its pixel bounds: a
    2800x2100 photo: at most 1,605,632 px = 2,048 visual tokens; an 84 px image: at least
    256 * 28 * 28 px = 256 tokens), the checkpoint's own with --prompt-settings checkpoint."""
    ck = save_family("qwen2_5_vl", str(tmp_path_factory.mktemp("q25") / "ckpt"))
    model, proc = bb.load_backbone(ck)
    big, small = Image.new("RGB", (2800, 2100), (9, 9, 9)), Image.new("RGB", (84, 84), (9, 9, 9))
    assert evaluate.apply_prompt_settings(model, proc, "checkpoint") == {}
    own = proc.vision([big])[1] + proc.vision([small])[1]
    assert evaluate.apply_prompt_settings(model, proc, "lmms-eval")["class"] == "qwen2_5_vl (chat)"
    assert proc.vision([big])[1] == [2028] and proc.vision([small])[1] == [256]
    assert own == [12, 9]  # the tiny family's own processor keeps <= 112x112 px
    ids = proc.prompt_ids("Q?", 0)
    text = proc.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert text.count("<|im_start|>system") == 1  # the template's default system turn is not added twice
    path = tmp_path / "d"
    shapes.generate_split(str(path), "test", 2)
    evaluate.main(["--model", ck, "--data", str(path / "test.json"), "--out", str(tmp_path / "e.json"),
                   "--max-new-tokens", "2", "--prompt-settings", "checkpoint"])
    assert json.load(open(tmp_path / "e.json"))["prompt_settings"] == {"name": "checkpoint"}


def test_evaluate_scores_a_text_moe_through_its_chat_template(tmp_path, capsys, monkeypatch):
    """eval.evaluate on a text MoE RoleMerge merges (a tiny Qwen3-MoE with a ChatML template):
    prompts from its template, stops at its end token; records with images are refused."""
    tok = bb.build_tokenizer()
    cfg = transformers.Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    ck = str(tmp_path / "moe")
    model.save_pretrained(ck)
    tok.save_pretrained(ck)
    model, proc = bb.load_backbone(ck, text_lms=True)
    prompt = proc.tokenizer.decode(proc.prompt_ids("Hi?", 0))
    assert prompt == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    assert proc.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") and proc.extras(torch.ones(1, 2).long(),
                                                                                       torch.ones(1, 2).long()) == {}
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"Is {i} even?", "answer": "yes",
                                        "family": "existence"}) + "\n" for i in range(3)))
    evaluate.main(["--model", ck, "--data", str(data), "--out", str(tmp_path / "e.json"), "--max-new-tokens", "3"])
    assert len(json.load(open(tmp_path / "e.json"))["results"]) == 3
    with pytest.raises(bb.BackboneError, match="'qwen3_moe' is not supported; supported VLMs"):
        bb.load_backbone(ck)  # the VLM entry points do not take it
    shapes.generate_split(str(tmp_path / "img"), "test", 1)
    monkeypatch.setattr(evaluate, "load_backbone", lambda *a, **k: pytest.fail("the model loaded"))
    argv = ["--model", ck, "--data", str(tmp_path / "img" / "test.json"), "--out", str(tmp_path / "i.json")]
    err = error_of(lambda args: run_cli(evaluate.main, args), argv, capsys)
    assert "error: " in err and "is a text model (qwen3_moe); 1 record(s)" in err


def test_a_checkpoint_without_a_chat_template_is_refused_by_name(tmp_path, monkeypatch):
    """No chat template (a base, not an instruct, checkpoint): `error:` naming it, exit 2; no
    prompt format is made up for it."""
    ck = save_family("llava_next_vicuna", str(tmp_path / "ck"))
    for f in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(ck, f)):
            os.remove(os.path.join(ck, f))
    cfg = json.load(open(os.path.join(ck, "processor_config.json")))
    cfg.pop("chat_template", None)
    json.dump(cfg, open(os.path.join(ck, "processor_config.json"), "w"))
    tc = json.load(open(os.path.join(ck, "tokenizer_config.json")))
    tc.pop("chat_template", None)
    json.dump(tc, open(os.path.join(ck, "tokenizer_config.json"), "w"))
    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained",
                        lambda *a, **k: pytest.fail("the weights loaded"))
    with pytest.raises(bb.BackboneError, match="its processor has no chat template"):
        bb.load_backbone(ck)
