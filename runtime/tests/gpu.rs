//! The runtime on an NVIDIA GPU, against the CPU path. These run wherever `nvidia-smi` works and
//! the crate was built with `--features cuda` (docs/runtime.md, "GPU tests", has the command);
//! elsewhere each prints one `=== GPU TEST SKIPPED` line and tests nothing.
//!
//! The tolerances below are first estimates from the CPU's own measurements (the kernels on the
//! two devices sum in different orders and candle's CUDA quantized matmul quantizes
//! activations to 8 bits as its CPU one does); they have not yet been measured on a GPU.

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use common::tiny::write_tiny_gguf;
use common::{first_logits_on as first_logits, rel_err};
use ferrite_runtime::kv::CacheDtype;
use ferrite_runtime::model::attention::AttentionBackend;
use ferrite_runtime::model::{self, LoadOptions, LoadedModel, WeightMode};
use ferrite_testkit::gpu::gpu_or_skip;
use ferrite_testkit::process::TempDir;

fn cuda(test: &str) -> Option<Device> {
    gpu_or_skip(test, cfg!(feature = "cuda"))?;
    Some(Device::new_cuda(0).expect("CUDA device 0"))
}

fn load(path: &std::path::Path, device: &Device, mode: WeightMode) -> LoadedModel {
    model::load(
        path,
        &LoadOptions {
            device: device.clone(),
            weight_mode: mode,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{path:?} {mode:?} on {device:?}: {e}"))
}

/// Every GGUF weight type, in both modes CUDA runs (`quantized`: candle's CUDA kernels on the
/// blocks; `dense`: dequantized, cuBLAS), against the same type and mode on the CPU, with the
/// CUDA attention kernel and a 16-bit cache on both sides.
#[test]
fn gpu_logits_match_the_cpu_for_every_weight_type() {
    let Some(gpu) = cuda("gpu_logits_match_the_cpu_for_every_weight_type") else {
        return;
    };
    let dir = TempDir::new("gpu-formats");
    let prompt: Vec<u32> = vec![1, 4093, 198, 1780, 314, 260, 3575, 282];
    // Relative logit error, CUDA against CPU for the same weights: dense differs only in
    // summation order (and f16 cache rounding falling on either side), quantized also in how
    // each device quantizes activations.
    let cases = [
        (GgmlDType::F32, 2e-3, 2e-3),
        (GgmlDType::F16, 2e-3, 2e-3),
        (GgmlDType::Q8_0, 2e-3, 3e-2),
        (GgmlDType::Q6K, 2e-3, 5e-2),
        (GgmlDType::Q4K, 2e-3, 5e-2),
        (GgmlDType::Q4_1, 2e-3, 5e-2),
        (GgmlDType::Q4_0, 2e-3, 5e-2),
    ];
    for (dtype, dense_tol, quantized_tol) in cases {
        let path = dir.path().join(format!("{dtype:?}.gguf"));
        write_tiny_gguf(&path, "llama", dtype, None, None);
        for (mode, tol) in [
            (WeightMode::Dense, dense_tol),
            (WeightMode::Quantized, quantized_tol),
        ] {
            let cpu = first_logits(
                &load(&path, &Device::Cpu, mode),
                &Device::Cpu,
                &prompt,
                DType::F16,
            );
            let on_gpu = first_logits(&load(&path, &gpu, mode), &gpu, &prompt, DType::F16);
            let err = rel_err(&on_gpu, &cpu);
            eprintln!("{dtype:?} {mode:?}: CUDA vs CPU relative logit error {err:.2e}");
            assert!(
                err < tol,
                "{dtype:?}/{mode:?}: CUDA vs CPU relative error {err}"
            );
        }
    }
}

/// The default model, as the server runs it on a GPU (`auto`: dense, f16 cache), greedy for 32
/// tokens: the same tokens as the CPU's exact (dense, f32 cache) run, or parting only where
/// the CPU's two best logits are within rounding noise, after at least 16 tokens.
#[test]
fn gpu_default_model_decodes_as_the_cpu_does() {
    let Some(gpu) = cuda("gpu_default_model_decodes_as_the_cpu_does") else {
        return;
    };
    let (exact, exact_tokens, _) = common::ours_all_on(
        &Device::Cpu,
        AttentionBackend::Auto,
        WeightMode::Dense,
        DType::F32,
    );
    for mode in [WeightMode::Auto, WeightMode::Quantized] {
        let (logits, tokens, text) =
            common::ours_all_on(&gpu, AttentionBackend::Auto, mode, CacheDtype::Auto.dtype());
        eprintln!("{mode:?} on CUDA: {text:?}");
        common::agreed(&format!("{mode:?} on CUDA"), &tokens, &exact_tokens, &exact);
        let err = rel_err(&logits[0], &exact[0]);
        eprintln!("{mode:?} on CUDA: first-step relative logit error against CPU f32 {err:.2e}");
        assert!(err < 5e-2, "{mode:?}: first-step error {err}");
    }
}

/// The CUDA attention kernel against the generic tensor-op path on the GPU, over the whole
/// default model: same tokens, logits within 1e-3 relative.
#[test]
fn gpu_attention_kernel_matches_the_generic_path() {
    let Some(gpu) = cuda("gpu_attention_kernel_matches_the_generic_path") else {
        return;
    };
    let (k, kt, _) =
        common::ours_all_on(&gpu, AttentionBackend::Auto, WeightMode::Dense, DType::F32);
    let (g, gt, _) = common::ours_all_on(
        &gpu,
        AttentionBackend::Generic,
        WeightMode::Dense,
        DType::F32,
    );
    assert_eq!(kt, gt, "tokens");
    let worst = k
        .iter()
        .zip(&g)
        .map(|(a, b)| rel_err(a, b))
        .fold(0f32, f32::max);
    eprintln!("CUDA kernel vs generic: worst step relative logit error {worst:.2e}");
    assert!(worst < 1e-3, "{worst}");
}

/// One request alone and inside a busy mixed batch of 16 on the GPU (prefill chunks sharing
/// forwards with other sequences' decodes): the same greedy tokens in every mode CUDA runs, and
/// first-step logits within a bound (cuBLAS and candle's CUDA quantized matmul pick kernels by
/// batch size, so bits may move; tokens must not).
#[test]
fn gpu_batches_do_not_change_a_requests_tokens() {
    let Some(gpu) = cuda("gpu_batches_do_not_change_a_requests_tokens") else {
        return;
    };
    for mode in [WeightMode::Dense, WeightMode::Quantized] {
        common::alone_and_in_a_busy_batch(&gpu, mode, 5e-2);
    }
}
