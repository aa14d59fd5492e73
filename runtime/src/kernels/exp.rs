//! A vectorizable `e^x` shared by the kernels that need many of them (softmax in attention,
//! SiLU in the MLP): libm's `expf` is a call per element that no compiler vectorizes.

use super::simd::F32s;

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

/// [`exp_approx`] on a vector of `S`, operation for operation (so the same bits).
///
/// # Safety
/// The CPU has `S`'s features.
#[inline(always)]
pub(crate) unsafe fn exp<S: F32s>(x: S::V) -> S::V {
    // SAFETY: the caller checked `S`'s features.
    unsafe {
        let v = S::mul(
            S::max(x, S::splat(EXP_MIN)),
            S::splat(std::f32::consts::LOG2_E),
        );
        let n = S::round_even(v);
        let f = S::sub(v, n);
        let mut p = S::splat(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = S::fma(p, f, S::splat(c));
        }
        S::zero_below(x, S::splat(EXP_MIN), S::mul(p, S::pow2(n)))
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
    /// range and past both ends. Paths this CPU lacks are skipped with one line.
    #[test]
    fn vector_exponentials_match_the_portable_one() {
        use crate::kernels::simd::F32Path;
        let xs: Vec<f32> = (0..200_000)
            .map(|i| -95.0 + i as f32 * 0.000_92)
            .chain([f32::NEG_INFINITY, -87.0, -86.999_99, 0.0, -0.0, EXP_MAX])
            .collect();
        let want: Vec<u32> = xs.iter().map(|&x| exp_approx(x).to_bits()).collect();
        for (path, isa, present) in F32Path::all() {
            if crate::kernels::isa_or_skip(
                "vector_exponentials_match_the_portable_one",
                isa,
                present,
            ) {
                let mut out = vec![0f32; xs.len()];
                exp_slice(path, &xs, &mut out);
                let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "{path:?}");
            }
        }
    }

    /// `e^x` of every element on `path` (tails through a zero-padded copy).
    fn exp_slice(path: crate::kernels::simd::F32Path, xs: &[f32], out: &mut [f32]) {
        use crate::kernels::simd::*;
        #[inline(always)]
        unsafe fn run<S: F32s>(xs: &[f32], out: &mut [f32]) {
            for (x, o) in xs.chunks(S::LANES).zip(out.chunks_mut(S::LANES)) {
                let (mut buf, mut res) = ([0f32; 16], [0f32; 16]);
                buf[..x.len()].copy_from_slice(x);
                // SAFETY: the caller checked the features; `buf` and `res` hold 16 floats.
                unsafe { S::store(res.as_mut_ptr(), exp::<S>(S::load(buf.as_ptr()))) };
                o.copy_from_slice(&res[..x.len()]);
            }
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(xs: &[f32], out: &mut [f32]) {
            // SAFETY: the caller checked AVX-512F.
            unsafe { run::<Avx512>(xs, out) }
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(xs: &[f32], out: &mut [f32]) {
            // SAFETY: the caller checked AVX2 and FMA.
            unsafe { run::<Avx2>(xs, out) }
        }
        #[cfg(target_arch = "aarch64")]
        #[target_feature(enable = "neon")]
        unsafe fn neon(xs: &[f32], out: &mut [f32]) {
            // SAFETY: every ARM64 CPU has NEON.
            unsafe { run::<Neon>(xs, out) }
        }
        match path {
            // SAFETY: `path` is one `F32Path::available` listed for this CPU.
            #[cfg(target_arch = "x86_64")]
            F32Path::Avx512 => unsafe { avx512(xs, out) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            F32Path::Avx2 => unsafe { avx2(xs, out) },
            // SAFETY: as above.
            #[cfg(target_arch = "aarch64")]
            F32Path::Neon => unsafe { neon(xs, out) },
            _ => {
                for (o, &x) in out.iter_mut().zip(xs) {
                    *o = exp_approx(x);
                }
            }
        }
    }
}
