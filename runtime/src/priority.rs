//! CPU priority of compute threads. The engine thread and rayon's pool (candle's GEMM and our
//! attention) run a few nice levels below the HTTP runtime, so health probes, `/metrics` scrapes
//! and token streaming get a core promptly even when the model saturates all of them. Compute
//! throughput does not change: the HTTP threads sleep most of the time.

use std::sync::atomic::{AtomicI32, Ordering};

/// Default nice increment for compute threads (`--compute-nice`).
pub const COMPUTE_NICE: i32 = 5;

static NICE: AtomicI32 = AtomicI32::new(COMPUTE_NICE);

/// Lowers the calling thread's priority by the configured increment (0 leaves it). On Linux
/// the nice value is per thread. Best effort: failing to renice only costs latency, so errors
/// are ignored.
pub fn lower_current_thread() {
    let nice = NICE.load(Ordering::Relaxed);
    #[cfg(target_os = "linux")]
    if nice > 0 {
        // SAFETY: plain syscalls on the calling thread (who = 0) with no pointers involved.
        unsafe {
            let current = libc::getpriority(libc::PRIO_PROCESS, 0);
            libc::setpriority(libc::PRIO_PROCESS, 0, current + nice);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

/// Sets the increment (clamped to 0..=19), then builds rayon's global pool with it; call
/// before any rayon work and before the engine thread starts.
pub fn init_compute_pool(nice: i32) -> Result<(), rayon::ThreadPoolBuildError> {
    NICE.store(nice.clamp(0, 19), Ordering::Relaxed);
    rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("ferrite-compute-{i}"))
        .start_handler(|_| lower_current_thread())
        .build_global()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn lowers_only_the_calling_thread() {
        // SAFETY: getpriority on the calling thread.
        let main_before = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let (before, after) = std::thread::spawn(|| {
            // SAFETY: as above.
            let before = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            lower_current_thread();
            // SAFETY: as above.
            let after = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            (before, after)
        })
        .join()
        .expect("thread");
        assert_eq!(after, (before + COMPUTE_NICE).min(19));
        // SAFETY: as above.
        let main_after = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        assert_eq!(main_after, main_before);
    }
}
