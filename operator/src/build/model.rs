//! Where the weights come from, and what the pod needs to reach them: the `--model` argument,
//! volumes, mounts, and for `hf://` with ferrite an init container that downloads them.

use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, EnvVar, PersistentVolumeClaimVolumeSource, Volume, VolumeMount,
};

use super::BuildError;
use crate::crd::{InferenceService, RuntimeKind};

/// Where model volumes are mounted in the pod (as KServe does).
pub const MODEL_ROOT: &str = "/mnt/models";
const MODEL_VOLUME: &str = "model";

/// A parsed `spec.model.source`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// An absolute path inside the image, or in a volume of `pod.volumes`.
    Path(String),
    /// `pvc://claim/path`.
    Pvc { claim: String, path: String },
    /// `hf://org/name[/file]`.
    HuggingFace { repo: String, file: Option<String> },
}

impl ModelSource {
    pub fn parse(s: &str) -> Result<Self, BuildError> {
        let bad = |why| BuildError::ModelSource(s.to_string(), why);
        if let Some(rest) = s.strip_prefix("pvc://") {
            let (claim, path) = rest
                .split_once('/')
                .ok_or_else(|| bad("expected pvc://<claim>/<path>"))?;
            if claim.is_empty() || path.is_empty() {
                return Err(bad("expected pvc://<claim>/<path>"));
            }
            if path.split('/').any(|p| p == "..") {
                return Err(bad("the path must stay inside the claim"));
            }
            return Ok(Self::Pvc {
                claim: claim.into(),
                path: path.trim_end_matches('/').into(),
            });
        }
        if let Some(rest) = s.strip_prefix("hf://") {
            let parts: Vec<&str> = rest.splitn(3, '/').collect();
            return match parts.as_slice() {
                [org, name] | [org, name, ""] if !org.is_empty() && !name.is_empty() => {
                    Ok(Self::HuggingFace {
                        repo: format!("{org}/{name}"),
                        file: None,
                    })
                }
                [org, name, file] if !org.is_empty() && !name.is_empty() => {
                    if file.split('/').any(|p| p == "..") {
                        return Err(bad("the file must stay inside the repository"));
                    }
                    Ok(Self::HuggingFace {
                        repo: format!("{org}/{name}"),
                        file: Some((*file).into()),
                    })
                }
                _ => Err(bad("expected hf://<org>/<name>[/<file>]")),
            };
        }
        if s.starts_with('/') {
            return Ok(Self::Path(s.into()));
        }
        Err(bad("expected an absolute path, pvc:// or hf://"))
    }
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
    pub volumes: Vec<Volume>,
    pub mounts: Vec<VolumeMount>,
    pub init_containers: Vec<Container>,
    pub env: Vec<EnvVar>,
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

/// Resolves the parsed `source` for `isvc`'s runtime.
pub fn model_mount(
    isvc: &InferenceService,
    source: &ModelSource,
    downloader_image: &str,
    security: &k8s_openapi::api::core::v1::SecurityContext,
) -> ModelMount {
    match source.clone() {
        ModelSource::Path(p) => ModelMount {
            model_arg: p,
            ..ModelMount::default()
        },
        ModelSource::Pvc { claim, path } => ModelMount {
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
        // vLLM downloads by itself into HF_HOME.
        ModelSource::HuggingFace { repo, file } if isvc.spec.runtime.kind == RuntimeKind::Vllm => {
            let model_arg = match file {
                Some(f) => format!("{repo}/{f}"),
                None => repo,
            };
            ModelMount {
                model_arg,
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
        // ferrite reads local files: an init container fetches them first (skipping files
        // already in the cache).
        ModelSource::HuggingFace { repo, file } => {
            let dir = format!("{MODEL_ROOT}/{repo}");
            let model_arg = match &file {
                Some(f) => format!("{dir}/{f}"),
                None => dir.clone(),
            };
            // The repository and file travel as environment variables, never through the shell.
            let script = "set -eu; pip install --quiet --no-cache-dir --target /tmp/py \
                          huggingface_hub; PYTHONPATH=/tmp/py python -c \"\
                          import os, huggingface_hub as h; f = os.environ.get('MODEL_FILE'); \
                          (h.hf_hub_download(os.environ['MODEL_REPO'], f, local_dir=os.environ['MODEL_DIR']) \
                          if f else h.snapshot_download(os.environ['MODEL_REPO'], local_dir=os.environ['MODEL_DIR']))\""
                .to_string();
            let var = |name: &str, value: String| EnvVar {
                name: name.into(),
                value: Some(value),
                ..EnvVar::default()
            };
            let mut env = vec![
                var("MODEL_REPO", repo.clone()),
                var("MODEL_DIR", dir.clone()),
                var("HF_HOME", format!("{MODEL_ROOT}/hf")),
                var("HOME", "/tmp".into()),
            ];
            if let Some(f) = &file {
                env.push(var("MODEL_FILE", f.clone()));
            }
            let init = Container {
                name: "model-download".into(),
                image: Some(downloader_image.into()),
                command: Some(vec!["sh".into(), "-c".into(), script]),
                env: Some(env),
                volume_mounts: Some(vec![
                    mount(false),
                    VolumeMount {
                        name: "tmp".into(),
                        mount_path: "/tmp".into(),
                        ..VolumeMount::default()
                    },
                ]),
                security_context: Some(security.clone()),
                ..Container::default()
            };
            ModelMount {
                model_arg,
                volumes: vec![download_volume(isvc)],
                mounts: vec![mount(true)],
                init_containers: vec![init],
                ..ModelMount::default()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_source_form() {
        assert_eq!(
            ModelSource::parse("/models/a.gguf"),
            Ok(ModelSource::Path("/models/a.gguf".into()))
        );
        assert_eq!(
            ModelSource::parse("pvc://weights/llama/8b/"),
            Ok(ModelSource::Pvc {
                claim: "weights".into(),
                path: "llama/8b".into()
            })
        );
        assert_eq!(
            ModelSource::parse("hf://HuggingFaceTB/SmolLM2-135M-Instruct"),
            Ok(ModelSource::HuggingFace {
                repo: "HuggingFaceTB/SmolLM2-135M-Instruct".into(),
                file: None
            })
        );
        assert_eq!(
            ModelSource::parse("hf://org/repo/q4/model.gguf"),
            Ok(ModelSource::HuggingFace {
                repo: "org/repo".into(),
                file: Some("q4/model.gguf".into())
            })
        );
    }

    #[test]
    fn rejects_malformed_sources_with_the_reason() {
        for bad in [
            "pvc://claim",
            "pvc:///x",
            "pvc://c/../etc",
            "hf://only-org",
            "hf://org/repo/../../x",
            "models/a.gguf",
            "s3://bucket/x",
        ] {
            let e = ModelSource::parse(bad).expect_err(bad);
            assert!(
                matches!(e, BuildError::ModelSource(ref s, _) if s == bad),
                "{e}"
            );
        }
    }
}
