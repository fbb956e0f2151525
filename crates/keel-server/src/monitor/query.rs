//! Query strings the way the reference reads them (Go's `url.ParseQuery` and `strconv`), with
//! its error texts for values that do not parse.

/// Decoded `key=value` pairs in order; a pair whose escapes do not decode is dropped (Go
/// drops it too), so `?x=%zz` is simply absent.
#[derive(Debug, Default)]
pub struct Query {
    pairs: Vec<(String, String)>,
}

impl Query {
    pub fn parse(raw: &str) -> Query {
        let mut pairs = Vec::new();
        for part in raw.split('&') {
            if part.is_empty() || part.contains(';') {
                continue;
            }
            let (k, v) = part.split_once('=').unwrap_or((part, ""));
            if let (Some(k), Some(v)) = (unescape(k), unescape(v)) {
                pairs.push((k, v));
            }
        }
        Query { pairs }
    }

    /// A query from decoded pairs (the options of a `$SYS` request).
    pub fn from_pairs(pairs: Vec<(String, String)>) -> Query {
        Query { pairs }
    }

    /// The first value for `key` (Go's `Values.Get`).
    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The value, or "" when absent.
    pub fn str(&self, key: &str) -> &str {
        self.get(key).unwrap_or("")
    }

    /// A boolean parameter; absent or empty is false.
    pub fn bool(&self, key: &str) -> Result<bool, String> {
        let v = self.str(key);
        if v.is_empty() {
            return Ok(false);
        }
        parse_bool(v).ok_or_else(|| {
            format!(
                "Error decoding boolean for '{key}': strconv.ParseBool: parsing {}: invalid syntax",
                crate::log::go_quote(v.as_bytes())
            )
        })
    }

    /// An int parameter; absent or empty is 0.
    pub fn int(&self, key: &str) -> Result<i64, String> {
        let v = self.str(key);
        if v.is_empty() {
            return Ok(0);
        }
        parse_int(v).map_err(|why| {
            format!(
                "Error decoding int for '{key}': strconv.Atoi: parsing {}: {why}",
                crate::log::go_quote(v.as_bytes())
            )
        })
    }

    /// A uint64 parameter; absent or empty is 0.
    pub fn uint(&self, key: &str) -> Result<u64, String> {
        let v = self.str(key);
        if v.is_empty() {
            return Ok(0);
        }
        parse_uint(v).map_err(|why| {
            format!(
                "Error decoding uint64 for '{key}': strconv.ParseUint: parsing {}: {why}",
                crate::log::go_quote(v.as_bytes())
            )
        })
    }
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// `+` is a space, `%XX` a byte; a malformed escape or invalid UTF-8 fails.
fn unescape(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hi = hex(*b.get(i + 1)?)?;
                let lo = hex(*b.get(i + 2)?)?;
                out.push(hi << 4 | lo);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// Go's `strconv.ParseBool`.
fn parse_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

const SYNTAX: &str = "invalid syntax";
const RANGE: &str = "value out of range";

/// Go's `strconv.Atoi` (64-bit): optional sign, decimal digits.
fn parse_int(s: &str) -> Result<i64, &'static str> {
    let (neg, digits) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let mag = parse_uint(digits)?;
    if neg {
        if mag > i64::MAX as u64 + 1 {
            return Err(RANGE);
        }
        Ok((mag as i64).wrapping_neg())
    } else {
        i64::try_from(mag).map_err(|_| RANGE)
    }
}

/// Go's `strconv.ParseUint(s, 10, 64)`.
fn parse_uint(s: &str) -> Result<u64, &'static str> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SYNTAX);
    }
    s.parse::<u64>().map_err(|_| RANGE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_like_go() {
        let q = Query::parse("a=1&b=x%20y&c=%zz&a=2&d&e=a+b&f;g=1");
        assert_eq!(q.get("a"), Some("1"));
        assert_eq!(q.get("b"), Some("x y"));
        assert_eq!(q.get("c"), None);
        assert_eq!(q.get("d"), Some(""));
        assert_eq!(q.get("e"), Some("a b"));
        assert_eq!(q.get("f"), None);
        assert_eq!(Query::parse("acc=$G").get("acc"), Some("$G"));
        assert_eq!(Query::parse("acc=%24G").get("acc"), Some("$G"));
    }

    #[test]
    fn typed_values() {
        let q = Query::parse("t=True&f=0&n=-5&u=7&big=99999999999999999999&bad=1x&q=%22");
        assert_eq!(q.bool("t"), Ok(true));
        assert_eq!(q.bool("f"), Ok(false));
        assert_eq!(q.bool("missing"), Ok(false));
        assert_eq!(q.int("n"), Ok(-5));
        assert_eq!(q.uint("u"), Ok(7));
        assert_eq!(
            q.int("big").unwrap_err(),
            "Error decoding int for 'big': strconv.Atoi: parsing \"99999999999999999999\": value out of range"
        );
        assert_eq!(
            q.uint("n").unwrap_err(),
            "Error decoding uint64 for 'n': strconv.ParseUint: parsing \"-5\": invalid syntax"
        );
        assert_eq!(
            q.bool("bad").unwrap_err(),
            "Error decoding boolean for 'bad': strconv.ParseBool: parsing \"1x\": invalid syntax"
        );
        assert_eq!(
            q.int("q").unwrap_err(),
            "Error decoding int for 'q': strconv.Atoi: parsing \"\\\"\": invalid syntax"
        );
        assert_eq!(parse_int("-"), Err(SYNTAX));
        assert_eq!(parse_int("-9223372036854775808"), Ok(i64::MIN));
    }
}
