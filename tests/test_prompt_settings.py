"""`eval.evaluate --prompt-settings`: with `lmms-eval` every family's model inputs equal what
lmms-eval 0.7.3's own model class builds for it (its code rewritten here, file:line in
`eval.evaluate.LMMS_EVAL`: system turn, image placement, JPEG re-encoding, qwen_vl_utils' resize,
the processor's size bounds); with `checkpoint` they equal the processor's own
`apply_chat_template`. Each family is built tiny and offline with its real transformers processor
(`test_families.build_family`)."""
import base64
import io
import math

import pytest
import torch
import transformers
from PIL import Image

from common import backbone as bb
from eval import evaluate
from test_families import FAMILIES, QWEN3_VL_TEMPLATE, examples, save_family, user

SYSTEM = "You are a helpful assistant."


def model_type(name):
    return {"llava_next_vicuna": "llava_next", "llava_next_mistral": "llava_next"}.get(name, name)


def data_url_image(image):
    """lmms-eval's `_encode_image_data_url` (JPEG, quality 85, RGB) and its decoding again
    (qwen_vl_utils `fetch_image` / transformers `load_image` of a data URL)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=85)
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    return Image.open(io.BytesIO(base64.b64decode(url.split("base64,", 1)[1]))).convert("RGB")


def qwen_vl_utils_resize(image, factor, min_pixels, max_pixels):
    """qwen_vl_utils 0.0.14 `smart_resize` + `image.resize` (vision_process.py:56-80, 140)."""
    h, w = image.height, image.width
    hb, wb = max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor)
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb, wb = math.floor(h / beta / factor) * factor, math.floor(w / beta / factor) * factor
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return image.resize((wb, hb))


def lmms_eval_inputs(name, path, image, question):
    """The model inputs lmms-eval 0.7.3's class for family `name` builds for one image and
    question (a task whose doc_to_text is the question), from the checkpoint at `path`."""
    cls = bb.processor_class(model_type(name))
    if name == "qwen2_vl":  # simple/qwen2_vl.py: :73 processor bounds, :252 system (a string), :290 JPEG, :346
        proc = cls.from_pretrained(path, max_pixels=602112, min_pixels=3136)
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        img = qwen_vl_utils_resize(data_url_image(image), 28, 3136, 602112)
        kw = {}
    elif name == "qwen2_5_vl":  # chat/qwen2_5_vl.py: no system turn, PIL image, qwen_vl_utils defaults, :105
        proc = cls.from_pretrained(path, max_pixels=1605632, min_pixels=256 * 28 * 28)
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        img = qwen_vl_utils_resize(image, 28, 4 * 28 * 28, 16384 * 28 * 28)
        kw = {}
    elif name.startswith("qwen3_vl"):  # chat/qwen3_vl.py: :50 system (list content), :69 patch 16, :86 no resize
        proc = cls.from_pretrained(path, max_pixels=1605632, min_pixels=256 * 28 * 28)
        msgs = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        img = qwen_vl_utils_resize(image, 32, 4 * 32 * 32, 16384 * 32 * 32)
        kw = {"do_resize": False}
    elif name.startswith("llava"):  # chat/llava_hf.py:62 the processor's template, :68 processor(images, text)
        proc = cls.from_pretrained(path)
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        img, kw = image, {}
    else:  # gemma3, simple/gemma3.py: :243 system (list content), :261 JPEG data URL, :292 apply_chat_template
        proc = cls.from_pretrained(path)
        msgs = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        img, kw = data_url_image(image), {}
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return proc(text=[text], images=[img], return_tensors="pt", **kw), proc


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, checkpoint dir, model, VLProcessor) of a tiny family loaded by `load_backbone`."""
    path = save_family(request.param, str(tmp_path_factory.mktemp(request.param) / "ckpt"))
    model, proc = bb.load_backbone(path)
    return request.param, path, model, proc


def _same_inputs(got, want, what):
    assert got["input_ids"].tolist() == want["input_ids"].tolist(), what
    for k in ("pixel_values", "image_grid_thw", "image_sizes", "mm_token_type_ids", "token_type_ids"):
        if k in want:
            assert torch.equal(got[k], want[k]), (what, k)


def test_lmms_eval_settings_give_the_inputs_lmms_evals_class_builds(family, capsys):
    """Ids, pixels and grids under `--prompt-settings lmms-eval` equal lmms-eval's class's, for
    an 84 px shapes image, a 60x30 one (qwen_vl_utils resizes it before the processor) and a
    noisy one (JPEG re-encoding changes its pixels)."""
    name, path, model, proc = family
    settings = evaluate.apply_prompt_settings(model, proc, "lmms-eval")
    ims, qs, _ = examples()
    ims[2] = Image.frombytes("RGB", (84, 84), bytes(torch.randint(0, 256, (84 * 84 * 3,),
                                                                   generator=torch.Generator().manual_seed(0))
                                                     .to(torch.uint8).tolist()))
    if name.startswith("qwen3_vl"):  # the tiny Qwen3-VL has patch 14: lmms-eval's class cannot run it
        assert settings == {} and proc.system is None and proc.pre_resize is None
        assert "assumes vision patch 16, this checkpoint has 14" in capsys.readouterr().out
        return
    for im, q in zip(ims, qs):
        want, _ = lmms_eval_inputs(name, path, im, q)
        _same_inputs(proc.encode([im], [q]), want, name)
    eos = proc.tokenizer.eos_token_id
    assert proc.stop_ids == (list(model.generation_config.eos_token_id) if name == "gemma3" else [eos]), name


def test_checkpoint_settings_give_the_processors_own_inputs(family):
    """`--prompt-settings checkpoint` (also after lmms-eval's were set) equals the processor's own
    `apply_chat_template(..., tokenize=True)`, and the stop ids are generation_config's again."""
    name, path, model, proc = family
    evaluate.apply_prompt_settings(model, proc, "lmms-eval")
    assert evaluate.apply_prompt_settings(model, proc, "checkpoint") == {}
    ref = bb.processor_class(model_type(name)).from_pretrained(path)
    ims, qs, _ = examples()
    for im, q in zip(ims, qs):
        want = ref.apply_chat_template(user(im, q), add_generation_prompt=True, tokenize=True, return_dict=True,
                                       return_tensors="pt")
        _same_inputs(proc.encode([im], [q]), want, name)
    assert proc.stop_ids == list(model.generation_config.eos_token_id), name
    assert (proc.system, proc.images_kwargs, proc.jpeg_quality, proc.pre_resize) == (None, {}, None, None)


def test_qwen3_vl_with_patch_16_gets_lmms_evals_settings(tmp_path):
    """A Qwen3-VL of the real checkpoints' patch 16: lmms-eval's system turn, qwen_vl_utils'
    resize to multiples of 32 (4..16384 tokens) and no processor resize, as its qwen3_vl class."""
    tok = bb.build_tokenizer()
    tok.chat_template = QWEN3_VL_TEMPLATE
    cfg = bb.tiny_config("qwen3_vl", tok, hidden=64, layers=2, patch_size=16)
    model = transformers.AutoModelForImageTextToText.from_config(cfg)
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id]
    hf = bb.build_hf_processor(tok, bb.build_image_processor(patch_size=16), cfg)
    path = str(tmp_path / "q3")
    model.save_pretrained(path)
    hf.tokenizer.save_pretrained(path)
    hf.image_processor.save_pretrained(path)
    model, proc = bb.load_backbone(path)
    assert evaluate.apply_prompt_settings(model, proc, "lmms-eval")["system"] == SYSTEM
    ims, qs, _ = examples()
    for im, q in zip(ims, qs):
        want, _ = lmms_eval_inputs("qwen3_vl", path, im, q)
        got = proc.encode([im], [q])
        _same_inputs(got, want, "qwen3_vl patch 16")
    assert proc.tokenizer.decode(got["input_ids"][0]).startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")


def test_fit_to_grid_is_qwen_vl_utils_resize():
    """Hand-computed: 60x30 px, factor 28, at least 3136 px: beta = sqrt(3136 / 1800) = 1.3199,
    height ceil(39.6 / 28) * 28 = 56, width ceil(79.2 / 28) * 28 = 84. 2800x2100 px with at most
    602,112 px: beta = sqrt(5,880,000 / 602,112) = 3.125, 2100 / 3.125 = 672 = 24 * 28 and
    2800 / 3.125 = 896 = 32 * 28."""
    assert bb.fit_to_grid(Image.new("RGB", (60, 30)), 28, 3136, 602112).size == (84, 56)
    assert bb.fit_to_grid(Image.new("RGB", (2800, 2100)), 28, 3136, 602112).size == (896, 672)
    assert bb.fit_to_grid(Image.new("RGB", (84, 84)), 28, 3136, 602112).size == (84, 84)
    with pytest.raises(ValueError, match="aspect ratio"):
        bb.fit_to_grid(Image.new("RGB", (402, 2)), 28, 3136, 602112)
