//! Checkpoint formats, quantization types, and the errors bad checkpoints produce.

use crate::common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use common::rel_err;
use common::tiny::write_tiny_gguf;
use ferrite_runtime::model::{self, LoadOptions, LoadedModel, ModelError, WeightMode};

/// With an f32 cache: a 16-bit one rounds keys and values where tiny differences between two
/// loads can fall on either side of a rounding step, and these tests compare formats.
fn first_logits(m: &LoadedModel, prompt: &[u32]) -> Vec<f32> {
    common::first_logits_on(m, &Device::Cpu, prompt, DType::F32)
}

fn load(path: &Path, mode: WeightMode) -> Result<LoadedModel, ModelError> {
    model::load(
        path,
        &LoadOptions {
            weight_mode: mode,
            ..Default::default()
        },
    )
}

#[test]
fn every_supported_quantization_type_loads_and_agrees_with_f32() {
    let dir = tempdir();
    let prompt: Vec<u32> = vec![1, 4093, 198, 1780, 314, 260, 3575, 282];
    let f32_path = dir.join("f32.gguf");
    write_tiny_gguf(&f32_path, "llama", GgmlDType::F32, None, None);
    let reference = first_logits(&load(&f32_path, WeightMode::Dense).expect("f32"), &prompt);
    // Limits are ~1.6x the errors measured on these uniform random weights (F16 7.7e-4,
    // Q8_0 1.8e-2/3.1e-2 dense/quantized, Q6K 5.5e-2, 4-bit 0.22-0.25). A mis-decoded tensor
    // gives errors of order 1.
    let cases = [
        (GgmlDType::F16, 1.5e-3),
        (GgmlDType::Q8_0, 5e-2),
        (GgmlDType::Q6K, 9e-2),
        (GgmlDType::Q4K, 0.4),
        (GgmlDType::Q4_1, 0.4),
        (GgmlDType::Q4_0, 0.4),
    ];
    for (dtype, tol) in cases {
        let path = dir.join(format!("{dtype:?}.gguf"));
        write_tiny_gguf(&path, "llama", dtype, None, None);
        for mode in [WeightMode::Quantized, WeightMode::Dense] {
            let m = load(&path, mode).unwrap_or_else(|e| panic!("{dtype:?}/{mode:?}: {e}"));
            let err = rel_err(&first_logits(&m, &prompt), &reference);
            eprintln!("{dtype:?} {mode:?}: relative logit error {err:.2e} (limit {tol:.0e})");
            assert!(err < tol, "{dtype:?}/{mode:?}: relative error {err}");
            assert!(err > 0.0 || dtype == GgmlDType::F32);
        }
    }
}

#[test]
fn bad_checkpoints_get_clear_errors() {
    let dir = tempdir();
    let expect_err = |path: &Path| -> String {
        match load(path, WeightMode::Auto) {
            Ok(_) => panic!("{} loaded", path.display()),
            Err(e) => e.to_string(),
        }
    };

    let p = dir.join("gpt2.gguf");
    write_tiny_gguf(&p, "gpt2", GgmlDType::F32, None, None);
    let e = expect_err(&p);
    assert!(e.contains("unsupported model architecture 'gpt2'"), "{e}");

    let p = dir.join("missing.gguf");
    write_tiny_gguf(
        &p,
        "llama",
        GgmlDType::Q8_0,
        Some("blk.1.ffn_down.weight"),
        None,
    );
    let e = expect_err(&p);
    assert!(e.contains("missing tensor 'blk.1.ffn_down.weight'"), "{e}");

    let p = dir.join("shape.gguf");
    write_tiny_gguf(
        &p,
        "llama",
        GgmlDType::F32,
        None,
        Some("blk.0.attn_k.weight"),
    );
    let e = expect_err(&p);
    assert!(
        e.contains("blk.0.attn_k.weight") && e.contains("expected [128, 256]"),
        "{e}"
    );

    // A family we do not run, and one we do with a tensor it needs missing: Qwen3's q/k norms.
    let p = dir.join("falcon.gguf");
    write_tiny_gguf(&p, "falcon", GgmlDType::F32, None, None);
    let e = expect_err(&p);
    assert!(e.contains("unsupported model architecture 'falcon'"), "{e}");
    // A mixture-of-experts family without its expert count.
    let p = dir.join("qwen2moe.gguf");
    write_tiny_gguf(&p, "qwen2moe", GgmlDType::F32, None, None);
    let e = expect_err(&p);
    assert!(
        e.contains("missing metadata key 'qwen2moe.expert_count'"),
        "{e}"
    );
    let p = dir.join("qwen3.gguf");
    write_tiny_gguf(&p, "qwen3", GgmlDType::F32, None, None);
    let e = expect_err(&p);
    assert!(
        e.contains("missing tensor 'blk.0.attn_q_norm.weight'"),
        "{e}"
    );

    let p = dir.join("garbage.gguf");
    std::fs::write(&p, b"this is not a model at all").expect("write");
    let e = expect_err(&p);
    assert!(
        e.contains("garbage.gguf") && e.contains("not a readable GGUF"),
        "{e}"
    );

    // A real file cut short: the header parses, the tensor data is missing.
    let good = dir.join("good.gguf");
    write_tiny_gguf(&good, "llama", GgmlDType::Q8_0, None, None);
    let bytes = std::fs::read(&good).expect("read");
    let p = dir.join("truncated.gguf");
    std::fs::write(&p, &bytes[..bytes.len() / 2]).expect("write");
    let e = expect_err(&p);
    assert!(e.contains("truncated.gguf"), "{e}");

    let e = expect_err(&dir.join("does-not-exist.gguf"));
    assert!(
        e.contains("does-not-exist.gguf") && e.contains("No such file"),
        "{e}"
    );

    let hf = dir.join("hf-bad");
    std::fs::create_dir_all(&hf).expect("dir");
    std::fs::write(hf.join("config.json"), r#"{"architectures":["GPTNeoXForCausalLM"],"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"vocab_size":8}"#).expect("w");
    candle_core::safetensors::save(
        &HashMap::from([(
            "x".to_string(),
            Tensor::zeros(2, DType::F32, &Device::Cpu).expect("t"),
        )]),
        hf.join("model.safetensors"),
    )
    .expect("save");
    let e = expect_err(&hf);
    assert!(
        e.contains("unsupported model architecture 'GPTNeoXForCausalLM'"),
        "{e}"
    );
}

/// Inverse of llama.cpp's Q/K row permutation: GGUF stores each head's rows interleaved for the
/// interleaved RoPE; Hugging Face stores them in rotate-half order.
fn unpermute(w: &Tensor, heads: usize) -> Tensor {
    let (out, inp) = w.dims2().expect("2d");
    w.reshape((heads, out / heads / 2, 2, inp))
        .and_then(|t| t.transpose(1, 2))
        .and_then(|t| t.reshape((out, inp)))
        .expect("unpermute")
}

/// Converts the default GGUF into a Hugging Face folder (f32 safetensors, config.json,
/// tokenizer.json, tokenizer_config.json) and checks that both load to the same model.
#[test]
fn hugging_face_folder_matches_the_gguf_it_was_converted_from() {
    let gguf_path = common::default_model();
    let gguf = load(&gguf_path, WeightMode::Dense).expect("gguf");
    let cfg = gguf.model.config().clone();
    let tmp = tempdir();
    let dir = tmp.join("hf");
    std::fs::create_dir_all(&dir).expect("dir");

    let mut f = std::fs::File::open(&gguf_path).expect("open");
    let content = gguf_file::Content::read(&mut f).expect("gguf");
    let mut tensors = HashMap::new();
    for name in content.tensor_infos.keys() {
        let t = content
            .tensor(&mut f, name, &Device::Cpu)
            .expect("t")
            .dequantize(&Device::Cpu)
            .expect("dq");
        let t = if name.ends_with("attn_q.weight") {
            unpermute(&t, cfg.num_heads)
        } else if name.ends_with("attn_k.weight") {
            unpermute(&t, cfg.num_kv_heads)
        } else {
            t
        };
        let hf = ferrite_runtime::model::safetensors::hf_name(name).expect("mapped name");
        tensors.insert(hf, t);
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).expect("save");
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    gguf.tokenizer
        .save_json(&dir.join("tokenizer.json"))
        .expect("tokenizer.json");
    let template = content.metadata["tokenizer.chat_template"]
        .to_string()
        .expect("template")
        .clone();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({ "chat_template": template }).to_string(),
    )
    .expect("tokenizer_config");

    let hf = load(&dir, WeightMode::Auto).expect("load HF folder");
    assert_eq!(
        hf.model.config().rope_style,
        ferrite_runtime::model::RopeStyle::Half
    );
    let text = "Hello world! 12345 fn main() { println!(\"hi\"); } 🦀";
    let ids = gguf.tokenizer.encode(text, false).expect("enc");
    assert_eq!(hf.tokenizer.encode(text, false).expect("enc"), ids);
    let msgs = vec![ferrite_runtime::model::ChatMessage {
        role: "user".into(),
        content: "Hi".into(),
        ..Default::default()
    }];
    assert_eq!(
        hf.chat_template
            .as_ref()
            .expect("tmpl")
            .render(&msgs, true)
            .expect("render"),
        gguf.chat_template
            .as_ref()
            .expect("tmpl")
            .render(&msgs, true)
            .expect("render"),
    );
    // config.json's EOS, then the vocabulary's other end-of-turn token, as from the GGUF.
    assert_eq!(hf.eos_token_ids, vec![2, 0]);
    assert_eq!(hf.eos_token_ids, gguf.eos_token_ids);
    let prompt = gguf.tokenizer.encode(common::PROMPT, false).expect("enc");
    let err = rel_err(&first_logits(&hf, &prompt), &first_logits(&gguf, &prompt));
    eprintln!("HF folder vs GGUF: relative logit error {err:.2e}");
    assert!(err < 1e-4, "HF folder logits differ from the GGUF's: {err}");
}

/// A scratch directory removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn join(&self, p: impl AsRef<Path>) -> std::path::PathBuf {
        self.0.join(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir() -> TempDir {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let d = std::env::temp_dir().join(format!("ferrite-test-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&d).expect("tempdir");
    TempDir(d)
}

/// `auto` on the CPU computes a float checkpoint at its own precision (`dense`) and keeps a
/// quantized one's blocks (`packed`): repacking F16 weights to 8 bits changes a model's greedy
/// outputs, so it happens only when asked for (`--weights packed`).
#[test]
fn auto_repacks_only_quantized_checkpoints_on_the_cpu() {
    let dir = tempdir();
    for (dtype, want) in [
        (GgmlDType::F16, WeightMode::Dense),
        (GgmlDType::F32, WeightMode::Dense),
        (GgmlDType::Q8_0, WeightMode::Packed),
        (GgmlDType::Q4_1, WeightMode::Packed),
    ] {
        let p = dir.join(format!("{dtype:?}.gguf"));
        write_tiny_gguf(&p, "llama", dtype, None, None);
        let m = load(&p, WeightMode::Auto).expect("load");
        assert_eq!(m.weight_mode, want, "{dtype:?}");
        let asked = load(&p, WeightMode::Packed).expect("load packed");
        assert_eq!(
            asked.weight_mode,
            WeightMode::Packed,
            "{dtype:?} asked for packed"
        );
    }
}
