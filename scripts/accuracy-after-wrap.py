"""Routing accuracy after a wrapped replay ring (issue 2.3, finding 4).

A mock engine with a 50-batch replay ring serves 400 distinct prompts, so
its ring no longer reaches back; then a router starts and traffic flows
through it for SECS seconds (80 % those prompts, 20 % new ones). Every 10 s
it prints (seconds, responses compared, % whose cached_tokens equalled the
router's prediction, rank state).

    python3 scripts/accuracy-after-wrap.py target/release/kvroute [SECS] [ROUTER_EXE]

ROUTER_EXE (default: the same kvroute) measures another router build against
the same engine."""
import json, random, socket, subprocess, sys, time, urllib.request

exe = sys.argv[1]
router = sys.argv[3] if len(sys.argv) > 3 else exe
secs = int(sys.argv[2]) if len(sys.argv) > 2 else 70
def free():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
http, ev, rp, srv = free(), free(), free(), free()
m = subprocess.Popen([exe, "mocker", "--port", str(http), "--kv-events-port", str(ev), "--replay-port", str(rp),
                      "--speedup", "100", "--replay-buffer", "50"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
line = m.stdout.readline().strip()
def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"content-type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=30).read())
def prompt(n): return [1000 + n * 101 + i for i in range(70)]
for n in range(400):
    post(http, "/v1/completions", {"model": "mock-model", "prompt": prompt(n), "max_tokens": 1})
s = subprocess.Popen([router, "serve", "--port", str(srv), "--worker", line, "--log", "warn"], stderr=subprocess.DEVNULL)
time.sleep(3)
def metrics():
    t = urllib.request.urlopen(f"http://127.0.0.1:{srv}/metrics", timeout=10).read().decode()
    c = e = 0.0
    for l in t.splitlines():
        if l.startswith("kvroute_accuracy_comparisons_total"): c += float(l.split()[-1])
        if l.startswith("kvroute_accuracy_exact_total"): e += float(l.split()[-1])
    state = [l for l in t.splitlines() if l.startswith("kvroute_ingest_rank_state{")]
    return c, e, state
random.seed(1)
start = time.time(); last = (0.0, 0.0); window = 10; nxt = start + window; new = 10_000
rows = []
while time.time() - start < secs:
    n = random.randrange(400) if random.random() < 0.8 else (new := new + 1)
    post(srv, "/v1/completions", {"model": "mock-model", "prompt": prompt(n), "max_tokens": 1})
    if time.time() >= nxt:
        c, e, st = metrics()
        dc, de = c - last[0], e - last[1]; last = (c, e); nxt += window
        rows.append((round(time.time() - start), int(dc), round(100 * de / max(dc, 1), 1), st[0].split("state=")[1] if st else "?"))
        print(rows[-1], flush=True)
s.terminate(); m.terminate()
