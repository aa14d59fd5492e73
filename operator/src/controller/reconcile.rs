//! One reconcile of one InferenceService.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference, PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams, Patch};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::apply::{self, Change};
use super::{Context, Error};
use crate::autoscale::store::Key;
use crate::build::dashboards::DASHBOARD_COMPONENT;
use crate::build::model::ModelSource;
use crate::build::monitor::ServiceMonitor;
use crate::build::{
    COMPONENT_LABEL, ClusterCapabilities, Desired, INSTANCE_LABEL, build, desired_replicas,
    selector, url,
};
use crate::crd::{InferenceService, InferenceServiceStatus};
use crate::status::{self, DEGRADED, Finding, MonitorState, Observation, READY};

/// Reconciles one InferenceService and records the outcome in the operator's metrics.
pub async fn reconcile(isvc: Arc<InferenceService>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&isvc, &ctx).await;
    ctx.metrics
        .observe_reconcile(started.elapsed(), result.as_ref().err());
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
    let (reason, verb) = match change {
        Change::Unchanged => return,
        Change::Created => ("Created", "created"),
        Change::Updated => ("Updated", "updated"),
    };
    let mut e = event(
        EventType::Normal,
        reason,
        "Apply",
        format!("{verb} {} {name}", K::kind(&())),
    );
    e.secondary = Some(child_ref::<K>(ns, name));
    events.push(e);
}

async fn reconcile_inner(isvc: &InferenceService, ctx: &Context) -> Result<Action, Error> {
    // Start, retune or stop the autoscaler task before anything can return early.
    ctx.autoscaler.sync(isvc);
    // Being deleted: garbage collection removes the children; re-applying them would fight it.
    if isvc.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns = isvc.namespace().ok_or(Error::Metadata("namespace"))?;
    let name = isvc.name_any();
    let uid = isvc.uid().ok_or(Error::Metadata("uid"))?;
    let client = ctx.client.clone();
    let mut events = Events::new();

    // Dereference: what the cluster offers and what the spec points at.
    let monitor_wanted = isvc.spec.monitoring.service_monitor.enabled;
    let service_monitor_crd = monitor_wanted
        && ctx
            .discovery
            .service_monitor_crd(&client)
            .await
            .map_err(Error::Discovery)?;
    let mut blocked = missing_claim(isvc, &client, &ns).await?;

    // Validate and build (pure).
    let caps = ClusterCapabilities {
        service_monitor_crd,
    };
    let desired = match build(isvc, &ctx.config, caps) {
        Ok(d) => Some(d),
        Err(e) => {
            blocked.get_or_insert_with(|| Finding::new(e.reason(), e.to_string()));
            None
        }
    };

    // Apply, or leave the running workload alone when the spec cannot be applied.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let deployment = match (&blocked, desired) {
        (None, Some(desired)) => {
            apply_all(&client, &ns, &uid, desired, !monitor_wanted, &mut events).await?
        }
        _ => deployments
            .get_opt(&name)
            .await
            .map_err(Error::kube("Deployment", &name))?,
    };

    // Observe pods only while the rollout is incomplete: that is when they explain why.
    let rollout = deployment.as_ref().map(status::rollout);
    let pod_failure = match rollout {
        Some(r) if !r.complete => {
            let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
            let list = pods
                .list(&ListParams::default().labels(&selector(&name)))
                .await
                .map_err(Error::kube("Pod", &name))?;
            status::pod_failure(&list.items)
        }
        _ => None,
    };

    let monitor = match (monitor_wanted, service_monitor_crd) {
        (false, _) => MonitorState::Disabled,
        (true, true) => MonitorState::Applied,
        (true, false) => MonitorState::CrdMissing,
    };
    let obs = Observation {
        generation: isvc.metadata.generation,
        blocked: blocked.clone(),
        desired_replicas: desired_replicas(isvc),
        deployment: deployment.as_ref(),
        pod_failure,
        monitor,
        selector: Some(selector(&name)),
        url: Some(url(isvc)),
        autoscaling: isvc
            .spec
            .autoscaling
            .as_ref()
            .map(|_| ctx.autoscaler.view(&Key::new(&ns, &name))),
    };
    let now = status::now();
    let new_status = status::compute(&obs, isvc.status.as_ref(), &now);
    transition_events(isvc.status.as_ref(), &new_status, &mut events);

    for e in &events {
        // Events are best effort: a failure to record one must not fail the reconcile.
        if let Err(err) = ctx.recorder.publish(e, &isvc.object_ref(&())).await {
            tracing::warn!(namespace = %ns, name = %name, error = %err, "publishing an event");
        }
    }
    if isvc.status.as_ref() != Some(&new_status) {
        let isvcs: Api<InferenceService> = Api::namespaced(client, &ns);
        let body = json!({
            "apiVersion": InferenceService::api_version(&()),
            "kind": InferenceService::kind(&()),
            "metadata": {"name": name},
            "status": new_status,
        });
        isvcs
            .patch_status(&name, &apply::apply_params(), &Patch::Apply(&body))
            .await
            .map_err(Error::kube("InferenceService status", &name))?;
    }

    let t = &ctx.timing;
    Ok(Action::requeue(if blocked.is_some() {
        t.blocked
    } else if rollout.is_some_and(|r| r.complete) {
        t.settled
    } else {
        t.progressing
    }))
}

/// The first claim the spec names that does not exist.
async fn missing_claim(
    isvc: &InferenceService,
    client: &kube::Client,
    ns: &str,
) -> Result<Option<Finding>, Error> {
    let mut claims = Vec::new();
    if let Ok(ModelSource::Pvc { claim, .. }) = ModelSource::parse(&isvc.spec.model.source) {
        claims.push(("model.source", claim));
    }
    if let Some(c) = &isvc.spec.model_cache {
        claims.push(("modelCache.claimName", c.claim_name.clone()));
    }
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    for (field, claim) in claims {
        let found = pvcs
            .get_opt(&claim)
            .await
            .map_err(Error::kube("PersistentVolumeClaim", &claim))?;
        if found.is_none() {
            return Ok(Some(Finding::new(
                "PersistentVolumeClaimNotFound",
                format!("{field} names PersistentVolumeClaim {ns}/{claim}, which does not exist"),
            )));
        }
    }
    Ok(None)
}

/// Applies every desired object and deletes the ones no longer wanted (a ServiceMonitor only
/// when `prune_monitor`: one that is wanted but lacks its CRD cannot exist). Returns the
/// Deployment as the API server holds it.
async fn apply_all(
    client: &kube::Client,
    ns: &str,
    uid: &str,
    desired: Desired,
    prune_monitor: bool,
    events: &mut Events,
) -> Result<Option<Deployment>, Error> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), ns);
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(client.clone(), ns);
    let monitors: Api<ServiceMonitor> = Api::namespaced(client.clone(), ns);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let name = desired.deployment.name_any();

    let (deployment, change) = apply::ensure(&deployments, desired.deployment).await?;
    record::<Deployment>(events, change, ns, &name);
    let (_, change) = apply::ensure(&services, desired.service).await?;
    record::<Service>(events, change, ns, &name);

    let child = Child {
        ns,
        name: &name,
        uid,
    };
    child.converge(&pdbs, desired.pdb, true, events).await?;
    child.converge(&hpas, desired.hpa, true, events).await?;
    child
        .converge(&monitors, desired.service_monitor, prune_monitor, events)
        .await?;

    // Dashboards vary in number: list ours, apply the wanted, delete the rest.
    let listed = config_maps
        .list(&ListParams::default().labels(&format!(
            "{COMPONENT_LABEL}={DASHBOARD_COMPONENT},{INSTANCE_LABEL}={name}"
        )))
        .await
        .map_err(Error::kube("ConfigMap", &name))?;
    let mut live: Vec<ConfigMap> = listed
        .items
        .into_iter()
        .filter(|c| apply::controlled_by(c, uid))
        .collect();
    for cm in desired.dashboards {
        let cm_name = cm.name_any();
        let existing = live
            .iter()
            .position(|l| l.name_any() == cm_name)
            .map(|i| live.swap_remove(i));
        let (_, change) = apply::ensure_with(&config_maps, cm, existing).await?;
        record::<ConfigMap>(events, change, ns, &cm_name);
    }
    for stale in live {
        let stale_name = stale.name_any();
        if apply::delete(&config_maps, &stale_name, "ConfigMap").await? {
            events.push(deleted::<ConfigMap>(ns, &stale_name));
        }
    }
    Ok(Some(deployment))
}

/// An optional child object of one InferenceService: named like it, controlled by its `uid`.
struct Child<'a> {
    ns: &'a str,
    name: &'a str,
    uid: &'a str,
}

impl Child<'_> {
    /// Applies `desired`, or, when it is `None` and `prune`, deletes the object this
    /// InferenceService controls; records an event for whatever changed.
    async fn converge<K>(
        &self,
        api: &Api<K>,
        desired: Option<K>,
        prune: bool,
        events: &mut Events,
    ) -> Result<(), Error>
    where
        K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
    {
        match desired {
            Some(obj) => {
                let (_, change) = apply::ensure(api, obj).await?;
                record::<K>(events, change, self.ns, self.name);
            }
            None if prune && apply::remove(api, self.name, self.uid).await? => {
                events.push(deleted::<K>(self.ns, self.name));
            }
            None => {}
        }
        Ok(())
    }
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
