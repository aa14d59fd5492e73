//! The `InferenceService` custom resource (`ferrite.dev/v1alpha1`). Doc comments become the
//! CRD's field descriptions, so `kubectl explain inferenceservice.spec` reads them; CEL rules
//! reject what the OpenAPI types alone cannot.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvFromSource, EnvVar, LocalObjectReference, Toleration, TopologySpreadConstraint,
    Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The forms of `model.source` and an adapter's `source` (see [`crate::source`]).
const SOURCE_PATTERN: &str = r"^(/[^\s]*|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[^\s]+|hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(@[-A-Za-z0-9_.]+)?(/[^\s]*)?|(s3|gs)://[a-z0-9][-a-z0-9_.]*/[^\s?#]+|https?://[^\s/?#]+/[^\s?#]*[^\s?#/])$";

/// Default HTTP port of both runtimes.
pub const DEFAULT_PORT: i32 = 8000;

/// What the spec implies, read the same way by the build step, the status step and the
/// autoscaler.
impl InferenceService {
    /// Replicas to run: spec.replicas (the schema defaults it to 1), brought within
    /// autoscaling.minReplicas..maxReplicas when autoscaling is on, as an HPA does.
    pub fn desired_replicas(&self) -> i32 {
        let replicas = self.spec.replicas.unwrap_or(1);
        match &self.spec.autoscaling {
            Some(a) => replicas.clamp(a.min_replicas, a.max_replicas.max(a.min_replicas)),
            None => replicas,
        }
    }

    /// The runtime's HTTP port.
    pub fn port(&self) -> i32 {
        self.spec.runtime.port.unwrap_or(DEFAULT_PORT)
    }

    /// The router's policy for this service.
    pub fn routing_policy(&self) -> RoutingPolicy {
        self.spec
            .routing
            .as_ref()
            .map(|r| r.policy)
            .unwrap_or_default()
    }

    /// How long the router holds a request while no replica is ready.
    pub fn cold_start_timeout(&self) -> std::time::Duration {
        let secs = self
            .spec
            .routing
            .as_ref()
            .and_then(|r| r.cold_start_timeout_seconds)
            .unwrap_or(DEFAULT_COLD_START_TIMEOUT_SECONDS);
        std::time::Duration::from_secs(secs.max(1) as u64)
    }
}

/// Desired state of an InferenceService.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "ferrite.dev",
    version = "v1alpha1",
    kind = "InferenceService",
    plural = "inferenceservices",
    singular = "inferenceservice",
    shortname = "fisvc",
    category = "ferrite",
    namespaced,
    cel,
    doc = "An LLM served over the OpenAI API by ferrite-server or vLLM, with its Deployment, Service, monitoring and autoscaling managed by ferrite-operator.",
    validation = Rule::new("self.metadata.name.size() <= 63").message("the name must be at most 63 characters (it names the Service)"),
    validation = Rule::new("has(self.spec.model.servedName) || !has(self.spec.model.adapters) || self.spec.model.adapters.all(a, a.name != self.metadata.name)").message("an adapter may not have the model's served name (the resource's name when servedName is unset)"),
    status = "InferenceServiceStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(
        name = "Model",
        type_ = "string",
        json_path = ".spec.model.source"
    ),
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.readyReplicas"
    ),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(name = "URL", type_ = "string", json_path = ".status.url"),
    printcolumn(
        name = "Status",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new(
    "!has(self.modelCache) || !self.model.source.startsWith('pvc://')"
).message("modelCache is for downloaded models; a pvc:// model is mounted from its claim directly"))]
#[x_kube(validation = Rule::new(
    "!has(self.model.adapters) || !has(self.model.servedName) || self.model.adapters.all(a, a.name != self.model.servedName)"
).message("an adapter may not have the model's servedName"))]
#[serde(rename_all = "camelCase")]
pub struct InferenceServiceSpec {
    /// What to serve.
    pub model: ModelSpec,
    /// The server that runs the model.
    #[serde(default)]
    pub runtime: RuntimeSpec,
    /// Compute for each replica.
    #[serde(default)]
    pub resources: ResourcesSpec,
    /// How one replica splits the model over GPUs (KServe's LLMInferenceService names):
    /// vLLM's tensor, pipeline, data and expert parallelism. A replica needs
    /// `tensor × pipeline × data` GPUs; `resources.gpus` (absent: all of them) is each pod's
    /// share. Only the `vllm` runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallelism: Option<ParallelismSpec>,
    /// An operator-wide profile, `NAME` or `NAME:GPUS` (`nvidia-h100:2`), from the chart's
    /// `resourceProfiles`: its node selector, tolerations, affinity, runtime and priority
    /// class, scheduler, GPU resource name and pull secrets apply under this spec's own (a
    /// field set here wins), and the count sets `resources.gpus` unless that is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]{1,2})?$"))]
    #[schemars(length(max = 80))]
    pub resource_profile: Option<String>,
    /// Number of pods (default 1). Written by `kubectl scale`, HPA, KEDA or the built-in
    /// autoscaler through the scale subresource. With autoscaling, a count outside
    /// minReplicas..maxReplicas is brought within them, as an HPA does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000), extend("default" = 1))]
    pub replicas: Option<i32>,
    /// Scale on queue length and KV-cache usage. Absent: replicas stay as set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingSpec>,
    /// Where the pods may run.
    #[serde(default)]
    pub scheduling: SchedulingSpec,
    /// The pods' identity, pull secrets, extra volumes, labels, annotations and probes.
    #[serde(default)]
    pub pod: PodSettings,
    /// How a spec change replaces the pods. Default: with GPUs, one pod at a time is stopped
    /// before its successor starts (no spare GPU needed); without, one extra pod starts first
    /// (no capacity lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSpec>,
    /// A PersistentVolumeClaim that holds downloaded (hf://) models across restarts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_cache: Option<ModelCacheSpec>,
    /// Prometheus ServiceMonitor and Grafana dashboards.
    #[serde(default)]
    pub monitoring: MonitoringSpec,
    /// How ferrite-router spreads requests over the replicas and holds them while the service
    /// scales from zero. Absent: the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingSpec>,
    /// Who may call the model. Absent: anyone who can reach its pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthSpec>,
}

/// The model's API key, as ferrite-server's and vLLM's `--api-key`: requests need
/// `Authorization: Bearer <key>` (probes and `/metrics` stay open). The key reaches the server
/// from the Secret as an environment variable, never in its arguments (which `kubectl get pod`
/// and `ps` show).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AuthSpec {
    /// A key of a Secret in the InferenceService's namespace holding the API key. Pods wait
    /// for it to exist.
    pub api_key_secret_ref: SecretKeyRef,
}

/// One key of a Secret in the InferenceService's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct SecretKeyRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key in the Secret (default `api-key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub key: Option<String>,
}

impl SecretKeyRef {
    /// The key read from the Secret: the one named, or `api-key`.
    pub fn key_or_default(&self) -> &str {
        self.key.as_deref().unwrap_or("api-key")
    }
}

/// Seconds ferrite-router holds a request while no replica is ready, by default.
pub const DEFAULT_COLD_START_TIMEOUT_SECONDS: i32 = 600;

/// ferrite-router's settings for this service.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RoutingSpec {
    /// `prefix-affinity` (default): requests sharing a prompt prefix go to the same replica
    /// (its prefix cache), overflowing to the next one when it has more than its share of the
    /// load; `least-load`; or `round-robin`.
    #[serde(default)]
    pub policy: RoutingPolicy,
    /// Seconds a request is held while the service has no ready replica (scaling from zero)
    /// before the client gets 503 with Retry-After (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub cold_start_timeout_seconds: Option<i32>,
    /// Traffic weight when InferenceServices of one namespace serve one model name (a canary:
    /// `95` here, `5` on the canary). The oldest claimant of the name holds it; when it sets a
    /// weight, every other claimant in its namespace that sets one shares the name's traffic
    /// in proportion, each prompt prefix always to the same service (its caches stay warm).
    /// The header `x-ferrite-service: namespace/name` pins a request to one of them. Claimants
    /// in other namespaces never share a name's traffic. 0 takes no traffic but pinned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    pub weight: Option<i32>,
}

/// How ferrite-router picks a replica.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RoutingPolicy {
    #[default]
    #[serde(rename = "prefix-affinity")]
    PrefixAffinity,
    #[serde(rename = "least-load")]
    LeastLoad,
    #[serde(rename = "round-robin")]
    RoundRobin,
}

impl RoutingPolicy {
    /// The spec's spelling, also the router's metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingPolicy::PrefixAffinity => "prefix-affinity",
            RoutingPolicy::LeastLoad => "least-load",
            RoutingPolicy::RoundRobin => "round-robin",
        }
    }
}

/// What to serve and under which name.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// Where the weights are: an absolute path in the image or a volume of `pod.volumes`
    /// (`/models/x.gguf`); `pvc://<claim>/<path>` (the claim is mounted read-only);
    /// `hf://<org>/<name>[@<revision>][/<file>]` (a Hugging Face repository, pinned to a branch,
    /// tag or commit, optionally one file of it); or an `s3://<bucket>/<key>`,
    /// `gs://<bucket>/<key>` or `https://<host>/<path>` URL (a key ending in `/` is a folder).
    /// Remote sources are downloaded by the runtime at start into `modelCache` (else an
    /// emptyDir), resuming an interrupted download; credentials come from `secretRef`.
    #[schemars(regex(pattern = SOURCE_PATTERN))]
    pub source: String,
    /// A Secret in the namespace whose keys become the server's environment, for downloads:
    /// `HF_TOKEN` (gated Hugging Face repositories, for ferrite and vLLM alike), `HF_ENDPOINT`
    /// (a mirror), `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_REGION`/`AWS_ENDPOINT_URL`
    /// (S3 and S3-compatible stores), `GOOGLE_SERVICE_ACCOUNT_KEY` (GCS). Pods wait for it to
    /// exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretRef>,
    /// The `model` id clients send; defaults to the resource's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub served_name: Option<String>,
    /// More names clients may send for this model through ferrite-router (`chat-default` for
    /// whichever service is current): the router sends a request naming an alias here with
    /// `model` rewritten to the served name, so moving an alias to another service restarts no
    /// pod. A served name or an adapter of that name wins over an alias; of two services with
    /// one alias, the older holds it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 16),
        inner(length(min = 1, max = 253), regex(pattern = r"^[^/]+$"))
    )]
    #[x_kube(validation = Rule::new("self.all(a, self.exists_one(b, b == a))").message("aliases must be unique"))]
    pub aliases: Vec<String>,
    /// Weight format: `gguf` or `safetensors`; inferred from the source when absent (`.gguf`
    /// is GGUF, else safetensors).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "model_format_schema")]
    pub format: Option<ModelFormat>,
    /// The sha256 (64 hex digits) of a single-file model (a GGUF): ferrite-server checks the
    /// file against it after any download and before loading, and a download that does not
    /// match is removed and the pod fails with `ModelDownloadFailed`. ferrite runtime only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9a-fA-F]{64}$"))]
    pub sha256: Option<String>,
    /// LoRA adapters served on this model, each under its own name, which clients send as
    /// `model`. The operator loads and unloads them on the running pods through the
    /// runtime's `/v1/load_lora_adapter` API, so editing this list restarts no pod; a new pod
    /// gets the current list once it is ready. Per adapter, `status.adapters` says how many
    /// ready replicas serve it, or why none do.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.all(a, self.exists_one(b, b.name == a.name))").message("adapter names must be unique"))]
    pub adapters: Vec<AdapterSpec>,
    /// LoRA limits of each replica. LoRA is on when this is set or `adapters` is not empty;
    /// set it (`lora: {}`) to keep it on while the list is empty, so the first adapter added
    /// restarts no pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraSpec>,
}

/// One LoRA adapter of the model (KServe's `model.lora.adapters`, vLLM's `--lora-modules`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AdapterSpec {
    /// The `model` id clients send for it: letters, digits, `-`, `_` and `.`; not the
    /// model's served name.
    #[schemars(length(min = 1, max = 128))]
    #[schemars(regex(pattern = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"))]
    pub name: String,
    /// Where it is, in the forms `model.source` takes: a Hugging Face PEFT folder
    /// (`adapter_config.json` + `adapter_model.safetensors`) or a llama.cpp GGUF LoRA file.
    /// ferrite reads every form; vLLM reads paths, `pvc://` and `hf://` repositories. A
    /// `pvc://` claim is mounted read-only into every pod (a claim no other adapter uses
    /// restarts the pods once).
    #[schemars(regex(pattern = SOURCE_PATTERN))]
    #[schemars(length(max = 2048))]
    pub source: String,
    /// A Secret whose keys become the server's environment for this adapter's download, as
    /// `model.secretRef`. The pods carry every Secret the adapters name, so naming one that
    /// no other adapter (nor the model) uses restarts the pods once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretRef>,
}

/// LoRA limits of each replica, as vLLM's flags.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "!has(self.maxAdapters) || !has(self.maxCpuAdapters) || self.maxCpuAdapters >= self.maxAdapters"
).message("lora.maxCpuAdapters must be at least lora.maxAdapters"))]
pub struct LoraSpec {
    /// Most distinct adapters in one batch (`--max-loras`, default 4); requests for
    /// another wait their turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    pub max_adapters: Option<i32>,
    /// Largest adapter rank accepted (`--max-lora-rank`, default 16); a larger adapter is
    /// refused and `status.adapters` says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 512))]
    pub max_rank: Option<i32>,
    /// Most adapters a replica keeps in memory (`--max-cpu-loras`, default 16); past it the
    /// least recently used is read again from its file when a request names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1024))]
    pub max_cpu_adapters: Option<i32>,
}

/// A Secret in the InferenceService's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct SecretRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// An optional enum without the `null` that schemars lists for `Option` (`kubectl explain`
/// would show it as a choice); absent means "infer".
fn model_format_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut schema = generator.subschema_for::<ModelFormat>();
    schema.remove("nullable");
    schema
}

/// Weight file format.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFormat {
    #[serde(rename = "gguf")]
    Gguf,
    #[serde(rename = "safetensors")]
    Safetensors,
}

/// Parallelism within one replica; every size defaults to 1.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ParallelismSpec {
    /// Tensor-parallel size: GPUs each layer is split over (vLLM's `--tensor-parallel-size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub tensor: Option<i32>,
    /// Pipeline-parallel size: stages the layers are split into (`--pipeline-parallel-size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub pipeline: Option<i32>,
    /// Data-parallel size: copies of the model within the replica (`--data-parallel-size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub data: Option<i32>,
    /// Expert parallelism for MoE models: experts spread over the data- and tensor-parallel
    /// GPUs instead of split (`--enable-expert-parallel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert: Option<bool>,
}

impl ParallelismSpec {
    /// GPUs one replica needs.
    pub fn gpus(&self) -> i64 {
        [self.tensor, self.pipeline, self.data]
            .into_iter()
            .map(|s| i64::from(s.unwrap_or(1).max(1)))
            .product()
    }
}

/// Which server runs the model. Both speak the OpenAI API and vLLM's metrics protocol.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RuntimeKind {
    #[default]
    #[serde(rename = "ferrite")]
    Ferrite,
    #[serde(rename = "vllm")]
    Vllm,
}

/// The server process.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeSpec {
    /// `ferrite` (default) or `vllm`.
    #[serde(default)]
    pub kind: RuntimeKind,
    /// Container image; defaults to the operator's image for this runtime (and GPU variant).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Extra arguments appended after the ones the operator derives.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Extra environment variables.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// HTTP port of the server (API, /health and /metrics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// Engine settings, passed as the runtime's flags.
    #[serde(default)]
    pub engine: EngineSpec,
}

/// Engine settings shared by ferrite-server and vLLM.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EngineSpec {
    /// Longest prompt + completion in tokens (`--max-model-len`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 16, max = 1048576))]
    pub max_model_len: Option<i32>,
    /// Most sequences in one batch (`--max-num-seqs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4096))]
    pub max_num_seqs: Option<i32>,
    /// Tokens per KV-cache block (`--block-size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self in [8, 16, 32, 64, 128]").message("blockSize must be 8, 16, 32, 64 or 128"))]
    pub block_size: Option<i32>,
    /// Memory for the KV cache, as a Kubernetes quantity (`2Gi`, `512Mi`); more than zero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"))]
    #[x_kube(validation = Rule::new("!self.matches('^0+([.]0+)?[A-Za-z]*$')").message("kvCacheMemory must be more than zero"))]
    pub kv_cache_memory: Option<String>,
    /// Seconds the server drains in-flight requests after SIGTERM; the pod's
    /// terminationGracePeriodSeconds is set a little above it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3600))]
    pub shutdown_timeout_seconds: Option<i32>,
}

/// GPU resource requested when `gpuResourceName` is not set.
pub const DEFAULT_GPU_RESOURCE: &str = "nvidia.com/gpu";

/// Compute for each replica. `cpu`, `memory` and `ephemeralStorage` set request and limit
/// alike; `requests` and `limits` set either apart and win over them.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "!has(self.gpuResourceName) || !has(self.limits) || !(self.gpuResourceName in self.limits)"
).message("set the GPU count with gpus, not limits[gpuResourceName]"))]
pub struct ResourcesSpec {
    /// GPUs per replica (limit of `gpuResourceName`); 0 runs on CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 16))]
    pub gpus: Option<i32>,
    /// The extended resource that counts GPUs: `nvidia.com/gpu` (default), a MIG profile
    /// such as `nvidia.com/mig-1g.10gb`, `amd.com/gpu` or `gpu.intel.com/i915`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(
        pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
    ))]
    #[schemars(length(max = 253))]
    pub gpu_resource_name: Option<String>,
    /// CPU request and limit, as a quantity (`4`, `500m`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+(\.[0-9]+)?m?$"))]
    pub cpu: Option<String>,
    /// Memory request and limit, as a quantity (`8Gi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"))]
    pub memory: Option<String>,
    /// Local scratch request and limit (`ephemeral-storage`), as a quantity (`20Gi`): what a
    /// download into an emptyDir needs, or the kubelet evicts the pod when the node fills.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"))]
    pub ephemeral_storage: Option<String>,
    /// Requests by resource name, over the ones above (`cpu: "2"` with a higher limit).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(length(max = 16))]
    pub requests: BTreeMap<String, Quantity>,
    /// Limits by resource name, over the ones above. A limit below its request is refused.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(length(max = 16))]
    pub limits: BTreeMap<String, Quantity>,
}

/// Pod-level settings. Labels and annotations are added to the operator's; the few labels the
/// operator selects its pods by cannot be set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "!has(self.labels) || self.labels.all(k, !(k in ['ferrite.dev/inferenceservice', 'app.kubernetes.io/component', 'app.kubernetes.io/managed-by']))"
).message("pod.labels may not set ferrite.dev/inferenceservice, app.kubernetes.io/component or app.kubernetes.io/managed-by: the operator selects its pods by them"))]
#[x_kube(validation = Rule::new(
    "!has(self.volumes) || self.volumes.all(v, !(v.name in ['tmp', 'dshm', 'model']))"
).message("pod.volumes may not be named tmp, dshm or model: the operator's own volumes use those names"))]
pub struct PodSettings {
    /// Secrets holding registry credentials for the runtime image.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// ServiceAccount the pods run as (default: the namespace's `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub service_account_name: Option<String>,
    /// Mount the ServiceAccount's API token (default false: the server never calls the
    /// Kubernetes API; set true for workload identity that reads it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub automount_service_account_token: Option<bool>,
    /// Labels added to the pods (e.g. Kueue's `kueue.x-k8s.io/queue-name`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(length(max = 64))]
    pub labels: BTreeMap<String, String>,
    /// Annotations added to the pods; they win over the operator's `prometheus.io/*` ones.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(length(max = 64))]
    pub annotations: BTreeMap<String, String>,
    /// Extra volumes of the pods (a claim holding models, a Secret, a CSI volume).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub volumes: Vec<Volume>,
    /// Where the server container mounts them; each names one of `volumes` (else the spec
    /// is Degraded, `InvalidPodSettings`). Paths under /tmp, /dev/shm and /mnt/models are the
    /// operator's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub volume_mounts: Vec<VolumeMount>,
    /// Environment from ConfigMaps and Secrets (e.g. `HF_TOKEN`), for the server container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub env_from: Vec<EnvFromSource>,
    /// How the replicas spread over zones and nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// Scheduler of the pods (e.g. a gang or bin-packing scheduler).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub scheduler_name: Option<String>,
    /// Seconds between SIGTERM and SIGKILL; default: the server's shutdownTimeoutSeconds
    /// plus 15.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 86400))]
    pub termination_grace_period_seconds: Option<i64>,
    /// Timing of the startup, readiness and liveness probes (all on `/health`).
    #[serde(default)]
    pub probes: ProbesSpec,
}

/// Probe timings over the defaults (startup: every 10 s, 180 failures, so 30 minutes to load;
/// readiness: every 5 s, 3 failures; liveness: every 10 s, 6 failures).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "(!has(self.startup) || !has(self.startup.successThreshold) || self.startup.successThreshold == 1) && (!has(self.liveness) || !has(self.liveness.successThreshold) || self.liveness.successThreshold == 1)"
).message("startup and liveness probes need successThreshold 1"))]
pub struct ProbesSpec {
    /// Until it first succeeds, the other probes wait: this bounds the model's load time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup: Option<ProbeTiming>,
    /// Failing takes the pod out of the Service (and of ferrite-router's replicas).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness: Option<ProbeTiming>,
    /// Failing restarts the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness: Option<ProbeTiming>,
}

/// One probe's timing; what is absent keeps its default.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ProbeTiming {
    /// Seconds after the container starts before the first probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3600))]
    pub initial_delay_seconds: Option<i32>,
    /// Seconds between probes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub period_seconds: Option<i32>,
    /// Seconds before one probe counts as failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub timeout_seconds: Option<i32>,
    /// Failures in a row before the probe fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub failure_threshold: Option<i32>,
    /// Successes in a row before a failed probe passes again (1 for startup and liveness).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub success_threshold: Option<i32>,
}

/// How the Deployment replaces pods.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RolloutStrategy {
    /// Replace pods a few at a time, within maxSurge and maxUnavailable.
    #[default]
    RollingUpdate,
    /// Stop every pod, then start the new ones: for a pool with no room for two versions.
    Recreate,
}

/// Rollout settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "self.strategy != 'Recreate' || (!has(self.maxSurge) && !has(self.maxUnavailable))"
).message("maxSurge and maxUnavailable are for RollingUpdate; Recreate takes neither"))]
pub struct RolloutSpec {
    /// `RollingUpdate` (default) or `Recreate`.
    #[serde(default)]
    pub strategy: RolloutStrategy,
    /// Pods started above the replica count during a rollout: a number or a percentage.
    /// When only maxUnavailable is set, 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "int_or_percent_schema")]
    pub max_surge: Option<IntOrString>,
    /// Pods that may be unavailable during a rollout: a number or a percentage. When only
    /// maxSurge is set, 0 (or 1 if maxSurge is 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "int_or_percent_schema")]
    pub max_unavailable: Option<IntOrString>,
}

/// A count or a percentage (`1`, `25%`), as Deployments take them.
fn int_or_percent_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    // A structural schema allows only bare types under int-or-string: the form is CEL's.
    schemars::json_schema!({
        "x-kubernetes-int-or-string": true,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-validations": [{
            "rule": "string(self).matches('^[0-9]+%?$')",
            "message": "a count of at least 0 or a percentage like 25%"
        }]
    })
}

/// How replicas follow load: `Builtin` (the operator scrapes the pods and writes spec.replicas),
/// `HPA` (the operator serves the signals on the External Metrics API and creates an HPA), or
/// `KEDA` (the operator creates a KEDA ScaledObject whose triggers read the same signals from
/// Prometheus; for clusters that run KEDA, which owns the External Metrics API there).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AutoscalingMode {
    #[default]
    Builtin,
    #[serde(rename = "HPA")]
    Hpa,
    #[serde(rename = "KEDA")]
    Keda,
}

/// Where KEDA's triggers read the signals.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KedaScaler {
    /// KEDA's `external` scaler, served by the operator: the built-in autoscaler's own
    /// signals, no Prometheus needed.
    External,
    /// KEDA's `prometheus` scaler, reading the series the ServiceMonitors produce.
    Prometheus,
}

/// KEDA mode's settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.serverAddress) || !has(self.scaler) || self.scaler == 'Prometheus'").message("serverAddress is the Prometheus scaler's: it needs scaler Prometheus"))]
pub struct KedaSpec {
    /// `External` (the operator's external scaler) or `Prometheus`. Absent: `External` when the
    /// operator serves it (the chart's `keda.externalScaler.enabled`, the default), else
    /// `Prometheus`; `Prometheus` whenever serverAddress is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaler: Option<KedaScaler>,
    /// The Prometheus that scrapes this service's pods (and the routers), as KEDA's
    /// `prometheus` trigger's `serverAddress`. Absent: the operator's
    /// `--keda-prometheus-address` (the chart's `keda.prometheusAddress`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048))]
    #[x_kube(validation = Rule::new("self.startsWith('http://') || self.startsWith('https://')").message("serverAddress is an http:// or https:// URL"))]
    pub server_address: Option<String>,
}

/// Autoscaling on LLM signals.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.minReplicas <= self.maxReplicas").message("minReplicas must not exceed maxReplicas"))]
#[x_kube(validation = Rule::new("self.minReplicas > 0 || has(self.idleTimeoutSeconds)").message("minReplicas 0 (scale to zero) needs idleTimeoutSeconds"))]
#[x_kube(validation = Rule::new("has(self.targets.queuePerReplica) || has(self.targets.kvCacheUsage)").message("set at least one target: queuePerReplica or kvCacheUsage"))]
#[x_kube(validation = Rule::new("!has(self.keda) || self.mode == 'KEDA'").message("autoscaling.keda applies only to mode KEDA"))]
pub struct AutoscalingSpec {
    /// `Builtin` (default), `HPA` or `KEDA`.
    #[serde(default)]
    pub mode: AutoscalingMode,
    /// With mode `KEDA`: where its triggers read the signals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keda: Option<KedaSpec>,
    /// Fewest replicas; 0 allows scale to zero after idleTimeoutSeconds.
    #[schemars(range(min = 0, max = 1000))]
    pub min_replicas: i32,
    /// Most replicas.
    #[schemars(range(min = 1, max = 1000))]
    pub max_replicas: i32,
    /// Per-signal targets; the replica count is the highest any signal asks for.
    pub targets: AutoscalingTargets,
    /// Stabilization windows and rate limits.
    #[serde(default)]
    pub behavior: ScalingBehavior,
    /// Seconds between scrapes of the pods (Builtin mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 300))]
    pub scrape_interval_seconds: Option<i32>,
    /// Scale up at once, and hold scale-down, when the queue exceeds this multiple of its
    /// target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1.0, max = 100.0))]
    pub panic_threshold: Option<f64>,
    /// Seconds without requests before scaling to zero (only with minReplicas 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 30, max = 86400))]
    pub idle_timeout_seconds: Option<i32>,
}

/// Target values per replica.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingTargets {
    /// Waiting requests per replica (`vllm:num_requests_waiting`, averaged over ready pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.1, max = 10000.0))]
    pub queue_per_replica: Option<f64>,
    /// KV-cache usage fraction, 0..1 (`vllm:kv_cache_usage_perc`, averaged over ready pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.05, max = 1.0))]
    pub kv_cache_usage: Option<f64>,
}

/// HPA-style behaviour.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ScalingBehavior {
    /// Window over which the highest recommendation wins before scaling up (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3600))]
    pub scale_up_stabilization_seconds: Option<i32>,
    /// Window over which the highest recommendation wins before scaling down (default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 3600))]
    pub scale_down_stabilization_seconds: Option<i32>,
    /// Most replicas added per minute, as a percentage of the current count (default 100:
    /// at most double).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_scale_up_percent_per_minute: Option<i32>,
    /// Most replicas removed per minute, as a percentage of the current count (default 50).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub max_scale_down_percent_per_minute: Option<i32>,
    /// Tolerance around each target before anything changes (default 0.1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 0.9))]
    pub tolerance: Option<f64>,
}

/// Pod placement.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SchedulingSpec {
    /// Node labels the pods require (e.g. a GPU product).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Taints the pods tolerate (e.g. `nvidia.com/gpu`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Node and pod (anti-)affinity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// PriorityClass of the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// RuntimeClass of the pods (e.g. `nvidia`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_class_name: Option<String>,
}

/// A claim for downloaded models.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelCacheSpec {
    /// An existing PersistentVolumeClaim in the same namespace.
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: String,
}

/// Monitoring objects the operator creates.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MonitoringSpec {
    #[serde(default)]
    pub service_monitor: ServiceMonitorSpec,
    #[serde(default)]
    pub dashboards: DashboardsSpec,
}

/// A Prometheus Operator ServiceMonitor for the pods' /metrics.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceMonitorSpec {
    /// Create it (only where the ServiceMonitor CRD is installed; the status says otherwise).
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Scrape interval, e.g. `15s`.
    #[serde(default = "default_interval")]
    #[schemars(regex(pattern = r"^[0-9]+(ms|s|m)$"))]
    pub interval: String,
    /// Extra labels, e.g. the `release` label your Prometheus selects monitors by.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

impl Default for ServiceMonitorSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            interval: default_interval(),
            labels: BTreeMap::new(),
        }
    }
}

/// Grafana dashboards as ConfigMaps for the Grafana sidecar.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DashboardsSpec {
    /// Create the ConfigMaps.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Labels the sidecar selects ConfigMaps by; default `grafana_dashboard: "1"`.
    #[serde(default = "default_dashboard_labels")]
    pub labels: BTreeMap<String, String>,
    /// Grafana folder, set as the `grafana_folder` annotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub folder: Option<String>,
}

impl Default for DashboardsSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            labels: default_dashboard_labels(),
            folder: None,
        }
    }
}

fn yes() -> bool {
    true
}

fn default_interval() -> String {
    "15s".into()
}

fn default_dashboard_labels() -> BTreeMap<String, String> {
    BTreeMap::from([("grafana_dashboard".to_string(), "1".to_string())])
}

/// Observed state.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InferenceServiceStatus {
    /// `Ready`, `Progressing`, `Degraded` and `MonitoringReady`; with autoscaling also
    /// `ScalingActive`, and in Builtin mode `ScalingLimited` (and `ScaledToZero` with
    /// minReplicas 0).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Pods of the current Deployment.
    #[serde(default)]
    pub replicas: i32,
    /// Pods passing their readiness probe.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Label selector of the pods, for the scale subresource (HPA, KEDA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// In-cluster base URL of the OpenAI-compatible API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The replica count the built-in autoscaler last decided on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_replicas: Option<i32>,
    /// When the built-in autoscaler last changed spec.replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<Time>,
    /// The signals the autoscaler last read from the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_metrics: Option<CurrentMetrics>,
    /// Each adapter of `spec.model.adapters`: the ready replicas serving it, and why the
    /// others do not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<AdapterStatus>,
}

/// One adapter as the replicas serve it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AdapterStatus {
    /// The adapter's name, as in `spec.model.adapters`.
    pub name: String,
    /// Ready replicas that have it loaded.
    pub ready_replicas: i32,
    /// Why a ready replica does not (CamelCase: `LoadFailed`, `Loading`, `Unreachable`,
    /// `NoReadyReplicas`, `Pending`; for a service with `spec.auth`, `ApiKeyRefused` and the
    /// `ApiKeySecret…`/`ApiKeyMissing` reasons of reading its key), when one does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The runtime's own words for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Load signals read from the pods' /metrics, as the autoscaler uses them.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CurrentMetrics {
    /// Waiting requests per reporting replica (`vllm:num_requests_waiting`, averaged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_per_replica: Option<f64>,
    /// KV-cache usage fraction averaged over reporting replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_usage: Option<f64>,
    /// Waiting requests, summed over reporting replicas.
    pub requests_waiting: f64,
    /// Running requests, summed over reporting replicas.
    pub requests_running: f64,
    /// Replicas whose /metrics was read.
    pub reporting_replicas: i32,
}

/// The CRD as YAML, exactly as committed under `crds/`.
///
/// Every mapping's keys are sorted: JSON values inside the schema keep their insertion order
/// when any crate in the build turns on serde_json's `preserve_order` (the grammar engine
/// does), and the file must come out the same however the generator was built.
pub fn crd_yaml() -> Result<String, serde_yaml_ng::Error> {
    use kube::CustomResourceExt;
    generated_yaml(serde_yaml_ng::to_value(InferenceService::crd())?)
}

/// A generated CRD's file: the header, then the YAML with every mapping's keys sorted.
pub(crate) fn generated_yaml(crd: serde_yaml_ng::Value) -> Result<String, serde_yaml_ng::Error> {
    let yaml = serde_yaml_ng::to_string(&sorted(crd))?;
    Ok(format!(
        "# Generated by `cargo run -p ferrite-api --bin crdgen`; do not edit.\n{yaml}"
    ))
}

/// `v` with the keys of every mapping in order.
fn sorted(v: serde_yaml_ng::Value) -> serde_yaml_ng::Value {
    use serde_yaml_ng::Value;
    match v {
        Value::Mapping(m) => {
            let mut entries: Vec<(Value, Value)> = m.into_iter().collect();
            entries.sort_by(|(a, _), (b, _)| a.as_str().cmp(&b.as_str()));
            Value::Mapping(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Value::Sequence(s) => Value::Sequence(s.into_iter().map(sorted).collect()),
        other => other,
    }
}
