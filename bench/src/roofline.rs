//! The machine's ceilings, measured in the same run as the figures they bound: f32 FMA and
//! int8 dot-product throughput on every thread, and the read bandwidth over a buffer the size
//! of the model's weights. A benchmark divides what it achieved by these to say how far from
//! the machine it runs (the roofline).

use std::hint::black_box;
use std::time::{Duration, Instant};

use ferrite_runtime::kernels::Isa;

/// Ceilings of this machine, all threads together.
#[derive(Debug, Clone, Copy)]
pub struct Peaks {
    /// f32 floating-point operations per second (an FMA counts two).
    pub f32_flops: f64,
    /// int8 operations per second (a multiply-add of a byte pair counts two) from the
    /// multiply instruction the int8 GEMM runs: `vpdpbusd` (AVX-512 VNNI or AVX-VNNI),
    /// `vpmaddubsw` (AVX2), `smmla` (ARM64 i8mm) or `sdot` (ARM64 dotprod); none elsewhere.
    pub int8_ops: Option<f64>,
    /// Which instructions [`Peaks::int8_ops`] measured.
    pub int8_isa: &'static str,
    /// Bytes per second read from a buffer of the size asked for.
    pub read_bytes: f64,
    pub threads: usize,
}

impl Peaks {
    /// The int8 ceiling as a benchmark prints it: rate and instructions, or why there is none.
    pub fn int8_label(&self) -> String {
        match self.int8_ops {
            Some(p) => format!("{:.1} GOP/s ({})", p / 1e9, self.int8_isa),
            None => "n/a (no int8 dot-product instructions on this CPU)".to_string(),
        }
    }
}

/// How long each ceiling is measured.
const SPAN: Duration = Duration::from_millis(300);

/// Measures every ceiling on `threads` threads; `bytes` sizes the read-bandwidth buffer.
pub fn measure(threads: usize, bytes: usize) -> Peaks {
    let threads = threads.max(1);
    Peaks {
        f32_flops: on_threads(threads, fma_kernel),
        int8_ops: int8_kernel().map(|(_, k)| on_threads(threads, k)),
        int8_isa: int8_kernel().map_or("none", |(isa, _)| isa),
        read_bytes: (0..TRIES)
            .map(|_| read_bandwidth(threads, bytes))
            .fold(0.0, f64::max),
        threads,
    }
}

/// A kernel runs `iters` rounds and returns the operations it did.
type Kernel = fn(u64) -> f64;

/// Runs `k` on every thread at once for about [`SPAN`]; operations per second in total.
fn on_threads(threads: usize, k: Kernel) -> f64 {
    // Calibrate one thread's rounds to the span, then time all threads together.
    let mut iters = 1u64 << 10;
    loop {
        let t = Instant::now();
        black_box(k(iters));
        if t.elapsed() > SPAN / 8 || iters > 1 << 40 {
            break;
        }
        iters *= 2;
    }
    // A ceiling is the best the machine does: on a VM two vCPUs sometimes share one core.
    (0..TRIES)
        .map(|_| {
            let start = Instant::now();
            let ops: f64 = std::thread::scope(|s| {
                let hs: Vec<_> = (0..threads).map(|_| s.spawn(|| k(iters))).collect();
                hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
            });
            ops / start.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max)
}

/// Timed tries of each ceiling; the best counts.
const TRIES: usize = 3;

/// Independent accumulators per kernel: enough to cover the FMA unit's latency × ports.
const ACC: usize = 12;

/// FMA at the vector width the f32 kernels run (which `FERRITE_CPU_ISA` may cap below the CPU's).
fn fma_kernel(iters: u64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    match ferrite_runtime::kernels::f32_lanes() {
        // SAFETY: the f32 kernels run 16 lanes only where AVX-512F is present.
        16 => return unsafe { x86::fma512(iters) },
        // SAFETY: and 8 where AVX2 and FMA are.
        8 => return unsafe { x86::fma256(iters) },
        _ => {}
    }
    let mut acc = [[1f32; 8]; ACC];
    let (a, b) = (black_box(0.999_f32), black_box(1e-7_f32));
    for _ in 0..iters {
        for r in acc.iter_mut() {
            for v in r.iter_mut() {
                *v = v.mul_add(a, b);
            }
        }
    }
    black_box(acc);
    (iters * (ACC * 8 * 2) as u64) as f64
}

/// The int8 ceiling's kernel: the multiply of the path the int8 GEMM runs ([`Isa::best`]),
/// named by its instructions.
fn int8_kernel() -> Option<(&'static str, Kernel)> {
    match Isa::best() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => Some(("vpdpbusd (AVX-512 VNNI)", |iters| {
            // SAFETY: the GEMM runs this path only where AVX-512 VNNI is present.
            unsafe { x86::dpbusd512(iters) }
        })),
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => Some(("vpdpbusd (AVX-VNNI)", |iters| {
            // SAFETY: likewise for AVX-VNNI.
            unsafe { x86::dpbusd256(iters) }
        })),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Some(("vpmaddubsw (AVX2)", |iters| {
            // SAFETY: likewise for AVX2.
            unsafe { x86::maddubs256(iters) }
        })),
        #[cfg(target_arch = "aarch64")]
        Isa::NeonMmla => Some(("smmla (NEON i8mm)", |iters| {
            // SAFETY: likewise for i8mm.
            unsafe { arm::smmla(iters) }
        })),
        #[cfg(target_arch = "aarch64")]
        Isa::NeonDot => Some(("sdot (NEON dotprod)", |iters| {
            // SAFETY: likewise for the dot-product extension.
            unsafe { arm::sdot(iters) }
        })),
        _ => None,
    }
}

/// Sums a `bytes`-sized buffer, split across the threads, until [`SPAN`] has passed.
fn read_bandwidth(threads: usize, bytes: usize) -> f64 {
    let words = (bytes / 8).max(threads * 1024);
    let buf: Vec<u64> = (0..words as u64).collect();
    let part = words.div_ceil(threads);
    let start = Instant::now();
    let read: usize = std::thread::scope(|s| {
        let hs: Vec<_> = buf
            .chunks(part)
            .map(|c| {
                s.spawn(move || {
                    let mut done = 0;
                    while start.elapsed() < SPAN {
                        // Four sums side by side so the adds are not one dependency chain.
                        let mut sums = [0u64; 4];
                        for q in c.chunks_exact(4) {
                            for (s, &v) in sums.iter_mut().zip(q) {
                                *s = s.wrapping_add(v);
                            }
                        }
                        black_box(sums);
                        done += c.len() / 4 * 32;
                    }
                    done
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or(0)).sum()
    });
    read as f64 / start.elapsed().as_secs_f64()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::hint::black_box;

    use super::ACC;

    #[target_feature(enable = "avx512f")]
    pub(super) fn fma512(iters: u64) -> f64 {
        let mut acc = [_mm512_set1_ps(1.0); ACC];
        let (a, b) = (
            _mm512_set1_ps(black_box(0.999)),
            _mm512_set1_ps(black_box(1e-7)),
        );
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm512_fmadd_ps(*r, a, b);
            }
        }
        black_box(acc);
        (iters * (ACC * 16 * 2) as u64) as f64
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn fma256(iters: u64) -> f64 {
        let mut acc = [_mm256_set1_ps(1.0); ACC];
        let (a, b) = (
            _mm256_set1_ps(black_box(0.999)),
            _mm256_set1_ps(black_box(1e-7)),
        );
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm256_fmadd_ps(*r, a, b);
            }
        }
        black_box(acc);
        (iters * (ACC * 8 * 2) as u64) as f64
    }

    /// The AVX2 GEMM's multiply: 32 byte products summed in pairs to i16. Each accumulator
    /// feeds its own next multiply, so nothing is loop-invariant (an invariant product is
    /// hoisted out of the loop, which once measured adds and read 5× the real peak); each
    /// starts from its own opaque value, so no two chains are merged.
    #[target_feature(enable = "avx2")]
    pub(super) fn maddubs256(iters: u64) -> f64 {
        let mut acc: [__m256i; ACC] =
            std::array::from_fn(|r| _mm256_set1_epi8(black_box(r as i8 + 1)));
        let b = _mm256_set1_epi8(black_box(-5));
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm256_maddubs_epi16(*r, b);
            }
        }
        black_box(acc);
        (iters * (ACC * 32 * 2) as u64) as f64
    }

    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) fn dpbusd512(iters: u64) -> f64 {
        let mut acc = [_mm512_setzero_si512(); ACC];
        let (a, b) = (
            _mm512_set1_epi8(black_box(3)),
            _mm512_set1_epi8(black_box(-5)),
        );
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm512_dpbusd_epi32(*r, a, b);
            }
        }
        black_box(acc);
        (iters * (ACC * 64 * 2) as u64) as f64
    }

    #[target_feature(enable = "avx2,avxvnni")]
    pub(super) fn dpbusd256(iters: u64) -> f64 {
        let mut acc = [_mm256_setzero_si256(); ACC];
        let (a, b) = (
            _mm256_set1_epi8(black_box(3)),
            _mm256_set1_epi8(black_box(-5)),
        );
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm256_dpbusd_avx_epi32(*r, a, b);
            }
        }
        black_box(acc);
        (iters * (ACC * 32 * 2) as u64) as f64
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;
    use std::hint::black_box;

    use super::ACC;

    /// An int8 ceiling kernel for ARM: `$instr` on [`ACC`] independent accumulators, each
    /// instruction `$products` byte products. The intrinsics (`vdotq_s32`, `vmmlaq_s32`) are not
    /// stable Rust yet; the instructions are the same.
    macro_rules! peak {
        ($(#[$doc:meta])* $name:ident, $features:literal, $instr:literal, $products:literal) => {
            $(#[$doc])*
            #[target_feature(enable = $features)]
            pub(super) fn $name(iters: u64) -> f64 {
                let mut acc = [vdupq_n_s32(0); ACC];
                let (a, b) = (vdupq_n_s8(black_box(3)), vdupq_n_s8(black_box(-5)));
                for _ in 0..iters {
                    for r in acc.iter_mut() {
                        // SAFETY: the caller checked the instruction's extension; registers
                        // only.
                        unsafe {
                            std::arch::asm!(
                                concat!($instr, " {acc:v}.4s, {a:v}.16b, {b:v}.16b"),
                                acc = inout(vreg) *r,
                                a = in(vreg) a,
                                b = in(vreg) b,
                                options(pure, nomem, nostack),
                            )
                        };
                    }
                }
                black_box(acc);
                (iters * (ACC * $products * 2) as u64) as f64
            }
        };
    }

    peak!(
        /// `sdot`: 4 lanes of 4 products.
        sdot, "neon,dotprod", "sdot", 16
    );
    peak!(
        /// `smmla`: a 2 × 8 by 8 × 2 product.
        smmla, "neon,i8mm", "smmla", 32
    );
}
