"""The answers half of the GPU P/D checks (scripts/gpu_check_vllm.sh, gpu_check_sglang.sh).

    python scripts/gpu_pd_check.py record URL FILE   # greedy answers of an aggregated engine
    python scripts/gpu_pd_check.py check URL FILE    # the same prompts through the router

`check` sends each prompt (completions and chat, JSON and streamed) to warply-router in front of
a prefill/decode pair (configured to hand every prompt off) and fails unless every answer equals
the recorded one and the router says it handed the prompt off (`X-Warply-Mode: remote`).
Standard library only: it runs in any engine's venv.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from typing import Any

MAX_TOKENS = 16
PROMPTS = [
    "Warply P/D check: the prefix cache holds a long shared system prompt. " * 12 + "First.",
    "Warply P/D check: the prefix cache holds a long shared system prompt. " * 12 + "Second.",
    "A different prompt about decode workers pulling KV from prefill workers. " * 10,
]


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[str, str]:
    """(the generated text, the X-Warply-Mode header or "")."""
    req = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        mode = resp.headers.get("X-Warply-Mode", "")
        raw = resp.read().decode()
    if not body.get("stream"):
        choice = json.loads(raw)["choices"][0]
        return choice.get("text") or choice["message"]["content"], mode
    text = ""
    for event in raw.split("\n\n"):
        if event.startswith("data: {"):
            chunk = json.loads(event[6:])
            if "error" in chunk:
                raise SystemExit(f"stream ended with an error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, mode


def _requests(model: str) -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        stream = i % 2 == 1
        common = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
        out.append((f"completion {i}", "/v1/completions", {**common, "prompt": prompt}))
        chat = {**common, "messages": [{"role": "user", "content": prompt}]}
        out.append((f"chat {i}", "/v1/chat/completions", chat))
    return out


def main(argv: list[str]) -> int:
    if argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) != 5 or argv[1] not in ("record", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    action, url, path, model = argv[1], argv[2], argv[3], argv[4]
    if action == "record":
        answers = {name: _post(url, p, body)[0] for name, p, body in _requests(model)}
        with open(path, "w") as f:
            json.dump(answers, f)
        print(f"recorded {len(answers)} reference answers")
        return 0
    with open(path) as f:
        want = json.load(f)
    failed = 0
    for name, p, body in _requests(model):
        text, mode = _post(url, p, body)
        ok = text == want[name] and mode == "remote"
        failed += not ok
        print(f"{'ok ' if ok else 'BAD'} {name:13s} mode={mode:24s} {text[:40]!r}")
        if text != want[name]:
            print(f"    reference {want[name][:40]!r}")
    print(f"{len(want) - failed} of {len(want)} answers equal the aggregated engine's, handed off")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
