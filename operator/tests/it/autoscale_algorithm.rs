//! The scaling algorithm on synthetic samples: table-driven cases for each rule, and a property
//! test that constant load never makes replicas oscillate.

use std::time::Duration;

use ferrite_api::crd::{AutoscalingSpec, AutoscalingTargets, ScalingBehavior};
use ferrite_api::signal::{PodMetrics, PodSample};
use ferrite_operator::autoscale::algorithm::{Limit, Policy, ScalerState, replicas_for};
use proptest::prelude::*;

fn policy() -> Policy {
    Policy {
        min_replicas: 1,
        max_replicas: 20,
        queue_target: Some(2.0),
        kv_target: None,
        tolerance: 0.1,
        scale_up_window: Duration::ZERO,
        scale_down_window: Duration::from_secs(300),
        max_up_percent_per_minute: 100,
        max_down_percent_per_minute: 50,
        scrape_interval: Duration::from_secs(5),
        panic_threshold: None,
        idle_timeout: None,
    }
}

fn ready(waiting: f64) -> PodSample {
    PodSample::Ready(PodMetrics {
        waiting,
        running: 1.0,
        kv_usage: None,
    })
}

fn kv(usage: f64) -> PodSample {
    PodSample::Ready(PodMetrics {
        waiting: 0.0,
        running: 1.0,
        kv_usage: Some(usage),
    })
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn defaults_come_from_the_spec() {
    let spec = AutoscalingSpec {
        mode: Default::default(),
        keda: None,
        min_replicas: 0,
        max_replicas: 4,
        targets: AutoscalingTargets {
            queue_per_replica: Some(3.0),
            kv_cache_usage: None,
        },
        behavior: ScalingBehavior::default(),
        scrape_interval_seconds: None,
        panic_threshold: None,
        idle_timeout_seconds: Some(600),
    };
    let p = Policy::from_spec(&spec);
    assert_eq!(p.scale_up_window, Duration::ZERO);
    assert_eq!(p.scale_down_window, secs(300));
    assert_eq!(p.tolerance, 0.1);
    assert_eq!(p.scrape_interval, secs(5));
    assert_eq!(p.max_up_percent_per_minute, 100);
    assert_eq!(p.max_down_percent_per_minute, 50);
    assert_eq!(p.idle_timeout, Some(secs(600)));
    assert_eq!(p.queue_target, Some(3.0));
    assert_eq!(p.panic_threshold, Some(3.0));
}

/// (case, current replicas, samples, expected desired): one evaluation from a fresh state.
#[test]
fn one_evaluation_table() {
    let cases: Vec<(&str, i32, Vec<PodSample>, i32)> = vec![
        ("within tolerance holds", 2, vec![ready(2.1), ready(2.1)], 2),
        (
            "just beyond tolerance scales",
            2,
            vec![ready(2.5), ready(2.5)],
            3,
        ),
        (
            "queue doubles the replicas",
            2,
            vec![ready(4.0), ready(4.0)],
            4,
        ),
        (
            "rate limit: at most double per minute",
            2,
            vec![ready(20.0), ready(20.0)],
            4,
        ),
        (
            "every scrape failed: hold",
            3,
            vec![PodSample::Missing; 3],
            3,
        ),
        ("no ready pods: hold", 3, vec![PodSample::Unready; 3], 3),
        (
            "a failed scrape blocks scale-down",
            3,
            vec![ready(0.0), ready(0.0), PodSample::Missing],
            3,
        ),
        (
            "a failed scrape counts as zero on the way up",
            2,
            vec![ready(6.0), PodSample::Missing],
            3,
        ),
        (
            "unready pods count as capacity on the way up",
            4,
            vec![
                ready(4.0),
                ready(4.0),
                PodSample::Unready,
                PodSample::Unready,
            ],
            4,
        ),
        ("below minReplicas rises to it at once", 0, vec![], 1),
    ];
    for (case, current, samples, want) in cases {
        let mut s = ScalerState::default();
        let d = s.decide(&policy(), secs(100), current, &samples);
        assert_eq!(d.desired, want, "{case}: {d:?}");
    }
}

#[test]
fn kv_signal_and_the_max_across_signals() {
    let p = Policy {
        kv_target: Some(0.5),
        ..policy()
    };
    let mut s = ScalerState::default();
    // KV 0.9 on 2 pods → ceil(2 × 0.9 / 0.5) = 4; queue says nothing (0 waiting).
    let d = s.decide(&p, secs(0), 2, &[kv(0.9), kv(0.9)]);
    assert_eq!(d.recommendation, 4);
    assert_eq!(d.desired, 4);
    assert_eq!(d.signals.kv_usage, Some(0.9));
    // KV near target but the queue wants more: the queue wins.
    let mut s = ScalerState::default();
    let samples = vec![
        PodSample::Ready(PodMetrics {
            waiting: 6.0,
            running: 4.0,
            kv_usage: Some(0.5),
        });
        2
    ];
    let d = s.decide(&p, secs(0), 2, &samples);
    assert_eq!(d.recommendation, 6);
    assert_eq!(d.desired, 4, "rate-limited to double");
    assert_eq!(d.limit, Some(Limit::ScaleUpRate));
    // KV on 2 ready + 2 starting pods: the starting ones damp the scale-up entirely.
    let mut s = ScalerState::default();
    let d = s.decide(
        &p,
        secs(0),
        4,
        &[kv(0.9), kv(0.9), PodSample::Unready, PodSample::Unready],
    );
    assert_eq!(d.desired, 4);
    // A pod without a KV metric is missing for that signal only.
    assert_eq!(
        replicas_for(&[Some(0.9), None], 0, 0.5, 2, 0.1),
        Some(2),
        "0.9 and an unknown (counted as 0 going up) is 0.45 per pod: within tolerance"
    );
}

#[test]
fn min_and_max_clamp_with_a_reason() {
    let p = Policy {
        max_replicas: 5,
        max_up_percent_per_minute: 1000,
        ..policy()
    };
    let mut s = ScalerState::default();
    let d = s.decide(&p, secs(0), 3, &[ready(20.0), ready(20.0), ready(20.0)]);
    assert_eq!((d.recommendation, d.desired), (5, 5));
    assert_eq!(d.limit, Some(Limit::TooMany));
    let p = Policy {
        min_replicas: 2,
        scale_down_window: Duration::ZERO,
        max_down_percent_per_minute: 100,
        ..policy()
    };
    let mut s = ScalerState::default();
    let d = s.decide(&p, secs(0), 4, &[ready(0.0); 4]);
    assert_eq!((d.recommendation, d.desired), (2, 2));
    assert_eq!(d.limit, Some(Limit::TooFew));
}

#[test]
fn scale_down_waits_for_the_window_then_follows_the_rate() {
    let p = policy();
    let mut s = ScalerState::default();
    // Busy at t=0: 8 waiting per pod on 4 pods → 16 replicas wanted, doubled to 8.
    let d = s.decide(&p, secs(0), 4, &[ready(8.0); 4]);
    assert_eq!(d.desired, 8);
    // Load gone: every later recommendation is 1, but t=0 asked for 16 within 300 s.
    let mut current = 8;
    for t in (5..=300).step_by(5) {
        let d = s.decide(&p, secs(t), current, &vec![ready(0.0); current as usize]);
        assert_eq!(d.desired, 8, "t={t}");
        assert_eq!(d.recommendation, 1);
        assert_eq!(d.limit, Some(Limit::ScaleDownStabilized), "t={t}");
        current = d.desired;
    }
    // The busy sample leaves the window: down, but at most 50% of the count a minute ago.
    let d = s.decide(&p, secs(305), current, &vec![ready(0.0); 8]);
    assert_eq!(d.desired, 4);
    assert_eq!(d.limit, Some(Limit::ScaleDownRate));
    current = d.desired;
    // Within the same minute the base is still 8, so 4 is as low as it goes.
    let d = s.decide(&p, secs(330), current, &[ready(0.0); 4]);
    assert_eq!(d.desired, 4);
    // A minute later the base is 4: down to 2.
    let d = s.decide(&p, secs(366), current, &[ready(0.0); 4]);
    assert_eq!(d.desired, 2);
}

#[test]
fn a_fresh_state_still_waits_out_the_scale_down_window() {
    // An operator restart mid-hold: the new state has no history, but must not drop at once.
    let p = policy();
    let mut s = ScalerState::default();
    let d = s.decide(&p, secs(1000), 8, &[ready(0.0); 8]);
    assert_eq!(d.desired, 8);
    assert_eq!(d.limit, Some(Limit::ScaleDownStabilized));
    let d = s.decide(&p, secs(1295), 8, &[ready(0.0); 8]);
    assert_eq!(d.desired, 8);
    let d = s.decide(&p, secs(1300), 8, &[ready(0.0); 8]);
    assert_eq!(d.desired, 4, "after the window: down by the 50% rate");
    // Scale-up is not held by it.
    let mut s = ScalerState::default();
    assert_eq!(
        s.decide(&p, secs(0), 2, &[ready(4.0), ready(4.0)]).desired,
        4
    );
}

#[test]
fn scale_up_window_takes_the_lowest_recent_recommendation() {
    let p = Policy {
        scale_up_window: secs(30),
        max_up_percent_per_minute: 1000,
        ..policy()
    };
    let mut s = ScalerState::default();
    let d = s.decide(&p, secs(0), 2, &[ready(2.0), ready(2.0)]);
    assert_eq!(d.desired, 2);
    // A spike: 10 wanted, but the window still holds a 2.
    let d = s.decide(&p, secs(10), 2, &[ready(10.0), ready(10.0)]);
    assert_eq!((d.recommendation, d.desired), (10, 2));
    assert_eq!(d.limit, Some(Limit::ScaleUpStabilized));
    let d = s.decide(&p, secs(20), 2, &[ready(8.0), ready(8.0)]);
    assert_eq!(d.desired, 2);
    // t=0 leaves the 30 s window: the lowest of 10 and 8 wins.
    let d = s.decide(&p, secs(35), 2, &[ready(12.0), ready(12.0)]);
    assert_eq!(d.desired, 8);
}

#[test]
fn rate_limit_counts_changes_over_the_last_minute() {
    let p = policy();
    let mut s = ScalerState::default();
    let busy = |n: i32| vec![ready(40.0); n as usize];
    let d = s.decide(&p, secs(0), 2, &busy(2));
    assert_eq!(d.desired, 4);
    let d = s.decide(&p, secs(30), 4, &busy(4));
    assert_eq!(d.desired, 4, "2 a minute ago: at most 4");
    assert_eq!(d.limit, Some(Limit::ScaleUpRate));
    let d = s.decide(&p, secs(60), 4, &busy(4));
    assert_eq!(d.desired, 8);
    let d = s.decide(&p, secs(120), 8, &busy(8));
    assert_eq!(d.desired, 16);
}

#[test]
fn panic_mode_jumps_and_then_holds_scale_down() {
    let p = Policy {
        panic_threshold: Some(3.0),
        ..policy()
    };
    let mut s = ScalerState::default();
    // 7 waiting per pod on 2 pods is 3.5 × the target of 2: no rate limit, straight to 7.
    let d = s.decide(&p, secs(0), 2, &[ready(7.0), ready(7.0)]);
    assert!(d.panic);
    assert_eq!(d.desired, 7);
    // Below the threshold but still high (2.5×): normal rules, rate-limited from base 2.
    let d = s.decide(&p, secs(5), 7, &[ready(5.0); 7]);
    assert_eq!(d.desired, 7);
    // Idle afterwards: held by panic mode for the scale-down window.
    let p0 = Policy {
        scale_down_window: secs(60),
        ..p.clone()
    };
    let mut s = ScalerState::default();
    s.decide(&p0, secs(0), 2, &[ready(7.0), ready(7.0)]);
    let d = s.decide(&p0, secs(30), 7, &[ready(0.0); 7]);
    assert_eq!(d.desired, 7);
    assert!(d.panic);
    // Panic over and the window passed: scale-down resumes.
    let d = s.decide(&p0, secs(75), 7, &[ready(0.0); 7]);
    assert!(!d.panic);
    assert!(d.desired < 7, "{d:?}");
}

#[test]
fn idle_timeout_scales_to_zero_and_zero_stays_until_woken() {
    let p = Policy {
        min_replicas: 0,
        idle_timeout: Some(secs(60)),
        scale_down_window: secs(10),
        ..policy()
    };
    let mut s = ScalerState::default();
    let idle = PodSample::Ready(PodMetrics::default());
    let d = s.decide(&p, secs(0), 1, std::slice::from_ref(&idle));
    assert_eq!(d.desired, 1, "min 0 still keeps one replica until idle");
    assert!(!d.idle);
    let d = s.decide(&p, secs(59), 1, std::slice::from_ref(&idle));
    assert_eq!(d.desired, 1);
    // A request resets the idle clock.
    let d = s.decide(&p, secs(60), 1, &[ready(0.0)]);
    assert_eq!(d.desired, 1);
    let d = s.decide(&p, secs(100), 1, std::slice::from_ref(&idle));
    assert_eq!(d.desired, 1);
    let d = s.decide(&p, secs(160), 1, std::slice::from_ref(&idle));
    assert!(d.idle);
    assert_eq!(d.desired, 0);
    // At zero there is nothing to scrape: it stays there.
    let d = s.decide(&p, secs(165), 0, &[]);
    assert_eq!(d.desired, 0);
    // Without an idle timeout, min 0 never reaches zero.
    let p = Policy {
        idle_timeout: None,
        ..p
    };
    let mut s = ScalerState::default();
    let d = s.decide(&p, secs(1000), 1, std::slice::from_ref(&idle));
    assert_eq!(d.desired, 1);
}

#[test]
fn hpa_replica_formula_edge_cases() {
    // No pod reported: no recommendation.
    assert_eq!(replicas_for(&[None, None], 0, 2.0, 2, 0.1), None);
    // Missing pods count as on-target going down, damping the drop from 3 to 2.
    assert_eq!(
        replicas_for(&[Some(0.0), Some(0.0), None], 0, 2.0, 3, 0.1),
        Some(1)
    );
    // ...and as zero going up.
    assert_eq!(replicas_for(&[Some(8.0), None], 0, 2.0, 2, 0.1), Some(4));
    // A change of direction after accounting for the unknowns holds still.
    assert_eq!(replicas_for(&[Some(2.4), None], 0, 2.0, 2, 0.1), Some(2));
}

/// Demand that is constant in total and shared evenly by whatever replicas exist, the load
/// model the HPA formula assumes: per-pod values scale as 1/replicas.
fn even_share(total_waiting: f64, total_kv: f64, replicas: i32) -> Vec<PodSample> {
    let n = replicas.max(0) as usize;
    vec![
        PodSample::Ready(PodMetrics {
            waiting: total_waiting / replicas.max(1) as f64,
            running: 1.0,
            kv_usage: Some(total_kv / replicas.max(1) as f64),
        });
        n
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// With constant load, replicas move in one direction only, then settle.
    #[test]
    fn constant_load_never_oscillates(
        start in 1i32..12,
        total_waiting in 0.0f64..200.0,
        total_kv in 0.0f64..12.0,
        queue_target in 0.5f64..10.0,
        kv_target in 0.3f64..0.95,
        tolerance in 0.0f64..0.3,
        up_window in 0u64..60,
        down_window in 0u64..400,
        up_pct in 10i32..400,
        down_pct in 10i32..100,
        panic in proptest::option::of(1.5f64..5.0),
        max_replicas in 12i32..40,
    ) {
        let p = Policy {
            min_replicas: 1,
            max_replicas,
            queue_target: Some(queue_target),
            kv_target: Some(kv_target),
            tolerance,
            scale_up_window: secs(up_window),
            scale_down_window: secs(down_window),
            max_up_percent_per_minute: up_pct,
            max_down_percent_per_minute: down_pct,
            scrape_interval: secs(5),
            panic_threshold: panic,
            idle_timeout: None,
        };
        let mut s = ScalerState::default();
        let mut current = start;
        let mut direction = 0i32;
        let mut history = vec![current];
        for step in 0..300u64 {
            let d = s.decide(&p, secs(step * 5), current, &even_share(total_waiting, total_kv, current));
            prop_assert!(d.desired >= 1 && d.desired <= max_replicas, "{d:?}");
            let delta = (d.desired - current).signum();
            if delta != 0 {
                prop_assert!(direction == 0 || direction == delta,
                    "reversed direction: {history:?} then {}", d.desired);
                direction = delta;
            }
            current = d.desired;
            history.push(current);
        }
        // Settled by the end: the last minute has no changes.
        let tail = &history[history.len() - 12..];
        prop_assert!(tail.iter().all(|r| *r == current), "still moving: {history:?}");
    }
}
