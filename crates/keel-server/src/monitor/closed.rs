//! Recently closed connections for `/connz?state=closed|all`: a bounded ring, as the
//! reference keeps (`max_closed_clients`, default 10,000), each entry a snapshot of the
//! connection taken as it closed, with the reference's stop time and reason text.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use super::endpoints::ConnRow;
use crate::client::{ClientHandle, CloseReason};
use crate::time::now_nanos;

/// At most this many of a closed connection's subscriptions are kept for `subs=1` (the count
/// stays exact), so one connection with a huge interest set cannot pin its memory.
const SUBS_KEPT: usize = 64;
/// Slow-consumer closes kept apart for the dashboard.
pub const SLOW_KEPT: usize = 20;

/// One closed connection.
pub(crate) struct Closed {
    pub row: ConnRow,
    /// Unix nanoseconds.
    pub stop: i64,
    pub reason: &'static str,
}

/// The ring of recently closed connections, oldest first.
pub struct ClosedConns {
    max: usize,
    ring: Mutex<VecDeque<Arc<Closed>>>,
    /// The newest slow-consumer closes (the dashboard lists them without scanning the ring).
    slow: Mutex<VecDeque<Arc<Closed>>>,
    /// Connections closed since start.
    total: std::sync::atomic::AtomicU64,
}

/// The reference's text for why a connection closed (its `ClosedState` strings).
pub fn reason_text(r: Option<CloseReason>) -> &'static str {
    match r {
        Some(CloseReason::ClientClosed) | None => "Client Closed",
        Some(CloseReason::ProtocolError) => "Protocol Violation",
        Some(CloseReason::SlowConsumerPendingBytes) => "Slow Consumer (Pending Bytes)",
        Some(CloseReason::SlowConsumerWriteDeadline) => "Slow Consumer (Write Deadline)",
        Some(CloseReason::StaleConnection) => "Stale Connection",
        Some(CloseReason::ServerShutdown) => "Server Shutdown",
        Some(CloseReason::MaxConnections) => "Maximum Connections Exceeded",
        Some(CloseReason::WriteError) => "Write Error",
        Some(CloseReason::ReadError) => "Read Error",
        Some(CloseReason::TlsHandshakeError) => "TLS Handshake Failure",
        Some(CloseReason::AuthenticationFailure) => "Authentication Failure",
        Some(CloseReason::AuthenticationTimeout) => "Authentication Timeout",
        Some(CloseReason::AuthenticationExpired) => "Authentication Expired",
        Some(CloseReason::MaxAccountConnections) => "Maximum Account Connections Exceeded",
        Some(CloseReason::MaxPayload) => "Maximum Message Payload Exceeded",
    }
}

impl ClosedConns {
    pub fn new(max: usize) -> ClosedConns {
        ClosedConns {
            max,
            ring: Mutex::new(VecDeque::new()),
            slow: Mutex::new(VecDeque::new()),
            total: Default::default(),
        }
    }

    /// Records `h` as closed now, with the reason it was first closed for. Called once per
    /// connection, before its subscriptions are removed.
    pub fn record(&self, h: &Arc<ClientHandle>) {
        self.total
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.max == 0 {
            return;
        }
        let mut row = ConnRow::of(h, true);
        row.subs.truncate(SUBS_KEPT);
        let entry = Arc::new(Closed {
            row,
            stop: now_nanos(),
            reason: reason_text(h.close_reason()),
        });
        if entry.reason.starts_with("Slow Consumer") {
            let mut slow = self.slow.lock().unwrap_or_else(|e| e.into_inner());
            if slow.len() >= SLOW_KEPT {
                slow.pop_front();
            }
            slow.push_back(entry.clone());
        }
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() >= self.max {
            ring.pop_front();
        }
        ring.push_back(entry);
    }

    /// The entries now, oldest first.
    pub(crate) fn list(&self) -> Vec<Arc<Closed>> {
        self.ring
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// The newest slow-consumer closes (at most [`SLOW_KEPT`]), newest first.
    pub(crate) fn newest_slow(&self) -> Vec<Arc<Closed>> {
        self.slow
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .rev()
            .cloned()
            .collect()
    }

    /// Connections closed since start (including any the ring no longer holds).
    pub fn total(&self) -> u64 {
        self.total.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_is_bounded_and_keeps_the_newest() {
        let ring = ClosedConns::new(3);
        for id in 1..=5 {
            let h = ClientHandle::detached(id);
            h.close(CloseReason::SlowConsumerPendingBytes);
            h.close(CloseReason::WriteError);
            ring.record(&h);
        }
        let cids: Vec<u64> = ring.list().iter().map(|c| c.row.cid).collect();
        assert_eq!(cids, [3, 4, 5]);
        // The first reason wins over the read loop's later one.
        assert!(ring
            .list()
            .iter()
            .all(|c| c.reason == "Slow Consumer (Pending Bytes)"));
        assert_eq!(ring.total(), 5);
        assert_eq!(ring.newest_slow()[0].row.cid, 5);
        assert_eq!(ring.newest_slow().len(), 5);
        let none = ClosedConns::new(0);
        none.record(&ClientHandle::detached(9));
        assert!(none.list().is_empty());
    }
}
