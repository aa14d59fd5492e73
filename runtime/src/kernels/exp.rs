//! A vectorizable `e^x` shared by the kernels that need many of them (softmax in attention,
//! SiLU in the MLP): libm's `expf` is a call per element that no compiler vectorizes.

/// Below this, [`exp_approx`] gives 0 (and its power of two would leave the normal range).
pub(crate) const EXP_MIN: f32 = -87.0;
/// Above this the power of two would overflow the exponent bits; callers clamp to it.
pub(crate) const EXP_MAX: f32 = 88.0;

/// [`exp_approx`]'s polynomial for `2^f`, highest degree first (Horner's scheme).
const EXP_POLY: [f32; 7] = [
    1.535_336_2e-4,
    1.339_887_4e-3,
    9.618_437e-3,
    5.550_332_5e-2,
    2.402_264_4e-1,
    6.931_472e-1,
    1.0,
];

/// `e^x` for `x ≤ EXP_MAX`: `2^(x·log2 e)` split into an integer power (exponent bits) and a
/// degree-6 polynomial on [-0.5, 0.5] (relative error under 4e-6, far below what softmax
/// weights or an activation need). Below -87 (and `-inf`) gives 0.
#[inline(always)]
pub(crate) fn exp_approx(x: f32) -> f32 {
    let v = x.max(EXP_MIN) * std::f32::consts::LOG2_E;
    let n = v.round_ties_even();
    let f = v - n;
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(f, c);
    }
    let scale = f32::from_bits(((n as i32 + 127) << 23) as u32);
    if x < EXP_MIN { 0.0 } else { p * scale }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use super::{EXP_MIN, EXP_POLY};

    /// [`super::exp_approx`] on 16 lanes, operation for operation.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) fn exp16(x: __m512) -> __m512 {
        let v = _mm512_mul_ps(
            _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)),
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
        let f = _mm512_sub_ps(v, n);
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        let pow = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_MIN));
        _mm512_maskz_mul_ps(!under, p, _mm512_castsi512_ps(pow))
    }

    /// [`super::exp_approx`] on 8 lanes (AVX2 with FMA), operation for operation.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) fn exp8(x: __m256) -> __m256 {
        let v = _mm256_mul_ps(
            _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)),
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
        let f = _mm256_sub_ps(v, n);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
        }
        let pow = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        let kept = _mm256_cmp_ps::<_CMP_NLT_UQ>(x, _mm256_set1_ps(EXP_MIN));
        _mm256_and_ps(kept, _mm256_mul_ps(p, _mm256_castsi256_ps(pow)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_approx_is_close_to_exp() {
        let mut worst = 0f32;
        for i in 0..378_000 {
            let x = -90.0 + i as f32 * 0.00047;
            assert!(x <= EXP_MAX);
            let (got, want) = (exp_approx(x), x.exp());
            if want > 1e-30 {
                worst = worst.max(((got - want) / want).abs());
            }
        }
        assert!(worst < 1e-5, "relative error {worst}");
        assert!(exp_approx(EXP_MAX).is_finite());
        assert_eq!(exp_approx(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_approx(-100.0), 0.0);
        assert_eq!(exp_approx(0.0), 1.0);
    }

    /// Each vector exponential gives the portable one's bits, lane for lane, over the whole
    /// range and past both ends.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exponentials_match_the_portable_one() {
        use std::arch::x86_64::*;
        let xs: Vec<f32> = (0..200_000)
            .map(|i| -95.0 + i as f32 * 0.000_92)
            .chain([f32::NEG_INFINITY, -87.0, -86.999_99, 0.0, -0.0, EXP_MAX])
            .collect();
        let want: Vec<u32> = xs.iter().map(|&x| exp_approx(x).to_bits()).collect();
        let have = |lanes: usize, f: &dyn Fn(&[f32], &mut [f32])| {
            let mut out = vec![0f32; xs.len()];
            for (x, o) in xs.chunks(lanes).zip(out.chunks_mut(lanes)) {
                let mut buf = vec![0f32; lanes];
                buf[..x.len()].copy_from_slice(x);
                let mut res = vec![0f32; lanes];
                f(&buf, &mut res);
                o.copy_from_slice(&res[..x.len()]);
            }
            out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        };
        let avx2 = crate::kernels::has_avx2_fma();
        if crate::kernels::isa_or_skip("exp8", "AVX2 and FMA", avx2) {
            // SAFETY: AVX2 and FMA are present; `x` and `o` hold 8 floats.
            let got = have(8, &|x, o| unsafe {
                _mm256_storeu_ps(o.as_mut_ptr(), x86::exp8(_mm256_loadu_ps(x.as_ptr())))
            });
            assert_eq!(got, want);
        }
        if crate::kernels::isa_or_skip("exp16", "AVX-512F", crate::kernels::has_avx512f()) {
            // SAFETY: AVX-512F is present; `x` and `o` hold 16 floats.
            let got = have(16, &|x, o| unsafe {
                _mm512_storeu_ps(o.as_mut_ptr(), x86::exp16(_mm512_loadu_ps(x.as_ptr())))
            });
            assert_eq!(got, want);
        }
    }
}
