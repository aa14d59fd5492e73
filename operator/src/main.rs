//! ferrite-operator: the kube-rs controller for `InferenceService` (group `ferrite.dev`).
//!
//! Only the crate exists so far; the CRD, reconciler and autoscaler are tracked as their own
//! issues. Running it says so instead of pretending to work.

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().init();
    tracing::error!("ferrite-operator has no controller yet");
    anyhow::bail!("ferrite-operator: the InferenceService controller is not implemented yet")
}
