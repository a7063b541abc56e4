"""What a vLLM engine holds, by its own KV-event history: an independent
subscriber for the real-engine suite, beside (not through) kvroute.

    python replay.py tcp://127.0.0.1:REPLAY [FROM]

Asks the engine's replay socket (a DEALER sends ["", start seq as 8 bytes
big-endian]) for every batch from sequence FROM (default 0), applies them in order
(BlockStored adds blocks, BlockRemoved drops them, AllBlocksCleared empties
the set) and prints one JSON object: the last sequence number, the last
clear's, the block sizes seen, and every block still stored with its
parent and its tokens
(from FROM > 0: only what those batches stored; `batches` 0 says the engine
published nothing from FROM on).
Runs in the engine's own virtual environment (pyzmq and msgspec come with
vLLM). Exits non-zero, saying why, on anything it cannot read.
"""

import json
import struct
import sys

import msgspec
import zmq

TIMEOUT_MS = 3_000


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    start = int(sys.argv[2]) if len(sys.argv) == 3 else 0
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sys.argv[1])
    sock.send_multipart([b"", struct.pack(">q", start)])
    blocks = {}
    last_seq, batches, sizes, clears, clear_seq = None, 0, set(), 0, None
    asked_after = None
    while True:
        if not sock.poll(TIMEOUT_MS):
            if last_seq is None or last_seq == asked_after:
                sys.exit(f"no replay answer from {sys.argv[1]} within {TIMEOUT_MS} ms")
            # vLLM's replay socket drops what a slow reader has not taken
            # past 1,000 queued messages, its end marker too: ask for the rest.
            asked_after = last_seq
            sock.send_multipart([b"", struct.pack(">q", last_seq + 1)])
            continue
        frames = sock.recv_multipart()
        seq = struct.unpack(">q", frames[-2])[0]
        if seq == -1:
            break
        if last_seq is not None and seq <= last_seq:
            continue
        last_seq, batches = seq, batches + 1
        payload = msgspec.msgpack.decode(frames[-1])
        for event in payload[1]:
            if not isinstance(event, dict):
                sys.exit(f"batch {seq}: an event that is not a map: {event!r}")
            kind = event.get("type")
            if kind == "BlockStored":
                size = event["block_size"]
                sizes.add(size)
                parent = event["parent_block_hash"]
                tokens = event["token_ids"]
                for i, h in enumerate(event["block_hashes"]):
                    blocks[h] = {"hash": h, "parent": parent, "tokens": tokens[i * size:(i + 1) * size]}
                    parent = h
            elif kind == "BlockRemoved":
                for h in event["block_hashes"]:
                    blocks.pop(h, None)
            elif kind == "AllBlocksCleared":
                blocks.clear()
                clears += 1
                clear_seq = seq
            else:
                sys.exit(f"batch {seq}: an event of unknown type {kind!r}")
    print(json.dumps({
        "last_seq": last_seq,
        "batches": batches,
        "clears": clears,
        "clear_seq": clear_seq,
        "block_sizes": sorted(sizes),
        "blocks": list(blocks.values()),
    }))


if __name__ == "__main__":
    main()
