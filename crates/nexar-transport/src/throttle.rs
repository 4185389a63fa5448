//! Warnings a peer or a client can cause as often as it likes, kept from flooding the log.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Events of one kind said at warn level before [`WarnThrottle`] turns to summaries.
pub const WARNED_EVENTS: usize = 32;

/// Past [`WARNED_EVENTS`], one event in this many is said at warn level, with the count
/// so far, so that a flood later in a node's life is not silent.
pub const EVENTS_PER_SUMMARY: usize = 1024;

/// Counts events of one kind (a rejected handshake, a refused stream), clones counting
/// together, and says which to log at warn level: the first [`WARNED_EVENTS`], then one
/// in [`EVENTS_PER_SUMMARY`]; the others belong at debug level. Whoever can cause such an
/// event at will (anyone who reaches a listener, a misbehaving peer) would otherwise
/// flood the log.
#[derive(Debug, Clone, Default)]
pub struct WarnThrottle(Arc<AtomicUsize>);

impl WarnThrottle {
    /// Counts one more event: `Some(count so far)` when it is to be said at warn level.
    ///
    /// ```
    /// let throttle = nexar_transport::WarnThrottle::default();
    /// let warned = (0..2048).filter(|_| throttle.count().is_some()).count();
    /// assert_eq!(warned, nexar_transport::WARNED_EVENTS + 2);
    /// ```
    pub fn count(&self) -> Option<usize> {
        let n = self.0.fetch_add(1, Ordering::Relaxed);
        (n < WARNED_EVENTS || (n + 1) % EVENTS_PER_SUMMARY == 0).then_some(n + 1)
    }

    /// How many events were counted so far.
    pub fn counted(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}
