//! LoRA adapters declared in `spec.model.adapters`, kept loaded on the running replicas
//! through the runtime's load/unload API, so editing the list restarts no pod. What to load
//! and what status says are pure, in `build::adapters`.

pub mod client;
pub mod sync;
