//! Logging in the reference's line format (`[pid] date time [INF] text`).
//!
//! A [`Log`] is a per-server handle, not a process global: the binary makes one for its
//! server, and an in-process test makes one per server, so two servers in one process never
//! write into each other's log. Every log macro takes the handle first
//! (`info!(server.log, "...")`); the server hands clones to what it starts (connections,
//! in-process queues, JetStream), a clone being one `Arc`.
//!
//! The binary's log is a dedicated thread behind a bounded queue: a launcher that stops
//! reading our stderr must never block the server, so when the queue is full lines are
//! dropped and counted instead.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Level {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

impl Level {
    fn tag(self) -> &'static str {
        match self {
            Level::Trace => "TRC",
            Level::Debug => "DBG",
            Level::Info => "INF",
            Level::Warn => "WRN",
            Level::Error => "ERR",
        }
    }
}

/// Which levels are written and whether lines carry the time (the `debug`, `trace` and
/// `logtime` options).
#[derive(Clone, Copy, Debug, Default)]
pub struct LogOpts {
    pub debug: bool,
    pub trace: bool,
    pub logtime: bool,
    /// `max_traced_msg_len` (0: whole payloads).
    pub max_traced: usize,
}

/// A server's log. Cheap to clone; every clone writes to the same place.
#[derive(Clone)]
pub struct Log {
    inner: Arc<Inner>,
}

struct Inner {
    /// The options, each changeable by a config reload (SIGHUP).
    debug: AtomicBool,
    trace: AtomicBool,
    logtime: AtomicBool,
    max_traced: AtomicUsize,
    sink: Sink,
    dropped: AtomicU64,
}

enum Sink {
    /// The log thread's queue.
    Thread(SyncSender<Msg>),
    /// Lines kept in memory (in-process servers in tests), at most [`CAPTURE_MAX`] bytes.
    Memory(Mutex<String>),
    /// Written at once to stderr: unit tests and tools without a configured log.
    Stderr,
}

enum Msg {
    Line(String),
    Flush(SyncSender<()>),
    /// Write to this file from now on (log rotation: `--signal reopen`, SIGUSR1).
    Reopen(std::fs::File),
}

/// What a captured log keeps: the newest lines, about this many bytes.
const CAPTURE_MAX: usize = 4 * 1024 * 1024;

impl Log {
    /// Starts a log thread writing to `file` (None: stderr).
    pub fn start(opts: LogOpts, file: Option<std::fs::File>) -> Log {
        let (tx, rx) = sync_channel::<Msg>(4096);
        std::thread::Builder::new()
            .name("keel-log".into())
            .spawn(move || writer(rx, file))
            .expect("spawn log thread");
        Log::with_sink(opts, Sink::Thread(tx))
    }

    /// A log kept in memory, read back with [`captured`](Self::captured).
    pub fn capture(opts: LogOpts) -> Log {
        Log::with_sink(opts, Sink::Memory(Mutex::new(String::new())))
    }

    /// Info and above straight to stderr.
    pub fn stderr() -> Log {
        Log::with_sink(LogOpts::default(), Sink::Stderr)
    }

    fn with_sink(opts: LogOpts, sink: Sink) -> Log {
        Log {
            inner: Arc::new(Inner {
                debug: AtomicBool::new(opts.debug),
                trace: AtomicBool::new(opts.trace),
                logtime: AtomicBool::new(opts.logtime),
                max_traced: AtomicUsize::new(opts.max_traced),
                sink,
                dropped: AtomicU64::new(0),
            }),
        }
    }

    /// How much of a payload a trace shows (`max_traced_msg_len`; 0: all of it).
    pub fn max_traced(&self) -> usize {
        self.inner.max_traced.load(Ordering::Relaxed)
    }

    pub fn enabled(&self, level: Level) -> bool {
        match level {
            Level::Trace => self.inner.trace.load(Ordering::Relaxed),
            Level::Debug => self.inner.debug.load(Ordering::Relaxed),
            _ => true,
        }
    }

    /// The options now in force.
    pub fn opts(&self) -> LogOpts {
        let i = &self.inner;
        LogOpts {
            debug: i.debug.load(Ordering::Relaxed),
            trace: i.trace.load(Ordering::Relaxed),
            logtime: i.logtime.load(Ordering::Relaxed),
            max_traced: i.max_traced.load(Ordering::Relaxed),
        }
    }

    /// New options (a config reload): every line written after this follows them.
    pub fn set_opts(&self, o: LogOpts) {
        let i = &self.inner;
        i.debug.store(o.debug, Ordering::Relaxed);
        i.trace.store(o.trace, Ordering::Relaxed);
        i.logtime.store(o.logtime, Ordering::Relaxed);
        i.max_traced.store(o.max_traced, Ordering::Relaxed);
    }

    /// Writes one line (the macros check [`enabled`](Self::enabled) for debug and trace).
    pub fn write(&self, level: Level, args: std::fmt::Arguments) {
        if !self.enabled(level) {
            return;
        }
        let mut line = format!("[{}] ", std::process::id());
        if self.inner.logtime.load(Ordering::Relaxed) {
            line.push_str(&timestamp());
            line.push(' ');
        }
        line.push_str(&format!("[{}] {}\n", level.tag(), args));
        match &self.inner.sink {
            Sink::Thread(tx) => match tx.try_send(Msg::Line(line)) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.inner.dropped.fetch_add(1, Ordering::Relaxed);
                }
            },
            Sink::Memory(text) => {
                let mut text = text.lock().unwrap_or_else(|e| e.into_inner());
                if text.len() + line.len() > CAPTURE_MAX {
                    // Keep the newer half, from a line start.
                    let mut cut = text.len() / 2;
                    while !text.is_char_boundary(cut) {
                        cut += 1;
                    }
                    let cut = text[cut..].find('\n').map_or(text.len(), |i| cut + i + 1);
                    text.drain(..cut);
                }
                text.push_str(&line);
            }
            Sink::Stderr => {
                let _ = std::io::stderr().write_all(line.as_bytes());
            }
        }
    }

    /// Lines dropped because the log thread's queue was full.
    pub fn dropped(&self) -> u64 {
        self.inner.dropped.load(Ordering::Relaxed)
    }

    /// What a [`capture`](Self::capture) log holds (empty for the other kinds).
    pub fn captured(&self) -> String {
        match &self.inner.sink {
            Sink::Memory(text) => text.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            _ => String::new(),
        }
    }

    /// Writes to `file` from now on (the binary's log after its file was rotated).
    pub fn reopen(&self, file: std::fs::File) {
        if let Sink::Thread(tx) = &self.inner.sink {
            let _ = tx.send(Msg::Reopen(file));
        }
    }

    /// Waits (briefly) until queued lines are written, e.g. before exiting.
    pub fn flush(&self) {
        if let Sink::Thread(tx) = &self.inner.sink {
            let (done, rx) = sync_channel(1);
            if tx.try_send(Msg::Flush(done)).is_ok() {
                let _ = rx.recv_timeout(std::time::Duration::from_secs(1));
            }
        }
    }
}

fn writer(rx: Receiver<Msg>, file: Option<std::fs::File>) {
    let mut out: Box<dyn Write> = match file {
        Some(f) => Box::new(f),
        None => Box::new(std::io::stderr()),
    };
    for m in rx {
        match m {
            Msg::Line(l) => {
                let _ = out.write_all(l.as_bytes());
                let _ = out.flush();
            }
            Msg::Flush(done) => {
                let _ = out.flush();
                let _ = done.send(());
            }
            Msg::Reopen(f) => {
                let _ = out.flush();
                out = Box::new(f);
            }
        }
    }
}

/// `YYYY/MM/DD HH:MM:SS.micros` in UTC.
fn timestamp() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let (y, m, d) = crate::time::civil_from_days(days);
    format!(
        "{y:04}/{m:02}/{d:02} {:02}:{:02}:{:02}.{:06}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        now.subsec_micros()
    )
}

/// `info!(log, "format", args...)`: `log` is a [`Log`] (or a reference to one).
#[macro_export]
macro_rules! info { ($log:expr, $($t:tt)*) => { $log.write($crate::log::Level::Info, format_args!($($t)*)) } }
#[macro_export]
macro_rules! warn { ($log:expr, $($t:tt)*) => { $log.write($crate::log::Level::Warn, format_args!($($t)*)) } }
#[macro_export]
macro_rules! error { ($log:expr, $($t:tt)*) => { $log.write($crate::log::Level::Error, format_args!($($t)*)) } }
/// Formats nothing unless debug logging is on.
#[macro_export]
macro_rules! debug { ($log:expr, $($t:tt)*) => {{ let l = &$log; if l.enabled($crate::log::Level::Debug) { l.write($crate::log::Level::Debug, format_args!($($t)*)) } }} }
/// Formats nothing unless trace logging is on.
#[macro_export]
macro_rules! trace { ($log:expr, $($t:tt)*) => {{ let l = &$log; if l.enabled($crate::log::Level::Trace) { l.write($crate::log::Level::Trace, format_args!($($t)*)) } }} }

/// Go's `%q` / `strconv.Quote`, as the reference prints payloads and texts: quoted, with
/// `"`, `\` and control characters escaped, printable Unicode kept, invalid UTF-8 as `\x..`.
pub fn go_quote(b: &[u8]) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(b.len() + 2);
    out.push('"');
    for chunk in b.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                    let _ = write!(out, "\\x{:02x}", c as u32);
                }
                c => out.push(c),
            }
        }
        for byte in chunk.invalid() {
            let _ = write!(out, "\\x{byte:02x}");
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamp_shape() {
        let t = super::timestamp();
        assert_eq!(t.len(), 26, "{t}");
        assert_eq!(&t[4..5], "/");
        assert!(t.starts_with("20"));
    }

    #[test]
    fn each_log_keeps_its_own_lines_and_levels() {
        let a = Log::capture(LogOpts::default());
        let b = Log::capture(LogOpts {
            debug: true,
            ..Default::default()
        });
        crate::info!(a, "to a {}", 1);
        crate::debug!(a, "a has no debug");
        crate::debug!(b, "to b");
        let pid = std::process::id();
        assert_eq!(a.captured(), format!("[{pid}] [INF] to a 1\n"));
        assert_eq!(b.captured(), format!("[{pid}] [DBG] to b\n"));
    }

    #[test]
    fn a_capture_keeps_the_newest_lines_within_its_bound() {
        let log = Log::capture(LogOpts::default());
        let filler = "x".repeat(1000);
        for i in 0..(2 * CAPTURE_MAX / 1000) {
            crate::info!(log, "{i} {filler}");
        }
        let text = log.captured();
        assert!(text.len() <= CAPTURE_MAX, "{}", text.len());
        assert!(text.starts_with('['), "cut at a line start");
        let last = 2 * CAPTURE_MAX / 1000 - 1;
        assert!(text.ends_with(&format!("] [INF] {last} {filler}\n")));
    }
}
