//! The LoRA adapters one server serves, by the name a request gives in `model`: loaded at
//! start from `--lora-modules` and, when runtime updates are allowed, by the endpoints in
//! `lora`. A removed adapter's running requests finish with it; new ones cannot name it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use ferrite_runtime::device::Device;
use ferrite_runtime::model::ModelConfig;
use ferrite_runtime::model::lora::{self, LoraAdapter, LoraDtype, LoraOptions};
use serde::Deserialize;

use super::error::ApiError;

/// Longest adapter name accepted (it travels in every response and in a metric label).
const MAX_NAME_LEN: usize = 128;

/// What bounds the adapters a server holds.
#[derive(Debug, Clone)]
pub struct LoraSettings {
    /// Largest rank accepted (`--max-lora-rank`): bounds the memory and work per adapter.
    pub max_rank: usize,
    /// What factors are kept in (`--lora-dtype`).
    pub dtype: LoraDtype,
    /// Most adapters loaded at once (`--max-cpu-loras`): bounds what runtime loads can hold.
    pub max_loaded: usize,
    /// Whether `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` may change the set.
    pub allow_runtime_updates: bool,
    /// Where downloads of adapter sources go.
    pub download_dir: PathBuf,
}

/// One served adapter.
#[derive(Debug)]
pub struct ServedAdapter {
    pub adapter: Arc<LoraAdapter>,
    /// Where it was loaded from, as given.
    pub source: String,
    /// Unix seconds it was loaded at.
    pub created: u64,
}

/// The adapters one server serves, by name.
#[derive(Debug)]
pub struct Adapters {
    settings: LoraSettings,
    model: ModelConfig,
    device: Device,
    by_name: RwLock<BTreeMap<String, Arc<ServedAdapter>>>,
}

impl Adapters {
    pub fn new(settings: LoraSettings, model: ModelConfig, device: Device) -> Self {
        Self {
            settings,
            model,
            device,
            by_name: RwLock::default(),
        }
    }

    pub fn settings(&self) -> &LoraSettings {
        &self.settings
    }

    /// The adapter named `name`, if this server serves one.
    pub fn get(&self, name: &str) -> Option<Arc<ServedAdapter>> {
        self.by_name.read().ok()?.get(name).cloned()
    }

    /// Every served adapter, by name.
    pub fn list(&self) -> Vec<(String, Arc<ServedAdapter>)> {
        self.by_name
            .read()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    /// Fetches `source` if it is remote, reads the adapter and serves it as `name`. `taken`
    /// says whether a name is the base model's. Reads files: call off the async workers'
    /// critical path (the handler runs it on the blocking pool).
    pub async fn load(
        &self,
        name: &str,
        source: &str,
        taken: impl Fn(&str) -> bool,
    ) -> Result<(), ApiError> {
        check_name(name, &taken)?;
        if self.get(name).is_some() {
            return Err(ApiError::bad_request(format!(
                "The lora adapter '{name}' has already been loaded."
            )));
        }
        let path = crate::fetch::resolve(source, &self.settings.download_dir, None)
            .await
            .map_err(|e| ApiError::bad_request(format!("fetching adapter '{name}': {e}")))?;
        let (name_owned, cfg, device) = (name.to_string(), self.model.clone(), self.device.clone());
        let opts = LoraOptions {
            max_rank: self.settings.max_rank,
            dtype: self.settings.dtype,
        };
        let adapter = tokio::task::spawn_blocking(move || {
            lora::load(&name_owned, &path, &cfg, &device, opts)
        })
        .await
        .map_err(|e| ApiError::internal(format!("loading adapter '{name}' panicked: {e}")))?
        .map_err(|e| ApiError::bad_request(format!("loading adapter '{name}': {e}")))?;
        let mut map = self
            .by_name
            .write()
            .map_err(|_| ApiError::internal("the adapter table's lock is poisoned"))?;
        // Checked again under the lock: two loads of one name may have raced.
        if map.contains_key(name) {
            return Err(ApiError::bad_request(format!(
                "The lora adapter '{name}' has already been loaded."
            )));
        }
        if map.len() >= self.settings.max_loaded {
            return Err(ApiError::bad_request(format!(
                "this server holds at most {} LoRA adapters (--max-cpu-loras); unload one first",
                self.settings.max_loaded
            )));
        }
        tracing::info!(
            adapter = name,
            source,
            rank = adapter.rank(),
            bytes = adapter.bytes(),
            "LoRA adapter loaded"
        );
        map.insert(
            name.to_string(),
            Arc::new(ServedAdapter {
                adapter: Arc::new(adapter),
                source: source.to_string(),
                created: super::now_secs(),
            }),
        );
        Ok(())
    }

    /// Stops serving `name`; requests already running with it finish.
    pub fn unload(&self, name: &str) -> Result<(), ApiError> {
        let mut map = self
            .by_name
            .write()
            .map_err(|_| ApiError::internal("the adapter table's lock is poisoned"))?;
        match map.remove(name) {
            Some(_) => {
                tracing::info!(adapter = name, "LoRA adapter unloaded");
                Ok(())
            }
            None => Err(ApiError::not_found(format!(
                "The lora adapter '{name}' cannot be found."
            ))),
        }
    }
}

/// A name clients can send in `model` and that is not the base model's.
fn check_name(name: &str, taken: &impl Fn(&str) -> bool) -> Result<(), ApiError> {
    if name.is_empty()
        || name.len() > MAX_NAME_LEN
        || name.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(ApiError::invalid_param(
            "lora_name",
            format!(
                "an adapter name is 1 to {MAX_NAME_LEN} characters without spaces or control \
                 characters"
            ),
        ));
    }
    if taken(name) {
        return Err(ApiError::invalid_param(
            "lora_name",
            format!("'{name}' is the base model's name"),
        ));
    }
    Ok(())
}

/// `--lora-modules` entries: `name=source`, or vLLM's JSON form `{"name": ..., "path": ...}`.
pub fn parse_module(s: &str) -> Result<(String, String), String> {
    #[derive(Deserialize)]
    struct Json {
        name: String,
        path: String,
    }
    if s.trim_start().starts_with('{') {
        let j: Json = serde_json::from_str(s).map_err(|e| format!("{s}: {e}"))?;
        return Ok((j.name, j.path));
    }
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), path.to_string()))
        }
        _ => Err(format!(
            "{s}: expected name=path or {{\"name\": ..., \"path\": ...}}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_parse_in_both_forms() {
        assert_eq!(
            parse_module("sql=/adapters/sql"),
            Ok(("sql".into(), "/adapters/sql".into()))
        );
        assert_eq!(
            parse_module(r#"{"name": "sql", "path": "hf://org/sql-lora", "base_model_name": "x"}"#),
            Ok(("sql".into(), "hf://org/sql-lora".into()))
        );
        for bad in ["sql", "=x", "sql=", "{\"name\": 1}"] {
            assert!(parse_module(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_must_be_usable_in_model() {
        let base = |n: &str| n == "base";
        assert!(check_name("sql-v2", &base).is_ok());
        assert!(check_name("base", &base).is_err());
        assert!(check_name("", &base).is_err());
        assert!(check_name("a b", &base).is_err());
        assert!(check_name(&"x".repeat(MAX_NAME_LEN + 1), &base).is_err());
    }
}
