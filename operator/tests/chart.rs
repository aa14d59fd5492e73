//! The Helm chart (`charts/ferrite-operator`), through the real Helm SDK (PyPI
//! `helm-python-sdk`, Helm v4's Go code): it ships the generated CRDs and the dashboards byte for
//! byte, lints strictly and renders for every value set in `ci/`, every rendered object passes
//! Kubernetes' schemas (PyPI `kubernetes-validate`, strict, 1.29 and 1.32) or the Prometheus
//! Operator's and cert-manager's (npm `@kubernetes-models/*`), wrong values are refused with a
//! message naming the key, the self-signed certificate verifies for the APIService when the real
//! operator serves it, and the RBAC grants exactly the calls the real operator binary makes.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use common::chart::{NAMESPACE, chart_dir, find, helm, one, operator_args, path_str, render};
use common::operator::{ISVCS, Operator, blocking, eventually};
use common::validate::{custom_resources, kubernetes, root, temp_dir};
use ferrite_operator::fake_api::{Access, FakeApi};
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

fn secret_value(secret: &Value, key: &str) -> String {
    let b64 = secret["data"][key].as_str().expect("secret key");
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("base64"),
    )
    .expect("PEM")
}

/// The chart's self-signed pair, served by the real operator: a client that trusts only the
/// APIService's caBundle, as the API server's aggregator does, reaches the API by the Service's
/// DNS name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_apiservice_ca_bundle_verifies_the_certificate_the_operator_serves() {
    let set = chart_dir().join("ci/external-metrics-values.yaml");
    let docs = render(&set, "tls").expect("renders");
    let secret = one(&docs, "Secret");
    let api = one(&docs, "APIService");
    let ca = String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(api["spec"]["caBundle"].as_str().expect("caBundle"))
            .expect("base64"),
    )
    .expect("PEM");
    assert_eq!(
        ca,
        secret_value(secret, "ca.crt"),
        "caBundle is the Secret's CA"
    );
    let svc = api["spec"]["service"]["name"].as_str().expect("svc");
    let host = format!("{svc}.{NAMESPACE}.svc");

    let fake = FakeApi::start().await.expect("fake API");
    let op = Operator::start_with_tls(
        &fake,
        "tls",
        &["--no-leader-election"],
        &secret_value(secret, "tls.crt"),
        &secret_value(secret, "tls.key"),
    );
    let port = op.external_port;
    let url = format!("https://{host}/apis/external.metrics.k8s.io/v1beta1");
    let resolve = move |_: &str| -> std::io::Result<Vec<std::net::SocketAddr>> {
        Ok(vec![std::net::SocketAddr::from(([127, 0, 0, 1], port))])
    };
    let agent = ureq::AgentBuilder::new()
        .tls_config(std::sync::Arc::new(common::tls::client_config(&ca, None)))
        .resolver(resolve)
        .timeout(Duration::from_secs(5))
        .build();
    let body: Value = eventually(20, "the External Metrics API over TLS", || {
        let agent = agent.clone();
        let url = url.clone();
        agent.get(&url).call().ok()?.into_json().ok()
    })
    .await;
    assert_eq!(body["groupVersion"], "external.metrics.k8s.io/v1beta1");
    // A name the certificate does not carry is refused: the check is real.
    let wrong =
        format!("https://ferrite-elsewhere.{NAMESPACE}.svc/apis/external.metrics.k8s.io/v1beta1");
    let err = blocking(move || agent.get(&wrong).call().err()).await;
    assert!(err.is_some(), "a wrong host name was accepted");
}

/// One RBAC rule with where it applies: everywhere (ClusterRoleBinding) or in one namespace.
#[derive(Debug)]
struct Grant {
    namespace: Option<String>,
    groups: Vec<String>,
    resources: Vec<String>,
    verbs: Vec<String>,
    names: Vec<String>,
    origin: String,
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn covers(list: &[String], item: &str) -> bool {
    list.iter().any(|x| x == "*" || x == item)
}

impl Grant {
    fn allows(&self, a: &Access) -> bool {
        let scope_ok = match &self.namespace {
            None => true,
            Some(ns) => a.namespace.as_deref() == Some(ns.as_str()),
        };
        scope_ok
            && covers(&self.groups, &a.group)
            && covers(&self.resources, &a.resource)
            && covers(&self.verbs, &a.verb)
            && (self.names.is_empty() || a.name.as_ref().is_some_and(|n| self.names.contains(n)))
    }
}

/// The rules bound to the operator's ServiceAccount in the rendered chart.
fn operator_grants(docs: &[Value]) -> Vec<Grant> {
    let sa = one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .expect("serviceAccountName")
        .to_string();
    let role = |kind: &str, name: &str, ns: Option<&str>| {
        docs.iter().find(|d| {
            d["kind"] == kind
                && d["metadata"]["name"] == name
                && ns.is_none_or(|n| d["metadata"]["namespace"] == n)
        })
    };
    let mut grants = Vec::new();
    for binding in docs
        .iter()
        .filter(|d| d["kind"] == "ClusterRoleBinding" || d["kind"] == "RoleBinding")
    {
        let bound = binding["subjects"].as_array().is_some_and(|s| {
            s.iter().any(|s| {
                s["kind"] == "ServiceAccount"
                    && s["name"] == sa.as_str()
                    && s["namespace"] == NAMESPACE
            })
        });
        if !bound {
            continue;
        }
        let binding_ns = binding["metadata"]["namespace"].as_str();
        let ref_kind = binding["roleRef"]["kind"].as_str().expect("roleRef.kind");
        let ref_name = binding["roleRef"]["name"].as_str().expect("roleRef.name");
        let r = role(
            ref_kind,
            ref_name,
            if ref_kind == "Role" { binding_ns } else { None },
        )
        .unwrap_or_else(|| panic!("{ref_kind} {ref_name} is bound but not in the chart"));
        for rule in r["rules"].as_array().expect("rules") {
            grants.push(Grant {
                namespace: binding_ns.map(String::from),
                groups: strings(&rule["apiGroups"]),
                resources: strings(&rule["resources"]),
                verbs: strings(&rule["verbs"]),
                names: strings(&rule["resourceNames"]),
                origin: format!("{ref_kind} {ref_name}"),
            });
        }
    }
    grants
}

fn isvc(spec: Value) -> Value {
    json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "chat", "namespace": "ml"}, "spec": spec})
}

/// Drives the real operator through every code path that calls the API: leader election,
/// reconcile with a claim, every child kind, status, events, a scale by the autoscaler, a switch
/// to HPA mode, pruning every optional child, deletion, and the Lease's release on SIGTERM.
async fn record_operator_traffic() -> Vec<Access> {
    let api = FakeApi::start().await.expect("fake API");
    api.set_service_monitor_crd(true);
    api.set_simulate_rollouts(true);
    api.put(
        "/api/v1/namespaces/ml/persistentvolumeclaims",
        json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
               "metadata": {"name": "weights", "namespace": "ml"},
               "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}),
    )
    .expect("claim");
    let dashboards = temp_dir("rbac-dashboards");
    std::fs::write(
        dashboards.join("overview.json"),
        json!({"title": "Overview", "panels": [], "templating": {"list": []}}).to_string(),
    )
    .expect("dashboard");
    let mut op = Operator::start(
        &api,
        "rbac",
        &[
            "--lease-namespace",
            NAMESPACE,
            "--dashboards-dir",
            path_str(&dashboards),
        ],
    );
    let path = format!("{ISVCS}/chat");
    let full = json!({"model": {"source": "pvc://weights/m.gguf"}, "replicas": 2,
        "monitoring": {"serviceMonitor": {"enabled": true}, "dashboards": {"enabled": true}},
        "autoscaling": {"mode": "Builtin", "minReplicas": 3, "maxReplicas": 4,
            "targets": {"queuePerReplica": 4.0, "kvCacheUsage": 0.8}}});
    api.put(ISVCS, isvc(full.clone())).expect("create");
    let exists = |p: &str| api.get(p).is_some();
    let monitor = "/apis/monitoring.coreos.com/v1/namespaces/ml/servicemonitors/chat";
    let pdb = "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/chat";
    let hpa = "/apis/autoscaling/v2/namespaces/ml/horizontalpodautoscalers/chat";
    eventually(40, "children, status and a scale to minReplicas", || {
        let obj = api.get(&path)?;
        (obj["spec"]["replicas"] == 3
            && obj["status"]["conditions"].is_array()
            && exists(monitor)
            && exists(pdb)
            && !api.list("/api/v1/namespaces/ml/configmaps").is_empty())
        .then_some(())
    })
    .await;
    let mut hpa_spec = full.clone();
    hpa_spec["autoscaling"]["mode"] = json!("HPA");
    hpa_spec["replicas"] = json!(3);
    api.put(ISVCS, isvc(hpa_spec)).expect("to HPA mode");
    eventually(30, "the HPA", || exists(hpa).then_some(())).await;
    api.put(
        ISVCS,
        isvc(json!({"model": {"source": "pvc://weights/m.gguf"}, "replicas": 1,
            "monitoring": {"serviceMonitor": {"enabled": false}, "dashboards": {"enabled": false}}})),
    )
    .expect("to the minimum");
    eventually(30, "optional children pruned", || {
        (!exists(hpa)
            && !exists(monitor)
            && !exists(pdb)
            && api.list("/api/v1/namespaces/ml/configmaps").is_empty())
        .then_some(())
    })
    .await;
    // Another Deployment update: the same event again, which the recorder patches as a series.
    api.put(
        ISVCS,
        isvc(json!({"model": {"source": "pvc://weights/m.gguf"}, "replicas": 2,
            "monitoring": {"serviceMonitor": {"enabled": false}, "dashboards": {"enabled": false}}})),
    )
    .expect("replicas 2");
    let events = "/apis/events.k8s.io/v1/namespaces/ml/events";
    eventually(30, "an event series", || {
        api.list(events)
            .iter()
            .any(|e| e["series"]["count"].as_i64().is_some_and(|c| c >= 2))
            .then_some(())
    })
    .await;
    assert!(api.delete(&path), "deleted");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status = blocking(move || {
        let s = op.terminate();
        drop(op);
        s
    })
    .await;
    assert!(status.success(), "the operator exits 0 on SIGTERM");
    let lease = api
        .get(&format!(
            "/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/ferrite-operator-leader"
        ))
        .expect("the Lease");
    assert!(
        lease["spec"]["holderIdentity"].is_null() || lease["spec"]["holderIdentity"] == "",
        "the Lease was released: {lease}"
    );
    api.accesses()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_grants_exactly_the_api_calls_the_operator_makes() {
    let accesses = record_operator_traffic().await;
    let (resource, discovery): (Vec<&Access>, Vec<&Access>) =
        accesses.iter().partition(|a| !a.resource.is_empty());
    // Discovery is allowed to every authenticated client (system:discovery); nothing else may go
    // outside resources.
    for d in &discovery {
        let p = d.name.as_deref().unwrap_or("");
        assert!(
            d.verb == "get" && (p.starts_with("/api/") || p.starts_with("/apis/")),
            "a non-resource request RBAC would refuse: {d:?}"
        );
    }
    let used: BTreeSet<(String, String, String, Option<String>)> = resource
        .iter()
        .map(|a| {
            (
                a.group.clone(),
                a.resource.clone(),
                a.verb.clone(),
                a.namespace.clone(),
            )
        })
        .collect();
    let set = chart_dir().join("ci/default-values.yaml");
    let docs = render(&set, "rbac").expect("renders");
    let grants = operator_grants(&docs);
    assert!(
        !grants.is_empty(),
        "no rules bound to the operator's ServiceAccount"
    );
    let denied: Vec<String> = resource
        .iter()
        .filter(|a| !grants.iter().any(|g| g.allows(a)))
        .map(|a| format!("{} {}/{} in {:?}", a.verb, a.group, a.resource, a.namespace))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    assert!(
        denied.is_empty(),
        "the chart's RBAC refuses calls the operator makes:\n{}\n(all calls: {used:#?})",
        denied.join("\n")
    );
    // Least privilege: every verb of every rule was used by some call.
    let mut unused = Vec::new();
    for g in &grants {
        for group in &g.groups {
            for res in &g.resources {
                for verb in &g.verbs {
                    let hit = resource.iter().any(|a| {
                        &a.group == group && &a.resource == res && &a.verb == verb && g.allows(a)
                    });
                    if !hit {
                        unused.push(format!("{verb} {group}/{res} ({})", g.origin));
                    }
                }
            }
        }
    }
    assert!(
        unused.is_empty(),
        "the chart grants what the operator never calls:\n{}\n(all calls: {used:#?})",
        unused.join("\n")
    );
    eprintln!(
        "{} API calls, {} distinct (group, resource, verb, namespace), all granted; {} rules, all used",
        accesses.len(),
        used.len(),
        grants.len()
    );
}

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
