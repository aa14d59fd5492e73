//! The workspace's layering (docs/architecture.md), checked on what cargo resolves and on the
//! sources: a break fails here, not in review.
//! - `ferrite-runtime` pulls in no HTTP, no Prometheus, no Kubernetes and no tokio networking;
//! - no production crate depends on a sibling above it, nor on `ferrite-testkit` or the
//!   workspace's suites (`ferrite-tests`); the router, operator and server meet only in
//!   `ferrite-api`, and the server takes it without `kube`;
//! - inside the runtime, `kv` imports neither `model` nor `engine`, and `model` does not import
//!   `engine`; inside the server, `metrics` does not import `api`;
//! - in no crate do the top-level modules import each other in a circle, nor any two modules
//!   at any depth.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use ferrite_testkit::kube::workspace_root;
use serde_json::Value;

pub(crate) fn metadata() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked"])
        .arg("--manifest-path")
        .arg(workspace_root().join("Cargo.toml"))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata JSON")
}

/// The resolved graph: package id → (name, ids of its normal (non-dev, non-build) deps).
struct Graph {
    names: HashMap<String, String>,
    normal: HashMap<String, Vec<String>>,
    packages: HashMap<String, Value>,
}

impl Graph {
    fn load() -> Self {
        let m = metadata();
        let mut names = HashMap::new();
        let mut packages = HashMap::new();
        for p in m["packages"].as_array().expect("packages") {
            let id = p["id"].as_str().expect("id").to_string();
            names.insert(id.clone(), p["name"].as_str().expect("name").to_string());
            packages.insert(id, p.clone());
        }
        let mut normal = HashMap::new();
        for node in m["resolve"]["nodes"].as_array().expect("resolve") {
            let deps = node["deps"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|d| {
                    d["dep_kinds"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|k| k["kind"].is_null())
                })
                .map(|d| d["pkg"].as_str().expect("pkg").to_string())
                .collect();
            normal.insert(node["id"].as_str().expect("id").to_string(), deps);
        }
        Self {
            names,
            normal,
            packages,
        }
    }

    fn id(&self, name: &str) -> String {
        self.names
            .iter()
            .find(|(_, n)| n.as_str() == name)
            .map(|(id, _)| id.clone())
            .unwrap_or_else(|| panic!("no package {name}"))
    }

    /// Ids of everything `name` needs to build and run (normal deps, transitively).
    fn closure(&self, name: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![self.id(name)];
        while let Some(id) = todo.pop() {
            for d in self.normal.get(&id).into_iter().flatten() {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    }

    fn closure_names(&self, name: &str) -> BTreeSet<String> {
        self.closure(name)
            .iter()
            .map(|id| self.names[id].clone())
            .collect()
    }
}

#[test]
fn the_runtime_has_no_http_prometheus_kubernetes_or_tokio_networking() {
    let g = Graph::load();
    let deps = g.closure_names("ferrite-runtime");
    assert!(deps.contains("candle-core"), "the walk found {deps:?}");
    for banned in [
        "axum",
        "hyper",
        "prometheus",
        "kube",
        "k8s-openapi",
        "ferrite-server",
        "ferrite-operator",
        "ferrite-testkit",
    ] {
        assert!(
            !deps.contains(banned),
            "ferrite-runtime depends on {banned}"
        );
    }
    // Features unify across the workspace (the resolved tokio carries the server's `net`), so
    // check what each crate in the runtime's closure, and the runtime itself, asks of tokio.
    let mut askers = g.closure("ferrite-runtime");
    askers.insert(g.id("ferrite-runtime"));
    for id in askers {
        let p = &g.packages[&id];
        for d in p["dependencies"].as_array().into_iter().flatten() {
            if d["name"] != "tokio" || !d["kind"].is_null() {
                continue;
            }
            let features: Vec<&str> = d["features"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            assert!(
                d["uses_default_features"] == false
                    && !features
                        .iter()
                        .any(|f| ["net", "full", "process", "signal"].contains(f)),
                "{} asks tokio for {features:?} (default features: {})",
                p["name"],
                d["uses_default_features"]
            );
        }
    }
}

#[test]
fn production_crates_depend_only_downward_and_never_on_test_support() {
    let g = Graph::load();
    let cases = [
        (
            "ferrite-runtime",
            &["ferrite-server", "ferrite-operator", "ferrite-router"][..],
        ),
        (
            "ferrite-server",
            &["ferrite-operator", "ferrite-router"][..],
        ),
        (
            "ferrite-operator",
            &["ferrite-server", "ferrite-runtime", "ferrite-router"][..],
        ),
        // The router reads the contract crate; it runs no controller and serves no model.
        (
            "ferrite-router",
            &["ferrite-server", "ferrite-runtime", "ferrite-operator"][..],
        ),
        // Listener hardening is a leaf the server and the router serve through.
        (
            "ferrite-net",
            &[
                "ferrite-server",
                "ferrite-operator",
                "ferrite-router",
                "ferrite-runtime",
                "ferrite-api",
            ][..],
        ),
        // What crosses a process boundary is a leaf every binary reads.
        (
            "ferrite-api",
            &[
                "ferrite-server",
                "ferrite-operator",
                "ferrite-router",
                "ferrite-runtime",
                "ferrite-net",
            ][..],
        ),
    ];
    for (krate, above) in cases {
        let deps = g.closure_names(krate);
        for a in above
            .iter()
            .chain(&["ferrite-testkit", "ferrite-bench", "ferrite-tests"])
        {
            assert!(!deps.contains(*a), "{krate} depends on {a}");
        }
    }
    assert!(
        g.closure_names("ferrite-server")
            .contains("ferrite-runtime")
    );
    for binary in ["ferrite-server", "ferrite-operator", "ferrite-router"] {
        assert!(
            g.closure_names(binary).contains("ferrite-api"),
            "{binary} reads the contract crate"
        );
    }
    // The operator's `test-support` (hand-filled watch caches) is only ever a dev-dependency's
    // feature: no crate builds it into a binary or library. The workspace's suites run the
    // binaries and need it not at all, as a dev-dependency either.
    for p in g.packages.values() {
        for d in p["dependencies"].as_array().into_iter().flatten() {
            let asks = d["features"]
                .as_array()
                .is_some_and(|f| f.iter().any(|f| f == "test-support"));
            assert!(
                !(asks && d["kind"].is_null()),
                "{} takes {}'s test-support as a normal dependency",
                p["name"],
                d["name"]
            );
            assert!(
                !(asks && p["name"] == "ferrite-tests"),
                "ferrite-tests takes {}'s test-support",
                d["name"]
            );
        }
    }
    // The server asks the contract for none of its Kubernetes parts (the resolved graph unifies
    // features across the workspace, so the ask is checked, as for tokio above).
    let server = &g.packages[&g.id("ferrite-server")];
    let api = server["dependencies"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|d| d["name"] == "ferrite-api")
        .expect("ferrite-server depends on ferrite-api");
    assert_eq!(api["uses_default_features"], false, "{api}");
    assert_eq!(api["features"], serde_json::json!([]), "{api}");
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out
}

/// The name at the start of `s` (a path segment).
fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The modules `text` names after `crate::`, grouped imports (`crate::{a, b::c}`) included.
fn crate_modules(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + 7..];
        match rest.strip_prefix('{') {
            Some(group) => out.extend(
                group[..group.find('}').unwrap_or(group.len())]
                    .split(',')
                    .map(|item| ident(item.trim())),
            ),
            None => out.push(ident(rest)),
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

/// Every `crate::<module>` path in the `.rs` files under `dir`, as (file, module).
fn crate_paths(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for path in rust_files(dir) {
        let text = std::fs::read_to_string(&path).expect("read source");
        for module in crate_modules(&text) {
            out.push((path.display().to_string(), module));
        }
    }
    out
}

#[test]
fn modules_import_only_downward() {
    let root = workspace_root();
    let rules = [
        ("runtime/src/kv", &["model", "engine"][..]),
        ("runtime/src/model", &["engine"][..]),
        ("server/src/metrics", &["api"][..]),
    ];
    for (dir, banned) in rules {
        let paths = crate_paths(&root.join(dir));
        let bad: Vec<_> = paths
            .iter()
            .filter(|(_, m)| banned.contains(&m.as_str()))
            .collect();
        assert!(bad.is_empty(), "{dir} imports upward: {bad:?}");
    }
    // The check reads real imports: the engine does import the model.
    assert!(
        crate_paths(&root.join("runtime/src/engine"))
            .iter()
            .any(|(_, m)| m == "model")
    );
}

/// The import graph of one crate's top-level modules: module → the modules its files name in
/// `crate::` paths (grouped `crate::{a, b::c}` imports included). `lib.rs`, `main.rs` and
/// `bin/` are the crate roots and wiring, not modules.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in rust_files(src) {
        let rel = path.strip_prefix(src).expect("under src");
        let first = rel
            .components()
            .next()
            .map(|c| {
                c.as_os_str()
                    .to_string_lossy()
                    .trim_end_matches(".rs")
                    .to_string()
            })
            .expect("a component");
        if ["lib", "main", "bin"].contains(&first.as_str()) {
            continue;
        }
        let text = code_text(&path);
        let edges = graph.entry(first.clone()).or_default();
        edges.extend(crate_modules(&text).into_iter().filter(|m| *m != first));
    }
    graph
}

/// A cycle in `graph`, if there is one, as the path that closes it.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|p| p == node) {
            let mut cycle = path[start..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, done, path) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut done, &mut Vec::new()))
}

#[test]
fn no_crate_has_an_import_circle_between_its_modules() {
    let root = workspace_root();
    for (krate, a_real_edge) in [
        ("runtime", ("engine", "model")),
        ("server", ("api", "metrics")),
        ("operator", ("controller", "build")),
    ] {
        let graph = module_graph(&root.join(krate).join("src"));
        // The walk reads real imports: an edge every crate has.
        assert!(
            graph
                .get(a_real_edge.0)
                .is_some_and(|e| e.contains(a_real_edge.1)),
            "{krate}: expected {} → {} in {graph:?}",
            a_real_edge.0,
            a_real_edge.1
        );
        assert_eq!(
            find_cycle(&graph),
            None,
            "{krate}'s modules import in a circle"
        );
    }
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(
        find_cycle(&graph),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
}

/// A crate's modules at every depth, as `a::b` paths (a file `a/b.rs` or `a/b/mod.rs`),
/// with the `.rs` file of each. `lib.rs`, `main.rs` and `bin/` are roots and wiring.
fn file_modules(src: &Path) -> BTreeMap<String, PathBuf> {
    rust_files(src)
        .into_iter()
        .filter_map(|path| {
            let rel = path.strip_prefix(src).ok()?.with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            let root = parts.first().map(String::as_str);
            if parts.len() == 1 && matches!(root, Some("lib" | "main")) || root == Some("bin") {
                return None;
            }
            Some((parts.join("::"), path))
        })
        .collect()
}

/// A file's lines without its comments, which may name modules without importing them.
fn code_text(path: &Path) -> String {
    std::fs::read_to_string(path)
        .expect("read source")
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// The code of a file that counts as imports: no comments, no `#[cfg(test)] mod tests`.
fn import_text(path: &Path) -> String {
    let text = code_text(path);
    match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

/// Every path in `text` that starts at `crate`, `super` or `self`, as its segments (the first
/// segment of each item of a `{...}` group after it included).
fn relative_paths(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    for start in ["crate::", "super::", "self::"] {
        for (i, _) in text.match_indices(start) {
            if i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_') {
                continue;
            }
            let mut segs = vec![start.trim_end_matches("::").to_string()];
            let mut rest = &text[i + start.len()..];
            loop {
                if let Some(group) = rest.strip_prefix('{') {
                    let group = &group[..group.find('}').unwrap_or(group.len())];
                    for item in group.split(',') {
                        let mut with = segs.clone();
                        with.extend(item.trim().split("::").map(ident).filter(|s| !s.is_empty()));
                        out.push(with);
                    }
                    break;
                }
                let seg = ident(rest);
                if seg.is_empty() {
                    out.push(segs);
                    break;
                }
                rest = &rest[seg.len()..];
                segs.push(seg);
                match rest.strip_prefix("::") {
                    Some(r) => rest = r,
                    None => {
                        out.push(segs);
                        break;
                    }
                }
            }
        }
    }
    out
}

/// The module a path from module `from` lands in: the longest prefix that is a module.
fn resolve(
    from: &[String],
    path: &[String],
    modules: &BTreeMap<String, PathBuf>,
) -> Option<String> {
    let (mut base, mut rest) = match path.first().map(String::as_str) {
        Some("crate") => (Vec::new(), &path[1..]),
        _ => (from.to_vec(), path),
    };
    while let Some(first) = rest.first() {
        match first.as_str() {
            "super" => {
                base.pop();
            }
            "self" => {}
            _ => break,
        }
        rest = &rest[1..];
    }
    (0..=rest.len()).rev().find_map(|n| {
        let mut m = base.clone();
        m.extend(rest[..n].iter().cloned());
        let m = m.join("::");
        modules.contains_key(&m).then_some(m)
    })
}

/// The import graph of every module of a crate, at any depth. A module using its own
/// submodules (a `mod.rs` declaring and re-exporting its children) is not an edge: the
/// parent organizes its children; circles are between modules neither of which contains the
/// other.
fn file_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = file_modules(src);
    let mut graph = BTreeMap::new();
    for (name, path) in &modules {
        let from: Vec<String> = name.split("::").map(String::from).collect();
        let edges: BTreeSet<String> = relative_paths(&import_text(path))
            .iter()
            .filter_map(|p| resolve(&from, p, &modules))
            .filter(|to| to != name && !to.starts_with(&format!("{name}::")))
            .collect();
        graph.insert(name.clone(), edges);
    }
    graph
}

/// The `src/` folder of every crate of the workspace that has one, as cargo lists its members
/// (`ferrite-tests` is test binaries only).
fn workspace_sources() -> Vec<PathBuf> {
    let meta = metadata();
    let members: BTreeSet<&str> = meta["workspace_members"]
        .as_array()
        .expect("workspace_members")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|p| p["id"].as_str().is_some_and(|id| members.contains(id)))
        .filter_map(|p| {
            Some(
                Path::new(p["manifest_path"].as_str()?)
                    .parent()?
                    .join("src"),
            )
        })
        .filter(|src| src.is_dir())
        .collect()
}

#[test]
fn no_module_at_any_depth_imports_in_a_circle() {
    let sources = workspace_sources();
    assert!(sources.len() >= 8, "the walk found {sources:?}");
    let mut walked = 0;
    for src in sources {
        let graph = file_graph(&src);
        walked += usize::from(!graph.is_empty());
        assert_eq!(
            find_cycle(&graph),
            None,
            "{}'s modules import in a circle",
            src.display()
        );
    }
    // Every crate but the single-file ones has modules to walk.
    assert!(walked >= 7, "modules found in {walked} crates");
}

/// The walk sees nested modules, `super::` and grouped imports: a circle planted two levels
/// down is found, and an import of a child by its parent is not one.
#[test]
fn the_file_graph_catches_a_planted_nested_circle() {
    let dir = ferrite_testkit::process::TempDir::new("planted-circle");
    let src = dir.path();
    let write = |rel: &str, text: &str| {
        let p = src.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("dir");
        std::fs::write(p, text).expect("write");
    };
    write("lib.rs", "pub mod engine;\n");
    write(
        "engine/mod.rs",
        "pub mod core;\npub mod output;\npub use self::core::Request;\n",
    );
    write(
        "engine/core.rs",
        "use super::output::{Out, flush};\npub struct Request;\n",
    );
    write(
        "engine/output.rs",
        "// crate::engine::core::Request in a comment is no import\npub struct Out;\npub fn flush() {}\n",
    );
    let graph = file_graph(src);
    assert_eq!(find_cycle(&graph), None, "{graph:?}");
    write(
        "engine/output.rs",
        "use crate::engine::{core::Request, mod_free};\npub struct Out;\npub fn flush() {}\n",
    );
    let graph = file_graph(src);
    let cycle = find_cycle(&graph).expect("the planted circle");
    assert!(
        cycle.contains(&"engine::core".to_string())
            && cycle.contains(&"engine::output".to_string()),
        "{cycle:?}"
    );
}
