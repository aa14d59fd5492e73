//! Whether the tests may use an NVIDIA GPU. GPU tests run wherever `nvidia-smi` works and the
//! crate under test was built with `--features cuda`; elsewhere each prints one loud line and
//! returns. `FERRITE_REQUIRE_GPU=1` turns a skip into a failure, so a run on a GPU machine
//! cannot pass by skipping.

use std::process::Command;

/// The first GPU `nvidia-smi` lists.
#[derive(Debug, Clone)]
pub struct Gpu {
    pub name: String,
    /// Compute capability, e.g. "9.0".
    pub compute_cap: String,
    pub memory_mib: u64,
}

/// The GPU, if `nvidia-smi` lists one.
pub fn nvidia_gpu() -> Option<Gpu> {
    let out = Command::new("nvidia-smi")
        .args([
            "--query-gpu=name,compute_cap,memory.total",
            "--format=csv,noheader,nounits",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut f = text.lines().next()?.split(',').map(str::trim);
    Some(Gpu {
        name: f.next()?.to_string(),
        compute_cap: f.next()?.to_string(),
        memory_mib: f.next()?.parse().ok()?,
    })
}

/// The GPU for `test`, or `None` after one loud line saying why it did not run. `built` is
/// whether the crate under test has the `cuda` feature (`cfg!(feature = "cuda")`).
pub fn gpu_or_skip(test: &str, built: bool) -> Option<Gpu> {
    let why = match (nvidia_gpu(), built) {
        (Some(gpu), true) => {
            eprintln!(
                "=== GPU TEST {test}: running on {} (sm_{})",
                gpu.name, gpu.compute_cap
            );
            return Some(gpu);
        }
        (None, _) => "no NVIDIA GPU here (nvidia-smi does not run)",
        (Some(_), false) => "a GPU is here but this build lacks `--features cuda`",
    };
    let line = format!("=== GPU TEST SKIPPED: {test}: {why}; it tested nothing");
    if std::env::var("FERRITE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("{line} (FERRITE_REQUIRE_GPU=1)");
    }
    eprintln!("{line}");
    None
}
