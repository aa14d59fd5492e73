//! Which InferenceServices serve which model, and their ready pods: two watch caches (the
//! InferenceServices, and their members: the EndpointSlices of the operator's Services or the
//! pods its Deployments make, see [`crate::members`]), read on every request.
//! Every change bumps a counter that held requests wait on, so a request waiting for a cold
//! service moves the moment its first pod turns Ready.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ferrite_api::conditions;
use ferrite_api::crd::{InferenceService, RoutingPolicy, SecretKeyRef};
use ferrite_api::served::{served_name, served_name_holder, split_group};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::watch;

use crate::members::{self, Endpoint, EndpointsFrom, Members};

/// An InferenceService as the router needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    /// The `model` clients send.
    pub model: String,
    pub policy: RoutingPolicy,
    pub cold_start_timeout: Duration,
    /// `spec.replicas` as the scale subresource has it.
    pub replicas: i32,
    /// The reason of a `Degraded=True` condition that needs a person (a crash loop, an image
    /// that cannot be pulled): held requests are not kept waiting for a service that will not
    /// become ready on its own.
    pub degraded: Option<String>,
    /// Ready pods, by name.
    pub endpoints: Vec<Endpoint>,
    /// The LoRA adapters it declares (`spec.model.adapters`), by name.
    pub adapters: Vec<String>,
    /// The adapter the request names, when `model` named one of `adapters`.
    pub adapter: Option<String>,
    /// Its aliases (`spec.model.aliases`).
    pub aliases: Vec<String>,
    /// The Secret holding its API key (`spec.auth`), which a router with tenants sends.
    pub api_key: Option<SecretKeyRef>,
}

impl Service {
    /// `namespace/name`: the id that always names this service, whatever served names others
    /// claim.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The watch caches, shared by every request.
#[derive(Clone)]
pub struct Registry {
    isvcs: Store<InferenceService>,
    members: Members,
    changes: watch::Receiver<u64>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("isvcs", &self.isvcs.state().len())
            .field("members", &self.members)
            .finish()
    }
}

impl Registry {
    /// Starts the watches, cluster-wide or in `namespace`, with endpoints `from` slices or
    /// pods.
    pub fn start(client: Client, namespace: Option<&str>, from: EndpointsFrom) -> Registry {
        let (tx, changes) = watch::channel(0u64);
        let tx = Arc::new(tx);
        let members_config = watcher::Config::default().labels(&members::selector(from));
        let members = match from {
            EndpointsFrom::EndpointSlices => Members::Slices(reflect(
                "EndpointSlice",
                scoped::<EndpointSlice>(&client, namespace),
                members_config,
                tx.clone(),
            )),
            EndpointsFrom::Pods => Members::Pods(reflect(
                "Pod",
                scoped::<Pod>(&client, namespace),
                members_config,
                tx.clone(),
            )),
        };
        let isvcs = reflect(
            "InferenceService",
            scoped(&client, namespace),
            watcher::Config::default(),
            tx,
        );
        Registry {
            isvcs,
            members,
            changes,
        }
    }

    /// Waits until both caches have been listed once.
    pub async fn ready(&self) -> Result<(), reflector::store::WriterDropped> {
        self.isvcs.wait_until_ready().await?;
        self.members.wait_until_ready().await
    }

    /// A receiver that sees every change of either cache.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.clone()
    }

    /// The service serving `model`: `namespace/name` names one InferenceService exactly
    /// (always, whatever served names others claim); otherwise the served name's oldest
    /// claimant holds it (creation time, then namespace and name, so every router replica
    /// agrees), and later claimants get none of its traffic (the operator marks them
    /// `ServedNameConflict`). A name no service serves may be an adapter's: the oldest
    /// service declaring it serves it, with [`Service::adapter`] set; else an alias
    /// (`spec.model.aliases`), held the same way, whose requests go on under the served name.
    pub fn find(&self, model: &str) -> Option<Service> {
        let all = self.isvcs.state();
        let live = all.iter().filter(|i| i.meta().deletion_timestamp.is_none());
        if let Some((ns, name)) = model.split_once('/')
            && let Some(i) = live
                .clone()
                .find(|i| i.namespace().as_deref() == Some(ns) && i.name_any() == name)
        {
            return Some(self.service(i));
        }
        let claimants = live
            .clone()
            .map(|i| &**i)
            .filter(|i| served_name(i) == model);
        if let Some(holder) = served_name_holder(claimants) {
            return Some(self.service(holder));
        }
        // An adapter's name, held like a served name: by its oldest declarer.
        let declarers = live
            .clone()
            .map(|i| &**i)
            .filter(|i| i.spec.model.adapters.iter().any(|a| a.name == model));
        if let Some(i) = served_name_holder(declarers) {
            return Some(Service {
                adapter: Some(model.to_string()),
                ..self.service(i)
            });
        }
        // An alias, held the same way; the request goes on under the served name.
        let aliased = live
            .map(|i| &**i)
            .filter(|i| i.spec.model.aliases.iter().any(|a| a == model));
        served_name_holder(aliased).map(|i| self.service(i))
    }

    /// The services sharing served name `model`'s traffic by weight (`spec.routing.weight`,
    /// [`ferrite_api::served::split_group`]) as `(namespace/name, weight)`, sorted by name;
    /// empty when the name's holder serves it alone (or no service serves it).
    pub fn split(&self, model: &str) -> Vec<(String, u32)> {
        let all = self.isvcs.state();
        let claimants = all
            .iter()
            .map(|i| &**i)
            .filter(|i| i.meta().deletion_timestamp.is_none() && served_name(i) == model);
        let group = split_group(claimants);
        let weighted = group
            .first()
            .is_some_and(|(i, _)| i.spec.routing.as_ref().is_some_and(|r| r.weight.is_some()));
        if !weighted {
            return Vec::new();
        }
        group
            .into_iter()
            .map(|(i, w)| {
                let id = format!("{}/{}", i.namespace().unwrap_or_default(), i.name_any());
                (id, w)
            })
            .collect()
    }

    /// Every service, sorted by model name; a service that does not hold its served name is
    /// listed under its `namespace/name`.
    pub fn all(&self) -> Vec<Service> {
        let isvcs = self.isvcs.state();
        let live: Vec<&InferenceService> = isvcs
            .iter()
            .map(|i| &**i)
            .filter(|i| i.meta().deletion_timestamp.is_none())
            .collect();
        // Each served name's holder, in one pass.
        let mut holders: HashMap<String, &InferenceService> = HashMap::new();
        for &i in &live {
            holders
                .entry(served_name(i))
                .and_modify(|h| *h = served_name_holder([*h, i]).unwrap_or(i))
                .or_insert(i);
        }
        let mut all: Vec<Service> = live
            .iter()
            .map(|&i| {
                let mut s = self.service(i);
                if holders.get(&s.model).is_some_and(|h| !std::ptr::eq(*h, i)) {
                    s.model = s.id();
                }
                s
            })
            .collect();
        all.sort_by(|a, b| {
            (&a.model, &a.namespace, &a.name).cmp(&(&b.model, &b.namespace, &b.name))
        });
        all
    }

    fn service(&self, isvc: &InferenceService) -> Service {
        let (ns, name) = (isvc.namespace().unwrap_or_default(), isvc.name_any());
        let endpoints = self.members.ready(&ns, &name, isvc.port());
        Service {
            model: served_name(isvc),
            policy: isvc.routing_policy(),
            cold_start_timeout: isvc.cold_start_timeout(),
            replicas: isvc.spec.replicas.unwrap_or(1),
            degraded: degraded_reason(isvc),
            endpoints,
            adapters: isvc
                .spec
                .model
                .adapters
                .iter()
                .map(|a| a.name.clone())
                .collect(),
            aliases: isvc.spec.model.aliases.clone(),
            api_key: isvc
                .spec
                .auth
                .as_ref()
                .map(|a| a.api_key_secret_ref.clone()),
            adapter: None,
            namespace: ns,
            name,
        }
    }
}

/// `Degraded` reasons a cold start waits through: pods that no node can take yet (a node
/// autoscaler adds one within minutes), a ReplicaSet blocked by a quota that may free, an API
/// server failing for a moment. Every other reason (an image that cannot be pulled, a crash
/// loop, a model that cannot be downloaded or loaded, a spec that cannot be applied) needs a
/// person, so held requests are answered at once.
const TRANSIENT_DEGRADED: [&str; 3] = [
    conditions::UNSCHEDULABLE,
    conditions::REPLICA_FAILURE,
    conditions::CHILD_APPLY_FAILED,
];

/// The reason of the service's `Degraded=True` condition, unless a cold start waits it out.
fn degraded_reason(isvc: &InferenceService) -> Option<String> {
    conditions::condition(isvc.status.as_ref()?, conditions::DEGRADED)
        .filter(|c| c.status == "True" && !TRANSIENT_DEGRADED.contains(&c.reason.as_str()))
        .map(|c| c.reason.clone())
}

/// `K`s in `namespace`, or cluster-wide.
fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = kube::core::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Runs a watch into a new store, bumping `changed` on every event; retries with backoff.
pub(crate) fn reflect<K>(
    kind: &'static str,
    api: Api<K>,
    config: watcher::Config,
    changed: Arc<watch::Sender<u64>>,
) -> Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default + Send + Sync,
{
    let (store, writer) = reflector::store();
    tokio::spawn(async move {
        let stream = watcher(api, config).default_backoff().reflect(writer);
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            if let Err(e) = event {
                tracing::warn!(kind, error = %e, "watch failed; retrying");
                continue;
            }
            changed.send_modify(|n| *n = n.wrapping_add(1));
        }
    });
    store
}
