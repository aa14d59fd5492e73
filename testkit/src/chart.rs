//! Rendering the Helm chart with the real Helm SDK (testkit/python/chart.py), for the chart's
//! own tests (tests/it/chart.rs) and for installing it into a test cluster ([`crate::e2e`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::paths::workspace_root;
use crate::tools::python;
use crate::validate::{run_validator, temp_dir};

/// The release's namespace in every rendering.
pub const NAMESPACE: &str = "ferrite-system";

pub fn chart_dir() -> PathBuf {
    workspace_root().join("charts/ferrite-operator")
}

/// Runs testkit/python/chart.py with the project's Python (which has the Helm SDK).
pub fn helm(args: &[&str]) -> (bool, String) {
    run_validator(
        Command::new(python())
            .arg(workspace_root().join("testkit/python/chart.py"))
            .args(args),
    )
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// Renders the chart with `values` (a file merged over values.yaml) as `helm install` would;
/// returns the objects, or Helm's message.
pub fn render(values: &Path, tag: &str) -> Result<Vec<Value>, String> {
    let yaml = render_text(values, tag)?;
    let mut docs = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&yaml) {
        let v: Value = serde::Deserialize::deserialize(doc).expect("rendered YAML parses");
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

/// The rendered manifests as Helm wrote them, byte for byte.
pub fn render_text(values: &Path, tag: &str) -> Result<String, String> {
    let out = temp_dir("chart").join(format!("{tag}.yaml"));
    let (ok, text) = helm(&[
        "render",
        path_str(&chart_dir()),
        path_str(values),
        NAMESPACE,
        path_str(&out),
    ]);
    if !ok {
        return Err(text);
    }
    Ok(std::fs::read_to_string(&out).expect("rendered file"))
}

/// The NOTES.txt Helm printed for the last [`render`] tagged `tag` in this process.
pub fn notes(tag: &str) -> String {
    std::fs::read_to_string(temp_dir("chart").join(format!("{tag}.yaml.NOTES.txt")))
        .unwrap_or_else(|e| panic!("NOTES of {tag}: {e}"))
}

/// Renders with `values` given inline (JSON is YAML).
pub fn render_values(values: &Value, tag: &str) -> Vec<Value> {
    let file = temp_dir("chart").join(format!("{tag}-values.yaml"));
    std::fs::write(&file, values.to_string()).expect("values written");
    render(&file, tag).unwrap_or_else(|e| panic!("rendering the chart ({tag}): {e}"))
}

pub fn find<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

pub fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found = find(docs, kind);
    assert_eq!(found.len(), 1, "expected one {kind}, found {}", found.len());
    found[0]
}

/// The objects of `kind` labelled `app.kubernetes.io/component: component` (`operator`,
/// `router`, ...).
pub fn find_component<'a>(docs: &'a [Value], kind: &str, component: &str) -> Vec<&'a Value> {
    find(docs, kind)
        .into_iter()
        .filter(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == component)
        .collect()
}

/// The one object of `kind` of `component`.
pub fn one_component<'a>(docs: &'a [Value], kind: &str, component: &str) -> &'a Value {
    let found = find_component(docs, kind, component);
    assert_eq!(
        found.len(),
        1,
        "expected one {kind} of component {component}, found {}",
        found.len()
    );
    found[0]
}

/// The operator's Deployment.
pub fn operator_deployment(docs: &[Value]) -> &Value {
    one_component(docs, "Deployment", "operator")
}

/// ferrite-router's Deployment.
pub fn router_deployment(docs: &[Value]) -> &Value {
    one_component(docs, "Deployment", "router")
}

/// The first container's arguments of `deployment`.
pub fn container_args(deployment: &Value) -> Vec<String> {
    deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str().map(String::from))
        .collect()
}

/// Asserts that a container (as JSON) has each of `pairs` as a flag and the value after it.
pub fn assert_flag_values(container: &Value, pairs: &[[&str; 2]]) {
    let args: Vec<&str> = container["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    for pair in pairs {
        assert!(args.windows(2).any(|w| w == pair), "{pair:?} in {args:?}");
    }
}

/// The operator container's arguments.
pub fn operator_args(docs: &[Value]) -> Vec<String> {
    container_args(operator_deployment(docs))
}

/// The router container's arguments.
pub fn router_args(docs: &[Value]) -> Vec<String> {
    container_args(router_deployment(docs))
}

/// (verb, API group, resource) of every rule of the Roles and ClusterRoles bound to the
/// ServiceAccount `sa` of the release's namespace.
pub fn granted(docs: &[Value], sa: &str) -> BTreeSet<(String, String, String)> {
    // (kind, name, namespace) of each bound role: a RoleBinding's Role is in its namespace.
    let bound: Vec<(&Value, &Value, &Value)> = docs
        .iter()
        .filter(|d| {
            matches!(
                d["kind"].as_str(),
                Some("ClusterRoleBinding" | "RoleBinding")
            )
        })
        .filter(|d| {
            d["subjects"].as_array().is_some_and(|s| {
                s.iter().any(|s| {
                    s["kind"] == "ServiceAccount" && s["name"] == sa && s["namespace"] == NAMESPACE
                })
            })
        })
        .map(|d| {
            (
                &d["roleRef"]["kind"],
                &d["roleRef"]["name"],
                &d["metadata"]["namespace"],
            )
        })
        .collect();
    let mut out = BTreeSet::new();
    for role in docs.iter().filter(|d| {
        bound.iter().any(|(kind, name, ns)| {
            d["kind"] == **kind
                && d["metadata"]["name"] == **name
                && d["metadata"]["namespace"] == **ns
        })
    }) {
        for rule in role["rules"].as_array().into_iter().flatten() {
            let list = |k: &str| -> Vec<String> {
                rule[k]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            };
            for g in list("apiGroups") {
                for r in list("resources") {
                    for v in list("verbs") {
                        out.insert((v.clone(), g.clone(), r.clone()));
                    }
                }
            }
        }
    }
    out
}
