//! Server-side apply that writes only when something changed. Each object is stamped with a
//! hash of its desired form, and compared with what the watch cache holds:
//! - no live object, or a different stamp: apply;
//! - the same stamp, but the object changed since the operator last wrote it (someone edited a
//!   field the operator owns, say the image): apply again, which reverts the edit. "Changed" is
//!   its `generation` (spec changes) where the kind has one, else its `resourceVersion`,
//!   remembered from the operator's own write. After an operator restart nothing is
//!   remembered, so an edit made while it was down stays until the spec changes.
//!
//! A steady state sends nothing. Deletion of unwanted objects is limited to ones this
//! InferenceService controls.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::Mutex;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::Error;
use crate::config::FIELD_MANAGER;
use ferrite_api::hash::fnv1a;

/// Annotation holding the hash of the desired object last applied.
pub const HASH_ANNOTATION: &str = "ferrite.dev/desired-hash";

/// What [`ensure`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Unchanged,
    Created,
    Updated,
    /// Someone else changed it; the operator put its fields back.
    Restored,
}

/// An object's identity and version as the operator last wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fingerprint {
    uid: Option<String>,
    version: Option<String>,
}

impl Fingerprint {
    fn of(meta: &ObjectMeta) -> Self {
        Self {
            uid: meta.uid.clone(),
            version: meta
                .generation
                .map(|g| format!("g{g}"))
                .or_else(|| meta.resource_version.clone()),
        }
    }
}

/// What the operator saw of each child right after writing it: by owning InferenceService
/// (`namespace/name`), then by `Kind/name`.
#[derive(Debug, Default)]
pub struct Memo(Mutex<HashMap<String, HashMap<String, Fingerprint>>>);

/// Where a child sits in the [`Memo`].
#[derive(Debug, Clone)]
struct Slot {
    owner: String,
    child: String,
}

impl Slot {
    fn of<K: Resource<DynamicType = ()>>(meta: &ObjectMeta) -> Self {
        let ns = meta.namespace.clone().unwrap_or_default();
        let owner = meta
            .owner_references
            .iter()
            .flatten()
            .find(|r| r.controller == Some(true))
            .map_or("", |r| r.name.as_str());
        Self {
            owner: format!("{ns}/{owner}"),
            child: format!(
                "{}/{}",
                K::kind(&()),
                meta.name.as_deref().unwrap_or_default()
            ),
        }
    }
}

impl Memo {
    fn get(&self, slot: &Slot) -> Option<Fingerprint> {
        self.0
            .lock()
            .ok()
            .and_then(|m| m.get(&slot.owner)?.get(&slot.child).cloned())
    }

    fn set(&self, slot: Slot, f: Fingerprint) {
        if let Ok(mut m) = self.0.lock() {
            m.entry(slot.owner).or_default().insert(slot.child, f);
        }
    }

    fn forget(&self, slot: &Slot) {
        if let Ok(mut m) = self.0.lock()
            && let Some(children) = m.get_mut(&slot.owner)
        {
            children.remove(&slot.child);
        }
    }

    /// Forgets every child of the InferenceService `ns/name` (it was deleted).
    pub fn forget_owner(&self, ns: &str, name: &str) {
        if let Ok(mut m) = self.0.lock() {
            m.remove(&format!("{ns}/{name}"));
        }
    }
}

/// Stamps `obj` with the hash of its desired form and returns the hash.
pub fn stamp<K: Resource + Serialize>(obj: &mut K) -> Result<String, Error> {
    let bytes = serde_json::to_vec(&*obj).map_err(Error::Serialize)?;
    let hash = format!("{:016x}", fnv1a(&bytes));
    obj.annotations_mut()
        .insert(HASH_ANNOTATION.into(), hash.clone());
    Ok(hash)
}

fn stamped_with(live: &ObjectMeta, hash: &str) -> bool {
    live.annotations
        .as_ref()
        .and_then(|a| a.get(HASH_ANNOTATION))
        .map(String::as_str)
        == Some(hash)
}

/// Whether `meta` is controlled by the object with `uid`.
pub fn controlled_by(meta: &ObjectMeta, uid: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|r| r.controller == Some(true) && r.uid == uid)
}

pub fn apply_params() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

/// Whether an API error means "no such thing": a 404 Status, or the plain-text `404 page not
/// found` an API server answers for a group it does not serve (which kube's `is_not_found`
/// does not recognise).
pub fn not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// Makes the object match `desired`, given the cached metadata of the live one (if any).
/// Returns the object as written when it wrote.
pub async fn ensure<K>(
    api: &Api<K>,
    memo: &Memo,
    mut desired: K,
    live: Option<&ObjectMeta>,
) -> Result<(Option<K>, Change), Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
{
    let name = desired.meta().name.clone().ok_or(Error::Unnamed)?;
    refuse_foreign(api, desired.meta(), live).await?;
    let key = Slot::of::<K>(desired.meta());
    let hash = stamp(&mut desired)?;
    let before = memo.get(&key);
    let intended = match live {
        None => Change::Created,
        Some(l) if !stamped_with(l, &hash) => Change::Updated,
        Some(l) => match &before {
            Some(b) if *b != Fingerprint::of(l) => Change::Restored,
            Some(_) => return Ok((None, Change::Unchanged)),
            None => {
                // First sight since start-up: the stamp matches, so take it as ours.
                memo.set(key, Fingerprint::of(l));
                return Ok((None, Change::Unchanged));
            }
        },
    };
    let applied = api
        .patch(&name, &apply_params(), &Patch::Apply(&desired))
        .await
        .map_err(Error::kube(K::kind(&()).into_owned(), &name))?;
    let after = Fingerprint::of(applied.meta());
    // A cache that lags behind the operator's own last write can make it write again; the
    // answer then shows nothing moved, and nothing is reported.
    let change = if before.as_ref() == Some(&after) {
        Change::Unchanged
    } else if intended == Change::Created && before.is_some_and(|b| b.uid == after.uid) {
        Change::Updated
    } else {
        intended
    };
    memo.set(key, after);
    Ok((Some(applied), change))
}

/// Adoption rule: a child is written only if it does not exist yet or its controller is the
/// InferenceService writing it. An object someone else made (a Service, HPA, PDB or ConfigMap
/// named like the InferenceService) is never applied over: a forced apply would take its
/// fields and add the ownerRef, and garbage collection would then delete it with the
/// InferenceService. The caches hold only managed objects, so one they do not hold is looked
/// up once before it would be created.
async fn refuse_foreign<K>(
    api: &Api<K>,
    desired: &ObjectMeta,
    live: Option<&ObjectMeta>,
) -> Result<(), Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let Some(owner) = desired
        .owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true))
    else {
        // Children without an owner (cross-namespace dashboards) are the operator's by label.
        return Ok(());
    };
    let name = desired.name.as_deref().unwrap_or_default();
    let foreign = match live {
        Some(l) => !controlled_by(l, &owner.uid),
        None => match api.get_metadata_opt(name).await {
            Ok(Some(m)) => !controlled_by(&m.metadata, &owner.uid),
            Ok(None) => false,
            Err(e) => return Err(Error::kube(K::kind(&()).into_owned(), name)(e)),
        },
    };
    if foreign {
        return Err(Error::ChildConflict {
            kind: K::kind(&()).into_owned(),
            name: name.to_string(),
        });
    }
    Ok(())
}

/// Deletes `name` if the cache holds it and `uid` controls it; returns whether it did.
pub async fn remove<K>(
    api: &Api<K>,
    memo: &Memo,
    live: Option<&ObjectMeta>,
    uid: &str,
) -> Result<bool, Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    match live {
        Some(l) if controlled_by(l, uid) => {
            memo.forget(&Slot::of::<K>(l));
            delete(api, l.name.as_deref().unwrap_or_default(), &K::kind(&())).await
        }
        _ => Ok(false),
    }
}

/// Deletes `name`, treating "already gone" as done.
pub async fn delete<K>(api: &Api<K>, name: &str, kind: &str) -> Result<bool, Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(true),
        Err(e) if not_found(&e) => Ok(false),
        Err(e) => Err(Error::kube(kind.to_string(), name)(e)),
    }
}
