//! The LoRA adapters one server serves, by the name a request gives in `model`: registered at
//! start from `--lora-modules` and, when runtime updates are allowed, by the endpoints in
//! `lora`. At most `--max-cpu-loras` are held in memory; past that the least recently used is
//! dropped and read again from its (local or downloaded) file when a request names it, as
//! vLLM's CPU cache pages adapters. A removed or paged-out adapter's running requests finish
//! with it; new ones cannot name a removed one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use ferrite_runtime::device::Device;
use ferrite_runtime::model::ModelConfig;
use ferrite_runtime::model::lora::{self, LoraAdapter, LoraDtype, LoraOptions};
use serde::Deserialize;

use super::error::ApiError;

/// Longest adapter name accepted (it travels in every response and in a metric label).
const MAX_NAME_LEN: usize = 128;
/// Most adapters registered at once, resident or not: each costs a table entry and a file.
pub const MAX_REGISTERED: usize = 1024;

/// What bounds the adapters a server holds.
#[derive(Debug, Clone)]
pub struct LoraSettings {
    /// Largest rank accepted (`--max-lora-rank`): bounds the memory and work per adapter.
    pub max_rank: usize,
    /// What factors are kept in (`--lora-dtype`).
    pub dtype: LoraDtype,
    /// Most adapters held in memory (`--max-cpu-loras`); more are paged in on use.
    pub max_resident: usize,
    /// Whether `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` may change the set.
    pub allow_runtime_updates: bool,
    /// Where downloads of adapter sources go.
    pub download_dir: PathBuf,
}

/// One adapter as `/v1/models` lists it.
#[derive(Debug, Clone)]
pub struct Listed {
    pub name: String,
    /// Where it was loaded from, as given.
    pub source: String,
    /// Unix seconds it was registered at.
    pub created: u64,
}

/// One registered adapter (`A`: the handle of one in memory; generic so the paging rule is
/// tested without loading adapters).
#[derive(Debug)]
struct Entry<A = Arc<LoraAdapter>> {
    source: String,
    /// The local file or folder it is read from (after any download).
    path: PathBuf,
    created: u64,
    /// In memory, or paged out.
    resident: Option<A>,
    /// The table's clock at its last use: the least recent is paged out first.
    used: u64,
}

#[derive(Debug)]
struct Table<A = Arc<LoraAdapter>> {
    entries: BTreeMap<String, Entry<A>>,
    clock: u64,
}

impl<A> Default for Table<A> {
    fn default() -> Self {
        Self {
            entries: BTreeMap::new(),
            clock: 0,
        }
    }
}

/// Why [`Table::register`] refused a name.
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    /// Another adapter has it.
    Taken,
    /// [`MAX_REGISTERED`] adapters are registered.
    Full,
}

impl<A> Table<A> {
    /// Registers `entry` as `name`, used now, unless the name is taken or the table full.
    fn register(&mut self, name: &str, entry: Entry<A>) -> Result<(), Refused> {
        if self.entries.contains_key(name) {
            return Err(Refused::Taken);
        }
        if self.entries.len() >= MAX_REGISTERED {
            return Err(Refused::Full);
        }
        self.entries.insert(name.to_string(), entry);
        self.touch(name);
        Ok(())
    }

    /// Marks `name` used now; returns it.
    fn touch(&mut self, name: &str) -> Option<&mut Entry<A>> {
        self.clock += 1;
        let now = self.clock;
        let e = self.entries.get_mut(name)?;
        e.used = now;
        Some(e)
    }

    /// Pages out the least recently used adapters other than `keep` until at most `max` are
    /// resident.
    fn page_out(&mut self, max: usize, keep: &str) {
        loop {
            let resident = self
                .entries
                .values()
                .filter(|e| e.resident.is_some())
                .count();
            if resident <= max {
                return;
            }
            let Some((name, e)) = self
                .entries
                .iter_mut()
                .filter(|(n, e)| e.resident.is_some() && n.as_str() != keep)
                .min_by_key(|(_, e)| e.used)
            else {
                return;
            };
            e.resident = None;
            tracing::info!(
                adapter = name.as_str(),
                "LoRA adapter paged out (--max-cpu-loras)"
            );
        }
    }
}

/// The adapters one server serves, by name.
#[derive(Debug)]
pub struct Adapters {
    settings: LoraSettings,
    model: ModelConfig,
    device: Device,
    table: Mutex<Table>,
}

impl Adapters {
    pub fn new(settings: LoraSettings, model: ModelConfig, device: Device) -> Self {
        Self {
            settings,
            model,
            device,
            table: Mutex::default(),
        }
    }

    pub fn settings(&self) -> &LoraSettings {
        &self.settings
    }

    fn table(&self) -> Result<MutexGuard<'_, Table>, ApiError> {
        self.table
            .lock()
            .map_err(|_| ApiError::internal("the adapter table's lock is poisoned"))
    }

    /// Whether an adapter named `name` is served (resident or not).
    pub fn contains(&self, name: &str) -> bool {
        self.table().is_ok_and(|t| t.entries.contains_key(name))
    }

    /// Every served adapter, by name.
    pub fn list(&self) -> Vec<Listed> {
        self.table()
            .map(|t| {
                t.entries
                    .iter()
                    .map(|(name, e)| Listed {
                        name: name.clone(),
                        source: e.source.clone(),
                        created: e.created,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The adapter named `name` for a request, read again from its file if it was paged out
    /// (`None`: no such adapter).
    pub async fn acquire(&self, name: &str) -> Result<Option<Arc<LoraAdapter>>, ApiError> {
        let path = {
            let mut t = self.table()?;
            match t.touch(name) {
                None => return Ok(None),
                Some(e) => match &e.resident {
                    Some(a) => return Ok(Some(a.clone())),
                    None => e.path.clone(),
                },
            }
        };
        let adapter = Arc::new(self.read(name, &path).await.map_err(|e| {
            ApiError::internal(format!("paging in adapter '{name}': {}", e.message))
        })?);
        let mut t = self.table()?;
        let Some(e) = t.touch(name) else {
            // Unloaded meanwhile: this request still runs with it, as one already running would.
            return Ok(Some(adapter));
        };
        let adapter = e.resident.get_or_insert(adapter).clone();
        t.page_out(self.settings.max_resident, name);
        tracing::info!(adapter = name, "LoRA adapter paged in");
        Ok(Some(adapter))
    }

    /// Reads and checks the adapter at `path`, off the async workers.
    async fn read(&self, name: &str, path: &Path) -> Result<LoraAdapter, ApiError> {
        let (name_owned, cfg, device) = (name.to_string(), self.model.clone(), self.device.clone());
        let path = path.to_path_buf();
        let opts = LoraOptions {
            max_rank: self.settings.max_rank,
            dtype: self.settings.dtype,
        };
        tokio::task::spawn_blocking(move || lora::load(&name_owned, &path, &cfg, &device, opts))
            .await
            .map_err(|e| ApiError::internal(format!("loading adapter '{name}' panicked: {e}")))?
            .map_err(|e| ApiError::bad_request(format!("loading adapter '{name}': {e}")))
    }

    /// Fetches `source` if it is remote, reads and checks the adapter and serves it as
    /// `name`, paging out the least recently used one past `--max-cpu-loras`. `taken` says
    /// whether a name is the base model's.
    pub async fn load(
        &self,
        name: &str,
        source: &str,
        taken: impl Fn(&str) -> bool,
    ) -> Result<(), ApiError> {
        check_name(name, &taken)?;
        let already = || {
            ApiError::bad_request(format!(
                "The lora adapter '{name}' has already been loaded."
            ))
        };
        if self.contains(name) {
            return Err(already());
        }
        let path = crate::fetch::resolve(source, &self.settings.download_dir, None)
            .await
            .map_err(|e| ApiError::bad_request(format!("fetching adapter '{name}': {e}")))?;
        let adapter = self.read(name, &path).await?;
        let (rank, bytes) = (adapter.rank(), adapter.bytes());
        let mut t = self.table()?;
        // The name is checked again under the lock: two loads of one name may have raced.
        let entry = Entry {
            source: source.to_string(),
            path,
            created: super::now_secs(),
            resident: Some(Arc::new(adapter)),
            used: 0,
        };
        match t.register(name, entry) {
            Err(Refused::Taken) => return Err(already()),
            Err(Refused::Full) => {
                return Err(ApiError::bad_request(format!(
                    "this server serves at most {MAX_REGISTERED} LoRA adapters; unload one first"
                )));
            }
            Ok(()) => {}
        }
        tracing::info!(adapter = name, source, rank, bytes, "LoRA adapter loaded");
        t.page_out(self.settings.max_resident, name);
        Ok(())
    }

    /// Stops serving `name`; requests already running with it finish.
    pub fn unload(&self, name: &str) -> Result<(), ApiError> {
        match self.table()?.entries.remove(name) {
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

    fn entry(resident: Option<u32>) -> Entry<u32> {
        Entry {
            source: String::new(),
            path: PathBuf::new(),
            created: 0,
            resident,
            used: 0,
        }
    }

    /// A client cannot grow the table past MAX_REGISTERED entries (each costs memory and a
    /// file), paged out or not, nor take a registered name; unloading one makes room.
    #[test]
    fn registration_stops_at_the_limit_and_names_stay_unique() {
        let mut t: Table<u32> = Table::default();
        for i in 0..MAX_REGISTERED {
            assert_eq!(t.register(&format!("a{i}"), entry(None)), Ok(()));
        }
        assert_eq!(t.register("one-more", entry(Some(1))), Err(Refused::Full));
        assert_eq!(t.register("a0", entry(None)), Err(Refused::Taken));
        assert_eq!(t.entries.len(), MAX_REGISTERED);
        t.entries.remove("a7");
        assert_eq!(t.register("one-more", entry(Some(1))), Ok(()));
        assert_eq!(
            t.entries["one-more"].used, t.clock,
            "registered as used now"
        );
    }

    /// Paging keeps the most recently used resident, never the one just used, and leaves
    /// paged-out entries registered.
    #[test]
    fn the_least_recently_used_adapters_are_paged_out_first() {
        let mut t: Table<u32> = Table::default();
        for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
            assert_eq!(t.register(name, entry(Some(i as u32))), Ok(()));
        }
        let resident = |t: &Table<u32>| -> Vec<String> {
            t.entries
                .iter()
                .filter(|(_, e)| e.resident.is_some())
                .map(|(n, _)| n.clone())
                .collect()
        };
        t.touch("a");
        t.page_out(2, "c");
        assert_eq!(resident(&t), ["a", "c"], "b was used least recently");
        t.page_out(1, "c");
        assert_eq!(
            resident(&t),
            ["c"],
            "the one kept stays even when least recent"
        );
        assert_eq!(t.entries.len(), 3, "paged-out adapters stay registered");
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
