#!/usr/bin/env sh
# Writes seeds for the endpoints_file target into fuzz/corpus/endpoints_file/:
# a file of llm-d's endpoints.yaml shape with every label kvroute reads, one
# whose entries share labels through an anchor, an explicit empty list, a
# file cut short, and a small alias bomb (each anchor nine aliases of the
# one before). Run from anywhere.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
corpus="$here/corpus/endpoints_file"
mkdir -p "$corpus"

cat > "$corpus/full.yaml" <<'Y'
endpoints:
  - name: vllm-0
    namespace: inference
    address: 10.0.0.7
    port: "8000"
    labels:
      kvroute.io/events-port: "5557"
      kvroute.io/replay-port: "5558"
      kvroute.io/flavor: sglang
      kvroute.io/dp-size: "2"
      kvroute.io/role: prefill
      kvroute.io/bootstrap-port: "8998"
      kvroute.io/block-size: "16"
      kvroute.io/model: my-model
  - {name: vllm-1, address: "::1", port: 8001, labels: {llm-d.ai/role: decode}}
Y
cat > "$corpus/anchors.yaml" <<'Y'
common: &common {kvroute.io/flavor: vllm, kvroute.io/events-port: "6000"}
endpoints:
  - {name: a, address: 10.0.0.1, port: 1, labels: *common}
  - {name: b, address: 10.0.0.2, port: 1, labels: *common}
Y
printf 'endpoints: []\n' > "$corpus/drain.yaml"
printf 'endpoints:\n  - name: a\n    address: 10.0.0.1\n    port: "80' > "$corpus/cut.yaml"
{
    printf 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in 1 2 3 4 5 6; do
        p=$((i - 1))
        printf 'a%s: &a%s [*a%s,*a%s,*a%s,*a%s,*a%s,*a%s,*a%s,*a%s,*a%s]\n' "$i" "$i" "$p" "$p" "$p" "$p" "$p" "$p" "$p" "$p" "$p"
    done
    printf 'endpoints:\n  - {name: e0, address: 127.0.0.1, port: "47700", labels: {x: *a6}}\n'
} > "$corpus/bomb.yaml"
echo "wrote $(ls "$corpus" | wc -l) seed(s) to $corpus"
