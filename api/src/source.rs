//! Where a model's weights come from, as written in `--model` and `spec.model.source`.
//!
//! One grammar serves both sides: the operator parses it to decide what the pod mounts (and to
//! refuse a bad source in a status condition), and ferrite-server parses it to download what is
//! not on disk. Keeping it in one place means a source the operator accepts is one the server
//! can fetch. [`crate::termination`] is the other half of that contract: the reasons the server gives
//! when it cannot start, which the operator turns into status conditions.

/// A parsed model source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// An absolute local path: a GGUF file or a Hugging Face folder.
    Path(String),
    /// `pvc://claim/path`: a PersistentVolumeClaim the operator mounts (the server never sees
    /// this form; it gets the mounted path).
    Pvc { claim: String, path: String },
    /// `hf://org/name[@revision][/file]`.
    Hf(HfSource),
    /// `s3://`, `gs://`, `https://` or `http://` URLs: one object, or a folder when the URL
    /// ends in `/`.
    Object(ObjectSource),
}

/// A Hugging Face Hub repository, optionally pinned and narrowed to one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfSource {
    /// `org/name`.
    pub repo: String,
    /// A branch, tag or commit; the Hub's default (`main`) when absent.
    pub revision: Option<String>,
    /// A file inside the repository (a GGUF, usually); the whole model folder when absent.
    pub file: Option<String>,
}

/// Object stores and plain web servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    S3,
    Gs,
    Https,
    /// Unencrypted; for in-cluster artefact servers.
    Http,
}

impl Scheme {
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::S3 => "s3",
            Scheme::Gs => "gs",
            Scheme::Https => "https",
            Scheme::Http => "http",
        }
    }
}

/// A URL source, split into the part that names the store and the key inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectSource {
    pub scheme: Scheme,
    /// The bucket, or `host[:port]` for http(s).
    pub authority: String,
    /// The key or URL path, without the leading `/`; ends in `/` for a folder.
    pub key: String,
}

impl ObjectSource {
    /// Whether the URL names a folder (every object under the prefix is fetched).
    pub fn is_folder(&self) -> bool {
        self.key.ends_with('/')
    }

    /// The URL of the store's root (bucket or site).
    pub fn root(&self) -> String {
        format!("{}://{}", self.scheme.as_str(), self.authority)
    }
}

/// Why a source does not parse: the source as given and the form it should take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model source {given:?}: {why}")]
pub struct SourceError {
    pub given: String,
    pub why: &'static str,
}

const FORMS: &str = "expected an absolute path, pvc://<claim>/<path>, \
                     hf://<org>/<name>[@<revision>][/<file>], or an s3://, gs://, https:// or \
                     http:// URL";

impl Source {
    pub fn parse(s: &str) -> Result<Self, SourceError> {
        let bad = |why| SourceError {
            given: redacted(s),
            why,
        };
        if s.chars().any(char::is_whitespace) {
            return Err(bad("a source has no whitespace"));
        }
        if let Some(rest) = s.strip_prefix("pvc://") {
            let (claim, path) = rest
                .split_once('/')
                .ok_or_else(|| bad("expected pvc://<claim>/<path>"))?;
            if claim.is_empty() || path.is_empty() {
                return Err(bad("expected pvc://<claim>/<path>"));
            }
            if !plain_path(path.trim_end_matches('/')) {
                return Err(bad(
                    "the path must stay inside the claim (no empty, . or .. segments)",
                ));
            }
            return Ok(Self::Pvc {
                claim: claim.into(),
                path: path.trim_end_matches('/').into(),
            });
        }
        if let Some(rest) = s.strip_prefix("hf://") {
            return hf(rest).map(Self::Hf).map_err(bad);
        }
        for (prefix, scheme) in [
            ("s3://", Scheme::S3),
            ("gs://", Scheme::Gs),
            ("https://", Scheme::Https),
            ("http://", Scheme::Http),
        ] {
            if let Some(rest) = s.strip_prefix(prefix) {
                let (authority, key) = rest
                    .split_once('/')
                    .ok_or_else(|| bad("expected <scheme>://<bucket or host>/<key>"))?;
                if authority.is_empty() || key.is_empty() || key == "/" {
                    return Err(bad("expected <scheme>://<bucket or host>/<key>"));
                }
                if authority.contains('@') {
                    return Err(bad(
                        "credentials do not go in the URL (they would show in logs and status); \
                         put them in the Secret named by spec.model.secretRef",
                    ));
                }
                if !plain_authority(authority) {
                    return Err(bad(
                        "the bucket or host has letters, digits, '-', '_', '.', ':' and [] only",
                    ));
                }
                if matches!(scheme, Scheme::Http | Scheme::Https) && key.ends_with('/') {
                    return Err(bad(
                        "an http(s) source names one file; a folder needs s3:// or gs://",
                    ));
                }
                if !plain_path(key.trim_end_matches('/')) || key.contains(['?', '#']) {
                    return Err(bad(
                        "the key must be a plain path (no empty, . or .. segments, query or \
                         fragment)",
                    ));
                }
                return Ok(Self::Object(ObjectSource {
                    scheme,
                    authority: authority.into(),
                    key: key.into(),
                }));
            }
        }
        if s.starts_with('/') {
            return Ok(Self::Path(s.into()));
        }
        Err(bad(FORMS))
    }

    /// Whether the weights are a GGUF file (else a safetensors folder), judged by the name as
    /// the operator and vLLM do.
    pub fn is_gguf(&self) -> bool {
        let name = match self {
            Source::Path(p) | Source::Pvc { path: p, .. } => p.as_str(),
            Source::Hf(h) => h.file.as_deref().unwrap_or(""),
            Source::Object(o) => o.key.as_str(),
        };
        name.ends_with(".gguf")
    }
}

/// `s` with any `user:password@` of a URL replaced, so an error that quotes a source (in a
/// log line, a pod's termination message, an InferenceService's status) never carries them.
pub fn redacted(s: &str) -> String {
    if let Some((scheme, rest)) = s.split_once("://") {
        let authority_end = rest.find('/').unwrap_or(rest.len());
        if let Some(at) = rest[..authority_end].rfind('@') {
            return format!("{scheme}://<redacted>@{}", &rest[at + 1..]);
        }
    }
    s.to_string()
}

/// A relative path that stays where it is joined: segments separated by `/`, none empty
/// (so no leading `/`, which would replace the folder it is joined to), `.` or `..`, and no
/// backslash or control character. Model sources and the names a store or the Hub lists are
/// checked with it before they become paths in the download cache.
pub fn plain_path(path: &str) -> bool {
    !path.is_empty()
        && path.split('/').all(|seg| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && !seg.chars().any(|c| c == '\\' || c.is_control())
        })
}

/// A bucket, or a host with an optional port: it is also a folder of the download cache.
fn plain_authority(a: &str) -> bool {
    a != "."
        && a != ".."
        && a.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '[' | ']'))
}

/// `org/name[@revision][/file]`.
fn hf(rest: &str) -> Result<HfSource, &'static str> {
    const FORM: &str = "expected hf://<org>/<name>[@<revision>][/<file>]";
    let mut parts = rest.splitn(3, '/');
    let org = parts.next().unwrap_or_default();
    let name_rev = parts.next().unwrap_or_default();
    let file = parts.next().filter(|f| !f.is_empty());
    let (name, revision) = match name_rev.split_once('@') {
        Some((n, r)) if !r.is_empty() => (n, Some(r.to_string())),
        Some(_) => return Err("the revision after @ is empty"),
        None => (name_rev, None),
    };
    let id_ok = |p: &str| {
        !p.is_empty()
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !p.starts_with(['.', '-'])
    };
    if !id_ok(org) || !id_ok(name) {
        return Err(FORM);
    }
    if let Some(r) = &revision
        && !r
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err("a revision is a branch, tag or commit of letters, digits, -, _ and .");
    }
    if let Some(f) = file
        && !plain_path(f)
    {
        return Err("the file must stay inside the repository (no empty, . or .. segments)");
    }
    Ok(HfSource {
        repo: format!("{org}/{name}"),
        revision,
        file: file.map(str::to_string),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hf(repo: &str, revision: Option<&str>, file: Option<&str>) -> Source {
        Source::Hf(HfSource {
            repo: repo.into(),
            revision: revision.map(Into::into),
            file: file.map(Into::into),
        })
    }

    #[test]
    fn parses_each_form() {
        let ok = |s: &str| Source::parse(s).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ok("/models/a.gguf"), Source::Path("/models/a.gguf".into()));
        assert_eq!(
            ok("pvc://weights/llama/8b/"),
            Source::Pvc {
                claim: "weights".into(),
                path: "llama/8b".into()
            }
        );
        assert_eq!(
            ok("hf://HuggingFaceTB/SmolLM2-135M-Instruct"),
            hf("HuggingFaceTB/SmolLM2-135M-Instruct", None, None)
        );
        assert_eq!(
            ok("hf://org/repo@v1.2/q4/model.gguf"),
            hf("org/repo", Some("v1.2"), Some("q4/model.gguf"))
        );
        assert_eq!(ok("hf://org/repo/"), hf("org/repo", None, None));
        assert_eq!(
            ok("s3://bucket/llama/8b/"),
            Source::Object(ObjectSource {
                scheme: Scheme::S3,
                authority: "bucket".into(),
                key: "llama/8b/".into()
            })
        );
        let Source::Object(o) = ok("http://10.0.0.1:9000/m/a.gguf") else {
            panic!("an object source");
        };
        assert_eq!(
            (o.scheme, o.root()),
            (Scheme::Http, "http://10.0.0.1:9000".into())
        );
        assert!(!o.is_folder());
        assert!(ok("gs://b/x.gguf").is_gguf());
        assert!(!ok("hf://a/b").is_gguf());
    }

    #[test]
    fn refuses_malformed_sources_with_the_reason() {
        for bad in [
            "pvc://claim",
            "pvc:///x",
            "pvc://c/../etc",
            "hf://only-org",
            "hf://org/repo/../../x",
            "hf://org/repo@/x",
            "hf://org/repo@a b",
            "hf://org/re po",
            "hf://.org/x",
            "models/a.gguf",
            "s3://bucket",
            "s3:///key",
            "https://host/a?x=1",
            "https://host/folder/",
            "gs://b/../x",
            "ftp://host/x",
            "",
            // Paths that would leave the download cache when joined to it.
            "s3://bucket//etc/passwd",
            "s3://bucket/a//b",
            "s3://bucket/./a",
            "s3://../key",
            "gs://./key",
            "hf://org/repo//etc/x",
            "hf://org/repo/a/./b",
            "pvc://c//abs",
            "https://host/a\\..\\b",
        ] {
            let e = Source::parse(bad).expect_err(bad);
            assert_eq!(e.given, bad);
            assert!(!e.why.is_empty());
        }
    }

    #[test]
    fn credentials_in_a_url_are_refused_and_not_repeated() {
        let e = Source::parse("https://user:secret@host/m.gguf").expect_err("credentials");
        assert!(e.why.contains("secretRef"), "{}", e.why);
        assert!(!e.to_string().contains("secret@"), "{e}");
        assert_eq!(e.given, "https://<redacted>@host/m.gguf");
        let e = Source::parse("s3://key:secret@bucket/m.gguf").expect_err("credentials");
        assert!(!e.to_string().contains("key:secret"), "{e}");
    }

    #[test]
    fn plain_paths_stay_where_they_are_joined() {
        for ok in ["a", "a/b.gguf", "models--x/blobs/ab12", "a.b/c-d_e"] {
            assert!(plain_path(ok), "{ok}");
        }
        for bad in [
            "", "/a", "a/", "a//b", "..", "a/../b", "./a", "a\\b", "a\u{0}b",
        ] {
            assert!(!plain_path(bad), "{bad:?}");
        }
    }
}
