//! Timestamps as the JetStream API writes them: RFC 3339 in UTC with up to nine fractional
//! digits, trailing zeros trimmed (Go's RFC3339Nano), and the zero time as
//! `0001-01-01T00:00:00Z`. Internally a timestamp is nanoseconds since the Unix epoch.

use std::time::{SystemTime, UNIX_EPOCH};

/// Nanoseconds since the Unix epoch, now.
pub fn now_nanos() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// (year, month, day) of a day count since the Unix epoch.
pub(crate) fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 } as i64;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// RFC 3339 with nanoseconds; 0 is Go's zero time.
pub fn rfc3339(ts: i64) -> String {
    if ts == 0 {
        return "0001-01-01T00:00:00Z".into();
    }
    let secs = ts.div_euclid(1_000_000_000);
    let nanos = ts.rem_euclid(1_000_000_000);
    let (y, m, d) = civil_from_days(secs.div_euclid(86400));
    let rem = secs.rem_euclid(86400);
    let mut s = format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
    if nanos != 0 {
        let frac = format!("{nanos:09}");
        s.push('.');
        s.push_str(frac.trim_end_matches('0'));
    }
    s.push('Z');
    s
}

/// RFC 3339 of whole Unix seconds (certificate dates, which may lie far beyond what
/// nanoseconds in an i64 can hold).
pub fn rfc3339_secs(secs: i64) -> String {
    let (y, m, d) = civil_from_days(secs.div_euclid(86400));
    let rem = secs.rem_euclid(86400);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Parses RFC 3339 (`Z` or `±hh:mm` offsets, optional fraction). The zero time parses to 0.
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, se) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    let mut i = 19;
    let mut nanos = 0i64;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let digits = &s[start..i];
        if digits.is_empty() {
            return None;
        }
        let mut frac = digits.chars().take(9).collect::<String>();
        while frac.len() < 9 {
            frac.push('0');
        }
        nanos = frac.parse().ok()?;
    }
    let offset = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        c @ (b'+' | b'-') if i + 6 == b.len() && b[i + 3] == b':' => {
            let oh = num(i + 1..i + 3)?;
            let om = num(i + 4..i + 6)?;
            let o = (oh * 3600 + om * 60) * 1_000_000_000;
            if *c == b'+' {
                o
            } else {
                -o
            }
        }
        _ => return None,
    };
    if y == 1 && mo == 1 && d == 1 && h == 0 && mi == 0 && se == 0 && nanos == 0 {
        return Some(0);
    }
    let days = days_from_civil(y, mo as u32, d as u32);
    let secs = days * 86400 + h * 3600 + mi * 60 + se;
    Some(secs * 1_000_000_000 + nanos - offset)
}

/// A duration as Go's `time.Duration.String` prints it (`1h2m3s`, `1.5s`, `500ms`,
/// `464µs`, `0s`); the reference uses it in status texts and monitoring fields.
pub fn go_duration(ns: i64) -> String {
    if ns == 0 {
        return "0s".into();
    }
    let sign = if ns < 0 { "-" } else { "" };
    let u = ns.unsigned_abs();
    // Whole units and a fraction with trailing zeros trimmed.
    let frac = |v: u64, unit: u64| -> String {
        let (whole, rest) = (v / unit, v % unit);
        if rest == 0 {
            return whole.to_string();
        }
        let digits = unit.ilog10() as usize;
        let f = format!("{rest:0digits$}");
        format!("{whole}.{}", f.trim_end_matches('0'))
    };
    let text = if u < 1_000 {
        format!("{u}ns")
    } else if u < 1_000_000 {
        format!("{}µs", frac(u, 1_000))
    } else if u < 1_000_000_000 {
        format!("{}ms", frac(u, 1_000_000))
    } else {
        let secs = u / 1_000_000_000;
        let s = frac(u % 60_000_000_000, 1_000_000_000);
        match (secs / 3600, secs % 3600 / 60) {
            (0, 0) => format!("{s}s"),
            (0, m) => format!("{m}m{s}s"),
            (h, m) => format!("{h}h{m}m{s}s"),
        }
    };
    format!("{sign}{text}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        assert_eq!(go_duration(0), "0s");
        assert_eq!(go_duration(1_000_000_000), "1s");
        assert_eq!(go_duration(1_500_000_000), "1.5s");
        assert_eq!(go_duration(500_000_000), "500ms");
        assert_eq!(go_duration(90_000_000_000), "1m30s");
        assert_eq!(go_duration(3_723_000_000_000), "1h2m3s");
        assert_eq!(go_duration(464_000), "464µs");
        assert_eq!(go_duration(1_234_567), "1.234567ms");
        assert_eq!(go_duration(999), "999ns");
    }

    #[test]
    fn format_and_parse() {
        assert_eq!(rfc3339(0), "0001-01-01T00:00:00Z");
        let t = parse_rfc3339("2026-11-29T11:58:51.89408078Z").unwrap();
        assert_eq!(rfc3339(t), "2026-11-29T11:58:51.89408078Z");
        let t = parse_rfc3339("2099-01-01T00:00:00Z").unwrap();
        assert_eq!(rfc3339(t), "2099-01-01T00:00:00Z");
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_rfc3339("0001-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339("2026-11-29T12:00:00+01:00"),
            parse_rfc3339("2026-11-29T11:00:00Z")
        );
        assert_eq!(parse_rfc3339("nope"), None);
        assert_eq!(parse_rfc3339("2026-13-01T00:00:00Z"), None);
        let now = now_nanos();
        assert_eq!(parse_rfc3339(&rfc3339(now)), Some(now));
    }
}
