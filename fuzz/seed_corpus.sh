#!/usr/bin/env sh
# Writes every golden fixture's payload (the hex line of each
# crates/kvroute-core/tests/fixtures/*.hex) and of each hand-built seed in
# fuzz/seeds/decode_batch/*.hex as binary into
# fuzz/corpus/decode_batch/, plus one two-payload seed (two fixtures joined by
# 0xc1, the target's separator for payloads fed to one reused StreamDecoder).
# Run from anywhere; needs xxd (vim-common) or perl.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
fixtures="$here/../crates/kvroute-core/tests/fixtures"
corpus="$here/corpus/decode_batch"
mkdir -p "$corpus"

unhex() {
    if command -v xxd >/dev/null 2>&1; then
        xxd -r -p
    else
        perl -ne 'chomp; print pack("H*", $_)'
    fi
}

count=0
for fixture in "$fixtures"/*.hex; do
    name=$(basename "$fixture" .hex)
    grep -v '^#' "$fixture" | tr -d ' \n\r' | unhex > "$corpus/$name.bin"
    count=$((count + 1))
done

# Hand-built seeds for forms no engine sample carries (fuzz/seeds/decode_batch).
for seed in "$here"/seeds/decode_batch/*.hex; do
    [ -f "$seed" ] || continue
    name=$(basename "$seed" .hex)
    grep -v '^#' "$seed" | tr -d ' \n\r' | unhex > "$corpus/seed_$name.bin"
    count=$((count + 1))
done

a="$corpus/vllm_0.33.0_multimodal_lora_salt.bin"
b="$corpus/vllm_0.33.0_lookahead_cpu_removed_cleared.bin"
if [ -f "$a" ] && [ -f "$b" ]; then
    { cat "$a"; printf '\301'; cat "$b"; } > "$corpus/two_payloads_one_stream.bin"
    count=$((count + 1))
fi

echo "wrote $count seed(s) to $corpus"
