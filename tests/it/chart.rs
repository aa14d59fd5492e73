//! The Helm chart (`charts/ferrite-operator`), through the real Helm SDK (PyPI
//! `helm-python-sdk`, Helm v4's Go code): it ships the generated CRDs and the dashboards byte for
//! byte, lints strictly and renders for every value set in `ci/`, every rendered object passes
//! Kubernetes' schemas (PyPI `kubernetes-validate`, strict, 1.29 and 1.32) or the Prometheus
//! Operator's and cert-manager's (npm `@kubernetes-models/*`), and wrong values are refused with
//! a message naming the key. Installed into a real API server, the chart is tested by the e2e
//! suites: its RBAC against the operator's audited traffic (e2e_traffic), its APIService and
//! certificate through the aggregator (e2e_scale, e2e_tls).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use ferrite_testkit::chart::{
    NAMESPACE, chart_dir, container_args, find, find_component, granted, helm, notes, one,
    one_component, operator_args, operator_deployment, path_str, render, render_text, router_args,
    router_deployment,
};
use ferrite_testkit::kube::workspace_root;
use ferrite_testkit::validate::{custom_resources, kubernetes, temp_dir};
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
    let source = files(&workspace_root().join("crds"), "yaml");
    assert!(!source.is_empty(), "crds/ is empty");
    assert_eq!(
        files(&loaded, "yaml"),
        source,
        "the chart's CRDs differ from crds/: {fix}"
    );
    let dashboards = files(&workspace_root().join("dashboards"), "json");
    assert_eq!(
        files(&chart_dir().join("files/dashboards"), "json"),
        dashboards,
        "the chart's dashboards differ from dashboards/: {fix}"
    );
    let alerts = workspace_root().join("dashboards/alerts.yaml");
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
    for wanted in [
        "default",
        "monitoring-off",
        "ha",
        "external-metrics",
        "router-off",
        "router-namespaced",
        "router-no-wake",
        "router-tenants",
        "resource-profiles",
        "keda",
    ] {
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
        check_notes(&tag, &docs);
    }
}

/// The NetworkPolicy in front of the operator's KEDA external scaler, if rendered.
fn keda_scaler_policy(docs: &[Value]) -> Option<Value> {
    find(docs, "NetworkPolicy")
        .into_iter()
        .find(|p| {
            p["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("-keda-scaler"))
        })
        .cloned()
}

/// What each value set must and must not produce.
fn check_value_set(tag: &str, docs: &[Value]) {
    let args = operator_args(docs);
    let has_arg = |a: &str| {
        args.iter()
            .any(|x| x == a || x.starts_with(&format!("{a}=")))
    };
    let deployment = operator_deployment(docs);
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
        one_component(docs, "ServiceAccount", "operator")["metadata"]["name"],
        "{tag}"
    );
    check_selectors(tag, docs);
    let router = (tag != "router-off").then(|| check_router(tag, docs));
    let sidecar_dashboards: Vec<_> = find(docs, "ConfigMap")
        .into_iter()
        .filter(|c| c["metadata"]["labels"]["grafana_dashboard"] == "1")
        .collect();
    let dashboard_count = files(&workspace_root().join("dashboards"), "json").len();
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
            assert!(!has_arg("--resource-profiles"), "no profiles, no flag");
            // KEDA's and LeaderWorkerSet's kinds are written only where the chart says so.
            assert!(
                !has_arg("--keda") && !has_arg("--leader-worker-sets"),
                "{args:?}"
            );
            // The router, as the README uses it: `port-forward svc/ferrite-router 8000:8000`,
            // cluster-wide, waking services scaled to zero.
            let router = router.expect("the router is on by default");
            assert_eq!(router.name, "ferrite-router");
            assert_eq!(
                router.args,
                [
                    "--addr=0.0.0.0:8080",
                    "--endpoints-from=endpoint-slices",
                    "--drain-delay-seconds=5"
                ]
            );
            assert_eq!(router.service["spec"]["type"], "ClusterIP");
            assert_eq!(router.service["spec"]["ports"][0]["port"], 8000);
            // The operator counts what the router's pods hold (flow control) as waiting.
            // (Compared as sets: a map's key order depends on serde_json's features.)
            let mut selector: Vec<String> = router.deployment["spec"]["selector"]["matchLabels"]
                .as_object()
                .expect("selector")
                .iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect();
            selector.sort();
            let mut given: Vec<String> = args
                .iter()
                .find_map(|a| a.strip_prefix("--router-pods="))
                .unwrap_or_else(|| panic!("no --router-pods: {args:?}"))
                .split(',')
                .map(String::from)
                .collect();
            given.sort();
            assert_eq!(given, selector);
            assert_eq!(router.role_kind, "ClusterRole");
            assert_eq!(
                router.rules,
                router_rules(true, Members::EndpointSlices, false)
            );
            let image = router.deployment["spec"]["template"]["spec"]["containers"][0]["image"]
                .as_str()
                .expect("image");
            assert!(
                image.starts_with("ghcr.io/ferrite-dev/ferrite-router:"),
                "{image}"
            );
            assert_eq!(router.deployment["spec"]["replicas"], 1);
        }
        "router-off" => {
            let routers: Vec<_> = docs
                .iter()
                .filter(|d| {
                    d["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
                        || d["metadata"]["name"]
                            .as_str()
                            .is_some_and(|n| n.contains("router"))
                })
                .map(|d| format!("{} {}", d["kind"], d["metadata"]["name"]))
                .collect();
            assert!(routers.is_empty(), "router objects: {routers:?}");
            // The operator's ServiceMonitor alone.
            assert_eq!(
                one(docs, "ServiceMonitor")["metadata"]["labels"]["app.kubernetes.io/component"],
                "operator"
            );
        }
        "router-namespaced" => {
            let router = router.expect("router");
            assert!(
                router.args.iter().any(|a| a == "--namespace=llm"),
                "{:?}",
                router.args
            );
            assert_eq!(router.role_kind, "Role");
            assert_eq!(
                router.rules,
                router_rules(true, Members::EndpointSlices, false)
            );
            // The Role and its binding live in the watched namespace, the ServiceAccount in
            // the release's; nothing cluster-wide is bound to the router.
            for kind in ["Role", "RoleBinding"] {
                let o = one_component(docs, kind, "router");
                assert_eq!(o["metadata"]["namespace"], "llm", "{kind}");
            }
            assert!(find_component(docs, "ClusterRole", "router").is_empty());
            assert!(find_component(docs, "ClusterRoleBinding", "router").is_empty());
            assert_eq!(router.deployment["spec"]["replicas"], 2);
            let pdb = one_component(docs, "PodDisruptionBudget", "router");
            assert_eq!(pdb["spec"]["maxUnavailable"], 1);
            let pod = &router.deployment["spec"]["template"]["spec"];
            assert_eq!(pod["priorityClassName"], "system-cluster-critical");
            assert_eq!(pod["nodeSelector"]["kubernetes.io/os"], "linux");
            assert_eq!(pod["tolerations"][0]["value"], "gateway");
            assert_eq!(pod["topologySpreadConstraints"][0]["maxSkew"], 1);
            assert_eq!(pod["containers"][0]["resources"]["limits"]["memory"], "1Gi");
            let meta = &router.deployment["spec"]["template"]["metadata"];
            assert_eq!(meta["labels"]["tier"], "gateway");
            assert_eq!(meta["annotations"]["example.com/team"], "llm");
            // The operator keeps one replica: only the router's PDB.
            assert_eq!(find(docs, "PodDisruptionBudget").len(), 1);
        }
        "router-tls" => {
            let router = router.expect("router");
            assert!(
                router
                    .args
                    .iter()
                    .any(|a| a == "--tls-cert-file=/etc/ferrite/tls/tls.crt")
                    && router
                        .args
                        .iter()
                        .any(|a| a == "--tls-key-file=/etc/ferrite/tls/tls.key"),
                "{:?}",
                router.args
            );
            let pod = &router.deployment["spec"]["template"]["spec"];
            assert_eq!(
                pod["volumes"][0]["secret"]["secretName"],
                "ferrite-router-tls"
            );
            let container = &pod["containers"][0];
            assert_eq!(
                container["volumeMounts"][0]["mountPath"],
                "/etc/ferrite/tls"
            );
            for probe in ["livenessProbe", "readinessProbe"] {
                assert_eq!(container[probe]["httpGet"]["scheme"], "HTTPS", "{probe}");
            }
            // cert-manager issues the Secret for the Service's names, from a self-signed issuer.
            let cert = find(docs, "Certificate")
                .into_iter()
                .find(|c| c["metadata"]["name"] == "ferrite-router")
                .expect("the router's Certificate");
            assert_eq!(cert["spec"]["secretName"], "ferrite-router-tls");
            assert!(
                cert["spec"]["dnsNames"]
                    .as_array()
                    .expect("names")
                    .contains(&json!(format!("ferrite-router.{NAMESPACE}.svc"))),
                "{cert}"
            );
            assert_eq!(
                cert["spec"]["issuerRef"]["name"],
                "ferrite-router-selfsigned"
            );
            // Prometheus scrapes it over HTTPS, verifying the certificate.
            let monitor = find_component(docs, "ServiceMonitor", "router");
            let endpoint =
                &monitor.first().expect("the router's ServiceMonitor")["spec"]["endpoints"][0];
            assert_eq!(endpoint["scheme"], "https");
            assert_eq!(
                endpoint["tlsConfig"]["ca"]["secret"],
                json!({"name": "ferrite-router-tls", "key": "ca.crt"})
            );
            assert_eq!(
                endpoint["tlsConfig"]["serverName"],
                format!("ferrite-router.{NAMESPACE}.svc")
            );
        }
        "router-tenants" => {
            let router = router.expect("router");
            // /metrics (which names every tenant) on a port and a Service of its own; the
            // operator reads the routers' queues there.
            assert!(
                router
                    .args
                    .iter()
                    .any(|a| a == "--metrics-addr=0.0.0.0:9090"),
                "{:?}",
                router.args
            );
            let ports = &router.deployment["spec"]["template"]["spec"]["containers"][0]["ports"];
            assert!(
                ports
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|p| p["name"] == "metrics" && p["containerPort"] == 9090),
                "{ports}"
            );
            let metrics_svc = find(docs, "Service")
                .into_iter()
                .find(|s| s["metadata"]["name"] == "ferrite-router-metrics")
                .expect("the router's metrics Service");
            assert_eq!(metrics_svc["spec"]["ports"][0]["targetPort"], "metrics");
            assert_eq!(
                router.service["spec"]["ports"].as_array().map(Vec::len),
                Some(1)
            );
            assert!(has_arg("--router-port=9090"), "{args:?}");
            // The router sends a spec.auth service its own key: the operator grants it `get` on
            // that Secret alone, per service, so it may write Roles and RoleBindings.
            let account = &router.deployment["spec"]["template"]["spec"]["serviceAccountName"];
            let account = format!(
                "--router-service-account={NAMESPACE}/{}",
                account.as_str().expect("the router's ServiceAccount")
            );
            assert!(has_arg(&account), "{args:?}");
            let operator_rules = &operator_cluster_role(docs)["rules"];
            assert!(
                operator_rules.as_array().into_iter().flatten().any(|r| {
                    r["apiGroups"] == json!(["rbac.authorization.k8s.io"])
                        && r["resources"] == json!(["roles", "rolebindings"])
                }),
                "{operator_rules}"
            );
            assert!(
                router.args.iter().any(|a| a == "--tenants"),
                "{:?}",
                router.args
            );
            let env = &router.deployment["spec"]["template"]["spec"]["containers"][0]["env"];
            let ns = env
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| e["name"] == "POD_NAMESPACE")
                .expect("POD_NAMESPACE: where the key Secrets are");
            assert_eq!(
                ns["valueFrom"]["fieldRef"]["fieldPath"],
                "metadata.namespace"
            );
            let name = env
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| e["name"] == "POD_NAME")
                .expect("POD_NAME: which of the --peers it is");
            assert_eq!(name["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");
            assert_eq!(
                router.rules,
                router_rules(true, Members::EndpointSlices, true)
            );
            // Tenants through a ClusterRole (cluster-scoped), Secrets only in the release's
            // namespace.
            let cluster = one_component(docs, "ClusterRole", "router-tenants");
            assert_eq!(
                cluster["rules"][0]["resources"],
                json!(["inferencetenants"])
            );
            let role = one_component(docs, "Role", "router-tenants");
            assert_eq!(role["metadata"]["namespace"], NAMESPACE);
            assert_eq!(role["rules"][0]["resources"], json!(["secrets"]));
            assert_eq!(role["rules"][1]["resources"], json!(["pods"]));
            // `--peers` selects exactly this Deployment's pods.
            let peers = router
                .args
                .iter()
                .find_map(|a| a.strip_prefix("--peers="))
                .expect("--peers");
            let wanted: serde_json::Map<String, Value> = peers
                .split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), json!(v)))
                .collect();
            assert!(!wanted.is_empty(), "{peers}");
            let labels = &router.deployment["spec"]["template"]["metadata"]["labels"];
            let wanted = Value::Object(wanted);
            assert!(selects(&wanted, labels), "{peers} vs {labels}");
            assert_eq!(
                wanted, router.deployment["spec"]["selector"]["matchLabels"],
                "the Deployment's own selector"
            );
            assert_eq!(
                one_component(docs, "RoleBinding", "router-tenants")["metadata"]["namespace"],
                NAMESPACE
            );
        }
        "router-no-wake" => {
            let router = router.expect("router");
            assert_eq!(router.name, "llm-gateway");
            assert!(
                router.args.iter().any(|a| a == "--no-wake"),
                "{:?}",
                router.args
            );
            assert_eq!(router.role_kind, "ClusterRole");
            assert_eq!(
                router.rules,
                router_rules(false, Members::Pods, false),
                "read only, pods"
            );
            assert_eq!(
                router.args,
                [
                    "--addr=0.0.0.0:8080",
                    "--endpoints-from=pods",
                    "--no-wake",
                    "--drain-delay-seconds=15",
                    "--prefix-chars=512",
                    "--epsilon=0.5"
                ]
            );
            assert_eq!(router.service["spec"]["type"], "LoadBalancer");
            assert_eq!(router.service["spec"]["ports"][0]["port"], 80);
            let pod = &router.deployment["spec"]["template"]["spec"];
            let c = &pod["containers"][0];
            assert_eq!(
                c["image"],
                "ghcr.io/ferrite-dev/ferrite-router@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
            );
            assert_eq!(c["imagePullPolicy"], "Always");
            assert_eq!(c["env"][0]["value"], "ferrite_router=debug,info");
            assert_eq!(pod["terminationGracePeriodSeconds"], 120);
            let sa = one_component(docs, "ServiceAccount", "router");
            assert_eq!(sa["metadata"]["annotations"]["example.com/role"], "gateway");
            let sm = router
                .service_monitor
                .expect("monitoring.serviceMonitor.enabled: true");
            assert_eq!(sm["metadata"]["labels"]["release"], "kube-prometheus-stack");
        }
        "monitoring-off" => {
            assert!(find(docs, "ServiceMonitor").is_empty());
            assert!(find(docs, "PrometheusRule").is_empty());
            assert!(find(docs, "ConfigMap").is_empty(), "no dashboards");
            assert!(!has_arg("--dashboards-dir"), "{args:?}");
        }
        "monitoring-on" => {
            let router_sm = router
                .and_then(|r| r.service_monitor)
                .expect("the router's ServiceMonitor");
            assert_eq!(
                router_sm["metadata"]["labels"]["release"],
                "kube-prometheus-stack"
            );
            assert_eq!(router_sm["spec"]["endpoints"][0]["interval"], "15s");
            let sm = one_component(docs, "ServiceMonitor", "operator");
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
            // monitoring.release labels every monitor and rule, and reaches the operator for
            // the monitors it makes; serviceMonitor.labels add to it.
            assert_eq!(
                rule["metadata"]["labels"]["release"],
                "kube-prometheus-stack"
            );
            assert_eq!(sm["metadata"]["labels"]["team"], "llm");
            assert_eq!(router_sm["metadata"]["labels"]["team"], "llm");
            assert!(
                args.iter()
                    .any(|a| a == "--monitor-label=release=kube-prometheus-stack"),
                "{args:?}"
            );
            let alerts: Value = serde_yaml_ng::from_str(
                &std::fs::read_to_string(workspace_root().join("dashboards/alerts.yaml"))
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
                assert!(
                    has_arg("--requestheader-allowed-names=front-proxy-client,aggregator"),
                    "{args:?}"
                );
                // A fixed CA: nothing read from kube-system.
                assert!(
                    find(docs, "RoleBinding")
                        .iter()
                        .all(|b| b["metadata"]["namespace"] != "kube-system"),
                    "no auth-reader binding with a fixed CA"
                );
            }
        }
        "external-metrics" => {
            let api = one(docs, "APIService");
            assert_eq!(api["metadata"]["name"], "v1beta1.external.metrics.k8s.io");
            assert_eq!(api["spec"]["insecureSkipTLSVerify"], false);
            // Nothing random at render time: the operator issues the certificate and sets the
            // caBundle, with exactly the rights to do so.
            assert!(api["spec"]["caBundle"].is_null(), "{api}");
            assert!(
                find(docs, "Secret").is_empty(),
                "no Secret is rendered for the serving certificate"
            );
            assert!(
                has_arg("--tls-secret=ferrite-ferrite-operator-external-metrics-tls"),
                "{args:?}"
            );
            assert!(
                !has_arg("--tls-cert-file=/etc/ferrite/tls/tls.crt"),
                "{args:?}"
            );
            let role = find(docs, "Role")
                .into_iter()
                .find(|r| {
                    r["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.ends_with("-serving-cert"))
                })
                .expect("the serving certificate's Role");
            assert_eq!(
                role["rules"][1]["resourceNames"][0],
                "ferrite-ferrite-operator-external-metrics-tls"
            );
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
            // Clients are checked against the request-header CA the operator reads from
            // kube-system, under the bootstrap policy's reader Role.
            let auth = find(docs, "RoleBinding")
                .into_iter()
                .find(|b| b["roleRef"]["name"] == "extension-apiserver-authentication-reader")
                .expect("the operator may read extension-apiserver-authentication");
            assert_eq!(auth["metadata"]["namespace"], "kube-system");
            assert_eq!(auth["subjects"][0]["namespace"], NAMESPACE);
            assert!(
                !has_arg("--client-ca-file") && !has_arg("--external-metrics-insecure-any-client"),
                "{args:?}"
            );
        }
        "lws" => {
            // LeaderWorkerSets: the operator may write them, and delete the Deployment of a
            // spec that moved to one.
            assert!(has_arg("--leader-worker-sets"), "{args:?}");
            let rules = &operator_cluster_role(docs)["rules"];
            let rule = |group: &str, resource: &str| {
                rules
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|r| {
                        r["apiGroups"] == json!([group]) && r["resources"] == json!([resource])
                    })
                    .unwrap_or_else(|| panic!("no rule for {resource}: {rules}"))
                    .clone()
            };
            for (group, resource) in [
                ("leaderworkerset.x-k8s.io", "leaderworkersets"),
                ("apps", "deployments"),
            ] {
                assert!(
                    rule(group, resource)["verbs"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|v| v == "delete"),
                    "{resource}: {rules}"
                );
            }
        }
        "keda" => {
            // ScaledObjects: the operator may write them, and knows the Prometheus to read.
            assert!(has_arg("--keda"), "{args:?}");
            assert!(
                has_arg("--keda-prometheus-address=http://prometheus-operated.monitoring.svc:9090"),
                "{args:?}"
            );
            let rules = &operator_cluster_role(docs)["rules"];
            assert!(
                rules.as_array().into_iter().flatten().any(|r| {
                    r["apiGroups"] == json!(["keda.sh"])
                        && r["resources"] == json!(["scaledobjects"])
                }),
                "{rules}"
            );
            assert!(
                keda_scaler_policy(docs).is_none(),
                "no NetworkPolicies asked for"
            );
            // KEDA serves the External Metrics API: the operator's is off.
            assert!(find(docs, "APIService").is_empty());
            // The external scaler, reached through the operator's Service.
            assert!(has_arg("--keda-scaler-addr=0.0.0.0:9443"), "{args:?}");
            let service = find(docs, "Service")
                .into_iter()
                .find(|s| s["metadata"]["labels"]["app.kubernetes.io/component"] == "operator")
                .expect("the operator's Service");
            let name = service["metadata"]["name"].as_str().expect("name");
            assert!(
                has_arg(&format!(
                    "--keda-scaler-address={name}.{NAMESPACE}.svc:9443"
                )),
                "{args:?}"
            );
            let port = service["spec"]["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["name"] == "keda-scaler")
                .expect("the keda-scaler port");
            assert_eq!(port["port"], 9443);
            assert_eq!(port["appProtocol"], "kubernetes.io/h2c");
        }
        "keda-network-policy" => {
            // Only KEDA's operator reaches the external scaler; the metrics port stays open.
            assert!(
                has_arg("--keda") && has_arg("--network-policy-peers"),
                "{args:?}"
            );
            let policy = keda_scaler_policy(docs).expect("the scaler's NetworkPolicy");
            assert_eq!(
                policy["spec"]["podSelector"]["matchLabels"],
                deployment["spec"]["selector"]["matchLabels"],
                "the operator's pods"
            );
            assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress"]));
            assert_eq!(
                policy["spec"]["ingress"],
                json!([
                    {"ports": [{"port": "http-metrics", "protocol": "TCP"}]},
                    {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}},
                               "podSelector": {"matchLabels": {"app": "keda-operator"}}}],
                     "ports": [{"port": "keda-scaler", "protocol": "TCP"}]}
                ])
            );
            let ports: Vec<&Value> = pod["containers"][0]["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .collect();
            assert_eq!(
                ports
                    .iter()
                    .map(|p| p["name"].as_str().unwrap_or_default())
                    .collect::<Vec<_>>(),
                ["http-metrics", "keda-scaler"],
                "every port the operator listens on is named by the policy"
            );
        }
        "network-policy" => {
            assert!(keda_scaler_policy(docs).is_none(), "no scaler without KEDA");
            let flag = args
                .iter()
                .find_map(|a| a.strip_prefix("--network-policy-peers="))
                .expect("--network-policy-peers");
            let peers: Vec<k8s_openapi::api::networking::v1::NetworkPolicyPeer> =
                serde_json::from_str(flag).expect("the operator's NetworkPolicyPeer list");
            let peers = serde_json::to_value(&peers).expect("json");
            let app =
                |i: usize| peers[i]["podSelector"]["matchLabels"]["app.kubernetes.io/name"].clone();
            assert_eq!(peers.as_array().map(Vec::len), Some(4), "{peers}");
            assert_eq!(app(0), "ferrite-operator");
            assert_eq!(app(1), "ferrite-router");
            assert_eq!(app(2), "prometheus");
            assert_eq!(
                peers[3]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
                "gateway"
            );
            let role = find(docs, "ClusterRole")
                .into_iter()
                .find(|r| r["metadata"]["name"] == "ferrite-ferrite-operator")
                .expect("the operator's ClusterRole");
            assert!(
                role["rules"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|r| r["resources"][0] == "networkpolicies")),
                "{role}"
            );
        }
        "resource-profiles" => {
            let flag = "--resource-profiles=/etc/ferrite/profiles/profiles.yaml";
            assert!(args.iter().any(|a| a == flag), "{args:?}");
            let cm = find(docs, "ConfigMap")
                .into_iter()
                .find(|c| {
                    c["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.ends_with("-resource-profiles"))
                })
                .expect("the profiles ConfigMap");
            // What the operator reads: its own parser, which refuses unknown keys.
            let path = temp_dir("profiles").join("profiles.yaml");
            std::fs::write(&path, cm["data"]["profiles.yaml"].as_str().expect("text"))
                .expect("write");
            let profiles =
                ferrite_operator::config::load_resource_profiles(&path).expect("profiles parse");
            assert_eq!(
                profiles.keys().map(String::as_str).collect::<Vec<_>>(),
                ["amd-mi300x", "nvidia-a100-mig", "nvidia-h100"]
            );
            assert_eq!(
                profiles["nvidia-a100-mig"].gpu_resource_name.as_deref(),
                Some("nvidia.com/mig-1g.10gb")
            );
            assert!(profiles["amd-mi300x"].affinity.is_some());
            let volume = pod["volumes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|v| v["name"] == "resource-profiles")
                .expect("the profiles volume");
            assert_eq!(volume["configMap"]["name"], cm["metadata"]["name"]);
            let annotations = &deployment["spec"]["template"]["metadata"]["annotations"];
            assert!(
                annotations["checksum/resource-profiles"].is_string(),
                "a change restarts the operator: {annotations}"
            );
        }
        other => panic!("ci/{other}-values.yaml has no checks here: add them"),
    }
}

/// NOTES.txt tells how to reach the models: through the router's Service where there is one
/// (its name and port), else through the InferenceService's own.
fn check_notes(tag: &str, docs: &[Value]) {
    let text = notes(tag);
    match find_component(docs, "Service", "router").first() {
        Some(svc) => {
            let port = &svc["spec"]["ports"][0]["port"];
            let forward = format!(
                "kubectl -n {NAMESPACE} port-forward svc/{} {port}:{port}",
                svc["metadata"]["name"].as_str().expect("name")
            );
            assert!(
                text.contains(&forward),
                "{tag}: NOTES lack {forward:?}:\n{text}"
            );
            let wakes = !router_args(docs).iter().any(|a| a == "--no-wake");
            assert_eq!(
                text.contains("scaleFromZero=false"),
                !wakes,
                "{tag}: NOTES say whether the router wakes services:\n{text}"
            );
        }
        None => {
            assert!(!text.contains("svc/ferrite-router"), "{tag}:\n{text}");
            assert!(text.contains("router.enabled=true"), "{tag}:\n{text}");
        }
    }
    assert!(
        text.contains("kubectl port-forward svc/smollm2 8000:8000"),
        "{tag}:\n{text}"
    );
    // How a model gets onto the claim the example names.
    assert!(
        text.contains("kubectl cp SmolLM2-135M-Instruct.Q4_1.gguf model-copy:/models/")
            && text.contains("claimName: models"),
        "{tag}:\n{text}"
    );
    assert_eq!(
        text.contains("Resource profiles for spec.resourceProfile (NAME or NAME:GPUS): amd-mi300x, nvidia-a100-mig, nvidia-h100."),
        tag == "resource-profiles",
        "{tag}:\n{text}"
    );
}

/// What a value set renders for the router.
struct RenderedRouter<'a> {
    name: String,
    deployment: &'a Value,
    args: Vec<String>,
    service: &'a Value,
    /// `ClusterRole` or `Role`.
    role_kind: String,
    /// (verb, group, resource) of every rule bound to the router's ServiceAccount.
    rules: BTreeSet<(String, String, String)>,
    service_monitor: Option<&'a Value>,
}

/// Where the router reads ready pods from (`--endpoints-from`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Members {
    EndpointSlices,
    Pods,
}

/// The rules ferrite-router needs: its two watch caches (router/src/registry.rs: the
/// InferenceServices, and their EndpointSlices or pods), and with `wake` the scale
/// subresource it patches to wake a service scaled to zero (router/src/proxy.rs).
fn router_rules(wake: bool, members: Members, tenants: bool) -> BTreeSet<(String, String, String)> {
    let (group, resource) = match members {
        Members::EndpointSlices => ("discovery.k8s.io", "endpointslices"),
        Members::Pods => ("", "pods"),
    };
    let mut rules = vec![
        ("list", "ferrite.dev", "inferenceservices"),
        ("watch", "ferrite.dev", "inferenceservices"),
        ("list", group, resource),
        ("watch", group, resource),
    ];
    if wake {
        rules.push(("patch", "ferrite.dev", "inferenceservices/scale"));
    }
    if tenants {
        // router/src/tenants.rs: the InferenceTenants and their key Secrets.
        rules.extend([
            ("list", "ferrite.dev", "inferencetenants"),
            ("watch", "ferrite.dev", "inferencetenants"),
            ("list", "", "secrets"),
            ("watch", "", "secrets"),
            ("list", "", "pods"),
            ("watch", "", "pods"),
        ]);
    }
    rules
        .into_iter()
        .map(|(v, g, r)| (v.to_string(), g.to_string(), r.to_string()))
        .collect()
}

/// Checks every value set with the router on: hardened like the operator, probes and the
/// Service on its `http` port, a graceful drain, its own ServiceAccount, the RBAC and
/// `--no-wake` agreeing, `--namespace` and a Role agreeing, and a ServiceMonitor exactly where
/// the operator has one, with the same labels.
fn check_router<'a>(tag: &str, docs: &'a [Value]) -> RenderedRouter<'a> {
    let deployment = router_deployment(docs);
    let name = deployment["metadata"]["name"]
        .as_str()
        .expect("name")
        .to_string();
    let args = container_args(deployment);
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{tag}");
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
        "{tag}"
    );
    let c = &pod["containers"][0];
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true, "{tag}");
    assert_eq!(sc["allowPrivilegeEscalation"], false, "{tag}");
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{tag}");
    assert_eq!(c["ports"][0]["name"], "http", "{tag}");
    let port = c["ports"][0]["containerPort"].as_u64().expect("port");
    assert!(
        args.contains(&format!("--addr=0.0.0.0:{port}")),
        "{tag}: the router listens on its container port: {args:?}"
    );
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(c[probe]["httpGet"]["path"], path, "{tag}");
        assert_eq!(c[probe]["httpGet"]["port"], "http", "{tag}");
    }
    assert!(
        c["env"]
            .as_array()
            .is_some_and(|e| e.iter().any(|e| e["name"] == "RUST_LOG")),
        "{tag}"
    );
    let drain: u64 = args
        .iter()
        .find_map(|a| a.strip_prefix("--drain-delay-seconds="))
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("{tag}: no --drain-delay-seconds: {args:?}"));
    let grace = pod["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("terminationGracePeriodSeconds");
    assert!(
        grace >= drain + 10,
        "{tag}: grace {grace} s, drain {drain} s"
    );
    let sa = pod["serviceAccountName"]
        .as_str()
        .expect("serviceAccountName");
    assert_eq!(
        one_component(docs, "ServiceAccount", "router")["metadata"]["name"],
        sa,
        "{tag}"
    );
    assert_ne!(
        sa,
        operator_deployment(docs)["spec"]["template"]["spec"]["serviceAccountName"],
        "{tag}: the router has a ServiceAccount of its own"
    );
    let service = one_component(docs, "Service", "router");
    assert_eq!(service["metadata"]["name"], name.as_str(), "{tag}");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "http", "{tag}");
    let rules = granted(docs, sa);
    let wakes = !args.iter().any(|a| a == "--no-wake");
    let members = if args.iter().any(|a| a == "--endpoints-from=pods") {
        Members::Pods
    } else {
        Members::EndpointSlices
    };
    let tenants = args.iter().any(|a| a == "--tenants");
    assert_eq!(
        rules,
        router_rules(wakes, members, tenants),
        "{tag}: the router's RBAC"
    );
    let namespace = args.iter().find_map(|a| a.strip_prefix("--namespace="));
    let role_kind = if namespace.is_some() {
        "Role"
    } else {
        "ClusterRole"
    };
    let role = one_component(docs, role_kind, "router");
    assert_eq!(
        role["metadata"]["namespace"].as_str(),
        namespace,
        "{tag}: a Role in the watched namespace, or a ClusterRole"
    );
    let monitors = find_component(docs, "ServiceMonitor", "router");
    let operator_monitors = find_component(docs, "ServiceMonitor", "operator");
    assert_eq!(monitors.len(), operator_monitors.len(), "{tag}");
    let service_monitor = monitors.first().copied();
    if let (Some(sm), Some(op)) = (service_monitor, operator_monitors.first()) {
        let endpoint = &sm["spec"]["endpoints"][0];
        // With tenants /metrics is on its own port and Service (it names every tenant).
        let (port, component) = if tenants {
            ("metrics", "router-metrics")
        } else {
            ("http", "router")
        };
        assert_eq!(endpoint["port"], port, "{tag}");
        assert_eq!(
            sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"], component,
            "{tag}: the ServiceMonitor selects the Service with that port"
        );
        let selected = find(docs, "Service").into_iter().find(|s| {
            s["metadata"]["labels"]["app.kubernetes.io/component"] == component
                && s["spec"]["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|p| p["name"] == port)
        });
        assert!(
            selected.is_some(),
            "{tag}: a Service of {component} with port {port}"
        );
        assert_eq!(endpoint["path"], "/metrics", "{tag}");
        assert_eq!(endpoint["honorLabels"], true, "{tag}");
        for key in ["interval", "scrapeTimeout"] {
            assert_eq!(endpoint[key], op["spec"]["endpoints"][0][key], "{tag}");
        }
        // The same extra labels as the operator's, for the same Prometheus selector.
        for (k, v) in op["metadata"]["labels"].as_object().into_iter().flatten() {
            if k != "app.kubernetes.io/component" && k != "app.kubernetes.io/name" {
                assert_eq!(&sm["metadata"]["labels"][k], v, "{tag}: label {k}");
            }
        }
    }
    RenderedRouter {
        name,
        deployment,
        args,
        service,
        role_kind: role_kind.to_string(),
        rules,
        service_monitor,
    }
}

/// Whether `labels` has every key and value of `selector`.
fn selects(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| &labels[k] == v))
}

/// Every selector picks the pods of exactly one Deployment (the operator's and the router's
/// pods share the release's labels, so a loose selector would mix them): each Service with a
/// selector and each PodDisruptionBudget, and each ServiceMonitor selects exactly one Service.
fn check_selectors(tag: &str, docs: &[Value]) {
    let pods: Vec<(&Value, &Value)> = find(docs, "Deployment")
        .into_iter()
        .map(|d| {
            (
                &d["metadata"]["name"],
                &d["spec"]["template"]["metadata"]["labels"],
            )
        })
        .collect();
    for d in find(docs, "Deployment") {
        let own = &d["spec"]["selector"]["matchLabels"];
        let matched: Vec<_> = pods.iter().filter(|(_, l)| selects(own, l)).collect();
        assert_eq!(
            matched.len(),
            1,
            "{tag}: Deployment {} selects {matched:?}",
            d["metadata"]["name"]
        );
    }
    for (kind, selector) in [
        ("Service", "/spec/selector"),
        ("PodDisruptionBudget", "/spec/selector/matchLabels"),
    ] {
        for o in find(docs, kind) {
            let Some(sel) = o.pointer(selector) else {
                continue;
            };
            let matched: Vec<_> = pods
                .iter()
                .filter(|(_, l)| selects(sel, l))
                .map(|(n, _)| n)
                .collect();
            assert_eq!(
                matched.len(),
                1,
                "{tag}: {kind} {} selects the pods of {matched:?}",
                o["metadata"]["name"]
            );
        }
    }
    for sm in find(docs, "ServiceMonitor") {
        let matched: Vec<_> = find(docs, "Service")
            .into_iter()
            .filter(|s| {
                selects(
                    &sm["spec"]["selector"]["matchLabels"],
                    &s["metadata"]["labels"],
                )
            })
            .map(|s| &s["metadata"]["name"])
            .collect();
        assert_eq!(
            matched.len(),
            1,
            "{tag}: ServiceMonitor {} selects {matched:?}",
            sm["metadata"]["name"]
        );
    }
}

/// `tests/chart-values/invalid-*.yaml`: each starts with `# expect: MESSAGE`, a part of
/// what Helm must answer.
#[test]
fn wrong_values_are_refused_with_a_message_naming_the_key() {
    let dir = workspace_root().join("tests/chart-values");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/chart-values")
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

/// GitOps tools render the chart again at every sync: with every value set in `ci/`, two
/// renders are byte-identical (no generated key, certificate, token or timestamp), so Argo CD
/// stays in sync and never restarts the operator.
#[test]
fn two_renders_with_the_same_values_are_byte_identical() {
    let mut checked = 0;
    for entry in std::fs::read_dir(chart_dir().join("ci")).expect("ci/") {
        let path = entry.expect("ci/ entry").path();
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("file name")
            .to_string();
        let first = render_text(&path, &format!("{stem}-first")).expect("renders");
        let second = render_text(&path, &format!("{stem}-second")).expect("renders");
        assert!(
            first == second,
            "{}: the two renders differ",
            path.display()
        );
        assert!(first.contains("kind: Deployment"), "{first}");
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} value sets");
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

/// The operator's ClusterRole: the one whose first rule is on InferenceServices.
fn operator_cluster_role(docs: &[Value]) -> &Value {
    find(docs, "ClusterRole")
        .into_iter()
        .find(|r| r["rules"][0]["resources"] == json!(["inferenceservices"]))
        .expect("the operator's ClusterRole")
}
