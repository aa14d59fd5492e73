//! What the pods need for LoRA: the runtime's limits as flags, runtime updates allowed (the
//! operator loads `spec.model.adapters` through the API, see [`crate::adapters`]), and the
//! claims and Secrets the adapters' sources use. Nothing here depends on which adapters are
//! listed beyond those claims and Secrets, so editing the list leaves the pod template alone.

use k8s_openapi::api::core::v1::{
    EnvFromSource, EnvVar, PersistentVolumeClaimVolumeSource, SecretEnvSource, Volume, VolumeMount,
};

use super::BuildError;
use crate::build::adapters::{ADAPTER_ROOT, claims, lora_enabled};
use ferrite_api::crd::{InferenceService, LoraSpec, RuntimeKind};

/// `--max-loras` unless `lora.maxAdapters` says otherwise (vLLM's own default, 1, would make
/// requests for a second adapter wait behind the first).
pub const DEFAULT_MAX_ADAPTERS: i32 = 4;
/// `--max-lora-rank` by default (vLLM's and ferrite's default).
pub const DEFAULT_MAX_RANK: i32 = 16;
/// `--max-cpu-loras` by default: fixed, so adding an adapter changes no flag.
pub const DEFAULT_MAX_CPU_ADAPTERS: i32 = 16;
/// The ranks vLLM accepts for `--max-lora-rank`.
const VLLM_RANKS: [i32; 9] = [1, 8, 16, 32, 64, 128, 256, 320, 512];

fn spec(isvc: &InferenceService) -> LoraSpec {
    isvc.spec.model.lora.clone().unwrap_or_default()
}

/// Most adapters one replica keeps in memory.
pub fn max_cpu_adapters(isvc: &InferenceService) -> i32 {
    let l = spec(isvc);
    l.max_cpu_adapters
        .unwrap_or(DEFAULT_MAX_CPU_ADAPTERS.max(l.max_adapters.unwrap_or(0)))
}

/// Limits the runtime would refuse at start.
pub fn check(isvc: &InferenceService) -> Result<(), BuildError> {
    let rank = spec(isvc).max_rank.unwrap_or(DEFAULT_MAX_RANK);
    if isvc.spec.runtime.kind == RuntimeKind::Vllm && !VLLM_RANKS.contains(&rank) {
        return Err(BuildError::Adapter(format!(
            "lora.maxRank {rank}: vLLM accepts only {VLLM_RANKS:?}"
        )));
    }
    Ok(())
}

/// The runtime's LoRA flags, when LoRA is on.
pub fn args(isvc: &InferenceService) -> Vec<String> {
    if !lora_enabled(isvc) {
        return Vec::new();
    }
    let l = spec(isvc);
    vec![
        "--enable-lora".into(),
        "--max-loras".into(),
        l.max_adapters.unwrap_or(DEFAULT_MAX_ADAPTERS).to_string(),
        "--max-lora-rank".into(),
        l.max_rank.unwrap_or(DEFAULT_MAX_RANK).to_string(),
        "--max-cpu-loras".into(),
        max_cpu_adapters(isvc).to_string(),
    ]
}

/// Runtime loading and unloading allowed (the variable both runtimes read).
pub fn env(isvc: &InferenceService) -> Vec<EnvVar> {
    if !lora_enabled(isvc) {
        return Vec::new();
    }
    vec![EnvVar {
        name: "VLLM_ALLOW_RUNTIME_LORA_UPDATING".into(),
        value: Some("True".into()),
        ..EnvVar::default()
    }]
}

/// Each claim an adapter names, mounted read-only at `/mnt/adapters/<claim>`. The volume is
/// named from a hash of the claim, so its name stays put as adapters come and go.
pub fn volumes(isvc: &InferenceService) -> (Vec<Volume>, Vec<VolumeMount>) {
    claims(isvc)
        .into_iter()
        .map(|claim| {
            let name = format!(
                "adapters-{:08x}",
                ferrite_api::hash::fnv1a(claim.as_bytes()) as u32
            );
            let volume = Volume {
                name: name.clone(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.clone(),
                    read_only: Some(true),
                }),
                ..Volume::default()
            };
            let mount = VolumeMount {
                name,
                mount_path: format!("{ADAPTER_ROOT}/{claim}"),
                read_only: Some(true),
                ..VolumeMount::default()
            };
            (volume, mount)
        })
        .unzip()
}

/// The adapters' Secrets, each once and not the model's own, as environment.
pub fn env_from(isvc: &InferenceService) -> Vec<EnvFromSource> {
    let model = isvc.spec.model.secret_ref.as_ref().map(|s| s.name.as_str());
    let mut names: Vec<&str> = Vec::new();
    for a in &isvc.spec.model.adapters {
        if let Some(s) = &a.secret_ref
            && Some(s.name.as_str()) != model
            && !names.contains(&s.name.as_str())
        {
            names.push(&s.name);
        }
    }
    names
        .into_iter()
        .map(|name| EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: name.to_string(),
                optional: Some(false),
            }),
            ..EnvFromSource::default()
        })
        .collect()
}
