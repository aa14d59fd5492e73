//! A JSON body extractor whose every failure is an OpenAI-style 400 (axum's own `Json` answers
//! in plain text and with 415/422), so a malformed body gets the same error shape as any other.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use super::error::ApiError;

#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            let mut err = ApiError::bad_request(format!("could not read the request body: {e}"));
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                err.status = StatusCode::PAYLOAD_TOO_LARGE;
            }
            err
        })?;
        parse(&bytes).map(JsonBody)
    }
}

/// Parses a body, naming the offending field when there is one.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() || path.is_empty() || path == "." || path == "?" {
            ApiError::bad_request(format!("invalid JSON body: {inner}"))
        } else {
            ApiError::invalid_param(&path, format!("invalid value for `{path}`: {inner}"))
        }
    })
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

        let ok = parse::<CompletionRequest>(br#"{"prompt": [1, 2, 3], "temperature": 0}"#)
            .expect("valid");
        assert!(matches!(ok.prompt, crate::api::protocol::Prompt::Tokens(ref t) if t.len() == 3));
    }
}
