//! bench-kernels: the packed int8 GEMM (`runtime/src/kernels/qgemm.rs`) alone, at the default
//! model's matrix shapes and the row counts of a decode step and a prefill chunk, on every
//! instruction set this CPU runs. The AVX2 path is the baseline each other path is divided by,
//! measured in the same run, and every figure is also a share of the machine's int8 peak
//! (`roofline`), so a kernel change shows up here without the rest of the model around it.
//!
//!   cargo run --release -p ferrite-bench --bin bench-kernels [-- --rows 1,32,512]

use std::hint::black_box;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use ferrite_bench::roofline;
use ferrite_runtime::kernels::Isa;
use ferrite_runtime::kernels::qgemm::{Bits, Block, QK, QWeights};
use ferrite_testkit::random::values;

#[derive(Debug, Parser)]
struct Args {
    /// Rows (tokens) per multiplication.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,512")]
    rows: Vec<usize>,
    /// `n x k` weight shapes (SmolLM2-135M: fused QKV, output, fused gate/up, down).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "960x576,576x576,3072x576,576x1536"
    )]
    shapes: Vec<String>,
    /// Repetitions; the best is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

/// Deterministic weights of `bits`: 8-bit ones quantized from random values by the kernel's
/// own quantizer, 4-bit ones as GGUF Q4_1 blocks (random nibbles, scales and minimums).
fn weights(n: usize, k: usize, bits: Bits) -> Result<QWeights> {
    let seed = (n * 31 + k) as u64;
    if bits == Bits::Eight {
        return Ok(QWeights::quantize(&values(n * k, seed, 1.0), n, k)?);
    }
    let kb = k.div_ceil(QK);
    let r = values(n * kb * (QK + 2), seed, 1.0);
    Ok(QWeights::from_blocks(n, k, bits, |col, b| {
        let at = (col * kb + b) * (QK + 2);
        let mut q = [0i16; QK];
        for (i, v) in q.iter_mut().enumerate().take(k.saturating_sub(b * QK)) {
            *v = ((r[at + i] + 1.0) * 7.99) as i16;
        }
        Block {
            d: 0.01 + r[at + QK].abs() * 0.01,
            m: r[at + QK + 1] * 0.1,
            q,
        }
    })?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let threads = rayon::current_num_threads();
    let peaks = roofline::measure(threads, 1 << 20);
    let int8 = peaks.int8_ops;
    println!("{threads} threads; int8 peak {}", peaks.int8_label());
    // Every path this CPU runs, slowest first: the first (AVX2, or scalar code where even AVX2
    // is missing) is the baseline.
    let mut isas: Vec<Isa> = Isa::available()
        .into_iter()
        .rev()
        .filter(|&i| i != Isa::Scalar)
        .collect();
    if isas.is_empty() {
        isas.push(Isa::Scalar);
    }
    for bits in [Bits::Four, Bits::Eight] {
        for shape in &args.shapes {
            let (n, k) = shape
                .split_once('x')
                .and_then(|(n, k)| Some((n.parse().ok()?, k.parse().ok()?)))
                .ok_or_else(|| anyhow::anyhow!("--shapes wants NxK, got {shape}"))?;
            let w = weights(n, k, bits)?;
            for &m in &args.rows {
                let x = values(m * k, m as u64, 0.5);
                let mut y = vec![0f32; m * n];
                // Enough calls for ~50 ms per repetition.
                let ops = 2.0 * (m * n * k) as f64;
                let calls = ((2e9 / ops) as usize).clamp(1, 20_000);
                let mut rates = Vec::new();
                for &isa in &isas {
                    w.matmul(isa, &x, m, &mut y);
                    let mut best = f64::MAX;
                    for _ in 0..args.reps {
                        let t = Instant::now();
                        for _ in 0..calls {
                            w.matmul(isa, black_box(&x), m, &mut y);
                        }
                        best = best.min(t.elapsed().as_secs_f64());
                    }
                    black_box(&y);
                    rates.push(ops * calls as f64 / best);
                }
                let line: Vec<String> = isas
                    .iter()
                    .zip(&rates)
                    .map(|(isa, r)| {
                        let share =
                            int8.map_or(String::new(), |p| format!(" ({:.1}%)", 100.0 * r / p));
                        format!("{isa:?} {:.1} GOP/s{share} {:.2}x", r / 1e9, r / rates[0])
                    })
                    .collect();
                println!("{bits:?} {n}x{k} rows {m:>4}: {}", line.join(", "));
            }
        }
    }
    Ok(())
}
