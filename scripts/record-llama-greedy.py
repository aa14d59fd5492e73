#!/usr/bin/env python3
"""Records llama.cpp's greedy answers on the default model, for the runtime's agreement test
(runtime/tests/it/llama_server_agreement.rs), into runtime/tests/fixtures/llama_server_greedy.json,
or on another checkpoint into another fixture (--out): e.g. the default model at F16, made by
scripts/gguf-variants.py, into runtime/tests/fixtures/llama_server_greedy_f16.json.

llama-server takes ~10 minutes to build on 2 cores, too long for every CI run, so its outputs
are recorded once and committed: per prompt, the chat-formatted text, its token ids as
llama.cpp tokenizes them, the greedy tokens, and at each step the gap between the two best
log-probabilities (equal to the gap between the two best logits), so the test can tell a real
disagreement from a near-tie.

Usage: scripts/record-llama-greedy.py [LLAMA_SERVER [MODEL]] [--out PATH] [--model-name TEXT]
  (defaults: scripts/build-llama-server.sh's binary, scripts/fetch-model.sh's model,
  runtime/tests/fixtures/llama_server_greedy.json, MODEL's file name). --model-name says in the
  fixture where the model came from, e.g. the scripts/gguf-variants.py command that made it.

Example (the LoRA fixture: the same adapter as PEFT and GGUF, see scripts/lora-adapter.py):
  scripts/lora-adapter.py /tmp/lora
  scripts/record-llama-greedy.py --lora /tmp/lora/adapter.gguf \\
    --out runtime/tests/fixtures/llama_server_greedy_lora.json \\
    --lora-name "scripts/lora-adapter.py defaults (rank 8, alpha 16, seed 1, every projection)"

Example (the F16 fixture):
  scripts/gguf-variants.py f16 /tmp/smollm2-f16.gguf
  scripts/record-llama-greedy.py "$(scripts/build-llama-server.sh | tail -n 1)" \\
    /tmp/smollm2-f16.gguf --out runtime/tests/fixtures/llama_server_greedy_f16.json \\
    --model-name "smollm2-f16.gguf (scripts/gguf-variants.py f16)"
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "runtime/tests/fixtures/llama_server_greedy.json")
NEW_TOKENS = 24

# Ten user turns of different kinds: facts, lists, code, arithmetic, translation, open prose.
QUESTIONS = [
    "What is the capital of France?",
    "Name three rivers in Africa.",
    "Write a Python function that reverses a string.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Explain in one sentence what a CPU cache is.",
    "Give me a short poem about the sea.",
    "List the planets of the solar system in order.",
    "Why is the sky blue?",
    "Suggest a name for a small bakery.",
]


def chat(question):
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def post(base, path, body):
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Texts whose tokens are recorded as llama.cpp reads them (special tokens parsed, nothing
# added): spaces in runs and at the ends, newlines and tabs, accents, emoji, CJK, digits.
TEXTS = [
    "Hello world",
    "  two leading spaces",
    "a trailing space ",
    "runs   of    spaces",
    "line\nbreaks\n\nand\ttabs",
    "café naïve façade Ünïcödé ß",
    "emoji 🦀🚀 and CJK 你好世界",
    "12345 3.14159 -42",
    "don't won't I'm",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
]


def peer_and_model(server, model):
    """SERVER and MODEL, or scripts/build-llama-server.sh's binary and scripts/fetch-model.sh's
    model where they are not given."""
    server = server or subprocess.check_output(
        [os.path.join(ROOT, "scripts/build-llama-server.sh")], text=True
    ).strip().splitlines()[-1]
    model = model or subprocess.check_output(
        [os.path.join(ROOT, "scripts/fetch-model.sh")], text=True
    ).strip()
    return server, model


def start(server, model, extra):
    """llama-server on MODEL at a free loopback port with EXTRA flags, once /health answers:
    (process, base URL)."""
    port = free_port()
    proc = subprocess.Popen(
        [server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "2",
         "--parallel", "1", "-c", "2048", "--no-warmup", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(0.2)
    proc.terminate()
    sys.exit("llama-server did not come up")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("server", nargs="?", help="llama-server (default: scripts/build-llama-server.sh's)")
    p.add_argument("model", nargs="?", help="the GGUF (default: scripts/fetch-model.sh's)")
    p.add_argument("--out", default=OUT, help=f"the fixture to write (default: {os.path.relpath(OUT, ROOT)})")
    p.add_argument("--model-name", help="the fixture's \"model\" field (default: MODEL's file name)")
    p.add_argument("--lora", help="a GGUF LoRA adapter llama-server applies to every answer (--lora)")
    p.add_argument("--lora-name", help="the fixture's \"lora\" field: how the adapter was made")
    args = p.parse_args()
    server, model = peer_and_model(args.server, args.model)
    out = args.out
    proc, base = start(server, model, ["--lora", args.lora] if args.lora else [])
    try:
        with urllib.request.urlopen(base + "/props", timeout=10) as r:
            version = json.load(r).get("build_info", "unknown")
        prompts = []
        for q in QUESTIONS:
            text = chat(q)
            ids = post(base, "/tokenize", {"content": text, "add_special": False})["tokens"]
            r = post(base, "/completion", {
                "prompt": ids, "n_predict": NEW_TOKENS, "temperature": 0.0, "top_k": 1,
                "n_probs": 2, "cache_prompt": False,
                "return_tokens": True,
            })
            steps = r["completion_probabilities"]
            tokens = [s["id"] for s in steps]
            gaps = []
            for s in steps:
                top = sorted((t["logprob"] for t in s["top_logprobs"]), reverse=True)
                gaps.append(round(top[0] - top[1], 4) if len(top) > 1 else None)
            prompts.append({"question": q, "text": text, "ids": ids, "tokens": tokens,
                            "top2_gaps": gaps, "answer": r["content"]})
            print(f"{q!r} -> {r['content']!r}", file=sys.stderr)
        texts = [{"text": t, "ids": post(base, "/tokenize", {"content": t, "add_special": False})["tokens"]}
                 for t in TEXTS]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({
            "recorded_with": f"llama-server {version} (llama-cpp-python 0.3.36's vendored "
                             "llama.cpp, scripts/build-llama-server.sh)",
            "model": args.model_name or os.path.basename(model),
            **({"lora": args.lora_name or os.path.basename(args.lora)} if args.lora else {}),
            "new_tokens": NEW_TOKENS,
            "prompts": prompts,
            "texts": texts,
        }, f, indent=1)
        f.write("\n")
    print(out)


if __name__ == "__main__":
    main()
