"""DeepSeek-VL2 prompts with several images (rolemerge/deepseek_vl2.py `Processor.encode`), as
the official DeepseekVLV2Processor does them (deepseek_vl2/models/processing_deepseek_vl_v2.py:
`tokenize_with_images(..., cropping=len(images) <= 2)`; without cropping the best resolution
is S x S, so each image is its global view plus one S x S local view)."""
import pytest
import torch
from PIL import Image

from rolemerge import deepseek_vl2 as vl2
from test_rolemerge_deepseek_vl2 import SPECIAL, raw_config, vl2_tokenizer


@pytest.fixture(scope="module")
def tok():
    return vl2_tokenizer()


def images(n):
    return [Image.new("RGB", (100, 50), (255, 40 * i, 0)) for i in range(n)]       # wide: tiled 2 x 1 when cropping


def test_more_than_two_images_are_not_tiled(tok):
    proc = vl2.Processor(tok, [[42, 42], [42, 84], [84, 42]], 14, 2)
    one = vl2.image_token_count(1, 1, 42, 14, 2)                                      # 6 + 1 + 6 = 13
    wide = vl2.image_token_count(2, 1, 42, 14, 2)                                     # 6 + 1 + 10 = 17
    inp = proc.encode([images(3), images(2), images(1)[0], None], ["q"] * 4)
    assert inp["images_spatial_crop"].tolist() == [[[1, 1]] * 3, [[2, 1], [2, 1], [0, 0]],
                                                   [[2, 1], [0, 0], [0, 0]], [[0, 0]] * 3]
    assert inp["images_seq_mask"].sum(1).tolist() == [3 * one, 2 * wide, wide, 0]
    assert ((inp["input_ids"] == proc.image_token_id) == inp["images_seq_mask"]).all()
    assert inp["images"].shape == (4, 6, 3, 42, 42)                                   # 3 x (1 + 1) tiles; 2 x (1 + 2)
    g, loc = inp["images"][0, 0], inp["images"][0, 1]
    assert torch.equal(g, loc)                                # no crop: the local view is the padded image itself
    assert not torch.equal(inp["images"][0, 0], inp["images"][0, 2])                   # image 2 follows image 1
    # the prompt: one `<image>\n` line per image before the question (as the official sft format writes them)
    text = tok.decode(inp["input_ids"][0][~inp["images_seq_mask"][0] & inp["attention_mask"][0].bool()].tolist())
    assert text == f"{SPECIAL['bos']}<|User|>: \n\n\nq\n\n<|Assistant|>:"
    # tags already in the question are used in place
    q = "first <image> then <image> and <image>?"
    inp2 = proc.encode([images(3)], [q])
    assert int(inp2["images_seq_mask"].sum()) == 3 * one
    text = tok.decode(inp2["input_ids"][0][~inp2["images_seq_mask"][0]].tolist())
    assert text == f"{SPECIAL['bos']}<|User|>: first  then  and ?\n\n<|Assistant|>:"


def test_the_model_embeds_a_three_image_prompt(tok):
    model = vl2.build_random(raw_config(False, len(tok))).eval()
    proc = vl2.Processor(tok, [[42, 42], [42, 84], [84, 42]], 14, 2)
    inp = proc.encode([images(3), images(1)[0]], ["what differs?", "and here?"])
    with torch.no_grad():
        emb = model.embed(inp["input_ids"], inp["images"], inp["images_seq_mask"], inp["images_spatial_crop"])
    assert emb.shape[:2] == inp["input_ids"].shape
    out = model.generate(**inp, max_new_tokens=2)
    assert out.shape[0] == 2
