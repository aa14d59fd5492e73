//! A JSON body extractor whose every failure is an OpenAI-style 400 (axum's own `Json` answers
//! in plain text and with 415/422), so a malformed body gets the same error shape as any other.

use std::time::Duration;

use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use ferrite_net::BodyError;
use serde::de::DeserializeOwned;

use super::error::ApiError;

/// Largest request body: axum's default, and the router's default `--max-body`.
pub const MAX_BODY: usize = 2 << 20;

/// How long a body may take to arrive (`--body-read-timeout`), as a request extension.
#[derive(Debug, Clone, Copy)]
pub struct BodyTimeout(pub Duration);

impl BodyTimeout {
    /// The timeout `req` carries, else the default.
    pub fn of(req: &Request) -> Duration {
        req.extensions()
            .get::<BodyTimeout>()
            .map_or(ferrite_net::DEFAULT_BODY_READ_TIMEOUT, |t| t.0)
    }
}

#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let timeout = BodyTimeout::of(&req);
        let bytes = ferrite_net::read_body(req.into_body(), MAX_BODY, timeout)
            .await
            .map_err(|e| {
                let (status, why) = match e {
                    BodyError::TooLarge => (
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("the request body is larger than {MAX_BODY} bytes"),
                    ),
                    BodyError::TimedOut => (
                        StatusCode::REQUEST_TIMEOUT,
                        format!("the request body did not arrive within {timeout:?}"),
                    ),
                    BodyError::Broken => (
                        StatusCode::BAD_REQUEST,
                        "the connection failed while the body was read".to_string(),
                    ),
                };
                let mut err =
                    ApiError::bad_request(format!("could not read the request body: {why}"));
                err.status = status;
                err
            })?;
        parse(&bytes).map(JsonBody)
    }
}

/// Parses a body, naming the offending field when there is one.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() || path.is_empty() || path == "." || path == "?" {
            ApiError::bad_request(format!("invalid JSON body: {inner}"))
        } else {
            ApiError::invalid_param(&path, format!("invalid value for `{path}`: {inner}"))
        }
    })?;
    // Bytes after the JSON value: refused, as the router refuses them (two parsers that read
    // one body differently are how request smuggling starts).
    de.end()
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::protocol::CompletionRequest;

    #[test]
    fn malformed_and_mistyped_bodies_are_400_with_a_reason() {
        let e = parse::<CompletionRequest>(b"{not json").expect_err("malformed");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.starts_with("invalid JSON body"), "{}", e.message);

        let e = parse::<CompletionRequest>(br#"{"prompt": "hi", "max_tokens": "many"}"#)
            .expect_err("mistyped");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("max_tokens"), "{}", e.message);

        let e = parse::<CompletionRequest>(br#"{"max_tokens": 3}"#).expect_err("no prompt");
        assert!(e.message.contains("prompt"), "{}", e.message);

        let e = parse::<CompletionRequest>(br#"{"prompt": "hi"} {"prompt": "again"}"#)
            .expect_err("trailing");
        assert!(e.message.contains("trailing"), "{}", e.message);

        let ok = parse::<CompletionRequest>(br#"{"prompt": [1, 2, 3], "temperature": 0} "#)
            .expect("valid");
        assert!(matches!(ok.prompt, crate::api::protocol::Prompt::Tokens(ref t) if t.len() == 3));
    }
}
