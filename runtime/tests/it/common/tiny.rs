//! Tiny random Llama-family GGUF checkpoints, with the default model's real vocabulary.

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use ferrite_testkit::random::values;

pub const HIDDEN: usize = 256;
pub const FFN: usize = 512;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const LAYERS: usize = 2;

/// Tokenizer metadata of the default model, reused so tiny models have a real vocabulary.
fn tokenizer_metadata() -> Vec<(String, Value)> {
    let mut f = std::fs::File::open(super::default_model()).expect("model");
    let c = gguf_file::Content::read(&mut f).expect("gguf");
    c.metadata
        .into_iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .collect()
}

/// Writes a tiny random Llama-family GGUF with matrices in `dtype`.
pub fn write_tiny_gguf(
    path: &Path,
    arch: &str,
    dtype: GgmlDType,
    drop: Option<&str>,
    bad_shape: Option<&str>,
) {
    let vocab = 49152;
    let mut md: Vec<(String, Value)> = tokenizer_metadata();
    let k = |s: &str| format!("{arch}.{s}");
    md.extend([
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        (k("embedding_length"), Value::U32(HIDDEN as u32)),
        (k("feed_forward_length"), Value::U32(FFN as u32)),
        (k("block_count"), Value::U32(LAYERS as u32)),
        (k("attention.head_count"), Value::U32(HEADS as u32)),
        (k("attention.head_count_kv"), Value::U32(KV_HEADS as u32)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (k("rope.freq_base"), Value::F32(10000.0)),
        (k("context_length"), Value::U32(512)),
    ]);
    let hd = HIDDEN / HEADS;
    let mut specs: Vec<(String, Vec<usize>, bool)> = vec![
        ("token_embd.weight".into(), vec![vocab, HIDDEN], true),
        ("output_norm.weight".into(), vec![HIDDEN], false),
    ];
    for l in 0..LAYERS {
        let p = |s: &str| format!("blk.{l}.{s}");
        specs.extend([
            (p("attn_norm.weight"), vec![HIDDEN], false),
            (p("ffn_norm.weight"), vec![HIDDEN], false),
            (p("attn_q.weight"), vec![HEADS * hd, HIDDEN], true),
            (p("attn_k.weight"), vec![KV_HEADS * hd, HIDDEN], true),
            (p("attn_v.weight"), vec![KV_HEADS * hd, HIDDEN], true),
            (p("attn_output.weight"), vec![HIDDEN, HEADS * hd], true),
            (p("ffn_gate.weight"), vec![FFN, HIDDEN], true),
            (p("ffn_up.weight"), vec![FFN, HIDDEN], true),
            (p("ffn_down.weight"), vec![HIDDEN, FFN], true),
        ]);
    }
    let mut tensors = Vec::new();
    for (i, (name, mut shape, matrix)) in specs.into_iter().enumerate() {
        if drop == Some(name.as_str()) {
            continue;
        }
        if bad_shape == Some(name.as_str()) {
            shape[0] += 32;
        }
        let n: usize = shape.iter().product();
        let t = if matrix {
            let v = values(n, i as u64 + 1, 0.08);
            let t = Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).expect("t");
            QTensor::quantize(&t, dtype).expect("quantize")
        } else {
            let v: Vec<f32> = values(n, i as u64 + 1, 0.1)
                .iter()
                .map(|x| 1.0 + x)
                .collect();
            let t = Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).expect("t");
            QTensor::quantize(&t, GgmlDType::F32).expect("f32")
        };
        tensors.push((name, t));
    }
    let mut f = std::fs::File::create(path).expect("create");
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &md_refs, &t_refs).expect("write gguf");
}
