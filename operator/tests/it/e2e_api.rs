//! The CRD and the chart's RBAC as a real API server serves and enforces them (one cluster
//! shared by these tests, each in its own namespace): every CEL rule, enum, bound, pattern and
//! length limit rejects a bad InferenceService with its message; the schema published for
//! `kubectl explain` describes every field; and the operator's ServiceAccount may not do what
//! it has no business doing.

use ferrite_testkit::e2e::{Applier, install, yaml_docs};
use ferrite_testkit::kube::{Cluster, workspace_root};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, DynamicObject, PostParams};
use serde_json::{Value, json};

/// A server-side dry-run create: `Ok` if accepted, else the API server's message.
async fn dry_run(api: &Api<DynamicObject>, obj: &Value) -> Result<(), String> {
    let dynamic: DynamicObject = serde_json::from_value(obj.clone()).expect("object");
    let pp = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    match api.create(&pp, &dynamic).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) => Err(s.message),
        Err(e) => panic!("dry run: {e}"),
    }
}

fn crd_schema() -> Value {
    let text =
        std::fs::read_to_string(workspace_root().join("crds/inferenceservice.yaml")).expect("CRD");
    let crd = yaml_docs(&text).remove(0);
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

/// examples/full.yaml's spec: every section present, so any one field can be spoiled alone.
fn full_spec() -> Value {
    let text =
        std::fs::read_to_string(workspace_root().join("examples/full.yaml")).expect("example");
    yaml_docs(&text).remove(0)["spec"].clone()
}

fn set(obj: &mut Value, path: &[String], value: Value) {
    let mut at = obj;
    for (i, key) in path.iter().enumerate() {
        if i + 1 == path.len() {
            at[key.as_str()] = value;
            return;
        }
        if !at[key.as_str()].is_object() {
            at[key.as_str()] = json!({});
        }
        at = &mut at[key.as_str()];
    }
}

/// One spoiled field: its path under spec, the bad value, and what the message must say.
#[derive(Debug)]
struct Violation {
    path: Vec<String>,
    value: Value,
    expect: &'static str,
}

/// Every enum, bound, pattern and length limit under `schema` (objects only; the arrays of
/// Kubernetes types carry none of their own).
fn violations(schema: &Value, path: &mut Vec<String>, out: &mut Vec<Violation>) {
    let mut add = |value: Value, expect: &'static str| {
        out.push(Violation {
            path: path.clone(),
            value,
            expect,
        })
    };
    let integer = schema["type"] == "integer";
    if schema["enum"].is_array() {
        add(json!("not-a-choice"), "Unsupported value");
    }
    if let Some(min) = schema["minimum"].as_f64() {
        add(
            if integer {
                json!(min as i64 - 1)
            } else {
                json!(min - 0.01)
            },
            "should be greater than or equal to",
        );
    }
    if let Some(max) = schema["maximum"].as_f64() {
        add(
            if integer {
                json!(max as i64 + 1)
            } else {
                json!(max + 0.01)
            },
            "should be less than or equal to",
        );
    }
    if schema["pattern"].is_string() {
        add(json!("has a space"), "should match");
    }
    if schema["minLength"].as_u64().is_some_and(|m| m > 0) {
        add(json!(""), "should be at least");
    }
    if let Some(max) = schema["maxLength"].as_u64() {
        add(json!("x".repeat(max as usize + 1)), "may not be more than");
    }
    if let Some(props) = schema["properties"].as_object() {
        for (name, sub) in props {
            path.push(name.clone());
            violations(sub, path, out);
            path.pop();
        }
    }
}

/// Every CEL rule (tests/cel/invalid.yaml, one case each) and every enum, bound, pattern and
/// length in the schema: the real API server rejects the object, with the rule's message or
/// the field's path and the constraint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_rejects_every_invalid_field_with_its_message() {
    let Some(cluster) = Cluster::shared().await else {
        return;
    };
    let client = cluster.client().await;
    let mut applier = Applier::new(client.clone()).await;
    applier
        .apply_file(&workspace_root().join("crds/inferenceservice.yaml"))
        .await;
    ferrite_testkit::e2e::wait_crd(&client, "inferenceservices.ferrite.dev").await;
    let ns = cluster.namespace("cel").await;
    let api = ferrite_testkit::e2e::isvc_api(&client, &ns);
    let object = |spec: Value| {
        json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
               "metadata": {"name": "valid", "namespace": ns}, "spec": spec})
    };
    dry_run(&api, &object(full_spec()))
        .await
        .expect("the full example is valid");

    let cases = std::fs::read_to_string(workspace_root().join("tests/cel/invalid.yaml"))
        .expect("CEL cases");
    let cases: Vec<Value> = serde_yaml_ng::from_str(&cases).expect("YAML");
    assert!(cases.len() >= 7);
    for case in &cases {
        let mut obj = case["object"].clone();
        obj["apiVersion"] = json!("ferrite.dev/v1alpha1");
        obj["kind"] = json!("InferenceService");
        obj["metadata"]["namespace"] = json!(ns);
        let expect = case["expect"].as_str().expect("expect");
        let err = dry_run(&api, &obj)
            .await
            .expect_err(&format!("rejected: {obj}"));
        assert!(err.contains(expect), "{expect:?} not in {err:?}");
    }

    let mut found = Vec::new();
    violations(&crd_schema()["properties"]["spec"], &mut vec![], &mut found);
    assert!(found.len() >= 30, "{} constraints found", found.len());
    for v in &found {
        let mut spec = full_spec();
        set(&mut spec, &v.path, v.value.clone());
        let err = dry_run(&api, &object(spec)).await.expect_err(&format!(
            "spec.{} = {} rejected",
            v.path.join("."),
            v.value
        ));
        let field = format!("spec.{}", v.path.join("."));
        assert!(
            err.contains(&field) && err.contains(v.expect),
            "{field} = {}: {:?} expected, got {err:?}",
            v.value,
            v.expect
        );
    }
    eprintln!(
        "{} schema constraints and {} CEL rules checked",
        found.len(),
        cases.len()
    );
}

/// What `kubectl explain` shows comes from the OpenAPI the API server publishes: every field
/// of the spec and status has a description, and optional enums list only their values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_schema_describes_every_field() {
    let Some(cluster) = Cluster::shared().await else {
        return;
    };
    let client = cluster.client().await;
    Applier::new(client.clone())
        .await
        .apply_file(&workspace_root().join("crds/inferenceservice.yaml"))
        .await;
    ferrite_testkit::e2e::wait_crd(&client, "inferenceservices.ferrite.dev").await;
    let get = async |path: &str| -> Option<Value> {
        let req = http::Request::get(path).body(Vec::new()).ok()?;
        serde_json::from_str(&client.request_text(req).await.ok()?).ok()
    };
    // The OpenAPI aggregator picks a new CRD up within seconds.
    let schema = ferrite_testkit::process::eventually(
        std::time::Duration::from_secs(60),
        "the InferenceService schema in /openapi/v3",
        async || {
            let index = get("/openapi/v3").await?;
            let url = index["paths"]["apis/ferrite.dev/v1alpha1"]["serverRelativeURL"]
                .as_str()?
                .to_string();
            let doc = get(&url).await?;
            let s = doc["components"]["schemas"]["dev.ferrite.v1alpha1.InferenceService"].clone();
            (!s.is_null()).then_some(s)
        },
    )
    .await;
    let (mut seen, mut missing) = (Vec::new(), Vec::new());
    fn walk(s: &Value, path: String, seen: &mut Vec<String>, missing: &mut Vec<String>) {
        if let Some(props) = s["properties"].as_object() {
            for (name, sub) in props {
                let p = format!("{path}.{name}");
                seen.push(p.clone());
                if sub["description"].as_str().is_none_or(str::is_empty) {
                    missing.push(p.clone());
                }
                walk(sub, p.clone(), seen, missing);
                walk(&sub["items"], format!("{p}[]"), seen, missing);
            }
        }
    }
    walk(
        &schema["properties"]["spec"],
        "spec".into(),
        &mut seen,
        &mut missing,
    );
    walk(
        &schema["properties"]["status"],
        "status".into(),
        &mut seen,
        &mut missing,
    );
    assert!(
        missing.is_empty(),
        "fields without a description: {missing:?}"
    );
    // Our own fields, and the Kubernetes types they embed (tolerations, affinity, env).
    assert!(seen.len() > 100, "walked only {} fields", seen.len());
    for field in [
        "spec.autoscaling.behavior.tolerance",
        "spec.runtime.engine.kvCacheMemory",
        "status.currentMetrics.requestsWaiting",
        "spec.scheduling.tolerations[].key",
    ] {
        assert!(seen.iter().any(|s| s == field), "{field} not published");
    }
    let format = &schema["properties"]["spec"]["properties"]["model"]["properties"]["format"];
    assert_eq!(format["enum"], json!(["gguf", "safetensors"]), "{format}");
}

/// The operator's ServiceAccount, bound by the chart's rendered RBAC, may do what it uses and
/// nothing of this: read Secrets (with `rbac.readApiKeySecrets` off), touch pods beyond reading them, change or delete
/// InferenceServices, delete Deployments or Services, manage RBAC or namespaces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_rbac_forbids_what_the_operator_has_no_business_doing() {
    let Some(cluster) = Cluster::shared().await else {
        return;
    };
    let client = cluster.client().await;
    // Without the one opt-out grant (reading the Secret key `spec.auth` names, on by default
    // and checked used in e2e_traffic.rs), the operator may read no Secret at all.
    let release = install(
        &cluster,
        &json!({"rbac": {"readApiKeySecrets": false}}),
        "rbac",
    )
    .await;
    let user = release.operator_user();
    let ns = cluster.namespace("rbac").await;
    let reviews: Api<SubjectAccessReview> = Api::all(client.clone());
    let can =
        async |verb: &str, group: &str, resource: &str, sub: Option<&str>, ns: Option<&str>| {
            let review = SubjectAccessReview {
                spec: SubjectAccessReviewSpec {
                    user: Some(user.clone()),
                    groups: Some(vec![
                        "system:serviceaccounts".into(),
                        "system:serviceaccounts:ferrite-system".into(),
                        "system:authenticated".into(),
                    ]),
                    resource_attributes: Some(ResourceAttributes {
                        verb: Some(verb.into()),
                        group: Some(group.into()),
                        resource: Some(resource.into()),
                        subresource: sub.map(Into::into),
                        namespace: ns.map(Into::into),
                        ..ResourceAttributes::default()
                    }),
                    ..SubjectAccessReviewSpec::default()
                },
                ..SubjectAccessReview::default()
            };
            reviews
                .create(&PostParams::default(), &review)
                .await
                .expect("SubjectAccessReview")
                .status
                .is_some_and(|s| s.allowed)
        };
    let n = Some(ns.as_str());
    let forbidden = [
        ("get", "", "secrets", None, n),
        ("list", "", "secrets", None, None),
        ("watch", "", "secrets", None, n),
        ("create", "", "pods", None, n),
        ("delete", "", "pods", None, n),
        ("patch", "", "pods", None, n),
        ("update", "", "pods", Some("status"), n),
        ("create", "", "pods", Some("exec"), n),
        ("delete", "ferrite.dev", "inferenceservices", None, n),
        ("create", "ferrite.dev", "inferenceservices", None, n),
        ("update", "ferrite.dev", "inferenceservices", None, n),
        ("patch", "ferrite.dev", "inferenceservices", None, n),
        ("delete", "apps", "deployments", None, n),
        ("delete", "", "services", None, n),
        ("create", "", "namespaces", None, None),
        ("list", "", "nodes", None, None),
        (
            "create",
            "rbac.authorization.k8s.io",
            "clusterrolebindings",
            None,
            None,
        ),
        (
            "create",
            "rbac.authorization.k8s.io",
            "rolebindings",
            None,
            n,
        ),
        (
            "escalate",
            "rbac.authorization.k8s.io",
            "clusterroles",
            None,
            None,
        ),
        ("update", "coordination.k8s.io", "leases", None, n),
        ("create", "", "serviceaccounts", Some("token"), n),
    ];
    for (verb, group, resource, sub, namespace) in forbidden {
        assert!(
            !can(verb, group, resource, sub, namespace).await,
            "{user} may {verb} {group}/{resource}{} in {namespace:?}",
            sub.map(|s| format!("/{s}")).unwrap_or_default()
        );
    }
    // And it may do what it does (the full check that it uses all of it is in e2e_rbac).
    let allowed = [
        ("watch", "ferrite.dev", "inferenceservices", None, None),
        (
            "patch",
            "ferrite.dev",
            "inferenceservices",
            Some("status"),
            n,
        ),
        (
            "patch",
            "ferrite.dev",
            "inferenceservices",
            Some("scale"),
            n,
        ),
        ("create", "apps", "deployments", None, n),
        ("patch", "apps", "deployments", None, n),
        ("create", "", "services", None, n),
        ("delete", "", "configmaps", None, n),
        ("watch", "", "pods", None, None),
        ("list", "", "persistentvolumeclaims", None, None),
        ("create", "events.k8s.io", "events", None, n),
        (
            "update",
            "coordination.k8s.io",
            "leases",
            None,
            Some("ferrite-system"),
        ),
    ];
    for (verb, group, resource, sub, namespace) in allowed {
        assert!(
            can(verb, group, resource, sub, namespace).await,
            "{user} may not {verb} {group}/{resource}{} in {namespace:?}",
            sub.map(|s| format!("/{s}")).unwrap_or_default()
        );
    }
}
