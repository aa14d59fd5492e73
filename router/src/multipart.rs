//! `multipart/form-data` requests (`/v1/audio/transcriptions`, `/v1/audio/translations`): the
//! `model` is a form field, and the file after it may be tens of megabytes. The router reads
//! only the body's head, up to the `model` field (at most [`HEAD_LIMIT`] bytes, and no file part
//! before it, as the `openai` SDK and `curl -F model=… -F file=@…` send it), and streams the
//! rest to the replica as it arrives, never holding the file.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// The most of a body read before its `model` field must have come.
pub const HEAD_LIMIT: usize = 64 << 10;
/// The longest `model` value taken.
const MAX_MODEL: usize = 256;

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Option<String> {
    let mut parts = content_type.split(';');
    if !parts
        .next()?
        .trim()
        .eq_ignore_ascii_case("multipart/form-data")
    {
        return None;
    }
    parts.find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        if !k.trim().eq_ignore_ascii_case("boundary") {
            return None;
        }
        let v = v.trim().trim_matches('"');
        (!v.is_empty() && v.len() <= 70).then(|| v.to_string())
    })
}

/// What a body's head says of its `model` field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// The field's value.
    Model(String),
    /// Not yet seen: read more.
    More,
    /// Not there before a file part (or the form ended), or not a readable name.
    Missing(&'static str),
}

/// Looks for the `model` field in `head`, the first bytes of a form delimited by `boundary`.
pub fn find_model(head: &[u8], boundary: &str) -> Head {
    let delimiter = format!("--{boundary}");
    let d = delimiter.as_bytes();
    let Some(mut at) = find(head, d, 0) else {
        return more_or(head, "the body is not the form its Content-Type names");
    };
    loop {
        let after = at + d.len();
        if head.len() < after + 2 {
            return Head::More;
        }
        if &head[after..after + 2] == b"--" {
            return Head::Missing("the form has no `model` field");
        }
        // The part's headers end at a blank line.
        let Some(end) = find(head, b"\r\n\r\n", after) else {
            return more_or(head, "a form part's headers are too long");
        };
        let headers = String::from_utf8_lossy(&head[after..end]).to_ascii_lowercase();
        let disposition = headers
            .lines()
            .find(|l| l.trim_start().starts_with("content-disposition:"))
            .unwrap_or_default();
        let value_start = end + 4;
        if disposition.contains("name=\"model\"") {
            let closing = [b"\r\n".as_slice(), d].concat();
            return match find(head, &closing, value_start) {
                Some(e) if e - value_start <= MAX_MODEL => {
                    match std::str::from_utf8(&head[value_start..e]) {
                        Ok(m) if !m.trim().is_empty() => Head::Model(m.trim().to_string()),
                        _ => Head::Missing("the `model` field is not a name"),
                    }
                }
                Some(_) => Head::Missing("the `model` field is too long"),
                None if head.len() - value_start > MAX_MODEL => {
                    Head::Missing("the `model` field is too long")
                }
                None => Head::More,
            };
        }
        if disposition.contains("filename=") {
            return Head::Missing("the `model` field must come before the file");
        }
        // Another small field (language, prompt, ...): on to the next part.
        let closing = [b"\r\n".as_slice(), d].concat();
        match find(head, &closing, value_start) {
            Some(e) => at = e + 2,
            None => return more_or(head, "the `model` field must come first"),
        }
    }
}

/// [`Head::More`] while the head may still grow, else `Missing(why)`.
fn more_or(head: &[u8], why: &'static str) -> Head {
    if head.len() >= HEAD_LIMIT {
        Head::Missing(why)
    } else {
        Head::More
    }
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// Why an upload's body stopped.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("the request body is larger than {0} bytes")]
    TooLarge(usize),
    #[error("the request body did not arrive in time")]
    TimedOut,
    #[error("reading the request body: {0}")]
    Broken(String),
}

/// A form's body on its way to the replica: the head already read, then the rest as it
/// arrives, within `limit` bytes in all and until `deadline`.
pub struct Upload {
    head: Option<Bytes>,
    rest: axum::body::Body,
    sent: usize,
    limit: usize,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl Upload {
    pub fn new(head: Bytes, rest: axum::body::Body, limit: usize, timeout: Duration) -> Upload {
        Upload {
            head: (!head.is_empty()).then_some(head),
            rest,
            sent: 0,
            limit,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

impl std::fmt::Debug for Upload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upload")
            .field("sent", &self.sent)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl Body for Upload {
    type Data = Bytes;
    type Error = UploadError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UploadError>>> {
        let this = &mut *self;
        if let Some(head) = this.head.take() {
            this.sent += head.len();
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(UploadError::TimedOut)));
        }
        match Pin::new(&mut this.rest).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.sent += data.len();
                    if this.sent > this.limit {
                        return Poll::Ready(Some(Err(UploadError::TooLarge(this.limit))));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(UploadError::Broken(e.to_string())))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self.rest.size_hint();
        let head = self.head.as_ref().map_or(0, |h| h.len() as u64);
        let mut hint = SizeHint::new();
        // The upper bound first: a lower one above it is refused.
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + head);
        }
        hint.set_lower(rest.lower() + head);
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(parts: &[(&str, Option<&str>, &str)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, file, value) in parts {
            out.extend_from_slice(b"--XyZ\r\n");
            match file {
                Some(f) => out.extend_from_slice(
                    format!(
                        "Content-Disposition: form-data; name=\"{name}\"; filename=\"{f}\"\r\n\
                         Content-Type: audio/wav\r\n\r\n"
                    )
                    .as_bytes(),
                ),
                None => out.extend_from_slice(
                    format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
                ),
            }
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"--XyZ--\r\n");
        out
    }

    /// Reads an upload whole, or to its error.
    async fn drain(mut u: Upload) -> Result<Vec<u8>, UploadError> {
        use http_body_util::BodyExt;
        let mut out = Vec::new();
        while let Some(frame) = u.frame().await {
            if let Ok(data) = frame?.into_data() {
                out.extend_from_slice(&data);
            }
        }
        Ok(out)
    }

    #[tokio::test]
    async fn an_upload_streams_its_head_then_the_rest_within_the_limit() {
        let file: Vec<u8> = (0..(5u32 << 20)).map(|i| i as u8).collect();
        let chunks: Vec<Result<Bytes, std::io::Error>> = file
            .chunks(64 << 10)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let rest = axum::body::Body::from_stream(futures::stream::iter(chunks));
        let head = Bytes::from_static(b"--b\r\n...model...");
        let up = Upload::new(head.clone(), rest, 6 << 20, Duration::from_secs(10));
        let out = drain(up).await.expect("whole");
        assert_eq!(&out[..head.len()], &head[..]);
        assert!(out[head.len()..] == file[..], "every byte, in order");
        // Past the limit, the upload stops with an error (the replica sees a cut body).
        let rest = axum::body::Body::from(file.clone());
        let up = Upload::new(head.clone(), rest, 1 << 20, Duration::from_secs(10));
        assert!(matches!(drain(up).await, Err(UploadError::TooLarge(_))));
        // A body that stalls past the deadline stops too.
        let stalled = axum::body::Body::from_stream(futures::stream::pending::<
            Result<Bytes, std::io::Error>,
        >());
        let up = Upload::new(head, stalled, 1 << 20, Duration::from_millis(50));
        assert!(matches!(drain(up).await, Err(UploadError::TimedOut)));
    }

    #[test]
    fn the_boundary_is_read_from_the_content_type() {
        assert_eq!(
            boundary("multipart/form-data; boundary=XyZ").as_deref(),
            Some("XyZ")
        );
        assert_eq!(
            boundary("Multipart/Form-Data; charset=utf-8; boundary=\"a b\"").as_deref(),
            Some("a b")
        );
        assert_eq!(boundary("application/json"), None);
        assert_eq!(boundary("multipart/form-data"), None);
    }

    #[test]
    fn the_model_is_found_before_the_file_and_nowhere_else() {
        let body = form(&[
            ("language", None, "en"),
            ("model", None, "whisper"),
            ("file", Some("a.wav"), "RIFF...."),
        ]);
        assert_eq!(find_model(&body, "XyZ"), Head::Model("whisper".into()));
        // Any prefix either finds it or asks for more; never a wrong answer.
        let at = body
            .windows(7)
            .position(|w| w == b"whisper")
            .expect("value")
            + 7;
        for n in 0..at + 2 {
            assert_eq!(find_model(&body[..n], "XyZ"), Head::More, "prefix of {n}");
        }
        let late = form(&[("file", Some("a.wav"), "RIFF"), ("model", None, "whisper")]);
        assert!(
            matches!(find_model(&late, "XyZ"), Head::Missing(m) if m.contains("before the file"))
        );
        let none = form(&[("language", None, "en")]);
        assert!(matches!(find_model(&none, "XyZ"), Head::Missing(_)));
        let long = form(&[("model", None, &"m".repeat(MAX_MODEL + 1))]);
        assert!(matches!(find_model(&long, "XyZ"), Head::Missing(m) if m.contains("too long")));
        // A head that never shows the field is refused at the limit.
        let junk = vec![b'x'; HEAD_LIMIT];
        assert!(matches!(find_model(&junk, "XyZ"), Head::Missing(_)));
    }
}
