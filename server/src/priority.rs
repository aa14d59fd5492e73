//! CPU priority of compute threads. The engine thread and rayon's pool (candle's GEMM and our
//! attention) run a few nice levels below the HTTP runtime, so health probes, `/metrics` scrapes
//! and token streaming get a core promptly even when the model saturates all of them. Compute
//! throughput does not change: the HTTP threads sleep most of the time.

/// Nice increment for compute threads (0 is the process's own level).
pub const COMPUTE_NICE: i32 = 5;

/// Lowers the calling thread's priority by `COMPUTE_NICE`. On Linux the nice value is per
/// thread. Best effort: failing to renice only costs latency, so errors are ignored.
pub fn lower_current_thread() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: plain syscalls on the calling thread (who = 0) with no pointers involved.
        unsafe {
            let current = libc::getpriority(libc::PRIO_PROCESS, 0);
            libc::setpriority(libc::PRIO_PROCESS, 0, current + COMPUTE_NICE);
        }
    }
}

/// Builds rayon's global pool with lowered priority; call before any rayon work.
pub fn init_compute_pool() -> Result<(), rayon::ThreadPoolBuildError> {
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
        assert_eq!(
            unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) },
            main_before
        );
    }
}
