//! The `cuda` build compiles the paged-attention kernel to PTX with nvcc, as candle-kernels
//! does for its own: `$NVCC` (scripts/cuda-env.sh sets it) or `nvcc` from `PATH`, for
//! `compute_$CUDA_COMPUTE_CAP` (default 80; the driver JIT-compiles it for newer GPUs).
//! Without the feature nothing is compiled and no CUDA toolchain is needed.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=kernels/paged_attention.cu");
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
    let ptx = out.join("paged_attention.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(&ptx)
        .arg("kernels/paged_attention.cu")
        .status()
        .unwrap_or_else(|e| {
            panic!("running {nvcc} for kernels/paged_attention.cu: {e} (see scripts/cuda-env.sh)")
        });
    if !status.success() {
        panic!("{nvcc} failed on kernels/paged_attention.cu ({status})");
    }
}
