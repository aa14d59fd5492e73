//! Picking a replica for one request: pure functions over a snapshot of the replicas' load,
//! so every policy is unit-tested without pods, servers or clocks.
//!
//! Loads and requests are weighed in tokens of work (see [`crate::work`]).
//!
//! - [`Policy::PrefixAffinity`] (the default): consistent hashing with bounded loads
//!   (Mirrokni, Thorup and Zadimoghaddam, 2018), counted in requests the size of the new one.
//!   The request's prefix key hashes onto the service's [`Ring`]; the first
//!   replica clockwise that would then hold at most `ceil((1 + ε) · (m + 1) / n)` takes it,
//!   where each replica's load is its work over the request's, rounded ([`units`]), and `m`
//!   their sum. With requests of one size this is the paper exactly; a short request is kept
//!   off a replica busy with a long prompt, which counts as many of it. The same conversation
//!   or tenant keeps landing where its prefix is cached, and no replica takes more than its
//!   bounded share, so a hot prefix overflows to the next replica on the ring (always the same
//!   one) instead of queueing. A prefix the router has not routed lately gets no slack
//!   (ε = 0): no replica can hold it, so keeping it on its owner buys nothing, and with few
//!   replicas even ε = 0.25 rounds up to letting one replica hold two requests while
//!   another holds none.
//! - [`Policy::LeastLoad`]: the replica with the least work, ties broken by name.
//! - [`Policy::RoundRobin`]: in turn.

pub use crate::ring::Ring;

/// The policies are the CRD's (`spec.routing.policy`).
pub use ferrite_api::crd::RoutingPolicy as Policy;

/// One ready replica as the router sees it when a request arrives.
#[derive(Debug, Clone, PartialEq)]
pub struct Replica {
    /// Pod name: the ring is built from names, so it survives IP changes and restarts.
    pub name: String,
    /// Work open there, in tokens (see `load`).
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

/// What one request brings to the choice.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// Its prefix key (see `prefix`).
    pub key: Option<&'a str>,
    /// Its work, in the loads' units (see `work`).
    pub work: f64,
    /// A counter the caller advances per request (round-robin).
    pub turn: u64,
    /// Whether the router routed this key lately (see `recent`): a prefix no replica can
    /// have cached gets no load slack.
    pub known: bool,
}

/// Picks a replica, or `None` when there is none. `ring` holds the service's replicas (those
/// offered may be fewer: one already tried sits out). `epsilon` is the load bound's slack
/// (0.25: a replica may take a quarter more than the average) for a known prefix; a new one
/// gets none, so it lands on the first replica along its ring at or below the average.
pub fn pick(
    policy: Policy,
    ring: &Ring,
    replicas: &[Replica],
    request: Request<'_>,
    epsilon: f64,
) -> Option<Decision> {
    if replicas.is_empty() {
        return None;
    }
    let decision = |index| Decision {
        index,
        affinity: Affinity::None,
    };
    match (policy, request.key) {
        (Policy::RoundRobin, _) => Some(decision((request.turn % replicas.len() as u64) as usize)),
        (Policy::PrefixAffinity, Some(key)) if !key.is_empty() => {
            let epsilon = if request.known { epsilon } else { 0.0 };
            Some(bounded_ring(ring, replicas, key, request.work, epsilon))
        }
        // Without a key there is nothing to be affine to: the least loaded replica.
        (Policy::LeastLoad | Policy::PrefixAffinity, _) => Some(decision(least_loaded(replicas))),
    }
}

/// [`pick`], for a request some replicas (`ready_for`) can start without swapping anything
/// in: a LoRA adapter already in their batch slots. The first of them, in the order the
/// policy looks (the ring from the key, else least loaded first), that stays within the load
/// bound over all the replicas takes it; when none does, or under round-robin, [`pick`]
/// decides. Either way no replica goes past the bound `pick` keeps.
pub fn pick_preferring(
    policy: Policy,
    ring: &Ring,
    replicas: &[Replica],
    request: Request<'_>,
    epsilon: f64,
    ready_for: &[bool],
) -> Option<Decision> {
    let some = ready_for.iter().any(|p| *p);
    if some && policy != Policy::RoundRobin && ready_for.len() == replicas.len() {
        let units = units(replicas, request.work);
        let epsilon = if request.known { epsilon } else { 0.0 };
        let bound = bound(&units, epsilon);
        let order: Vec<usize> = match request.key {
            Some(key) if policy == Policy::PrefixAffinity && !key.is_empty() => ring
                .walk(key)
                .filter_map(|name| replicas.iter().position(|r| r.name == name))
                .collect(),
            _ => {
                let mut by_load: Vec<usize> = (0..replicas.len()).collect();
                by_load.sort_by(|&a, &b| {
                    let (a, b) = (&replicas[a], &replicas[b]);
                    a.load.total_cmp(&b.load).then_with(|| a.name.cmp(&b.name))
                });
                by_load
            }
        };
        let first = order.first().copied();
        if let Some(i) = order
            .into_iter()
            .find(|&i| ready_for[i] && units[i] + 1.0 <= bound)
        {
            let affinity = match request.key {
                Some(k) if policy == Policy::PrefixAffinity && !k.is_empty() => {
                    if Some(i) == first {
                        Affinity::Kept
                    } else {
                        Affinity::Overflowed
                    }
                }
                _ => Affinity::None,
            };
            return Some(Decision { index: i, affinity });
        }
    }
    pick(policy, ring, replicas, request, epsilon)
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

/// Each replica's load in requests the size of this one (`work`), rounded to the nearest
/// whole: with one request size these are the paper's counts, small differences in size
/// (a conversation's later turns are a little longer) change nothing, and a replica
/// prefilling a long prompt counts as many short requests.
pub fn units(replicas: &[Replica], work: f64) -> Vec<f64> {
    let work = if work.is_finite() && work > 0.0 {
        work
    } else {
        1.0
    };
    replicas
        .iter()
        .map(|r| {
            let u = (r.load / work).round();
            if u.is_finite() { u.max(0.0) } else { 0.0 }
        })
        .collect()
}

/// The most a replica may hold, in [`units`], once it takes the request:
/// `ceil((1 + ε) · (m + 1) / n)` where `m` is the units held in all, and at least 1, so an
/// idle service still follows the ring. Some replica always has room: the least loaded holds
/// at most the average.
pub fn bound(units: &[f64], epsilon: f64) -> f64 {
    let m: f64 = units.iter().sum();
    ((1.0 + epsilon.max(0.0)) * (m + 1.0) / units.len().max(1) as f64)
        .ceil()
        .max(1.0)
}

fn bounded_ring(ring: &Ring, replicas: &[Replica], key: &str, work: f64, epsilon: f64) -> Decision {
    let units = units(replicas, work);
    let bound = bound(&units, epsilon);
    let mut owner = None;
    let offered = ring
        .walk(key)
        .filter_map(|name| replicas.iter().position(|r| r.name == name));
    for i in offered {
        let first = *owner.get_or_insert(i);
        if units[i] + 1.0 <= bound {
            let affinity = if i == first {
                Affinity::Kept
            } else {
                Affinity::Overflowed
            };
            return Decision { index: i, affinity };
        }
    }
    // Unreachable while every replica is on the ring (the least loaded one fits the bound),
    // kept for NaN loads: the least loaded replica.
    Decision {
        index: least_loaded(replicas),
        affinity: Affinity::Overflowed,
    }
}

/// The member of `group` (`(id, weight)`) that `draw` falls on, each in proportion to its
/// weight: `draw` is mixed first (splitmix64's finalizer), so nearby draws (a counter, a hash
/// of similar keys) spread evenly. `None` when every weight is 0.
pub fn weighted(group: &[(String, u32)], draw: u64) -> Option<&str> {
    let total: u64 = group.iter().map(|(_, w)| u64::from(*w)).sum();
    if total == 0 {
        return None;
    }
    let mut z = draw.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let mut at = z % total;
    for (id, w) in group {
        if at < u64::from(*w) {
            return Some(id);
        }
        at -= u64::from(*w);
    }
    None
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

    /// A request of unit work: the loads read as request counts.
    fn req(key: Option<&str>, turn: u64) -> Request<'_> {
        Request {
            key,
            work: 1.0,
            turn,
            known: true,
        }
    }

    /// [`pick`] on the ring of exactly these replicas.
    fn pick(policy: Policy, rs: &[Replica], request: Request<'_>, eps: f64) -> Option<Decision> {
        let names: Vec<&str> = rs.iter().map(|r| r.name.as_str()).collect();
        super::pick(policy, &Ring::new(&names), rs, request, eps)
    }

    fn affine(rs: &[Replica], key: &str) -> Decision {
        pick(Policy::PrefixAffinity, rs, req(Some(key), 0), 0.25).expect("a replica")
    }

    #[test]
    fn no_replicas_no_decision() {
        for p in [
            Policy::PrefixAffinity,
            Policy::LeastLoad,
            Policy::RoundRobin,
        ] {
            assert_eq!(pick(p, &[], req(Some("k"), 0), 0.25), None);
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

    /// A replica left out for this attempt (tried already) is passed over on the full
    /// ring: the others keep their keys, and its keys go where they would without it.
    #[test]
    fn a_replica_sitting_out_is_passed_over_on_the_services_ring() {
        let three = replicas(&[0.0, 0.0, 0.0]);
        let ring = Ring::new(&["pod-0", "pod-1", "pod-2"]);
        let two: Vec<Replica> = three
            .iter()
            .filter(|r| r.name != "pod-1")
            .cloned()
            .collect();
        for t in 0..300 {
            let key = format!("conversation {t}");
            let d = super::pick(
                Policy::PrefixAffinity,
                &ring,
                &two,
                req(Some(&key), 0),
                0.25,
            )
            .expect("replica");
            assert_eq!(two[d.index].name, two[affine(&two, &key).index].name);
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
        let d = pick(Policy::LeastLoad, &rs, req(Some("k"), 7), 0.25).expect("replica");
        assert_eq!(d.index, 1);
        assert_eq!(d.affinity, Affinity::None);
    }

    #[test]
    fn round_robin_takes_turns_and_empty_keys_go_to_the_least_loaded() {
        let rs = replicas(&[5.0, 0.0, 9.0]);
        let picks: Vec<usize> = (0..6)
            .map(|t| {
                pick(Policy::RoundRobin, &rs, req(None, t), 0.25)
                    .expect("replica")
                    .index
            })
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        for key in [None, Some("")] {
            let d = pick(Policy::PrefixAffinity, &rs, req(key, 0), 0.25).expect("replica");
            assert_eq!((d.index, d.affinity), (1, Affinity::None));
        }
    }

    #[test]
    fn a_short_request_keeps_off_a_replica_prefilling_a_long_prompt() {
        // Two replicas; one holds a 1,000-token prompt with 128 tokens to write.
        let short = |key| Request {
            key: Some(key),
            work: 80.0,
            turn: 0,
            known: true,
        };
        let key = (0..100)
            .map(|t| format!("fresh prompt {t}"))
            .find(|k| affine(&replicas(&[0.0, 0.0]), k).index == 0)
            .expect("some key lands on pod-0");
        let busy = replicas(&[1128.0, 0.0]);
        let d = pick(Policy::PrefixAffinity, &busy, short(&key), 0.25).expect("replica");
        assert_eq!((d.index, d.affinity), (1, Affinity::Overflowed));
        // Counted in requests, one open request was within the bound and the short one
        // queued behind the prefill.
        let counted = replicas(&[1.0, 0.0]);
        assert_eq!(affine(&counted, &key).index, 0);
        // A short request in the way does not count against a long one: it keeps its replica.
        let long = Request {
            key: Some(&key),
            work: 1128.0,
            turn: 0,
            known: true,
        };
        let d = pick(Policy::PrefixAffinity, &replicas(&[80.0, 0.0]), long, 0.25).expect("replica");
        assert_eq!((d.index, d.affinity), (0, Affinity::Kept));
        // Turns a little longer than this one count as one each: two on the owner, one on
        // each other replica, and the owner may still take a third (the paper's bound, 3).
        let turn = Request {
            key: Some(&key),
            work: 1036.0,
            turn: 0,
            known: true,
        };
        let owner = affine(&replicas(&[0.0, 0.0, 0.0]), &key).index;
        let mut loads = [1150.0; 3];
        loads[owner] = 2300.0;
        let d = pick(Policy::PrefixAffinity, &replicas(&loads), turn, 0.25).expect("replica");
        assert_eq!((d.index, d.affinity), (owner, Affinity::Kept), "{loads:?}");
        // Least-load weighs work too.
        let d = pick(
            Policy::LeastLoad,
            &replicas(&[1128.0, 300.0]),
            short(&key),
            0.25,
        )
        .expect("replica");
        assert_eq!(d.index, 1);
    }

    #[test]
    fn a_new_prefix_gets_no_slack_and_a_known_one_keeps_its_replica() {
        // Two replicas, the key's owner prefilling one long prompt, the other idle.
        let key = (0..100)
            .map(|t| format!("fresh prompt {t}"))
            .find(|k| affine(&replicas(&[0.0, 0.0]), k).index == 0)
            .expect("some key lands on pod-0");
        let loads = replicas(&[1128.0, 0.0]);
        let long = |known| Request {
            key: Some(&key),
            work: 1128.0,
            turn: 0,
            known,
        };
        // Known: (1 + 0.25) x (1 + 1) / 2 rounds up to 2, so the owner takes a second.
        let d = pick(Policy::PrefixAffinity, &loads, long(true), 0.25).expect("replica");
        assert_eq!((d.index, d.affinity), (0, Affinity::Kept));
        // New: nothing to keep, so the idle replica takes it.
        let d = pick(Policy::PrefixAffinity, &loads, long(false), 0.25).expect("replica");
        assert_eq!((d.index, d.affinity), (1, Affinity::Overflowed));
        // On an idle service a new prefix still follows the ring.
        let d = pick(
            Policy::PrefixAffinity,
            &replicas(&[0.0, 0.0]),
            long(false),
            0.25,
        )
        .expect("replica");
        assert_eq!((d.index, d.affinity), (0, Affinity::Kept));
    }

    #[test]
    fn with_one_request_size_the_bound_is_the_papers() {
        for loads in [
            [0.0, 0.0, 0.0],
            [1.0, 0.0, 0.0],
            [2.0, 1.0, 0.0],
            [7.0, 2.0, 3.0],
        ] {
            let total: f64 = loads.iter().sum();
            let paper = (1.25 * (total + 1.0) / 3.0).ceil().max(1.0);
            for size in [1.0, 80.0, 1128.0] {
                let scaled: Vec<f64> = loads.iter().map(|l| l * size).collect();
                let u = units(&replicas(&scaled), size);
                assert_eq!(u, loads, "{size}");
                assert_eq!(bound(&u, 0.25), paper, "{loads:?} x {size}");
            }
        }
    }

    #[test]
    fn a_replica_holding_the_adapter_takes_it_within_the_bound() {
        let rs = replicas(&[0.0, 0.0, 0.0]);
        let names: Vec<&str> = rs.iter().map(|r| r.name.as_str()).collect();
        let ring = Ring::new(&names);
        for t in 0..50 {
            let key = format!("prompt {t}");
            let plain = affine(&rs, &key);
            // Only the replica the key would not choose holds the adapter: it takes it.
            let holder = (plain.index + 1) % 3;
            let ready: Vec<bool> = (0..3).map(|i| i == holder).collect();
            let d = pick_preferring(
                Policy::PrefixAffinity,
                &ring,
                &rs,
                req(Some(&key), 0),
                0.25,
                &ready,
            )
            .expect("a replica");
            assert_eq!(d.index, holder);
            // Nobody holds it: the plain choice.
            let none = pick_preferring(
                Policy::PrefixAffinity,
                &ring,
                &rs,
                req(Some(&key), 0),
                0.25,
                &[false; 3],
            );
            assert_eq!(none, Some(plain));
        }
        // The holder is over the bound: someone else takes it.
        let busy = replicas(&[9.0, 0.0, 0.0]);
        let d = pick_preferring(
            Policy::LeastLoad,
            &ring,
            &busy,
            req(None, 0),
            0.25,
            &[true, false, false],
        )
        .expect("a replica");
        assert_ne!(d.index, 0);
        // Least load: the least loaded holder within the bound.
        let rs = replicas(&[1.0, 0.0, 1.0]);
        let d = pick_preferring(
            Policy::LeastLoad,
            &ring,
            &rs,
            req(None, 0),
            0.25,
            &[true, false, true],
        )
        .expect("a replica");
        assert_eq!(d.index, 0);
    }

    proptest! {
        /// Whatever the loads and the request's size, prefix affinity never sends a request
        /// to a replica that would then hold more than the bound, and the bound always
        /// leaves room somewhere.
        #[test]
        fn the_load_bound_holds(
            loads in proptest::collection::vec(0u32..5000, 1..8),
            key in "[a-z ]{1,40}",
            work in 1u32..2000,
            eps in 0.0f64..1.0,
        ) {
            let rs = replicas(&loads.iter().map(|&l| f64::from(l)).collect::<Vec<_>>());
            for known in [true, false] {
                let request = Request { key: Some(&key), work: f64::from(work), turn: 0, known };
                let d = pick(Policy::PrefixAffinity, &rs, request, eps).expect("replica");
                let u = units(&rs, f64::from(work));
                let eps = if known { eps } else { 0.0 };
                prop_assert!(u[d.index] + 1.0 <= bound(&u, eps), "{:?} -> {}", loads, d.index);
                prop_assert!(d.affinity != Affinity::None);
            }
        }

        /// Preferring replicas that hold the request's adapter keeps the same bound.
        #[test]
        fn the_load_bound_holds_when_preferring(
            loads in proptest::collection::vec(0u32..5000, 1..8),
            ready in proptest::collection::vec(any::<bool>(), 8),
            key in "[a-z ]{1,40}",
            work in 1u32..2000,
            eps in 0.0f64..1.0,
        ) {
            let rs = replicas(&loads.iter().map(|&l| f64::from(l)).collect::<Vec<_>>());
            let names: Vec<&str> = rs.iter().map(|r| r.name.as_str()).collect();
            let ring = Ring::new(&names);
            let ready = &ready[..rs.len()];
            for known in [true, false] {
                let request = Request { key: Some(&key), work: f64::from(work), turn: 0, known };
                let d = pick_preferring(Policy::PrefixAffinity, &ring, &rs, request, eps, ready)
                    .expect("replica");
                let u = units(&rs, f64::from(work));
                let eps = if known { eps } else { 0.0 };
                prop_assert!(u[d.index] + 1.0 <= bound(&u, eps), "{:?} -> {}", loads, d.index);
            }
        }
    }

    #[test]
    fn weighted_draws_follow_the_weights_and_skip_zero() {
        let group = vec![
            ("a".to_string(), 95),
            ("b".to_string(), 5),
            ("c".to_string(), 0),
        ];
        let mut counts = std::collections::HashMap::new();
        for draw in 0..100_000u64 {
            *counts
                .entry(super::weighted(&group, draw).expect("a member"))
                .or_insert(0) += 1;
        }
        let share = f64::from(counts["b"]) / 100_000.0;
        assert!((share - 0.05).abs() < 0.005, "{share}");
        assert!(!counts.contains_key("c"));
        assert_eq!(super::weighted(&[("z".to_string(), 0)], 7), None);
        // The same draw, the same member.
        assert_eq!(super::weighted(&group, 42), super::weighted(&group, 42));
    }
}
