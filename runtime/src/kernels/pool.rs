//! Keeps rayon's workers awake for the length of one CPU forward.
//!
//! A forward is ~150 parallel ops a few microseconds to a millisecond apart, with serial work
//! between them (candle's elementwise ops, bookkeeping). Rayon's idle workers spin only briefly
//! before they sleep on a futex, so most parallel ops began by waking a sleeping worker: on this
//! project's 2-vCPU VM `perf` put 12–15% of a decode benchmark's time in `futex_wake` (a wake
//! is a hypervisor exit), plus the wake's latency before the sleeper takes its half. llama.cpp's
//! CPU backend spins its threads between the ops of one graph for the same reason.
//!
//! [`hot`] runs a closure on the pool with one poller per other worker: a job that, until the
//! closure returns, takes any pending job of the pool as soon as it appears
//! ([`rayon::yield_now`]) and otherwise spins, then after a stretch without work yields its core
//! between polls (`sched_yield`), so the process's other threads still get to run. Which thread
//! runs a piece of work never changes a result here (every kernel splits its work the same way
//! whatever the threads), so this only changes when work starts.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

thread_local! {
    /// Whether this thread is inside a poller: a nested one must return at once, or the job the
    /// outer poller is running (and the closure waiting on it) would never finish.
    static POLLING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` on rayon's global pool (from outside it: `f` runs on a worker and the caller
/// blocks until it returns) while the pool's other workers poll for its jobs.
pub fn hot<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let done = AtomicBool::new(false);
    rayon::scope(|s| {
        let owner = rayon::current_thread_index();
        let done = &done;
        for _ in 1..rayon::current_num_threads() {
            s.spawn(move |_| poll(done, owner));
        }
        // Set on every way out, a panic included, so the scope's pollers end and it can join.
        let _stop = Stop(done);
        f()
    })
}

/// Empty polls (each a pass over the pool's queues, about a microsecond) before a poller
/// starts yielding its core to the OS scheduler between polls.
const SPINS_BEFORE_YIELDING: u32 = 64;

/// Sets its flag when dropped.
struct Stop<'a>(&'a AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Takes the pool's jobs as they appear until `done`. Returns at once on the thread running the
/// closure (which must get back to it) and inside another poller.
fn poll(done: &AtomicBool, owner: Option<usize>) {
    if rayon::current_thread_index() == owner || POLLING.get() {
        return;
    }
    POLLING.set(true);
    let mut idle = 0u32;
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle = 0;
        } else if idle < SPINS_BEFORE_YIELDING {
            idle += 1;
            std::hint::spin_loop();
        } else {
            // A long serial stretch: let the process's other threads (the HTTP server's) run
            // rather than hold the core, without sleeping on a futex.
            std::thread::yield_now();
        }
    }
    POLLING.set(false);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn runs_the_closure_and_its_parallel_work_and_returns() {
        let sums: Vec<u64> = hot(|| {
            (0..200)
                .map(|i| (0..10_000u64).into_par_iter().map(|x| x * i).sum())
                .collect()
        });
        let want: Vec<u64> = (0..200).map(|i| i * (10_000 * 9_999 / 2)).collect();
        assert_eq!(sums, want);
    }

    #[test]
    fn nests_and_survives_a_panic() {
        let nested = hot(|| hot(|| (0..1000u32).into_par_iter().sum::<u32>()));
        assert_eq!(nested, 499_500);
        let caught = std::panic::catch_unwind(|| {
            hot(|| {
                (0..100u32)
                    .into_par_iter()
                    .for_each(|i| assert!(i < 50, "boom"));
            })
        });
        assert!(caught.is_err());
        // The pool is still usable afterwards (a stuck poller would hang this).
        assert_eq!(hot(|| (0..10u32).into_par_iter().sum::<u32>()), 45);
    }
}
