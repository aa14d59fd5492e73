//! `spec.parallelism`: how one replica splits a model over GPUs, as vLLM does it. A replica
//! needs `tensor × pipeline × data` GPUs; each pod gets `resources.gpus` of them (absent: all,
//! in one pod). The build step turns that into the pod's GPU count, the pods a replica spans
//! and vLLM's flags, and refuses what cannot run: a runtime without parallelism
//! (ferrite-server runs a model on one device), pods whose GPUs do not divide the replica's,
//! GPUs a replica would leave idle, and data parallelism across pods. A replica of several
//! pods is a LeaderWorkerSet group (`super::lws`).

use ferrite_api::crd::{InferenceService, ParallelismSpec, RuntimeKind};

use super::BuildError;

/// The most GPUs one pod may take (`resources.gpus`' schema bound).
const MAX_GPUS_PER_POD: i64 = 16;
/// The most pods one replica may span (a group of 64 nodes: 512 GPUs of 8 per node).
const MAX_PODS_PER_REPLICA: i64 = 64;

/// GPUs each pod of `isvc` requests: `resources.gpus`, else what its parallelism needs when
/// that is more than one GPU, else 0 (sizes of 1 split nothing and ask for no GPU).
pub fn gpus_per_pod(isvc: &InferenceService) -> i32 {
    match (isvc.spec.resources.gpus, &isvc.spec.parallelism) {
        (Some(g), _) => g,
        (None, Some(p)) if p.gpus() > 1 => {
            i32::try_from(p.gpus().min(MAX_GPUS_PER_POD)).unwrap_or(0)
        }
        (None, _) => 0,
    }
}

/// Refuses a parallelism that cannot run (see the module doc).
pub(crate) fn check(isvc: &InferenceService) -> Result<(), BuildError> {
    let Some(p) = &isvc.spec.parallelism else {
        return Ok(());
    };
    let needed = p.gpus();
    let trivial = needed == 1 && p.expert != Some(true);
    if isvc.spec.runtime.kind == RuntimeKind::Ferrite && !trivial {
        return Err(BuildError::Parallelism(
            "is vLLM's: ferrite-server runs a model on one device (use runtime.kind vllm, or \
             drop parallelism)"
                .into(),
        ));
    }
    let per_pod = i64::from(gpus_per_pod(isvc));
    if isvc.spec.resources.gpus.is_none() && needed > MAX_GPUS_PER_POD {
        return Err(BuildError::Parallelism(format!(
            "needs {needed} GPUs a replica, more than one pod may take ({MAX_GPUS_PER_POD}): set \
             resources.gpus to the GPUs of one node, and a replica spans that many pods"
        )));
    }
    if !trivial && per_pod == 0 {
        return Err(BuildError::Parallelism(format!(
            "needs {needed} GPUs a replica, and resources.gpus is 0"
        )));
    }
    if per_pod > needed && !trivial {
        return Err(BuildError::Parallelism(format!(
            "needs {needed} GPUs a replica, and resources.gpus {per_pod} would leave {} idle",
            per_pod - needed
        )));
    }
    if per_pod > 0 && needed % per_pod != 0 {
        return Err(BuildError::Parallelism(format!(
            "tensor × pipeline × data = {needed} GPUs a replica does not split into pods of \
             resources.gpus {per_pod}"
        )));
    }
    let pods = i64::from(pods_per_replica(isvc));
    if pods > MAX_PODS_PER_REPLICA {
        return Err(BuildError::Parallelism(format!(
            "needs {needed} GPUs a replica, over {pods} pods of {per_pod}: at most \
             {MAX_PODS_PER_REPLICA} pods a replica; give each pod more GPUs"
        )));
    }
    if pods > 1 && p.data.unwrap_or(1) > 1 {
        return Err(BuildError::Parallelism(format!(
            "data {} across {pods} pods: a replica spanning pods splits the model with tensor \
             and pipeline parallelism only; scale replicas (each its own group) instead",
            p.data.unwrap_or(1)
        )));
    }
    Ok(())
}

/// Pods one replica spans: `tensor × pipeline × data` over `resources.gpus` (1 without GPUs
/// or parallelism). Meaningful once [`check`] passed.
pub fn pods_per_replica(isvc: &InferenceService) -> i32 {
    let (Some(p), per_pod) = (&isvc.spec.parallelism, i64::from(gpus_per_pod(isvc))) else {
        return 1;
    };
    if per_pod <= 0 {
        return 1;
    }
    i32::try_from(p.gpus() / per_pod).unwrap_or(1).max(1)
}

/// vLLM's flags for `p` (sizes of 1 left to vLLM's defaults).
pub fn vllm_args(p: &ParallelismSpec) -> Vec<String> {
    let mut a = Vec::new();
    for (flag, size) in [
        ("--tensor-parallel-size", p.tensor),
        ("--pipeline-parallel-size", p.pipeline),
        ("--data-parallel-size", p.data),
    ] {
        if let Some(n) = size.filter(|n| *n > 1) {
            a.push(flag.to_string());
            a.push(n.to_string());
        }
    }
    if p.expert == Some(true) {
        a.push("--enable-expert-parallel".into());
    }
    a
}
