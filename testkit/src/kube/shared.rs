//! One cluster for every test process of a run. nextest runs each test in a process of its
//! own, so the cluster outlives the process that started it: a small supervisor script runs it
//! in a session of its own and stops it once no test has held `users.lock` (a shared `flock`,
//! released by the kernel however a test process ends) for a while. `create.lock` serialises
//! starting a cluster against joining or stopping one.

use std::fs::File;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{
    Binaries, Cluster, Options, Pki, Processes, client_from, plan, target_dir, wait_ready,
};
use crate::process::free_port;

/// Seconds without users after which the supervisor stops the cluster.
const IDLE_SECONDS: u32 = 30;
/// Bumped when the cluster's configuration changes, so a run never joins an older one.
const LAYOUT: u32 = 1;

fn quote(arg: &str) -> String {
    format!("'{}'", arg.replace('\'', r"'\''"))
}

fn line(argv: &[String], log: &str) -> String {
    let words: Vec<String> = argv.iter().map(|a| quote(a)).collect();
    format!("{} > {log} 2>&1 &", words.join(" "))
}

fn supervisor_script(plan: &super::Plan) -> String {
    let mut s = String::from(
        "#!/bin/bash\n# Supervises a shared test cluster (ferrite-testkit); stops it when idle.\ncd \"$(dirname \"$0\")\"\n",
    );
    s += &format!("{}\nETCD=$!\n", line(&plan.etcd, "etcd.log"));
    s += &format!("{}\nAPI=$!\n", line(&plan.apiserver, "kube-apiserver.log"));
    let mut pids = "$ETCD $API".to_string();
    if let Some(cm) = &plan.controller_manager {
        s += &format!("{}\nKCM=$!\n", line(cm, "kube-controller-manager.log"));
        pids += " $KCM";
    }
    s += &format!(
        r#"trap 'rm -f state.json; kill -9 {pids} 2>/dev/null' EXIT
idle=0
while kill -0 $API 2>/dev/null; do
  sleep 1
  if flock -n -x users.lock true; then idle=$((idle+1)); else idle=0; fi
  if [ "$idle" -ge {IDLE_SECONDS} ]; then
    exec 9>>create.lock
    flock -x 9
    if flock -n -x users.lock true; then exit 0; fi
    flock -u 9
    exec 9>&-
    idle=0
  fi
done
"#
    );
    s
}

fn key(bins: &Binaries) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (
        LAYOUT,
        &bins.etcd,
        &bins.apiserver,
        &bins.controller_manager,
    )
        .hash(&mut h);
    format!("{:016x}", h.finish())
}

fn lock_file(dir: &Path, name: &str) -> File {
    File::options()
        .create(true)
        .append(true)
        .open(dir.join(name))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Whether the cluster described by `state.json` answers now.
async fn alive(dir: &Path) -> Option<u16> {
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("state.json")).ok()?).ok()?;
    let port = u16::try_from(state["apiPort"].as_u64()?).ok()?;
    let client = client_from(&dir.join("admin.kubeconfig")).await;
    let req = http::Request::get("/readyz").body(Vec::new()).ok()?;
    tokio::time::timeout(Duration::from_secs(5), client.request_text(req))
        .await
        .ok()?
        .ok()?;
    Some(port)
}

pub(super) async fn join(bins: &Binaries) -> Cluster {
    let dir = target_dir().join("ferrite-kube/shared").join(key(bins));
    std::fs::create_dir_all(&dir).expect("shared cluster dir");
    let create = lock_file(&dir, "create.lock");
    let create = tokio::task::spawn_blocking(move || {
        create.lock().expect("create.lock");
        create
    })
    .await
    .expect("lock task");
    let api_port = match alive(&dir).await {
        Some(port) => port,
        None => start(bins, &dir).await,
    };
    let user = lock_file(&dir, "users.lock");
    user.lock_shared().expect("users.lock");
    drop(create);
    Cluster {
        dir,
        api_port,
        processes: Processes::default(),
        _user: Some(user),
    }
}

async fn start(bins: &Binaries, dir: &Path) -> u16 {
    // A free port can be taken by another process before etcd or the apiserver binds it; such
    // a start is seen in their logs and retried on other ports.
    for attempt in 1..=3 {
        if let Some(port) = try_start(bins, dir).await {
            return port;
        }
        eprintln!(
            "ferrite-testkit: the shared cluster lost a port race (attempt {attempt}); retrying"
        );
        // The supervisor and everything it started run with this directory in their
        // command lines.
        let _ = Command::new("pkill")
            .arg("-9")
            .arg("-f")
            .arg(dir.as_os_str())
            .status();
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    panic!(
        "the shared cluster did not start in 3 attempts:\n{}",
        super::tail(&dir.join("kube-apiserver.log"), 30)
    );
}

/// Whether etcd or the apiserver gave up at start (a port taken under it).
fn start_failed(dir: &Path) -> bool {
    let log = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    log("kube-apiserver.log").contains("\"command failed\"") || super::lost_port_race(dir)
}

async fn try_start(bins: &Binaries, dir: &Path) -> Option<u16> {
    // Whatever an earlier, dead cluster left.
    for stale in [
        "etcd-data",
        "pki",
        "state.json",
        "etcd.log",
        "kube-apiserver.log",
    ] {
        let p = dir.join(stale);
        let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
    }
    let _pki = Pki::create(&dir.join("pki"));
    let api_port = free_port();
    super::write_kubeconfigs(dir, api_port);
    let plan = plan(bins, dir, api_port, &Options::default());
    let script = dir.join("run.sh");
    std::fs::write(&script, supervisor_script(&plan)).expect("run.sh written");
    let log = File::create(dir.join("supervisor.log")).expect("supervisor log");
    // `--fork` detaches the supervisor from this test process: `setsid`
    // itself exits at once (reaped here), and the supervisor outlives us.
    let status = Command::new("setsid")
        .arg("--fork")
        .arg("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .status()
        .expect("setsid --fork bash run.sh (util-linux)");
    assert!(status.success(), "setsid --fork failed: {status}");
    let kubeconfig = dir.join("admin.kubeconfig");
    let ready = wait_ready(&kubeconfig, None, dir);
    let failed = async {
        while !start_failed(dir) {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    };
    tokio::select! {
        r = ready => if let Err(why) = r { panic!("{why}") },
        () = failed => return None,
    }
    std::fs::write(
        dir.join("state.json"),
        serde_json::json!({ "apiPort": api_port }).to_string(),
    )
    .expect("state.json written");
    Some(api_port)
}
