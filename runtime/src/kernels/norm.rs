//! The residual add and the RMS norm that follows it, fused: `s = x + y`, then
//! `h = s / sqrt(mean(s²) + ε) · w`, row by row on the calling pool.
//!
//! Candle runs these as two ops: the add on its own thread pool (a second set of spinning
//! workers beside rayon's, from 64 Ki elements up) and the norm on one thread below 33 rows; a
//! decode step of 30 layers did 60 of each while the other compute thread waited. Here the rows
//! split across the pool, and each row does candle's operations in candle's order (its sum of
//! squares is one sequential f32 sum), so the results are its bits: the quantized mode still
//! matches candle-transformers' `quantized_llama` exactly. Each row depends on its own inputs
//! only, so a row's result never depends on the batch.

use std::mem::MaybeUninit;

use rayon::prelude::*;

/// Fewest rows a thread takes (a decode step's few rows run on the calling thread).
const PAR_ROWS: usize = 8;

/// For row-major rows of `w.len()` values: with `y`, `[s | h]` (`s = x + y`, then `h`, the RMS
/// norm of `s` times `w`), `2 · x.len()` values; without, `h` of `x` alone.
pub fn residual_rms_norm(x: &[f32], y: Option<&[f32]>, w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    assert!(n > 0, "empty rows");
    assert_eq!(x.len() % n, 0, "rows are not {n} wide");
    if let Some(y) = y {
        assert_eq!(y.len(), x.len(), "the residual's shape differs");
    }
    let len = x.len() * if y.is_some() { 2 } else { 1 };
    let mut out = Vec::with_capacity(len);
    let spare = &mut out.spare_capacity_mut()[..len];
    match y {
        Some(y) => {
            let (sums, normed) = spare.split_at_mut(x.len());
            sums.par_chunks_mut(n)
                .zip(normed.par_chunks_mut(n))
                .zip(x.par_chunks(n).zip(y.par_chunks(n)))
                .with_min_len(PAR_ROWS)
                .for_each(|((s, h), (x, y))| {
                    for ((s, &a), &b) in s.iter_mut().zip(x).zip(y) {
                        s.write(a + b);
                    }
                    // SAFETY: every element of `s` was just written.
                    let s = unsafe { &*(s as *const [MaybeUninit<f32>] as *const [f32]) };
                    row(s, w, eps, h);
                });
        }
        None => spare
            .par_chunks_mut(n)
            .zip(x.par_chunks(n))
            .with_min_len(PAR_ROWS)
            .for_each(|(h, x)| row(x, w, eps, h)),
    }
    // SAFETY: every row of every part was written above.
    unsafe { out.set_len(len) };
    out
}

/// `h = s / sqrt(sum(s²) / n + eps) · w`, as candle-nn's `rms_norm` computes it on f32.
fn row(s: &[f32], w: &[f32], eps: f32, h: &mut [MaybeUninit<f32>]) {
    let sum2 = s.iter().map(|&v| v * v).sum::<f32>();
    let m = (sum2 / s.len() as f32 + eps).sqrt();
    for ((h, &v), &w) in h.iter_mut().zip(s).zip(w) {
        h.write(v / m * w);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Candle's add and `rms_norm` bit for bit, at any width and row count (both of
        /// candle's row loops, the serial one and the parallel one), and a row's output is the
        /// same alone as in a batch.
        #[test]
        fn candles_bits_and_rows_are_independent(
            n in 1usize..100,
            rows in prop::sample::select(vec![1usize, 3, 20, 40]),
            seed in any::<u64>(),
        ) {
            let x = ferrite_testkit::random::values(rows * n, seed, 30.0);
            let y = ferrite_testkit::random::values(rows * n, seed ^ 2, 30.0);
            let w = ferrite_testkit::random::values(n, seed ^ 1, 3.0);
            let both = residual_rms_norm(&x, Some(&y), &w, 1e-6);
            let (sum, normed) = both.split_at(rows * n);
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            let t = |v: &[f32], shape: (usize, usize)| Tensor::from_slice(v, shape, &Device::Cpu);
            let want_sum = (t(&x, (rows, n))? + t(&y, (rows, n))?)?;
            let want = candle_nn::ops::rms_norm(&want_sum, &t(&w, (1, n))?.flatten_all()?, 1e-6)?;
            prop_assert_eq!(bits(sum), bits(&want_sum.flatten_all()?.to_vec1::<f32>()?));
            prop_assert_eq!(bits(normed), bits(&want.flatten_all()?.to_vec1::<f32>()?));
            prop_assert_eq!(bits(&residual_rms_norm(sum, None, &w, 1e-6)), bits(normed));
            for r in 0..rows {
                let alone = residual_rms_norm(&x[r * n..(r + 1) * n], Some(&y[r * n..(r + 1) * n]), &w, 1e-6);
                prop_assert_eq!(bits(&alone[n..]), bits(&normed[r * n..(r + 1) * n]));
            }
        }
    }
}
