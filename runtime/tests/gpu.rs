//! The runtime on an NVIDIA GPU, against the CPU path. These run wherever `nvidia-smi` works and
//! the crate was built with `--features cuda` (docs/runtime.md, "GPU tests", has the command);
//! elsewhere each prints one `=== GPU TEST SKIPPED` line and tests nothing.
//!
//! The tolerances below are first estimates from the CPU's own measurements (the kernels on the
//! two devices sum in different orders and candle's CUDA quantized matmul quantizes
//! activations to 8 bits as its CPU one does); they have not yet been measured on a GPU.

#[path = "it/common/mod.rs"]
mod common;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use common::tiny::write_tiny_gguf;
use common::{first_logits_on as first_logits, forced_logits, rel_err};
use ferrite_runtime::kv::CacheDtype;
use ferrite_runtime::model::attention::AttentionBackend;
use ferrite_runtime::model::{self, LoadOptions, LoadedModel, WeightMode};
use ferrite_testkit::gpu::gpu_or_skip;
use ferrite_testkit::process::TempDir;

fn cuda(test: &str) -> Option<Device> {
    gpu_or_skip(test, cfg!(feature = "cuda"))?;
    Some(ferrite_runtime::device::parse_device("cuda:0").expect("CUDA device 0"))
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

/// How far from exact arithmetic a GPU quantized run may be: no further than the quantized
/// modes the CPU ships (candle's `quantized` and our `packed`), measured in the same run on the
/// default prompt's first step (4.0e-2 and 7.0e-2), with a fifth of margin.
fn quantized_bound() -> f32 {
    let on_cpu = |mode, kv| common::ours_all_on(&Device::Cpu, AttentionBackend::Auto, mode, kv);
    let exact = on_cpu(WeightMode::Dense, DType::F32).0;
    let errors = [WeightMode::Quantized, WeightMode::Packed]
        .map(|mode| rel_err(&on_cpu(mode, CacheDtype::Auto.dtype()).0[0], &exact[0]));
    eprintln!(
        "CPU first-step relative logit error against f32: quantized {:.2e}, packed {:.2e}",
        errors[0], errors[1]
    );
    1.2 * errors[0].max(errors[1])
}

/// The default model, as the server runs it on a GPU (`auto`: dense, f16 cache) and with
/// candle's CUDA quantized kernels, greedy for 32 tokens: the same tokens as the CPU's exact
/// (dense, f32 cache) run, or parting only where the CPU's two best logits are within rounding
/// noise, after at least 16 tokens. First-step logits: dense within 1e-2 of exact (measured on
/// an H100: 3.7e-4, the f16 cache's rounding), quantized within [`quantized_bound`] (5.7e-2).
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
    for (mode, bound) in [
        (WeightMode::Auto, 1e-2),
        (WeightMode::Quantized, quantized_bound()),
    ] {
        let (logits, tokens, text) =
            common::ours_all_on(&gpu, AttentionBackend::Auto, mode, CacheDtype::Auto.dtype());
        eprintln!("{mode:?} on CUDA: {text:?}");
        common::agreed(&format!("{mode:?} on CUDA"), &tokens, &exact_tokens, &exact);
        let err = rel_err(&logits[0], &exact[0]);
        eprintln!("{mode:?} on CUDA: first-step relative logit error against CPU f32 {err:.2e}");
        assert!(err < bound, "{mode:?}: first-step error {err} over {bound}");
    }
}

/// The default model (dense weights) fed the same tokens on the GPU and the CPU, step by step
/// (teacher forcing: the prompt in one forward or in 7-token chunks, then the CPU's greedy
/// tokens one at a time): every step's logits within 1e-2 relative of the CPU's (f32 cache),
/// and the keys in the cache as well, for both cache types and both attention paths. The first
/// step or position that parts is named, so a failure says where the GPU went wrong.
#[test]
fn gpu_decode_follows_the_cpu_step_by_step() {
    let Some(gpu) = cuda("gpu_decode_follows_the_cpu_step_by_step") else {
        return;
    };
    let path = common::default_model();
    let prompt = common::prompt_ids();
    let (_, greedy, _) = common::ours_all_on(
        &Device::Cpu,
        AttentionBackend::Auto,
        WeightMode::Dense,
        DType::F32,
    );
    let tokens: Vec<u32> = prompt.iter().chain(&greedy).copied().collect();
    let last_layer = 29;
    let cpu = load(&path, &Device::Cpu, WeightMode::Dense);
    let want = forced_logits(&cpu, DType::F32, &tokens, prompt.len(), 7, last_layer);
    let mut on_gpu = load(&path, &gpu, WeightMode::Dense);
    let mut failures = Vec::new();
    for (kv, chunk, backend) in [
        (DType::F32, 512, AttentionBackend::Auto),
        (DType::F32, 7, AttentionBackend::Auto),
        (DType::F32, 7, AttentionBackend::Generic),
        (DType::F16, 512, AttentionBackend::Auto),
        (DType::F16, 7, AttentionBackend::Auto),
    ] {
        on_gpu.model.set_attention_backend(backend);
        let got = forced_logits(&on_gpu, kv, &tokens, prompt.len(), chunk, last_layer);
        let steps: Vec<f32> = got
            .logits
            .iter()
            .zip(&want.logits)
            .map(|(a, b)| rel_err(a, b))
            .collect();
        let keys: Vec<f32> = got
            .keys
            .iter()
            .zip(&want.keys)
            .map(|(a, b)| rel_err(a, b))
            .collect();
        let worst = |v: &[f32]| v.iter().copied().fold(0f32, f32::max);
        let first_bad = |v: &[f32]| v.iter().position(|&e| e.is_nan() || e >= 1e-2);
        let name = format!("{kv:?} cache, prefill chunk {chunk}, {backend:?} attention");
        eprintln!(
            "{name}: worst step logit error {:.2e} (first over 1e-2: step {:?} of {}), worst \
             layer-{last_layer} key error {:.2e} (first over 1e-2: position {:?} of {})",
            worst(&steps),
            first_bad(&steps),
            steps.len(),
            worst(&keys),
            first_bad(&keys),
            keys.len()
        );
        if first_bad(&steps).is_some() || first_bad(&keys).is_some() {
            failures.push(name);
        }
    }
    assert!(
        failures.is_empty(),
        "the GPU parts from the CPU: {failures:?}"
    );
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
/// forwards with other sequences' decodes). Dense weights (the GPU's `auto`): the same greedy
/// tokens, first-step logits within 1e-2 (cuBLAS picks kernels by shape, so bits may move;
/// measured on an H100: 3.4e-3). Quantized: candle's CUDA quantized matmul picks its kernel by
/// row count (up to 8 rows it quantizes activations to 8 bits; more rows multiply dequantized
/// weights), so a request's rounding depends on its batch, as in llama.cpp's CUDA backend, and
/// greedy tokens may part where two are close (on an H100 this prompt parted at its second
/// token). Its first-step logits alone and batched must stay within [`quantized_bound`] of
/// each other: the distance the quantized modes themselves keep from exact arithmetic.
#[test]
fn gpu_batches_do_not_change_a_requests_tokens() {
    let Some(gpu) = cuda("gpu_batches_do_not_change_a_requests_tokens") else {
        return;
    };
    common::alone_and_in_a_busy_batch(&gpu, WeightMode::Dense, 1e-2);
    let run = common::busy_batch(&gpu, WeightMode::Quantized);
    let same = run
        .alone
        .iter()
        .zip(&run.batched)
        .take_while(|(a, b)| a == b)
        .count();
    let err = rel_err(&run.batched_first, &run.alone_first);
    eprintln!(
        "Quantized on CUDA: alone and batched share {same} of {} tokens; first-step relative \
         logit difference {err:.2e}",
        run.alone.len()
    );
    let bound = quantized_bound();
    assert!(
        err < bound,
        "quantized alone vs batched: {err} over {bound}"
    );
}

/// Decode steps replayed from CUDA graphs against the same steps run op by op, on the default
/// model: eleven sequences with prompts of 5 to 45 tokens that join two steps apart and
/// generate 20 tokens each, so decode-only steps run at every batch size from 1 to 11 (graphs
/// of 1, 2, 4, 8 and 16 rows, padded) between mixed steps that run eagerly. Dense weights: the
/// same greedy tokens, or parting only where the eager run's two best logits are within 1e-3,
/// and every step's logits within 1e-2 relative until then, the bound a batch's rows keep on a
/// GPU (cuBLAS picks kernels by row count and a padded step has more rows; with the f16 cache
/// this measured 9.3e-4 on an H100). Quantized: logits within [`quantized_bound`] (its matmul
/// rounds activations per row count). Either way the graphs must have been captured and
/// replayed, with no capture falling back.
#[test]
fn gpu_decode_graphs_replay_the_eager_steps() {
    use ferrite_runtime::kv::{KvCache, KvCacheConfig};
    use ferrite_runtime::model::driver::{GreedySeq, run_greedy};
    use ferrite_runtime::model::llama::DEFAULT_MAX_GRAPH_BATCH;
    let Some(gpu) = cuda("gpu_decode_graphs_replay_the_eager_steps") else {
        return;
    };
    let path = common::default_model();
    let prompt = common::prompt_ids();
    let run = |m: &LoadedModel| -> Vec<GreedySeq> {
        let cfg = KvCacheConfig::for_model(m.model.config(), 16, 256, 0)
            .with_dtype(CacheDtype::Auto.dtype());
        let mut cache = KvCache::new(cfg, &gpu).expect("cache");
        let mut seqs: Vec<GreedySeq> = (0..11usize)
            .map(|i| {
                let p: Vec<u32> = prompt
                    .iter()
                    .cycle()
                    .skip(i)
                    .take(5 + 4 * i)
                    .copied()
                    .collect();
                let mut s = GreedySeq::new(p, 20);
                s.start_step = 2 * i;
                s.keep_all_logits = true;
                s
            })
            .collect();
        run_greedy(&m.model, &mut cache, &mut seqs, 16).expect("run");
        assert_eq!(cache.allocator().num_used(), 0);
        seqs
    };
    for (mode, bound) in [
        (WeightMode::Dense, 1e-2),
        (WeightMode::Quantized, quantized_bound()),
    ] {
        let mut m = load(&path, &gpu, mode);
        m.model.set_max_graph_batch(0);
        let eager = run(&m);
        m.model.set_max_graph_batch(DEFAULT_MAX_GRAPH_BATCH);
        let graphed = run(&m);
        let stats = m.model.graph_stats().expect("graph stats");
        eprintln!("{mode:?}: {stats:?}");
        assert_eq!(stats.failed, None, "{mode:?}: a capture failed");
        assert!(
            stats.replays >= 10 && stats.captured.len() >= 3,
            "{mode:?}: graphs were not used: {stats:?}"
        );
        let mut worst = 0f32;
        for (i, (e, g)) in eager.iter().zip(&graphed).enumerate() {
            let same = e
                .generated
                .iter()
                .zip(&g.generated)
                .take_while(|(a, b)| a == b)
                .count();
            for (a, b) in g.all_logits.iter().zip(&e.all_logits).take(same + 1) {
                worst = worst.max(rel_err(a, b));
            }
            if mode == WeightMode::Dense && same < e.generated.len() {
                let mut v = e.all_logits[same].clone();
                v.sort_by(|a, b| b.total_cmp(a));
                let gap = v[0] - v[1];
                eprintln!("sequence {i}: graphs part from eager at token {same}, gap {gap}");
                assert!(gap < 1e-3, "sequence {i} parts at token {same}, gap {gap}");
            }
        }
        eprintln!("{mode:?}: graphs vs eager, worst step relative logit error {worst:.2e}");
        assert!(worst < bound, "{mode:?}: {worst} over {bound}");
    }
}

/// A LoRA adapter on the GPU (each adapter's rows gathered and multiplied as two matrix
/// products) against the CPU's row-by-row update, dense weights, f32 cache on the CPU: the
/// CPU's greedy tokens, or parting only at a near-tie after 16; first-step logits within 1e-2.
#[test]
fn gpu_lora_adapter_decodes_as_the_cpu_does() {
    let Some(gpu) = cuda("gpu_lora_adapter_decodes_as_the_cpu_does") else {
        return;
    };
    let peft = common::lora_adapter_dir(1).join("peft");
    let (exact, exact_tokens, exact_text) = common::ours_all_with(
        &Device::Cpu,
        AttentionBackend::Auto,
        WeightMode::Dense,
        DType::F32,
        Some(&peft),
    );
    let (logits, tokens, text) = common::ours_all_with(
        &gpu,
        AttentionBackend::Auto,
        WeightMode::Dense,
        CacheDtype::Auto.dtype(),
        Some(&peft),
    );
    eprintln!("LoRA on the CPU: {exact_text:?}\nLoRA on CUDA:    {text:?}");
    common::agreed("LoRA on CUDA", &tokens, &exact_tokens, &exact);
    let err = rel_err(&logits[0], &exact[0]);
    eprintln!("LoRA on CUDA: first-step relative logit error against the CPU {err:.2e}");
    assert!(err < 1e-2, "first-step error {err}");
}
