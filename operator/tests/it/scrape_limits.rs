//! A pod's `/metrics` is its image's to write, so a tenant's: the scraper the autoscaler and
//! the router share reads it as a stream and keeps only the signals. A large exposition within
//! the limits costs a few MiB, an endless one is a failed scrape, and neither grows the
//! process (before, an exposition was parsed whole into samples: ~150-200 MB for 8 MiB).

use std::io::Write;
use std::net::TcpListener;
use std::time::Duration;

use ferrite_api::scrape::Scraper;

/// Peak and current resident memory of this process, in KiB.
fn memory_kib() -> (u64, u64) {
    ferrite_testkit::process::memory_kib(std::process::id())
}

/// Serves one `/metrics` answer per connection: `head`, then `line` repeated `repeat` times
/// (`None`: until the client leaves), with no Content-Length.
fn serve(head: &'static str, line: String, repeat: Option<usize>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { continue };
            let line = line.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 1024];
                let _ = std::io::Read::read(&mut c, &mut buf);
                let _ = c.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\n",
                );
                let _ = c.write_all(head.as_bytes());
                let chunk = line.repeat(256);
                let mut sent = 0;
                while repeat.is_none_or(|n| sent < n) {
                    if c.write_all(chunk.as_bytes()).is_err() {
                        return;
                    }
                    sent += 256;
                }
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_and_endless_expositions_cost_no_memory() {
    let scraper = Scraper::new(Duration::from_secs(20));
    let (_, rss_before) = memory_kib();

    // ~3.8 MiB: 40,000 series of another metric around the signal (within the limits).
    let head = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 3\n";
    let line = "vllm:other_metric{model_name=\"m\",bucket=\"a-long-label-value\"} 1\n".to_string();
    let big = serve(head, line, Some(40_000));
    let m = scraper
        .scrape(&big)
        .await
        .expect("a large exposition within the limits");
    assert_eq!(m.waiting, 3.0);

    // 50 MiB and more, without end: a failed scrape with the reason.
    let endless = serve(head, format!("# {}\n", "p".repeat(200)), None);
    let e = scraper.scrape(&endless).await.expect_err("over the limit");
    assert_eq!(e.kind(), "too_large", "{e}");
    assert!(e.to_string().contains("bytes"), "{e}");

    let (peak, _) = memory_kib();
    let grown_mib = peak.saturating_sub(rss_before) / 1024;
    println!("scraping a 3.8 MiB and an endless exposition: peak RSS +{grown_mib} MiB");
    assert!(grown_mib < 20, "peak RSS grew by {grown_mib} MiB");
}
