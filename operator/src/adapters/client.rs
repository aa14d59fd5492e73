//! Calls to one replica's adapter API, as vLLM and ferrite-server both serve it:
//! `GET /v1/models` (adapters are the entries with a `parent`), `POST /v1/load_lora_adapter`
//! and `POST /v1/unload_lora_adapter`. The pod runs the tenant's image, so its answers are
//! untrusted: each is read up to a bound, and what reaches status is cut short.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};

use crate::build::adapters::{Resident, Wanted};
use ferrite_api::keys::ApiKey;

/// Largest answer read from a pod: a model list of a thousand adapters is well under it.
const MAX_BODY: usize = 1 << 20;
/// Most adapters taken from one model list.
const MAX_LISTED: usize = 4096;
/// Longest runtime message kept for status.
const MAX_MESSAGE: usize = 512;

/// Why a call to a pod failed, in words fit for `status.adapters[].message`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    #[error("{0}")]
    Transport(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("HTTP {0}: {1}")]
    Status(u16, String),
    #[error("the answer is not what the runtime sends: {0}")]
    Malformed(String),
}

/// A reusable client for the pods' adapter APIs.
#[derive(Debug, Clone)]
pub struct PodApi {
    client: Client<HttpConnector, Full<Bytes>>,
    /// For listing and unloading.
    timeout: Duration,
    /// For a load, which may download the adapter first.
    load_timeout: Duration,
}

impl CallError {
    /// Whether the pod refused the API key (or that there was none).
    pub fn unauthorized(&self) -> bool {
        matches!(self, CallError::Status(401 | 403, _))
    }
}

impl PodApi {
    pub fn new(timeout: Duration, load_timeout: Duration) -> Self {
        Self {
            client: ferrite_api::scrape::pod_client(timeout),
            timeout,
            load_timeout,
        }
    }

    /// The adapters the replica at `base` serves, by name, with the path each came from.
    /// `key`: the service's API key, where it has one (for this call and the others).
    pub async fn resident(&self, base: &str, key: Option<&ApiKey>) -> Result<Resident, CallError> {
        let body = self
            .call(
                http::Method::GET,
                base,
                "/v1/models",
                None,
                key,
                self.timeout,
            )
            .await?;
        let list: Value =
            serde_json::from_slice(&body).map_err(|e| CallError::Malformed(e.to_string()))?;
        let data = list
            .get("data")
            .and_then(Value::as_array)
            .ok_or_else(|| CallError::Malformed("no data list".into()))?;
        Ok(data
            .iter()
            .filter(|m| m.get("parent").is_some_and(|p| !p.is_null()))
            .take(MAX_LISTED)
            .filter_map(|m| {
                let id = m.get("id")?.as_str()?;
                let root = m.get("root").and_then(Value::as_str).unwrap_or_default();
                Some((id.to_string(), root.to_string()))
            })
            .collect())
    }

    pub async fn load(
        &self,
        base: &str,
        w: &Wanted,
        key: Option<&ApiKey>,
    ) -> Result<(), CallError> {
        let body = json!({"lora_name": w.name, "lora_path": w.path});
        self.call(
            http::Method::POST,
            base,
            "/v1/load_lora_adapter",
            Some(body),
            key,
            self.load_timeout,
        )
        .await
        .map(drop)
    }

    pub async fn unload(
        &self,
        base: &str,
        name: &str,
        key: Option<&ApiKey>,
    ) -> Result<(), CallError> {
        let body = json!({"lora_name": name});
        self.call(
            http::Method::POST,
            base,
            "/v1/unload_lora_adapter",
            Some(body),
            key,
            self.timeout,
        )
        .await
        .map(drop)
    }

    async fn call(
        &self,
        method: http::Method,
        base: &str,
        path: &str,
        body: Option<Value>,
        key: Option<&ApiKey>,
        timeout: Duration,
    ) -> Result<Bytes, CallError> {
        let url = format!("{}{path}", base.trim_end_matches('/'));
        let mut request = http::Request::builder().method(method).uri(&url);
        if body.is_some() {
            request = request.header(http::header::CONTENT_TYPE, "application/json");
        }
        if let Some(key) = key {
            request = request.header(http::header::AUTHORIZATION, key.header());
        }
        let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let request = request
            .body(Full::new(body))
            .map_err(|e| CallError::Transport(format!("{url}: {e}")))?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| CallError::Transport(format!("{path}: {}", error_chain(&e))))?;
            let status = response.status();
            let bytes = Limited::new(response.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| CallError::Malformed(format!("{path}: {e}")))?
                .to_bytes();
            if status.is_success() {
                Ok(bytes)
            } else {
                Err(CallError::Status(status.as_u16(), message(&bytes)))
            }
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| CallError::Timeout(timeout))?
    }
}

/// The runtime's message in an error answer: OpenAI's `{"error": {"message"}}`, vLLM's older
/// `{"message"}`, or the text itself; cut to [`MAX_MESSAGE`].
fn message(body: &[u8]) -> String {
    let text = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    cut(text.trim())
}

/// At most [`MAX_MESSAGE`] bytes, on a character boundary, without control characters.
fn cut(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars().map(|c| if c.is_control() { ' ' } else { c }) {
        if out.len() + c.len_utf8() > MAX_MESSAGE {
            out.push('…');
            break;
        }
        out.push(c);
    }
    out
}

/// An error and its causes, as one line (hyper's own message is only "client error").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_messages_are_read_in_each_form_and_cut_short() {
        assert_eq!(
            message(br#"{"error": {"message": "rank too large"}}"#),
            "rank too large"
        );
        assert_eq!(
            message(br#"{"object": "error", "message": "no such file"}"#),
            "no such file"
        );
        assert_eq!(message(b"plain\ntext"), "plain text");
        let long = message("é".repeat(1000).as_bytes());
        assert!(long.len() <= MAX_MESSAGE + '…'.len_utf8() && long.ends_with('…'));
    }
}
