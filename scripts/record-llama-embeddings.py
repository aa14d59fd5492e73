#!/usr/bin/env python3
"""Records llama.cpp's embeddings of the default model, the reference for ferrite-server's
/v1/embeddings (server/tests/python/test_embeddings.py), into
runtime/tests/fixtures/llama_server_embeddings.json: for each pooling (last, mean) a
llama-server started with `--embeddings --pooling P` embeds the same texts, given as the token
ids its own /tokenize returns (so both servers see the same tokens), and its L2-normalised
vectors are kept to 6 significant digits.

llama-server takes ~10 minutes to build on 2 cores, so its outputs are recorded once and
committed, as the greedy fixtures are (scripts/record-llama-greedy.py).

Usage: scripts/record-llama-embeddings.py [LLAMA_SERVER [MODEL]] [--out PATH]
  (defaults: scripts/build-llama-server.sh's binary, scripts/fetch-model.sh's model).
"""

import argparse
import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import importlib

greedy = importlib.import_module("record-llama-greedy")

ROOT = greedy.ROOT
OUT = os.path.join(ROOT, "runtime/tests/fixtures/llama_server_embeddings.json")

TEXTS = [
    "The cat sat on the mat and watched the rain.",
    "A kitten rested on the rug while it rained outside.",
    "Quarterly revenue grew by twelve percent in the European market.",
    "def add(a, b):\n    return a + b",
    "Rivers carry water from the mountains to the sea.",
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("server", nargs="?")
    p.add_argument("model", nargs="?")
    p.add_argument("--out", default=OUT)
    args = p.parse_args()
    server, model = greedy.peer_and_model(args.server, args.model)
    out = {"model": os.path.basename(model), "texts": [], "pooling": {}}
    for pooling in ["last", "mean"]:
        proc, base = greedy.start(server, model, ["--embeddings", "--pooling", pooling])
        try:
            with urllib.request.urlopen(base + "/props", timeout=10) as r:
                out["recorded_with"] = (f"llama-server {json.load(r).get('build_info', 'unknown')} "
                                        "(scripts/build-llama-server.sh)")
            if not out["texts"]:
                out["texts"] = [
                    {"text": t,
                     "ids": greedy.post(base, "/tokenize", {"content": t, "add_special": False})["tokens"]}
                    for t in TEXTS
                ]
            vectors = []
            for t in out["texts"]:
                r = greedy.post(base, "/v1/embeddings",
                                {"input": [t["ids"]], "model": "m", "encoding_format": "float"})
                vectors.append([float(f"{v:.6g}") for v in r["data"][0]["embedding"]])
            out["pooling"][pooling] = vectors
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    with open(args.out, "w") as f:
        json.dump(out, f)
        f.write("\n")
    print(args.out)


if __name__ == "__main__":
    main()
