#!/usr/bin/env bash
# GPU check for SGLang (needs one CUDA GPU; cannot run on the CPU-only dev machine), 8 minutes at
# most (the script stops itself), all servers on 127.0.0.1, stopped by PID (process group).
#  1. `python -m sglang.launch_server --enable-warply` on a small local model, a Warply state
#     collector: one prompt twice, the exported events, the index prediction, the engine's
#     cached_tokens and a pin ack; then greedy reference answers (scripts/gpu_pd_check.py record).
#  2. A P/D pair on the same GPU, both with --enable-warply: a prefill server
#     (--disaggregation-mode prefill, bootstrap port 8998) and a decode server
#     (--disaggregation-mode decode, decode radix cache on), KV over $TRANSFER (default nixl:
#     `pip install nixl` in .venvs/sglang; mooncake needs mooncake-transfer-engine), behind
#     warply-router (.venvs/core) with `kv_handoff: sglang` pools; every answer must equal
#     phase 1's and be handed off (scripts/gpu_pd_check.py check).
# Usage: [TRANSFER=nixl|mooncake] bash scripts/gpu_check_sglang.sh [MODEL_DIR]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/script_help.sh" "$@"  # --help: the comment above
if [[ -z "${WARPLY_GPU_CHECK_TIMED:-}" ]]; then
  WARPLY_GPU_CHECK_TIMED=1 exec timeout 480 bash "$0" "$@"
fi
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venvs/sglang/bin/python"
CORE="$ROOT/.venvs/core/bin/python"
MODEL="${1:-$ROOT/.cache/tiny-small}"
TRANSFER="${TRANSFER:-nixl}"
PORT=30123 ROUTER=5591 CONTROL=5592
P_PORT=30124 D_PORT=30125 R_PORT=30126 BOOTSTRAP=8998
P_EVENTS=5593 D_EVENTS=5594 P_CONTROL=5595 D_CONTROL=5596
export PYTHONPATH="$ROOT"
case "$TRANSFER" in
  nixl) "$PY" -c "import nixl" ;;
  mooncake) "$PY" -c "import mooncake.engine" ;;
  *) echo "TRANSFER must be nixl or mooncake, not $TRANSFER" >&2; exit 2 ;;
esac || { echo "the $TRANSFER transfer backend does not import in .venvs/sglang" >&2; exit 1; }
[[ -d "$MODEL" ]] || "$PY" "$ROOT/scripts/tiny_model.py" --size small --out "$MODEL"
# shellcheck source=scripts/gpu_check_common.sh
source "$ROOT/scripts/gpu_check_common.sh"
sglang() {  # sglang LOG ARGS...: start a server in its own process group, PID in $!
  local log="$1"; shift
  SGLANG_PLUGINS=warply setsid "$PY" -m sglang.launch_server --model-path "$MODEL" \
    --served-model-name tiny --host 127.0.0.1 --page-size 16 --enable-warply "$@" >"$log" 2>&1 &
}

echo "== phase 1: one server with --enable-warply"
sglang "$LOGS/aggregated.log" --port "$PORT" --mem-fraction-static 0.3 \
  --warply-router "tcp://127.0.0.1:$ROUTER" --warply-control "tcp://127.0.0.1:$CONTROL" \
  --warply-worker gpu0 --warply-model tiny
SERVER=$!
PIDS+=("$SERVER")
"$PY" - "$PORT" "$ROUTER" "$CONTROL" "$MODEL" <<'PY'
import json, sys, time, urllib.request
import zmq
from transformers import AutoTokenizer
from router.index import MemoryStore, PrefixIndex, completed
from warply.protocol import Directive, DirectiveKind, StreamDecoder, encode_directive, prefix_keys
port, router, control, model = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
sub = zmq.Context.instance().socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.bind(f"tcp://127.0.0.1:{router}")
base = f"http://127.0.0.1:{port}"
for _ in range(200):
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
"$CORE" "$ROOT/scripts/gpu_pd_check.py" record "http://127.0.0.1:$PORT" "$LOGS/reference.json" tiny
stop "$SERVER"

echo "== phase 2: prefill + decode ($TRANSFER) behind warply-router"
sglang "$LOGS/prefill.log" --port "$P_PORT" --mem-fraction-static 0.3 \
  --disaggregation-mode prefill --disaggregation-transfer-backend "$TRANSFER" \
  --disaggregation-bootstrap-port "$BOOTSTRAP" \
  --warply-router "tcp://127.0.0.1:$P_EVENTS" --warply-control "tcp://127.0.0.1:$P_CONTROL" \
  --warply-worker p --warply-model tiny
PIDS+=("$!")
sglang "$LOGS/decode.log" --port "$D_PORT" --mem-fraction-static 0.3 \
  --disaggregation-mode decode --disaggregation-transfer-backend "$TRANSFER" \
  --disaggregation-decode-enable-radix-cache \
  --warply-router "tcp://127.0.0.1:$D_EVENTS" --warply-control "tcp://127.0.0.1:$D_CONTROL" \
  --warply-worker d --warply-model tiny
PIDS+=("$!")
cat >"$LOGS/router.yaml" <<YAML
model: tiny
tokenizer: $MODEL
host: 127.0.0.1
port: $R_PORT
pd: {prefill_timeout_s: 60}
pools:
  - name: prefill
    role: prefill
    kv_handoff: sglang
    block_size: 16
    workers:
      - {name: p, url: "http://127.0.0.1:$P_PORT", bootstrap_port: $BOOTSTRAP,
         events: "tcp://127.0.0.1:$P_EVENTS", bind: true, control: "tcp://127.0.0.1:$P_CONTROL"}
  - name: decode
    role: decode
    kv_handoff: sglang
    block_size: 16
    workers:
      - {name: d, url: "http://127.0.0.1:$D_PORT",
         events: "tcp://127.0.0.1:$D_EVENTS", bind: true, control: "tcp://127.0.0.1:$D_CONTROL"}
YAML
route_and_check SGLang
