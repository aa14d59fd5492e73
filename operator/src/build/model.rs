//! Where the weights come from, and what the pod needs to reach them: the `--model` argument,
//! volumes, mounts and the environment. Downloads (`hf://`, `s3://`, `gs://`, `http(s)://`)
//! are the runtime's own: ferrite-server and vLLM fetch into the model cache (the claim, else
//! an emptyDir) at start, with credentials from `spec.model.secretRef`. No init container, no
//! package installed at run time.

use k8s_openapi::api::core::v1::{
    EmptyDirVolumeSource, EnvFromSource, EnvVar, PersistentVolumeClaimVolumeSource,
    SecretEnvSource, Volume, VolumeMount,
};

pub use ferrite_api::source::Source as ModelSource;
use ferrite_api::source::{HfSource, Scheme, Source};

use super::BuildError;
use ferrite_api::crd::{InferenceService, RuntimeKind};

/// Where model volumes are mounted in the pod (as KServe does).
pub const MODEL_ROOT: &str = "/mnt/models";
const MODEL_VOLUME: &str = "model";

/// Parses `spec.model.source` and checks that the runtime can read that form.
pub fn parse(isvc: &InferenceService) -> Result<ModelSource, BuildError> {
    let s = &isvc.spec.model.source;
    let source = Source::parse(s).map_err(|e| BuildError::ModelSource(s.clone(), e.why))?;
    if isvc.spec.runtime.kind == RuntimeKind::Vllm {
        let refuse = |why| Err(BuildError::ModelSource(s.clone(), why));
        match &source {
            Source::Hf(HfSource { file: Some(_), .. }) => {
                return refuse(
                    "vLLM downloads a whole repository (hf://<org>/<name>[@<revision>]); for one \
                     GGUF file use the ferrite runtime",
                );
            }
            Source::Object(o) if matches!(o.scheme, Scheme::Http | Scheme::Https) => {
                return refuse(
                    "vLLM streams s3:// and gs:// folders, not http(s) files; use the ferrite \
                     runtime or a claim",
                );
            }
            _ if isvc.spec.model.sha256.is_some() => {
                return refuse(
                    "model.sha256 is checked by ferrite-server, and vLLM has no way to check it; \
                     use the ferrite runtime or leave it out",
                );
            }
            _ => {}
        }
    }
    Ok(source)
}

/// The PersistentVolumeClaims the spec mounts, each with the field that names it: the model's
/// (from its parsed source, when it parsed) and the model cache's. They must exist before the
/// Deployment may reference them.
pub fn claims(model: Option<&ModelSource>, isvc: &InferenceService) -> Vec<(&'static str, String)> {
    let mut claims = Vec::new();
    if let Some(ModelSource::Pvc { claim, .. }) = model {
        claims.push(("model.source", claim.clone()));
    }
    if let Some(c) = &isvc.spec.model_cache {
        claims.push(("modelCache.claimName", c.claim_name.clone()));
    }
    for v in &isvc.spec.pod.volumes {
        if let Some(pvc) = &v.persistent_volume_claim {
            claims.push(("pod.volumes", pvc.claim_name.clone()));
        }
    }
    for claim in crate::build::adapters::claims(isvc) {
        claims.push(("model.adapters", claim));
    }
    claims
}

/// The claims `isvc` names, whether or not the rest of its spec validates (a claim appearing
/// later concerns it either way).
pub fn claims_of(isvc: &InferenceService) -> Vec<(&'static str, String)> {
    claims(
        ModelSource::parse(&isvc.spec.model.source).ok().as_ref(),
        isvc,
    )
}

/// What the pod template needs for the model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelMount {
    /// The runtime's `--model` value.
    pub model_arg: String,
    /// Runtime flags the source implies (vLLM's `--revision`, `--load-format`).
    pub args: Vec<String>,
    pub volumes: Vec<Volume>,
    pub mounts: Vec<VolumeMount>,
    pub env: Vec<EnvVar>,
    /// `spec.model.secretRef`, whole, as environment (HF_TOKEN, AWS_*, GOOGLE_*).
    pub env_from: Vec<EnvFromSource>,
}

fn mount(read_only: bool) -> VolumeMount {
    VolumeMount {
        name: MODEL_VOLUME.into(),
        mount_path: MODEL_ROOT.into(),
        read_only: Some(read_only),
        ..VolumeMount::default()
    }
}

/// The volume holding downloads: the model cache claim, else an emptyDir.
fn download_volume(isvc: &InferenceService) -> Volume {
    match &isvc.spec.model_cache {
        Some(c) => Volume {
            name: MODEL_VOLUME.into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: c.claim_name.clone(),
                read_only: Some(false),
            }),
            ..Volume::default()
        },
        None => Volume {
            name: MODEL_VOLUME.into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        },
    }
}

/// A download into the model cache: `HF_HOME` under the mount, which both runtimes (and the
/// Hub's own tools) read, so one cache claim serves either.
fn download(isvc: &InferenceService, model_arg: String, args: Vec<String>) -> ModelMount {
    ModelMount {
        model_arg,
        args,
        volumes: vec![download_volume(isvc)],
        mounts: vec![mount(false)],
        env: vec![EnvVar {
            name: "HF_HOME".into(),
            value: Some(format!("{MODEL_ROOT}/hf")),
            ..EnvVar::default()
        }],
        ..ModelMount::default()
    }
}

/// Resolves the parsed `source` for `isvc`'s runtime.
pub fn model_mount(isvc: &InferenceService, source: &ModelSource) -> ModelMount {
    let vllm = isvc.spec.runtime.kind == RuntimeKind::Vllm;
    let mut m = match source.clone() {
        Source::Path(p) => ModelMount {
            model_arg: p,
            ..ModelMount::default()
        },
        Source::Pvc { claim, path } => ModelMount {
            model_arg: format!("{MODEL_ROOT}/{path}"),
            volumes: vec![Volume {
                name: MODEL_VOLUME.into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim,
                    read_only: Some(true),
                }),
                ..Volume::default()
            }],
            mounts: vec![mount(true)],
            ..ModelMount::default()
        },
        // vLLM takes the repository id and the revision apart.
        Source::Hf(h) if vllm => {
            let args = h
                .revision
                .map(|r| vec!["--revision".to_string(), r])
                .unwrap_or_default();
            download(isvc, h.repo, args)
        }
        // vLLM streams object-store folders through the Run:ai model streamer.
        Source::Object(_) if vllm => download(
            isvc,
            isvc.spec.model.source.clone(),
            vec!["--load-format".into(), "runai_streamer".into()],
        ),
        // ferrite-server downloads every remote form itself, given the source as written.
        Source::Hf(_) | Source::Object(_) => {
            download(isvc, isvc.spec.model.source.clone(), Vec::new())
        }
    };
    if let Some(secret) = &isvc.spec.model.secret_ref {
        m.env_from.push(EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: secret.name.clone(),
                optional: Some(false),
            }),
            ..EnvFromSource::default()
        });
    }
    m
}
