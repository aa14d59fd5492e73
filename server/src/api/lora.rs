//! vLLM's endpoints for changing the adapters of a running server, allowed only when
//! runtime updates are (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`): `POST /v1/load_lora_adapter`
//! and `/v1/unload_lora_adapter`, with vLLM's answers.

use std::sync::Arc;

use axum::extract::State;
use serde::Deserialize;

use super::adapters::Adapters;
use super::error::ApiError;
use super::extract::JsonBody;
use super::state::AppState;

#[derive(Debug, Deserialize)]
pub struct LoadRequest {
    pub lora_name: String,
    pub lora_path: String,
}

#[derive(Debug, Deserialize)]
pub struct UnloadRequest {
    pub lora_name: String,
}

/// The adapter table, when runtime updates are on.
fn updatable(state: &AppState) -> Result<&Adapters, ApiError> {
    let serving = state.serving()?;
    match &serving.adapters {
        Some(a) if a.settings().allow_runtime_updates => Ok(a),
        Some(_) => Err(ApiError::not_found(
            "runtime LoRA updates are off (set VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
        )),
        None => Err(ApiError::not_found(
            "LoRA is not enabled on this server (--enable-lora)",
        )),
    }
}

/// `POST /v1/load_lora_adapter`.
pub async fn load_adapter(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<LoadRequest>,
) -> Result<String, ApiError> {
    let adapters = updatable(&state)?;
    adapters
        .load(&req.lora_name, &req.lora_path, |n| state.is_base_name(n))
        .await?;
    Ok(format!(
        "Success: LoRA adapter '{}' added successfully.",
        req.lora_name
    ))
}

/// `POST /v1/unload_lora_adapter`.
pub async fn unload_adapter(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<UnloadRequest>,
) -> Result<String, ApiError> {
    updatable(&state)?.unload(&req.lora_name)?;
    Ok(format!(
        "Success: LoRA adapter '{}' removed successfully.",
        req.lora_name
    ))
}
