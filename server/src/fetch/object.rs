//! `s3://`, `gs://` and `http(s)://` sources through `object_store`. Credentials come from the
//! environment as each cloud's own tools read them (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`,
//! `GOOGLE_SERVICE_ACCOUNT_KEY`, ...), which the operator fills from `spec.model.secretRef`.
//!
//! A file is written to `<name>.part` and renamed when complete; `<name>.part.tag` records
//! which version of the object the part belongs to, so an interrupted download resumes with a
//! range request only if the object has not changed since.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrite_api::source::{ObjectSource, Scheme};
use futures_util::StreamExt;
use object_store::path::Path as StorePath;
use object_store::{ClientOptions, GetOptions, GetRange, ObjectMeta, ObjectStore};
use tokio::io::AsyncWriteExt;
use tracing::{info, warn};

use super::progress::LogProgress;
use super::{FetchError, lock};

/// Tries per file; each retry resumes from the bytes already written.
const ATTEMPTS: usize = 3;

/// Fetches `src` (written as `label` in `--model`, which errors quote) into `cache`.
pub async fn fetch(label: &str, src: &ObjectSource, cache: &Path) -> Result<PathBuf, FetchError> {
    let store = store(src).map_err(|e| error(label, &e))?;
    let root = cache
        .join("objects")
        .join(src.scheme.as_str())
        .join(&src.authority);
    if !src.is_folder() {
        let key = StorePath::from(src.key.as_str());
        return file(&*store, &key, &root, label).await;
    }
    let prefix = StorePath::from(src.key.trim_end_matches('/'));
    let mut listing = store.list(Some(&prefix));
    let mut objects = Vec::new();
    while let Some(meta) = listing.next().await {
        objects.push(meta.map_err(|e| error(label, &e))?);
    }
    if objects.is_empty() {
        return Err(FetchError::Refused {
            model: label.to_string(),
            detail: "no objects under this prefix".into(),
        });
    }
    // The store's listing names cache paths too: a hostile or broken store must not write
    // outside the cache (a key with `..`, an empty segment or a leading `/`).
    if let Some(bad) = objects
        .iter()
        .find(|m| !ferrite_api::source::plain_path(m.location.as_ref()))
    {
        return Err(FetchError::Refused {
            model: label.to_string(),
            detail: format!(
                "the store listed {:?}, which is not a plain relative path",
                bad.location.as_ref()
            ),
        });
    }
    let dest_dir = root.join(src.key.trim_end_matches('/'));
    for meta in objects {
        file(&*store, &meta.location, &root, label).await?;
    }
    Ok(dest_dir)
}

fn store(src: &ObjectSource) -> object_store::Result<Arc<dyn ObjectStore>> {
    Ok(match src.scheme {
        Scheme::S3 => Arc::new(
            object_store::aws::AmazonS3Builder::from_env()
                .with_bucket_name(&src.authority)
                .build()?,
        ),
        Scheme::Gs => Arc::new(
            object_store::gcp::GoogleCloudStorageBuilder::from_env()
                .with_bucket_name(&src.authority)
                .build()?,
        ),
        Scheme::Https | Scheme::Http => Arc::new(
            object_store::http::HttpBuilder::new()
                .with_url(src.root())
                .with_client_options(
                    ClientOptions::new().with_allow_http(src.scheme == Scheme::Http),
                )
                .build()?,
        ),
    })
}

/// What identifies one version of an object, for deciding whether a part file may resume.
fn tag(meta: &ObjectMeta) -> String {
    match &meta.e_tag {
        Some(e) => format!("etag {e}"),
        None => format!("size {} modified {}", meta.size, meta.last_modified),
    }
}

/// Downloads `key` into `root` (the bucket's or host's folder, which also holds the download
/// locks) and returns where it is.
async fn file(
    store: &dyn ObjectStore,
    key: &StorePath,
    root: &Path,
    label: &str,
) -> Result<PathBuf, FetchError> {
    let dest = &root.join(key.as_ref());
    let meta = store.head(key).await.map_err(|e| error(label, &e))?;
    let io = |path: &Path, error: std::io::Error| FetchError::Io {
        model: label.to_string(),
        path: path.to_path_buf(),
        error,
    };
    let complete = async || {
        tokio::fs::metadata(dest)
            .await
            .is_ok_and(|m| m.len() == meta.size)
    };
    if complete().await {
        info!(file = %dest.display(), "model file already downloaded");
        return Ok(dest.clone());
    }
    let part = dest.with_extension(extension(dest, "part"));
    let tag_file = dest.with_extension(extension(dest, "part.tag"));
    let lock_file = lock::path_in(root, key.as_ref());
    let _lock = lock::acquire_async(lock_file.clone())
        .await
        .map_err(|e| io(&lock_file, e))?;
    if complete().await {
        info!(file = %dest.display(), "model file downloaded by another replica");
        return Ok(dest.clone());
    }
    if let Some(parent) = dest.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|e| io(parent, e))?;
    }
    let tag = tag(&meta);
    let same = tokio::fs::read_to_string(&tag_file).await.ok().as_deref() == Some(tag.as_str());
    if !same {
        // A part of another version (or none): start over.
        let _ = tokio::fs::remove_file(&part).await;
        tokio::fs::write(&tag_file, &tag)
            .await
            .map_err(|e| io(&tag_file, e))?;
    }
    let mut progress = LogProgress::default();
    progress.start(
        usize::try_from(meta.size).unwrap_or(usize::MAX),
        key.as_ref(),
    );
    let mut last = None;
    for attempt in 0..ATTEMPTS {
        let mut have = tokio::fs::metadata(&part).await.map_or(0, |m| m.len());
        if have > meta.size {
            // Longer than the object: not a part of it. Start over rather than fail forever.
            warn!(file = %key, have, size = meta.size, "discarding an oversized part file");
            tokio::fs::remove_file(&part)
                .await
                .map_err(|e| io(&part, e))?;
            have = 0;
        }
        if have == meta.size {
            break;
        }
        if have > 0 {
            info!(file = %key, from = have, attempt, "resuming");
        } else {
            info!(file = %key, bytes = meta.size, "downloading");
        }
        match copy_from(store, key, &meta, have, &part, &mut progress).await {
            Ok(()) => {
                last = None;
                break;
            }
            Err(Failure::Store(e)) => {
                warn!(file = %key, error = %e, "download interrupted");
                last = Some(error(label, &e));
            }
            Err(Failure::Io(e)) => return Err(io(&part, e)),
        }
    }
    if let Some(e) = last {
        return Err(e);
    }
    let got = tokio::fs::metadata(&part).await.map_or(0, |m| m.len());
    if got != meta.size {
        return Err(FetchError::Transfer {
            model: label.to_string(),
            detail: format!("{key}: got {got} bytes of {}", meta.size),
        });
    }
    tokio::fs::rename(&part, dest)
        .await
        .map_err(|e| io(dest, e))?;
    let _ = tokio::fs::remove_file(&tag_file).await;
    Ok(dest.clone())
}

/// `name.ext` → `ext.<suffix>` (so `a.gguf` gets `a.gguf.part`).
fn extension(dest: &Path, suffix: &str) -> String {
    match dest.extension() {
        Some(e) => format!("{}.{suffix}", e.to_string_lossy()),
        None => suffix.to_string(),
    }
}

enum Failure {
    Store(object_store::Error),
    Io(std::io::Error),
}

/// Appends the object from byte `from` to `part`, asking only for the version `meta` names.
async fn copy_from(
    store: &dyn ObjectStore,
    key: &StorePath,
    meta: &ObjectMeta,
    from: u64,
    part: &Path,
    progress: &mut LogProgress,
) -> Result<(), Failure> {
    let opts = GetOptions {
        range: (from > 0).then_some(GetRange::Offset(from)),
        if_match: meta.e_tag.clone(),
        ..GetOptions::default()
    };
    let got = store.get_opts(key, opts).await.map_err(Failure::Store)?;
    let mut out = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(part)
        .await
        .map_err(Failure::Io)?;
    progress.advance(usize::try_from(from).unwrap_or(0));
    let mut stream = got.into_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(Failure::Store)?;
        out.write_all(&chunk).await.map_err(Failure::Io)?;
        progress.advance(chunk.len());
    }
    out.flush().await.map_err(Failure::Io)?;
    Ok(())
}

fn error(label: &str, e: &object_store::Error) -> FetchError {
    let model = label.to_string();
    match e {
        object_store::Error::NotFound { .. } => FetchError::Refused {
            model,
            detail: format!("not found: check the bucket and key ({e})"),
        },
        object_store::Error::Unauthenticated { .. }
        | object_store::Error::PermissionDenied { .. } => FetchError::Refused {
            model,
            detail: format!(
                "the store refused the credentials: put them in the Secret named by \
                 spec.model.secretRef ({e})"
            ),
        },
        _ => FetchError::Transfer {
            model,
            detail: e.to_string(),
        },
    }
}
