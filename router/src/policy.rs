//! Picking a replica for one request: pure functions over a snapshot of the replicas' load,
//! so every policy is unit-tested without pods, servers or clocks.
//!
//! - [`Policy::PrefixAffinity`] (the default): consistent hashing with bounded loads
//!   (Mirrokni, Thorup and Zadimoghaddam, 2018). The request's prefix key hashes onto a ring of
//!   [`VNODES`] points per replica; the first replica clockwise whose load is below
//!   `ceil((1 + ε) · (total + 1) / n)` takes it. The same conversation or tenant keeps landing
//!   where its prefix is cached, and no replica takes more than its bounded share, so a hot
//!   prefix overflows to the next replica on the ring (always the same one) instead of
//!   queueing.
//! - [`Policy::LeastLoad`]: the replica with the least load, ties broken by name.
//! - [`Policy::RoundRobin`]: in turn.

use ferrite_operator::hash::fnv1a;

/// Points per replica on the hash ring: enough that 3 replicas split keys within a few percent.
pub const VNODES: usize = 160;

/// The policies are the CRD's (`spec.routing.policy`).
pub use ferrite_operator::crd::RoutingPolicy as Policy;

/// One ready replica as the router sees it when a request arrives.
#[derive(Debug, Clone, PartialEq)]
pub struct Replica {
    /// Pod name: the ring is built from names, so it survives IP changes and restarts.
    pub name: String,
    /// Requests waiting and running there, as last scraped, plus the router's own requests
    /// sent since that scrape and still open (so a burst between two scrapes spreads too).
    pub load: f64,
}

/// What the prefix-affinity policy did, for the routing-decision metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affinity {
    /// The key's own replica took the request.
    Kept,
    /// Its replica was over the bound; the next one on the ring took it.
    Overflowed,
    /// No key (an empty prompt) or another policy.
    None,
}

impl Affinity {
    pub fn as_str(self) -> &'static str {
        match self {
            Affinity::Kept => "kept",
            Affinity::Overflowed => "overflowed",
            Affinity::None => "none",
        }
    }
}

/// The replica chosen (an index into the slice given) and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub index: usize,
    pub affinity: Affinity,
}

/// Picks a replica, or `None` when there is none. `key` is the request's prefix key (see
/// `prefix`), `turn` a counter the caller advances per request (round-robin), and `epsilon`
/// the load bound's slack (0.25: a replica may take a quarter more than the average).
pub fn pick(
    policy: Policy,
    replicas: &[Replica],
    key: Option<&str>,
    turn: u64,
    epsilon: f64,
) -> Option<Decision> {
    if replicas.is_empty() {
        return None;
    }
    let decision = |index| Decision {
        index,
        affinity: Affinity::None,
    };
    match (policy, key) {
        (Policy::RoundRobin, _) => Some(decision((turn % replicas.len() as u64) as usize)),
        (Policy::PrefixAffinity, Some(key)) if !key.is_empty() => {
            Some(bounded_ring(replicas, key, epsilon))
        }
        // Without a key there is nothing to be affine to: the least loaded replica.
        (Policy::LeastLoad | Policy::PrefixAffinity, _) => Some(decision(least_loaded(replicas))),
    }
}

fn least_loaded(replicas: &[Replica]) -> usize {
    let mut best = 0;
    for (i, r) in replicas.iter().enumerate().skip(1) {
        let b = &replicas[best];
        if r.load < b.load || (r.load == b.load && r.name < b.name) {
            best = i;
        }
    }
    best
}

/// Position of a string on the ring: FNV-1a (stable across builds and router replicas, which
/// must agree) through a finalizer that spreads FNV's weak low bits.
fn point(bytes: &[u8]) -> u64 {
    let mut z = fnv1a(bytes);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The ring's points, sorted: `(position, replica index)`.
fn ring(replicas: &[Replica]) -> Vec<(u64, usize)> {
    let mut points: Vec<(u64, usize)> = replicas
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            (0..VNODES).map(move |v| (point(format!("{}#{v}", r.name).as_bytes()), i))
        })
        .collect();
    points.sort_unstable();
    points
}

fn bounded_ring(replicas: &[Replica], key: &str, epsilon: f64) -> Decision {
    let total: f64 = replicas.iter().map(|r| r.load.max(0.0)).sum();
    // Every replica may hold this many, counting the new request; at least 1, so an idle
    // service still follows the ring.
    let bound = ((1.0 + epsilon.max(0.0)) * (total + 1.0) / replicas.len() as f64)
        .ceil()
        .max(1.0);
    let points = ring(replicas);
    let h = point(key.as_bytes());
    let start = points.partition_point(|&(p, _)| p < h);
    let mut owner = None;
    let mut seen = vec![false; replicas.len()];
    for k in 0..points.len() {
        let (_, i) = points[(start + k) % points.len()];
        if seen[i] {
            continue;
        }
        seen[i] = true;
        let first = *owner.get_or_insert(i);
        if replicas[i].load + 1.0 <= bound {
            let affinity = if i == first {
                Affinity::Kept
            } else {
                Affinity::Overflowed
            };
            return Decision { index: i, affinity };
        }
    }
    // Unreachable in exact arithmetic (some replica is at or below the average), kept for
    // NaN loads: the least loaded replica.
    Decision {
        index: least_loaded(replicas),
        affinity: Affinity::Overflowed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn replicas(loads: &[f64]) -> Vec<Replica> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| Replica {
                name: format!("pod-{i}"),
                load,
            })
            .collect()
    }

    fn affine(rs: &[Replica], key: &str) -> Decision {
        pick(Policy::PrefixAffinity, rs, Some(key), 0, 0.25).expect("a replica")
    }

    #[test]
    fn no_replicas_no_decision() {
        for p in [
            Policy::PrefixAffinity,
            Policy::LeastLoad,
            Policy::RoundRobin,
        ] {
            assert_eq!(pick(p, &[], Some("k"), 0, 0.25), None);
        }
    }

    #[test]
    fn the_same_key_keeps_its_replica_and_keys_spread() {
        let rs = replicas(&[0.0, 0.0, 0.0]);
        let mut per = [0usize; 3];
        for t in 0..3000 {
            let key = format!("tenant {t} system prompt");
            let d = affine(&rs, &key);
            assert_eq!(d, affine(&rs, &key), "stable");
            assert_eq!(d.affinity, Affinity::Kept);
            per[d.index] += 1;
        }
        // 160 points per replica keep the split within ~15% of a third.
        for n in per {
            assert!((850..=1150).contains(&n), "{per:?}");
        }
    }

    #[test]
    fn removing_a_replica_moves_only_its_keys() {
        let three = replicas(&[0.0, 0.0, 0.0]);
        let two: Vec<Replica> = three
            .iter()
            .filter(|r| r.name != "pod-1")
            .cloned()
            .collect();
        for t in 0..500 {
            let key = format!("conversation {t}");
            let before = &three[affine(&three, &key).index].name;
            let after = &two[affine(&two, &key).index].name;
            if before != "pod-1" {
                assert_eq!(before, after, "{key} moved although its replica stayed");
            }
        }
    }

    #[test]
    fn an_overloaded_owner_overflows_to_the_same_next_replica() {
        let key = "a hot prefix";
        let idle = replicas(&[0.0, 0.0, 0.0]);
        let owner = affine(&idle, key).index;
        let mut loads = vec![1.0, 1.0, 1.0];
        loads[owner] = 10.0;
        let busy = replicas(&loads);
        let d = affine(&busy, key);
        assert_ne!(d.index, owner);
        assert_eq!(d.affinity, Affinity::Overflowed);
        assert_eq!(d, affine(&busy, key), "overflow is deterministic");
        // Within the bound (1.25 x the average), the owner keeps it.
        loads[owner] = 2.0;
        assert_eq!(affine(&replicas(&loads), key).index, owner);
    }

    #[test]
    fn least_load_avoids_the_long_queue_and_breaks_ties_by_name() {
        let rs = replicas(&[20.0, 3.0, 3.0]);
        let d = pick(Policy::LeastLoad, &rs, Some("k"), 7, 0.25).expect("replica");
        assert_eq!(d.index, 1);
        assert_eq!(d.affinity, Affinity::None);
    }

    #[test]
    fn round_robin_takes_turns_and_empty_keys_go_to_the_least_loaded() {
        let rs = replicas(&[5.0, 0.0, 9.0]);
        let picks: Vec<usize> = (0..6)
            .map(|t| {
                pick(Policy::RoundRobin, &rs, None, t, 0.25)
                    .expect("replica")
                    .index
            })
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        for key in [None, Some("")] {
            let d = pick(Policy::PrefixAffinity, &rs, key, 0, 0.25).expect("replica");
            assert_eq!((d.index, d.affinity), (1, Affinity::None));
        }
    }

    proptest! {
        /// Whatever the loads, prefix affinity never sends a request to a replica that would
        /// then hold more than the bound, while another is below it.
        #[test]
        fn the_load_bound_holds(
            loads in proptest::collection::vec(0u32..50, 1..8),
            key in "[a-z ]{1,40}",
            eps in 0.0f64..1.0,
        ) {
            let rs = replicas(&loads.iter().map(|&l| f64::from(l)).collect::<Vec<_>>());
            let d = pick(Policy::PrefixAffinity, &rs, Some(&key), 0, eps).expect("replica");
            let total: f64 = rs.iter().map(|r| r.load).sum();
            let bound = ((1.0 + eps) * (total + 1.0) / rs.len() as f64).ceil().max(1.0);
            prop_assert!(rs[d.index].load + 1.0 <= bound, "{:?} -> {}", loads, d.index);
        }
    }
}
