//! Gives memory back to the operating system after a burst.
//!
//! Every queue is bounded, so a burst only ever holds tens of MiB; but glibc's malloc keeps
//! freed memory in its per-thread arenas (only the top of each heap is returned on its own),
//! so without help the process would keep its high-water mark. Once traffic has been quiet
//! for a second after a busy period, and again a few seconds later (for what drained late),
//! `malloc_trim(0)` returns the free pages of every arena. It is not called while busy:
//! trimming pages that the next batch faults back in would only cost time. Measured with
//! bench/ingest_memory.py: about 32 MiB held after a flood without it, 10 MiB with it.

use std::sync::Arc;
use std::time::Duration;

use crate::server::Server;

/// Bytes in and out per second above which the server counts as busy.
const BUSY_BYTES_PER_SEC: u64 = 1024 * 1024;
/// Quiet seconds after which to trim (a second pass catches late frees).
const TRIM_AFTER: [u32; 2] = [1, 5];

pub fn spawn(server: Arc<Server>) {
    if cfg!(all(target_os = "linux", target_env = "gnu")) {
        server.clone().spawn(trim_loop(server));
    }
}

fn moved(server: &Server) -> u64 {
    let t = server.totals();
    t.in_bytes + t.out_bytes
}

async fn trim_loop(server: Arc<Server>) {
    let mut shutdown = server.shutdown_rx();
    let mut last = moved(&server);
    let mut quiet = 0u32;
    let mut busy = false;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = crate::client::until_true(&mut shutdown) => return,
        }
        let now = moved(&server);
        let delta = now.saturating_sub(last);
        last = now;
        if delta >= BUSY_BYTES_PER_SEC {
            busy = true;
            quiet = 0;
            continue;
        }
        quiet = quiet.saturating_add(1);
        if busy && TRIM_AFTER.contains(&quiet) {
            if quiet == TRIM_AFTER[TRIM_AFTER.len() - 1] {
                busy = false;
            }
            let log = server.log.clone();
            let _ = tokio::task::spawn_blocking(move || trim(&log)).await;
        }
    }
}

fn trim(log: &crate::log::Log) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let before = crate::monitor::proc::rss_bytes();
        // SAFETY: malloc_trim only releases free memory; it is safe to call at any time.
        unsafe {
            libc::malloc_trim(0);
        }
        let after = crate::monitor::proc::rss_bytes();
        crate::debug!(
            log,
            "Returned {} KiB of freed memory to the OS (RSS {} KiB)",
            before.saturating_sub(after) / 1024,
            after / 1024
        );
    }
}
