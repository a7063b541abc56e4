#!/usr/bin/env python3
"""Writes kvroute's tiny vision-language test model: a Qwen2-VL
(Qwen2VLForConditionalGeneration) with random weights (the engine is started
with `--load-format dummy`, so nothing but this folder is read and nothing is
downloaded), a word-level tokenizer, an image processor and a chat template
that places images.

    scripts/tiny-vlm.py DIR

It is for the image side of the real-engine bed: requests with images, their
expanded placeholder tokens, and the per-block `extra_keys` (image hash and
offset) vLLM publishes in its KV events.

The tokenizer lets tests choose token ids from plain text, as the text
model's does: the word `w<i>` is token i (32 <= i < 4096), split on
whitespace; `user`, `assistant` and `system` are 16, 17 and 18; ids below 16
are Qwen2-VL's special tokens, which config.json names:

    3 <|vision_start|>   4 <|vision_end|>   6 <|image_pad|>   (7 <|video_pad|>)

The chat template (OpenAI content lists) writes each image part as
` <|vision_start|><|image_pad|><|vision_end|> ` between the text parts:

    <|im_start|> user w100 w101 <|vision_start|><|image_pad|><|vision_end|> w300 <|im_end|> <|im_start|> assistant

and vLLM expands the one <|image_pad|> into (H/28)*(W/28) of them, H and W
being the image's size after the processor's resize: 4 for 56x56, 64 for
224x224.

The settings that are not what a real Qwen2-VL has, and why:

* hidden 128 with 4 heads: vLLM's Qwen2 takes head_dim as hidden / heads
  (a `head_dim` field is ignored) and the CPU attention backend takes head
  sizes 32, 64, 80, ... only, so hidden is 128 for head_dim 32.
* mrope_section [4, 6, 6]: the M-RoPE sections (time, height, width) must
  sum to head_dim / 2 = 16. Given as transformers' `rope_parameters` and as
  the older `rope_scaling` {"type": "mrope"}; the text fields are in
  `text_config` and also flat at the top level, for readers of either form.
* The vision tower: 1 block, embed_dim 64 with 2 heads (head size 32 again),
  and hidden_size 128, the text model's hidden size (what the patch merger
  outputs). patch 14, spatial merge 2, temporal patch 2 as in Qwen2-VL, so
  an image token covers 28x28 pixels.
* min_pixels 56*56 and max_pixels 448*448 (also as `size`
  shortest_edge/longest_edge, which newer processors read): an image is
  resized to between 4 and 256 image tokens, whatever its size.
* video_preprocessor_config.json: Qwen2VLProcessor loads a video processor
  even when only images are sent (the engine runs with video limited to 0).
* vocab 4096, 2 layers: small enough to start in seconds on 2 cores.
* The tokenizer's decoder (WordPiece's, with no `##` words) puts spaces
  between decoded words.

Standard library only, so it runs before any virtual environment exists.
"""

import json
import os
import sys

VOCAB = 4096
SPECIALS = [
    "<|endoftext|>",  # 0: pad
    "<|im_start|>",  # 1
    "<|im_end|>",  # 2: end of sequence
    "<|vision_start|>",  # 3
    "<|vision_end|>",  # 4
    "<|vision_pad|>",  # 5
    "<|image_pad|>",  # 6
    "<|video_pad|>",  # 7
    "<unk>",  # 8
]
ROLES = {"user": 16, "assistant": 17, "system": 18}
FIRST_WORD = 32

HEAD_DIM = 32
TEXT = {
    "model_type": "qwen2_vl_text",
    "vocab_size": VOCAB,
    "hidden_size": 4 * HEAD_DIM,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "use_sliding_window": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [4, 6, 6],
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    "rope_theta": 1000000.0,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
assert sum(TEXT["rope_parameters"]["mrope_section"]) == HEAD_DIM // 2

VISION = {
    "model_type": "qwen2_vl_vision",
    "depth": 1,
    "embed_dim": 2 * HEAD_DIM,
    "num_heads": 2,
    "hidden_size": TEXT["hidden_size"],
    "hidden_act": "quick_gelu",
    "mlp_ratio": 2,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

CONFIG = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "text_config": TEXT,
    "vision_config": VISION,
    "vision_start_token_id": 3,
    "vision_end_token_id": 4,
    "vision_token_id": 5,
    "image_token_id": 6,
    "video_token_id": 7,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    **{k: v for k, v in TEXT.items() if k != "model_type"},
}

PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": VISION["patch_size"],
    "merge_size": VISION["spatial_merge_size"],
    "temporal_patch_size": VISION["temporal_patch_size"],
    "min_pixels": 56 * 56,
    "max_pixels": 448 * 448,
    "size": {"shortest_edge": 56 * 56, "longest_edge": 448 * 448},
}

VIDEO_PREPROCESSOR = {k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}
VIDEO_PREPROCESSOR["video_processor_type"] = "Qwen2VLVideoProcessor"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|> {{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    " <|vision_start|><|image_pad|><|vision_end|> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    " <|im_end|> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tokenizer():
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    names = {i: word for word, i in ROLES.items()}
    for i in range(len(SPECIALS), FIRST_WORD):
        vocab[names.get(i, f"<|reserved{i}|>")] = i
    for i in range(FIRST_WORD, VOCAB):
        vocab[f"w{i}"] = i
    added = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in enumerate(SPECIALS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def tokenizer_config():
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "processor_class": "Qwen2VLProcessor",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "model_max_length": TEXT["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    files = {
        "config.json": CONFIG,
        "generation_config.json": {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0},
        "tokenizer.json": tokenizer(),
        "tokenizer_config.json": tokenizer_config(),
        "special_tokens_map.json": {
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": "<unk>",
        },
        "preprocessor_config.json": PREPROCESSOR,
        "video_preprocessor_config.json": VIDEO_PREPROCESSOR,
        "chat_template.json": {"chat_template": CHAT_TEMPLATE},
    }
    for name, content in files.items():
        with open(os.path.join(out, name), "w") as f:
            json.dump(content, f)
    print(out)


if __name__ == "__main__":
    main()
