//! Process figures for `/varz` (resident memory, CPU percentage, cores) and the reference's
//! duration texts.

use std::time::{Duration, Instant};

/// Resident set size in bytes (0 where `/proc` is not available).
pub fn rss_bytes() -> u64 {
    let Ok(statm) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page.max(0) as u64
}

/// User plus system CPU time of this process, in clock ticks.
fn cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is parenthesised and may contain spaces.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 11 and 12 after `)`.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// The JetStream memory limit when none is configured, as the reference computes it: three
/// quarters of the machine's physical memory (1 GiB if that cannot be read).
pub fn default_max_memory() -> i64 {
    // SAFETY: sysinfo fills the struct we pass and has no other preconditions.
    let total = unsafe {
        let mut info: libc::sysinfo = std::mem::zeroed();
        if libc::sysinfo(&mut info) == 0 {
            (info.totalram as u64).saturating_mul(info.mem_unit as u64)
        } else {
            0
        }
    };
    if total == 0 {
        return 1 << 30;
    }
    (total as i64) / 4 * 3
}

/// The JetStream file store limit when none is configured, as the reference computes it:
/// three quarters of the space available to unprivileged users on the store's file system
/// at startup (1 TiB if that cannot be read).
pub fn default_max_store(store_dir: &std::path::Path) -> i64 {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(store_dir.as_os_str().as_bytes()) else {
        return 1 << 40;
    };
    // SAFETY: `path` is NUL-terminated and `fs` is a plain struct statfs fills in.
    unsafe {
        let mut fs: libc::statfs = std::mem::zeroed();
        if libc::statfs(path.as_ptr(), &mut fs) != 0 {
            return 1 << 40;
        }
        ((fs.f_bavail as u64).saturating_mul(fs.f_bsize as u64) / 4 * 3) as i64
    }
}

pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// CPU use in percent of one core, over the time since the previous sample (at most one new
/// sample a second, as the reference refreshes its figure).
#[derive(Default)]
pub struct CpuSampler {
    last: Option<(Instant, u64)>,
    pct: f64,
    rss: u64,
}

impl CpuSampler {
    pub fn percent(&mut self, process_start: Instant) -> f64 {
        // Within a second of the last sample: the same figure, without reading /proc.
        if self
            .last
            .is_some_and(|(t, _)| t.elapsed().as_secs_f64() < 1.0)
        {
            return self.pct;
        }
        self.rss = rss_bytes();
        let Some(ticks) = cpu_ticks() else {
            return 0.0;
        };
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let now = Instant::now();
        let (since, base) = self.last.unwrap_or((process_start, 0));
        let wall = now.duration_since(since).as_secs_f64();
        if wall > 0.0 {
            let pct = (ticks.saturating_sub(base)) as f64 / hz / wall * 100.0;
            self.pct = (pct * 10.0).round() / 10.0;
        }
        self.last = Some((now, ticks));
        self.pct
    }

    /// Resident memory as of the last [`percent`](Self::percent) sample.
    pub fn rss(&self) -> u64 {
        self.rss
    }
}

/// The reference's uptime/idle text: `1y2d3h4m5s`, leading zero units left out.
pub fn uptime(d: Duration) -> String {
    let secs = d.as_secs();
    let (mins, hrs) = (secs / 60, secs / 3600);
    let (days, yrs) = (hrs / 24, hrs / 24 / 365);
    if yrs > 0 {
        format!(
            "{yrs}y{}d{}h{}m{}s",
            days % 365,
            hrs % 24,
            mins % 60,
            secs % 60
        )
    } else if days > 0 {
        format!("{days}d{}h{}m{}s", hrs % 24, mins % 60, secs % 60)
    } else if hrs > 0 {
        format!("{hrs}h{}m{}s", mins % 60, secs % 60)
    } else if mins > 0 {
        format!("{mins}m{}s", secs % 60)
    } else {
        format!("{secs}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uptime_text() {
        assert_eq!(uptime(Duration::from_millis(900)), "0s");
        assert_eq!(uptime(Duration::from_secs(65)), "1m5s");
        assert_eq!(uptime(Duration::from_secs(3600 * 25 + 1)), "1d1h0m1s");
        assert_eq!(
            uptime(Duration::from_secs(366 * 86400 + 7200)),
            "1y1d2h0m0s"
        );
    }

    #[test]
    fn default_limits_are_real() {
        assert!(default_max_memory() > 0);
        let dir = std::env::temp_dir();
        assert!(default_max_store(&dir) > 0);
        assert_eq!(
            default_max_store(std::path::Path::new("/no/such/dir")),
            1 << 40
        );
    }

    #[test]
    fn process_figures() {
        assert!(rss_bytes() > 0);
        assert!(cores() >= 1);
        let mut s = CpuSampler::default();
        assert!(s.percent(Instant::now() - Duration::from_secs(1)) >= 0.0);
    }
}
