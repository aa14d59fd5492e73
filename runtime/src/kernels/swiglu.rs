//! SwiGLU, the gated MLP activation of Llama-family models: `silu(gate) · up`, fused.
//!
//! Candle runs it as three passes over strided views of the fused gate/up projection (SiLU
//! through libm's `expf`, a copy, a multiply), which took about a tenth of a prefill. Here it is
//! one pass per row with [`exp_approx`] and, on AVX-512 or AVX2, 16 or 8 lanes at a time doing
//! the same operations, so every path gives the same bits. Each element depends on its own inputs only,
//! so a row's result never depends on the batch.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::exp::{EXP_MAX, exp_approx};

/// Fewest rows a thread takes (a decode step's few rows run on the calling thread).
const PAR_ROWS: usize = 8;

/// `silu(x) · u` with `silu(x) = x / (1 + e^-x)`; `e^-x` is clamped at [`EXP_MAX`], where
/// `silu` is already 0 to f32 precision.
#[inline(always)]
fn silu_mul(x: f32, u: f32) -> f32 {
    x / (1.0 + exp_approx((-x).min(EXP_MAX))) * u
}

/// `out[r][i] = silu(gate_up[r][i]) · gate_up[r][ffn + i]` for every row `r` of `gate_up`,
/// a row-major `[rows, 2·ffn]` buffer (gate columns first, as the fused projection writes
/// them), as a new `[rows, ffn]` buffer. It is not zeroed first: every element is written.
pub fn swiglu(gate_up: &[f32], ffn: usize) -> Vec<f32> {
    let len = gate_up.len() / 2;
    let mut out = Vec::with_capacity(len);
    swiglu_into(gate_up, ffn, &mut out.spare_capacity_mut()[..len]);
    // SAFETY: `swiglu_into` wrote all `len` elements.
    unsafe { out.set_len(len) };
    out
}

fn swiglu_into(gate_up: &[f32], ffn: usize, out: &mut [MaybeUninit<f32>]) {
    assert!(ffn > 0, "empty MLP");
    assert_eq!(
        gate_up.len() % (2 * ffn),
        0,
        "gate/up rows are not 2 x {ffn} wide"
    );
    assert_eq!(out.len() * 2, gate_up.len(), "output is not half the input");
    #[cfg(target_arch = "x86_64")]
    let (avx512, avx2) = (super::has_avx512f(), super::has_avx2_fma());
    out.par_chunks_mut(ffn)
        .zip(gate_up.par_chunks(2 * ffn))
        .with_min_len(PAR_ROWS)
        .for_each(|(o, gu)| {
            let (g, u) = gu.split_at(ffn);
            #[cfg(target_arch = "x86_64")]
            if avx512 {
                // SAFETY: AVX-512F is present.
                unsafe { x86::row(g, u, o) };
                return;
            } else if avx2 {
                // SAFETY: AVX2 and FMA are present.
                unsafe { x86::row_avx2(g, u, o) };
                return;
            }
            row_portable(g, u, o);
        });
}

fn row_portable(g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    for ((o, &x), &u) in o.iter_mut().zip(g).zip(u) {
        o.write(silu_mul(x, u));
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use super::EXP_MAX;
    use crate::kernels::exp::x86::{exp8, exp16};

    /// [`super::silu_mul`] 16 lanes at a time (IEEE division and the same exponential, so the
    /// same bits); a masked tail instead of a scalar loop.
    #[target_feature(enable = "avx512f")]
    pub(super) fn row(g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
        let n = o.len().min(g.len()).min(u.len());
        let (one, top) = (_mm512_set1_ps(1.0), _mm512_set1_ps(EXP_MAX));
        let mut i = 0;
        while i < n {
            let k = (n - i).min(16);
            let mask = ((1u32 << k) - 1) as __mmask16;
            // SAFETY: masked lanes past `n` are neither read nor written.
            unsafe {
                let x = _mm512_maskz_loadu_ps(mask, g.as_ptr().add(i));
                let up = _mm512_maskz_loadu_ps(mask, u.as_ptr().add(i));
                // -x, clamped like `(-x).min(EXP_MAX)` (NaN passes through as `min` does).
                let neg = _mm512_sub_ps(_mm512_setzero_ps(), x);
                let e = exp16(_mm512_min_ps(top, neg));
                let s = _mm512_div_ps(x, _mm512_add_ps(one, e));
                let dst = o.as_mut_ptr().add(i).cast::<f32>();
                _mm512_mask_storeu_ps(dst, mask, _mm512_mul_ps(s, up));
            }
            i += 16;
        }
    }

    /// [`row`] on AVX2: 8 lanes, the same operations; the tail goes through a zero-padded
    /// copy (`vmaskmovps` would skip the lanes past the row, but emulators still touch them).
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn row_avx2(g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
        let n = o.len().min(g.len()).min(u.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: lanes i..i + 8 are inside all three rows.
            unsafe {
                let r = silu_mul8(
                    _mm256_loadu_ps(g.as_ptr().add(i)),
                    _mm256_loadu_ps(u.as_ptr().add(i)),
                );
                _mm256_storeu_ps(o.as_mut_ptr().add(i).cast::<f32>(), r);
            }
            i += 8;
        }
        if i < n {
            let k = n - i;
            let (mut gt, mut ut, mut ot) = ([0f32; 8], [0f32; 8], [0f32; 8]);
            gt[..k].copy_from_slice(&g[i..n]);
            ut[..k].copy_from_slice(&u[i..n]);
            // SAFETY: each buffer holds 8 floats.
            unsafe {
                let r = silu_mul8(_mm256_loadu_ps(gt.as_ptr()), _mm256_loadu_ps(ut.as_ptr()));
                _mm256_storeu_ps(ot.as_mut_ptr(), r);
            }
            for (o, &v) in o[i..n].iter_mut().zip(&ot) {
                o.write(v);
            }
        }
    }

    /// [`super::silu_mul`] on 8 lanes: IEEE division and the same exponential.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn silu_mul8(x: __m256, up: __m256) -> __m256 {
        // -x, clamped like `(-x).min(EXP_MAX)`.
        let neg = _mm256_sub_ps(_mm256_setzero_ps(), x);
        let e = exp8(_mm256_min_ps(_mm256_set1_ps(EXP_MAX), neg));
        let s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
        _mm256_mul_ps(s, up)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn close_to_silu_times_up() {
        let ffn = 37;
        let gate_up: Vec<f32> = ferrite_testkit::random::values(3 * 2 * ffn, 7, 12.0);
        let out = swiglu(&gate_up, ffn);
        for r in 0..3 {
            for i in 0..ffn {
                let (x, u) = (
                    gate_up[r * 2 * ffn + i] as f64,
                    gate_up[r * 2 * ffn + ffn + i] as f64,
                );
                let want = x / (1.0 + (-x).exp()) * u;
                let got = out[r * ffn + i] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs() + 1e-30,
                    "{x} {u}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn extremes() {
        let g = [-1e4f32, -100.0, -88.5, 0.0, 100.0, 1e30, f32::NAN];
        let gate_up: Vec<f32> = g
            .iter()
            .copied()
            .chain(std::iter::repeat_n(2.0, g.len()))
            .collect();
        let out = swiglu(&gate_up, g.len());
        // silu is 0 to f32 precision far below zero; the clamp keeps e^-x finite there.
        for &v in &out[..4] {
            assert!(v.abs() < 1e-30, "{v}");
        }
        assert_eq!(out[4], 200.0);
        assert_eq!(out[5], 2e30);
        assert!(out[6].is_nan());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The vector path and the portable one agree bit for bit, at every length (tails),
        /// and a row's output is the same alone as in a batch.
        #[test]
        fn vector_matches_portable_and_rows_are_independent(
            ffn in 1usize..70,
            rows in 1usize..20,
            seed in any::<u64>(),
        ) {
            let gate_up = ferrite_testkit::random::values(rows * 2 * ffn, seed, 20.0);
            let out = swiglu(&gate_up, ffn);
            #[cfg(target_arch = "x86_64")]
            {
                // Every vector path this CPU has, not only the one dispatch picks.
                let (g, u) = gate_up[..2 * ffn].split_at(ffn);
                let mut want = vec![MaybeUninit::uninit(); ffn];
                row_portable(g, u, &mut want);
                // SAFETY: `row_portable` wrote every element.
                let want: Vec<u32> = want.iter().map(|v| unsafe { v.assume_init() }.to_bits()).collect();
                let run = |f: unsafe fn(&[f32], &[f32], &mut [MaybeUninit<f32>])| {
                    let mut o = vec![MaybeUninit::uninit(); ffn];
                    // SAFETY: callers check the CPU has the path's features.
                    unsafe { f(g, u, &mut o) };
                    // SAFETY: the row function wrote every element.
                    o.iter().map(|v| unsafe { v.assume_init() }.to_bits()).collect::<Vec<u32>>()
                };
                if crate::kernels::has_avx2_fma() {
                    prop_assert_eq!(run(x86::row_avx2), want.clone());
                }
                if crate::kernels::has_avx512f() {
                    prop_assert_eq!(run(x86::row), want);
                }
            }
            for r in 0..rows {
                let gu = &gate_up[r * 2 * ffn..(r + 1) * 2 * ffn];
                let want: Vec<f32> = gu[..ffn].iter().zip(&gu[ffn..]).map(|(&x, &u)| silu_mul(x, u)).collect();
                let got: Vec<u32> = out[r * ffn..(r + 1) * ffn].iter().map(|v| v.to_bits()).collect();
                prop_assert_eq!(got, want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
                prop_assert_eq!(swiglu(gu, ffn), want);
            }
        }
    }
}
