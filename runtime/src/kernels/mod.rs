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
    /// AVX2 with FMA and AVX-VNNI (`vpdpbusd` on 256-bit vectors: 32 int8 products per
    /// instruction): Intel's client cores since Alder Lake, and Xeons on E-cores, have it
    /// without AVX-512.
    AvxVnni,
    /// AVX2 with FMA (`vpmaddubsw` + `vpmaddwd`).
    Avx2,
    /// ARM64 NEON with the int8 matrix multiply (`smmla`, i8mm: a 2 × 8 by 8 × 2 product, 32
    /// int8 products per instruction) and dotprod: Graviton 3 and 4, Neoverse N2/V1/V2, Apple
    /// M2 and later.
    NeonMmla,
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
        Isa::available().first().copied().unwrap_or(Isa::Scalar)
    }

    /// What the kernels run: [`Isa::detect`] or, where [`ISA_CAP_VAR`] names a lower path, the
    /// best this CPU has at or below it; once per process.
    pub fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            let floor = Cap::from_env().map_or(0, |c| c.int8.rank());
            at_or_below(Isa::available(), Isa::rank, floor).unwrap_or(Isa::Scalar)
        })
    }

    /// Place in this architecture's order, best first (a cap keeps what ranks at or after it).
    fn rank(self) -> u8 {
        match self {
            Isa::Avx512Vnni | Isa::NeonMmla => 0,
            Isa::AvxVnni | Isa::NeonDot => 1,
            Isa::Avx2 | Isa::Neon => 2,
            Isa::Scalar => 3,
        }
    }

    /// Whether this CPU has what `self`'s kernels need.
    pub fn present(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        let avx2 = || {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        };
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => avx2() && std::arch::is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2(),
            #[cfg(target_arch = "aarch64")]
            Isa::NeonMmla => {
                std::arch::is_aarch64_feature_detected!("i8mm")
                    && std::arch::is_aarch64_feature_detected!("dotprod")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => std::arch::is_aarch64_feature_detected!("dotprod"),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => true,
            Isa::Scalar => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Every ISA this CPU can run, best first (tests compare them all). Not a prefix of one
    /// order: a CPU may have AVX-512 VNNI without AVX-VNNI (Ice Lake, Cascade Lake).
    pub fn available() -> Vec<Isa> {
        let order: &[Isa] = if cfg!(target_arch = "aarch64") {
            &[Isa::NeonMmla, Isa::NeonDot, Isa::Neon, Isa::Scalar]
        } else {
            &[Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2, Isa::Scalar]
        };
        order.iter().copied().filter(|i| i.present()).collect()
    }
}

/// Asks the CPU to bring the cache line holding `p` into L1 ahead of its use: a hint, which
/// never faults whatever the address. Nothing off x86-64.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    prefetch_hinted::<3, T>(p); // _MM_HINT_T0
}

/// [`prefetch`] for one read soon after (x86's non-temporal hint: into the core's first-level
/// cache, and out of the shared caches first), for streams read once that would otherwise push
/// out data used again.
#[inline(always)]
pub(crate) fn prefetch_once<T>(p: *const T) {
    prefetch_hinted::<0, T>(p); // _MM_HINT_NTA
}

/// x86's `prefetch` with `HINT` (`_MM_HINT_*`); nothing elsewhere.
#[inline(always)]
fn prefetch_hinted<const HINT: i32, T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing and never faults; SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<HINT>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The environment variable that caps the CPU kernels below what the CPU has (as oneDNN's
/// `ONEDNN_MAX_CPU_ISA`): `avx512`, `avxvnni`, `avx2`, `neoni8mm`, `neondot`, `neon` or
/// `portable`. It lets
/// one machine run and benchmark an older CPU's paths, and steps around a hypervisor that
/// reports features it then faults on.
pub const ISA_CAP_VAR: &str = "FERRITE_CPU_ISA";

/// The highest paths [`ISA_CAP_VAR`] allows: the int8 GEMM's and the f32 kernels'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cap {
    int8: Isa,
    f32: simd::F32Path,
}

impl Cap {
    /// The cap set in the environment, read once; a value this architecture has no path for is
    /// logged and ignored (the kernels then take the best the CPU has).
    fn from_env() -> Option<Cap> {
        static CAP: std::sync::OnceLock<Option<Cap>> = std::sync::OnceLock::new();
        *CAP.get_or_init(|| {
            let value = std::env::var(ISA_CAP_VAR).ok()?;
            let cap = Cap::parse(&value);
            if cap.is_none() {
                tracing::warn!(
                    "{ISA_CAP_VAR}={value:?} names no CPU path of this architecture; ignored"
                );
            }
            cap
        })
    }

    fn parse(value: &str) -> Option<Cap> {
        use simd::F32Path;
        let x86 = cfg!(target_arch = "x86_64");
        let arm = cfg!(target_arch = "aarch64");
        let (int8, f32) = match value.trim().to_ascii_lowercase().as_str() {
            "avx512" if x86 => (Isa::Avx512Vnni, F32Path::Avx512),
            "avxvnni" if x86 => (Isa::AvxVnni, F32Path::Avx2),
            "avx2" if x86 => (Isa::Avx2, F32Path::Avx2),
            "neoni8mm" if arm => (Isa::NeonMmla, F32Path::Neon),
            "neondot" if arm => (Isa::NeonDot, F32Path::Neon),
            "neon" if arm => (Isa::Neon, F32Path::Neon),
            "portable" => (Isa::Scalar, F32Path::Portable),
            _ => return None,
        };
        Some(Cap { int8, f32 })
    }
}

/// The first of `available` (best first) whose rank is `floor` or after: the best path a cap
/// allows.
fn at_or_below<T: Copy>(available: Vec<T>, rank: impl Fn(T) -> u8, floor: u8) -> Option<T> {
    available.into_iter().find(|&p| rank(p) >= floor)
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
    let capped = match Cap::from_env() {
        Some(_) => format!(" (capped by {ISA_CAP_VAR})"),
        None => String::new(),
    };
    format!(
        "int8 GEMM {:?}; attention tile, SwiGLU and activation quantizer {vector}{capped}",
        Isa::best()
    )
}

/// Lanes of the f32 kernels' vectors on this machine (16, 8, 4, or 1 for the portable path),
/// after any [`ISA_CAP_VAR`] cap: what a benchmark's FMA ceiling should be measured at.
pub fn f32_lanes() -> usize {
    match simd::F32Path::best() {
        simd::F32Path::Avx512 => 16,
        simd::F32Path::Avx2 => 8,
        simd::F32Path::Neon => 4,
        simd::F32Path::Portable => 1,
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_names_this_architectures_paths_only() {
        assert_eq!(Cap::parse("bogus"), None);
        assert_eq!(
            Cap::parse(" Portable "),
            Some(Cap {
                int8: Isa::Scalar,
                f32: simd::F32Path::Portable
            })
        );
        let (ours, theirs) = if cfg!(target_arch = "aarch64") {
            (("neon", Isa::Neon), "avx2")
        } else {
            (("avx2", Isa::Avx2), "neon")
        };
        assert_eq!(Cap::parse(ours.0).map(|c| c.int8), Some(ours.1));
        assert_eq!(Cap::parse(theirs), None);
    }

    #[test]
    fn a_cap_keeps_the_best_path_at_or_below_it() {
        let cpu = vec![Isa::Avx512Vnni, Isa::Avx2, Isa::Scalar];
        let pick = |cap: Isa| at_or_below(cpu.clone(), Isa::rank, cap.rank());
        assert_eq!(pick(Isa::Avx512Vnni), Some(Isa::Avx512Vnni));
        // A CPU without AVX-VNNI capped there runs the next path down, never a higher one.
        assert_eq!(pick(Isa::AvxVnni), Some(Isa::Avx2));
        assert_eq!(pick(Isa::Avx2), Some(Isa::Avx2));
        assert_eq!(pick(Isa::Scalar), Some(Isa::Scalar));
    }
}
