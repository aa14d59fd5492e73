//! KEDA's external scaler protocol (`externalscaler.ExternalScaler`, gRPC), served by the
//! operator for InferenceServices in KEDA mode with `scaler: External`: KEDA asks, the
//! operator answers with the signals its built-in autoscaler already scrapes from the pods
//! and the routers (the same numbers Builtin and HPA mode scale on), so no Prometheus is
//! needed. Each trigger's metadata names its `signal`:
//!
//! - `GetMetricSpec`: the signal and the spec's target (`queuePerReplica`, `kvCacheUsage`);
//! - `GetMetrics`: the signal's current value: `queue` is the pods' waiting requests plus the
//!   routers' queued and held ones, `kv-cache` the pods' mean KV-cache usage;
//! - `IsActive`: whether any request runs, waits or is held for the service, for scale to and
//!   from zero (whatever the trigger's signal).
//!
//! The messages are written out here with `prost` (KEDA's `externalscaler.proto`, field for
//! field), so the build needs no `protoc`. Signals older than [`FRESH`] count as none (the
//! pods are gone). Services not in KEDA mode with the external scaler answer `NOT_FOUND`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use ferrite_api::crd::{AutoscalingMode, InferenceService};
use tonic::body::Body;
use tonic::server::{Grpc, NamedService};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

use crate::autoscale::routers::RouterQueues;
use crate::autoscale::store::{Key, SignalStore, Snapshot};
use crate::build::keda::{Signal, effective_scaler};
use crate::cache::Caches;
use ferrite_api::crd::KedaScaler;

/// `ScaledObjectRef`: the ScaledObject asking (named like its InferenceService) and its
/// trigger's metadata.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ScaledObjectRef {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(map = "string, string", tag = "3")]
    pub scaler_metadata: HashMap<String, String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct IsActiveResponse {
    #[prost(bool, tag = "1")]
    pub result: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct GetMetricSpecResponse {
    #[prost(message, repeated, tag = "1")]
    pub metric_specs: Vec<MetricSpec>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MetricSpec {
    #[prost(string, tag = "1")]
    pub metric_name: String,
    /// Deprecated by KEDA for `target_size_float`; filled too, rounded up, for older KEDAs.
    #[prost(int64, tag = "2")]
    pub target_size: i64,
    #[prost(double, tag = "3")]
    pub target_size_float: f64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct GetMetricsRequest {
    #[prost(message, optional, tag = "1")]
    pub scaled_object_ref: Option<ScaledObjectRef>,
    #[prost(string, tag = "2")]
    pub metric_name: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct GetMetricsResponse {
    #[prost(message, repeated, tag = "1")]
    pub metric_values: Vec<MetricValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MetricValue {
    #[prost(string, tag = "1")]
    pub metric_name: String,
    #[prost(int64, tag = "2")]
    pub metric_value: i64,
    #[prost(double, tag = "3")]
    pub metric_value_float: f64,
}

/// Signals older than this are not used: the pods stopped reporting.
pub const FRESH: Duration = Duration::from_secs(30);

/// The gRPC service's name, as KEDA dials it.
const SERVICE: &str = "externalscaler.ExternalScaler";

/// What the answers are read from.
#[derive(Clone)]
pub struct Scaler {
    caches: Caches,
    store: Arc<SignalStore>,
    routers: RouterQueues,
}

impl std::fmt::Debug for Scaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scaler").finish_non_exhaustive()
    }
}

impl Scaler {
    pub fn new(caches: Caches, store: Arc<SignalStore>, routers: RouterQueues) -> Scaler {
        Scaler {
            caches,
            store,
            routers,
        }
    }

    /// Serves the protocol (plain HTTP/2) on `listener` until `shutdown`.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tonic::transport::Server::builder()
            .add_service(self)
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
    }

    /// The InferenceService a ScaledObject stands for, when it is in KEDA mode with the
    /// external scaler, and the signal its trigger asks about.
    fn target(&self, r: &ScaledObjectRef) -> Result<(Arc<InferenceService>, Signal), Status> {
        let isvc = self.caches.isvc(&r.namespace, &r.name).ok_or_else(|| {
            Status::not_found(format!("no InferenceService {}/{}", r.namespace, r.name))
        })?;
        let external = isvc.spec.autoscaling.as_ref().is_some_and(|a| {
            a.mode == AutoscalingMode::Keda && effective_scaler(a, true) == KedaScaler::External
        });
        if !external {
            return Err(Status::not_found(format!(
                "InferenceService {}/{} is not in KEDA mode with the external scaler",
                r.namespace, r.name
            )));
        }
        let name = r.scaler_metadata.get("signal").map(String::as_str);
        let signal = name.and_then(Signal::parse).ok_or_else(|| {
            Status::invalid_argument(format!(
                "trigger metadata `signal` is {name:?}: one of queue, kv-cache"
            ))
        })?;
        Ok((isvc, signal))
    }

    /// The signals of `key` if the pods reported within [`FRESH`].
    fn fresh(&self, key: &Key) -> Option<Snapshot> {
        let s = self.store.get(key)?;
        let age = SystemTime::now().duration_since(s.at).unwrap_or_default();
        (age <= FRESH && s.signals.reporting > 0).then_some(s)
    }

    fn is_active(&self, r: &ScaledObjectRef) -> Result<IsActiveResponse, Status> {
        self.target(r)?;
        let key = Key::new(&r.namespace, &r.name);
        let pods = self
            .fresh(&key)
            .map_or(0.0, |s| s.signals.running + s.signals.waiting);
        Ok(IsActiveResponse {
            result: pods + self.routers.queued(&key) > 0.0,
        })
    }

    fn metric_spec(&self, r: &ScaledObjectRef) -> Result<GetMetricSpecResponse, Status> {
        let (isvc, signal) = self.target(r)?;
        let targets = isvc
            .spec
            .autoscaling
            .as_ref()
            .map(|a| a.targets.clone())
            .unwrap_or_default();
        let target = match signal {
            Signal::Queue => targets.queue_per_replica,
            Signal::KvCache => targets.kv_cache_usage,
        }
        .ok_or_else(|| {
            Status::failed_precondition(format!("the spec sets no target for {}", signal.name()))
        })?;
        Ok(GetMetricSpecResponse {
            metric_specs: vec![MetricSpec {
                metric_name: signal.name().into(),
                target_size: target.ceil() as i64,
                target_size_float: target,
            }],
        })
    }

    fn metrics(&self, req: &GetMetricsRequest) -> Result<GetMetricsResponse, Status> {
        let r = req
            .scaled_object_ref
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("no scaledObjectRef"))?;
        let (_, signal) = self.target(r)?;
        let key = Key::new(&r.namespace, &r.name);
        let fresh = self.fresh(&key);
        let value = match signal {
            // The routers' queue is in the pods' waiting already (spread over them); with no
            // pod reporting it stands alone (held requests included).
            Signal::Queue => fresh.map_or_else(|| self.routers.queued(&key), |s| s.signals.waiting),
            Signal::KvCache => fresh.and_then(|s| s.signals.kv_usage).unwrap_or(0.0),
        };
        Ok(GetMetricsResponse {
            metric_values: vec![MetricValue {
                metric_name: signal.name().into(),
                metric_value: value.ceil() as i64,
                metric_value_float: value,
            }],
        })
    }
}

impl NamedService for Scaler {
    const NAME: &'static str = SERVICE;
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = Result<T, Infallible>> + Send>>;

impl tower::Service<http::Request<Body>> for Scaler {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let scaler = self.clone();
        let method = req
            .uri()
            .path()
            .strip_prefix(&format!("/{SERVICE}/"))
            .unwrap_or_default()
            .to_string();
        Box::pin(async move {
            let response = match method.as_str() {
                "IsActive" => unary(req, move |r: ScaledObjectRef| scaler.is_active(&r)).await,
                "GetMetricSpec" => {
                    unary(req, move |r: ScaledObjectRef| scaler.metric_spec(&r)).await
                }
                "GetMetrics" => unary(req, move |r: GetMetricsRequest| scaler.metrics(&r)).await,
                // The push variants: KEDA falls back to polling the three above.
                other => {
                    Status::unimplemented(format!("{SERVICE}/{other} is not served")).into_http()
                }
            };
            Ok(response)
        })
    }
}

/// One unary call: decode `Req`, answer with `answer`, encode the response or the status.
async fn unary<Req, Resp>(
    req: http::Request<Body>,
    answer: impl Fn(Req) -> Result<Resp, Status> + Clone + Send + 'static,
) -> http::Response<Body>
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Default + Send + 'static,
{
    let service = tower::service_fn(move |r: Request<Req>| {
        let answer = answer.clone();
        async move { answer(r.into_inner()).map(Response::new) }
    });
    Grpc::new(ProstCodec::<Resp, Req>::default())
        .unary(service, req)
        .await
}
