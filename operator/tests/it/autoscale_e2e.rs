//! The autoscaler's scraping core against real ferrite-servers on 127.0.0.1: load backs up their
//! queues, the recommendation rises; the load ends, the window passes, and it falls. The pod
//! list is given directly, as pod discovery hands it over in the operator.

use std::time::{Duration, Instant};

use ferrite_testkit::process::free_port;
use ferrite_testkit::server::{Load, start_server};

use ferrite_api::scrape::{PodTarget, Scraper};
use ferrite_api::signal::PodSample;
use ferrite_operator::autoscale::algorithm::{Policy, ScalerState};

/// One evaluation as the operator's loop runs it, at time `t`.
#[derive(Debug, Clone, Copy)]
struct Step {
    t: f64,
    waiting: f64,
    recommendation: i32,
    desired: i32,
}

#[test]
fn recommendation_follows_real_queues_up_and_back_down() {
    let mut servers = [start_server(), start_server()];
    for s in &mut servers {
        s.wait_ready();
    }
    // Two ready pods, and one still starting: it is listed but not scraped.
    let mut targets: Vec<PodTarget> = servers
        .iter()
        .enumerate()
        .map(|(i, s)| PodTarget {
            name: format!("pod-{i}"),
            base_url: s.base.clone(),
            ready: true,
        })
        .collect();
    targets.push(PodTarget {
        name: "pod-starting".into(),
        base_url: format!("http://127.0.0.1:{}", free_port()),
        ready: false,
    });
    let policy = Policy {
        min_replicas: 1,
        max_replicas: 10,
        queue_target: Some(1.0),
        kv_target: None,
        tolerance: 0.1,
        scale_up_window: Duration::ZERO,
        scale_down_window: Duration::from_secs(6),
        max_up_percent_per_minute: 1000,
        max_down_percent_per_minute: 100,
        scrape_interval: Duration::from_millis(500),
        panic_threshold: None,
        idle_timeout: None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let scraper = Scraper::new(Duration::from_secs(2));
    let mut state = ScalerState::default();
    let epoch = Instant::now();
    let mut current = 3;
    let mut steps: Vec<Step> = Vec::new();
    let mut step = |current: &mut i32| {
        let results = rt.block_on(scraper.scrape_all(&targets));
        for r in &results[..2] {
            assert!(r.error.is_none(), "{} scrape failed: {:?}", r.name, r.error);
        }
        assert_eq!(results[2].sample, PodSample::Unready);
        let samples: Vec<PodSample> = results.iter().map(|r| r.sample).collect();
        let d = state.decide(&policy, epoch.elapsed(), *current, &samples);
        *current = d.desired;
        let s = Step {
            t: epoch.elapsed().as_secs_f64(),
            waiting: d.signals.waiting,
            recommendation: d.recommendation,
            desired: d.desired,
        };
        std::thread::sleep(policy.scrape_interval);
        s
    };

    // Idle: the queue is empty and the recommendation is the minimum.
    let idle = step(&mut current);
    assert_eq!(idle.waiting, 0.0, "{idle:?}");
    assert_eq!(idle.recommendation, 1, "{idle:?}");
    current = 3;

    // Load: 8 requests per server with room for 2 running: about 6 wait on each.
    let loads: Vec<_> = servers
        .iter()
        .map(|s| Load::start(&s.base, 8, 48))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let peak = loop {
        let s = step(&mut current);
        steps.push(s);
        if s.recommendation >= 6 {
            break s;
        }
        assert!(Instant::now() < deadline, "no rise: {steps:#?}");
    };
    assert!(peak.waiting >= 6.0, "{peak:?}");
    assert_eq!(
        peak.desired, peak.recommendation,
        "no window or rate holds it"
    );

    // The load stops and drains: every request must succeed.
    for l in loads {
        let statuses = l.finish();
        assert!(
            !statuses.is_empty() && statuses.iter().all(|s| *s == 200),
            "{statuses:?}"
        );
    }
    let drained_at = epoch.elapsed().as_secs_f64();
    // While the window holds the busy recommendation, nothing drops; after it, back to 1.
    let deadline = Instant::now() + Duration::from_secs(30);
    let fell = loop {
        let s = step(&mut current);
        steps.push(s);
        if s.desired == 1 {
            break s;
        }
        assert!(Instant::now() < deadline, "no fall: {steps:#?}");
    };
    let last_busy = steps
        .iter()
        .filter(|s| s.recommendation > 1)
        .map(|s| s.t)
        .fold(0.0, f64::max);
    assert!(
        fell.t - last_busy >= policy.scale_down_window.as_secs_f64(),
        "fell at {:.1}s, only {:.1}s after the last busy recommendation (drained at {drained_at:.1}s): {steps:#?}",
        fell.t,
        fell.t - last_busy
    );
    // From the highest count to the fall it only goes down: no flapping.
    let top = steps
        .iter()
        .enumerate()
        .max_by_key(|(i, s)| (s.desired, std::cmp::Reverse(*i)))
        .map_or(0, |(i, _)| i);
    let after_peak: Vec<i32> = steps[top..].iter().map(|s| s.desired).collect();
    assert!(
        after_peak.windows(2).all(|w| w[1] <= w[0]),
        "{after_peak:?}"
    );
}
