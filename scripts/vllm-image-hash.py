#!/usr/bin/env python3
"""Prints the identifier vLLM gives an image sent as a data URL, computed by
vLLM's own code, as test vectors for kvroute's image hashing.

    ~/.cache/kvroute/vllm/bin/python scripts/vllm-image-hash.py [MODEL_ID...]

Run with the engines' Python (`scripts/real-engines install`). It builds a
small PNG itself (56x56 RGB, a colour gradient: 4 image tokens for the tiny
VLM) and, for each MODEL_ID (default: /models/tiny-vl and tiny), prints what
a vLLM engine started with `--model MODEL_ID` names that image in its cache
keys and in its KV events' extra_keys:

    {"vllm_version": ..., "hash_algorithm": "blake3",
     "vectors": [{"png_base64": ..., "model_id": ..., "identifier": ...}, ...]}

The path is the one a chat request's `image_url` data URL takes: the chat
parser's media connector loads it (MediaConnector.fetch_image: the decoded
image together with the original encoded bytes), the multi-modal parser
makes it an image item, and the processor's ProcessorInputs.get_mm_hashes
hashes it with the model's id (the --model path, not the served name),
with the default --mm-hash-algorithm (blake3), no mm_processor_kwargs and
no media_io_kwargs. A `uuid` on the request's content part replaces the
identifier. The PNG is RGB: an image the loader converts (RGBA, grayscale)
has its conversion settings hashed in too.

crates/kvroute-core/tests/fixtures/vllm_0.32_image_hash.json is this script's output.
"""

import base64
import json
import struct
import sys
import zlib

import vllm
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.media import MediaConnector, MediaWithBytes
from vllm.multimodal.parse import MultiModalDataParser
from vllm.multimodal.processing.inputs import ProcessorInputs

MODEL_IDS = ["/models/tiny-vl", "tiny"]
ALGORITHM = "blake3"  # --mm-hash-algorithm's default


def png(width, height):
    """A `width` x `height` 8-bit RGB PNG, a gradient, no ancillary chunks."""

    def chunk(kind, data):
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    rows = b"".join(
        b"\x00"  # filter: none
        + b"".join(
            bytes((x * 255 // (width - 1), y * 255 // (height - 1), 128))
            for x in range(width)
        )
        for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows, 9))
        + chunk(b"IEND", b"")
    )


def identifier(data_url, model_id):
    media = MediaConnector().fetch_image(data_url)
    assert isinstance(media, MediaWithBytes) and media.io_config is None, media
    items = MultiModalDataParser().parse_mm_data({"image": [media]})
    hashes = ProcessorInputs(prompt=[], mm_data_items=items).get_mm_hashes(
        model_id, ALGORITHM
    )
    (digest,) = hashes["image"]
    # The call get_mm_hashes makes for an item with no uuid and no kwargs.
    assert digest == MultiModalHasher.hash_kwargs(
        ALGORITHM, model_id=model_id, image=media
    )
    return digest


def main():
    model_ids = sys.argv[1:] or MODEL_IDS
    image = png(56, 56)
    b64 = base64.b64encode(image).decode("ascii")
    data_url = "data:image/png;base64," + b64
    vectors = [
        {"png_base64": b64, "model_id": m, "identifier": identifier(data_url, m)}
        for m in model_ids
    ]
    doc = {"vllm_version": vllm.__version__, "hash_algorithm": ALGORITHM, "vectors": vectors}
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
