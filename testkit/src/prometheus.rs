//! A real Prometheus (Debian's `prometheus`) on 127.0.0.1, with the queries tests need, and
//! where to find promtool. Shared by the server's and the operator's tests.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::process::free_port;

/// A Debian-packaged tool from `$env` or the PATH; fails with what to install otherwise.
pub fn tool(env: &str, name: &str) -> PathBuf {
    if let Ok(p) = std::env::var(env) {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "{env}={} does not exist", p.display());
        return p;
    }
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        let p = dir.join(name);
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "{name} not found: install Debian's `prometheus` package (scripts/prometheus.sh; \
         scripts/test.sh does) or set {env}"
    );
}

/// A Prometheus process with its own data directory, killed and removed on drop.
#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    pub base: String,
    dir: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Prometheus {
    /// Starts Prometheus with these `scrape_configs` (YAML list items, indented two spaces;
    /// `$PROMETHEUS` stands for its own host:port), scraping and evaluating every second;
    /// returns once it is ready.
    pub fn start(scrape_configs: &str) -> Self {
        Self::start_with_rules(scrape_configs, &[])
    }

    /// As [`Prometheus::start`], also evaluating these rule files.
    pub fn start_with_rules(scrape_configs: &str, rule_files: &[PathBuf]) -> Self {
        let port = free_port();
        let scrape_configs = scrape_configs.replace("$PROMETHEUS", &format!("127.0.0.1:{port}"));
        let dir = std::env::temp_dir().join(format!("ferrite-prom-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("prometheus dir");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 rule_files: {}\nscrape_configs:\n{scrape_configs}",
                serde_json::to_string(rule_files).expect("paths")
            ),
        )
        .expect("write config");
        let child = Command::new(tool("FERRITE_PROMETHEUS", "prometheus"))
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn prometheus");
        let mut p = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while ureq::get(&format!("{}/-/ready", p.base)).call().is_err() {
            if let Ok(Some(status)) = p.child.try_wait() {
                panic!("prometheus exited with {status}; config:\n{scrape_configs}");
            }
            assert!(Instant::now() < deadline, "prometheus not ready in 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        p
    }

    fn api(&self, path: &str, params: &[(&str, &str)]) -> Result<Value, String> {
        let mut req = ureq::get(&format!("{}{path}", self.base));
        for (k, v) in params {
            req = req.query(k, v);
        }
        let r: Value = match req.call() {
            Ok(r) => r.into_json().map_err(|e| e.to_string())?,
            Err(ureq::Error::Status(code, r)) => {
                return Err(format!("{code}: {}", r.into_string().unwrap_or_default()));
            }
            Err(e) => return Err(e.to_string()),
        };
        if r["status"] != "success" {
            return Err(r.to_string());
        }
        Ok(r["data"].clone())
    }

    /// An instant query's result vector (an error if Prometheus rejects the query).
    pub fn query(&self, promql: &str) -> Result<Vec<Value>, String> {
        self.query_at(promql, None)
    }

    /// An instant query evaluated at `at` (unix seconds), or now.
    pub fn query_at(&self, promql: &str, at: Option<f64>) -> Result<Vec<Value>, String> {
        let time = at.map(|t| format!("{t:.3}"));
        let mut params = vec![("query", promql)];
        if let Some(t) = &time {
            params.push(("time", t));
        }
        let data = self.api("/api/v1/query", &params)?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// A range query from `start` to `end` (unix seconds) at `step` seconds: the matrix.
    pub fn query_range(
        &self,
        promql: &str,
        start: f64,
        end: f64,
        step: f64,
    ) -> Result<Vec<Value>, String> {
        let (start, end, step) = (format!("{start:.3}"), format!("{end:.3}"), step.to_string());
        let data = self.api(
            "/api/v1/query_range",
            &[
                ("query", promql),
                ("start", &start),
                ("end", &end),
                ("step", &step),
            ],
        )?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// The values of `label` on the series matching `selector` (what Grafana's
    /// `label_values(selector, label)` lists).
    pub fn label_values(&self, selector: &str, label: &str) -> Result<Vec<String>, String> {
        let data = self.api("/api/v1/series", &[("match[]", selector)])?;
        let mut values: Vec<String> = data
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s[label].as_str().map(String::from))
            .collect();
        values.sort();
        values.dedup();
        Ok(values)
    }

    /// The rule groups' rules as `/api/v1/rules` reports them (name, health, lastError, state).
    pub fn rules(&self) -> Vec<Value> {
        let data = self
            .api("/api/v1/rules", &[])
            .unwrap_or_else(|e| panic!("rules: {e}"));
        data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect()
    }

    /// The single value of an instant query now; `None` when empty.
    pub fn value(&self, promql: &str) -> Option<f64> {
        self.value_at(promql, None)
    }

    /// The single value of an instant query at `at` (unix seconds) or now; `None` when empty.
    /// Panics when the query returns more than one series: callers mean one number.
    pub fn value_at(&self, promql: &str, at: Option<f64>) -> Option<f64> {
        let result = self
            .query_at(promql, at)
            .unwrap_or_else(|e| panic!("{promql}: {e}"));
        assert!(result.len() <= 1, "{promql} returned {result:?}");
        result
            .first()
            .and_then(|s| s["value"][1].as_str())
            .and_then(|v| v.parse().ok())
    }

    /// Waits until `promql` has a value for which `ok` holds; returns it.
    pub fn wait_for(&self, promql: &str, within: Duration, ok: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + within;
        loop {
            let v = self.value(promql);
            if let Some(v) = v.filter(|v| ok(*v)) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{promql} is {v:?} after {within:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
