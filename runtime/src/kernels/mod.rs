//! CPU matrix kernels of our own, where candle's do not fit a server's needs.
//!
//! [`qgemm`] is a batched int8 GEMM over 4- and 8-bit block-quantized weights: weights stay
//! small (a quarter to an eighth of f32's bytes, which is what a decode step reads),
//! activations are quantized per row, and every output element is reduced in the same order
//! whatever the batch. So a request's output does not depend on what runs beside it, unlike
//! dense f32 GEMM (whose blocking follows the batch size), while each weight block still
//! serves every row of a step, unlike candle's per-row quantized matmul.

pub(crate) mod exp;
pub mod lora;
pub mod norm;
pub mod pool;
pub mod qgemm;
pub(crate) mod simd;
pub mod softcap;
pub mod swiglu;

/// The instruction set a kernel runs on, chosen once at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 with VNNI (`vpdpbusd`): 64 int8 products per instruction.
    Avx512Vnni,
    /// AVX2 with FMA (`vpmaddubsw` + `vpmaddwd`).
    Avx2,
    /// ARM64 NEON with the dot-product extension (`sdot`): 16 int8 products per instruction.
    NeonDot,
    /// ARM64 NEON alone (`smull` + `sadalp`): 8 int8 products per instruction.
    Neon,
    /// Plain Rust; also the reference the others are tested against.
    Scalar,
}

impl Isa {
    /// Output panels one kernel call computes at most ([`qgemm`]'s tile width). Only the VNNI
    /// kernels take several at once; the others compute one, and asking them for more would only
    /// split the group again, through a zeroed scratch tile per extra panel.
    pub(crate) fn panels_per_tile(self) -> usize {
        match self {
            Isa::Avx512Vnni => qgemm::PMAX,
            _ => 1,
        }
    }

    /// The best the CPU supports. AMX is never used: it faults under some hypervisors that
    /// still report it, and VNNI is enough for these sizes.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                return Isa::Avx512Vnni;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2;
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("dotprod") {
                return Isa::NeonDot;
            }
            return Isa::Neon;
        }
        #[allow(unreachable_code)]
        Isa::Scalar
    }

    /// [`Isa::detect`], once per process.
    pub fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(Isa::detect)
    }

    /// Every ISA this CPU can run, best first (tests compare them all).
    pub fn available() -> Vec<Isa> {
        let order: &[Isa] = if cfg!(target_arch = "aarch64") {
            &[Isa::NeonDot, Isa::Neon, Isa::Scalar]
        } else {
            &[Isa::Avx512Vnni, Isa::Avx2, Isa::Scalar]
        };
        let best = Isa::detect();
        order.iter().copied().skip_while(|&i| i != best).collect()
    }
}

/// Whether a test of a vector path may run here: `present` is whether this CPU has `isa`. If
/// not, one line says the test was skipped and why, and the test passes: the portable path it
/// compares against is what this CPU runs, and other tests check that path.
#[cfg(test)]
pub(crate) fn isa_or_skip(test: &str, isa: &str, present: bool) -> bool {
    if !present {
        eprintln!("=== CPU TEST SKIPPED: {test}: this CPU lacks {isa}; it tested nothing");
    }
    present
}

/// Whether this CPU has AVX2, FMA and F16C (always false off x86-64): what the AVX2 attention
/// tile and key transpose, SwiGLU and activation quantizer need. Every CPU with AVX2 since
/// Haswell and Zen has all three (they are x86-64-v3, the server image's baseline).
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// What each CPU kernel runs on this machine, chosen once at run time: the start-up log and
/// the benchmarks print it, so a figure always names its path.
pub fn cpu_paths() -> String {
    let vector = match simd::F32Path::best() {
        simd::F32Path::Avx512 => "AVX-512F",
        simd::F32Path::Avx2 => "AVX2+FMA",
        simd::F32Path::Neon => "NEON",
        simd::F32Path::Portable => "portable",
    };
    format!(
        "int8 GEMM {:?}; attention tile, SwiGLU and activation quantizer {vector}",
        Isa::best()
    )
}

/// Whether this CPU has AVX-512F (always false off x86-64): what the AVX-512 attention tile
/// and its tests ask.
pub(crate) fn has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}
