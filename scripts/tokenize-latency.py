#!/usr/bin/env python3
"""What the router's `/tokenize` fallback adds to a request: the time of one
`POST /tokenize` of a chat of about 300 tokens (random `w<i>` words of the
project's tiny model, so no two calls are the same), over one kept-alive
connection, 200 calls; prints p50, p90 and p99.

    scripts/tokenize-latency.py HOST:PORT [MODEL]
"""

import http.client
import json
import random
import statistics
import sys
import time


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    host, port = sys.argv[1].rsplit(":", 1)
    model = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    conn = http.client.HTTPConnection(host, int(port))
    times = []
    for _ in range(200):
        words = " ".join(f"w{random.randint(16, 31999)}" for _ in range(300))
        messages = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": words}]
        body = json.dumps({"model": model, "messages": messages})
        start = time.perf_counter()
        conn.request("POST", "/tokenize", body, {"content-type": "application/json"})
        answer = conn.getresponse()
        answer.read()
        if answer.status != 200:
            sys.exit(f"/tokenize answered {answer.status}")
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    print(
        f"/tokenize, ~300-token chat, 200 calls: p50 {statistics.median(times):.2f} ms, "
        f"p90 {times[179]:.2f} ms, p99 {times[197]:.2f} ms"
    )


if __name__ == "__main__":
    main()
