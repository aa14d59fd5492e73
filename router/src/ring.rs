//! The consistent-hash ring of a service's replicas, built once per set of replica names and
//! kept per service ([`Rings`]) instead of once per request: [`crate::policy`] walks it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferrite_api::hash::fnv1a;

/// Points per replica on the hash ring: enough that 3 replicas split keys within a few percent.
pub const VNODES: usize = 160;

/// Position of a string on the ring: FNV-1a (stable across builds and router replicas, which
/// must agree) through a finalizer that spreads FNV's weak low bits.
pub fn point(bytes: &[u8]) -> u64 {
    let mut z = fnv1a(bytes);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// [`VNODES`] points per replica name, sorted. Names, not addresses: a replica keeps its
/// place across IP changes and restarts.
#[derive(Debug, PartialEq, Eq)]
pub struct Ring {
    names: Vec<String>,
    /// `(position, index into names)`.
    points: Vec<(u64, usize)>,
}

impl Ring {
    pub fn new<S: AsRef<str>>(names: &[S]) -> Ring {
        let names: Vec<String> = names.iter().map(|n| n.as_ref().to_string()).collect();
        let mut points: Vec<(u64, usize)> = names
            .iter()
            .enumerate()
            .flat_map(|(i, n)| (0..VNODES).map(move |v| (point(format!("{n}#{v}").as_bytes()), i)))
            .collect();
        points.sort_unstable();
        Ring { names, points }
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The replica names in ring order from `key`'s position, each once.
    pub fn walk<'a>(&'a self, key: &str) -> impl Iterator<Item = &'a str> + 'a {
        let start = self
            .points
            .partition_point(|&(p, _)| p < point(key.as_bytes()));
        let mut seen = vec![false; self.names.len()];
        (0..self.points.len()).filter_map(move |k| {
            let (_, i) = self.points[(start + k) % self.points.len()];
            (!std::mem::replace(&mut seen[i], true)).then(|| self.names[i].as_str())
        })
    }
}

/// Each service's ring, rebuilt only when its replica names change.
#[derive(Debug, Default)]
pub struct Rings(Mutex<HashMap<String, Arc<Ring>>>);

impl Rings {
    /// The ring of `service` over `names` (in a stable order).
    pub fn get<S: AsRef<str>>(&self, service: &str, names: &[S]) -> Arc<Ring> {
        let same = |r: &Ring| {
            r.names.len() == names.len() && r.names.iter().zip(names).all(|(a, b)| a == b.as_ref())
        };
        let Ok(mut rings) = self.0.lock() else {
            return Arc::new(Ring::new(names));
        };
        if let Some(r) = rings.get(service).filter(|r| same(r)) {
            return r.clone();
        }
        let ring = Arc::new(Ring::new(names));
        rings.insert(service.to_string(), ring.clone());
        ring
    }

    /// Drops the rings of services not in `live`.
    pub fn retain(&self, live: &std::collections::HashSet<String>) {
        if let Ok(mut rings) = self.0.lock() {
            rings.retain(|id, _| live.contains(id));
        }
    }

    pub fn len(&self) -> usize {
        self.0.lock().map(|r| r.len()).unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_is_reused_until_its_names_change() {
        let rings = Rings::default();
        let a = rings.get("ml/chat", &["pod-a", "pod-b"]);
        let again = rings.get("ml/chat", &["pod-a", "pod-b"]);
        assert!(Arc::ptr_eq(&a, &again), "rebuilt although nothing changed");
        let grown = rings.get("ml/chat", &["pod-a", "pod-b", "pod-c"]);
        assert!(!Arc::ptr_eq(&a, &grown));
        assert_eq!(grown.names(), ["pod-a", "pod-b", "pod-c"]);
        assert_eq!(*grown, Ring::new(&["pod-a", "pod-b", "pod-c"]));
        rings.get("ml/code", &["pod-x"]);
        assert_eq!(rings.len(), 2);
        rings.retain(&["ml/code".to_string()].into_iter().collect());
        assert_eq!(rings.len(), 1);
    }

    #[test]
    fn a_walk_visits_every_name_once() {
        let ring = Ring::new(&["a", "b", "c", "d"]);
        for key in ["x", "a prompt", ""] {
            let mut names: Vec<&str> = ring.walk(key).collect();
            assert_eq!(names.len(), 4, "{names:?}");
            names.sort_unstable();
            assert_eq!(names, ["a", "b", "c", "d"]);
        }
        assert_eq!(Ring::new::<&str>(&[]).walk("k").count(), 0);
    }
}
