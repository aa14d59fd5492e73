//! The first word of ferrite-server's termination message when it cannot start
//! (`<Reason>: <detail>`), which the operator shows as the InferenceService's `Degraded` reason.
//! One list, so the two sides cannot drift apart.

/// The weights could not be downloaded: a refused token, a missing file or revision, a network
/// failure.
pub const DOWNLOAD_FAILED: &str = "ModelDownloadFailed";
/// The weights are on disk but do not load: a corrupt file, an unsupported architecture.
pub const LOAD_FAILED: &str = "ModelLoadFailed";
/// Any other failure to start: a bad flag value, a KV cache too small for one sequence, a port
/// in use.
pub const START_FAILED: &str = "ServerStartFailed";

/// Every reason the server writes.
pub const REASONS: &[&str] = &[DOWNLOAD_FAILED, LOAD_FAILED, START_FAILED];
