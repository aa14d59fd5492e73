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

/// Mean of `v` and the half-width of its two-sided 95% confidence interval (Student's t), for
/// judging a ratio measured over a few runs; `None` with fewer than two values.
pub fn mean_ci95(v: &[f64]) -> Option<(f64, f64)> {
    // t(0.975, df) for df = 1..=30; beyond that, the normal's 1.96 is close enough.
    const T975: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    let n = v.len();
    if n < 2 {
        return None;
    }
    let mean = v.iter().sum::<f64>() / n as f64;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let t = T975.get(n - 2).copied().unwrap_or(1.96);
    Some((mean, t * (var / n as f64).sqrt()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confidence_interval_of_a_small_sample() {
        // Four ratios measured on 2026-11-23: mean 1.0368, sd 0.0390, t(3) = 3.182.
        let (mean, half) = mean_ci95(&[1.092, 1.001, 1.032, 1.022]).expect("interval");
        assert!((mean - 1.03675).abs() < 1e-9);
        assert!((half - 0.0621).abs() < 5e-4, "{half}");
        assert_eq!(mean_ci95(&[1.0]), None);
        let (m, h) = mean_ci95(&[2.0, 2.0, 2.0]).expect("interval");
        assert_eq!((m, h), (2.0, 0.0));
    }
}
