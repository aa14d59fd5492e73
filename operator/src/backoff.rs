//! Exponential backoff, shared by the reconcile retries and the adapter sync's load retries.

use std::time::Duration;

/// The wait after the `failures`-th consecutive failure (1 for the first): `first`, doubled
/// per failure since, at most `max`.
pub fn delay(first: Duration, failures: u32, max: Duration) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(16));
    first.saturating_mul(factor).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_the_first_failure_up_to_the_cap() {
        let s = Duration::from_secs;
        let d = |n| delay(s(3), n, s(60));
        assert_eq!(
            [d(0), d(1), d(2), d(3), d(5), d(6)],
            [s(3), s(3), s(6), s(12), s(48), s(60)]
        );
        assert_eq!(delay(s(1), u32::MAX, s(300)), s(300));
    }
}
