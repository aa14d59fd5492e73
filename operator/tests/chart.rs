//! The Helm chart (`charts/ferrite-operator`), through the real Helm SDK (PyPI
//! `helm-python-sdk`, Helm v4's Go code): it ships the generated CRDs and the dashboards byte for
//! byte, lints strictly and renders for every value set in `ci/`, every rendered object passes
//! Kubernetes' schemas (PyPI `kubernetes-validate`, strict, 1.29 and 1.32) or the Prometheus
//! Operator's and cert-manager's (npm `@kubernetes-models/*`), and wrong values are refused with
//! a message naming the key. Installed into a real API server, the chart is tested by the e2e
//! suites: its RBAC against the operator's audited traffic (e2e_traffic), its APIService and
//! certificate through the aggregator (e2e_scale, e2e_tls).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::chart::{NAMESPACE, chart_dir, find, helm, one, operator_args, path_str, render};
use common::validate::{custom_resources, kubernetes, root, temp_dir};
use serde_json::{Value, json};

/// Kinds whose schemas come from their CRDs' npm models, not from Kubernetes.
const CRD_KINDS: [&str; 4] = ["ServiceMonitor", "PrometheusRule", "Certificate", "Issuer"];

fn value_sets() -> Vec<PathBuf> {
    let mut sets: Vec<PathBuf> = std::fs::read_dir(chart_dir().join("ci"))
        .expect("charts/ferrite-operator/ci")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with("-values.yaml"))
        .collect();
    sets.sort();
    sets
}

fn set_name(p: &Path) -> String {
    p.file_name()
        .map(|n| {
            n.to_string_lossy()
                .trim_end_matches("-values.yaml")
                .to_string()
        })
        .unwrap_or_default()
}

/// Files under `dir` with their bytes, by file name.
fn files(dir: &Path, ext: &str) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == ext))
                .map(|p| {
                    (
                        p.file_name()
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_default(),
                        std::fs::read(&p).expect("readable"),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn the_chart_ships_the_generated_crds_and_the_dashboards_byte_for_byte() {
    let fix = "run scripts/sync-chart.sh";
    // What Helm itself installs from crds/, as it loads them.
    let loaded = temp_dir("chart-crds").join("crds");
    let (ok, text) = helm(&["crds", path_str(&chart_dir()), path_str(&loaded)]);
    assert!(ok, "Helm could not load the chart's CRDs:\n{text}");
    let source = files(&root().join("crds"), "yaml");
    assert!(!source.is_empty(), "crds/ is empty");
    assert_eq!(
        files(&loaded, "yaml"),
        source,
        "the chart's CRDs differ from crds/: {fix}"
    );
    let dashboards = files(&root().join("dashboards"), "json");
    assert_eq!(
        files(&chart_dir().join("files/dashboards"), "json"),
        dashboards,
        "the chart's dashboards differ from dashboards/: {fix}"
    );
    let alerts = root().join("dashboards/alerts.yaml");
    let copy = chart_dir().join("files/alerts.yaml");
    assert_eq!(
        std::fs::read(&copy).ok(),
        std::fs::read(&alerts).ok(),
        "the chart's files/alerts.yaml differs from dashboards/alerts.yaml: {fix}"
    );
}

/// Validates the rendered objects: Kubernetes kinds with kubernetes-validate (strict, 1.29 and
/// 1.32), the rest with their CRDs' npm models.
fn validate_objects(docs: &[Value], tag: &str) {
    let dir = temp_dir(&format!("chart-{tag}"));
    let (crd_objects, k8s_objects): (Vec<&Value>, Vec<&Value>) = docs
        .iter()
        .partition(|d| CRD_KINDS.contains(&d["kind"].as_str().unwrap_or("")));
    let k8s_file = dir.join("k8s.yaml");
    let text: String = k8s_objects
        .iter()
        .map(|d| format!("---\n{}", serde_yaml_ng::to_string(d).expect("yaml")))
        .collect();
    std::fs::write(&k8s_file, text).expect("write");
    for version in ["1.29.0", "1.32.0"] {
        let (ok, out) = kubernetes(version, std::slice::from_ref(&k8s_file));
        assert!(ok, "{tag}: Kubernetes {version} rejects the chart:\n{out}");
        assert_eq!(
            out.lines().filter(|l| l.starts_with("ok")).count(),
            k8s_objects.len(),
            "{tag}: not every object was validated:\n{out}"
        );
    }
    if crd_objects.is_empty() {
        return;
    }
    let paths: Vec<PathBuf> = crd_objects
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let p = dir.join(format!("crd-object-{i}.json"));
            std::fs::write(&p, d.to_string()).expect("write");
            p
        })
        .collect();
    let (ok, out) = custom_resources(&paths);
    assert!(ok, "{tag}: a custom resource is invalid:\n{out}");
    assert_eq!(
        out.lines().filter(|l| l.starts_with("ok")).count(),
        crd_objects.len(),
        "{tag}: not every custom resource was validated:\n{out}"
    );
}

#[test]
fn every_value_set_lints_strictly_and_renders_objects_that_pass_their_schemas() {
    let sets = value_sets();
    let names: Vec<String> = sets.iter().map(|p| set_name(p)).collect();
    for wanted in ["default", "monitoring-off", "ha", "external-metrics"] {
        assert!(
            names.iter().any(|n| n == wanted),
            "ci/{wanted}-values.yaml is missing"
        );
    }
    for set in &sets {
        let tag = set_name(set);
        for kube in ["1.29.0", "1.32.0"] {
            let (ok, out) = helm(&[
                "lint",
                path_str(&chart_dir()),
                path_str(set),
                NAMESPACE,
                kube,
            ]);
            assert!(
                ok,
                "{tag}: helm lint --strict (Kubernetes {kube}) fails:\n{out}"
            );
        }
        let docs = render(set, &tag).unwrap_or_else(|e| panic!("{tag}: render failed:\n{e}"));
        validate_objects(&docs, &tag);
        check_value_set(&tag, &docs);
    }
}

/// What each value set must and must not produce.
fn check_value_set(tag: &str, docs: &[Value]) {
    let args = operator_args(docs);
    let has_arg = |a: &str| {
        args.iter()
            .any(|x| x == a || x.starts_with(&format!("{a}=")))
    };
    let deployment = one(docs, "Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    // Everywhere: non-root, read-only, no privilege escalation, probes on the operator's port.
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{tag}");
    let c = &pod["containers"][0];
    assert_eq!(
        c["securityContext"]["readOnlyRootFilesystem"], true,
        "{tag}"
    );
    assert_eq!(
        c["securityContext"]["allowPrivilegeEscalation"], false,
        "{tag}"
    );
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz", "{tag}");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz", "{tag}");
    assert_eq!(
        pod["serviceAccountName"],
        one(docs, "ServiceAccount")["metadata"]["name"],
        "{tag}"
    );
    let sidecar_dashboards: Vec<_> = find(docs, "ConfigMap")
        .into_iter()
        .filter(|c| c["metadata"]["labels"]["grafana_dashboard"] == "1")
        .collect();
    let dashboard_count = files(&root().join("dashboards"), "json").len();
    match tag {
        "default" => {
            assert_eq!(deployment["spec"]["replicas"], 1);
            assert!(has_arg("--lease-name"), "{args:?}");
            assert!(has_arg("--external-metrics-addr=off"), "{args:?}");
            assert!(find(docs, "APIService").is_empty());
            assert!(find(docs, "PodDisruptionBudget").is_empty());
            // Offline, the Prometheus Operator's API is not there: `auto` makes no monitors.
            assert!(find(docs, "ServiceMonitor").is_empty());
            assert!(find(docs, "PrometheusRule").is_empty());
            assert_eq!(sidecar_dashboards.len(), dashboard_count);
            assert!(has_arg("--dashboards-dir"), "{args:?}");
        }
        "monitoring-off" => {
            assert!(find(docs, "ServiceMonitor").is_empty());
            assert!(find(docs, "PrometheusRule").is_empty());
            assert!(find(docs, "ConfigMap").is_empty(), "no dashboards");
            assert!(!has_arg("--dashboards-dir"), "{args:?}");
        }
        "monitoring-on" => {
            let sm = one(docs, "ServiceMonitor");
            assert_eq!(sm["metadata"]["labels"]["release"], "kube-prometheus-stack");
            assert_eq!(sm["spec"]["endpoints"][0]["port"], "http-metrics");
            assert_eq!(sm["spec"]["endpoints"][0]["honorLabels"], true);
            // The monitor selects the operator's metrics Service, not the HTTPS one.
            let svc = find(docs, "Service")
                .into_iter()
                .find(|s| {
                    sm["spec"]["selector"]["matchLabels"]
                        .as_object()
                        .expect("matchLabels")
                        .iter()
                        .all(|(k, v)| &s["metadata"]["labels"][k] == v)
                })
                .expect("a Service the ServiceMonitor selects");
            assert_eq!(svc["spec"]["ports"][0]["name"], "http-metrics");
            let rule = one(docs, "PrometheusRule");
            let alerts: Value = serde_yaml_ng::from_str(
                &std::fs::read_to_string(root().join("dashboards/alerts.yaml"))
                    .expect("dashboards/alerts.yaml"),
            )
            .expect("alerts.yaml parses");
            assert_eq!(
                rule["spec"]["groups"], alerts["groups"],
                "the alerts, unchanged"
            );
            assert_eq!(sidecar_dashboards.len(), dashboard_count);
            for d in &sidecar_dashboards {
                assert_eq!(d["metadata"]["namespace"], "monitoring");
                assert_eq!(d["metadata"]["annotations"]["grafana_folder"], "LLM");
                let (_, json) = d["data"]
                    .as_object()
                    .and_then(|m| m.iter().next())
                    .expect("one dashboard");
                let parsed: Value =
                    serde_json::from_str(json.as_str().expect("text")).expect("dashboard JSON");
                assert!(parsed["title"].is_string(), "a dashboard with a title");
            }
        }
        "ha" | "cert-manager" => {
            assert_eq!(deployment["spec"]["replicas"], 2);
            assert!(has_arg("--lease-name"), "{args:?}");
            assert!(!has_arg("--no-leader-election"), "{args:?}");
            let pdb = one(docs, "PodDisruptionBudget");
            assert_eq!(pdb["spec"]["maxUnavailable"], 1);
            assert_eq!(one(docs, "Role")["rules"][0]["resources"][0], "leases");
            if tag == "cert-manager" {
                let cert = one(docs, "Certificate");
                let api = one(docs, "APIService");
                assert_eq!(
                    api["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
                    format!(
                        "{NAMESPACE}/{}",
                        cert["metadata"]["name"].as_str().expect("name")
                    )
                );
                assert!(
                    api["spec"]["caBundle"].is_null(),
                    "cert-manager fills caBundle"
                );
                assert!(has_arg("--client-ca-file"), "{args:?}");
            }
        }
        "external-metrics" => {
            let api = one(docs, "APIService");
            assert_eq!(api["metadata"]["name"], "v1beta1.external.metrics.k8s.io");
            assert_eq!(api["spec"]["insecureSkipTLSVerify"], false);
            let svc_name = api["spec"]["service"]["name"].as_str().expect("service");
            let svc = find(docs, "Service")
                .into_iter()
                .find(|s| s["metadata"]["name"] == svc_name)
                .expect("the APIService's Service");
            assert_eq!(svc["spec"]["ports"][0]["port"], 443);
            assert!(has_arg("--external-metrics-addr=0.0.0.0:6443"), "{args:?}");
            assert!(has_arg(&format!("--service-name={svc_name}")), "{args:?}");
            let reader = find(docs, "ClusterRoleBinding")
                .into_iter()
                .find(|b| b["subjects"][0]["name"] == "horizontal-pod-autoscaler")
                .expect("the HPA controller may read external metrics");
            assert_eq!(reader["subjects"][0]["namespace"], "kube-system");
        }
        other => panic!("ci/{other}-values.yaml has no checks here: add them"),
    }
}

/// `operator/tests/chart-values/invalid-*.yaml`: each starts with `# expect: MESSAGE`, a part of
/// what Helm must answer.
#[test]
fn wrong_values_are_refused_with_a_message_naming_the_key() {
    let dir = root().join("operator/tests/chart-values");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("operator/tests/chart-values")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("invalid-"))
        })
        .collect();
    cases.sort();
    assert!(cases.len() >= 5, "at least five wrong values files");
    for file in &cases {
        let text = std::fs::read_to_string(file).expect("readable");
        let message = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{}: no `# expect:` line", file.display()));
        match render(file, &set_name(file)) {
            Ok(_) => panic!("accepted wrong values:\n{text}"),
            Err(out) => assert!(
                out.contains(message),
                "{} was refused, but the message does not say {message:?}:\n{out}",
                file.display()
            ),
        }
    }
}

/// The chart's self-signed pair, served by the real operator: a client that trusts only the
/// APIService's caBundle, as the API server's aggregator does, reaches the API by the Service's
/// DNS name.
#[test]
fn the_custom_resource_validator_rejects_broken_objects() {
    let docs = render(&chart_dir().join("ci/cert-manager-values.yaml"), "broken").expect("renders");
    let mut cert = one(&docs, "Certificate").clone();
    cert["spec"]
        .as_object_mut()
        .expect("spec")
        .remove("issuerRef");
    let mut unknown = one(&docs, "Issuer").clone();
    unknown["apiVersion"] = json!("example.com/v1");
    let dir = temp_dir("chart-broken");
    for (name, obj, why) in [
        ("cert", cert, "must have required property issuerRef"),
        ("unknown", unknown, "no model for example.com/v1"),
    ] {
        let p = dir.join(format!("{name}.json"));
        std::fs::write(&p, obj.to_string()).expect("write");
        let (ok, out) = custom_resources(std::slice::from_ref(&p));
        assert!(
            !ok && out.contains(why),
            "{name} was not rejected for {why:?}:\n{out}"
        );
    }
}
