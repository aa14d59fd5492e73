#!/usr/bin/env python3
"""Writes one LoRA adapter for a Llama-family GGUF model in both formats people ship: a Hugging
Face PEFT folder (adapter_config.json + adapter_model.safetensors, the projections' own row
order) and llama.cpp's GGUF LoRA (what convert_lora_to_gguf.py makes: the same matrices under
the base tensors' names + .lora_a / .lora_b, with Q's and K's B rows permuted as llama.cpp
permutes those projections). The two files are the same adapter, so a server must give the
same tokens with either, and llama-server --lora is the reference for both.

No hub is reachable, so adapters for tests are made here: A and B are seeded normal matrices
(A scaled by 1/sqrt(in), B by --b-std), which perturb the real base model enough to change its
greedy answers without drowning them. The output is the same bytes on every run.

Usage: scripts/lora-adapter.py OUT_DIR [--model GGUF] [--rank 8] [--alpha 16] [--rslora]
         [--targets q,k,v,o,gate,up,down] [--seed 1] [--b-std 0.02]
  writes OUT_DIR/peft/{adapter_config.json,adapter_model.safetensors} and OUT_DIR/adapter.gguf.
  (numpy and gguf come from scripts/python-env.sh's venv: run by a Python without them, the
  script runs itself again there.)
"""

import argparse
import json
import math
import os
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    import numpy as np
    from gguf import GGUFReader, GGUFWriter
except ImportError:
    if os.environ.get("LORA_ADAPTER_REEXEC"):
        raise
    venv_python = subprocess.check_output(
        [os.path.join(ROOT, "scripts/python-env.sh")], text=True
    ).strip().splitlines()[-1]
    os.environ["LORA_ADAPTER_REEXEC"] = "1"
    os.execv(venv_python, [venv_python, os.path.abspath(__file__), *sys.argv[1:]])

# PEFT module name -> (HF submodule path, llama.cpp tensor name).
TARGETS = {
    "q": ("self_attn.q_proj", "attn_q"),
    "k": ("self_attn.k_proj", "attn_k"),
    "v": ("self_attn.v_proj", "attn_v"),
    "o": ("self_attn.o_proj", "attn_output"),
    "gate": ("mlp.gate_proj", "ffn_gate"),
    "up": ("mlp.up_proj", "ffn_up"),
    "down": ("mlp.down_proj", "ffn_down"),
}


def model_shape(path):
    """Layer count and each target's (in, out) features, read from the base model."""
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    get = lambda key: int(reader.fields[f"{arch}.{key}"].contents())
    n_layer, hidden, ffn = get("block_count"), get("embedding_length"), get("feed_forward_length")
    heads, kv_heads = get("attention.head_count"), get("attention.head_count_kv")
    head_dim = hidden // heads
    dims = {
        "q": (hidden, heads * head_dim),
        "k": (hidden, kv_heads * head_dim),
        "v": (hidden, kv_heads * head_dim),
        "o": (heads * head_dim, hidden),
        "gate": (hidden, ffn),
        "up": (hidden, ffn),
        "down": (ffn, hidden),
    }
    return arch, n_layer, dims, heads, kv_heads


def gguf_rows(b, n_head):
    """B's rows in llama.cpp's order for Q and K: per head, rows j and j + head_dim/2 of the
    Hugging Face layout become rows 2j and 2j + 1 (convert_hf_to_gguf.py's permute)."""
    out, r = b.shape
    return b.reshape(n_head, 2, out // n_head // 2, r).swapaxes(1, 2).reshape(out, r)


def write_safetensors(path, tensors):
    """The safetensors format by hand (an 8-byte header length, a JSON header, raw data), so
    the script needs no package beyond numpy and gguf."""
    header, offset, blobs = {}, 0, []
    for name, t in tensors:
        data = np.ascontiguousarray(t, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--rslora", action="store_true")
    ap.add_argument("--targets", default="q,k,v,o,gate,up,down")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--b-std", type=float, default=0.02)
    args = ap.parse_args()
    model = args.model or subprocess.check_output(
        [os.path.join(ROOT, "scripts/fetch-model.sh")], text=True
    ).strip().splitlines()[-1]
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        sys.exit(f"lora-adapter: unknown targets {unknown}; known: {sorted(TARGETS)}")

    arch, n_layer, dims, heads, kv_heads = model_shape(model)
    rng = np.random.default_rng(args.seed)
    r = args.rank
    peft, gguf = [], []
    for layer in range(n_layer):
        for t in targets:
            fan_in, fan_out = dims[t]
            a = (rng.standard_normal((r, fan_in)) / math.sqrt(fan_in)).astype(np.float32)
            b = (rng.standard_normal((fan_out, r)) * args.b_std).astype(np.float32)
            hf, cpp = TARGETS[t]
            prefix = f"base_model.model.model.layers.{layer}.{hf}"
            peft += [(f"{prefix}.lora_A.weight", a), (f"{prefix}.lora_B.weight", b)]
            b_cpp = {"q": lambda m: gguf_rows(m, heads), "k": lambda m: gguf_rows(m, kv_heads)}.get(t, lambda m: m)(b)
            gguf += [(f"blk.{layer}.{cpp}.weight.lora_a", a), (f"blk.{layer}.{cpp}.weight.lora_b", b_cpp)]

    os.makedirs(os.path.join(args.out, "peft"), exist_ok=True)
    write_safetensors(os.path.join(args.out, "peft", "adapter_model.safetensors"), peft)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.basename(model),
        "r": r,
        "lora_alpha": args.alpha,
        "use_rslora": args.rslora,
        "target_modules": [TARGETS[t][0].split(".")[1] for t in targets],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
    }
    with open(os.path.join(args.out, "peft", "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")

    # llama.cpp scales by alpha / rank; rsLoRA's alpha / sqrt(rank) is that with alpha * sqrt(rank).
    alpha = args.alpha * math.sqrt(r) if args.rslora else args.alpha
    w = GGUFWriter(os.path.join(args.out, "adapter.gguf"), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name, t in gguf:
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(args.out)


if __name__ == "__main__":
    main()
