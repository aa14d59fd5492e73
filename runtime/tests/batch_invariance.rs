//! One request decoded alone gives the same greedy tokens as inside a busy mixed batch.

mod common;

use candle_core::Device;
use ferrite_runtime::kv::{KvCache, KvCacheConfig};
use ferrite_runtime::model::driver::{GreedySeq, run_greedy};
use ferrite_runtime::model::{self, LoadOptions, WeightMode};

/// The default on CPU (`auto` resolves to `packed`): our int8 GEMM quantizes and reduces each
/// row on its own in a fixed order, so logits must be bitwise equal.
#[test]
fn packed_weights_are_bitwise_batch_invariant() {
    check(WeightMode::Packed, 0.0);
}

/// candle's quantized kernels compute each row on its own too.
#[test]
fn quantized_weights_are_bitwise_batch_invariant() {
    check(WeightMode::Quantized, 0.0);
}

/// Dense GEMM blocks differently for different batch sizes, so logits move in the last bits
/// (measured 3.7e-5); tokens must not.
#[test]
fn dense_weights_give_the_same_greedy_tokens() {
    check(WeightMode::Dense, 1e-3);
}

/// The default mode in batches of 2 to 64 decoding together (every other sequence has its own
/// prompt): the target's tokens and every logit of every step are bitwise those it gets alone.
#[test]
fn packed_weights_are_bitwise_batch_invariant_from_2_to_64() {
    let opts = LoadOptions {
        weight_mode: WeightMode::Packed,
        ..Default::default()
    };
    let loaded = model::load(&common::default_model(), &opts).expect("load");
    let tok = &loaded.tokenizer;
    let target = tok
        .encode(
            "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .expect("encode");
    let cfg = KvCacheConfig::for_model(loaded.model.config(), 16, 1024, 0);
    let run = |others: usize| {
        let mut cache = KvCache::new(cfg, &Device::Cpu).expect("cache");
        let mut seqs = vec![GreedySeq::new(target.clone(), 16)];
        seqs[0].keep_all_logits = true;
        for i in 0..others {
            let p = tok
                .encode(
                    &format!("{i} {}", "numbers and words ".repeat(1 + i % 7)),
                    false,
                )
                .expect("encode");
            seqs.push(GreedySeq::new(p, 16));
        }
        run_greedy(&loaded.model, &mut cache, &mut seqs, 512).expect("run");
        seqs.swap_remove(0)
    };
    let alone = run(0);
    assert_eq!(alone.generated.len(), 16);
    for size in [2, 8, 32, 64] {
        let batched = run(size - 1);
        assert_eq!(
            batched.generated, alone.generated,
            "batch of {size}: tokens"
        );
        assert_eq!(batched.all_logits.len(), alone.all_logits.len());
        for (step, (a, b)) in batched.all_logits.iter().zip(&alone.all_logits).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "batch of {size}: logits of step {step} differ");
        }
    }
}

fn check(weight_mode: WeightMode, logit_tolerance: f32) {
    common::alone_and_in_a_busy_batch(&Device::Cpu, weight_mode, logit_tolerance);
}
