//! Leader election over a `coordination.k8s.io/v1` Lease, so that of several operator
//! replicas exactly one reconciles. Like client-go, expiry is judged by the local clock from
//! when this replica last saw the record change, never by comparing clocks across nodes;
//! writes carry the read `resourceVersion`, so two candidates cannot both win.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};

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
