#!/usr/bin/env python3
"""Writes kvroute's tiny test model: a Llama with random weights (the engine
is started with `--load-format dummy`, so nothing but this folder is read and
nothing is downloaded), a word-level tokenizer and a chat template.

    scripts/tiny-model.py DIR

The tokenizer lets tests choose token ids from plain text: the word `w<i>` is
token i (16 <= i < 32000), split on whitespace; ids below 16 are the special
tokens. The chat template has roles, separators and a generation prompt, as
real models' do (not plain concatenation):

    <|system|> ... <|end|> <|user|> ... <|end|> <|assistant|>

Standard library only, so it runs before any virtual environment exists.
"""

import json
import os
import sys

VOCAB = 32000
SPECIALS = [
    "<s>",
    "</s>",
    "<unk>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|tool|>",
]
FIRST_WORD = 16

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # The CPU attention backend takes head sizes 32, 64, 80, ... only.
    "head_dim": 32,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} <|end|> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def tokenizer():
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for i in range(len(SPECIALS), FIRST_WORD):
        vocab[f"<|reserved{i}|>"] = i
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
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def tokenizer_config():
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "model_max_length": CONFIG["max_position_embeddings"],
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
        "generation_config.json": {"bos_token_id": 0, "eos_token_id": 1},
        "tokenizer.json": tokenizer(),
        "tokenizer_config.json": tokenizer_config(),
        "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    }
    for name, content in files.items():
        with open(os.path.join(out, name), "w") as f:
            json.dump(content, f)
    print(out)


if __name__ == "__main__":
    main()
