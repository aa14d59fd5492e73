//! Finding the control plane's binaries: `FERRITE_KUBE_BIN` (a directory), then `PATH`, then
//! the xz-packed copies in `../shared/k8s` beside the checkout, unpacked once into a cache under
//! the target directory.

use std::path::PathBuf;
use std::process::Command;

use crate::paths::{target_dir, workspace_root};

/// Paths of the three programs a test cluster runs.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub etcd: PathBuf,
    pub apiserver: PathBuf,
    pub controller_manager: PathBuf,
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

fn in_env_dir(name: &str) -> Option<PathBuf> {
    std::env::var_os("FERRITE_KUBE_BIN")
        .map(|d| PathBuf::from(d).join(name))
        .filter(|p| p.is_file())
}

/// Unpacks `<shared>/k8s/<name>.xz` (checked against its SHA256SUMS) into the cache once.
fn from_shared(name: &str) -> Result<Option<PathBuf>, String> {
    let shared = workspace_root().join("../shared/k8s");
    let packed = shared.join(format!("{name}.xz"));
    if !packed.is_file() {
        return Ok(None);
    }
    let cache = target_dir().join("ferrite-kube/bin");
    let out = cache.join(name);
    let stamp = cache.join(format!("{name}.from"));
    let packed_meta = std::fs::metadata(&packed).map_err(|e| e.to_string())?;
    let fingerprint = format!(
        "{} {}",
        packed_meta.len(),
        packed_meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs())
    );
    if out.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == fingerprint) {
        return Ok(Some(out));
    }
    std::fs::create_dir_all(&cache).map_err(|e| e.to_string())?;
    let sums = std::fs::read_to_string(shared.join("SHA256SUMS")).map_err(|e| e.to_string())?;
    let want = sums
        .lines()
        .find(|l| l.ends_with(&format!(" {name}.xz")))
        .and_then(|l| l.split_whitespace().next())
        .ok_or_else(|| format!("{name}.xz is not in SHA256SUMS"))?
        .to_string();
    let got = Command::new("sha256sum")
        .arg(&packed)
        .output()
        .map_err(|e| format!("sha256sum: {e}"))?;
    let got = String::from_utf8_lossy(&got.stdout);
    if got.split_whitespace().next() != Some(want.as_str()) {
        return Err(format!("{} does not match SHA256SUMS", packed.display()));
    }
    // Unpack beside the target and rename, so concurrent tests never run a half-written file.
    let partial = cache.join(format!("{name}.{}.partial", std::process::id()));
    let file = std::fs::File::create(&partial).map_err(|e| e.to_string())?;
    let status = Command::new("xz")
        .arg("-dc")
        .arg(&packed)
        .stdout(file)
        .status()
        .map_err(|e| format!("xz: {e} (install xz-utils)"))?;
    if !status.success() {
        return Err(format!("xz -dc {} failed", packed.display()));
    }
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| e.to_string())?;
    std::fs::rename(&partial, &out).map_err(|e| e.to_string())?;
    std::fs::write(&stamp, fingerprint).map_err(|e| e.to_string())?;
    Ok(Some(out))
}

fn find(name: &str) -> Result<PathBuf, String> {
    if let Some(p) = in_env_dir(name).or_else(|| on_path(name)) {
        return Ok(p);
    }
    if name != "etcd"
        && let Some(p) = from_shared(name)?
    {
        return Ok(p);
    }
    Err(format!("{name} not found"))
}

/// Where to get the binaries, for the message shown when they are missing.
pub const HOW_TO_GET: &str = "set FERRITE_KUBE_BIN to a directory holding etcd, kube-apiserver and kube-controller-manager \
(v1.32: `setup-envtest use 1.32.x -p path` gives etcd and kube-apiserver; kube-controller-manager comes from \
https://dl.k8s.io/v1.32.6/bin/linux/amd64/kube-controller-manager), or put them on PATH; \
scripts/kube-bin.sh installs them from Debian (etcd) and ../shared/k8s";

/// The binaries, or why they cannot be found.
pub fn binaries() -> Result<Binaries, String> {
    let mut missing = Vec::new();
    let mut get = |name: &str| {
        find(name).unwrap_or_else(|e| {
            missing.push(e);
            PathBuf::new()
        })
    };
    let b = Binaries {
        etcd: get("etcd"),
        apiserver: get("kube-apiserver"),
        controller_manager: get("kube-controller-manager"),
    };
    if missing.is_empty() {
        Ok(b)
    } else {
        Err(format!("{}; {HOW_TO_GET}", missing.join(", ")))
    }
}
