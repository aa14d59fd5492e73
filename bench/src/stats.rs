//! Summary statistics shared by the bench binaries.

/// The `p`th percentile (0–100) of `v` by nearest rank; NaN when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = (p / 100.0 * (s.len() - 1) as f64).round() as usize;
    s[rank.min(s.len() - 1)]
}
