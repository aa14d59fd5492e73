//! FNV-1a: a stable, dependency-free hash. Stable across operator versions, so dashboard uids
//! (and their Grafana URLs) and the desired-state hashes on applied objects do not churn.

pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}
