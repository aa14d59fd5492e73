//! Server-side apply that writes only when something changed. Each object is stamped with a
//! hash of its desired form; when the live object carries the same stamp, nothing is sent, so a
//! steady state costs reads only. Deletion of unwanted objects is limited to ones this
//! InferenceService controls.

use std::fmt::Debug;

use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::Error;
use crate::config::FIELD_MANAGER;
use crate::hash::fnv1a;

/// Annotation holding the hash of the desired object last applied.
pub const HASH_ANNOTATION: &str = "ferrite.dev/desired-hash";

/// What [`ensure`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Unchanged,
    Created,
    Updated,
}

/// Stamps `obj` with the hash of its desired form and returns the hash.
pub fn stamp<K: Resource + Serialize>(obj: &mut K) -> Result<String, Error> {
    let bytes = serde_json::to_vec(&*obj).map_err(Error::Serialize)?;
    let hash = format!("{:016x}", fnv1a(&bytes));
    obj.annotations_mut()
        .insert(HASH_ANNOTATION.into(), hash.clone());
    Ok(hash)
}

fn stamped_with<K: Resource>(live: &K, hash: &str) -> bool {
    live.annotations().get(HASH_ANNOTATION).map(String::as_str) == Some(hash)
}

/// Whether `obj` is controlled by the object with `uid`.
pub fn controlled_by<K: Resource>(obj: &K, uid: &str) -> bool {
    obj.owner_references()
        .iter()
        .any(|r| r.controller == Some(true) && r.uid == uid)
}

pub fn apply_params() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

/// Makes the live object match `desired` (`live` is what a read found, if anything).
pub async fn ensure_with<K>(
    api: &Api<K>,
    mut desired: K,
    live: Option<K>,
) -> Result<(K, Change), Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
{
    let name = desired.meta().name.clone().ok_or(Error::Unnamed)?;
    let hash = stamp(&mut desired)?;
    match live {
        Some(l) if stamped_with(&l, &hash) => Ok((l, Change::Unchanged)),
        other => {
            let applied = api
                .patch(&name, &apply_params(), &Patch::Apply(&desired))
                .await
                .map_err(Error::kube(K::kind(&()).into_owned(), &name))?;
            let change = if other.is_some() {
                Change::Updated
            } else {
                Change::Created
            };
            Ok((applied, change))
        }
    }
}

/// Reads the live object, then [`ensure_with`].
pub async fn ensure<K>(api: &Api<K>, desired: K) -> Result<(K, Change), Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
{
    let name = desired.meta().name.clone().ok_or(Error::Unnamed)?;
    let live = api
        .get_opt(&name)
        .await
        .map_err(Error::kube(K::kind(&()).into_owned(), &name))?;
    ensure_with(api, desired, live).await
}

/// Deletes `name` if it exists and `uid` controls it; returns whether it did. Reads only the
/// metadata: ownership is all that matters, and a foreign CRD's schema cannot break it.
pub async fn remove<K>(api: &Api<K>, name: &str, uid: &str) -> Result<bool, Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let kind = K::kind(&()).into_owned();
    match api.get_metadata_opt(name).await {
        Ok(Some(live)) if controlled_by(&live, uid) => delete(api, name, &kind).await,
        Ok(_) => Ok(false),
        // The kind itself is not served (a ServiceMonitor without its CRD): nothing to delete.
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(false),
        Err(e) => Err(Error::kube(kind, name)(e)),
    }
}

/// Deletes `name`, treating "already gone" as done.
pub async fn delete<K>(api: &Api<K>, name: &str, kind: &str) -> Result<bool, Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(false),
        Err(e) => Err(Error::kube(kind.to_string(), name)(e)),
    }
}
