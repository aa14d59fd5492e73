//! `hf://` sources through the `hf-hub` crate, into the Hub's own cache layout
//! (`models--org--name/{blobs,snapshots,refs}`), so vLLM and ferrite share a cache and a
//! half-downloaded blob (`.part`) resumes on the next start.

use std::path::{Path, PathBuf};

use ferrite_api::source::HfSource;
use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};
use tracing::info;

use super::progress::LogProgress;
use super::{FetchError, lock};

/// Files a model folder needs; the rest of a repository (other formats, images, ONNX and
/// PyTorch copies) is left on the Hub, as vLLM's downloader does.
fn wanted(name: &str) -> bool {
    let base = name.rsplit('/').next().unwrap_or(name);
    name.ends_with(".safetensors")
        || name.ends_with(".json")
        || name.ends_with(".jinja")
        || base == "tokenizer.model"
}

/// Fetches `src` (written as `label` in `--model`, which errors quote) into `cache`.
pub fn fetch(label: &str, src: &HfSource, cache: &Path) -> Result<PathBuf, FetchError> {
    let repo = match &src.revision {
        Some(r) => Repo::with_revision(src.repo.clone(), RepoType::Model, r.clone()),
        None => Repo::model(src.repo.clone()),
    };
    let hub_cache = Cache::new(cache.to_path_buf());
    let token = std::env::var("HF_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
        .or_else(|| hub_cache.token());
    let endpoint = std::env::var("HF_ENDPOINT").ok();
    if token.is_some()
        && let Some(e) = &endpoint
        && !token_may_go_to(e)
    {
        return Err(FetchError::Refused {
            model: label.to_string(),
            detail: format!(
                "HF_ENDPOINT {e} is plain http: the token would cross the network in clear; \
                 use https"
            ),
        });
    }
    let mut builder = ApiBuilder::from_cache(hub_cache.clone())
        .with_token(token)
        .with_progress(false)
        .with_retries(3);
    if let Some(endpoint) = endpoint {
        builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_string());
    }
    let api = builder.build().map_err(|e| error(label, None, &e))?;
    let api_repo = api.repo(repo.clone());
    let repo_dir = cache.join(repo.folder_name());
    let cached = hub_cache.repo(repo);
    let get = |file: &str| get(&api_repo, &cached, &repo_dir, file, label);

    if let Some(file) = &src.file {
        return get(file);
    }
    // A whole model folder: the file list of the revision, then each wanted file.
    let listing = api_repo.info().map_err(|e| error(label, None, &e))?;
    let names: Vec<&str> = listing
        .siblings
        .iter()
        .map(|s| s.rfilename.as_str())
        .filter(|n| wanted(n))
        .collect();
    // The listing names cache paths: nothing may point outside the repository's folder.
    if let Some(bad) = names.iter().find(|n| !ferrite_api::source::plain_path(n)) {
        return Err(FetchError::Refused {
            model: label.to_string(),
            detail: format!("the repository lists {bad:?}, which is not a plain relative path"),
        });
    }
    if !names.iter().any(|n| n.ends_with(".safetensors")) {
        let ggufs: Vec<&str> = listing
            .siblings
            .iter()
            .map(|s| s.rfilename.as_str())
            .filter(|n| n.ends_with(".gguf"))
            .collect();
        let detail = if ggufs.is_empty() {
            "the repository has no .safetensors weights".to_string()
        } else {
            format!(
                "the repository has no .safetensors weights; name one of its GGUF files as \
                 hf://{}/<file> (it has {})",
                src.repo,
                ggufs.join(", ")
            )
        };
        return Err(FetchError::Refused {
            model: label.to_string(),
            detail,
        });
    }
    let mut folder = None;
    for name in names {
        let path = get(name)?;
        // The snapshot folder is the downloaded path less the file's own components.
        let depth = name.split('/').count();
        folder = path.ancestors().nth(depth).map(Path::to_path_buf);
    }
    folder.ok_or_else(|| FetchError::Refused {
        model: label.to_string(),
        detail: "the repository lists no files".into(),
    })
}

/// Whether a token may be sent to `endpoint`: over https, or plain http to this machine only
/// (a stand-in Hub in tests, a proxy in the pod).
fn token_may_go_to(endpoint: &str) -> bool {
    let Some(rest) = endpoint.strip_prefix("http://") else {
        return true;
    };
    let host = rest.split(['/', '?']).next().unwrap_or_default();
    let host = match host.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => host,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The cached file when this revision's copy is complete, else a download: one replica at a
/// time per file (the others wait, then find it complete), a part file that cannot be resumed
/// discarded, and the Hub's sha256 of an LFS file checked against what arrived.
fn get(
    api: &ApiRepo,
    cached: &hf_hub::CacheRepo,
    repo_dir: &Path,
    file: &str,
    label: &str,
) -> Result<PathBuf, FetchError> {
    if let Some(path) = cached.get(file) {
        info!(file, path = %path.display(), "model file already downloaded");
        return Ok(path);
    }
    let lock_path = lock::path_in(repo_dir, file);
    let _lock = lock::acquire(&lock_path).map_err(|e| FetchError::Io {
        model: label.to_string(),
        path: lock_path.clone(),
        error: e,
    })?;
    if let Some(path) = cached.get(file) {
        info!(file, path = %path.display(), "model file downloaded by another replica");
        return Ok(path);
    }
    info!(url = api.url(file), "downloading");
    let path = match api.download_with_progress(file, LogProgress::default()) {
        Err(ApiError::InvalidResume) => {
            // A part file longer than the file (hf-hub cannot resume it): drop the parts no
            // download holds, and start over.
            discard_idle_parts(&repo_dir.join("blobs"));
            api.download_with_progress(file, LogProgress::default())
        }
        other => other,
    }
    .map_err(|e| error(label, Some(file), &e))?;
    verify_lfs_sha256(&path).map_err(|detail| FetchError::Transfer {
        model: label.to_string(),
        detail: format!("file {file}: {detail}"),
    })?;
    Ok(path)
}

/// Removes the `.part` files of `blobs` whose download lock no one holds.
fn discard_idle_parts(blobs: &Path) {
    let parts = std::fs::read_dir(blobs)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "part"));
    for part in parts {
        if let Ok(Some(_held)) = lock::try_acquire(&part.with_extension("lock")) {
            tracing::warn!(part = %part.display(), "discarding a part file that cannot be resumed");
            let _ = std::fs::remove_file(&part);
        }
    }
}

/// The Hub names an LFS file's blob by its sha256 (its `x-linked-etag`); a blob named so must
/// hash to its name. A mismatch removes the blob and its snapshot link, so the next start
/// downloads it again instead of loading corrupt weights.
fn verify_lfs_sha256(path: &Path) -> Result<(), String> {
    let blob = std::fs::canonicalize(path).map_err(|e| e.to_string())?;
    let name = blob
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let is_sha256 = name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit());
    if !is_sha256 {
        return Ok(());
    }
    match super::check_sha256(path, &name, true) {
        Ok(()) => {
            info!(file = %path.display(), "sha256 matches the Hub's");
            Ok(())
        }
        Err(super::Sha256Error::Read(e)) => Err(e),
        Err(super::Sha256Error::Mismatch { got }) => Err(format!(
            "the download does not match the Hub's sha256 ({name}; got {got}); it was removed"
        )),
    }
}

/// The Hub's answer in words a user can act on: which token, which file, which revision.
fn error(label: &str, file: Option<&str>, e: &ApiError) -> FetchError {
    let status = match e {
        ApiError::RequestError(r) => match r.as_ref() {
            ureq::Error::Status(code, _) => Some(*code),
            ureq::Error::Transport(_) => None,
        },
        ApiError::TooManyRetries(inner) => {
            return error(label, file, inner);
        }
        _ => None,
    };
    let model = label.to_string();
    let what = file.map_or_else(|| "the repository".to_string(), |f| format!("file {f}"));
    match status {
        Some(code @ (401 | 403)) => FetchError::Refused {
            model,
            detail: format!(
                "the Hub refused access to {what} (HTTP {code}): set HF_TOKEN (through \
                 spec.model.secretRef) to a token that may read this repository, and accept its \
                 licence on the Hub if it is gated"
            ),
        },
        Some(404) => FetchError::Refused {
            model,
            detail: format!(
                "{what} was not found (HTTP 404): check the repository, revision and file name"
            ),
        },
        Some(code) => FetchError::Transfer {
            model,
            detail: format!("the Hub answered HTTP {code} for {what}: {e}"),
        },
        None => FetchError::Transfer {
            model,
            detail: format!("downloading {what}: {e}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_goes_over_https_or_to_this_machine_only() {
        for ok in [
            "https://huggingface.co",
            "http://127.0.0.1:8080",
            "http://localhost:9000/",
            "http://[::1]:80",
        ] {
            assert!(token_may_go_to(ok), "{ok}");
        }
        for bad in [
            "http://hub.internal",
            "http://10.0.0.5:8080",
            "http://127.0.0.1.evil.io",
        ] {
            assert!(!token_may_go_to(bad), "{bad}");
        }
    }

    #[test]
    fn a_model_folder_takes_weights_configs_and_tokenizers_only() {
        for keep in [
            "model.safetensors",
            "model-00001-of-00002.safetensors",
            "config.json",
            "tokenizer.json",
            "chat_template.jinja",
            "sub/tokenizer.model",
        ] {
            assert!(wanted(keep), "{keep}");
        }
        for skip in [
            "pytorch_model.bin",
            "model.gguf",
            "onnx/model.onnx",
            "README.md",
        ] {
            assert!(!wanted(skip), "{skip}");
        }
    }
}
