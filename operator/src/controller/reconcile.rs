//! One reconcile of one InferenceService, as named steps: dereference (what the cluster
//! offers) → validate (the spec parsed once, its claims present) → build (pure) → apply
//! (server-side apply, prune) → status (pure, then written with the events).

use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};

use crate::build::keda::ScaledObject;
use crate::build::lws::LeaderWorkerSet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PartialObjectMeta, Patch};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::apply::{self, Change};
use super::{Context, Error};
use crate::autoscale::store::Key;
use crate::build::dashboards::DASHBOARD_COMPONENT;
use crate::build::model::claims_of;
use crate::build::monitor::ServiceMonitor;
use crate::build::{self, ClusterCapabilities, Desired, Validated, Workload, selector, url};
use crate::cache::Caches;
use crate::status::{self, DEGRADED, Finding, MonitorState, Observation, READY};
use ferrite_api::crd::{InferenceService, InferenceServiceStatus};
use ferrite_api::labels::{COMPONENT_LABEL, INSTANCE_LABEL};

/// How long a reconcile waits for the ServiceMonitor cache's first listing.
const MONITOR_CACHE_WAIT: Duration = Duration::from_secs(10);

/// Reconciles one InferenceService and records the outcome in the operator's metrics.
pub async fn reconcile(isvc: Arc<InferenceService>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&isvc, &ctx).await;
    ctx.metrics.observe_reconcile(
        started.elapsed(),
        result.as_ref().err().map(Error::metric_label),
    );
    if result.is_ok() {
        ctx.succeeded(&isvc);
    }
    result
}

/// Events to publish once the reconcile has done its writes.
type Events = Vec<Event>;

fn event(type_: EventType, reason: &str, action: &str, note: String) -> Event {
    Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: action.into(),
        secondary: None,
    }
}

/// The child an event is about, as its `related` object. kube's recorder folds events with the
/// same reason and objects into one series, keeping the first note; without this, "created
/// Deployment" and "created Service" would collapse into one event.
fn child_ref<K: Resource<DynamicType = ()>>(ns: &str, name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some(K::api_version(&()).into_owned()),
        kind: Some(K::kind(&()).into_owned()),
        namespace: Some(ns.to_string()),
        name: Some(name.to_string()),
        ..ObjectReference::default()
    }
}

fn record<K: Resource<DynamicType = ()>>(
    events: &mut Events,
    change: Change,
    ns: &str,
    name: &str,
) {
    let kind = K::kind(&());
    let (reason, note) = match change {
        Change::Unchanged => return,
        Change::Created => ("Created", format!("created {kind} {name}")),
        Change::Updated => ("Updated", format!("updated {kind} {name}")),
        Change::Restored => (
            "Updated",
            format!("restored {kind} {name}, which was changed outside the operator"),
        ),
    };
    let mut e = event(EventType::Normal, reason, "Apply", note);
    e.secondary = Some(child_ref::<K>(ns, name));
    events.push(e);
}

async fn reconcile_inner(isvc: &InferenceService, ctx: &Context) -> Result<Action, Error> {
    // Being deleted: garbage collection removes the children; re-applying them would fight it.
    if isvc.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let id = Identity::of(isvc)?;
    ctx.caches
        .ready()
        .await
        .map_err(|_| Error::Cache("watch"))?;
    let cluster = dereference(ctx).await?;
    let desired = validate(isvc, ctx, &id.ns).and_then(|v| build_step(&v, ctx, cluster.caps));
    let mut events = Events::new();
    let applied = apply_step(ctx, &id, &cluster, desired, &mut events).await?;
    let rollout = applied.workload.as_ref().map(|w| w.observed().rollout());
    let new_status = status_step(isvc, ctx, &id, &cluster, &applied, rollout);
    transition_events(isvc.status.as_ref(), &new_status, &mut events);
    publish(ctx, isvc, &id, &new_status, &events).await?;
    next_action(ctx, applied, rollout.is_some_and(|r| r.complete))
}

/// Who is being reconciled.
struct Identity {
    ns: String,
    name: String,
    uid: String,
}

impl Identity {
    fn of(isvc: &InferenceService) -> Result<Self, Error> {
        Ok(Self {
            ns: isvc.namespace().ok_or(Error::Metadata("namespace"))?,
            name: isvc.name_any(),
            uid: isvc.uid().ok_or(Error::Metadata("uid"))?,
        })
    }
}

/// What the cluster offers this reconcile, read once before validation.
struct Cluster {
    caps: ClusterCapabilities,
    /// The ServiceMonitor cache, when the CRD is installed.
    monitors: Option<Store<PartialObjectMeta<ServiceMonitor>>>,
    /// The NetworkPolicy cache, when the operator makes them.
    network_policies: Option<Store<PartialObjectMeta<NetworkPolicy>>>,
    /// The Role and RoleBinding caches, when the operator grants the router API keys.
    router_keys: Option<RouterKeyStores>,
    /// The ScaledObject cache, when KEDA's CRD is installed and the operator may write them.
    scaled_objects: Option<Store<PartialObjectMeta<ScaledObject>>>,
    /// The LeaderWorkerSet cache, when its CRD is installed and the operator may write them.
    groups: Option<Store<LeaderWorkerSet>>,
}

/// The caches of the router's API-key grants (see `build::router_key`).
struct RouterKeyStores {
    roles: Store<PartialObjectMeta<Role>>,
    bindings: Store<PartialObjectMeta<RoleBinding>>,
}

/// Dereference: the optional APIs the cluster serves, and their caches.
async fn dereference(ctx: &Context) -> Result<Cluster, Error> {
    let (service_monitor_crd, monitors) = optional(
        ctx.discovery.service_monitor_crd(&ctx.client),
        |served| served,
        "ServiceMonitor",
        ctx.caches.monitors(MONITOR_CACHE_WAIT),
    )
    .await?;
    // Where KEDA runs, HPA mode is refused whether or not the operator may use it.
    let (scaled_object_crd, scaled_objects) = optional(
        ctx.discovery.scaled_object_crd(&ctx.client),
        |served| served && ctx.config.keda,
        "ScaledObject",
        ctx.caches.scaled_objects(MONITOR_CACHE_WAIT),
    )
    .await?;
    // LWS is looked for only by an operator allowed to write it.
    let (leader_worker_set_crd, groups) = optional(
        async {
            match ctx.config.leader_worker_sets {
                true => ctx.discovery.leader_worker_set_crd(&ctx.client).await,
                false => Ok(false),
            }
        },
        |served| served,
        "LeaderWorkerSet",
        ctx.caches.groups(MONITOR_CACHE_WAIT),
    )
    .await?;
    let network_policies = cache_if(
        ctx.config.network_policy_peers.is_some(),
        "NetworkPolicy",
        ctx.caches.network_policies(MONITOR_CACHE_WAIT),
    )
    .await?;
    let granting = ctx.config.router_service_account.is_some();
    let roles = cache_if(granting, "Role", ctx.caches.roles(MONITOR_CACHE_WAIT)).await?;
    let bindings = cache_if(
        granting,
        "RoleBinding",
        ctx.caches.role_bindings(MONITOR_CACHE_WAIT),
    )
    .await?;
    let router_keys = roles
        .zip(bindings)
        .map(|(roles, bindings)| RouterKeyStores { roles, bindings });
    Ok(Cluster {
        caps: ClusterCapabilities {
            service_monitor_crd,
            scaled_object_crd,
            leader_worker_set_crd,
        },
        monitors,
        network_policies,
        router_keys,
        scaled_objects,
        groups,
    })
}

/// An optional kind: whether the cluster serves it (`crd`), and its cache where the operator
/// `uses` it, given that answer.
async fn optional<S>(
    crd: impl std::future::Future<Output = Result<bool, kube::Error>>,
    uses: impl FnOnce(bool) -> bool,
    kind: &'static str,
    cache: impl std::future::Future<Output = Option<S>>,
) -> Result<(bool, Option<S>), Error> {
    let served = crd.await.map_err(Error::Discovery)?;
    Ok((served, cache_if(uses(served), kind, cache).await?))
}

/// An optional cache, when the reconcile needs it (`wanted`), once it has its first listing;
/// `cache` is only started then.
async fn cache_if<S>(
    wanted: bool,
    kind: &'static str,
    cache: impl std::future::Future<Output = Option<S>>,
) -> Result<Option<S>, Error> {
    if !wanted {
        return Ok(None);
    }
    cache.await.map(Some).ok_or(Error::Cache(kind))
}

/// Validate: the spec parsed once, and the claims it names present. A missing claim is
/// reported before anything wrong with the spec itself: it is the likelier thing to fix.
fn validate<'a>(
    isvc: &'a InferenceService,
    ctx: &Context,
    ns: &str,
) -> Result<Validated<'a>, Finding> {
    let caches = &ctx.caches;
    let valid = build::validate(isvc, &ctx.config);
    let claims = match &valid {
        Ok(v) => v.claims(),
        Err(_) => claims_of(isvc),
    };
    if let Some(missing) = missing_claim(&claims, caches, ns) {
        return Err(missing);
    }
    valid.map_err(|e| Finding::new(e.reason(), e.to_string()))
}

/// Build (pure): the objects that should exist.
fn build_step(
    v: &Validated<'_>,
    ctx: &Context,
    caps: ClusterCapabilities,
) -> Result<Desired, Finding> {
    build::desired(v, &ctx.config, caps).map_err(|e| Finding::new(e.reason(), e.to_string()))
}

/// The workload as last written or cached.
enum Live {
    Deployment(Arc<Deployment>),
    Groups(Arc<LeaderWorkerSet>),
}

impl Live {
    fn observed(&self) -> status::Workload<'_> {
        match self {
            Live::Deployment(d) => status::Workload::Deployment(d),
            Live::Groups(g) => status::Workload::Groups(g),
        }
    }
}

/// The workload in the caches: the Deployment, else the LeaderWorkerSet (both exist only
/// while a spec moves between them).
fn cached_workload(ctx: &Context, cluster: &Cluster, id: &Identity) -> Option<Live> {
    cached(&ctx.caches.deployments, &id.ns, &id.name)
        .map(Live::Deployment)
        .or_else(|| {
            let groups = cluster.groups.as_ref()?;
            cached(groups, &id.ns, &id.name).map(Live::Groups)
        })
}

/// What applying left behind, for the status step.
struct Applied {
    /// The workload as last written or cached.
    workload: Option<Live>,
    /// Why the spec could not be applied, if it could not.
    blocked: Option<Finding>,
    /// The API server would not take a child: the reconcile fails with this after status is
    /// written.
    failed: Option<Error>,
}

/// Apply, or leave the running workload alone when the spec cannot be applied. A child the
/// API server refuses (invalid, forbidden, over quota) blocks the spec like a build error, so
/// status says why; the reconcile still fails afterwards, to be retried with backoff.
async fn apply_step(
    ctx: &Context,
    id: &Identity,
    cluster: &Cluster,
    desired: Result<Desired, Finding>,
    events: &mut Events,
) -> Result<Applied, Error> {
    let desired = match desired {
        Ok(d) => d,
        Err(blocked) => {
            return Ok(Applied {
                workload: cached_workload(ctx, cluster, id),
                blocked: Some(blocked),
                failed: None,
            });
        }
    };
    let children = Children {
        ctx,
        ns: &id.ns,
        name: &id.name,
        uid: &id.uid,
        monitors: cluster.monitors.as_ref(),
        network_policies: cluster.network_policies.as_ref(),
        router_keys: cluster.router_keys.as_ref(),
        scaled_objects: cluster.scaled_objects.as_ref(),
        groups: cluster.groups.as_ref(),
    };
    match children.apply_all(desired, events).await {
        Ok(workload) => Ok(Applied {
            workload: Some(workload),
            blocked: None,
            failed: None,
        }),
        Err(e) => {
            let Some((finding, for_good)) = refusal(&e) else {
                return Err(e);
            };
            // A refusal for good is an error of its own kind; a failure on the server's side
            // keeps its own (an API error, retried).
            let failed = match for_good {
                true => Error::Refused(finding.message.clone()),
                false => e,
            };
            Ok(Applied {
                blocked: Some(finding),
                workload: cached_workload(ctx, cluster, id),
                failed: Some(failed),
            })
        }
    }
}

/// Status (pure once observed): what was applied, the rollout, the pods while it is
/// incomplete, monitoring and the autoscaler's published view.
fn status_step(
    isvc: &InferenceService,
    ctx: &Context,
    id: &Identity,
    cluster: &Cluster,
    applied: &Applied,
    rollout: Option<status::Rollout>,
) -> InferenceServiceStatus {
    let (ns, name) = (id.ns.as_str(), id.name.as_str());
    // Observe pods only while the rollout is incomplete: that is when they explain why.
    let pod_failure = match rollout {
        Some(r) if !r.complete => {
            let pods = ctx.caches.pods_of(ns, name);
            let pods: Vec<_> = pods.iter().map(|p| (**p).clone()).collect();
            status::pod_failure(&pods)
        }
        _ => None,
    };
    let monitor = match (
        isvc.spec.monitoring.service_monitor.enabled,
        cluster.caps.service_monitor_crd,
        &applied.blocked,
    ) {
        (false, _, _) => MonitorState::Disabled,
        (true, false, _) => MonitorState::CrdMissing,
        (true, true, None) => MonitorState::Applied,
        (true, true, Some(b)) => {
            let earlier = cluster
                .monitors
                .as_ref()
                .and_then(|m| cached(m, ns, name))
                .is_some_and(|m| apply::controlled_by(&m.metadata, &id.uid));
            MonitorState::NotApplied {
                earlier,
                why: b.message.clone(),
            }
        }
    };
    let obs = Observation {
        generation: isvc.metadata.generation,
        blocked: applied.blocked.clone(),
        desired_replicas: isvc.desired_replicas(),
        workload: applied.workload.as_ref().map(Live::observed),
        pod_failure,
        monitor,
        selector: Some(selector(name)),
        url: Some(url(isvc)),
        autoscaling: isvc
            .spec
            .autoscaling
            .as_ref()
            .map(|_| ctx.autoscale.get(&Key::new(ns, name))),
        served_name_conflict: status::served_name_conflict(
            isvc,
            ctx.caches.isvcs.state().iter().map(|i| &**i),
        ),
        adapters: crate::build::adapters::status_of(isvc, ctx.adapters.get(&Key::new(ns, name))),
    };
    status::compute(&obs, isvc.status.as_ref(), &status::now())
}

/// Records the events, then writes status if it changed.
async fn publish(
    ctx: &Context,
    isvc: &InferenceService,
    id: &Identity,
    new_status: &InferenceServiceStatus,
    events: &Events,
) -> Result<(), Error> {
    for e in events {
        // Events are best effort: a failure to record one must not fail the reconcile.
        if let Err(err) = ctx.recorder.publish(e, &isvc.object_ref(&())).await {
            tracing::warn!(namespace = %id.ns, name = %id.name, error = %err, "publishing an event");
        }
    }
    if isvc.status.as_ref() == Some(new_status) {
        return Ok(());
    }
    let isvcs: Api<InferenceService> = Api::namespaced(ctx.client.clone(), &id.ns);
    let body = json!({
        "apiVersion": InferenceService::api_version(&()),
        "kind": InferenceService::kind(&()),
        "metadata": {"name": id.name},
        "status": new_status,
    });
    isvcs
        .patch_status(&id.name, &apply::apply_params(), &Patch::Apply(&body))
        .await
        .map_err(Error::kube("InferenceService status", &id.name))?;
    Ok(())
}

/// When to look again: soon while a rollout is under way, rarely once settled; a child the
/// API server would not take fails the reconcile so that it is retried with backoff.
fn next_action(ctx: &Context, applied: Applied, complete: bool) -> Result<Action, Error> {
    if let Some(e) = applied.failed {
        return Err(e);
    }
    let t = &ctx.timing;
    Ok(Action::requeue(if applied.blocked.is_some() {
        t.blocked
    } else if complete {
        t.settled
    } else {
        t.progressing
    }))
}

/// A finding for a child the API server would not take: refused for good (400 invalid, 403
/// forbidden or over quota, 422 unprocessable), or failed on its side (5xx, e.g. no Service
/// IP left in the cluster's range). Retrying alone may not fix either, so status says it while
/// the reconcile is retried with backoff. Conflicts (409), throttling (429) and transport
/// errors are passing and only retried. The flag says whether it was refused for good.
fn refusal(e: &Error) -> Option<(Finding, bool)> {
    if let Error::ChildConflict { .. } = e {
        return Some((Finding::new("ChildConflict", e.to_string()), true));
    }
    let Error::Kube {
        kind,
        name,
        source: kube::Error::Api(s),
    } = e
    else {
        return None;
    };
    match s.code {
        400 | 403 | 422 => Some((
            Finding::new(
                "ChildRefused",
                format!("the API server refused {kind} {name}: {}", s.message),
            ),
            true,
        )),
        code if code >= 500 => Some((
            Finding::new(
                ferrite_api::conditions::CHILD_APPLY_FAILED,
                format!(
                    "the API server failed to apply {kind} {name}: {}",
                    s.message
                ),
            ),
            false,
        )),
        _ => None,
    }
}

/// `ns/name` from a cache.
fn cached<K>(store: &Store<K>, ns: &str, name: &str) -> Option<Arc<K>>
where
    K: kube::runtime::reflector::Lookup + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    store.get(&ObjectRef::new(name).within(ns))
}

/// The metadata of `ns/name` from a metadata cache.
fn cached_meta<K>(store: &Store<PartialObjectMeta<K>>, ns: &str, name: &str) -> Option<ObjectMeta>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    cached(store, ns, name).map(|m| m.metadata.clone())
}

/// The first of `claims` that does not exist.
fn missing_claim(claims: &[(&'static str, String)], caches: &Caches, ns: &str) -> Option<Finding> {
    claims.iter().find_map(|(field, claim)| {
        cached(&caches.claims, ns, claim).is_none().then(|| {
            Finding::new(
                "PersistentVolumeClaimNotFound",
                format!("{field} names PersistentVolumeClaim {ns}/{claim}, which does not exist"),
            )
        })
    })
}

/// A kind of child the operator applies server-side in the InferenceService's namespace.
trait Child:
    Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
    + Clone
    + Serialize
    + DeserializeOwned
    + Debug
{
}

impl<K> Child for K where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + Serialize
        + DeserializeOwned
        + Debug
{
}

/// The children of one InferenceService: named like it, controlled by its `uid`.
struct Children<'a> {
    ctx: &'a Context,
    ns: &'a str,
    name: &'a str,
    uid: &'a str,
    /// The ServiceMonitor cache, when the CRD is installed.
    monitors: Option<&'a Store<PartialObjectMeta<ServiceMonitor>>>,
    /// The NetworkPolicy cache, when the operator makes them.
    network_policies: Option<&'a Store<PartialObjectMeta<NetworkPolicy>>>,
    /// The Role and RoleBinding caches, when the operator grants the router API keys.
    router_keys: Option<&'a RouterKeyStores>,
    /// The ScaledObject cache, when KEDA's CRD is installed.
    scaled_objects: Option<&'a Store<PartialObjectMeta<ScaledObject>>>,
    /// The LeaderWorkerSet cache, when its CRD is installed and the operator may write them.
    groups: Option<&'a Store<LeaderWorkerSet>>,
}

impl Children<'_> {
    fn api<K: Resource<Scope = k8s_openapi::NamespaceResourceScope>>(&self) -> Api<K>
    where
        K::DynamicType: Default,
    {
        Api::namespaced(self.ctx.client.clone(), self.ns)
    }

    /// Applies every desired object and deletes the ones no longer wanted. Returns the
    /// workload as last written or cached.
    async fn apply_all(&self, desired: Desired, events: &mut Events) -> Result<Live, Error> {
        let (ns, name, caches) = (self.ns, self.name, &self.ctx.caches);
        let memo = &self.ctx.applied;
        let workload = self.apply_workload(desired.workload, events).await?;
        let live = cached_meta(&caches.services, ns, name);
        let (_, change) = apply::ensure(&self.api(), memo, desired.service, live.as_ref()).await?;
        record::<k8s_openapi::api::core::v1::Service>(events, change, ns, name);

        self.converge(desired.pdb, cached_meta(&caches.pdbs, ns, name), events)
            .await?;
        self.converge(desired.hpa, cached_meta(&caches.hpas, ns, name), events)
            .await?;
        // Without the CRD there is no ServiceMonitor to apply or to prune.
        if let Some(store) = self.monitors {
            self.converge(
                desired.service_monitor,
                cached_meta(store, ns, name),
                events,
            )
            .await?;
        }
        // Without KEDA there is no ScaledObject to apply (KEDA mode is Degraded) or prune.
        if let Some(store) = self.scaled_objects {
            self.converge(desired.scaled_object, cached_meta(store, ns, name), events)
                .await?;
        }
        // Only an operator that makes NetworkPolicies watches, applies or prunes them.
        if let Some(store) = self.network_policies {
            self.converge(desired.network_policy, cached_meta(store, ns, name), events)
                .await?;
        }
        // Only an operator told the router's ServiceAccount grants it keys, or prunes grants.
        if let Some(stores) = self.router_keys {
            let key = build::router_key::name_of(name);
            let (role, binding) = desired.router_key.unzip();
            // The Role first: a binding to a missing Role grants nothing, and is refused
            // nothing either.
            self.converge(role, cached_meta(&stores.roles, ns, &key), events)
                .await?;
            self.converge(binding, cached_meta(&stores.bindings, ns, &key), events)
                .await?;
        }

        // Dashboards vary in number: apply the wanted, delete the rest of ours.
        let mut live: Vec<ObjectMeta> = caches
            .config_maps
            .state()
            .into_iter()
            .map(|c| c.metadata.clone())
            .filter(|m| {
                let labels = m.labels.as_ref();
                m.namespace.as_deref() == Some(ns)
                    && labels
                        .and_then(|l| l.get(COMPONENT_LABEL))
                        .map(String::as_str)
                        == Some(DASHBOARD_COMPONENT)
                    && labels
                        .and_then(|l| l.get(INSTANCE_LABEL))
                        .map(String::as_str)
                        == Some(name)
                    && apply::controlled_by(m, self.uid)
            })
            .collect();
        let config_maps: Api<ConfigMap> = self.api();
        for cm in desired.dashboards {
            let cm_name = cm.name_any();
            let existing = live
                .iter()
                .position(|l| l.name.as_deref() == Some(cm_name.as_str()))
                .map(|i| live.swap_remove(i));
            let (_, change) = apply::ensure(&config_maps, memo, cm, existing.as_ref()).await?;
            record::<ConfigMap>(events, change, ns, &cm_name);
        }
        for stale in live {
            if apply::remove(&config_maps, memo, Some(&stale), self.uid).await? {
                events.push(deleted::<ConfigMap>(
                    ns,
                    stale.name.as_deref().unwrap_or_default(),
                ));
            }
        }
        Ok(workload)
    }

    /// Applies the workload; the one of the other kind, left from a spec that moved between
    /// one pod and a group per replica, goes once the new one is complete, or at once when the
    /// rollout may not surge (GPUs for both may not exist).
    async fn apply_workload(&self, desired: Workload, events: &mut Events) -> Result<Live, Error> {
        let (ns, name) = (self.ns, self.name);
        let surges = desired_surges(&desired);
        let live_deployment = cached(&self.ctx.caches.deployments, ns, name);
        let live_groups = self.groups.and_then(|g| cached(g, ns, name));
        let (written, old) = match desired {
            Workload::Deployment(d) => (
                self.ensure_live(*d, live_deployment, events)
                    .await?
                    .map(Live::Deployment),
                live_groups.map(|g| (g.metadata.clone(), false)),
            ),
            Workload::Groups(g) => (
                self.ensure_live(*g, live_groups, events)
                    .await?
                    .map(Live::Groups),
                live_deployment.map(|d| (d.metadata.clone(), true)),
            ),
        };
        let written = written.ok_or(Error::Cache("the workload just applied"))?;
        if let Some((old, is_deployment)) = old {
            let r = written.observed().rollout();
            if !surges || r.complete {
                match is_deployment {
                    true => self.converge::<Deployment>(None, Some(old), events).await?,
                    false => {
                        self.converge::<LeaderWorkerSet>(None, Some(old), events)
                            .await?
                    }
                }
            }
        }
        Ok(written)
    }

    /// Applies `desired` over `live` (from a whole-object cache) and records the change;
    /// returns it as written, else as cached.
    async fn ensure_live<K>(
        &self,
        desired: K,
        live: Option<Arc<K>>,
        events: &mut Events,
    ) -> Result<Option<Arc<K>>, Error>
    where
        K: Child,
    {
        let (written, change) = apply::ensure(
            &self.api::<K>(),
            &self.ctx.applied,
            desired,
            live.as_ref().map(|l| l.meta()),
        )
        .await?;
        record::<K>(events, change, self.ns, self.name);
        Ok(written.map(Arc::new).or(live))
    }

    /// Applies `desired`, or, when it is `None`, deletes the object (as `live` shows it) if
    /// this InferenceService controls it; records an event for whatever changed.
    async fn converge<K>(
        &self,
        desired: Option<K>,
        live: Option<ObjectMeta>,
        events: &mut Events,
    ) -> Result<(), Error>
    where
        K: Child,
    {
        let api: Api<K> = self.api();
        match desired {
            Some(obj) => {
                let (_, change) =
                    apply::ensure(&api, &self.ctx.applied, obj, live.as_ref()).await?;
                record::<K>(events, change, self.ns, self.name);
            }
            None if apply::remove(&api, &self.ctx.applied, live.as_ref(), self.uid).await? => {
                events.push(deleted::<K>(self.ns, self.name));
            }
            None => {}
        }
        Ok(())
    }
}

/// Whether the workload's rollout may run new pods beside the old (a non-zero maxSurge).
fn desired_surges(w: &Workload) -> bool {
    let surge = match w {
        Workload::Deployment(d) => d
            .spec
            .as_ref()
            .and_then(|s| s.strategy.as_ref())
            .and_then(|s| s.rolling_update.as_ref())
            .and_then(|r| r.max_surge.clone()),
        Workload::Groups(g) => Some(
            g.spec
                .rollout_strategy
                .rolling_update_configuration
                .max_surge
                .clone(),
        ),
    };
    surge.is_some_and(|s| !build::deployment::is_zero(&s))
}

fn deleted<K: Resource<DynamicType = ()>>(ns: &str, name: &str) -> Event {
    let mut e = event(
        EventType::Normal,
        "Deleted",
        "Prune",
        format!("deleted {} {name}, no longer wanted", K::kind(&())),
    );
    e.secondary = Some(child_ref::<K>(ns, name));
    e
}

/// Warning events when `Degraded` turns true (or changes reason), Normal when `Ready` turns
/// true; unchanged conditions record nothing, so resyncs stay quiet.
fn transition_events(
    old: Option<&InferenceServiceStatus>,
    new: &InferenceServiceStatus,
    events: &mut Events,
) {
    let before = |t: &str| old.and_then(|o| status::condition(o, t));
    if let Some(d) = status::condition(new, DEGRADED)
        && d.status == "True"
    {
        let same = before(DEGRADED).is_some_and(|b| b.status == "True" && b.reason == d.reason);
        if !same {
            events.push(event(
                EventType::Warning,
                &d.reason,
                "Reconcile",
                d.message.clone(),
            ));
        }
    }
    if let Some(r) = status::condition(new, READY)
        && r.status == "False"
        && r.reason == status::SERVED_NAME_CONFLICT
        && before(READY).is_none_or(|b| b.reason != r.reason)
    {
        events.push(event(
            EventType::Warning,
            &r.reason,
            "Reconcile",
            r.message.clone(),
        ));
    }
    if let Some(r) = status::condition(new, READY)
        && r.status == "True"
        && before(READY).is_none_or(|b| b.status != "True")
    {
        events.push(event(
            EventType::Normal,
            "Ready",
            "Reconcile",
            r.message.clone(),
        ));
    }
}
