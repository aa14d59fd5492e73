//! The CUDA paged-attention kernel's source, run on the CPU: `runtime/kernels/paged_attention.cu`
//! is compiled with g++ against a small shim (`tests/cuda_shim/`: a thread block is that many
//! threads with a barrier for `__syncthreads`), under AddressSanitizer, and fed the launch the
//! CUDA build would make (`attention_kernel::{KernelTables, launch_shape}`). Its output is
//! checked against the fused CPU kernel on mixed batches: prefill chunks after cached context
//! longer than one chunk of keys, decodes, shuffled block tables, sliding windows, GQA groups,
//! head sizes that are not powers of two, and every cache type. This is how the kernel's
//! indexing (block tables, slots, chunking, shared memory) is tested where no GPU is.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::batches::BatchShape;
use ferrite_runtime::model::attention::{AttentionBackend, AttnMeta, paged_attention};
use ferrite_runtime::model::attention_kernel::{KernelTables, LaunchShape, launch_shape};
use ferrite_testkit::process::TempDir;
use proptest::prelude::*;

/// The harness binary, built once per test run.
fn harness() -> &'static Path {
    static BUILT: OnceLock<(TempDir, PathBuf)> = OnceLock::new();
    let (_, exe) = BUILT.get_or_init(|| {
        let dir = TempDir::new("cuda-shim");
        let exe = dir.path().join("harness");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_shim/harness.cpp");
        let out = Command::new("g++")
            .args([
                "-std=c++20",
                "-O1",
                "-g",
                "-pthread",
                "-fno-omit-frame-pointer",
            ])
            .args(["-fsanitize=address,undefined", "-fno-sanitize-recover=all"])
            .arg("-o")
            .arg(&exe)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("g++ (Debian g++) is needed to build {src:?}: {e}"));
        assert!(
            out.status.success(),
            "g++ failed on the kernel:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (dir, exe)
    });
    exe
}

fn push<T: Copy>(buf: &mut Vec<u8>, xs: &[T], bytes: impl Fn(T) -> Vec<u8>) {
    for &x in xs {
        buf.extend(bytes(x));
    }
}

/// Runs the kernel on the CPU for `meta`, as the CUDA build would launch it.
fn run_kernel(meta: &AttnMeta, q: &[f32], kc: &Tensor, vc: &Tensor) -> Vec<f32> {
    let shape: LaunchShape = launch_shape(meta).expect("a launch");
    let t = KernelTables::new(meta);
    let slots = kc.dim(0).expect("slots");
    let cache_type = match kc.dtype() {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        other => panic!("cache type {other:?}"),
    };
    let header = [
        t.token_seq.len(),
        t.table_start.len(),
        meta.num_heads,
        meta.num_kv_heads,
        meta.head_dim,
        meta.block_size,
        shape.window as usize,
        cache_type,
        slots,
        t.tables.len(),
        shape.threads as usize,
        shape.shared_bytes as usize,
    ];
    let mut buf = Vec::new();
    push(&mut buf, &header, |x| (x as i32).to_le_bytes().to_vec());
    buf.extend(meta.scale.to_le_bytes());
    push(&mut buf, q, |x: f32| x.to_le_bytes().to_vec());
    for c in [kc, vc] {
        let flat = c.flatten_all().expect("flat");
        match c.dtype() {
            DType::F32 => push(&mut buf, &flat.to_vec1::<f32>().expect("f32"), |x| {
                x.to_le_bytes().to_vec()
            }),
            DType::F16 => push(&mut buf, &flat.to_vec1::<half::f16>().expect("f16"), |x| {
                x.to_bits().to_le_bytes().to_vec()
            }),
            _ => push(
                &mut buf,
                &flat.to_vec1::<half::bf16>().expect("bf16"),
                |x| x.to_bits().to_le_bytes().to_vec(),
            ),
        }
    }
    for a in [&t.token_seq, &t.token_pos, &t.table_start, &t.tables] {
        push(&mut buf, a, |x: u32| x.to_le_bytes().to_vec());
    }
    let dir = TempDir::new("cuda-launch");
    let (input, output) = (dir.path().join("in"), dir.path().join("out"));
    std::fs::write(&input, &buf).expect("input");
    let out = Command::new(harness())
        .arg(&input)
        .arg(&output)
        .output()
        .expect("the harness runs");
    assert!(
        out.status.success(),
        "the kernel failed on the CPU ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&output)
        .expect("output")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn cpu_kernel(meta: &AttnMeta, q: &[f32], kc: &Tensor, vc: &Tensor) -> Vec<f32> {
    let q = Tensor::from_slice(
        q,
        (meta.token_seq.len(), meta.num_heads * meta.head_dim),
        &Device::Cpu,
    )
    .expect("q");
    paged_attention(&q, kc, vc, meta, AttentionBackend::Auto)
        .and_then(|t| t.flatten_all()?.to_vec1())
        .expect("attention")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// The kernel agrees with the fused CPU kernel within 1e-4 (they sum in different orders,
    /// and the CPU kernel's exp is an approximation), reads nothing outside its buffers, and
    /// gives each sequence bitwise the same rows when the batch around it changes (here: the
    /// sequences in the opposite order). Contexts reach 300 keys: several chunks of 128.
    #[test]
    fn the_cuda_kernel_agrees_with_the_cpu_kernel(
        kv_heads in 1usize..4,
        group in 1usize..5,
        head_dim in prop::sample::select(vec![8usize, 40, 64]),
        block_size in prop::sample::select(vec![4usize, 16]),
        seqs in prop::collection::vec((0usize..300, 1usize..12), 1..4),
        window in prop::option::of(1usize..200),
        cache in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        seed in any::<u64>(),
    ) {
        let shape = BatchShape { kv_heads, group, head_dim, block_size, seqs, window, cache, seed };
        let b = shape.in_order();
        let gpu = run_kernel(&b.meta, &b.q, &b.k_cache, &b.v_cache);
        let cpu = cpu_kernel(&b.meta, &b.q, &b.k_cache, &b.v_cache);
        prop_assert_eq!(gpu.len(), cpu.len());
        let max = gpu.iter().zip(&cpu).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        prop_assert!(max < 1e-4, "kernel vs CPU: {}", max);

        let order: Vec<usize> = (0..shape.seqs.len()).collect();
        let reversed: Vec<usize> = order.iter().rev().copied().collect();
        let r = shape.batch(&reversed);
        let again = run_kernel(&r.meta, &r.q, &r.k_cache, &r.v_cache);
        for s in 0..shape.seqs.len() {
            let (a, b) = (shape.rows_of(&gpu, &order, s), shape.rows_of(&again, &reversed, s));
            prop_assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "sequence {} differs when the batch is reordered", s
            );
        }
    }
}

/// A token whose table points past the pool is refused before any launch (the CUDA path runs
/// the same check), and the kernel's launch covers one block per token and kv head.
#[test]
fn tables_outside_the_pool_are_refused() {
    let meta = AttnMeta {
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 8,
        block_size: 4,
        scale: 0.35,
        sliding_window: None,
        token_seq: vec![0],
        token_pos: vec![3],
        block_tables: vec![vec![9]],
        device_tables: Default::default(),
    };
    let kc = Tensor::zeros((8, 8), DType::F32, &Device::Cpu).expect("kc");
    let q = Tensor::zeros((1, 16), DType::F32, &Device::Cpu).expect("q");
    let err = paged_attention(&q, &kc, &kc, &meta, AttentionBackend::Auto).expect_err("refused");
    assert!(err.to_string().contains("outside the pool"), "{err}");
    assert_eq!(launch_shape(&meta).map(|s| s.grid), Some((1, 1)));
}
