//! Puts a model's weights on local disk before the server loads them.
//!
//! `--model` takes a local path, `hf://org/name[@revision][/file]`, or an `s3://`, `gs://`,
//! `https://` or `http://` URL (the grammar lives in `ferrite_api::source`, shared with the
//! operator). Downloads go into `--download-dir` and resume where an interrupted one stopped,
//! so a restarted pod with a model cache claim neither starts over nor needs the network once
//! the files are complete.

mod hub;
mod lock;
mod object;
mod progress;

use std::path::{Path, PathBuf};

use ferrite_api::source::{Source, SourceError};
use ferrite_api::termination::DOWNLOAD_FAILED;
use tracing::info;

/// Why the weights could not be put on disk. Each message names the source and what to change.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(
        "{0}: pvc:// sources are mounted by the operator; give the server the mounted path instead"
    )]
    Pvc(String),
    #[error("{model}: {detail}")]
    Refused { model: String, detail: String },
    #[error("{model}: {detail}")]
    Transfer { model: String, detail: String },
    #[error("{model}: writing {path}: {error}")]
    Io {
        model: String,
        path: PathBuf,
        error: std::io::Error,
    },
}

impl FetchError {
    /// The first line of the pod's termination message: `ModelDownloadFailed: <why>`.
    pub fn termination_message(&self) -> String {
        format!("{DOWNLOAD_FAILED}: {self}")
    }
}

/// Where the weights are now: `source` itself when local, else the downloaded file or folder
/// under `cache`; with `sha256`, checked to be a file with that hash.
pub async fn resolve(
    source: &str,
    cache: &Path,
    sha256: Option<&str>,
) -> Result<PathBuf, FetchError> {
    let parsed = Source::parse(source)?;
    let local = matches!(parsed, Source::Path(_));
    let path = fetch(source, parsed, cache).await?;
    let Some(expected) = sha256 else {
        return Ok(path);
    };
    let (label, expected) = (source.to_string(), expected.to_string());
    tokio::task::spawn_blocking(move || {
        verify_sha256(&path, &expected, !local).map_err(|detail| FetchError::Refused {
            model: label,
            detail,
        })?;
        Ok(path)
    })
    .await
    .map_err(|e| FetchError::Transfer {
        model: source.to_string(),
        detail: format!("the checksum thread failed: {e}"),
    })?
}

/// `path` must be a file hashing to `expected`; a download that does not (`remove`) is
/// removed, with the link to it, so the next start fetches it again. A local file is left.
fn verify_sha256(path: &Path, expected: &str, remove: bool) -> Result<(), String> {
    if path.is_dir() {
        return Err(format!(
            "--model-sha256 names one file, and {} is a folder",
            path.display()
        ));
    }
    match check_sha256(path, expected, remove) {
        Ok(()) => {
            info!(file = %path.display(), "sha256 matches --model-sha256");
            Ok(())
        }
        Err(Sha256Error::Read(e)) => Err(e),
        Err(Sha256Error::Mismatch { got }) => Err(format!(
            "the weights do not match the expected sha256 {expected} (got {got}){}",
            if remove {
                "; the download was removed"
            } else {
                ""
            }
        )),
    }
}

/// Why a file failed [`check_sha256`].
enum Sha256Error {
    /// It could not be read (the message says where).
    Read(String),
    /// It hashes to `got` instead.
    Mismatch { got: String },
}

/// Hashes the file `path` leads to (a link is followed) against `expected` (hex, either case).
/// On a mismatch, with `remove`, the file and `path` (the link to it, if one) are removed, so
/// the next start fetches it again instead of loading it.
fn check_sha256(path: &Path, expected: &str, remove: bool) -> Result<(), Sha256Error> {
    let file = std::fs::canonicalize(path)
        .map_err(|e| Sha256Error::Read(format!("{}: {e}", path.display())))?;
    let got = sha256_file(&file)
        .map_err(|e| Sha256Error::Read(format!("reading {}: {e}", file.display())))?;
    if got.eq_ignore_ascii_case(expected) {
        return Ok(());
    }
    if remove {
        let _ = std::fs::remove_file(&file);
        let _ = std::fs::remove_file(path);
    }
    Err(Sha256Error::Mismatch { got })
}

/// The lowercase hex sha256 of a file, streamed through the hasher.
fn sha256_file(path: &Path) -> std::io::Result<String> {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The weights of `parsed` (`source` as given) on local disk, downloaded first when remote.
async fn fetch(source: &str, parsed: Source, cache: &Path) -> Result<PathBuf, FetchError> {
    match parsed {
        Source::Path(p) => Ok(PathBuf::from(p)),
        Source::Pvc { .. } => Err(FetchError::Pvc(source.to_string())),
        Source::Hf(h) => {
            info!(source, cache = %cache.display(), "fetching the model");
            let (cache, label) = (cache.to_path_buf(), source.to_string());
            tokio::task::spawn_blocking(move || hub::fetch(&label, &h, &cache))
                .await
                .map_err(|e| FetchError::Transfer {
                    model: source.to_string(),
                    detail: format!("the download thread failed: {e}"),
                })?
        }
        Source::Object(o) => {
            info!(source, cache = %cache.display(), "fetching the model");
            object::fetch(source, &o, cache)
                .await
                .map(|p| single_gguf(&p))
        }
    }
}

/// A downloaded folder that is not a Hugging Face model folder (no `config.json`) but holds
/// exactly one GGUF is that GGUF: a bucket prefix often holds one quantisation and a README.
fn single_gguf(path: &Path) -> PathBuf {
    if !path.is_dir() || path.join("config.json").exists() {
        return path.to_path_buf();
    }
    let ggufs: Vec<PathBuf> = std::fs::read_dir(path)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    match ggufs.as_slice() {
        [one] => one.clone(),
        _ => path.to_path_buf(),
    }
}

/// The name clients use by default, as vLLM picks it: the repository id for `hf://`, else the
/// file or folder name without extension.
pub fn default_served_name(source: &str) -> String {
    if let Ok(Source::Hf(h)) = Source::parse(source) {
        return h.repo;
    }
    let last = source
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default();
    let stem = Path::new(last)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    if stem.is_empty() {
        "model".into()
    } else {
        stem
    }
}

/// The default download folder: `$HF_HOME/hub` as the Hub's own tools use it (so vLLM and
/// ferrite pods share one cache layout), else `~/.cache/huggingface/hub`, else a folder in
/// the working directory.
pub fn default_cache_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("HF_HOME") {
        return PathBuf::from(home).join("hub");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache/huggingface/hub"),
        None => PathBuf::from(".cache/huggingface/hub"),
    }
}

/// Writes `message` where Kubernetes reads a container's termination message, so that the
/// operator can say why the pod failed without reading logs. Best effort: the server exits
/// with the error either way.
pub fn write_termination_message(path: &Path, message: &str) {
    if let Err(e) = std::fs::write(path, message) {
        tracing::warn!(path = %path.display(), error = %e, "could not write the termination message");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_names_follow_vllm() {
        assert_eq!(default_served_name("hf://org/repo@v1/x.gguf"), "org/repo");
        assert_eq!(default_served_name("/models/smol.gguf"), "smol");
        assert_eq!(default_served_name("s3://b/llama/8b/"), "8b");
        assert_eq!(default_served_name("/"), "model");
    }

    #[tokio::test]
    async fn local_and_refused_sources() {
        let cache = Path::new("/nonexistent");
        assert_eq!(
            resolve("/models/a.gguf", cache, None).await.ok(),
            Some(PathBuf::from("/models/a.gguf"))
        );
        let e = resolve("pvc://claim/x", cache, None)
            .await
            .expect_err("pvc");
        assert!(e.to_string().contains("mounted path"), "{e}");
        let e = resolve("ftp://x/y", cache, None).await.expect_err("ftp");
        assert!(
            e.termination_message().starts_with("ModelDownloadFailed: "),
            "{e}"
        );
    }
}
