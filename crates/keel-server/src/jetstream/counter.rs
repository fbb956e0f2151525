//! Message counters (`allow_msg_counter`, ADR-49): each publish carries `Nats-Incr: <n>` and
//! no payload; the stream stores `{"val":"<total>"}` for the subject, the previous total
//! plus n, in arbitrary precision as the reference does, and acknowledges with `"val"`.
//! Sourced counter messages add the change of their origin's total, remembered per origin
//! stream and subject in `Nats-Counter-Sources`, so a counter can aggregate several others.
//!
//! Pure decisions: what the new message is, given the subject's last one.

use std::collections::BTreeMap;

use keel_protocol::headers;

use super::api::{ApiError, ErrorKind};

pub const INCR: &str = "Nats-Incr";
pub const SOURCES: &str = "Nats-Counter-Sources";

/// A signed decimal integer of any size: sign and digits, most significant first, no
/// leading zeros (zero is `[]`, never negative).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Big {
    neg: bool,
    digits: Vec<u8>,
}

impl Big {
    /// Go's `big.Int.SetString(s, 10)`: an optional sign, then decimal digits.
    pub fn parse(s: &str) -> Option<Big> {
        let (neg, rest) = match s.as_bytes().first()? {
            b'-' => (true, &s[1..]),
            b'+' => (false, &s[1..]),
            _ => (false, s),
        };
        if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let digits: Vec<u8> = rest
            .bytes()
            .skip_while(|b| *b == b'0')
            .map(|b| b - b'0')
            .collect();
        let neg = neg && !digits.is_empty();
        Some(Big { neg, digits })
    }

    fn cmp_abs(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
        a.len().cmp(&b.len()).then_with(|| a.cmp(b))
    }

    fn add_abs(a: &[u8], b: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(a.len().max(b.len()) + 1);
        let (mut i, mut j, mut carry) = (a.len(), b.len(), 0u8);
        while i > 0 || j > 0 || carry > 0 {
            let x = if i > 0 {
                i -= 1;
                a[i]
            } else {
                0
            };
            let y = if j > 0 {
                j -= 1;
                b[j]
            } else {
                0
            };
            let s = x + y + carry;
            out.push(s % 10);
            carry = s / 10;
        }
        out.reverse();
        out
    }

    /// |a| - |b| with |a| >= |b|.
    fn sub_abs(a: &[u8], b: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(a.len());
        let (mut i, mut j, mut borrow) = (a.len(), b.len(), 0i8);
        while i > 0 {
            i -= 1;
            let y = if j > 0 {
                j -= 1;
                b[j] as i8
            } else {
                0
            };
            let mut d = a[i] as i8 - y - borrow;
            borrow = 0;
            if d < 0 {
                d += 10;
                borrow = 1;
            }
            out.push(d as u8);
        }
        while out.last() == Some(&0) {
            out.pop();
        }
        out.reverse();
        out
    }

    pub fn add(&self, o: &Big) -> Big {
        let (neg, digits) = if self.neg == o.neg {
            (self.neg, Self::add_abs(&self.digits, &o.digits))
        } else {
            match Self::cmp_abs(&self.digits, &o.digits) {
                std::cmp::Ordering::Less => (o.neg, Self::sub_abs(&o.digits, &self.digits)),
                _ => (self.neg, Self::sub_abs(&self.digits, &o.digits)),
            }
        };
        Big {
            neg: neg && !digits.is_empty(),
            digits,
        }
    }

    pub fn neg(&self) -> Big {
        Big {
            neg: !self.neg && !self.digits.is_empty(),
            digits: self.digits.clone(),
        }
    }
}

impl std::fmt::Display for Big {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.digits.is_empty() {
            return f.write_str("0");
        }
        if self.neg {
            f.write_str("-")?;
        }
        for d in &self.digits {
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

pub fn disabled() -> ApiError {
    ErrorKind::MsgCounterDisabled.err()
}
pub fn missing() -> ApiError {
    ErrorKind::MsgCounterMissing.err()
}
pub fn has_payload() -> ApiError {
    ErrorKind::MsgCounterPayload.err()
}
pub fn invalid() -> ApiError {
    ErrorKind::MsgCounterInvalid.err()
}
pub fn broken() -> ApiError {
    ErrorKind::MsgCounterBroken.err()
}

/// The `Nats-Incr` of a message: None when absent or empty, Err when not a number.
pub fn increment(hdr: &[u8]) -> Result<Option<Big>, ApiError> {
    match headers::get_str(hdr, INCR) {
        None | Some("") => Ok(None),
        Some(v) => Big::parse(v).map(Some).ok_or_else(invalid),
    }
}

/// Headers a counter publish may not carry with `Nats-Incr`.
pub fn conflicting_headers(hdr: &[u8]) -> bool {
    [
        "Nats-Rollup",
        "Nats-Expected-Stream",
        "Nats-Expected-Last-Msg-Id",
        "Nats-Expected-Last-Subject-Sequence-Subject",
        "Nats-Expected-Last-Sequence",
        "Nats-Expected-Last-Subject-Sequence",
    ]
    .iter()
    .any(|h| headers::get(hdr, h).is_some())
}

#[derive(serde::Deserialize)]
struct Value {
    val: String,
}

fn value_of(payload: &[u8]) -> Option<Big> {
    serde_json::from_slice::<Value>(payload)
        .ok()
        .and_then(|v| Big::parse(&v.val))
}

type Sources = BTreeMap<String, BTreeMap<String, String>>;

/// The new counter message for a subject: (headers, payload, total). `last` is the
/// subject's newest message (headers, payload), if any.
pub fn next(
    last: Option<(&[u8], &[u8])>,
    hdr: &[u8],
    payload: &[u8],
    incr: Big,
) -> Result<(Vec<u8>, Vec<u8>, String), ApiError> {
    let mut total = Big::default();
    let mut sources: Sources = BTreeMap::new();
    if let Some((lh, lp)) = last {
        total = value_of(lp).ok_or_else(broken)?;
        if let Some(s) = headers::get(lh, SOURCES).filter(|s| !s.is_empty()) {
            sources = serde_json::from_slice(s).map_err(|_| broken())?;
        }
    }
    let mut hdr = hdr.to_vec();
    let mut incr = incr;
    if let Some(src) = headers::get_str(&hdr, "Nats-Stream-Source").map(str::to_string) {
        // Sourced: count the change of the origin's total since the last one seen from it.
        let fields: Vec<&str> = src.split(' ').collect();
        let origin = fields[0].to_string();
        let subject = fields.get(4).map(|s| s.to_string()).unwrap_or_default();
        let sourced = value_of(payload).ok_or_else(broken)?;
        let entry = sources.entry(origin).or_default();
        let previous = entry
            .get(&subject)
            .and_then(|v| Big::parse(v))
            .unwrap_or_default();
        entry.insert(subject, sourced.to_string());
        incr = sourced.add(&previous.neg());
        hdr = set_header(&hdr, INCR, &incr.to_string());
    }
    let total = total.add(&incr);
    let value = total.to_string();
    if !sources.is_empty() {
        let s = serde_json::to_string(&sources).map_err(|_| broken())?;
        hdr = set_header(&hdr, SOURCES, &s);
    }
    let payload = format!(
        "{{\"val\":{}}}",
        serde_json::to_string(&value).expect("string")
    );
    Ok((hdr, payload.into_bytes(), value))
}

/// Replaces a header's value in place, or appends it (the reference's setHeader).
fn set_header(hdr: &[u8], key: &str, val: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(hdr.len() + key.len() + val.len() + 4);
    let mut found = false;
    let body = if hdr.len() >= 4 {
        &hdr[..hdr.len() - 2]
    } else {
        b"NATS/1.0\r\n"
    };
    for (i, line) in body.split_inclusive(|b| *b == b'\n').enumerate() {
        let name = line.split(|b| *b == b':').next().unwrap_or_default();
        if i > 0 && !found && name == key.as_bytes() {
            found = true;
            out.extend_from_slice(format!("{key}: {val}\r\n").as_bytes());
        } else {
            out.extend_from_slice(line);
        }
    }
    if !found {
        out.extend_from_slice(format!("{key}: {val}\r\n").as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Big {
        Big::parse(s).unwrap()
    }

    #[test]
    fn big_arithmetic() {
        assert_eq!(b("+5").to_string(), "5");
        assert_eq!(b("-0").to_string(), "0");
        assert_eq!(b("007").to_string(), "7");
        assert!(Big::parse("x").is_none() && Big::parse("").is_none() && Big::parse("-").is_none());
        assert_eq!(b("1").add(&b("5")).add(&b("-2")).to_string(), "4");
        assert_eq!(
            b("4")
                .add(&b("99999999999999999999999999999999999999999"))
                .to_string(),
            "100000000000000000000000000000000000000003"
        );
        assert_eq!(b("3").add(&b("-10")).to_string(), "-7");
        assert_eq!(b("-3").add(&b("-10")).to_string(), "-13");
        assert_eq!(b("-3").add(&b("3")).to_string(), "0");
        assert_eq!(b("1000").add(&b("-1")).to_string(), "999");
    }

    #[test]
    fn sourced_counters_count_the_change() {
        let hdr = b"NATS/1.0\r\nNats-Incr: 1\r\nNats-Stream-Source: C 1 c.a agg.x c.a id\r\n\r\n";
        let (h, p, v) = next(None, hdr, br#"{"val":"1"}"#, b("1")).unwrap();
        assert_eq!(v, "1");
        assert_eq!(p, br#"{"val":"1"}"#);
        let h2 = b"NATS/1.0\r\nNats-Incr: 5\r\nNats-Stream-Source: C 2 c.a agg.x c.a id\r\n\r\n";
        let (h2, _, v) = next(Some((&h, &p)), h2, br#"{"val":"6"}"#, b("5")).unwrap();
        assert_eq!(v, "6");
        assert_eq!(
            String::from_utf8(h2).unwrap(),
            "NATS/1.0\r\nNats-Incr: 5\r\nNats-Stream-Source: C 2 c.a agg.x c.a id\r\nNats-Counter-Sources: {\"C\":{\"c.a\":\"6\"}}\r\n\r\n"
        );
        assert_eq!(next(Some((b"", b"nope")), b"", b"", b("1")), Err(broken()));
    }
}
