//! Replicas that share a download cache (a ReadWriteMany claim) take turns on each file: an
//! exclusive advisory lock on `<file>.lock`, held for the whole download. Before, two replicas
//! started at once appended to one `.part` file together (corrupt weights, or a part longer
//! than the file and a crash loop). The second replica waits, then finds the file complete.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

/// Holds the lock while it lives; the kernel releases it if the process dies.
#[derive(Debug)]
pub struct FileLock {
    _file: File,
}

/// The lock file for `name` (a key or file path) of the cache folder `dir`: in its
/// `.ferrite-locks`, apart from the files it guards, which a model folder would otherwise list.
pub fn path_in(dir: &Path, name: &str) -> PathBuf {
    dir.join(".ferrite-locks")
        .join(format!("{}.lock", name.replace('/', "%2F")))
}

/// Waits for the lock on `path` (blocking: call it from a blocking thread).
pub fn acquire(path: &Path) -> io::Result<FileLock> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    file.lock()?;
    Ok(FileLock { _file: file })
}

/// The lock on `path`, if no one holds it now.
pub fn try_acquire(path: &Path) -> io::Result<Option<FileLock>> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    match file.try_lock() {
        Ok(()) => Ok(Some(FileLock { _file: file })),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

/// [`acquire`] from async code.
pub async fn acquire_async(path: PathBuf) -> io::Result<FileLock> {
    tokio::task::spawn_blocking(move || acquire(&path))
        .await
        .map_err(io::Error::other)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time() {
        let dir = std::env::temp_dir().join(format!("ferrite-lock-{}", std::process::id()));
        let path = dir.join("a.gguf.lock");
        let held = acquire(&path).expect("lock");
        assert!(try_acquire(&path).expect("try").is_none(), "held elsewhere");
        drop(held);
        assert!(try_acquire(&path).expect("try").is_some(), "released");
        let _ = std::fs::remove_dir_all(dir);
    }
}
