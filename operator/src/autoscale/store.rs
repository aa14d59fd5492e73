//! The latest signals of every autoscaled InferenceService, written by the scrape loop and read
//! by the status step and the External Metrics API. One writer per key; readers copy out.

use std::collections::BTreeMap;
use std::sync::RwLock;
use std::time::SystemTime;

use ferrite_api::signal::Signals;

/// Namespace and name of an InferenceService.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    pub namespace: String,
    pub name: String,
}

impl Key {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One evaluation's signals, with when they were read.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub signals: Signals,
    pub at: SystemTime,
    /// The InferenceService's own labels, so metric selectors can match on them too.
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Default)]
pub struct SignalStore {
    inner: RwLock<BTreeMap<Key, Snapshot>>,
}

impl SignalStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn put(&self, key: Key, snapshot: Snapshot) {
        if let Ok(mut m) = self.inner.write() {
            m.insert(key, snapshot);
        }
    }

    pub fn remove(&self, key: &Key) {
        if let Ok(mut m) = self.inner.write() {
            m.remove(key);
        }
    }

    pub fn get(&self, key: &Key) -> Option<Snapshot> {
        self.inner.read().ok()?.get(key).cloned()
    }

    /// Every snapshot in `namespace`, by name.
    pub fn in_namespace(&self, namespace: &str) -> Vec<(String, Snapshot)> {
        self.inner.read().map_or_else(
            |_| Vec::new(),
            |m| {
                m.iter()
                    .filter(|(k, _)| k.namespace == namespace)
                    .map(|(k, s)| (k.name.clone(), s.clone()))
                    .collect()
            },
        )
    }
}
