//! The dense f32 runtime against candle-transformers' `quantized_llama` with its
//! weights dequantized too (`CANDLE_DEQUANTIZE_ALL`), so that both sides multiply in f32.
//! A separate test binary, because that switch is process-wide.

use crate::common;

use candle_core::DType;
use common::{diffs, ours, prompt_ids, reference};
use ferrite_runtime::model::WeightMode;
use ferrite_runtime::model::attention::AttentionBackend;

#[test]
fn dense_runtime_matches_dequantized_quantized_llama() {
    // SAFETY: set before any thread of this process reads the environment.
    unsafe { std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1") };
    let (ref_logits, ref_tokens) = reference(&prompt_ids());
    let (logits, tokens, text) = ours(AttentionBackend::Auto, WeightMode::Dense, DType::F32);
    let (max, mean) = diffs(&logits, &ref_logits);
    eprintln!("dense vs dequantized quantized_llama: max |dlogit| {max:e}, mean {mean:e}");
    // Same f32 GEMMs; only the attention summation order differs.
    assert!(max < 1e-3, "max logit difference {max}");
    assert_eq!(
        tokens, ref_tokens,
        "greedy tokens differ from the reference"
    );
    assert!(text.contains("Paris"), "{text}");
}
