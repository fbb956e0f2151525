//! Logging in the reference's line format (`[pid] date time [INF] text`), on a dedicated
//! thread behind a bounded queue: a launcher that stops reading our stderr must never block
//! the server, so when the queue is full lines are dropped and counted instead.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::OnceLock;
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

struct Logger {
    tx: SyncSender<Msg>,
    debug: bool,
    trace: bool,
    logtime: bool,
}

enum Msg {
    Line(String),
    Flush(SyncSender<()>),
}

static LOGGER: OnceLock<Logger> = OnceLock::new();
static DROPPED: AtomicU64 = AtomicU64::new(0);
static STARTED: AtomicBool = AtomicBool::new(false);

/// Starts the log thread. `file` None means stderr.
pub fn init(debug: bool, trace: bool, logtime: bool, file: Option<std::fs::File>) {
    let (tx, rx) = sync_channel::<Msg>(4096);
    if LOGGER
        .set(Logger {
            tx,
            debug,
            trace,
            logtime,
        })
        .is_err()
    {
        return;
    }
    STARTED.store(true, Ordering::Release);
    std::thread::Builder::new()
        .name("keel-log".into())
        .spawn(move || writer(rx, file))
        .expect("spawn log thread");
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
        }
    }
}

pub fn enabled(level: Level) -> bool {
    match LOGGER.get() {
        Some(l) => match level {
            Level::Trace => l.trace,
            Level::Debug => l.debug,
            _ => true,
        },
        None => level >= Level::Info,
    }
}

pub fn log(level: Level, args: std::fmt::Arguments) {
    if !enabled(level) {
        return;
    }
    let Some(l) = LOGGER.get() else {
        eprintln!("[{}] {}", level.tag(), args);
        return;
    };
    let mut line = format!("[{}] ", std::process::id());
    if l.logtime {
        line.push_str(&timestamp());
        line.push(' ');
    }
    line.push_str(&format!("[{}] {}\n", level.tag(), args));
    match l.tx.try_send(Msg::Line(line)) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Waits (briefly) until queued lines are written, e.g. before exiting.
pub fn flush() {
    if !STARTED.load(Ordering::Acquire) {
        return;
    }
    if let Some(l) = LOGGER.get() {
        let (tx, rx) = sync_channel(1);
        if l.tx.try_send(Msg::Flush(tx)).is_ok() {
            let _ = rx.recv_timeout(std::time::Duration::from_secs(1));
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

#[macro_export]
macro_rules! info { ($($t:tt)*) => { $crate::log::log($crate::log::Level::Info, format_args!($($t)*)) } }
#[macro_export]
macro_rules! warn { ($($t:tt)*) => { $crate::log::log($crate::log::Level::Warn, format_args!($($t)*)) } }
#[macro_export]
macro_rules! error { ($($t:tt)*) => { $crate::log::log($crate::log::Level::Error, format_args!($($t)*)) } }
#[macro_export]
macro_rules! debug { ($($t:tt)*) => { if $crate::log::enabled($crate::log::Level::Debug) { $crate::log::log($crate::log::Level::Debug, format_args!($($t)*)) } } }
#[macro_export]
macro_rules! trace { ($($t:tt)*) => { if $crate::log::enabled($crate::log::Level::Trace) { $crate::log::log($crate::log::Level::Trace, format_args!($($t)*)) } } }

#[cfg(test)]
mod tests {
    #[test]
    fn timestamp_shape() {
        let t = super::timestamp();
        assert_eq!(t.len(), 26, "{t}");
        assert_eq!(&t[4..5], "/");
        assert!(t.starts_with("20"));
    }
}
