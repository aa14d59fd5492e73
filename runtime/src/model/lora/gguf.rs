//! llama.cpp's GGUF LoRA files (`convert_lora_to_gguf.py`): `general.type = adapter`,
//! `adapter.type = lora`, `adapter.lora.alpha`, and tensors named after the base model's
//! (`blk.N.attn_q.weight`) plus `.lora_a` (`[r, in]`) and `.lora_b` (`[out, r]`), scaled as
//! llama.cpp scales them: `alpha / r`, or 1 when the file has no alpha.

use std::path::Path;

use candle_core::Device;
use candle_core::quantized::gguf_file::{Content, Value};

use super::{LoraError, RawAdapter, RawPair, RowOrder, Target, fits_base_arch, matrix};
use crate::model::ModelConfig;

pub(super) fn read(path: &Path, cfg: &ModelConfig) -> Result<RawAdapter, LoraError> {
    let invalid = |reason: String| LoraError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = std::fs::File::open(path).map_err(|source| LoraError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let content = Content::read(&mut file).map_err(|e| invalid(e.to_string()))?;
    let text = |key: &str| match content.metadata.get(key) {
        Some(Value::String(s)) => Some(s.clone()),
        _ => None,
    };
    if text("general.type").as_deref() != Some("adapter")
        || text("adapter.type").as_deref() != Some("lora")
    {
        return Err(invalid(
            "not a LoRA adapter (general.type must be \"adapter\", adapter.type \"lora\")".into(),
        ));
    }
    let arch = text("general.architecture").unwrap_or_default();
    if !fits_base_arch(&arch, cfg.arch) {
        return Err(invalid(format!(
            "an adapter for architecture \"{arch}\", the base model is {:?}",
            cfg.arch
        )));
    }
    let alpha = match content.metadata.get("adapter.lora.alpha") {
        Some(v) => v
            .to_f32()
            .map_err(|e| invalid(format!("adapter.lora.alpha: {e}")))?,
        None => 0.0,
    };

    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut pairs = Vec::new();
    for name in names {
        // Norm vectors are skipped as llama.cpp skips them.
        if name.ends_with("_norm.weight") {
            continue;
        }
        let Some(base) = name.strip_suffix(".lora_a") else {
            if name.ends_with(".lora_b") {
                continue;
            }
            return Err(invalid(format!("tensor {name} is not a LoRA factor")));
        };
        let (layer, target) = parse_base(base).ok_or_else(|| {
            invalid(format!(
                "tensor {name} is not a LoRA factor of a Llama projection"
            ))
        })?;
        let b_name = format!("{base}.lora_b");
        if !content.tensor_infos.contains_key(&b_name) {
            return Err(invalid(format!("{name} has no {b_name}")));
        }
        let mut read = |n: &str| -> Result<_, LoraError> {
            let q = content
                .tensor(&mut file, n, &Device::Cpu)
                .map_err(|e| invalid(format!("{n}: {e}")))?;
            Ok(matrix(&q.dequantize(&Device::Cpu)?)?)
        };
        let (a, a_shape) = read(name)?;
        let (b, b_shape) = read(&b_name)?;
        pairs.push(RawPair {
            layer,
            target,
            a,
            a_shape,
            b,
            b_shape,
        });
    }
    // Every B must have had its A.
    let bs = content
        .tensor_infos
        .keys()
        .filter(|n| n.ends_with(".lora_b"))
        .count();
    if bs != pairs.len() {
        return Err(invalid("a lora_b tensor has no lora_a".into()));
    }
    Ok(RawAdapter {
        pairs,
        scale: Box::new(move |r| if alpha == 0.0 { 1.0 } else { alpha / r as f32 }),
        order: RowOrder::LlamaCpp,
    })
}

/// `(layer, target)` of a base tensor name such as `blk.3.attn_q.weight`.
fn parse_base(name: &str) -> Option<(usize, Target)> {
    let rest = name.strip_prefix("blk.")?.strip_suffix(".weight")?;
    let (layer, tensor) = rest.split_once('.')?;
    let target = Target::ALL.into_iter().find(|t| t.gguf_name() == tensor)?;
    Some((layer.parse().ok()?, target))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_names() {
        assert_eq!(parse_base("blk.3.attn_q.weight"), Some((3, Target::Q)));
        assert_eq!(
            parse_base("blk.29.ffn_down.weight"),
            Some((29, Target::Down))
        );
        assert_eq!(parse_base("token_embd.weight"), None);
        assert_eq!(parse_base("blk.1.attn_qkv.weight"), None);
        assert_eq!(parse_base("blk.x.attn_q.weight"), None);
    }
}
