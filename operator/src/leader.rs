//! Leader election over a `coordination.k8s.io/v1` Lease, so that of several operator
//! replicas exactly one reconciles. Like client-go, expiry is judged by the local clock from
//! when this replica last saw the record change, never by comparing clocks across nodes;
//! writes carry the read `resourceVersion`, so two candidates cannot both win. [`lead`] is the
//! loop around it: wait, act while renewing, hand back or exit when lost.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Debug, Clone)]
pub struct LeaseSettings {
    pub name: String,
    pub namespace: String,
    /// This replica's identity (the pod name).
    pub identity: String,
    /// How long a lease holds without renewal.
    pub lease_duration: Duration,
}

/// The outcome of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    Leader,
    /// Someone else holds a live lease (their identity, when known).
    Follower(Option<String>),
}

#[derive(Debug)]
pub struct LeaderElector {
    api: Api<Lease>,
    settings: LeaseSettings,
    /// The holder and renew time last seen, and when they were first seen locally.
    observed: Option<(Option<String>, Option<MicroTime>, Instant)>,
}

impl LeaderElector {
    pub fn new(client: kube::Client, settings: LeaseSettings) -> Self {
        Self {
            api: Api::namespaced(client, &settings.namespace),
            settings,
            observed: None,
        }
    }

    fn duration_secs(&self) -> i32 {
        i32::try_from(self.settings.lease_duration.as_secs().max(1)).unwrap_or(i32::MAX)
    }

    fn spec_for_us(&self, previous: Option<&LeaseSpec>) -> LeaseSpec {
        let now = MicroTime(Timestamp::now());
        let ours = previous.and_then(|p| p.holder_identity.as_deref())
            == Some(self.settings.identity.as_str());
        let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.settings.identity.clone()),
            lease_duration_seconds: Some(self.duration_secs()),
            acquire_time: if ours {
                previous.and_then(|p| p.acquire_time.clone())
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if ours || previous.is_none() {
                transitions
            } else {
                transitions + 1
            }),
            ..LeaseSpec::default()
        }
    }

    /// One acquire-or-renew attempt.
    pub async fn try_acquire(&mut self) -> Result<Role, kube::Error> {
        let name = self.settings.name.clone();
        let Some(mut lease) = self.api.get_opt(&name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name),
                    namespace: Some(self.settings.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec_for_us(None)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(Role::Leader),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(Role::Follower(None)),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let ours = holder.as_deref() == Some(self.settings.identity.as_str());
        if !ours && holder.is_some() && !self.expired(&spec) {
            return Ok(Role::Follower(holder));
        }
        lease.spec = Some(self.spec_for_us(Some(&spec)));
        match self
            .api
            .replace(&name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => {
                self.observed = None;
                Ok(Role::Leader)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Role::Follower(holder)),
            Err(e) => Err(e),
        }
    }

    /// Whether another holder's lease has gone unrenewed for its whole duration, as measured
    /// locally since the record last changed.
    fn expired(&mut self, spec: &LeaseSpec) -> bool {
        let record = (spec.holder_identity.clone(), spec.renew_time.clone());
        let seen_at = match &self.observed {
            Some((h, r, at)) if (h, r) == (&record.0, &record.1) => *at,
            _ => {
                self.observed = Some((record.0, record.1, Instant::now()));
                return false;
            }
        };
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(self.settings.lease_duration, Duration::from_secs);
        seen_at.elapsed() >= duration
    }

    /// Gives the lease up so a standby takes over at once instead of after expiry.
    pub async fn release(&mut self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.settings.name).await? else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.settings.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        self.api
            .replace(&self.settings.name, &PostParams::default(), &lease)
            .await
            .map(|_| ())
    }
}

/// What the Lease loop tells the rest of the process as this replica's role changes.
pub trait Leadership {
    /// Another replica leads (`holder`, when known); this one serves reads.
    fn standing_by(&self, holder: Option<&str>);
    /// The Lease is this replica's: act.
    fn acquired(&self);
    /// The Lease is lost: health fails at once, before in-flight work is given its grace.
    fn lost(&self);
    /// Leading has ended, whichever way: stop acting.
    fn ended(&self);
}

/// Leading ended because the Lease was lost: the process should exit and come back as a
/// standby rather than idle as a leader that no longer leads.
#[derive(Debug, thiserror::Error)]
#[error("lost the leader Lease; exiting so that this replica restarts as a standby")]
pub struct LeaseLost;

/// How often candidates try for the Lease and the leader renews it: client-go's 2 s, or a
/// third of a shorter Lease.
pub fn retry_period(lease: Duration) -> Duration {
    (lease / 3).min(Duration::from_secs(2))
}

/// How long a replica that lost its Lease gives in-flight work before it exits.
const LOST_GRACE: Duration = Duration::from_secs(5);

/// Waits for the Lease, then runs `work` while renewing it, and hands the Lease back when
/// `stop` says so. `work` gets a future that completes when it must stop (on `stop`, or when
/// the Lease is lost). Renewal retries every [`retry_period`]; when none has succeeded for two
/// thirds of the Lease duration (client-go's renew deadline), the Lease is lost: `roles.lost()`
/// is told at once, `work` gets [`LOST_GRACE`] to finish, and this returns [`LeaseLost`].
/// `Ok(None)`: stopped before leading, or `work` still running when the grace ran out.
pub async fn lead<W, F, R>(
    client: kube::Client,
    settings: LeaseSettings,
    roles: &impl Leadership,
    stop: watch::Receiver<bool>,
    work: W,
) -> Result<Option<R>, LeaseLost>
where
    W: FnOnce(Pin<Box<dyn Future<Output = ()> + Send + Sync>>) -> F,
    F: Future<Output = R>,
{
    let retry = retry_period(settings.lease_duration);
    let mut elector = LeaderElector::new(client, settings.clone());
    if !wait_for_lease(&mut elector, retry, roles, &stop).await {
        return Ok(None);
    }
    roles.acquired();
    tracing::info!(identity = %settings.identity, "acquired the leader Lease");
    let (done_tx, done_rx) = watch::channel(false);
    let (renewer, lost_rx) = renew(
        elector,
        retry,
        settings.lease_duration,
        stop.clone(),
        done_rx,
    );
    let result = run_until_lost(work, roles, stop, lost_rx.clone()).await;
    roles.ended();
    let _ = done_tx.send(true);
    if *lost_rx.borrow() {
        roles.lost();
        return Err(LeaseLost);
    }
    if let Ok(mut elector) = renewer.await
        && let Err(e) = elector.release().await
    {
        tracing::warn!(error = %e, "releasing the leader Lease");
    }
    Ok(result)
}

/// Tries for the Lease every `retry` until it is ours (`true`) or `stop` (`false`).
async fn wait_for_lease(
    elector: &mut LeaderElector,
    retry: Duration,
    roles: &impl Leadership,
    stop: &watch::Receiver<bool>,
) -> bool {
    loop {
        if *stop.borrow() {
            return false;
        }
        match elector.try_acquire().await {
            Ok(Role::Leader) => return true,
            Ok(Role::Follower(holder)) => {
                roles.standing_by(holder.as_deref());
                tracing::info!(holder = holder.as_deref().unwrap_or("?"), "standing by");
            }
            Err(e) => tracing::warn!(error = %e, "leader election"),
        }
        let mut s = stop.clone();
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            _ = s.wait_for(|v| *v) => return false,
        }
    }
}

/// Renews the Lease every `retry` on a task of its own until `stop` or `done`; the returned
/// receiver turns true when it is lost (another holder, or no renewal within two thirds of
/// `lease`). The task hands the elector back, to release the Lease.
fn renew(
    mut elector: LeaderElector,
    retry: Duration,
    lease: Duration,
    mut stop: watch::Receiver<bool>,
    mut done: watch::Receiver<bool>,
) -> (JoinHandle<LeaderElector>, watch::Receiver<bool>) {
    let (lost_tx, lost_rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        let mut last_ok = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(retry) => {}
                _ = stop.wait_for(|v| *v) => return elector,
                _ = done.wait_for(|v| *v) => return elector,
            }
            match elector.try_acquire().await {
                Ok(Role::Leader) => last_ok = tokio::time::Instant::now(),
                Ok(Role::Follower(holder)) => {
                    tracing::error!(
                        holder = holder.as_deref().unwrap_or("?"),
                        "lost the leader Lease to another replica"
                    );
                    let _ = lost_tx.send(true);
                    return elector;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "renewing the leader Lease");
                    if last_ok.elapsed() >= lease * 2 / 3 {
                        tracing::error!(
                            "could not renew the leader Lease within its renew deadline"
                        );
                        let _ = lost_tx.send(true);
                        return elector;
                    }
                }
            }
        }
    });
    (task, lost_rx)
}

/// Runs `work` until it ends; if the Lease is lost first, tells `roles` at once and gives the
/// work [`LOST_GRACE`] (`None` if it is still running then).
async fn run_until_lost<W, F, R>(
    work: W,
    roles: &impl Leadership,
    stop: watch::Receiver<bool>,
    lost: watch::Receiver<bool>,
) -> Option<R>
where
    W: FnOnce(Pin<Box<dyn Future<Output = ()> + Send + Sync>>) -> F,
    F: Future<Output = R>,
{
    let shutdown = {
        let (mut stop, mut lost) = (stop, lost.clone());
        Box::pin(async move {
            tokio::select! {
                _ = stop.wait_for(|v| *v) => {}
                _ = lost.wait_for(|v| *v) => {}
            }
        })
    };
    let run = work(shutdown);
    let mut run = std::pin::pin!(run);
    let mut lost = lost;
    tokio::select! {
        r = &mut run => Some(r),
        _ = lost.wait_for(|v| *v) => {
            roles.lost();
            match tokio::time::timeout(LOST_GRACE, &mut run).await {
                Ok(r) => Some(r),
                Err(_) => {
                    tracing::warn!("work still in flight after losing the Lease; exiting anyway");
                    None
                }
            }
        }
    }
}
