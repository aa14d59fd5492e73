//! The router's replicas, as each sees them: the Ready pods matching `--peers` in its own
//! namespace. Each replica enforces a share of every tenant's limits ([`Peers::share`]), so
//! that several replicas together admit about what one would, with no store between them.
//! The shares follow each tenant's traffic: every second a replica takes the rate each
//! tenant asks of it ([`crate::demand`]) and reads the other replicas' rates as they are
//! then (at their pod IPs, `--peer-port`, `/internal/tenant-demand`), so that it compares
//! rates of the same moment; a replica not heard from lately, or one that does not know
//! which pod it is, falls back to the even split `1/N`. A replica enforces the lower of the
//! shares its last two rounds give: a burst that reaches every replica at once can read, in
//! the round it starts, as one replica's alone, and earns that replica more only if it
//! lasts.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Api, Client};

use crate::demand::{self, Demand};
use crate::registry::reflect;

/// Where the replicas are and how to reach them.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// The label selector of the router's pods.
    pub selector: String,
    /// This replica's pod name (`POD_NAME`); without it the split stays even.
    pub pod_name: Option<String>,
    /// The port every replica serves `/internal/tenant-demand` on.
    pub port: u16,
}

/// How often rates are taken and read.
pub const TICK: Duration = Duration::from_secs(1);

/// A replica's rates older than this are not used: the split falls back to even.
const STALE: Duration = Duration::from_secs(3);

/// The most a replica's answer may hold: rates are a name and a number per tenant.
const MAX_ANSWER: usize = 4 << 20;

/// The path of the rates.
pub const DEMAND_PATH: &str = "/internal/tenant-demand";

/// The watched router pods and what was last heard from each.
#[derive(Clone)]
pub struct Peers {
    pods: Store<Pod>,
    me: Option<String>,
    demand: Arc<Demand>,
    /// The latest round and the one before it.
    rounds: Arc<RwLock<[Round; 2]>>,
}

/// A replica's rates (tenant to tokens a second) and when they were read.
type Heard = (HashMap<String, f64>, Instant);

/// What one exchange saw: this replica's rates and the others' as last read, by pod name.
#[derive(Debug, Default, Clone)]
struct Round {
    own: BTreeMap<String, f64>,
    others: HashMap<String, Heard>,
}

impl Round {
    /// The share of `tenant` this round gives `me` among `pods` (`me` among them).
    fn share(
        &self,
        me: &str,
        pods: &[(String, Option<String>)],
        tenant: &str,
        now: Instant,
    ) -> f64 {
        let others: Vec<Option<f64>> = pods
            .iter()
            .filter(|(name, _)| name != me)
            .map(|(name, _)| {
                lately(&self.others, name, now)
                    .map(|rates| rates.get(tenant).copied().unwrap_or(0.0))
            })
            .collect();
        let own = self.own.get(tenant).copied().unwrap_or(0.0);
        demand::share(own, &others)
    }
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("ready", &self.ready_pods().len())
            .field("me", &self.me)
            .finish()
    }
}

impl Peers {
    /// Watches the pods of `config` in `namespace`, and every [`TICK`] publishes what each
    /// tenant asked of this replica ([`Peers::record`]) and reads the other replicas'.
    pub fn start(client: Client, namespace: &str, config: PeerConfig) -> Peers {
        let (changed, _) = tokio::sync::watch::channel(0u64);
        let pods = reflect(
            "Pod",
            Api::<Pod>::namespaced(client, namespace),
            watcher::Config::default().labels(&config.selector),
            Arc::new(changed),
        );
        let peers = Peers {
            pods,
            me: config.pod_name,
            demand: Arc::default(),
            rounds: Arc::default(),
        };
        tokio::spawn(exchange(peers.clone(), config.port));
        peers
    }

    pub async fn ready(&self) -> Result<(), reflector::store::WriterDropped> {
        self.pods.wait_until_ready().await
    }

    /// This replica's share of `tenant`'s limits: in proportion to the tenant's traffic each
    /// replica sees, with a floor ([`demand::share`]), the lower of what the last two rounds
    /// give; even when a replica's rates are not known lately.
    pub fn share(&self, tenant: &str) -> f64 {
        let pods = self.ready_pods();
        let Some(me) = self
            .me
            .as_deref()
            .filter(|me| pods.iter().any(|p| p.0 == *me))
        else {
            return 1.0 / pods.len().max(1) as f64;
        };
        let now = Instant::now();
        read(&self.rounds)
            .iter()
            .map(|round| round.share(me, &pods, tenant, now))
            .fold(1.0, f64::min)
    }

    /// `tenant` asked this replica for `tokens` at `now`, admitted or not: what its share
    /// follows.
    pub fn record(&self, tenant: &str, tokens: f64, now: Instant) {
        self.demand.record(tenant, tokens, now);
    }

    /// Ready router replicas (this one among them) and how many of the others were heard
    /// from lately: what the split of every tenant's limits rests on. A replica that counts
    /// fewer than run enforces a larger share than its own.
    pub fn replicas(&self) -> (usize, usize) {
        let pods = self.ready_pods();
        let now = Instant::now();
        let [latest, _] = &*read(&self.rounds);
        let lately_heard = pods
            .iter()
            .filter(|(name, _)| lately(&latest.others, name, now).is_some())
            .count();
        (pods.len(), lately_heard)
    }

    /// This replica's rates now: what the others read.
    pub fn rates_now(&self) -> BTreeMap<String, f64> {
        self.demand.rates(Instant::now())
    }

    /// Ready router pods: name and IP.
    fn ready_pods(&self) -> Vec<(String, Option<String>)> {
        self.pods
            .state()
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && is_ready(p))
            .map(|p| {
                let ip = p.status.as_ref().and_then(|s| s.pod_ip.clone());
                (p.metadata.name.clone().unwrap_or_default(), ip)
            })
            .collect()
    }
}

/// `name`'s rates, if they were read within [`STALE`] of `now`.
fn lately<'h>(
    heard: &'h HashMap<String, Heard>,
    name: &str,
    now: Instant,
) -> Option<&'h HashMap<String, f64>> {
    let (rates, at) = heard.get(name)?;
    (now.saturating_duration_since(*at) <= STALE).then_some(rates)
}

fn read<T: Clone>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    // Plain maps of numbers: a panic elsewhere cannot leave them inconsistent.
    lock.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|e| e.into_inner())
}

/// Every [`TICK`], a round: take this replica's rates, read the others' (at once, each
/// bounded in time and size), forget replicas that are gone; the round before is kept.
/// Stops when the caches are dropped.
async fn exchange(peers: Peers, port: u16) {
    let client = ferrite_api::scrape::pod_client(TICK / 2);
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let own = peers.demand.rates(Instant::now());
        let pods = peers.ready_pods();
        let others = pods
            .iter()
            .filter(|(name, _)| peers.me.as_deref() != Some(name.as_str()))
            .filter_map(|(name, ip)| Some((name.clone(), ip.clone()?)));
        let reads = others.map(|(name, ip)| {
            let client = client.clone();
            async move { (name, fetch(&client, &ip, port).await) }
        });
        let answers = futures::future::join_all(reads).await;
        let now = Instant::now();
        let mut rounds = write(&peers.rounds);
        rounds[1] = rounds[0].clone();
        let latest = &mut rounds[0];
        latest.own = own;
        for (name, answer) in answers {
            match answer {
                Ok(rates) => {
                    latest.others.insert(name, (rates, now));
                }
                Err(e) => tracing::debug!(peer = %name, error = %e, "no tenant rates"),
            }
        }
        latest
            .others
            .retain(|name, _| pods.iter().any(|p| p.0 == *name));
    }
}

/// One replica's rates: a JSON object of tenant to tokens a second. Another pod's answer is
/// not trusted beyond its shape: bounded, and a rate that is not a finite number ≥ 0 counts
/// as none (a replica's claim can only lower this one's share, never raise the total).
async fn fetch(
    client: &HttpClient<HttpConnector, Empty<Bytes>>,
    ip: &str,
    port: u16,
) -> Result<HashMap<String, f64>, String> {
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    let uri = format!("http://{host}:{port}{DEMAND_PATH}");
    let request = hyper::Request::get(&uri)
        .body(Empty::new())
        .map_err(|e| e.to_string())?;
    let read = async {
        let resp = client.request(request).await.map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("{uri}: {}", resp.status()));
        }
        Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .map_err(|e| e.to_string())
    };
    let body = tokio::time::timeout(TICK / 2, read)
        .await
        .map_err(|_| format!("{uri}: no answer within {:?}", TICK / 2))??;
    let rates: HashMap<String, serde_json::Value> =
        serde_json::from_slice(&body).map_err(|e| format!("{uri}: {e}"))?;
    Ok(rates
        .into_iter()
        .filter_map(|(t, v)| Some((t, v.as_f64().filter(|r| r.is_finite() && *r >= 0.0)?)))
        .collect())
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}
