//! The `cuda` build compiles ferrite's kernels (`kernels/*.cu`: paged attention, and the fused
//! cache write and SwiGLU) to PTX with nvcc, as candle-kernels does for its own: `$NVCC`
//! (scripts/cuda-env.sh sets it) or `nvcc` from `PATH`, for `compute_$CUDA_COMPUTE_CAP` (default 80; the driver JIT-compiles it for newer GPUs).
//! Without the feature nothing is compiled and no CUDA toolchain is needed.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    for k in KERNELS {
        println!("cargo:rerun-if-changed=kernels/{k}.cu");
    }
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".to_string());
    let cap = cap
        .trim()
        .trim_start_matches("sm_")
        .trim_start_matches("compute_");
    for k in KERNELS {
        compile(&nvcc, cap, &out, k);
    }
}

/// The kernel sources under `kernels/`, each compiled to `$OUT_DIR/<name>.ptx`.
const KERNELS: [&str; 2] = ["paged_attention", "fused"];

fn compile(nvcc: &str, cap: &str, out: &std::path::Path, name: &str) {
    let ptx = out.join(format!("{name}.ptx"));
    let src = format!("kernels/{name}.cu");
    let status = Command::new(nvcc)
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(&ptx)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("running {nvcc} for {src}: {e} (see scripts/cuda-env.sh)"));
    if !status.success() {
        panic!("{nvcc} failed on {src} ({status})");
    }
}
