//! The gated MLP activations, fused: SwiGLU (`silu(gate) · up`, Llama and most families) and
//! GeGLU (`gelu(gate) · up` with GELU's tanh approximation, Gemma). The tanh form is a sigmoid
//! in disguise, `gelu(x) = x · σ(2·√(2/π)·(x + 0.044715·x³))`, so both are `x · σ(z) · up` and
//! share one row of code.
//!
//! Candle runs it as three passes over strided views of the fused gate/up projection (SiLU
//! through libm's `expf`, a copy, a multiply), which took about a tenth of a prefill. Here it is
//! one pass per row with [`exp_approx`] and, on AVX-512, AVX2 or NEON, 16, 8 or 4 lanes at a time
//! doing the same operations (one generic row, [`super::simd`]), so every path gives the same
//! bits. Each element depends on its own inputs only, so a row's result never depends on the
//! batch.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::exp::{EXP_MAX, exp_approx};
use super::simd::F32Path;

/// Fewest rows a thread takes (a decode step's few rows run on the calling thread).
const PAR_ROWS: usize = 8;

/// Which activation gates the FFN: `act(gate) · up` (a model's `ModelConfig::activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Gate {
    /// SwiGLU (Llama and most families).
    #[default]
    Silu,
    /// GeGLU with GELU's tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// `2·√(2/π)` and `2·√(2/π)·0.044715`: GELU's tanh argument, doubled for the sigmoid.
const GELU_A: f32 = 1.595_769;
const GELU_B: f32 = 0.071_354_816;

/// The sigmoid's argument: `x` for SiLU, `x·(A + B·x²)` for GELU.
#[inline(always)]
fn sigmoid_arg(gate: Gate, x: f32) -> f32 {
    match gate {
        Gate::Silu => x,
        Gate::GeluTanh => x * (x * x).mul_add(GELU_B, GELU_A),
    }
}

/// `x · σ(z) · u = x / (1 + e^-z) · u`; `e^-z` is clamped at [`EXP_MAX`], where the gate is
/// already 0 to f32 precision.
#[inline(always)]
fn gate_mul(gate: Gate, x: f32, u: f32) -> f32 {
    let z = sigmoid_arg(gate, x);
    x / (1.0 + exp_approx((-z).min(EXP_MAX))) * u
}

/// `out[r][i] = silu(gate_up[r][i]) · gate_up[r][ffn + i]` for every row `r` of `gate_up`,
/// a row-major `[rows, 2·ffn]` buffer (gate columns first, as the fused projection writes
/// them), as a new `[rows, ffn]` buffer. It is not zeroed first: every element is written.
pub fn swiglu(gate_up: &[f32], ffn: usize) -> Vec<f32> {
    gated(Gate::Silu, gate_up, ffn)
}

/// As [`swiglu`] with `gate`'s activation.
pub fn gated(gate: Gate, gate_up: &[f32], ffn: usize) -> Vec<f32> {
    let len = gate_up.len() / 2;
    let mut out = Vec::with_capacity(len);
    gated_into(gate, gate_up, ffn, &mut out.spare_capacity_mut()[..len]);
    // SAFETY: `gated_into` wrote all `len` elements.
    unsafe { out.set_len(len) };
    out
}

fn gated_into(gate: Gate, gate_up: &[f32], ffn: usize, out: &mut [MaybeUninit<f32>]) {
    assert!(ffn > 0, "empty MLP");
    assert_eq!(
        gate_up.len() % (2 * ffn),
        0,
        "gate/up rows are not 2 x {ffn} wide"
    );
    assert_eq!(out.len() * 2, gate_up.len(), "output is not half the input");
    let path = F32Path::best();
    out.par_chunks_mut(ffn)
        .zip(gate_up.par_chunks(2 * ffn))
        .with_min_len(PAR_ROWS)
        .for_each(|(o, gu)| {
            let (g, u) = gu.split_at(ffn);
            row(path, gate, g, u, o);
        });
}

/// One row on `path`, which must be one [`F32Path::available`] lists.
fn row(path: F32Path, gate: Gate, g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    match path {
        // SAFETY: `path` is one this CPU has (`F32Path::available`).
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx512 => unsafe { vector::avx512(gate, g, u, o) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        F32Path::Avx2 => unsafe { vector::avx2(gate, g, u, o) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        F32Path::Neon => unsafe { vector::neon(gate, g, u, o) },
        _ => row_portable(gate, g, u, o),
    }
}

fn row_portable(gate: Gate, g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    for ((o, &x), &u) in o.iter_mut().zip(g).zip(u) {
        o.write(gate_mul(gate, x, u));
    }
}

mod vector {
    use std::mem::MaybeUninit;

    use super::{EXP_MAX, GELU_A, GELU_B, Gate};
    use crate::kernels::exp::exp;
    use crate::kernels::simd::*;

    /// [`super::gate_mul`] a vector at a time (IEEE division, the same fused multiply-adds and
    /// exponential, so the same bits); the tail goes through a zero-padded copy.
    ///
    /// # Safety
    /// The CPU has `S`'s features.
    #[inline(always)]
    unsafe fn row<S: F32s>(gate: Gate, g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
        let n = o.len().min(g.len()).min(u.len());
        let lanes = S::LANES;
        let mut i = 0;
        // SAFETY: the caller checked `S`'s features; lanes i..i + LANES are inside all three
        // rows, and the padded copies hold 16 ≥ LANES floats.
        unsafe {
            while i + lanes <= n {
                let r = gate_mul::<S>(gate, S::load(g.as_ptr().add(i)), S::load(u.as_ptr().add(i)));
                S::store(o.as_mut_ptr().add(i).cast::<f32>(), r);
                i += lanes;
            }
            if i < n {
                let k = n - i;
                let (mut gt, mut ut, mut ot) = ([0f32; 16], [0f32; 16], [0f32; 16]);
                gt[..k].copy_from_slice(&g[i..n]);
                ut[..k].copy_from_slice(&u[i..n]);
                let r = gate_mul::<S>(gate, S::load(gt.as_ptr()), S::load(ut.as_ptr()));
                S::store(ot.as_mut_ptr(), r);
                for (o, &v) in o[i..n].iter_mut().zip(&ot) {
                    o.write(v);
                }
            }
        }
    }

    /// [`super::gate_mul`] on one vector.
    ///
    /// # Safety
    /// The CPU has `S`'s features.
    #[inline(always)]
    unsafe fn gate_mul<S: F32s>(gate: Gate, x: S::V, up: S::V) -> S::V {
        // SAFETY: the caller checked `S`'s features.
        unsafe {
            let z = match gate {
                Gate::Silu => x,
                Gate::GeluTanh => {
                    S::mul(x, S::fma(S::mul(x, x), S::splat(GELU_B), S::splat(GELU_A)))
                }
            };
            // -z, clamped like `(-z).min(EXP_MAX)`.
            let neg = S::sub(S::splat(0.0), z);
            let e = exp::<S>(S::min(S::splat(EXP_MAX), neg));
            let s = S::div(x, S::add(S::splat(1.0), e));
            S::mul(s, up)
        }
    }

    /// # Safety
    /// The CPU has AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512(gate: Gate, g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
        // SAFETY: the caller checked AVX-512F.
        unsafe { row::<Avx512>(gate, g, u, o) }
    }

    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2(gate: Gate, g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
        // SAFETY: the caller checked AVX2 and FMA.
        unsafe { row::<Avx2>(gate, g, u, o) }
    }

    /// # Safety
    /// None beyond an ARM64 CPU, which always has NEON.
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn neon(gate: Gate, g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
        // SAFETY: every ARM64 CPU has NEON.
        unsafe { row::<Neon>(gate, g, u, o) }
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

    #[test]
    fn geglu_is_close_to_gelu_tanh_times_up() {
        let ffn = 41;
        let gate_up: Vec<f32> = ferrite_testkit::random::values(3 * 2 * ffn, 9, 8.0);
        let out = gated(Gate::GeluTanh, &gate_up, ffn);
        for r in 0..3 {
            for i in 0..ffn {
                let (x, u) = (
                    gate_up[r * 2 * ffn + i] as f64,
                    gate_up[r * 2 * ffn + ffn + i] as f64,
                );
                let c = (2.0 / std::f64::consts::PI).sqrt();
                let want = 0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh()) * u;
                let got = out[r * ffn + i] as f64;
                assert!(
                    (got - want).abs() <= 2e-5 * want.abs() + 1e-6 * u.abs(),
                    "{x} {u}: {got} vs {want}"
                );
            }
        }
        // Far below zero the gate is 0; far above, the identity.
        let ends = gated(Gate::GeluTanh, &[-60.0, 0.0, 60.0, 3.0, 3.0, 3.0], 3);
        assert!(ends[0].abs() < 1e-30, "{}", ends[0]);
        assert_eq!(&ends[1..], &[0.0, 180.0]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The vector paths and the portable one agree bit for bit, for each activation at
        /// every length (tails), and a row's output is the same alone as in a batch.
        #[test]
        fn vector_matches_portable_and_rows_are_independent(
            ffn in 1usize..70,
            rows in 1usize..20,
            seed in any::<u64>(),
        ) {
            let gate_up = ferrite_testkit::random::values(rows * 2 * ffn, seed, 20.0);
            for gate in [Gate::Silu, Gate::GeluTanh] {
                let out = gated(gate, &gate_up, ffn);
                {
                    // Every vector path this CPU has, not only the one dispatch picks.
                    let (g, u) = gate_up[..2 * ffn].split_at(ffn);
                    let run = |path: F32Path| {
                        let mut o = vec![MaybeUninit::uninit(); ffn];
                        row(path, gate, g, u, &mut o);
                        // SAFETY: `row` wrote every element.
                        o.iter().map(|v| unsafe { v.assume_init() }.to_bits()).collect::<Vec<u32>>()
                    };
                    let want = run(F32Path::Portable);
                    for path in F32Path::available() {
                        prop_assert_eq!(run(path), want.clone(), "{:?} {:?}", gate, path);
                    }
                }
                for r in 0..rows {
                    let gu = &gate_up[r * 2 * ffn..(r + 1) * 2 * ffn];
                    let want: Vec<f32> = gu[..ffn]
                        .iter()
                        .zip(&gu[ffn..])
                        .map(|(&x, &u)| gate_mul(gate, x, u))
                        .collect();
                    let got: Vec<u32> =
                        out[r * ffn..(r + 1) * ffn].iter().map(|v| v.to_bits()).collect();
                    prop_assert_eq!(got, want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
                    prop_assert_eq!(gated(gate, gu, ffn), want);
                }
            }
        }
    }
}
