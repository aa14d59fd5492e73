//! Which prefix keys this router has routed lately. Prefix affinity is worth its load slack
//! only when some replica may hold the prefix in its cache: a prompt seen for the first time
//! has nothing to be affine to, so it gets no slack and goes where the load is lowest along
//! its ring. Routers do not share this memory; two of them disagreeing only changes how
//! tight one request's bound is, never where a known prefix lives (that is the ring's).

use std::collections::HashMap;
use std::sync::Mutex;

/// Keys remembered; past this the older half is forgotten.
pub const CAPACITY: usize = 16_384;

/// A bounded memory of key hashes and when each was last routed.
#[derive(Debug, Default)]
pub struct RecentKeys {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    last: HashMap<u64, u64>,
    tick: u64,
}

impl RecentKeys {
    /// Whether `key` was routed before (and is still remembered); remembers it now.
    pub fn seen(&self, key: &str) -> bool {
        let h = crate::ring::point(key.as_bytes());
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.tick += 1;
        let tick = inner.tick;
        let before = inner.last.insert(h, tick).is_some();
        if inner.last.len() > CAPACITY {
            // Forget the older half: keys routed since `cut` stay.
            let cut = tick - (CAPACITY as u64) / 2;
            inner.last.retain(|_, t| *t > cut);
        }
        before
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().map(|i| i.last.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_new_once_then_seen() {
        let r = RecentKeys::default();
        assert!(!r.seen("tenant a"));
        assert!(r.seen("tenant a"));
        assert!(!r.seen("tenant b"));
        assert!(r.seen("tenant a"));
    }

    #[test]
    fn memory_stays_bounded_and_keeps_the_recent_keys() {
        let r = RecentKeys::default();
        assert!(!r.seen("hot"));
        for i in 0..(CAPACITY * 3) {
            r.seen(&format!("cold {i}"));
            if i % 1000 == 0 {
                r.seen("hot");
            }
        }
        assert!(r.len() <= CAPACITY);
        assert!(r.seen("hot"), "a key routed lately is remembered");
        assert!(!r.seen("cold 0"), "the oldest are forgotten");
    }
}
