//! The generated CRD: committed copy is current, CEL rules reject what they should (evaluated
//! client-side with kube's CEL evaluator, as no API server can run here), and the examples are
//! accepted.

use ferrite_api::crd::{InferenceService, crd_yaml};
use ferrite_testkit::kube::workspace_root;
use kube::CustomResourceExt;
use kube::core::cel::Validator;
use serde_json::Value;

fn schema() -> Value {
    schema_of::<InferenceService>()
}

/// The openAPIV3Schema of `K`'s CRD.
fn schema_of<K: CustomResourceExt>() -> Value {
    let crd = K::crd();
    let s = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("openAPIV3Schema");
    serde_json::to_value(s).expect("schema json")
}

fn yaml(path: &str) -> Value {
    let text = std::fs::read_to_string(workspace_root().join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Asserts that `object` is refused with a message containing `expect`.
fn assert_refused(v: &Validator, schema: &Value, object: &Value, expect: &str) {
    let errors = v.validate(schema, object, None).expect_err(&format!(
        "accepted, but should fail with {expect:?}: {object}"
    ));
    let messages: Vec<String> = errors
        .as_slice()
        .iter()
        .map(|e| e.message.clone())
        .collect();
    assert!(
        messages.iter().any(|m| m.contains(expect)),
        "expected {expect:?}, got {messages:?}"
    );
}

#[test]
fn committed_crd_is_current() {
    let committed = std::fs::read_to_string(workspace_root().join("crds/inferenceservice.yaml"))
        .expect("crds/inferenceservice.yaml");
    assert!(
        committed == crd_yaml().expect("yaml"),
        "crds/inferenceservice.yaml is stale: run \
         `cargo run -q -p ferrite-api --bin crdgen > crds/inferenceservice.yaml`"
    );
}

#[test]
fn committed_tenant_crd_is_current() {
    let committed = std::fs::read_to_string(workspace_root().join("crds/inferencetenant.yaml"))
        .expect("crds/inferencetenant.yaml");
    assert!(
        committed == ferrite_api::tenant::crd_yaml().expect("yaml"),
        "crds/inferencetenant.yaml is stale: run \
         `cargo run -q -p ferrite-api --bin crdgen inferencetenant > crds/inferencetenant.yaml`"
    );
}

#[test]
fn tenant_cel_rules_refuse_a_tenant_with_no_models_and_zero_limits() {
    let schema = schema_of::<ferrite_api::tenant::InferenceTenant>();
    let v = Validator::new();
    let object = |spec: Value| {
        serde_json::json!({"apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceTenant",
                           "metadata": {"name": "team-a"}, "spec": spec})
    };
    let refused = |spec: Value, expect: &str| assert_refused(&v, &schema, &object(spec), expect);
    refused(serde_json::json!({}), "give the namespaces or the models");
    refused(
        serde_json::json!({"models": ["chat"], "limits": {"tokensPerMinute": 0}}),
        "tokensPerMinute must be at least 1",
    );
    refused(
        serde_json::json!({"models": [""]}),
        "model names are not empty",
    );
    let ok = object(
        serde_json::json!({"namespaces": ["team-a"], "models": ["chat"],
        "priority": 2, "limits": {"requestsPerMinute": 60, "tokensPerMinute": 100000,
        "concurrentRequests": 8}}),
    );
    v.validate(&schema, &ok, None).expect("a full tenant");
}

#[test]
fn cel_rules_reject_each_invalid_example_with_its_message() {
    let schema = schema();
    let cases = yaml("tests/cel/invalid.yaml");
    let cases = cases.as_array().expect("a list of cases");
    assert!(cases.len() >= 7);
    let v = Validator::new();
    for case in cases {
        let expect = case["expect"].as_str().expect("expect");
        let mut object = case["object"].clone();
        object["apiVersion"] = "ferrite.dev/v1alpha1".into();
        object["kind"] = "InferenceService".into();
        assert_refused(&v, &schema, &object, expect);
        // The same object with the offending section made valid passes: the rule, not the
        // evaluator, rejected it.
        let fixed: Value = serde_json::json!({
            "apiVersion": "ferrite.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "a"}, "spec": {"model": {"source": "/models/m.gguf"}}
        });
        v.validate(&schema, &fixed, None)
            .expect("a valid object passes");
    }
}

#[test]
fn examples_parse_and_pass_every_rule() {
    let schema = schema();
    for path in ["examples/minimal.yaml", "examples/full.yaml"] {
        let object = yaml(path);
        let isvc: InferenceService =
            serde_json::from_value(object.clone()).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(
            Validator::new()
                .validate(&schema, &object, None)
                .map_err(|e| e.to_string()),
            Ok(()),
            "{path}"
        );
        isvc.validate_cel()
            .unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}

/// Every field has a description, so `kubectl explain` is useful.
#[test]
fn every_spec_field_is_described() {
    fn walk(path: &str, s: &Value, missing: &mut Vec<String>) {
        if let Some(props) = s.get("properties").and_then(Value::as_object) {
            for (k, v) in props {
                let p = format!("{path}.{k}");
                if v.get("description").is_none() {
                    missing.push(p.clone());
                }
                walk(&p, v, missing);
            }
        }
        if let Some(items) = s.get("items") {
            walk(&format!("{path}[]"), items, missing);
        }
    }
    let schema = schema();
    let mut missing = Vec::new();
    walk("spec", &schema["properties"]["spec"], &mut missing);
    walk("status", &schema["properties"]["status"], &mut missing);
    assert!(
        missing.is_empty(),
        "fields without a description: {missing:#?}"
    );
}
