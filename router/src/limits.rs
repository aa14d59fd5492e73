//! What the router may hold at once, so that no client can grow its memory without bound:
//! requests open (until their response ends), request bytes in memory (reserved before a body
//! is read, from its `Content-Length` or the body limit), and requests held while a service
//! scales from zero, per service and in all. Over a limit a request is refused at once with
//! 503 and `Retry-After` (413 for a body over the limit), as Envoy's overload manager does,
//! instead of queueing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The limits, from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitConfig {
    /// Largest request body, bytes.
    pub max_body: usize,
    /// Largest `multipart/form-data` body (an audio file), bytes: streamed to the replica, not
    /// held, so only its head counts against `max_buffered_bytes`.
    pub max_upload: usize,
    /// Request bodies held in memory at once, bytes.
    pub max_buffered_bytes: usize,
    /// Requests open at once, from arrival until their response ends.
    pub max_in_flight: usize,
    /// Requests held for services scaling from zero, in all.
    pub max_held: usize,
    /// Requests held for one service.
    pub max_held_per_service: usize,
}

impl Default for LimitConfig {
    fn default() -> Self {
        LimitConfig {
            max_body: 2 << 20,
            // OpenAI's limit for audio files.
            max_upload: 25 << 20,
            max_buffered_bytes: 128 << 20,
            max_in_flight: 2048,
            max_held: 1024,
            max_held_per_service: 256,
        }
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The body is over `max_body` (413).
    BodyTooLarge,
    /// Too many requests open, or too many bytes buffered (503).
    Busy,
    /// Too many requests held for this service, or in all (503).
    HoldFull,
}

/// Byte reservations are counted in KiB: a semaphore's permits are a `u32`.
const UNIT: usize = 1024;

/// The shared counters.
#[derive(Debug)]
pub struct Limits {
    pub config: LimitConfig,
    in_flight: Arc<Semaphore>,
    buffered: Arc<Semaphore>,
    held: Arc<Mutex<Held>>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    by_service: HashMap<String, usize>,
}

/// An admitted request: its open-request slot, and its body's reservation (dropped once the
/// body is no longer needed).
#[derive(Debug)]
pub struct Admission {
    pub open: OwnedSemaphorePermit,
    pub body: Option<OwnedSemaphorePermit>,
}

/// One held request's place; gives it back when dropped.
#[derive(Debug)]
pub struct HeldSlot {
    held: Arc<Mutex<Held>>,
    service: String,
}

impl Drop for HeldSlot {
    fn drop(&mut self) {
        if let Ok(mut h) = self.held.lock() {
            h.total = h.total.saturating_sub(1);
            if let Some(n) = h.by_service.get_mut(&self.service) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    h.by_service.remove(&self.service);
                }
            }
        }
    }
}

impl Limits {
    pub fn new(config: LimitConfig) -> Self {
        let units = config.max_buffered_bytes.div_ceil(UNIT).max(1);
        Limits {
            config,
            in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
            buffered: Arc::new(Semaphore::new(units.min(Semaphore::MAX_PERMITS))),
            held: Arc::default(),
        }
    }

    /// Admits a request whose body announces `content_length` bytes (`None`: chunked, so the
    /// limit is reserved).
    pub fn admit(&self, content_length: Option<u64>) -> Result<Admission, Refusal> {
        let max = self.config.max_body as u64;
        if content_length.is_some_and(|n| n > max) {
            return Err(Refusal::BodyTooLarge);
        }
        self.reserve(content_length.unwrap_or(max).min(max) as usize)
    }

    /// An open-request slot and a reservation of `bytes` of body memory.
    fn reserve(&self, bytes: usize) -> Result<Admission, Refusal> {
        let open = self
            .in_flight
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refusal::Busy)?;
        let units = u32::try_from(bytes.div_ceil(UNIT).max(1)).unwrap_or(u32::MAX);
        let body = self
            .buffered
            .clone()
            .try_acquire_many_owned(units)
            .map_err(|_| Refusal::Busy)?;
        Ok(Admission {
            open,
            body: Some(body),
        })
    }

    /// Admits an upload whose body announces `content_length` bytes: its open-request slot,
    /// and a reservation for the `head` bytes read before it is streamed on.
    pub fn admit_upload(
        &self,
        content_length: Option<u64>,
        head: usize,
    ) -> Result<Admission, Refusal> {
        if content_length.is_some_and(|n| n > self.config.max_upload as u64) {
            return Err(Refusal::BodyTooLarge);
        }
        self.reserve(head)
    }

    /// A place to wait for `service` (`namespace/name`) to become ready.
    pub fn hold(&self, service: &str) -> Result<HeldSlot, Refusal> {
        let mut h = self.held.lock().map_err(|_| Refusal::HoldFull)?;
        let mine = h.by_service.get(service).copied().unwrap_or(0);
        if h.total >= self.config.max_held || mine >= self.config.max_held_per_service {
            return Err(Refusal::HoldFull);
        }
        h.total += 1;
        *h.by_service.entry(service.to_string()).or_default() += 1;
        Ok(HeldSlot {
            held: self.held.clone(),
            service: service.to_string(),
        })
    }

    /// Requests held now, in all.
    pub fn held(&self) -> usize {
        self.held.lock().map(|h| h.total).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits::new(LimitConfig {
            max_body: 10 * UNIT,
            max_upload: 100 * UNIT,
            max_buffered_bytes: 25 * UNIT,
            max_in_flight: 4,
            max_held: 3,
            max_held_per_service: 2,
        })
    }

    #[test]
    fn bodies_over_the_limit_are_refused_before_anything_is_reserved() {
        let l = limits();
        assert_eq!(
            l.admit(Some(10 * UNIT as u64 + 1)).err(),
            Some(Refusal::BodyTooLarge)
        );
        assert!(l.admit(Some(10 * UNIT as u64)).is_ok());
    }

    #[test]
    fn buffered_bytes_are_bounded_and_given_back() {
        let l = limits();
        let a = l.admit(Some(10 * UNIT as u64)).expect("first");
        let b = l.admit(None).expect("chunked reserves the limit");
        // 20 of 25 KiB reserved: a 6 KiB body does not fit, a 5 KiB one does.
        assert_eq!(l.admit(Some(6 * UNIT as u64)).err(), Some(Refusal::Busy));
        let mut c = l.admit(Some(5 * UNIT as u64)).expect("fits");
        c.body = None; // its body was read and sent: the bytes are free again
        drop(a);
        assert!(l.admit(Some(10 * UNIT as u64)).is_ok());
        drop(b);
    }

    #[test]
    fn open_requests_are_bounded_until_their_response_ends() {
        let l = limits();
        let mut open: Vec<Admission> = (0..4)
            .map(|_| {
                let mut a = l.admit(Some(1)).expect("admitted");
                a.body = None;
                a
            })
            .collect();
        assert_eq!(l.admit(Some(1)).err(), Some(Refusal::Busy));
        open.pop();
        assert!(l.admit(Some(1)).is_ok());
    }

    #[test]
    fn held_requests_are_capped_per_service_and_in_all() {
        let l = limits();
        let a1 = l.hold("ns/a").expect("a1");
        let _a2 = l.hold("ns/a").expect("a2");
        assert_eq!(l.hold("ns/a").err(), Some(Refusal::HoldFull));
        let _b1 = l.hold("ns/b").expect("b1");
        assert_eq!(
            l.hold("ns/c").err(),
            Some(Refusal::HoldFull),
            "3 held in all"
        );
        drop(a1);
        assert_eq!(l.held(), 2);
        assert!(l.hold("ns/c").is_ok());
    }
}
