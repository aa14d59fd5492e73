//! Hugging Face PEFT adapters: `adapter_config.json` and `adapter_model.safetensors`, with
//! tensors named `base_model.model.model.layers.N.<module>.lora_A.weight` (`[r, in]`) and
//! `.lora_B.weight` (`[out, r]`), scaled by `lora_alpha / r` (`lora_alpha / √r` with rsLoRA).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde::Deserialize;

use super::{LoraError, RawAdapter, RawPair, RowOrder, Target, matrix};

/// The fields of `adapter_config.json` that change what the weights mean. Options that
/// change the computation in ways this runtime does not do (DoRA, trained biases, extra
/// trained modules, per-module alphas) are refused rather than silently ignored.
#[derive(Debug, Deserialize)]
struct Config {
    #[serde(default)]
    peft_type: Option<String>,
    lora_alpha: f32,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    alpha_pattern: HashMap<String, serde_json::Value>,
}

/// Reads the adapter in folder `dir`.
pub(super) fn read(dir: &Path) -> Result<RawAdapter, LoraError> {
    let config_path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|source| LoraError::Io {
        path: config_path.clone(),
        source,
    })?;
    let invalid = |reason: String| LoraError::Invalid {
        path: config_path.clone(),
        reason,
    };
    let cfg: Config = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
    check(&cfg).map_err(invalid)?;

    let weights = dir.join("adapter_model.safetensors");
    let tensors =
        candle_core::safetensors::load(&weights, &Device::Cpu).map_err(|e| LoraError::Invalid {
            path: weights.clone(),
            reason: e.to_string(),
        })?;
    let pairs = pairs(&tensors).map_err(|reason| LoraError::Invalid {
        path: weights.clone(),
        reason,
    })?;
    let (alpha, rs) = (cfg.lora_alpha, cfg.use_rslora);
    Ok(RawAdapter {
        pairs,
        scale: Box::new(move |r| {
            if rs {
                alpha / (r as f32).sqrt()
            } else {
                alpha / r as f32
            }
        }),
        order: RowOrder::Hf,
    })
}

/// Refuses configurations whose weights would mean something else here.
fn check(cfg: &Config) -> Result<(), String> {
    if let Some(t) = &cfg.peft_type
        && t != "LORA"
    {
        return Err(format!("peft_type {t} is not supported (only LORA)"));
    }
    if cfg.use_dora {
        return Err("DoRA adapters (use_dora) are not supported".into());
    }
    if cfg.fan_in_fan_out {
        return Err(
            "fan_in_fan_out adapters (Conv1D bases such as GPT-2) are not supported".into(),
        );
    }
    if let Some(b) = &cfg.bias
        && b != "none"
    {
        return Err(format!("bias \"{b}\" is not supported (only \"none\")"));
    }
    if cfg.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err("modules_to_save (fully trained extra modules) is not supported".into());
    }
    if !cfg.alpha_pattern.is_empty() {
        return Err("alpha_pattern (per-module alphas) is not supported".into());
    }
    if !cfg.lora_alpha.is_finite() || cfg.lora_alpha == 0.0 {
        return Err(format!(
            "lora_alpha {} is not a usable scale",
            cfg.lora_alpha
        ));
    }
    Ok(())
}

/// `(layer, target, is_b)` of a tensor name such as
/// `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`.
fn parse_name(name: &str) -> Result<(usize, Target, bool), String> {
    let unknown = || format!("tensor {name} is not a LoRA factor of a Llama projection");
    let (module, is_b) = if let Some(m) = name.strip_suffix(".lora_A.weight") {
        (m, false)
    } else if let Some(m) = name.strip_suffix(".lora_B.weight") {
        (m, true)
    } else {
        return Err(unknown());
    };
    let at = module.find("layers.").ok_or_else(unknown)?;
    let rest = &module[at + "layers.".len()..];
    let (layer, path) = rest.split_once('.').ok_or_else(unknown)?;
    let layer: usize = layer.parse().map_err(|_| unknown())?;
    let target = Target::ALL
        .into_iter()
        .find(|t| t.hf_name() == path)
        .ok_or_else(unknown)?;
    Ok((layer, target, is_b))
}

/// Pairs every A with its B.
fn pairs(tensors: &HashMap<String, Tensor>) -> Result<Vec<RawPair>, String> {
    let mut halves: HashMap<(usize, Target), [Option<&Tensor>; 2]> = HashMap::new();
    for (name, t) in tensors {
        let (layer, target, is_b) = parse_name(name)?;
        halves.entry((layer, target)).or_default()[usize::from(is_b)] = Some(t);
    }
    let mut out = Vec::with_capacity(halves.len());
    for ((layer, target), [a, b]) in halves {
        let (Some(a), Some(b)) = (a, b) else {
            return Err(format!("layer {layer} {target:?} lacks its A or B factor"));
        };
        let (a, a_shape) = matrix(a).map_err(|e| format!("layer {layer} {target:?} A: {e}"))?;
        let (b, b_shape) = matrix(b).map_err(|e| format!("layer {layer} {target:?} B: {e}"))?;
        out.push(RawPair {
            layer,
            target,
            a,
            a_shape,
            b,
            b_shape,
        });
    }
    out.sort_by_key(|p| (p.layer, p.target));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_read_with_or_without_the_peft_prefix() {
        assert_eq!(
            parse_name("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"),
            Ok((3, Target::Q, false))
        );
        assert_eq!(
            parse_name("model.layers.12.mlp.down_proj.lora_B.weight"),
            Ok((12, Target::Down, true))
        );
        for bad in [
            "base_model.model.lm_head.lora_A.weight",
            "base_model.model.model.embed_tokens.lora_embedding_A",
            "base_model.model.model.layers.x.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.1.self_attn.rotary.lora_A.weight",
        ] {
            assert!(parse_name(bad).is_err(), "{bad}");
        }
    }

    fn config_with(alpha: f32, extra: &str) -> Result<(), String> {
        let text = format!(r#"{{"r": 8, "lora_alpha": {alpha}{extra}}}"#);
        check(&serde_json::from_str::<Config>(&text).map_err(|e| e.to_string())?)
    }

    fn config(extra: &str) -> Result<(), String> {
        config_with(16.0, extra)
    }

    #[test]
    fn options_that_change_the_math_are_refused() {
        assert_eq!(config(""), Ok(()));
        assert_eq!(config(r#", "use_rslora": true, "bias": "none""#), Ok(()));
        for (extra, word) in [
            (r#", "use_dora": true"#, "DoRA"),
            (r#", "fan_in_fan_out": true"#, "fan_in_fan_out"),
            (r#", "bias": "all""#, "bias"),
            (r#", "modules_to_save": ["lm_head"]"#, "modules_to_save"),
            (r#", "alpha_pattern": {"q_proj": 4}"#, "alpha_pattern"),
            (r#", "peft_type": "IA3""#, "IA3"),
        ] {
            let err = config(extra).expect_err(extra);
            assert!(err.contains(word), "{extra}: {err}");
        }
        let zero = config_with(0.0, "").expect_err("alpha 0");
        assert!(zero.contains("lora_alpha"), "{zero}");
    }
}
