//! What `spec.model.adapters` implies: the path each runtime loads an adapter from, the
//! claims they mount, what each replica must load and unload, and what `status.adapters`
//! says of them. Pure: `crate::adapters::sync` does the I/O.

use std::collections::BTreeMap;

use ferrite_api::crd::{AdapterStatus, InferenceService, RuntimeKind};
use ferrite_api::source::{HfSource, Source};

/// Where adapter claims are mounted: `/mnt/adapters/<claim>`.
pub const ADAPTER_ROOT: &str = "/mnt/adapters";

/// One adapter as its runtime is asked to load it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub name: String,
    /// The `lora_path` sent to `/v1/load_lora_adapter`; the runtime lists it back as the
    /// adapter's `root` in `/v1/models`, which is how a changed source is noticed.
    pub path: String,
}

/// Why an adapter's source cannot be served by the runtime.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model.adapters {name:?}: source {given:?}: {why}")]
pub struct InvalidAdapter {
    pub name: String,
    pub given: String,
    pub why: String,
}

/// Whether `isvc`'s replicas run with LoRA on: adapters are declared or `lora` is set.
pub fn lora_enabled(isvc: &InferenceService) -> bool {
    isvc.spec.model.lora.is_some() || !isvc.spec.model.adapters.is_empty()
}

/// The adapters `isvc` declares, each with the path its runtime loads it from.
pub fn wanted(isvc: &InferenceService) -> Result<Vec<Wanted>, InvalidAdapter> {
    let vllm = isvc.spec.runtime.kind == RuntimeKind::Vllm;
    isvc.spec
        .model
        .adapters
        .iter()
        .map(|a| {
            let refuse = |why: &str| InvalidAdapter {
                name: a.name.clone(),
                given: a.source.clone(),
                why: why.to_string(),
            };
            let source = Source::parse(&a.source).map_err(|e| refuse(e.why))?;
            let path = match source {
                Source::Path(p) => p,
                Source::Pvc { claim, path } => format!("{ADAPTER_ROOT}/{claim}/{path}"),
                Source::Hf(HfSource {
                    repo,
                    revision: None,
                    file: None,
                }) if vllm => repo,
                Source::Hf(_) if vllm => {
                    return Err(refuse(
                        "vLLM loads an adapter repository whole at its default revision \
                         (hf://<org>/<name>); for a revision or one file use the ferrite runtime",
                    ));
                }
                Source::Object(o) if vllm => {
                    return Err(refuse(&format!(
                        "vLLM cannot load an adapter from {}://; use a path, pvc:// or hf://, \
                         or the ferrite runtime",
                        o.scheme.as_str()
                    )));
                }
                // ferrite-server fetches every remote form itself, given the source as written.
                Source::Hf(_) | Source::Object(_) => a.source.clone(),
            };
            Ok(Wanted {
                name: a.name.clone(),
                path,
            })
        })
        .collect()
}

/// The claims the adapters mount, each once, in order of first use.
pub fn claims(isvc: &InferenceService) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for a in &isvc.spec.model.adapters {
        if let Ok(Source::Pvc { claim, .. }) = Source::parse(&a.source)
            && !out.contains(&claim)
        {
            out.push(claim);
        }
    }
    out
}

/// What one replica serves: adapter name → the path (`root`) it was loaded from.
pub type Resident = BTreeMap<String, String>;

/// The calls that bring one replica to the wanted set: unloads first (they free room under
/// `--max-cpu-loras`), then loads. An adapter whose source changed is unloaded and loaded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub unload: Vec<String>,
    pub load: Vec<Wanted>,
}

pub fn plan(wanted: &[Wanted], resident: &Resident) -> Plan {
    let current = |w: &Wanted| resident.get(&w.name) == Some(&w.path);
    let unload = resident
        .iter()
        .filter(|(name, root)| !wanted.iter().any(|w| &w.name == *name && &w.path == *root))
        .map(|(name, _)| name.clone())
        .collect();
    let load = wanted.iter().filter(|w| !current(w)).cloned().collect();
    Plan { unload, load }
}

/// Where one adapter stands on one ready replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Loaded,
    /// The runtime refused or failed the load (this time, or the last time while its retry
    /// is not due); its words.
    Failed(String),
}

/// One ready replica: what became of each wanted adapter, or why it could not be reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replica {
    Reached(BTreeMap<String, Outcome>),
    Unreachable(String),
    /// It answered 401/403: the service's API key is not the one it runs with.
    Refused(String),
}

/// Reasons that say more than a wait or an unreachable pod, and so win the summary.
const DECISIVE: [&str; 2] = ["LoadFailed", "ApiKeyRefused"];

/// `status.adapters`: per wanted adapter, the ready replicas serving it, and the first
/// reason another does not.
pub fn summarize(wanted: &[Wanted], replicas: &[Replica]) -> Vec<AdapterStatus> {
    wanted
        .iter()
        .map(|w| {
            let mut ready = 0;
            let mut why: Option<(&str, String)> = None;
            for r in replicas {
                let miss = match r {
                    Replica::Reached(m) => match m.get(&w.name) {
                        Some(Outcome::Loaded) => {
                            ready += 1;
                            continue;
                        }
                        Some(Outcome::Failed(msg)) => ("LoadFailed", msg.clone()),
                        None => ("Loading", "not loaded yet".to_string()),
                    },
                    Replica::Unreachable(msg) => ("Unreachable", msg.clone()),
                    Replica::Refused(msg) => ("ApiKeyRefused", msg.clone()),
                };
                if why.as_ref().is_none_or(|(r, _)| !DECISIVE.contains(r)) {
                    why = Some(miss);
                }
            }
            if replicas.is_empty() {
                why = Some(("NoReadyReplicas", "no replica is ready".to_string()));
            }
            AdapterStatus {
                name: w.name.clone(),
                ready_replicas: ready,
                reason: why.as_ref().map(|(r, _)| r.to_string()),
                message: why.map(|(_, m)| m),
            }
        })
        .collect()
}

/// `status.adapters` for the adapters `isvc` declares now, from the sync's last `view`: one
/// it has not synced yet shows as pending.
pub fn status_of(isvc: &InferenceService, view: Vec<AdapterStatus>) -> Vec<AdapterStatus> {
    isvc.spec
        .model
        .adapters
        .iter()
        .map(|a| {
            view.iter()
                .find(|s| s.name == a.name)
                .cloned()
                .unwrap_or_else(|| AdapterStatus {
                    name: a.name.clone(),
                    ready_replicas: 0,
                    reason: Some("Pending".into()),
                    message: Some("the operator has not synced the replicas yet".into()),
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(name: &str, path: &str) -> Wanted {
        Wanted {
            name: name.into(),
            path: path.into(),
        }
    }

    #[test]
    fn the_plan_unloads_the_undeclared_and_reloads_a_moved_source() {
        let wanted = [w("a", "/x/a"), w("b", "/x/b2"), w("c", "/x/c")];
        let resident = Resident::from([
            ("a".into(), "/x/a".into()),
            ("b".into(), "/x/b".into()),
            ("old".into(), "/x/old".into()),
        ]);
        let p = plan(&wanted, &resident);
        assert_eq!(p.unload, vec!["b".to_string(), "old".to_string()]);
        assert_eq!(p.load, vec![w("b", "/x/b2"), w("c", "/x/c")]);
        assert_eq!(
            plan(&wanted[..1], &Resident::from([("a".into(), "/x/a".into())])),
            Plan::default()
        );
    }

    #[test]
    fn the_summary_counts_ready_replicas_and_names_a_failure_first() {
        let wanted = [w("a", "/a"), w("b", "/b")];
        let loaded = Replica::Reached(BTreeMap::from([
            // b not asked yet.
            ("a".into(), Outcome::Loaded),
        ]));
        let failed = Replica::Reached(BTreeMap::from([
            ("a".into(), Outcome::Loaded),
            (
                "b".into(),
                Outcome::Failed("rank 64 is over --max-lora-rank 16".into()),
            ),
        ]));
        let gone = Replica::Unreachable("connection refused".into());
        let s = summarize(&wanted, &[loaded, gone, failed]);
        assert_eq!(
            (s[0].ready_replicas, s[0].reason.as_deref()),
            (2, Some("Unreachable"))
        );
        assert_eq!(
            (s[1].ready_replicas, s[1].reason.as_deref()),
            (0, Some("LoadFailed"))
        );
        assert_eq!(
            s[1].message.as_deref(),
            Some("rank 64 is over --max-lora-rank 16")
        );
        let none = summarize(&wanted, &[]);
        assert_eq!(none[0].reason.as_deref(), Some("NoReadyReplicas"));
        let all = summarize(
            &wanted[..1],
            &[Replica::Reached(BTreeMap::from([(
                "a".into(),
                Outcome::Loaded,
            )]))],
        );
        assert_eq!((all[0].ready_replicas, all[0].reason.clone()), (1, None));
        // A pod refusing the key says more than one not reached.
        let refused = Replica::Refused("pod p-1 refused the API key: HTTP 401".into());
        let s = summarize(
            &wanted[..1],
            &[Replica::Unreachable("timeout".into()), refused],
        );
        assert_eq!(s[0].reason.as_deref(), Some("ApiKeyRefused"));
    }
}
