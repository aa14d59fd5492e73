//! The fused CPU attention kernel against the generic tensor-op path, and its batch invariance.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::batches::BatchShape;
use ferrite_runtime::model::attention::{AttentionBackend, AttnMeta, paged_attention};
use proptest::prelude::*;

fn run(
    meta: &AttnMeta,
    q: &[f32],
    kc: &Tensor,
    vc: &Tensor,
    backend: AttentionBackend,
) -> Vec<f32> {
    let dim = meta.num_heads * meta.head_dim;
    let q = Tensor::from_slice(q, (meta.token_seq.len(), dim), &Device::Cpu).expect("q");
    paged_attention(&q, kc, vc, meta, backend)
        .and_then(|t| t.flatten_all()?.to_vec1())
        .expect("attention")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    /// Mixed batches (prefill chunks after cached context, decodes, several sequences,
    /// shuffled block tables, sliding windows, head sizes that are not multiples of 16,
    /// every cache type; the generic path widens the same stored values):
    /// the tiled kernel agrees with the generic path, and each token's output is bitwise
    /// the same when it is computed alone.
    #[test]
    fn tiled_kernel_matches_generic_and_is_batch_invariant(
        kv_heads in 1usize..4,
        group in 1usize..4,
        head_dim in prop::sample::select(vec![8usize, 40, 64]),
        block_size in prop::sample::select(vec![4usize, 16]),
        seqs in prop::collection::vec((0usize..70, 1usize..45), 1..4),
        window in prop::option::of(1usize..50),
        softcap in prop::option::of(prop::sample::select(vec![1.5f32, 50.0])),
        cache in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        seed in any::<u64>(),
    ) {
        let shape = BatchShape {
            kv_heads, group, head_dim, block_size, seqs, window, softcap, cache, seed,
        };
        let b = shape.in_order();
        let (meta, kc, vc) = (&b.meta, &b.k_cache, &b.v_cache);
        let fused = run(meta, &b.q, kc, vc, AttentionBackend::Auto);
        let generic = run(meta, &b.q, kc, vc, AttentionBackend::Generic);
        let max = fused
            .iter()
            .zip(&generic)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        prop_assert!(max < 1e-4, "fused vs generic: {}", max);
        let row = shape.row();
        for t in 0..meta.token_seq.len() {
            let s = meta.token_seq[t] as usize;
            let alone = AttnMeta {
                token_seq: vec![0],
                token_pos: vec![meta.token_pos[t]],
                block_tables: vec![meta.block_tables[s].clone()],
                ..meta.clone()
            };
            let got = run(&alone, &b.q[t * row..(t + 1) * row], kc, vc, AttentionBackend::Auto);
            prop_assert!(
                got.iter().zip(&fused[t * row..(t + 1) * row]).all(|(a, b)| a.to_bits() == b.to_bits()),
                "token {} differs alone", t
            );
        }
    }
}
