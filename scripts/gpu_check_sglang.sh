#!/usr/bin/env bash
# GPU check for the SGLang plugin (needs one CUDA GPU; cannot run on the CPU-only dev machine).
# Starts `python -m sglang.launch_server --enable-warply` on a small local model (127.0.0.1),
# a Warply state collector, sends one prompt twice, prints the exported events and the hit.
# Budget: under 8 minutes. Usage: bash scripts/gpu_check_sglang.sh [MODEL_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venvs/sglang/bin/python"
MODEL="${1:-$ROOT/.cache/tiny-small}"
PORT=30123 ROUTER=5591 CONTROL=5592
[[ -d "$MODEL" ]] || "$PY" "$ROOT/scripts/tiny_model.py" --size small --out "$MODEL"
LOG="$(mktemp)"
SGLANG_PLUGINS=warply timeout 480 "$PY" -m sglang.launch_server --model-path "$MODEL" \
  --host 127.0.0.1 --port "$PORT" --mem-fraction-static 0.3 --page-size 16 \
  --enable-warply --warply-router "tcp://127.0.0.1:$ROUTER" \
  --warply-control "tcp://127.0.0.1:$CONTROL" --warply-worker gpu0 --warply-model tiny \
  >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
timeout 420 "$PY" - "$PORT" "$ROUTER" "$CONTROL" "$MODEL" <<'PY'
import json, sys, time, urllib.request
import zmq
from transformers import AutoTokenizer
from router.index import MemoryStore, PrefixIndex, completed
from warply.protocol import Directive, DirectiveKind, StreamDecoder, encode_directive, prefix_keys
port, router, control, model = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
sub = zmq.Context.instance().socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.bind(f"tcp://127.0.0.1:{router}")
base = f"http://127.0.0.1:{port}"
for _ in range(360):
    try:
        urllib.request.urlopen(base + "/health", timeout=1); break
    except OSError:
        time.sleep(1)
else:
    sys.exit("server did not come up")
tok = AutoTokenizer.from_pretrained(model)
prompt = "Warply GPU check. " * 40
ids = tok(prompt)["input_ids"]
index, decoder = PrefixIndex("tiny", MemoryStore()), StreamDecoder("gpu0")
def ask():
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}).encode()
    req = urllib.request.Request(base + "/generate", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))["meta_info"].get("cached_tokens")
def drain():
    while sub.poll(1500):
        b = decoder.decode_frames(sub.recv_multipart())
        if b:
            for e in b.events: print("event", type(e).__name__, str(e)[:160])
            completed(index.apply("gpu0", b.events))
print("first cached_tokens", ask()); drain()
keys = prefix_keys(ids, 16, "tiny")
print("index predicts", completed(index.match(keys)).get("gpu0"), "of", len(keys), "blocks")
print("second cached_tokens", ask()); drain()
d = zmq.Context.instance().socket(zmq.DEALER); d.connect(f"tcp://127.0.0.1:{control}")
d.send(encode_directive(Directive("pin1", DirectiveKind.PIN, token_ids=ids, ttl_s=30)))
print("pin ack", d.recv() if d.poll(5000) else "no reply")
PY
echo "server log tail:"; tail -5 "$LOG"
