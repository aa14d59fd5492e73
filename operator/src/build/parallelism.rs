//! `spec.parallelism`: how one replica splits a model over GPUs, as vLLM does it. A replica
//! needs `tensor × pipeline × data` GPUs; each pod gets `resources.gpus` of them (absent: all).
//! The build step turns that into the pod's GPU count and vLLM's flags, and refuses what cannot
//! run: a runtime without parallelism (ferrite-server runs a model on one device), pods whose
//! GPUs do not divide the replica's, GPUs a replica would leave idle, and a replica spanning
//! several pods (multi-node, which needs a LeaderWorkerSet this operator does not render yet).

use ferrite_api::crd::{InferenceService, ParallelismSpec, RuntimeKind};

use super::BuildError;

/// The most GPUs one pod may take (`resources.gpus`' schema bound).
const MAX_GPUS_PER_POD: i64 = 16;

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
    let pods = if per_pod > 0 { needed / per_pod } else { 1 };
    if pods > 1 || needed > MAX_GPUS_PER_POD {
        return Err(BuildError::Parallelism(format!(
            "needs {needed} GPUs a replica, over {} pods of {per_pod}: a replica across nodes \
             needs a LeaderWorkerSet, which this operator does not render yet; fit a replica \
             in one pod (resources.gpus {needed}, at most {MAX_GPUS_PER_POD})",
            pods.max((needed + MAX_GPUS_PER_POD - 1) / MAX_GPUS_PER_POD)
        )));
    }
    Ok(())
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
