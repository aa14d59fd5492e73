//! Serving HTTP so that no client can exhaust the listener (the slowloris class): at most
//! `max_connections` open at once (past that the listener stops accepting, and the kernel's
//! backlog holds the rest), a request's head must arrive within `header_read_timeout`, and a
//! kept-alive connection that sends nothing for that long is closed (hyper arms the same timer
//! while it waits for the next head). `axum::serve` sets neither: without a timer hyper has no
//! header timeout at all, so a client sending a header a byte a minute held its connection
//! and task forever. The server and the router serve through this; body read timeouts are
//! each service's own ([`read_body`]).

pub mod tls;

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tower::ServiceExt;

/// What one listener allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Time for a request's head to arrive, and the most a kept-alive connection may idle.
    pub header_read_timeout: Duration,
    /// Whether to set TCP_NODELAY (small stream events must not wait for an ACK).
    pub nodelay: bool,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        ListenerLimits {
            max_connections: 4096,
            header_read_timeout: Duration::from_secs(30),
            nodelay: true,
        }
    }
}

/// Time for a request's whole body to arrive by default ([`read_body`]).
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Serves `app` on `listener` within `limits` until `shutdown` completes; then open
/// connections finish their requests (streams included) and close, for at most `drain`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
) -> std::io::Result<()> {
    serve_with(listener, app, limits, None, shutdown, drain).await
}

/// [`serve`] over TLS with `config` (e.g. a [`tls::ServingCert`]'s): the handshake must end
/// within the header read timeout, and counts against the connection limit like the rest.
pub async fn serve_tls(
    listener: TcpListener,
    app: Router,
    limits: ListenerLimits,
    config: Arc<tokio_rustls::rustls::ServerConfig>,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
) -> std::io::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    serve_with(listener, app, limits, Some(acceptor), shutdown, drain).await
}

async fn serve_with(
    listener: TcpListener,
    app: Router,
    limits: ListenerLimits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        // A slot first: at the limit, stop accepting rather than accept and drop.
        let slot = tokio::select! {
            () = &mut shutdown => break,
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
        };
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accepting a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if limits.nodelay
            && let Err(e) = stream.set_nodelay(true)
        {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
        let app = app.clone();
        let stop = stop_rx.clone();
        let header_timeout = limits.header_read_timeout;
        let tls = tls.clone();
        connections.spawn(async move {
            let _slot = slot;
            match tls {
                None => connection(stream, app, header_timeout, stop, peer).await,
                Some(acceptor) => {
                    match tokio::time::timeout(header_timeout, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            connection(stream, app, header_timeout, stop, peer).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
            }
        });
        // Reap finished connections as we go, so the set does not grow.
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(drain, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            open = connections.len(),
            "connections still open after the drain; closing them"
        );
        connections.abort_all();
    }
    Ok(())
}

/// Serves one connection until it ends, or until `stop` (then its requests finish).
async fn connection<I>(
    io: I,
    app: Router,
    header_timeout: Duration,
    mut stop: watch::Receiver<bool>,
    peer: std::net::SocketAddr,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        app.clone().oneshot(req.map(axum::body::Body::new))
    });
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true);
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    let mut conn = pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(%peer, error = %e, "connection ended");
            }
            return;
        }
        _ = stop.wait_for(|&s| s) => conn.as_mut().graceful_shutdown(),
    }
    if let Err(e) = conn.await {
        tracing::debug!(%peer, error = %e, "connection ended while draining");
    }
}

/// Why a body could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyError {
    /// More than the limit.
    TooLarge,
    /// Not all of it arrived within the body read timeout.
    TimedOut,
    /// The connection failed mid-body.
    Broken,
}

/// Reads a whole body of at most `limit` bytes within `timeout`: a client that sends a body a
/// byte at a time does not hold its request (and its memory) open forever. A body whose
/// announced length (`Content-Length`) is over the limit is refused before any of it is read.
pub async fn read_body(
    body: axum::body::Body,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, BodyError> {
    if http_body::Body::size_hint(&body).lower() > limit as u64 {
        return Err(BodyError::TooLarge);
    }
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(BodyError::TimedOut),
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            Err(if too_large {
                BodyError::TooLarge
            } else {
                BodyError::Broken
            })
        }
    }
}

/// Refused bodies drained at once, at most: past them a refused body is dropped, which closes
/// its connection.
const MAX_DRAINS: usize = 64;
static DRAINS: Semaphore = Semaphore::const_new(MAX_DRAINS);

/// Reads and discards `body`, refused from its request's head (a 503 while the server is
/// full), up to `limit` bytes or for `timeout`, so that a client still writing it reads the
/// refusal instead of a broken pipe: the response goes out at once, the connection stays to
/// take the rest. Nothing is kept; at most [`MAX_DRAINS`] at once.
pub fn discard_body(body: axum::body::Body, limit: usize, timeout: Duration) {
    let Ok(permit) = DRAINS.try_acquire() else {
        return;
    };
    tokio::spawn(async move {
        let _permit = permit;
        let drain = async move {
            let mut body = body;
            let mut seen = 0usize;
            while let Some(Ok(frame)) = http_body_util::BodyExt::frame(&mut body).await {
                seen += frame.data_ref().map_or(0, |d| d.len());
                if seen > limit {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(timeout, drain).await;
    });
}

/// The token of an `Authorization: Bearer <token>` header, as sent (`None` without one).
pub fn bearer(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
}

/// Compares without an early exit, so response timing does not leak how much of a key matched.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, &x) in a.iter().enumerate() {
        diff |= (x ^ b.get(i).copied().unwrap_or(0)) as usize;
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"secret"));
    }

    #[test]
    fn the_bearer_token_is_read_as_sent() {
        let mut h = axum::http::HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert("authorization", "Bearer sk-1 ".parse().expect("header"));
        assert_eq!(bearer(&h), Some("sk-1 "));
        h.insert("authorization", "Basic abc".parse().expect("header"));
        assert_eq!(bearer(&h), None);
    }
    use axum::routing::get;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn start(limits: ListenerLimits) -> (std::net::SocketAddr, watch::Sender<bool>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = Router::new().route("/", get(|| async { "ok" }));
        let (tx, mut rx) = watch::channel(false);
        tokio::spawn(async move {
            let stop = async move {
                let _ = rx.wait_for(|&s| s).await;
            };
            serve(listener, app, limits, stop, Duration::from_secs(1)).await
        });
        (addr, tx)
    }

    /// Reads until the peer closes (or `within` passes); whether it closed.
    async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 256];
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
                Err(_) => return false,
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => {}
            }
        }
    }

    async fn get_ok(addr: std::net::SocketAddr) -> bool {
        let Ok(mut s) = TcpStream::connect(addr).await else {
            return false;
        };
        let req = b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
        if s.write_all(req).await.is_err() {
            return false;
        }
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        out.starts_with(b"HTTP/1.1 200")
    }

    fn limits(max_connections: usize) -> ListenerLimits {
        ListenerLimits {
            max_connections,
            header_read_timeout: Duration::from_millis(400),
            nodelay: true,
        }
    }

    #[tokio::test]
    async fn a_head_sent_a_byte_at_a_time_is_cut_off() {
        let (addr, _stop) = start(limits(8)).await;
        let mut slow = TcpStream::connect(addr).await.expect("connect");
        slow.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n")
            .await
            .expect("write");
        let started = Instant::now();
        for _ in 0..20 {
            // Keeps trickling, as slowloris does: the timeout is on the whole head.
            tokio::time::sleep(Duration::from_millis(50)).await;
            if slow.write_all(b"x-a: b\r\n").await.is_err() {
                break;
            }
        }
        assert!(closed_within(&mut slow, Duration::from_secs(3)).await);
        assert!(started.elapsed() < Duration::from_secs(3));
        assert!(get_ok(addr).await);
    }

    #[tokio::test]
    async fn an_idle_kept_alive_connection_is_closed() {
        let (addr, _stop) = start(limits(8)).await;
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 128];
        let n = s.read(&mut buf).await.expect("response");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        // Kept alive, then silent: closed after the header timeout.
        assert!(closed_within(&mut s, Duration::from_secs(3)).await);
    }

    #[tokio::test]
    async fn past_the_connection_limit_new_clients_wait_for_a_slot() {
        let (addr, _stop) = start(limits(2)).await;
        let mut hogs = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(addr).await.expect("connect");
            s.write_all(b"GET / HT").await.expect("write");
            hogs.push(s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Both slots are taken: a request waits until the header timeout frees one.
        let started = Instant::now();
        assert!(get_ok(addr).await);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(200),
            "served in {waited:?} with every slot taken"
        );
    }

    #[tokio::test]
    async fn a_body_that_trickles_times_out_and_one_too_large_is_refused() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
        let stream = tokio_stream_from(rx);
        tx.send(Ok(Bytes::from_static(b"{\"a\":")))
            .await
            .expect("send");
        let body = axum::body::Body::from_stream(stream);
        let r = read_body(body, 1024, Duration::from_millis(200)).await;
        assert_eq!(r.err(), Some(BodyError::TimedOut));
        drop(tx);

        // Announced over the limit: refused before reading.
        let body = axum::body::Body::from(vec![b'x'; 2048]);
        let r = read_body(body, 1024, Duration::from_secs(1)).await;
        assert_eq!(r.err(), Some(BodyError::TooLarge));
        // Unannounced (chunked): refused once the limit is passed while reading.
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
        for _ in 0..3 {
            tx.send(Ok(Bytes::from(vec![b'x'; 512])))
                .await
                .expect("send");
        }
        drop(tx);
        let body = axum::body::Body::from_stream(tokio_stream_from(rx));
        let r = read_body(body, 1024, Duration::from_secs(1)).await;
        assert_eq!(r.err(), Some(BodyError::TooLarge));
        let body = axum::body::Body::from(vec![b'x'; 1024]);
        let r = read_body(body, 1024, Duration::from_secs(1)).await;
        assert_eq!(r.map(|b| b.len()).ok(), Some(1024));
    }

    /// A stream over a channel's receiver.
    fn tokio_stream_from<T: Send + 'static>(
        mut rx: tokio::sync::mpsc::Receiver<T>,
    ) -> impl futures_util::Stream<Item = T> + Send + 'static {
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }
}
