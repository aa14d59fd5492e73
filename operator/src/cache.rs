//! Watch caches of everything the operator reads, as controller-runtime operators keep them:
//! one list and one watch per kind for the life of the process, so reconciles and the
//! autoscaler read memory, not the API server. With 100 InferenceServices and nothing
//! changing, the operator sends no reads beyond these watches (and its Lease).
//!
//! Children are cached as metadata only (their desired-state hash, owner, generation): the
//! dashboards alone would otherwise hold megabytes. Deployments and pods keep what status
//! reads. Every change of a child, a pod or a claim is turned into a [`Touch`] naming the
//! InferenceService it concerns, which the controller turns into a reconcile. Changes of the
//! InferenceServices themselves go to the autoscaler as well, which follows them on its own.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};

use crate::build::keda::ScaledObject;
use crate::build::lws::LeaderWorkerSet;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, watcher};
use kube::runtime::{WatchStreamExt, reflector::store::Writer};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use crate::build::monitor::ServiceMonitor;
use ferrite_api::crd::InferenceService;
use ferrite_api::labels::{INSTANCE_LABEL, MANAGED_SELECTOR};

/// Something changed that may concern InferenceServices.
#[derive(Debug, Clone)]
pub enum Touch {
    /// An InferenceService was created, changed, or listed.
    Applied(Arc<InferenceService>),
    /// An InferenceService is gone.
    Deleted(ObjectRef<InferenceService>),
    /// A child or pod of this InferenceService changed or went away.
    Owner(ObjectRef<InferenceService>),
    /// A PersistentVolumeClaim appeared, changed or went away.
    Claim { namespace: String, name: String },
}

/// The caches. Stores can be read at once; [`Caches::ready`] waits for their first listing.
#[derive(Clone)]
pub struct Caches {
    pub isvcs: Store<InferenceService>,
    pub deployments: Store<Deployment>,
    pub pods: Store<Pod>,
    pub services: Store<PartialObjectMeta<Service>>,
    pub pdbs: Store<PartialObjectMeta<PodDisruptionBudget>>,
    pub hpas: Store<PartialObjectMeta<HorizontalPodAutoscaler>>,
    pub config_maps: Store<PartialObjectMeta<ConfigMap>>,
    pub claims: Store<PartialObjectMeta<PersistentVolumeClaim>>,
    /// Started once the ServiceMonitor CRD is found (it may be installed after the operator).
    monitors: Arc<OnceLock<Store<PartialObjectMeta<ServiceMonitor>>>>,
    /// Started on first use: only an operator that makes NetworkPolicies watches them.
    network_policies: Arc<OnceLock<Store<PartialObjectMeta<NetworkPolicy>>>>,
    /// Started on first use: only an operator that grants the router API keys watches these.
    roles: Arc<OnceLock<Store<PartialObjectMeta<Role>>>>,
    /// Started once KEDA's CRD is found.
    scaled_objects: Arc<OnceLock<Store<PartialObjectMeta<ScaledObject>>>>,
    /// Started once LeaderWorkerSet's CRD is found (by an operator allowed to write them);
    /// whole, slimmed as Deployments are: status reads their counts.
    groups: Arc<OnceLock<Store<LeaderWorkerSet>>>,
    role_bindings: Arc<OnceLock<Store<PartialObjectMeta<RoleBinding>>>>,
    /// How to start the ServiceMonitor watch; absent in tests that fill the stores by hand.
    starter: Option<Starter>,
}

impl std::fmt::Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("isvcs", &self.isvcs.len())
            .field("deployments", &self.deployments.len())
            .field("pods", &self.pods.len())
            .finish_non_exhaustive()
    }
}

#[derive(Clone)]
struct Starter {
    client: Client,
    touch: mpsc::UnboundedSender<Touch>,
}

/// Where the caches report changes.
#[derive(Debug)]
pub struct Feeds {
    /// Every [`Touch`], for the controller.
    pub controller: mpsc::UnboundedReceiver<Touch>,
    /// InferenceServices applied or deleted, for the autoscaler.
    pub autoscaler: mpsc::UnboundedReceiver<Touch>,
}

/// Writers of hand-filled caches (tests): apply `watcher::Event`s to them.
#[cfg(feature = "test-support")]
#[allow(missing_debug_implementations)]
pub struct Writers {
    pub isvcs: Writer<InferenceService>,
    pub deployments: Writer<Deployment>,
    pub pods: Writer<Pod>,
    pub services: Writer<PartialObjectMeta<Service>>,
    pub pdbs: Writer<PartialObjectMeta<PodDisruptionBudget>>,
    pub hpas: Writer<PartialObjectMeta<HorizontalPodAutoscaler>>,
    pub config_maps: Writer<PartialObjectMeta<ConfigMap>>,
    pub claims: Writer<PartialObjectMeta<PersistentVolumeClaim>>,
    pub monitors: Writer<PartialObjectMeta<ServiceMonitor>>,
    pub network_policies: Writer<PartialObjectMeta<NetworkPolicy>>,
    pub roles: Writer<PartialObjectMeta<Role>>,
    pub scaled_objects: Writer<PartialObjectMeta<ScaledObject>>,
    pub role_bindings: Writer<PartialObjectMeta<RoleBinding>>,
    pub groups: Writer<LeaderWorkerSet>,
}

#[cfg(feature = "test-support")]
impl Writers {
    /// Marks every store listed (empty unless filled before).
    pub fn all_listed(&mut self) {
        fn done<K: kube::runtime::reflector::Lookup + Clone + 'static>(w: &mut Writer<K>)
        where
            K::DynamicType: Eq + std::hash::Hash + Clone,
        {
            w.apply_watcher_event(&watcher::Event::Init);
            w.apply_watcher_event(&watcher::Event::InitDone);
        }
        done(&mut self.isvcs);
        done(&mut self.deployments);
        done(&mut self.pods);
        done(&mut self.services);
        done(&mut self.pdbs);
        done(&mut self.hpas);
        done(&mut self.config_maps);
        done(&mut self.claims);
        done(&mut self.monitors);
        done(&mut self.network_policies);
        done(&mut self.roles);
        done(&mut self.scaled_objects);
        done(&mut self.role_bindings);
        done(&mut self.groups);
    }
}

/// InferenceServices, whole (managed fields dropped); each change touches the controller and
/// the autoscaler.
fn isvc_store(client: &Client, to: Vec<mpsc::UnboundedSender<Touch>>) -> Store<InferenceService> {
    let (store, writer) = reflector::store();
    let stream = watcher(
        Api::<InferenceService>::all(client.clone()),
        watcher::Config::default().any_semantic(),
    )
    .modify(|i| i.managed_fields_mut().clear());
    reflect("InferenceService", stream, writer, to, |i, seen| {
        Some(match seen {
            Seen::Deleted => Touch::Deleted(ObjectRef::from_obj(i)),
            _ => Touch::Applied(Arc::new(i.clone())),
        })
    });
    store
}

/// A kind the caches watch and keep.
trait Watched:
    Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static
{
}

impl<K> Watched for K where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static
{
}

/// The operator's workloads of kind `K` (Deployments, LeaderWorkerSets), slimmed by `slim` to
/// what status reads; a change touches their owner.
fn workload_store<K>(
    client: &Client,
    managed: &watcher::Config,
    touch: &mpsc::UnboundedSender<Touch>,
    kind: &'static str,
    slim: fn(&mut K),
) -> Store<K>
where
    K: Watched,
{
    let (store, writer) = reflector::store();
    let stream = watcher(Api::<K>::all(client.clone()), managed.clone()).modify(slim);
    reflect(kind, stream, writer, vec![touch.clone()], owner_touch);
    store
}

/// The server pods, slimmed. Pods are owned by ReplicaSets; the instance label names their
/// InferenceService, which a change touches.
fn pod_store(
    client: &Client,
    managed: &watcher::Config,
    touch: &mpsc::UnboundedSender<Touch>,
) -> Store<Pod> {
    let (store, writer) = reflector::store();
    let stream = watcher(Api::<Pod>::all(client.clone()), managed.clone()).modify(slim_pod);
    reflect(
        "Pod",
        stream,
        writer,
        vec![touch.clone()],
        |p: &Pod, seen| {
            let ns = p.namespace()?;
            let name = p.labels().get(INSTANCE_LABEL)?;
            (seen != Seen::Listed).then(|| Touch::Owner(ObjectRef::new(name).within(&ns)))
        },
    );
    store
}

/// Every PersistentVolumeClaim's metadata (a `pvc://` model or a cache claim waits for its
/// claim); a change touches the InferenceServices that wait on it.
fn claim_store(
    client: &Client,
    touch: &mpsc::UnboundedSender<Touch>,
) -> Store<PartialObjectMeta<PersistentVolumeClaim>> {
    let (store, writer) = reflector::store();
    let stream = watcher(
        Api::<PartialObjectMeta<PersistentVolumeClaim>>::all(client.clone()),
        watcher::Config::default(),
    )
    .modify(slim_meta);
    reflect(
        "PersistentVolumeClaim",
        stream,
        writer,
        vec![touch.clone()],
        |c: &PartialObjectMeta<PersistentVolumeClaim>, seen| {
            (seen != Seen::Listed).then(|| Touch::Claim {
                namespace: c.namespace().unwrap_or_default(),
                name: c.name_any(),
            })
        },
    );
    store
}

/// Keeps a Deployment's metadata, replicas and status: what status and drift checks read.
fn slim_deployment(d: &mut Deployment) {
    d.managed_fields_mut().clear();
    if let Some(spec) = d.spec.as_mut() {
        spec.template = Default::default();
    }
}

/// Keeps a LeaderWorkerSet's metadata, replicas and status.
fn slim_group(g: &mut LeaderWorkerSet) {
    g.managed_fields_mut().clear();
    let t = &mut g.spec.leader_worker_template;
    t.leader_template = Default::default();
    t.worker_template = Default::default();
}

/// Keeps a pod's metadata and status.
fn slim_pod(p: &mut Pod) {
    p.managed_fields_mut().clear();
    p.spec = None;
}

fn slim_meta<K>(m: &mut PartialObjectMeta<K>) {
    m.metadata.managed_fields = None;
}

/// The InferenceService that controls `obj`, from its controller owner reference.
fn controller_of<K: Resource>(obj: &K) -> Option<ObjectRef<InferenceService>> {
    let ns = obj.meta().namespace.clone()?;
    obj.meta()
        .owner_references
        .as_ref()?
        .iter()
        .find(|r| r.controller == Some(true) && r.kind == "InferenceService")
        .map(|r| ObjectRef::new(&r.name).within(&ns))
}

/// What a watch event means for the owners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Listed,
    Applied,
    Deleted,
}

/// Drives a watch into a store, sending a [`Touch`] per change to each of `sinks` (until all
/// of them are closed); retries with backoff forever.
fn reflect<K>(
    kind: &'static str,
    stream: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    writer: Writer<K>,
    sinks: Vec<mpsc::UnboundedSender<Touch>>,
    map: impl Fn(&K, Seen) -> Option<Touch> + Send + 'static,
) where
    K: Resource + Clone + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default + Send + Sync,
{
    tokio::spawn(async move {
        let stream = stream.default_backoff().reflect(writer);
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            let (obj, seen) = match &event {
                Ok(watcher::Event::Apply(o)) => (o, Seen::Applied),
                Ok(watcher::Event::Delete(o)) => (o, Seen::Deleted),
                Ok(watcher::Event::InitApply(o)) => (o, Seen::Listed),
                Ok(_) => continue,
                Err(e) => {
                    tracing::warn!(kind, error = %e, "watch failed; retrying");
                    continue;
                }
            };
            if let Some(t) = map(obj, seen) {
                let delivered = sinks.iter().filter(|s| s.send(t.clone()).is_ok()).count();
                if delivered == 0 {
                    return;
                }
            }
        }
    });
}

/// Children only matter when they change; the InferenceServices' own listing covers the rest.
fn owner_touch<K: Resource>(obj: &K, seen: Seen) -> Option<Touch> {
    (seen != Seen::Listed)
        .then(|| controller_of(obj))
        .flatten()
        .map(Touch::Owner)
}

fn metadata_store<K>(
    starter: &Starter,
    kind: &'static str,
    config: watcher::Config,
) -> Store<PartialObjectMeta<K>>
where
    K: Watched,
{
    let (store, writer) = reflector::store();
    let stream = watcher(
        Api::<PartialObjectMeta<K>>::all(starter.client.clone()),
        config,
    )
    .modify(slim_meta);
    reflect(
        kind,
        stream,
        writer,
        vec![starter.touch.clone()],
        owner_touch,
    );
    store
}

impl Caches {
    /// Starts every watch; their changes arrive on the returned feeds.
    pub fn start(client: Client) -> (Caches, Feeds) {
        let (touch, rx) = mpsc::unbounded_channel();
        let (follow, follow_rx) = mpsc::unbounded_channel();
        let starter = Starter {
            client: client.clone(),
            touch: touch.clone(),
        };
        let managed = watcher::Config::default().labels(MANAGED_SELECTOR);
        let isvcs = isvc_store(&client, vec![touch.clone(), follow]);
        let deployments = workload_store(&client, &managed, &touch, "Deployment", slim_deployment);
        let pods = pod_store(&client, &managed, &touch);
        let claims = claim_store(&client, &touch);
        let caches = Caches {
            isvcs,
            deployments,
            pods,
            services: metadata_store::<Service>(&starter, "Service", managed.clone()),
            pdbs: metadata_store::<PodDisruptionBudget>(
                &starter,
                "PodDisruptionBudget",
                managed.clone(),
            ),
            hpas: metadata_store::<HorizontalPodAutoscaler>(
                &starter,
                "HorizontalPodAutoscaler",
                managed.clone(),
            ),
            config_maps: metadata_store::<ConfigMap>(&starter, "ConfigMap", managed),
            claims,
            monitors: Arc::new(OnceLock::new()),
            network_policies: Arc::new(OnceLock::new()),
            roles: Arc::new(OnceLock::new()),
            role_bindings: Arc::new(OnceLock::new()),
            scaled_objects: Arc::new(OnceLock::new()),
            groups: Arc::new(OnceLock::new()),
            starter: Some(starter),
        };
        let feeds = Feeds {
            controller: rx,
            autoscaler: follow_rx,
        };
        (caches, feeds)
    }

    /// Empty caches filled by hand through the returned writers (tests).
    #[cfg(feature = "test-support")]
    pub fn manual() -> (Caches, Writers) {
        /// A lazily started cache, started already: its store in the cell, and its writer.
        fn started<K>() -> (Arc<OnceLock<Store<K>>>, Writer<K>)
        where
            K: kube::runtime::reflector::Lookup + Clone + 'static,
            K::DynamicType: Eq + std::hash::Hash + Clone + Default,
        {
            let (store, writer) = reflector::store();
            let cell = OnceLock::new();
            let _ = cell.set(store);
            (Arc::new(cell), writer)
        }
        let (isvcs, w_isvcs) = reflector::store();
        let (deployments, w_deployments) = reflector::store();
        let (pods, w_pods) = reflector::store();
        let (services, w_services) = reflector::store();
        let (pdbs, w_pdbs) = reflector::store();
        let (hpas, w_hpas) = reflector::store();
        let (config_maps, w_config_maps) = reflector::store();
        let (claims, w_claims) = reflector::store();
        let (monitors, w_monitors) = started();
        let (network_policies, w_network_policies) = started();
        let (roles, w_roles) = started();
        let (scaled_objects, w_scaled_objects) = started();
        let (role_bindings, w_role_bindings) = started();
        let (groups, w_groups) = started();
        let caches = Caches {
            isvcs,
            deployments,
            pods,
            services,
            pdbs,
            hpas,
            config_maps,
            claims,
            monitors,
            network_policies,
            roles,
            role_bindings,
            scaled_objects,
            groups,
            starter: None,
        };
        let writers = Writers {
            isvcs: w_isvcs,
            deployments: w_deployments,
            pods: w_pods,
            services: w_services,
            pdbs: w_pdbs,
            hpas: w_hpas,
            config_maps: w_config_maps,
            claims: w_claims,
            monitors: w_monitors,
            network_policies: w_network_policies,
            roles: w_roles,
            scaled_objects: w_scaled_objects,
            role_bindings: w_role_bindings,
            groups: w_groups,
        };
        (caches, writers)
    }

    /// Waits until every store has its first listing (at once after start-up).
    pub async fn ready(&self) -> Result<(), reflector::store::WriterDropped> {
        self.isvcs.wait_until_ready().await?;
        self.deployments.wait_until_ready().await?;
        self.pods.wait_until_ready().await?;
        self.services.wait_until_ready().await?;
        self.pdbs.wait_until_ready().await?;
        self.hpas.wait_until_ready().await?;
        self.config_maps.wait_until_ready().await?;
        self.claims.wait_until_ready().await
    }

    /// The ServiceMonitor cache, started on first use (call only once the CRD exists), once
    /// it has its first listing; `None` if that takes longer than `wait`.
    pub async fn monitors(
        &self,
        wait: Duration,
    ) -> Option<Store<PartialObjectMeta<ServiceMonitor>>> {
        self.lazy(&self.monitors, "ServiceMonitor", wait).await
    }

    /// The NetworkPolicy cache, started on first use, as [`Caches::monitors`].
    pub async fn network_policies(
        &self,
        wait: Duration,
    ) -> Option<Store<PartialObjectMeta<NetworkPolicy>>> {
        self.lazy(&self.network_policies, "NetworkPolicy", wait)
            .await
    }

    /// The ScaledObject cache (KEDA mode), started on first use (once KEDA's CRD exists).
    pub async fn scaled_objects(
        &self,
        wait: Duration,
    ) -> Option<Store<PartialObjectMeta<ScaledObject>>> {
        self.lazy(&self.scaled_objects, "ScaledObject", wait).await
    }

    /// The LeaderWorkerSet cache, started on first use (once LWS's CRD exists), once it has
    /// its first listing; `None` if that takes longer than `wait`.
    pub async fn groups(&self, wait: Duration) -> Option<Store<LeaderWorkerSet>> {
        let store = self
            .groups
            .get_or_init(|| match &self.starter {
                Some(s) => workload_store(
                    &s.client,
                    &watcher::Config::default().labels(MANAGED_SELECTOR),
                    &s.touch,
                    "LeaderWorkerSet",
                    slim_group,
                ),
                None => reflector::store().0,
            })
            .clone();
        ready_within(store, wait).await
    }

    /// The Role cache (the router's API-key grants), started on first use.
    pub async fn roles(&self, wait: Duration) -> Option<Store<PartialObjectMeta<Role>>> {
        self.lazy(&self.roles, "Role", wait).await
    }

    /// The RoleBinding cache (the router's API-key grants), started on first use.
    pub async fn role_bindings(
        &self,
        wait: Duration,
    ) -> Option<Store<PartialObjectMeta<RoleBinding>>> {
        self.lazy(&self.role_bindings, "RoleBinding", wait).await
    }

    /// A metadata cache of the operator's children of kind `K`, started the first time it is
    /// asked for; `None` until it has its first listing, if that takes longer than `wait`.
    async fn lazy<K>(
        &self,
        cell: &OnceLock<Store<PartialObjectMeta<K>>>,
        kind: &'static str,
        wait: Duration,
    ) -> Option<Store<PartialObjectMeta<K>>>
    where
        K: Watched,
    {
        let store = cell
            .get_or_init(|| match &self.starter {
                Some(s) => metadata_store::<K>(
                    s,
                    kind,
                    watcher::Config::default().labels(MANAGED_SELECTOR),
                ),
                None => reflector::store().0,
            })
            .clone();
        ready_within(store, wait).await
    }

    /// The pods of one InferenceService.
    pub fn pods_of(&self, namespace: &str, name: &str) -> Vec<Arc<Pod>> {
        self.pods
            .state_filter(|p| ferrite_api::labels::belongs_to(p, namespace, name))
    }

    /// The pods of one InferenceService that serve its API: all of a Deployment's, a
    /// LeaderWorkerSet's leaders (its workers have no HTTP server).
    pub fn servers_of(&self, namespace: &str, name: &str) -> Vec<Arc<Pod>> {
        self.pods.state_filter(|p| {
            ferrite_api::labels::belongs_to(p, namespace, name) && ferrite_api::labels::serves(p)
        })
    }

    /// The InferenceService `namespace/name`, if cached.
    pub fn isvc(&self, namespace: &str, name: &str) -> Option<Arc<InferenceService>> {
        self.isvcs.get(&ObjectRef::new(name).within(namespace))
    }
}

/// `store` once it has its first listing; `None` if that takes longer than `wait`.
async fn ready_within<K>(store: Store<K>, wait: Duration) -> Option<Store<K>>
where
    K: kube::runtime::reflector::Lookup + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    tokio::time::timeout(wait, store.wait_until_ready())
        .await
        .ok()?
        .ok()?;
    Some(store)
}

/// Where reconcile requests go: nowhere on a standby, the controller's queue on the leader.
#[derive(Debug, Default)]
pub struct Triggers {
    tx: Mutex<Option<mpsc::UnboundedSender<ObjectRef<InferenceService>>>>,
}

impl Triggers {
    /// Asks for a reconcile of `r` (dropped unless a controller is attached).
    pub fn reconcile(&self, r: ObjectRef<InferenceService>) {
        if let Ok(guard) = self.tx.lock()
            && let Some(tx) = guard.as_ref()
        {
            let _ = tx.send(r);
        }
    }

    /// Attaches a controller; its stream ends when [`Triggers::detach`] is called.
    pub fn attach(&self) -> mpsc::UnboundedReceiver<ObjectRef<InferenceService>> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut guard) = self.tx.lock() {
            *guard = Some(tx);
        }
        rx
    }

    pub fn detach(&self) {
        if let Ok(mut guard) = self.tx.lock() {
            *guard = None;
        }
    }
}
