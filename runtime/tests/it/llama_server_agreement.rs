//! The default runtime (packed weights, 16-bit KV cache) against llama.cpp's `llama-server` on
//! the same GGUF: ten chat prompts, greedy. llama-server's answers are recorded once by
//! `scripts/record-llama-greedy.py` (building it takes ~10 minutes), with the gap between its
//! two best log-probabilities at every step. The same for an F16 checkpoint of the default
//! model (`scripts/gguf-variants.py f16`), which `--weights auto` computes at F16 precision
//! (dense) rather than repacking to 8 bits.
//!
//! Both quantize activations to 8 bits, but in different places and orders, so exact agreement
//! is not expected everywhere: a prompt must agree for at least [`MIN_AGREED`] tokens, or part
//! only at a near-tie, where either side's two best logits are within [`TIE_GAP`].

use std::path::Path;

use crate::common;

use candle_core::Device;
use ferrite_runtime::kv::{KvCache, KvCacheConfig};
use ferrite_runtime::model::driver::{GreedySeq, run_greedy};
use ferrite_runtime::model::{self, LoadOptions, WeightMode};
use serde_json::Value;

const MIN_AGREED: usize = 16;
/// Top-two gap (in logits, which equals the gap in log-probabilities) below which the two
/// implementations' rounding may pick either token: about what 8-bit activations move a logit
/// by (`runtime_reference.rs` measures max ~1.3 against f32 over a whole answer).
const TIE_GAP: f32 = 1.0;

fn fixture(name: &str) -> Value {
    let path = ferrite_testkit::paths::workspace_root()
        .join("runtime/tests/fixtures")
        .join(name);
    let text = std::fs::read_to_string(path).expect("fixture");
    serde_json::from_str(&text).expect("fixture JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect()
}

fn top2_gap(logits: &[f32]) -> f32 {
    let mut v = logits.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

#[test]
fn greedy_answers_agree_with_llama_server() {
    let exact = agree(
        "llama_server_greedy.json",
        &common::default_model(),
        (WeightMode::Auto, WeightMode::Packed),
        None,
        0,
    );
    eprintln!("{exact} of 10 answers identical to llama.cpp's");
}

/// With a LoRA adapter (`scripts/lora-adapter.py`'s default, every projection at rank 8), in
/// its PEFT form, against llama-server's `--lora` with the GGUF form of the same adapter.
#[test]
fn greedy_answers_with_a_lora_adapter_agree_with_llama_server() {
    let adapter = common::lora_adapter_dir(1).join("peft");
    let exact = agree(
        "llama_server_greedy_lora.json",
        &common::default_model(),
        (WeightMode::Auto, WeightMode::Packed),
        Some(&adapter),
        0,
    );
    eprintln!("LoRA: {exact} of 10 answers identical to llama.cpp's");
}

/// An F16 checkpoint computes at F16 precision by default (`--weights auto` keeps it dense on
/// the CPU), and its greedy answers follow llama.cpp's on the same file.
#[test]
fn greedy_answers_of_an_f16_checkpoint_agree_with_llama_server() {
    let exact = agree(
        "llama_server_greedy_f16.json",
        &ferrite_testkit::model::gguf_variant("f16", false).join("model.gguf"),
        (WeightMode::Auto, WeightMode::Dense),
        None,
        8,
    );
    eprintln!("F16: {exact} of 10 answers identical to llama.cpp's");
}

/// Qwen3 (per-head q/k norms, rotate-half RoPE) made from the default model's weights at F16
/// (`scripts/gguf-variants.py qwen3`), against llama-server on the same file.
#[test]
fn greedy_answers_of_a_qwen3_checkpoint_agree_with_llama_server() {
    let exact = agree(
        "llama_server_greedy_qwen3.json",
        &ferrite_testkit::model::gguf_variant("qwen3", true).join("model.gguf"),
        (WeightMode::Auto, WeightMode::Dense),
        None,
        6,
    );
    eprintln!("Qwen3: {exact} of 10 answers identical to llama.cpp's");
}

/// The F16 model with a SentencePiece vocabulary made from its BPE (`scripts/gguf-variants.py
/// spm`): our tokenizer, rebuilt from the GGUF's `llama` metadata, must read every prompt as
/// llama.cpp does (`agree` checks the ids), and the answers follow.
#[test]
fn greedy_answers_with_a_sentencepiece_vocabulary_agree_with_llama_server() {
    let exact = agree(
        "llama_server_greedy_spm.json",
        &ferrite_testkit::model::gguf_variant("spm", false).join("model.gguf"),
        (WeightMode::Auto, WeightMode::Dense),
        None,
        8,
    );
    eprintln!("SentencePiece: {exact} of 10 answers identical to llama.cpp's");
}

/// Mixtral's layout (a `llama` GGUF with experts, interleaved RoPE; `scripts/gguf-variants.py
/// mixtral`), packed to 8 bits as `auto` would not (it is F16) but as a user's quantized Mixtral
/// is run, and at F16.
#[test]
fn greedy_answers_of_a_mixtral_checkpoint_agree_with_llama_server() {
    agree_in_modes(
        "Mixtral",
        "llama_server_greedy_mixtral.json",
        &ferrite_testkit::model::gguf_variant("mixtral", true).join("model.gguf"),
        &[
            (WeightMode::Auto, WeightMode::Dense),
            (WeightMode::Packed, WeightMode::Packed),
        ],
        8,
    );
}

/// Qwen2-MoE (Q/K/V biases, experts not renormalised, a shared expert under a sigmoid gate;
/// `scripts/gguf-variants.py qwen2moe`), against llama-server on the same file.
#[test]
fn greedy_answers_of_a_qwen2_moe_checkpoint_agree_with_llama_server() {
    let exact = agree(
        "llama_server_greedy_qwen2moe.json",
        &ferrite_testkit::model::gguf_variant("qwen2moe", false).join("model.gguf"),
        (WeightMode::Auto, WeightMode::Dense),
        None,
        7,
    );
    eprintln!("Qwen2-MoE: {exact} of 10 answers identical to llama.cpp's");
}

/// Phi-3 (fused Q/K/V and gate/up, an untied output, LongRoPE's short factors;
/// `scripts/gguf-variants.py phi3`), against llama-server on the same file.
#[test]
fn greedy_answers_of_a_phi3_checkpoint_agree_with_llama_server() {
    let exact = agree(
        "llama_server_greedy_phi3.json",
        &ferrite_testkit::model::gguf_variant("phi3", true).join("model.gguf"),
        (WeightMode::Auto, WeightMode::Dense),
        None,
        7,
    );
    eprintln!("Phi-3: {exact} of 10 answers identical to llama.cpp's");
}

/// Phi-4-mini's partial rotary embeddings: three quarters of each head rotated, the rest
/// passed through (`scripts/gguf-variants.py phi4mini`), against llama-server on the same file.
#[test]
fn greedy_answers_of_a_phi4_mini_checkpoint_agree_with_llama_server() {
    let path = ferrite_testkit::model::gguf_variant("phi4mini", true).join("model.gguf");
    let cfg = model::gguf::GgufFile::open(&path, &Device::Cpu)
        .and_then(|mut f| f.config())
        .expect("config");
    assert_eq!((cfg.head_dim, cfg.rotary_dim), (64, 48));
    let exact = agree(
        "llama_server_greedy_phi4mini.json",
        &path,
        (WeightMode::Auto, WeightMode::Dense),
        None,
        8,
    );
    eprintln!("Phi-4-mini: {exact} of 10 answers identical to llama.cpp's");
}

/// Gemma 3 (q/k norms, norms after each block, GeGLU, a scaled embedding, five sliding layers
/// of a 16-token window to one global with another RoPE base; `scripts/gguf-variants.py
/// gemma3`), against llama-server on the same file, in every weight mode. The prompts are 15
/// to 19 tokens long, so every answer runs past the window.
#[test]
fn greedy_answers_of_a_gemma3_checkpoint_agree_with_llama_server() {
    agree_in_modes(
        "Gemma 3",
        "llama_server_greedy_gemma3.json",
        &ferrite_testkit::model::gguf_variant("gemma3", true).join("model.gguf"),
        &EVERY_MODE,
        8,
    );
}

/// Gemma 2 (Gemma 3's layer without q/k norms, every other layer within a 16-token window,
/// attention scores soft-capped at 10 and logits at 30; `scripts/gguf-variants.py gemma2`),
/// against llama-server on the same file.
#[test]
fn greedy_answers_of_a_gemma2_checkpoint_agree_with_llama_server() {
    let exact = agree(
        "llama_server_greedy_gemma2.json",
        &ferrite_testkit::model::gguf_variant("gemma2", true).join("model.gguf"),
        (WeightMode::Auto, WeightMode::Dense),
        None,
        8,
    );
    eprintln!("Gemma 2: {exact} of 10 answers identical to llama.cpp's");
}

/// Qwen3-MoE (4 experts, top 2; `scripts/gguf-variants.py qwen3moe`) in every weight mode: at
/// F16 (`auto`), with the experts cut out of the stacked F16 blocks (`quantized`), and
/// repacked to 8 bits (`packed`).
#[test]
fn greedy_answers_of_a_qwen3_moe_checkpoint_agree_with_llama_server() {
    agree_in_modes(
        "Qwen3-MoE",
        "llama_server_greedy_qwen3moe.json",
        &ferrite_testkit::model::gguf_variant("qwen3moe", true).join("model.gguf"),
        &EVERY_MODE,
        5,
    );
}

/// A float checkpoint's weight modes as (asked, resolved): at its F16 precision (`auto`), with
/// candle's kernels on its F16 blocks (`quantized`), repacked to 8 bits (`packed`).
const EVERY_MODE: [(WeightMode, WeightMode); 3] = [
    (WeightMode::Auto, WeightMode::Dense),
    (WeightMode::Quantized, WeightMode::Quantized),
    (WeightMode::Packed, WeightMode::Packed),
];

/// [`agree`] in each of `modes`, holding the runs at F16 precision to `floor` identical answers
/// (packed runs to none).
fn agree_in_modes(
    label: &str,
    fixture_name: &str,
    path: &Path,
    modes: &[(WeightMode, WeightMode)],
    floor: usize,
) {
    for &(request, resolved) in modes {
        let min = if resolved == WeightMode::Packed {
            0
        } else {
            floor
        };
        let exact = agree(fixture_name, path, (request, resolved), None, min);
        eprintln!("{label} {resolved:?}: {exact} of 10 answers identical to llama.cpp's");
    }
}

/// Runs the fixture's prompts greedily on `model` (with `adapter`, a LoRA adapter's path, on
/// every sequence) loaded with weight mode `request`, checks that it resolved to `resolved`,
/// that every answer agrees with llama.cpp's for [`MIN_AGREED`] tokens or parts only at a
/// near-tie, and that at least `min_exact` of the ten are identical. Returns how many are.
///
/// The near-tie rule alone cannot fail on a test model whose answers are unsure (most of the
/// architectures' are): with Gemma 2's soft-cap left out, every answer parted at a gap below
/// [`TIE_GAP`] and 3 of 10 stayed identical. Computed at the checkpoint's F16 precision, as
/// llama.cpp computes it, each of them gives 7 to 10 of 10 on this VM's AVX-512: `min_exact`
/// holds them to it, with one or two answers of slack for other CPUs' rounding (packed
/// modes, whose 8-bit activations round elsewhere than llama.cpp's, take 0).
fn agree(
    fixture_name: &str,
    model_path: &Path,
    (request, resolved): (WeightMode, WeightMode),
    adapter: Option<&Path>,
    min_exact: usize,
) -> usize {
    let fx = fixture(fixture_name);
    let opts = LoadOptions {
        weight_mode: request,
        ..Default::default()
    };
    let loaded = model::load(model_path, &opts).expect("load");
    let adapter = adapter.map(|p| crate::lora::load_adapter(&loaded, "adapter", p));
    assert_eq!(
        loaded.weight_mode,
        resolved,
        "--weights {request:?} on {}",
        model_path.display()
    );
    // Fixtures recorded since the sample texts were added carry them: each must read as
    // llama.cpp reads it.
    for t in fx["texts"].as_array().into_iter().flatten() {
        let text = t["text"].as_str().expect("text");
        let ours = loaded.tokenizer.encode(text, false).expect("encode");
        assert_eq!(ours, ids(&t["ids"]), "tokens of {text:?}");
    }
    let prompts = fx["prompts"].as_array().expect("prompts");
    assert_eq!(prompts.len(), 10);
    let mut seqs: Vec<GreedySeq> = prompts
        .iter()
        .map(|p| {
            let want = ids(&p["ids"]);
            // Our tokenizer must read the chat text as llama.cpp does.
            let ours = loaded
                .tokenizer
                .encode(p["text"].as_str().expect("text"), false)
                .expect("encode");
            assert_eq!(ours, want, "tokens of {:?}", p["text"]);
            let mut s = GreedySeq::new(want, ids(&p["tokens"]).len());
            s.keep_all_logits = true;
            s.adapter = adapter.clone();
            s
        })
        .collect();
    let cfg = KvCacheConfig::for_model(loaded.model.config(), 16, 256, 0);
    let mut cache = KvCache::new(cfg, &Device::Cpu).expect("cache");
    run_greedy(&loaded.model, &mut cache, &mut seqs, 64).expect("run");

    let mut exact = 0;
    for (p, s) in prompts.iter().zip(&seqs) {
        let theirs = ids(&p["tokens"]);
        let same = s
            .generated
            .iter()
            .zip(&theirs)
            .take_while(|(a, b)| a == b)
            .count();
        let question = p["question"].as_str().unwrap_or_default();
        let ours_text = loaded.tokenizer.decode(&s.generated, true).expect("decode");
        if same == theirs.len() {
            exact += 1;
            eprintln!("{question:?}: all {same} tokens agree: {ours_text:?}");
            continue;
        }
        let our_gap = top2_gap(&s.all_logits[same]);
        let their_gap = p["top2_gaps"][same].as_f64().unwrap_or(f64::INFINITY) as f32;
        eprintln!(
            "{question:?}: {same} tokens agree, then top-two gaps ours {our_gap:.3}, \
             llama.cpp's {their_gap:.3}\n  ours:      {ours_text:?}\n  llama.cpp: {:?}",
            p["answer"]
        );
        assert!(
            same >= MIN_AGREED || our_gap.min(their_gap) < TIE_GAP,
            "{question:?} parts from llama.cpp at token {same} where neither side has a \
             near-tie (gaps {our_gap}, {their_gap}): ours {ours_text:?}, llama.cpp's {:?}",
            p["answer"]
        );
    }
    assert!(
        exact >= min_exact,
        "{fixture_name} ({resolved:?}): {exact} of 10 answers identical to llama.cpp's, \
         fewer than {min_exact}"
    );
    exact
}
