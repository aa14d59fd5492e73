//! The architectures that `scripts/gguf-variants.py` builds from the default model's weights
//! (Qwen3's q/k norms, Qwen3-MoE's and Mixtral's experts, Phi-3's fused projections and
//! LongRoPE, Gemma 3's norms, GeGLU and local layers, Qwen2-MoE's shared expert), in their
//! two forms: the Hugging Face
//! folder must give the tokens the GGUF gives. (Each GGUF against llama.cpp is in
//! `llama_server_agreement.rs`.)

use std::path::PathBuf;

use candle_core::{DType, Device};
use ferrite_runtime::kv::{KvCache, KvCacheConfig};
use ferrite_runtime::model::driver::{GreedySeq, run_greedy};
use ferrite_runtime::model::{self, Arch, LoadOptions, LoadedModel, Moe, WeightMode};

use crate::common;

const QUESTIONS: [&str; 4] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
];

/// The experts of the generator's MoE variants: 4 of the dense FFN's size, 2 per token,
/// renormalised.
const VARIANT_MOE: Moe = Moe {
    num_experts: 4,
    experts_per_token: 2,
    expert_ffn: 1536,
    norm_top_k: true,
    shared_ffn: None,
};

/// The variant's GGUF and its Hugging Face folder, with a `tokenizer.json` written there from
/// the GGUF's tokenizer (the generator has no tokenizer library to write one).
fn variant(name: &str) -> (PathBuf, PathBuf) {
    let dir = ferrite_testkit::model::gguf_variant(name, true);
    let (gguf, hf) = (dir.join("model.gguf"), dir.join("hf"));
    let tokenizer = hf.join("tokenizer.json");
    if !tokenizer.exists() {
        let file = model::gguf::GgufFile::open(&gguf, &Device::Cpu).expect("open the GGUF");
        let tok = model::Tokenizer::from_gguf(file.metadata()).expect("the GGUF's tokenizer");
        let partial = hf.join(format!("tokenizer.json.{}", std::process::id()));
        tok.save_json(&partial).expect("write tokenizer.json");
        std::fs::rename(&partial, &tokenizer).expect("put tokenizer.json in place");
    }
    (gguf, hf)
}

fn load(path: &std::path::Path) -> LoadedModel {
    let opts = LoadOptions {
        weight_mode: WeightMode::Dense,
        ..Default::default()
    };
    model::load(path, &opts).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Greedy answers to [`QUESTIONS`], `tokens` each, and every step's logits.
fn answers(m: &LoadedModel, tokens: usize) -> Vec<GreedySeq> {
    let template = m.chat_template.as_ref().expect("a chat template");
    let mut seqs: Vec<GreedySeq> = QUESTIONS
        .iter()
        .map(|q| {
            let msgs = [model::ChatMessage {
                role: "user".into(),
                content: (*q).into(),
                ..Default::default()
            }];
            let text = template.render(&msgs, true).expect("render");
            let mut s = GreedySeq::new(m.tokenizer.encode(&text, false).expect("encode"), tokens);
            s.keep_all_logits = true;
            s
        })
        .collect();
    // An f32 cache: a 16-bit one rounds keys where the two RoPE layouts' last bits differ.
    let cfg = KvCacheConfig::for_model(m.model.config(), 16, 128, 0).with_dtype(DType::F32);
    let mut cache = KvCache::new(cfg, &Device::Cpu).expect("cache");
    run_greedy(&m.model, &mut cache, &mut seqs, 64).expect("run");
    seqs
}

/// Loads both forms, checks they read the same configuration, and that they answer with the
/// same tokens and (from the same F16 values, computed the same way) the same logits.
/// `archs`: what the GGUF and the folder read as (Mixtral's GGUF is a `llama` file with
/// interleaved RoPE, its folder a Mistral with rotate-half RoPE: the same model).
fn folder_matches_gguf(name: &str, archs: (Arch, Arch), moe: Option<Moe>) {
    let qk_norm = matches!(archs.0, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3);
    let (gguf_path, hf_path) = variant(name);
    let (gguf, hf) = (load(&gguf_path), load(&hf_path));
    let (a, b) = (gguf.model.config(), hf.model.config());
    assert_eq!((a.arch, b.arch), archs);
    assert_eq!((a.qk_norm, b.qk_norm), (qk_norm, qk_norm));
    assert_eq!(a.rope_scaling, b.rope_scaling);
    assert_eq!(a.tie_word_embeddings, b.tie_word_embeddings);
    assert_eq!((a.moe, b.moe), (moe, moe));
    assert_eq!(a.attention_bias, b.attention_bias);
    assert_eq!(a.sliding_window, b.sliding_window);
    assert_eq!(
        (a.attn_logit_softcap, a.final_logit_softcap),
        (b.attn_logit_softcap, b.final_logit_softcap)
    );
    assert_eq!(a.local_layers, b.local_layers);
    assert_eq!(
        (a.activation, a.embedding_scale, a.post_norms),
        (b.activation, b.embedding_scale, b.post_norms)
    );
    assert_eq!(a.score_scale(), b.score_scale());
    if archs.0 == archs.1 {
        assert_eq!(a.rope_style, b.rope_style);
    }
    assert_eq!(
        (a.head_dim, a.rotary_dim, a.num_kv_heads),
        (b.head_dim, b.rotary_dim, b.num_kv_heads)
    );
    assert_eq!(hf.eos_token_ids, gguf.eos_token_ids);
    let (ours, theirs) = (answers(&hf, 16), answers(&gguf, 16));
    for (q, (h, g)) in QUESTIONS.iter().zip(ours.iter().zip(&theirs)) {
        let text = gguf.tokenizer.decode(&g.generated, true).expect("decode");
        eprintln!("{name} {q:?}: {text:?}");
        assert_eq!(h.prompt, g.prompt, "{name}: prompt tokens of {q:?}");
        assert_eq!(h.generated, g.generated, "{name}: answer to {q:?}");
        let worst = h
            .all_logits
            .iter()
            .zip(&g.all_logits)
            .map(|(x, y)| common::rel_err(x, y))
            .fold(0f32, f32::max);
        // Same values computed the same way, but the two RoPE layouts sum in other orders.
        assert!(worst < 1e-4, "{name}: logits of {q:?} differ by {worst}");
    }
}

#[test]
fn a_qwen3_folder_answers_as_its_gguf_does() {
    folder_matches_gguf("qwen3", (Arch::Qwen3, Arch::Qwen3), None);
}

#[test]
fn a_qwen3_moe_folder_answers_as_its_gguf_does() {
    folder_matches_gguf(
        "qwen3moe",
        (Arch::Qwen3Moe, Arch::Qwen3Moe),
        Some(VARIANT_MOE),
    );
}

/// Qwen2-MoE: Q/K/V biases, experts not renormalised, the shared expert and its `[1, hidden]`
/// gate (`mlp.shared_expert_gate`).
#[test]
fn a_qwen2_moe_folder_answers_as_its_gguf_does() {
    let moe = Moe {
        norm_top_k: false,
        shared_ffn: Some(1536),
        ..VARIANT_MOE
    };
    folder_matches_gguf("qwen2moe", (Arch::Qwen2Moe, Arch::Qwen2Moe), Some(moe));
}

#[test]
fn a_phi3_folder_answers_as_its_gguf_does() {
    folder_matches_gguf("phi3", (Arch::Phi3, Arch::Phi3), None);
}

/// Phi-4-mini's partial rotary embeddings (`partial_rotary_factor` 0.75 in the folder,
/// `phi3.rope.dimension_count` 48 of 64 in the GGUF).
#[test]
fn a_phi4_mini_folder_answers_as_its_gguf_does() {
    folder_matches_gguf("phi4mini", (Arch::Phi3, Arch::Phi3), None);
}

/// Gemma 3: the folder's norms are stored less 1 (Gemma's `1 + weight`) and its sliding layers
/// come from `sliding_window_pattern`; the GGUF's from llama.cpp's fixed pattern.
#[test]
fn a_gemma3_folder_answers_as_its_gguf_does() {
    folder_matches_gguf("gemma3", (Arch::Gemma3, Arch::Gemma3), None);
}

/// Gemma 2: soft-capped attention and logits, every other layer sliding.
#[test]
fn a_gemma2_folder_answers_as_its_gguf_does() {
    folder_matches_gguf("gemma2", (Arch::Gemma2, Arch::Gemma2), None);
}

#[test]
fn a_mixtral_folder_answers_as_its_gguf_does() {
    folder_matches_gguf("mixtral", (Arch::Llama, Arch::Mistral), Some(VARIANT_MOE));
}

/// The first logits of a prompt.
fn first_logits(m: &model::LlamaModel, prompt: &[u32]) -> Vec<f32> {
    let mut seqs = [GreedySeq::new(prompt.to_vec(), 1)];
    let cfg = KvCacheConfig::for_model(m.config(), 16, 16, 0).with_dtype(DType::F32);
    let mut cache = KvCache::new(cfg, &Device::Cpu).expect("cache");
    run_greedy(m, &mut cache, &mut seqs, 64).expect("run");
    seqs[0].first_logits.take().expect("logits")
}

/// Gemma's final soft-cap, where a config sets one (`final_logit_softcapping`): each logit
/// becomes `cap · tanh(logit / cap)`, so none passes the cap and the order stays.
#[test]
fn a_final_logit_soft_cap_bounds_every_logit() {
    let (gguf, _) = variant("gemma3");
    let plain = load(&gguf);
    let mut file = model::gguf::GgufFile::open(&gguf, &Device::Cpu).expect("open");
    let cfg = file.config().expect("config");
    assert_eq!(cfg.final_logit_softcap, None);
    let weights = model::LlamaWeights::load(&cfg, &mut file, WeightMode::Dense, &Device::Cpu)
        .expect("weights");
    let cap = 5.0f32;
    let capped_cfg = model::ModelConfig {
        final_logit_softcap: Some(cap),
        ..cfg
    };
    let capped = model::LlamaModel::new(capped_cfg, weights, 256, &Device::Cpu).expect("model");
    let prompt = plain.tokenizer.encode("The sea is", false).expect("encode");
    let (a, b) = (
        first_logits(&plain.model, &prompt),
        first_logits(&capped, &prompt),
    );
    let max = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(
        max > 2.0 * cap,
        "the test needs logits past the cap, max {max}"
    );
    for (x, y) in a.iter().zip(&b) {
        let want = cap * (x / cap).tanh();
        assert!(
            (y - want).abs() <= 1e-5 * cap,
            "{x} capped to {y}, not {want}"
        );
        assert!(y.abs() <= cap);
    }
}

/// A multimodal Gemma 3 folder (`Gemma3ForConditionalGeneration`, as gemma-3-4b-it and larger
/// ship): the text model's config under `text_config`, with what equals Gemma 3's defaults left
/// out, its tensors under `language_model.model.*`, and a vision tower beside them. Made here
/// from the gemma3 variant's folder; it must answer as the GGUF does.
#[test]
fn a_multimodal_gemma3_folder_serves_its_language_model() {
    let (gguf_path, hf_path) = variant("gemma3");
    let dir = ferrite_testkit::process::TempDir::new("gemma3-multimodal");
    let tensors = candle_core::safetensors::load(hf_path.join("model.safetensors"), &Device::Cpu)
        .expect("the folder's tensors");
    let mut renamed: std::collections::HashMap<String, candle_core::Tensor> = tensors
        .into_iter()
        .map(|(name, t)| {
            let name = match name.strip_prefix("model.") {
                Some(rest) => format!("language_model.model.{rest}"),
                None => name,
            };
            (name, t)
        })
        .collect();
    renamed.insert(
        "vision_tower.vision_model.post_layernorm.weight".into(),
        candle_core::Tensor::ones(8, DType::F32, &Device::Cpu).expect("tower"),
    );
    candle_core::safetensors::save(&renamed, dir.path().join("model.safetensors")).expect("save");
    let text: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(hf_path.join("config.json")).expect("config.json"),
    )
    .expect("json");
    let mut text = text.as_object().expect("object").clone();
    let (bos, eos) = (text.remove("bos_token_id"), text.remove("eos_token_id"));
    // Left to Gemma 3's defaults, which they equal.
    for key in [
        "architectures",
        "hidden_activation",
        "rope_local_base_freq",
        "sliding_window_pattern",
        "attention_bias",
        "final_logit_softcapping",
        "attn_logit_softcapping",
    ] {
        text.remove(key);
    }
    let config = serde_json::json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "bos_token_id": bos,
        "eos_token_id": eos,
        "text_config": text,
        "vision_config": {"hidden_size": 8},
    });
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write config");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(hf_path.join(f), dir.path().join(f)).expect("copy the tokenizer");
    }
    let (gguf, mm) = (load(&gguf_path), load(dir.path()));
    assert_eq!(mm.model.config().arch, Arch::Gemma3);
    assert_eq!(
        mm.model.config().local_layers,
        gguf.model.config().local_layers
    );
    assert_eq!(mm.eos_token_ids, gguf.eos_token_ids);
    let (ours, theirs) = (answers(&mm, 16), answers(&gguf, 16));
    for (q, (a, b)) in QUESTIONS.iter().zip(ours.iter().zip(&theirs)) {
        assert_eq!(a.generated, b.generated, "answer to {q:?}");
    }
}
