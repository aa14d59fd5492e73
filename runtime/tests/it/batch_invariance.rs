//! One request decoded alone gives the same greedy tokens as inside a busy mixed batch.

use crate::common;

use candle_core::Device;
use ferrite_runtime::kv::{KvCache, KvCacheConfig};
use ferrite_runtime::model::driver::{GreedySeq, run_greedy};
use ferrite_runtime::model::{self, LoadOptions, SeqInput, WeightMode};

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

/// `tokens` at positions from `start_pos`, through `block_table`.
fn input<'a>(tokens: &'a [u32], start_pos: usize, block_table: &'a [u32]) -> SeqInput<'a> {
    SeqInput {
        tokens,
        start_pos,
        block_table,
        adapter: None,
    }
}

fn check(weight_mode: WeightMode, logit_tolerance: f32) {
    common::alone_and_in_a_busy_batch(&Device::Cpu, weight_mode, logit_tolerance);
}

/// A forward larger than the model's slice limit runs through the layers in slices (a prompt
/// split between two of them finds its first part's keys and values in the cache). With the
/// batch-invariant modes the logits are bitwise those of one pass at every slice size; dense
/// GEMM rounds differently with the row count, as it does for any batch (measured: 2.8e-3 with
/// one-token slices, whose products take candle's matrix-vector path).
#[test]
fn a_sliced_forward_gives_the_logits_of_one_pass() {
    for (mode, tolerance) in [
        (WeightMode::Packed, 0.0),
        (WeightMode::Quantized, 0.0),
        (WeightMode::Dense, 1e-2),
    ] {
        let opts = LoadOptions {
            weight_mode: mode,
            ..Default::default()
        };
        let mut loaded = model::load(&common::default_model(), &opts).expect("load");
        let tok = &loaded.tokenizer;
        let text = |s: &str| tok.encode(s, false).expect("encode");
        let a = text(&"A long prompt about rivers, mountains and seas. ".repeat(4));
        let b = text("Count: one two three four five six seven eight nine ten eleven twelve");
        let c = text(&"Name the planets of the solar system in order. ".repeat(3));
        assert!(a.len() > 40 && b.len() > 10 && c.len() > 30);
        let (b_done, c_done) = (b.len() - 1, c.len() / 2);
        let cfg = KvCacheConfig::for_model(loaded.model.config(), 16, 64, 0);
        // Every slicing starts from a cache holding b's and c's first parts, written by one
        // unsliced pass, then runs a's whole prompt, b's last token and the rest of c together.
        let mut run = |slice: usize| {
            let mut cache = KvCache::new(cfg, &Device::Cpu).expect("cache");
            let tables: Vec<Vec<u32>> = [a.len(), b.len(), c.len()]
                .iter()
                .map(|&n| {
                    cache
                        .allocator_mut()
                        .allocate_n(n.div_ceil(16))
                        .expect("blocks")
                })
                .collect();
            loaded.model.set_max_slice_tokens(usize::MAX);
            let before = [
                input(&b[..b_done], 0, &tables[1]),
                input(&c[..c_done], 0, &tables[2]),
            ];
            loaded.model.forward(&before, &cache).expect("first part");
            loaded.model.set_max_slice_tokens(slice);
            let batch = [
                input(&a, 0, &tables[0]),
                input(&b[b_done..], b_done, &tables[1]),
                input(&c[c_done..], c_done, &tables[2]),
            ];
            let logits = loaded.model.forward(&batch, &cache).expect("forward");
            logits.to_vec2::<f32>().expect("logits")
        };
        let whole = run(usize::MAX);
        assert_eq!(whole.len(), 3);
        for slice in [1, 7, 16, 40, 64] {
            let sliced = run(slice);
            for (seq, (x, y)) in sliced.iter().zip(&whole).enumerate() {
                let worst = x
                    .iter()
                    .zip(y)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0f32, f32::max);
                if tolerance == 0.0 {
                    let same = x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
                    assert!(
                        same,
                        "{mode:?}, slices of {slice}: sequence {seq} differs by {worst}"
                    );
                } else {
                    assert!(
                        worst <= tolerance,
                        "{mode:?}, slices of {slice}: sequence {seq} differs by {worst}"
                    );
                }
            }
        }
    }
}
