//! Every benchmark binary builds and starts: each parses its arguments and prints its usage. This
//! test is also what makes the test build compile (and clippy lint) the benchmarks, whose own
//! code has no unit tests to run.

use std::process::Command;

#[test]
fn every_benchmark_prints_its_usage() {
    let bins = [
        ("bench-runtime", env!("CARGO_BIN_EXE_bench-runtime")),
        ("bench-kernels", env!("CARGO_BIN_EXE_bench-kernels")),
        ("bench-serve", env!("CARGO_BIN_EXE_bench-serve")),
        (
            "bench-prefix-cache",
            env!("CARGO_BIN_EXE_bench-prefix-cache"),
        ),
        ("bench-operator", env!("CARGO_BIN_EXE_bench-operator")),
        ("bench-autoscale", env!("CARGO_BIN_EXE_bench-autoscale")),
        ("bench-router", env!("CARGO_BIN_EXE_bench-router")),
    ];
    for (name, path) in bins {
        let out = Command::new(path)
            .arg("--help")
            .output()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{name} --help: {}\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("Usage:") && stdout.contains(name),
            "{name} --help printed no usage naming it:\n{stdout}"
        );
    }
}
