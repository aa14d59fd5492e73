//! Child processes that cannot outlive the test that started them, free loopback ports, and
//! polling with a deadline.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A port that was free a moment ago on 127.0.0.1, from below the kernel's ephemeral range:
/// a port from `bind(:0)` is one any outgoing connection (the tests make thousands) may take
/// before the process it was meant for binds it, which lost CI runs to "address already in
/// use". Below that range only another test's pick can collide, and each process starts its
/// walk at a different place.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 10_000;
    let high = ephemeral_start().max(LOW + 1_000);
    let span = high - LOW;
    let seed = std::process::id().wrapping_mul(7_919)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
    for _ in 0..span {
        let port = LOW + (seed.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % span);
        let port = u16::try_from(port).expect("below the ephemeral range");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port below {high}")
}

/// The first port the kernel hands to outgoing connections (32768 when unreadable).
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
        .min(65_535)
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Children are forked from one thread that lives as long as the process, with
/// `PR_SET_PDEATHSIG`: the kernel kills them when this process dies, however it dies (a test
/// timeout's SIGKILL included), so no etcd or apiserver is ever left behind. A signal tied to
/// a short-lived thread (a tokio worker) would fire too early.
fn keeper() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static KEEPER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    KEEPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("testkit-keeper".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(spawn_dying_with_parent(&mut cmd));
                }
            })
            .expect("keeper thread");
        Mutex::new(tx)
    })
}

fn spawn_dying_with_parent(cmd: &mut Command) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: prctl is async-signal-safe and touches only the calling (child) process.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// A child process killed (SIGKILL) and reaped when dropped, and when this process dies.
#[derive(Debug)]
pub struct Guard {
    pub name: String,
    pub child: Child,
}

impl Guard {
    /// Spawns `cmd` so that it dies with this process.
    pub fn spawn(name: &str, cmd: Command) -> std::io::Result<Guard> {
        let (tx, rx) = mpsc::channel();
        keeper()
            .lock()
            .map_err(|_| std::io::Error::other("keeper poisoned"))?
            .send((cmd, tx))
            .map_err(|_| std::io::Error::other("keeper gone"))?;
        let child = rx
            .recv()
            .map_err(|_| std::io::Error::other("keeper gone"))??;
        Ok(Guard {
            name: name.to_string(),
            child,
        })
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Whether it has exited (and how).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`).
    pub fn signal(&self, signal: i32) {
        let Ok(pid) = i32::try_from(self.child.id()) else {
            return;
        };
        // SAFETY: kill(2) on a pid we spawned and have not reaped.
        unsafe {
            libc::kill(pid, signal);
        }
    }

    /// SIGTERM, then the exit status if it exits within `timeout`.
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        self.signal(libc::SIGTERM);
        self.wait_timeout(timeout)
    }

    /// Waits up to `timeout` for it to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A directory removed when dropped.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A new, empty directory under the system's temp dir.
    pub fn new(prefix: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("{prefix}-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("FERRITE_TEST_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Resident memory of process `pid` from `/proc/<pid>/status`: (peak, current) in KiB, zeros
/// where it cannot be read. Tests of memory bounds read it for the process under test.
pub fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// A short string unique within this process and unlikely to repeat across processes.
pub fn unique() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{:x}{:x}{}",
        std::process::id() & 0xffff,
        nanos & 0xfff,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Polls `f` every 100 ms until it returns `Some`, for at most `timeout`; panics naming `what`.
pub async fn eventually<T>(
    timeout: Duration,
    what: &str,
    mut f: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// [`eventually`] for tests without a runtime: polls `f` every 100 ms.
pub fn eventually_blocking<T>(
    timeout: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
