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
use ferrite_runtime::model::attention_kernel::{
    KernelTables, LaunchShape, graph_launch_shape, launch_shape,
};
use ferrite_testkit::process::TempDir;
use proptest::prelude::*;

/// The harness binary.
fn harness() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    build(&BUILT, "harness.cpp")
}

/// `tests/cuda_shim/<source>` compiled with g++ under AddressSanitizer and UBSan into the test
/// target's scratch folder, named by a hash of the shim's and the kernels' sources: each test
/// runs in its own process, and the sanitized build is seconds of CPU, so a build is kept until
/// a source changes (and nothing is left in the system's temporary folder).
fn build<'a>(cell: &'a OnceLock<PathBuf>, source: &str) -> &'a Path {
    cell.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let src = root.join("tests/cuda_shim").join(source);
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-shim");
        std::fs::create_dir_all(&dir).expect("the shim's folder");
        let exe = dir.join(format!("{source}-{:016x}", sources_hash(root, source)));
        if exe.exists() {
            return exe;
        }
        let partial = dir.join(format!("{source}.{}", std::process::id()));
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
            .arg(&partial)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("g++ (Debian g++) is needed to build {src:?}: {e}"));
        assert!(
            out.status.success(),
            "g++ failed on the kernel:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::rename(&partial, &exe).expect("put the harness in place");
        exe
    })
}

/// A hash of what a harness is built from: its source, the shim's headers and the kernels.
fn sources_hash(root: &Path, source: &str) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut files: Vec<PathBuf> = ["tests/cuda_shim", "kernels"]
        .iter()
        .flat_map(|d| std::fs::read_dir(root.join(d)).expect("the kernels' sources"))
        .map(|e| e.expect("a source").path())
        .collect();
    files.sort();
    let mut h = DefaultHasher::new();
    source.hash(&mut h);
    for f in files {
        f.file_name().hash(&mut h);
        std::fs::read(&f).expect("read a source").hash(&mut h);
    }
    h.finish()
}

fn push<T: Copy>(buf: &mut Vec<u8>, xs: &[T], bytes: impl Fn(T) -> Vec<u8>) {
    for &x in xs {
        buf.extend(bytes(x));
    }
}

/// Runs the kernel on the CPU for `meta`, as the CUDA build would launch it.
fn run_kernel(meta: &AttnMeta, q: &[f32], kc: &Tensor, vc: &Tensor) -> Vec<f32> {
    let shape = launch_shape(meta).expect("a launch");
    run_shape(meta, &shape, q, kc, vc)
}

/// Runs the kernel on the CPU for `meta` as launched with `shape`.
fn run_shape(
    meta: &AttnMeta,
    shape: &LaunchShape,
    q: &[f32],
    kc: &Tensor,
    vc: &Tensor,
) -> Vec<f32> {
    let t = KernelTables::new(meta);
    let slots = kc.dim(0).expect("slots");
    let cache_type = match kc.dtype() {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        other => panic!("cache type {other:?}"),
    };
    let runs = shape.runs(t.token_seq.len());
    let scratch = shape.scratch_floats(t.token_seq.len(), meta.head_dim);
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
        shape.max_parts as usize,
        scratch,
        runs.len(),
    ];
    let mut buf = Vec::new();
    push(&mut buf, &header, |x| (x as i32).to_le_bytes().to_vec());
    buf.extend(meta.scale.to_le_bytes());
    buf.extend(meta.softcap.unwrap_or(0.0).to_le_bytes());
    for (t0, n, z) in runs {
        push(&mut buf, &[t0, n, z], |x| (x as i32).to_le_bytes().to_vec());
    }
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
    launch(harness(), &buf)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Runs `exe` on the launch `input`; returns what it wrote.
fn launch(exe: &Path, input: &[u8]) -> Vec<u8> {
    let dir = TempDir::new("cuda-launch");
    let (inp, output) = (dir.path().join("in"), dir.path().join("out"));
    std::fs::write(&inp, input).expect("input");
    let out = Command::new(exe)
        .arg(&inp)
        .arg(&output)
        .output()
        .expect("the harness runs");
    assert!(
        out.status.success(),
        "the kernel failed on the CPU ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&output).expect("output")
}

/// A key pool of rows `[slots][kv_dim]` (the CUDA kernel's layout) as the CPU keeps keys:
/// transposed per block (`kv::layout`).
fn cpu_key_layout(rows: &Tensor, block_size: usize) -> Tensor {
    let (slots, kv_dim) = rows.dims2().expect("a pool");
    rows.reshape((slots / block_size, block_size, kv_dim))
        .and_then(|t| t.transpose(1, 2)?.contiguous()?.reshape((slots, kv_dim)))
        .expect("whole blocks")
}

/// The CPU kernel on the same keys as the CUDA one, `kc` in rows.
fn cpu_kernel(meta: &AttnMeta, q: &[f32], kc: &Tensor, vc: &Tensor) -> Vec<f32> {
    let kc = &cpu_key_layout(kc, meta.block_size);
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
    /// sequences in the opposite order) or the launch spreads its parts otherwise. Contexts
    /// reach 300 keys: several chunks of 128, so tokens of several parts are combined.
    #[test]
    fn the_cuda_kernel_agrees_with_the_cpu_kernel(
        kv_heads in 1usize..4,
        group in 1usize..5,
        head_dim in prop::sample::select(vec![8usize, 40, 64]),
        block_size in prop::sample::select(vec![4usize, 16]),
        seqs in prop::collection::vec((0usize..300, 1usize..12), 1..4),
        window in prop::option::of(1usize..200),
        softcap in prop::option::of(prop::sample::select(vec![1.5f32, 50.0])),
        cache in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        seed in any::<u64>(),
    ) {
        let shape = BatchShape {
            kv_heads, group, head_dim, block_size, seqs, window, softcap, cache, seed,
        };
        let b = shape.in_order();
        let gpu = run_kernel(&b.meta, &b.q, &b.k_cache, &b.v_cache);
        let cpu = cpu_kernel(&b.meta, &b.q, &b.k_cache, &b.v_cache);
        prop_assert_eq!(gpu.len(), cpu.len());
        let max = gpu.iter().zip(&cpu).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        prop_assert!(max < 1e-4, "kernel vs CPU: {}", max);

        // Parts of several chunks (contexts past MAX_PARTS chunks), here at most two parts.
        let plain = launch_shape(&b.meta).expect("a launch");
        let two = LaunchShape { max_parts: 2, planned_parts: 2, ..plain };
        let wide = run_shape(&b.meta, &two, &b.q, &b.k_cache, &b.v_cache);
        let max = wide.iter().zip(&cpu).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        prop_assert!(max < 1e-4, "kernel with parts of two chunks vs CPU: {}", max);

        // Neither the batch around a sequence nor how the launch spreads and runs the parts
        // changes a bit: the sequences in the opposite order, launched as a graph launches
        // (every token combined) in runs of two tokens, each (token, head) over three blocks.
        let order: Vec<usize> = (0..shape.seqs.len()).collect();
        let reversed: Vec<usize> = order.iter().rev().copied().collect();
        let r = shape.batch(&reversed);
        let graph = graph_launch_shape(&r.meta).expect("a launch");
        let spread = LaunchShape { run_tokens: 2, target_blocks: 2 * graph.heads * 3, ..graph };
        let again = run_shape(&r.meta, &spread, &r.q, &r.k_cache, &r.v_cache);
        for s in 0..shape.seqs.len() {
            let (a, b) = (shape.rows_of(&gpu, &order, s), shape.rows_of(&again, &reversed, s));
            prop_assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "sequence {} differs when the batch is reordered and launched as a graph", s
            );
        }
    }
}

/// A token whose table points past the pool is refused before any launch (the CUDA path runs
/// the same check), and the kernel's launch covers one block per token and head.
#[test]
fn tables_outside_the_pool_are_refused() {
    let meta = AttnMeta {
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 8,
        block_size: 4,
        scale: 0.35,
        sliding_window: None,
        softcap: None,
        token_seq: vec![0],
        token_pos: vec![3],
        block_tables: vec![vec![9]],
        device_tables: Default::default(),
    };
    let kc = Tensor::zeros((8, 8), DType::F32, &Device::Cpu).expect("kc");
    let q = Tensor::zeros((1, 16), DType::F32, &Device::Cpu).expect("q");
    let err = paged_attention(&q, &kc, &kc, &meta, AttentionBackend::Auto).expect_err("refused");
    assert!(err.to_string().contains("outside the pool"), "{err}");
    let shape = launch_shape(&meta).expect("a launch");
    assert_eq!((shape.heads, shape.runs(1)), (2, vec![(0, 1, 1)]));
}

/// `kernels/fused.cu`, built for the CPU.
fn fused() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    build(&BUILT, "fused_harness.cpp")
}

/// A tensor's values as little-endian bytes, in its own type.
fn bytes_of(t: &Tensor) -> Vec<u8> {
    let flat = t.flatten_all().expect("flat");
    let mut buf = Vec::new();
    match t.dtype() {
        DType::F32 => push(&mut buf, &flat.to_vec1::<f32>().expect("f32"), |x| {
            x.to_le_bytes().to_vec()
        }),
        DType::F16 => push(&mut buf, &flat.to_vec1::<half::f16>().expect("f16"), |x| {
            x.to_bits().to_le_bytes().to_vec()
        }),
        DType::BF16 => push(
            &mut buf,
            &flat.to_vec1::<half::bf16>().expect("bf16"),
            |x| x.to_bits().to_le_bytes().to_vec(),
        ),
        DType::U32 => push(&mut buf, &flat.to_vec1::<u32>().expect("u32"), |x| {
            x.to_le_bytes().to_vec()
        }),
        other => panic!("type {other:?}"),
    }
    buf
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// The fused rotation and cache write gives what the CPU build's `CacheWriter` gives (its
    /// CPU passes, themselves bitwise candle's ops: `cache_write::cpu`'s proptest): the same
    /// rotated queries, and the same pools (rotated keys and the
    /// values, rounded to the cache type, at their slots, nothing else touched), for both RoPE
    /// pairings, GQA groups, and qkv rows read at a stride wider than the row.
    #[test]
    fn the_fused_rope_and_cache_write_match_candles_ops(
        tokens in 1usize..12,
        kv_heads in 1usize..4,
        group in 1usize..4,
        head_dim in prop::sample::select(vec![2usize, 8, 64]),
        interleaved in any::<bool>(),
        cache in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        seed in any::<u64>(),
    ) {
        use ferrite_runtime::model::cache_write::{CacheWriter, Heads};
        use ferrite_runtime::model::config::RopeStyle;
        use ferrite_runtime::model::rope::Rope;
        let cpu = &Device::Cpu;
        let heads = Heads { num_heads: kv_heads * group, num_kv_heads: kv_heads, head_dim };
        let (q_dim, kv_dim) = (heads.num_heads * head_dim, kv_heads * head_dim);
        let width = q_dim + 2 * kv_dim;
        // Whole blocks of 4 slots (the CPU pool keeps keys transposed per block).
        let block_size = 4;
        let (rows, table_rows, half) = ((tokens + 5).next_multiple_of(block_size), 40usize, head_dim / 2);
        let values = |n: usize, s: u64, scale| ferrite_testkit::random::values(n, s, scale);
        let qkv = Tensor::from_vec(values(tokens * width, seed, 4.0), (tokens, width), cpu).expect("qkv");
        let table = |s| Tensor::from_vec(values(table_rows * half, s, 1.0), (table_rows, half), cpu).expect("table");
        let style = if interleaved { RopeStyle::Interleaved } else { RopeStyle::Half };
        let rope = Rope::from_tables(table(seed ^ 4), table(seed ^ 5), style);
        let positions: Vec<u32> = (0..tokens).map(|t| ((t * 7 + seed as usize) % table_rows) as u32).collect();
        // Distinct slots in a scrambled order.
        let slots: Vec<u32> = (0..tokens).map(|t| ((t * 3 + 2) % rows) as u32).collect();
        let pool = |s: u64| {
            Tensor::from_vec(values(rows * kv_dim, s, 8.0), (rows, kv_dim), cpu)
                .and_then(|t| t.to_dtype(cache))
                .expect("pool")
        };
        let (kc, vc) = (pool(seed ^ 2), pool(seed ^ 3));
        let (pos_t, slot_t) = (
            Tensor::new(positions.as_slice(), cpu).expect("positions"),
            Tensor::new(slots.as_slice(), cpu).expect("slots"),
        );
        let mut input = Vec::new();
        let cache_type = match cache {
            DType::F32 => 0,
            DType::F16 => 1,
            _ => 2,
        };
        let header = [0, tokens, heads.num_heads, kv_heads, head_dim, width, usize::from(interleaved), table_rows, rows, cache_type];
        push(&mut input, &header, |x| (x as i32).to_le_bytes().to_vec());
        for t in [&qkv, rope.cos(), rope.sin(), &pos_t, &slot_t, &kc, &vc] {
            input.extend(bytes_of(t));
        }
        let got = launch(fused(), &input);

        let writer = CacheWriter::new(&pos_t, &slot_t, &rope, kv_dim, block_size).expect("writer");
        let cpu_kc = cpu_key_layout(&kc, block_size);
        let q = writer.write(&qkv, heads, &cpu_kc, &vc).expect("write");
        let mut want = bytes_of(&q.contiguous().expect("q"));
        let written = ferrite_runtime::kv::layout::cpu_keys_as_rows(&cpu_kc, block_size).expect("rows");
        want.extend(bytes_of(&written));
        want.extend(bytes_of(&vc));
        prop_assert_eq!(got.len(), want.len());
        prop_assert!(got == want, "the kernel's q or pools differ from candle's ops");
    }

    /// The fused SwiGLU gives candle's `silu(gate) * up`, within an ulp or two of rounding,
    /// reading the gate/up rows at their stride.
    #[test]
    fn the_fused_swiglu_is_silu_times_up(
        tokens in 0usize..9,
        ffn in 1usize..300,
        extra in 0usize..5,
        seed in any::<u64>(),
    ) {
        let cpu = &Device::Cpu;
        let stride = 2 * ffn + extra;
        let x = Tensor::from_vec(
            ferrite_testkit::random::values(tokens * stride, seed, 12.0),
            (tokens, stride),
            cpu,
        ).expect("x");
        let mut input = Vec::new();
        push(&mut input, &[1, tokens, ffn, stride], |v| (v as i32).to_le_bytes().to_vec());
        input.extend(bytes_of(&x));
        let got: Vec<f32> = launch(fused(), &input)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let want = (candle_nn::ops::silu(&x.narrow(1, 0, ffn).expect("gate")).expect("silu")
            * x.narrow(1, ffn, ffn).expect("up"))
            .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
            .expect("want");
        prop_assert_eq!(got.len(), want.len());
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            prop_assert!((a - b).abs() <= 4.0 * f32::EPSILON * b.abs().max(1e-30), "output {}: {} vs {}", i, a, b);
        }
    }
}
