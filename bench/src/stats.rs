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

/// The order targets take in run `run`: reversed on odd runs, so neither always goes first
/// (a warming or cooling machine favours one side).
pub fn alternating(targets: usize, run: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..targets).collect();
    if run % 2 == 1 {
        order.reverse();
    }
    order
}

/// Per-run ratios as `mean x (95% CI lo-hi; runs r1 r2 ...)`, or `r x (one run)`.
pub fn ratio_summary(ratios: &[f64]) -> String {
    let list: Vec<String> = ratios.iter().map(|r| format!("{r:.3}")).collect();
    match mean_ci95(ratios) {
        Some((mean, half)) => format!(
            "{mean:.3}x (95% CI {:.3}-{:.3}; runs {})",
            mean - half,
            mean + half,
            list.join(" ")
        ),
        None => format!("{}x (one run)", list.join(" ")),
    }
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

    #[test]
    fn targets_alternate_and_ratios_read_with_their_interval() {
        assert_eq!(alternating(3, 0), [0, 1, 2]);
        assert_eq!(alternating(3, 1), [2, 1, 0]);
        assert_eq!(
            ratio_summary(&[2.0, 2.0]),
            "2.000x (95% CI 2.000-2.000; runs 2.000 2.000)"
        );
        assert_eq!(ratio_summary(&[0.5]), "0.500x (one run)");
    }
}
