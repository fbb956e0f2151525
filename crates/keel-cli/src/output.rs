//! Human output in the style of the `nats` CLI: right-aligned "label: value"
//! columns with section titles, simple tables, and the number, size, time
//! and duration formats it uses. Also prints the API's JSON for `--json`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::util::group;

/// Prints an API response as `nats --json` does: indented, without the
/// response `type` marker (the `nats` CLI prints its typed structs, which
/// have no such field).
pub fn print_json(v: &Value) {
    let mut v = v.clone();
    if let Value::Object(m) = &mut v {
        m.remove("type");
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&v).unwrap_or_else(|_| v.to_string())
    );
}

enum Line {
    Section(String),
    Row(String, String),
}

/// A "label: value" block like the `nats` CLI's info output.
pub struct Cols {
    heading: String,
    lines: Vec<Line>,
}

impl Cols {
    pub fn new(heading: impl Into<String>) -> Cols {
        Cols {
            heading: heading.into(),
            lines: Vec::new(),
        }
    }

    pub fn section(&mut self, title: &str) {
        self.lines.push(Line::Section(title.to_string()));
    }

    pub fn row(&mut self, label: &str, value: impl ToString) {
        self.lines
            .push(Line::Row(label.to_string(), value.to_string()));
    }

    pub fn row_if(&mut self, cond: bool, label: &str, value: impl ToString) {
        if cond {
            self.row(label, value);
        }
    }

    pub fn render(&self) -> String {
        let width = self
            .lines
            .iter()
            .filter_map(|l| match l {
                Line::Row(k, _) => Some(k.chars().count()),
                _ => None,
            })
            .max()
            .unwrap_or(0)
            + 2;
        let mut out = String::new();
        if !self.heading.is_empty() {
            out.push_str(&self.heading);
            out.push_str("\n\n");
        }
        for line in &self.lines {
            match line {
                Line::Section(t) => {
                    if !out.is_empty() && !out.ends_with("\n\n") {
                        out.push('\n');
                    }
                    out.push_str(&format!("{t}:\n\n"));
                }
                Line::Row(k, v) if k.is_empty() => {
                    out.push_str(&format!("{:>width$}  {v}\n", ""));
                }
                Line::Row(k, v) => out.push_str(&format!("{k:>width$}: {v}\n")),
            }
        }
        out
    }
}

/// A table with a title and column headers, drawn with box characters as
/// the `nats` CLI does.
pub struct Table {
    title: String,
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
    footer: Option<Vec<String>>,
}

impl Table {
    pub fn new(title: impl Into<String>, headers: &[&str]) -> Table {
        Table {
            title: title.into(),
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
            footer: None,
        }
    }

    pub fn add(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    /// A totals row under a rule, as the `nats` CLI's table footers.
    pub fn footer(&mut self, row: Vec<String>) {
        self.footer = Some(row);
    }

    pub fn render(&self) -> String {
        let n = self.headers.len();
        let mut w: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in self.rows.iter().chain(self.footer.iter()) {
            for (i, c) in r.iter().enumerate().take(n) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |l: &str, m: &str, r: &str| {
            let mut s = String::from(l);
            for (i, wi) in w.iter().enumerate() {
                s.push_str(&"─".repeat(wi + 2));
                s.push_str(if i + 1 == n { r } else { m });
            }
            s.push('\n');
            s
        };
        let cells = |cells: &[String]| {
            let mut s = String::from("│");
            for (i, wi) in w.iter().enumerate() {
                let c = cells.get(i).map(String::as_str).unwrap_or("");
                let pad = wi - c.chars().count();
                // Numbers read best right-aligned, like the nats CLI's tables.
                if looks_numeric(c) {
                    s.push_str(&format!(" {}{c} │", " ".repeat(pad)));
                } else {
                    s.push_str(&format!(" {c}{} │", " ".repeat(pad)));
                }
            }
            s.push('\n');
            s
        };
        let total: usize = w.iter().map(|x| x + 3).sum::<usize>() + 1;
        let mut out = String::new();
        out.push_str(&format!("{:^total$}\n", self.title));
        out.push_str(&line("╭", "┬", "╮"));
        out.push_str(&cells(&self.headers));
        out.push_str(&line("├", "┼", "┤"));
        for r in &self.rows {
            out.push_str(&cells(r));
        }
        if let Some(f) = &self.footer {
            out.push_str(&line("├", "┼", "┤"));
            out.push_str(&cells(f));
        }
        out.push_str(&line("╰", "┴", "╯"));
        out
    }
}

fn looks_numeric(s: &str) -> bool {
    !s.is_empty()
        && s.chars().next().is_some_and(|c| c.is_ascii_digit())
        && s.chars()
            .all(|c| c.is_ascii_digit() || c == ',' || c == '.')
}

/// An integer field of a JSON object (0 when absent).
pub fn u(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// A signed integer field of a JSON object (0 when absent).
pub fn i(v: &Value, key: &str) -> i64 {
    v.get(key).and_then(Value::as_i64).unwrap_or(0)
}

/// A string field of a JSON object ("" when absent).
pub fn s<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

/// A bool field of a JSON object (false when absent).
pub fn b(v: &Value, key: &str) -> bool {
    v.get(key).and_then(Value::as_bool).unwrap_or(false)
}

/// A count with thousands separators.
pub fn n(x: u64) -> String {
    group(x)
}

/// Durations as the `nats` CLI shows them: `30.00s`, `2m0s`, `1h0m0s`,
/// `1d0h0m0s`, `1y0d0h0m0s`.
pub fn dur(d: Duration) -> String {
    if d.is_zero() {
        return "0s".into();
    }
    let secs = d.as_secs();
    let (mins, hrs, days, yrs) = (secs / 60, secs / 3600, secs / 86400, secs / (365 * 86400));
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
    } else if d < Duration::from_millis(1) {
        format!("{:.2}µs", d.as_nanos() as f64 / 1e3)
    } else if d < Duration::from_secs(1) {
        format!("{:.2}ms", d.as_nanos() as f64 / 1e6)
    } else {
        format!("{:.2}s", d.as_secs_f64())
    }
}

/// A nanosecond duration field, as [`dur`].
pub fn dur_ns(ns: i64) -> String {
    dur(Duration::from_nanos(ns.max(0) as u64))
}

/// Sizes as Go's humanize.IBytes: `0 B`, `1.5 KiB`, `24 MiB`.
pub fn ibytes(x: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if x < 1024 {
        return format!("{x} B");
    }
    let mut v = x as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if v < 10.0 {
        format!("{v:.1} {}", UNITS[unit])
    } else {
        format!("{v:.0} {}", UNITS[unit])
    }
}

/// Parses an RFC 3339 timestamp (as the server writes them) into nanoseconds
/// since the Unix epoch. Go's zero time (year 1) comes back as None.
pub fn parse_time(t: &str) -> Option<i128> {
    let bytes = t.as_bytes();
    if bytes.len() < 20 {
        return None;
    }
    let num = |a: usize, b: usize| t.get(a..b)?.parse::<i64>().ok();
    let (year, month, day) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    let (hour, min, sec) = (num(11, 13)?, num(14, 16)?, num(17, 19)?);
    if year <= 1 {
        return None;
    }
    let mut rest = &t[19..];
    let mut nanos: i64 = 0;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(frac.len());
        let mut f = frac[..digits].to_string();
        f.truncate(9);
        while f.len() < 9 {
            f.push('0');
        }
        nanos = f.parse().ok()?;
        rest = &frac[digits..];
    }
    let offset_secs = match rest {
        "Z" | "z" => 0,
        o if o.len() == 6 => {
            let sign = if o.starts_with('-') { -1 } else { 1 };
            let h: i64 = o.get(1..3)?.parse().ok()?;
            let m: i64 = o.get(4..6)?.parse().ok()?;
            sign * (h * 3600 + m * 60)
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let secs = days * 86400 + hour * 3600 + min * 60 + sec - offset_secs;
    Some(secs as i128 * 1_000_000_000 + nanos as i128)
}

/// Howard Hinnant's days-from-civil: days since 1970-01-01.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146097 + doe - 719468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719468;
    let era = if z >= 0 { z } else { z - 146096 } / 146097;
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// `2006-01-02 15:04:05` in UTC, from nanoseconds since the epoch.
pub fn fmt_time_ns(ns: i128) -> String {
    let secs = ns.div_euclid(1_000_000_000) as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// RFC 3339 with nanoseconds in UTC, as the server's JSON expects.
pub fn rfc3339_ns(ns: i128) -> String {
    let frac = ns.rem_euclid(1_000_000_000);
    let base = fmt_time_ns(ns).replacen(' ', "T", 1);
    format!("{base}.{frac:09}Z")
}

/// Formats an RFC 3339 field for people (`2006-01-02 15:04:05 UTC`).
pub fn fmt_time(t: &str) -> String {
    match parse_time(t) {
        Some(ns) => format!("{} UTC", fmt_time_ns(ns)),
        None => t.to_string(),
    }
}

pub fn now_ns() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(0)
}

/// How long before `reference` (an RFC 3339 time, usually the response's
/// `ts`, else now) the time `t` was.
pub fn ago(t: &str, reference: &str) -> Option<String> {
    let then = parse_time(t)?;
    let now = parse_time(reference).unwrap_or_else(now_ns);
    let d = (now - then).max(0) as u64;
    Some(dur(Duration::from_nanos(d)))
}

/// Standard base64 decoding (the API sends message data and headers so).
pub fn base64_decode(input: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(input.len() * 3 / 4);
    let mut buf = 0u32;
    let mut bits = 0;
    for c in input.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' | b'\n' | b'\r' => continue,
            _ => return Err(format!("invalid base64 character {:?}", c as char)),
        };
        buf = (buf << 6) | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((buf >> bits) as u8);
            buf &= (1 << bits) - 1;
        }
    }
    Ok(out)
}

/// Standard base64 encoding with padding (the API's form for data and headers).
pub fn base64_encode(input: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let v = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(T[(v >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Parses a NATS header block (`NATS/1.0 ...\r\nKey: value\r\n\r\n`) into
/// sorted "Key: value" lines plus the status line's code and description.
pub fn header_block_lines(block: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(block);
    let mut lines: Vec<String> = text
        .split("\r\n")
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .map(|l| match l.split_once(':') {
            Some((k, v)) => format!("{}: {}", k.trim(), v.trim()),
            None => l.to_string(),
        })
        .collect();
    lines.sort();
    lines
}

/// `HH:MM:SS` now (UTC), as natscli stamps progress lines.
pub fn now_stamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let d = secs % 86_400;
    format!("{:02}:{:02}:{:02}", d / 3600, d % 3600 / 60, d % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(dur(Duration::from_secs(30)), "30.00s");
        assert_eq!(dur(Duration::from_secs(120)), "2m0s");
        assert_eq!(dur(Duration::from_secs(86400)), "1d0h0m0s");
        assert_eq!(dur(Duration::from_secs(3600)), "1h0m0s");
        assert_eq!(dur(Duration::ZERO), "0s");
    }

    #[test]
    fn sizes() {
        assert_eq!(ibytes(0), "0 B");
        assert_eq!(ibytes(1536), "1.5 KiB");
        assert_eq!(ibytes(24 << 20), "24 MiB");
        assert_eq!(ibytes(1 << 30), "1.0 GiB");
    }

    #[test]
    fn times() {
        let ns = parse_time("2024-05-01T10:00:00.5Z").unwrap();
        assert_eq!(fmt_time_ns(ns), "2024-05-01 10:00:00");
        assert_eq!(rfc3339_ns(ns), "2024-05-01T10:00:00.500000000Z");
        let with_offset = parse_time("2024-05-01T12:00:00+02:00").unwrap();
        assert_eq!(fmt_time_ns(with_offset), "2024-05-01 10:00:00");
        assert_eq!(parse_time("0001-01-01T00:00:00Z"), None);
        assert_eq!(fmt_time_ns(0), "1970-01-01 00:00:00");
    }

    #[test]
    fn base64() {
        assert_eq!(base64_decode("eyJpZCI6MX0=").unwrap(), b"{\"id\":1}");
        assert_eq!(base64_decode("").unwrap(), b"");
        assert!(base64_decode("*").is_err());
        for raw in [
            &b""[..],
            b"a",
            b"ab",
            b"abc",
            b"{\"id\":1}",
            &[0, 255, 128, 7],
        ] {
            assert_eq!(base64_decode(&base64_encode(raw)).unwrap(), raw);
        }
        assert_eq!(base64_encode(b"{\"id\":1}"), "eyJpZCI6MX0=");
    }

    #[test]
    fn tables() {
        let mut t = Table::new("Streams", &["Name", "Messages"]);
        t.add(vec!["ORDERS".into(), "1,000".into()]);
        let out = t.render();
        assert!(out.contains("│ ORDERS │    1,000 │"), "{out}");
    }
}
