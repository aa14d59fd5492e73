//! The C allocator's policy for a process whose working set is a few large tensors.
//!
//! glibc gives a thread that finds the allocator busy an arena of its own (up to eight per
//! core) and keeps what is freed in an arena for that arena's later use. A forward runs on
//! whichever compute thread takes it, the loader and the engine run on others, so each arena
//! ended up holding its own copy of the activation peak: ~100 MiB of the server's resident
//! memory under load (docs/benchmarks.md). One arena serves the same allocations from one
//! free list. Its lock is not a bottleneck: a forward makes a few hundred allocations, each a
//! whole tensor, and throughput measured the same with one arena as with the default.

/// Whether [`use_one_arena`] changed the allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArenaPolicy {
    /// One arena for every thread.
    One,
    /// `MALLOC_ARENA_MAX` or `GLIBC_TUNABLES` chose; they were left alone.
    FromEnvironment,
    /// Not glibc, or glibc refused the setting.
    Unchanged,
}

/// Makes every thread allocate from one arena, unless the environment sets the arena count
/// (an operator's `MALLOC_ARENA_MAX` wins). Call first thing in `main`, before any thread
/// starts: threads that already took an arena keep it.
pub fn use_one_arena() -> ArenaPolicy {
    let tuned = std::env::var_os("MALLOC_ARENA_MAX").is_some()
        || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.arena_max"));
    if tuned {
        return ArenaPolicy::FromEnvironment;
    }
    set_arena_max_one()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_arena_max_one() -> ArenaPolicy {
    // SAFETY: mallopt takes two integers and only changes glibc's allocator parameters.
    match unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) } {
        1 => ArenaPolicy::One,
        _ => ArenaPolicy::Unchanged,
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_arena_max_one() -> ArenaPolicy {
    ArenaPolicy::Unchanged
}

/// Hands the free memory inside the allocator's heaps back to the kernel. Loading leaves the
/// checkpoint's raw tensors and conversion buffers freed but resident; this makes a fresh
/// server's resident memory what it holds.
pub fn release_free_memory() {
    // SAFETY: malloc_trim only walks glibc's own free lists.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::malloc_trim(0);
    }
}
