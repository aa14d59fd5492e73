//! `hf://` sources through the `hf-hub` crate, into the Hub's own cache layout
//! (`models--org--name/{blobs,snapshots,refs}`), so vLLM and ferrite share a cache and a
//! half-downloaded blob (`.part`) resumes on the next start.

use std::path::{Path, PathBuf};

use ferrite_source::HfSource;
use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};
use tracing::info;

use super::FetchError;
use super::progress::LogProgress;

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
    let mut builder = ApiBuilder::from_cache(hub_cache.clone())
        .with_token(token)
        .with_progress(false)
        .with_retries(3);
    if let Ok(endpoint) = std::env::var("HF_ENDPOINT") {
        builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_string());
    }
    let api = builder.build().map_err(|e| error(label, None, &e))?;
    let api_repo = api.repo(repo.clone());
    let cached = hub_cache.repo(repo);

    if let Some(file) = &src.file {
        return get(&api_repo, &cached, file).map_err(|e| error(label, Some(file), &e));
    }
    // A whole model folder: the file list of the revision, then each wanted file.
    let listing = api_repo.info().map_err(|e| error(label, None, &e))?;
    let names: Vec<&str> = listing
        .siblings
        .iter()
        .map(|s| s.rfilename.as_str())
        .filter(|n| wanted(n))
        .collect();
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
        let path = get(&api_repo, &cached, name).map_err(|e| error(label, Some(name), &e))?;
        // The snapshot folder is the downloaded path less the file's own components.
        let depth = name.split('/').count();
        folder = path.ancestors().nth(depth).map(Path::to_path_buf);
    }
    folder.ok_or_else(|| FetchError::Refused {
        model: label.to_string(),
        detail: "the repository lists no files".into(),
    })
}

/// The cached file when this revision's copy is complete, else a (resumed) download.
fn get(api: &ApiRepo, cached: &hf_hub::CacheRepo, file: &str) -> Result<PathBuf, ApiError> {
    if let Some(path) = cached.get(file) {
        info!(file, path = %path.display(), "model file already downloaded");
        return Ok(path);
    }
    info!(url = api.url(file), "downloading");
    api.download_with_progress(file, LogProgress::default())
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
