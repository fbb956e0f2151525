//! Parser for the nats-server configuration file format.
//!
//! Keel is a drop-in for nats-server, so it must read the same config files:
//! `key: value` / `key = value` / `key value` entries, nested `{}` maps, `[]`
//! arrays, `#` and `//` comments, quoted and bare strings, size-suffixed
//! integers (`1MB`), `$VAR` references and `include`. The result is a plain
//! value tree ([`Map`]); mapping it onto server options is done elsewhere.
//!
//! Semantics follow nats-server's `conf` lexer/parser where they matter:
//! - Unquoted integers may carry a size suffix: `k`/`m`/`g`/`t`/`p`/`e` are
//!   powers of 1000, while `kb`/`ki`/`kib` (and the `mb`, `gb`, ... forms) are
//!   powers of 1024. So unquoted `2m` is the integer 2000000, not a duration.
//! - Sizes given as *strings* (see [`parse_size`]) are always powers of 1024,
//!   as nats-server's `getStorageSize` does for `"10G"`.
//! - `$NAME` looks in the enclosing maps (innermost first), then the
//!   environment, whose value is parsed like a config value.
//!
//! Where nats-server's lexer has accidents (it rejects `a: [1]`, wraps
//! overflowing sizes, reads `a:` as an empty string) this parser accepts the
//! sensible reading or reports an error instead. It never panics, reports
//! line/column on errors and bounds nesting depth.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Maximum nesting of maps/arrays (includes count too); deeper input is an error.
const MAX_DEPTH: usize = 128;

/// A configuration value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Array(Vec<Value>),
    Map(Map),
}

/// An ordered map; lookups with [`Map::get`] ignore ASCII case like nats-server.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Map(pub Vec<(String, Value)>);

/// A parse error with 1-based line and column (0/0 when no position applies).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfError {
    pub line: usize,
    pub col: usize,
    pub msg: String,
}

impl fmt::Display for ConfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            // The reference's words ("Parse error on line N"), which scripts look for.
            "Parse error on line {}, column {}: {}",
            self.line, self.col, self.msg
        )
    }
}

impl std::error::Error for ConfError {}

impl Map {
    /// Value for `key`, ignoring ASCII case; the last matching entry wins.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v)
    }

    /// Sets `key`, replacing an entry with exactly the same key (moved to the end).
    pub fn insert(&mut self, key: String, value: Value) {
        self.0.retain(|(k, _)| *k != key);
        self.0.push((key, value));
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Exact-key lookup, as nats-server's variable resolution does.
    fn get_exact(&self, key: &str) -> Option<&Value> {
        self.0.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

/// Generates `Option`-returning typed accessors on [`Value`].
macro_rules! accessors {
    ($($(#[$doc:meta])* $name:ident -> $t:ty { $($pat:pat => $e:expr),+ })*) => {$(
        $(#[$doc])*
        pub fn $name(&self) -> Option<$t> {
            match self {
                $($pat => Some($e),)+
                _ => None,
            }
        }
    )*};
}

impl Value {
    /// Short type name for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Bool(_) => "boolean",
            Value::Int(_) => "integer",
            Value::Float(_) => "float",
            Value::Str(_) => "string",
            Value::Array(_) => "array",
            Value::Map(_) => "map",
        }
    }

    accessors! {
        as_bool -> bool { Value::Bool(b) => *b }
        as_i64 -> i64 { Value::Int(i) => *i }
        /// Floats, and integers widened to float.
        as_f64 -> f64 { Value::Float(f) => *f, Value::Int(i) => *i as f64 }
        as_str -> &str { Value::Str(s) => s.as_str() }
        as_array -> &[Value] { Value::Array(a) => a.as_slice() }
        as_map -> &Map { Value::Map(m) => m }
    }

    /// Integers (and floats) are seconds, as in nats-server; strings use
    /// [`parse_duration`].
    pub fn as_duration(&self) -> Result<Duration, String> {
        match self {
            Value::Int(n) if *n >= 0 => Ok(Duration::from_secs(*n as u64)),
            Value::Float(f) => {
                Duration::try_from_secs_f64(*f).map_err(|e| format!("invalid duration {f}: {e}"))
            }
            Value::Str(s) => parse_duration(s),
            Value::Int(n) => Err(format!("negative duration {n}")),
            v => Err(format!("expected a duration, got {}", v.type_name())),
        }
    }

    /// Integers are byte counts as is; strings use [`parse_size`].
    pub fn as_size(&self) -> Result<i64, String> {
        match self {
            Value::Int(n) => Ok(*n),
            Value::Str(s) => parse_size(s),
            v => Err(format!("expected a size, got {}", v.type_name())),
        }
    }
}

/// Parses config text. `include` is rejected (there is no directory to resolve it).
pub fn parse(text: &str) -> Result<Map, ConfError> {
    Parser::new(text, None, 0, &env_lookup).parse_document()
}

/// Reads and parses a config file, resolving `include` relative to its directory.
pub fn parse_file(path: &Path) -> Result<Map, ConfError> {
    parse_file_at(path, 0, &env_lookup, &[])
}

fn env_lookup(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

type EnvFn<'e> = &'e dyn Fn(&str) -> Option<String>;

/// `chain` holds the canonical paths of the files including this one.
fn parse_file_at(
    path: &Path,
    depth: usize,
    env: EnvFn<'_>,
    chain: &[PathBuf],
) -> Result<Map, ConfError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfError {
        line: 0,
        col: 0,
        msg: format!("cannot read config file '{}': {e}", path.display()),
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut parser = Parser::new(&text, Some(dir), depth, env);
    parser.chain = chain.to_vec();
    parser
        .chain
        .push(std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()));
    parser.parse_document()
}

/// Parses a Go-style duration (`1h30m`, `1.5s`, `500ms`, `10us`; units ns, us,
/// µs, ms, s, m, h). A bare integer is a number of seconds. Negative durations
/// are rejected; days are not a unit (as in Go).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let rest = t.strip_prefix('+').unwrap_or(t);
    let (neg, rest) = match rest.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    if rest.is_empty() {
        return Err(format!("invalid duration '{s}'"));
    }
    if rest.bytes().all(|b| b.is_ascii_digit()) {
        let secs: u64 = rest
            .parse()
            .map_err(|_| format!("duration '{s}' out of range"))?;
        return match (neg, secs) {
            (true, n) if n > 0 => Err(format!("negative duration '{s}'")),
            _ => Ok(Duration::from_secs(secs)),
        };
    }
    let mut total: u128 = 0;
    let mut r = rest;
    while !r.is_empty() {
        let num_end = r
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(r.len());
        let (num, tail) = r.split_at(num_end);
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_end);
        let (int_part, frac_part) = num.split_once('.').unwrap_or((num, ""));
        if (int_part.is_empty() && frac_part.is_empty()) || frac_part.contains('.') {
            return Err(format!("invalid duration '{s}'"));
        }
        let mult: u128 = match unit {
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => return Err(format!("missing unit in duration '{s}'")),
            u => return Err(format!("unknown unit '{u}' in duration '{s}'")),
        };
        let range = || format!("duration '{s}' out of range");
        let digits = |d: &str| match d {
            "" => Ok(0u128),
            d => d.parse::<u128>().map_err(|_| range()),
        };
        let frac = &frac_part[..frac_part.len().min(18)];
        let (int_val, frac_val) = (digits(int_part)?, digits(frac)?);
        let frac_ns = frac_val * mult / 10u128.pow(frac.len() as u32);
        total = int_val
            .checked_mul(mult)
            .and_then(|v| v.checked_add(frac_ns))
            .and_then(|v| v.checked_add(total))
            .filter(|v| *v <= i64::MAX as u128)
            .ok_or_else(range)?;
        r = next;
    }
    if neg && total > 0 {
        return Err(format!("negative duration '{s}'"));
    }
    Ok(Duration::from_nanos(total as u64))
}

/// Parses a size string: a plain integer, or an integer with a suffix
/// `k`/`kb`/`ki`/`kib`, `m..`, `g..`, `t..`, `p..`, `e..` (case-insensitive),
/// all powers of 1024 as nats-server does for sizes given as strings.
/// (Unquoted size literals in a config are lexed differently: see the module docs.)
pub fn parse_size(s: &str) -> Result<i64, String> {
    let t = s.trim();
    let digits_start = usize::from(t.starts_with(['-', '+']));
    let split = t[digits_start..]
        .find(|c: char| !c.is_ascii_digit())
        .map_or(t.len(), |i| i + digits_start);
    let (num, suffix) = t.split_at(split);
    if num.len() == digits_start {
        return Err(format!("invalid size '{s}'"));
    }
    let n: i64 = num
        .parse()
        .map_err(|_| format!("size '{s}' out of range"))?;
    let suffix = suffix.trim().to_ascii_lowercase();
    let power = match suffix.as_str() {
        "" | "b" => 0,
        x => match (x.get(..1).and_then(|c| "kmgtpe".find(c)), x.get(1..)) {
            (Some(p), Some("" | "b" | "i" | "ib")) => p as u32 + 1,
            _ => return Err(format!("unknown size suffix in '{s}'")),
        },
    };
    n.checked_mul(1i64 << (10 * power))
        .ok_or_else(|| format!("size '{s}' out of range"))
}

/// Classifies an unquoted integer literal with an optional nats-server size
/// suffix. `None` if the token is not of that form.
fn lex_int(tok: &str) -> Option<Result<i64, String>> {
    let start = usize::from(tok.starts_with('-'));
    let end = tok[start..]
        .find(|c: char| !c.is_ascii_digit())
        .map_or(tok.len(), |i| i + start);
    if end == start {
        return None;
    }
    let suffix = tok[end..].to_ascii_lowercase();
    let mult: i64 = match suffix.as_str() {
        "" => 1,
        x => {
            let p = "kmgtpe".find(x.get(..1)?)? as u32 + 1;
            match x.get(1..)? {
                "" => 1000i64.pow(p),
                "b" | "i" | "ib" => 1i64 << (10 * p),
                _ => return None,
            }
        }
    };
    let out_of_range = || format!("integer '{tok}' is out of range");
    Some(
        tok[..end]
            .parse::<i64>()
            .ok()
            .and_then(|n| n.checked_mul(mult))
            .ok_or_else(out_of_range),
    )
}

/// `-?digits.digits`, the only float form nats-server accepts.
fn is_float(tok: &str) -> bool {
    let t = tok.strip_prefix('-').unwrap_or(tok);
    matches!(t.split_once('.'), Some((a, b)) if !a.is_empty() && !b.is_empty()
        && a.bytes().all(|c| c.is_ascii_digit()) && b.bytes().all(|c| c.is_ascii_digit()))
}

fn is_inline_ws(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\r' | b'\n' | b'\x0b' | b'\x0c')
}

/// Bytes that end an unquoted value.
fn ends_value(b: u8) -> bool {
    is_ws(b) || matches!(b, b',' | b';' | b']' | b'}')
}

struct Parser<'a> {
    src: &'a str,
    b: &'a [u8],
    pos: usize,
    depth: usize,
    /// Maps under construction, outermost first: the scopes for `$VAR`.
    scopes: Vec<Map>,
    /// Directory for `include`; `None` means includes are not allowed.
    dir: Option<&'a Path>,
    env: EnvFn<'a>,
    /// Environment variables being expanded, for cycle detection.
    env_stack: Vec<String>,
    /// Files being parsed (this one last), for include cycle detection.
    chain: Vec<PathBuf>,
}

impl<'a> Parser<'a> {
    fn new(src: &'a str, dir: Option<&'a Path>, depth: usize, env: EnvFn<'a>) -> Self {
        Parser {
            src,
            b: src.as_bytes(),
            pos: 0,
            depth,
            scopes: Vec::new(),
            dir,
            env,
            env_stack: Vec::new(),
            chain: Vec::new(),
        }
    }

    fn err(&self, pos: usize, msg: impl Into<String>) -> ConfError {
        let mut p = pos.min(self.src.len());
        while !self.src.is_char_boundary(p) {
            p -= 1;
        }
        let before = &self.src[..p];
        let line = before.matches('\n').count() + 1;
        let col = before[before.rfind('\n').map_or(0, |i| i + 1)..]
            .chars()
            .count()
            + 1;
        ConfError {
            line,
            col,
            msg: msg.into(),
        }
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.pos).copied()
    }

    /// Raw text of the `'...'` or `"..."` run at `pos` (no escape processing).
    fn quoted_raw(&mut self, what: &str) -> Result<&'a str, ConfError> {
        let start = self.pos;
        let q = self.b[start];
        let Some(len) = self.b[start + 1..].iter().position(|&c| c == q) else {
            return Err(self.err(start, format!("unterminated {what}")));
        };
        self.pos = start + len + 2;
        Ok(&self.src[start + 1..start + 1 + len])
    }

    /// Describes what is at `pos`, for error messages.
    fn found(&self) -> String {
        match self.src.get(self.pos..).and_then(|s| s.chars().next()) {
            Some(c) => format!("'{}'", c.escape_default()),
            None => "end of input".to_string(),
        }
    }

    fn at_comment(&self) -> bool {
        self.peek() == Some(b'#') || self.b[self.pos.min(self.b.len())..].starts_with(b"//")
    }

    fn skip_inline_ws(&mut self) {
        while self.peek().is_some_and(is_inline_ws) {
            self.pos += 1;
        }
    }

    /// Skips whitespace, newlines and comments.
    fn skip_blank(&mut self) {
        loop {
            while self.peek().is_some_and(is_ws) {
                self.pos += 1;
            }
            if !self.at_comment() {
                return;
            }
            while self.peek().is_some_and(|b| b != b'\n') {
                self.pos += 1;
            }
        }
    }

    fn enter(&mut self, pos: usize) -> Result<(), ConfError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(self.err(pos, format!("nesting deeper than {MAX_DEPTH} levels")));
        }
        Ok(())
    }

    fn parse_document(mut self) -> Result<Map, ConfError> {
        self.skip_blank();
        // nats-server tolerates a JSON-like `{ ... }` around the whole file.
        let open = (self.peek() == Some(b'{')).then_some(self.pos);
        if open.is_some() {
            self.pos += 1;
        }
        let map = self.parse_map_body(open)?;
        self.skip_blank();
        if self.pos < self.b.len() {
            return Err(self.err(self.pos, format!("unexpected {}", self.found())));
        }
        Ok(map)
    }

    /// Parses entries up to the `}` matching `open`, or to end of input if `None`.
    fn parse_map_body(&mut self, open: Option<usize>) -> Result<Map, ConfError> {
        self.scopes.push(Map::default());
        let res = self.map_entries(open);
        let map = self.scopes.pop().unwrap_or_default();
        res.map(|()| map)
    }

    fn map_entries(&mut self, open: Option<usize>) -> Result<(), ConfError> {
        loop {
            self.skip_blank();
            match (self.peek(), open) {
                (None, None) => return Ok(()),
                (None, Some(p)) => return Err(self.err(p, "unterminated map: missing '}'")),
                (Some(b'}'), Some(_)) => {
                    self.pos += 1;
                    return Ok(());
                }
                (Some(b',' | b';'), _) => {
                    self.pos += 1;
                    continue;
                }
                _ => {}
            }
            self.parse_entry()?;
            self.skip_inline_ws();
            match self.peek() {
                None | Some(b'\n' | b'\r' | b'}') => {}
                Some(b',' | b';') => self.pos += 1,
                _ if self.at_comment() => {}
                _ => {
                    let msg = format!(
                        "expected a newline, ',' or ';' after value, found {}",
                        self.found()
                    );
                    return Err(self.err(self.pos, msg));
                }
            }
        }
    }

    fn parse_entry(&mut self) -> Result<(), ConfError> {
        let key_pos = self.pos;
        let (key, quoted) = self.parse_key()?;
        if !quoted && key.eq_ignore_ascii_case("include") && self.peek().is_some_and(is_inline_ws) {
            self.skip_inline_ws();
            if !matches!(self.peek(), Some(b'=' | b':')) {
                return self.parse_include(key_pos);
            }
        }
        // Like nats-server, the separator may even be on a following line.
        while self.peek().is_some_and(is_ws) {
            self.pos += 1;
        }
        if matches!(self.peek(), Some(b'=' | b':')) {
            // After an explicit separator the value must be on the same line,
            // so a missing value cannot swallow the next entry.
            self.pos += 1;
            self.skip_inline_ws();
        }
        if self
            .peek()
            .is_none_or(|b| matches!(b, b'\r' | b'\n' | b',' | b';' | b'}' | b']'))
        {
            return Err(self.err(
                self.pos,
                format!("expected a value for key '{key}', found {}", self.found()),
            ));
        }
        let value = self.parse_value()?;
        if let Some(scope) = self.scopes.last_mut() {
            scope.insert(key, value);
        }
        Ok(())
    }

    fn parse_key(&mut self) -> Result<(String, bool), ConfError> {
        let start = self.pos;
        if let Some(b'"' | b'\'') = self.peek() {
            return Ok((self.quoted_raw("quoted key")?.to_string(), true));
        }
        while self
            .peek()
            .is_some_and(|b| !is_ws(b) && !b"=:{}[],;".contains(&b))
        {
            self.pos += 1;
        }
        if self.pos == start {
            return Err(self.err(start, format!("expected a key, found {}", self.found())));
        }
        Ok((self.src[start..self.pos].to_string(), false))
    }

    fn parse_include(&mut self, key_pos: usize) -> Result<(), ConfError> {
        let start = self.pos;
        let name = match self.peek() {
            Some(b'"' | b'\'') => self.quoted_raw("include path")?,
            _ => {
                while self
                    .peek()
                    .is_some_and(|b| !is_ws(b) && b != b';' && b != b'}')
                {
                    self.pos += 1;
                }
                &self.src[start..self.pos]
            }
        };
        if name.is_empty() {
            return Err(self.err(start, "expected an include path"));
        }
        let Some(dir) = self.dir else {
            return Err(self.err(key_pos, "include is only supported when parsing a file"));
        };
        let path = dir.join(name);
        if self.depth + 1 > MAX_DEPTH {
            return Err(self.err(key_pos, "includes nested too deeply"));
        }
        if std::fs::canonicalize(&path).is_ok_and(|c| self.chain.contains(&c)) {
            return Err(self.err(
                key_pos,
                format!("include cycle: '{name}' is already being parsed"),
            ));
        }
        let included =
            parse_file_at(&path, self.depth + 1, self.env, &self.chain).map_err(|e| {
                let msg = format!(
                    "in include '{name}' (line {}, column {}): {}",
                    e.line, e.col, e.msg
                );
                self.err(key_pos, msg)
            })?;
        if let Some(scope) = self.scopes.last_mut() {
            for (k, v) in included.0 {
                scope.insert(k, v);
            }
        }
        Ok(())
    }

    fn parse_value(&mut self) -> Result<Value, ConfError> {
        let start = self.pos;
        match self.peek() {
            Some(b'{') => {
                self.enter(start)?;
                self.pos += 1;
                let map = self.parse_map_body(Some(start))?;
                self.depth -= 1;
                Ok(Value::Map(map))
            }
            Some(b'[') => {
                self.enter(start)?;
                self.pos += 1;
                let arr = self.parse_array(start)?;
                self.depth -= 1;
                Ok(Value::Array(arr))
            }
            Some(b'\'') => Ok(Value::Str(self.quoted_raw("string")?.to_string())),
            Some(b'"') => {
                let mut i = start + 1;
                while i < self.b.len() && self.b[i] != b'"' {
                    i += if self.b[i] == b'\\' { 2 } else { 1 };
                }
                if i >= self.b.len() {
                    return Err(self.err(start, "unterminated string"));
                }
                self.pos = i + 1;
                self.unescape(&self.src[start + 1..i], start + 1, true)
                    .map(Value::Str)
            }
            Some(b'(') => self.parse_block(start),
            Some(b) if !ends_value(b) => {
                while self.peek().is_some_and(|b| !ends_value(b)) {
                    self.pos += 1;
                }
                self.classify(start)
            }
            _ => Err(self.err(start, format!("expected a value, found {}", self.found()))),
        }
    }

    fn parse_array(&mut self, open: usize) -> Result<Vec<Value>, ConfError> {
        let mut items = Vec::new();
        loop {
            self.skip_blank();
            match self.peek() {
                None => return Err(self.err(open, "unterminated array: missing ']'")),
                Some(b']') => {
                    self.pos += 1;
                    return Ok(items);
                }
                Some(b',') => return Err(self.err(self.pos, "unexpected ',' in array")),
                _ => items.push(self.parse_value()?),
            }
            self.skip_inline_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                None | Some(b']' | b'\n' | b'\r') => {}
                _ if self.at_comment() => {}
                _ => {
                    let msg = format!(
                        "expected ',' or ']' after array value, found {}",
                        self.found()
                    );
                    return Err(self.err(self.pos, msg));
                }
            }
        }
    }

    /// `( ... )` block string, ended by a line holding only `)`; like nats-server
    /// the text keeps the newlines after `(` and before `)`.
    fn parse_block(&mut self, start: usize) -> Result<Value, ConfError> {
        let body = &self.src[start + 1..];
        let mut search = 0;
        while let Some(nl) = body[search..].find('\n').map(|i| search + i) {
            let line_end = body[nl + 1..].find('\n').map_or(body.len(), |i| nl + 1 + i);
            if body[nl + 1..line_end].trim() == ")" {
                let close = nl + 1 + body[nl + 1..line_end].find(')').unwrap_or(0);
                self.pos = start + 1 + close + 1;
                return Ok(Value::Str(body[..=nl].to_string()));
            }
            search = nl + 1;
        }
        Err(self.err(
            start,
            "unterminated block string: missing ')' on its own line",
        ))
    }

    /// Turns the unquoted token `src[start..pos]` into a value.
    fn classify(&mut self, start: usize) -> Result<Value, ConfError> {
        let tok = &self.src[start..self.pos];
        if tok.contains('\\') {
            return self.unescape(tok, start, false).map(Value::Str);
        }
        match tok.to_ascii_lowercase().as_str() {
            "true" | "yes" | "on" => return Ok(Value::Bool(true)),
            "false" | "no" | "off" => return Ok(Value::Bool(false)),
            _ => {}
        }
        if let Some(name) = tok.strip_prefix('$') {
            return self.resolve_var(name, start);
        }
        if let Some(res) = lex_int(tok) {
            return res.map(Value::Int).map_err(|m| self.err(start, m));
        }
        if is_float(tok) {
            return tok
                .parse()
                .map(Value::Float)
                .map_err(|_| self.err(start, format!("invalid float '{tok}'")));
        }
        Ok(Value::Str(tok.to_string()))
    }

    fn resolve_var(&mut self, name: &str, pos: usize) -> Result<Value, ConfError> {
        // Bare bcrypt hashes (`$2a$11$...`) are strings, not variables.
        if ["2a$", "2b$", "2y$"].iter().any(|p| name.starts_with(p)) {
            return Ok(Value::Str(format!("${name}")));
        }
        if let Some(v) = self.scopes.iter().rev().find_map(|m| m.get_exact(name)) {
            return Ok(v.clone());
        }
        if self.env_stack.iter().any(|n| n == name) {
            return Err(self.err(pos, format!("variable reference cycle for '{name}'")));
        }
        let Some(raw) = (self.env)(name) else {
            return Err(self.err(
                pos,
                format!("variable reference for '{name}' can not be found"),
            ));
        };
        let text = format!("pk={raw}");
        let mut sub = Parser::new(&text, None, self.depth, self.env);
        sub.env_stack = self.env_stack.clone();
        sub.env_stack.push(name.to_string());
        let parsed = sub.parse_document().map_err(|e| {
            self.err(
                pos,
                format!(
                    "environment variable '{name}' could not be parsed: {}",
                    e.msg
                ),
            )
        })?;
        parsed
            .get_exact("pk")
            .cloned()
            .ok_or_else(|| self.err(pos, format!("environment variable '{name}' is empty")))
    }

    /// Processes `\t \n \r \" \\ \xHH \uHHHH`. Unknown escapes are errors when
    /// `strict` (quoted strings) and kept literally otherwise (bare strings).
    fn unescape(&self, raw: &str, base: usize, strict: bool) -> Result<String, ConfError> {
        let b = raw.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        let hex = |from: usize, n: usize| -> Option<u32> {
            let digits = b.get(from..from + n)?;
            digits.iter().all(u8::is_ascii_hexdigit).then(|| {
                digits.iter().fold(0, |acc, &d| {
                    acc * 16 + (d as char).to_digit(16).unwrap_or(0)
                })
            })
        };
        while i < b.len() {
            if b[i] != b'\\' {
                out.push(b[i]);
                i += 1;
                continue;
            }
            let simple = match b.get(i + 1) {
                Some(b't') => Some(b'\t'),
                Some(b'n') => Some(b'\n'),
                Some(b'r') => Some(b'\r'),
                Some(b'"') => Some(b'"'),
                Some(b'\\') => Some(b'\\'),
                _ => None,
            };
            if let Some(c) = simple {
                out.push(c);
                i += 2;
            } else if let (Some(b'x'), Some(v)) = (b.get(i + 1), hex(i + 2, 2)) {
                out.push(v as u8);
                i += 4;
            } else if let (Some(b'u'), Some(c)) =
                (b.get(i + 1), hex(i + 2, 4).and_then(char::from_u32))
            {
                out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                i += 6;
            } else if strict {
                let msg = "invalid escape: use \\t, \\n, \\r, \\\", \\\\, \\xHH or \\uHHHH";
                return Err(self.err(base + i, msg));
            } else {
                out.push(b'\\');
                i += 1;
            }
        }
        String::from_utf8(out)
            .map_err(|_| self.err(base, "string is not valid UTF-8 after escapes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Map {
        parse(text).unwrap_or_else(|e| panic!("{e}\n--- input ---\n{text}"))
    }

    fn s(v: &str) -> Value {
        Value::Str(v.to_string())
    }

    /// `path` is `/`-separated keys through nested maps.
    fn at<'m>(m: &'m Map, path: &str) -> &'m Value {
        let mut keys = path.split('/');
        let first = m.get(keys.next().unwrap()).expect(path);
        keys.fold(first, |v, k| v.as_map().and_then(|m| m.get(k)).expect(path))
    }

    fn with_env(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Map, ConfError> {
        Parser::new(text, None, 0, env).parse_document()
    }

    #[test]
    fn separators_and_map_forms() {
        let m = p("a: 1\nb = 2\nc 3\nd:4\ne=5");
        let got: Vec<i64> = m.iter().map(|(_, v)| v.as_i64().unwrap()).collect();
        assert_eq!(got, [1, 2, 3, 4, 5]);
        for text in [
            "js { d: \"/x\" }",
            "js: { d: \"/x\" }",
            "js = {d = \"/x\"}",
            "js {\n d /x\n}",
        ] {
            assert_eq!(at(&p(text), "js/d"), &s("/x"), "{text}");
        }
        assert_eq!(at(&p("foo\n  = 1"), "foo"), &Value::Int(1));
        let m = p("a: 1, b: 2; c: 3\nm { x: 1; y: 2, z: 3 }");
        assert_eq!((m.len(), at(&m, "m").as_map().unwrap().len()), (4, 3));
        assert_eq!(
            at(&p("{ \"a\": 1, \"b\": [true] }"), "b"),
            &Value::Array(vec![Value::Bool(true)])
        );
    }

    #[test]
    fn comments_keys_and_case_insensitive_get() {
        let m = p(
            "# top\n// also\na: 1 # c\nb: \"x # y // z\" // c\nurl: nats://h:4222\n\
                   'q k': 1\n\"d.k\": 2\nmax-x_1.y: 3",
        );
        assert_eq!(at(&m, "A"), &Value::Int(1));
        assert_eq!(at(&m, "b"), &s("x # y // z"));
        assert_eq!(at(&m, "url"), &s("nats://h:4222"));
        assert_eq!(at(&m, "Q K"), &Value::Int(1));
        assert_eq!(at(&m, "d.k"), &Value::Int(2));
        assert_eq!(at(&m, "MAX-X_1.Y"), &Value::Int(3));
        assert_eq!(m.get("nope"), None);
        assert_eq!(
            at(&p("a: 1\nA: 2\na: 3"), "a"),
            &Value::Int(3),
            "last one wins"
        );
    }

    #[test]
    fn strings_and_escapes() {
        let m = p(
            "a: \"t\\tn\\nq\\\"b\\\\x\\x41u\\u00e9\"\nb: 'raw \\n \"q\"'\nc: \"multi\nline\"\n\
                   d: a\\tb\ne: C:\\dir\nf: '', g: \"\"",
        );
        assert_eq!(at(&m, "a"), &s("t\tn\nq\"b\\xAu\u{e9}"));
        assert_eq!(at(&m, "b"), &s("raw \\n \"q\""));
        assert_eq!(at(&m, "c"), &s("multi\nline"));
        assert_eq!(at(&m, "d"), &s("a\tb"));
        assert_eq!(at(&m, "e"), &s("C:\\dir"));
        assert_eq!((at(&m, "f"), at(&m, "g")), (&s(""), &s("")));
        let e = parse("a: 1\nb: \"bad \\q\"").unwrap_err();
        assert_eq!((e.line, e.col), (2, 9));
        assert!(parse("a: \"\\uD800\"").is_err());
        let m = p("blk: (\nline one\n  line two\n)\nnext: 1");
        assert_eq!(at(&m, "blk"), &s("\nline one\n  line two\n"));
        assert_eq!(at(&m, "next"), &Value::Int(1));
    }

    #[test]
    fn numbers_bools_and_bare_strings() {
        let m =
            p("a: 42\nb: -7\nc: 1.5\nd: -0.25\ne: TRUE\nf: off\ng: Yes\nh: no\ni: On\nj: False");
        assert_eq!(
            (at(&m, "a"), at(&m, "b")),
            (&Value::Int(42), &Value::Int(-7))
        );
        assert_eq!(
            (at(&m, "c"), at(&m, "d")),
            (&Value::Float(1.5), &Value::Float(-0.25))
        );
        let bools: Vec<_> = "efghij"
            .chars()
            .map(|k| at(&m, &k.to_string()).as_bool())
            .collect();
        assert_eq!(bools, [true, false, true, false, true, false].map(Some));
        let text = "l: 127.0.0.1:4222\nd: /tmp/js\nw: 10s\nx: 500ms\ny: 1h30m\nz: always\n\
                    ip: 10.0.0.1\nt: truex";
        let m = p(text);
        for line in text.lines() {
            let (k, v) = line.split_once(": ").unwrap();
            assert_eq!(at(&m, k), &s(v), "{k}");
        }
        assert!(parse("a: 99999999999999999999").is_err());
    }

    #[test]
    fn size_suffixes_match_nats_server() {
        // Unquoted `2m` is 2 million, exactly as in nats-server (not a duration).
        let cases = "1k=1000 1K=1000 1kb=1024 1KiB=1024 2ki=2048 1MB=1048576 64MiB=67108864 \
                     2m=2000000 512MB=536870912 1G=1000000000 1GB=1073741824 10GB=10737418240 \
                     1t=1000000000000 1TiB=1099511627776 1pb=1125899906842624 -1k=-1000";
        for case in cases.split_whitespace() {
            let (lit, want) = case.split_once('=').unwrap();
            assert_eq!(
                at(&p(&format!("v: {lit}")), "v"),
                &Value::Int(want.parse().unwrap()),
                "{lit}"
            );
        }
        assert!(parse("v: 9eb").is_err(), "overflow must be an error");
        assert_eq!(at(&p("v: 1kbb"), "v"), &s("1kbb"));
    }

    #[test]
    fn arrays() {
        let m =
            p("a: [1, two, \"three\", [4], {k: v}]\nb: [\n  x\n  y, # c\n  z,\n]\nc: []\nd [1,2]");
        let a = at(&m, "a").as_array().unwrap();
        assert_eq!(
            a[..4],
            [
                Value::Int(1),
                s("two"),
                s("three"),
                Value::Array(vec![Value::Int(4)])
            ]
        );
        assert_eq!(at(a[4].as_map().unwrap(), "k"), &s("v"));
        assert_eq!(at(&m, "b"), &Value::Array(vec![s("x"), s("y"), s("z")]));
        assert_eq!(at(&m, "c"), &Value::Array(vec![]));
        assert_eq!(at(&m, "d").as_array().unwrap().len(), 2);
        assert!(parse("a: [1,,2]").is_err());
    }

    #[test]
    fn variables() {
        let env = |n: &str| {
            let vars = [
                ("PORT", "4333"),
                ("HOST", "0.0.0.0"),
                ("L1", "$L2"),
                ("L2", "$L1"),
                ("NONE", ""),
            ];
            vars.iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        };
        let text = "pw: s3cret\nport: $PORT\nhost = $HOST\nauth { user: a, password: $pw }\n\
                    m { inner: 5, x: [ $inner ] }\nhash: $2a$11$abc\nq: \"$PORT\"";
        let m = with_env(text, &env).unwrap();
        assert_eq!(at(&m, "port"), &Value::Int(4333));
        assert_eq!(at(&m, "host"), &s("0.0.0.0"));
        assert_eq!(at(&m, "auth/password"), &s("s3cret"));
        assert_eq!(at(&m, "m/x"), &Value::Array(vec![Value::Int(5)]));
        assert_eq!(at(&m, "hash"), &s("$2a$11$abc"));
        assert_eq!(at(&m, "q"), &s("$PORT"));
        let e = with_env("a: 1\nb: $MISSING", &env).unwrap_err();
        assert_eq!((e.line, e.col), (2, 4));
        assert!(with_env("a: $L1", &env).unwrap_err().msg.contains("cycle"));
        assert!(with_env("a: $NONE", &env).is_err());
    }

    #[test]
    fn includes() {
        let dir = std::env::temp_dir().join(format!("keel-conf-test-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let files = [
            (
                "main.conf",
                "a: 1\ninclude ./sub/users.conf\nauth {\n  include 'sub/pw.conf'\n}\n",
            ),
            (
                "sub/users.conf",
                "users: [{user: x}]\ninclude \"deeper.conf\"",
            ),
            ("sub/deeper.conf", "deep: true"),
            ("sub/pw.conf", "password: pw"),
            ("cycle.conf", "include cycle.conf"),
            ("bad.conf", "ok: 1\ninclude sub/broken.conf"),
            ("sub/broken.conf", "x: \"open"),
        ];
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        let m = parse_file(&dir.join("main.conf")).unwrap();
        assert_eq!(at(&m, "a"), &Value::Int(1));
        assert_eq!(at(&m, "users").as_array().unwrap().len(), 1);
        assert_eq!(at(&m, "deep"), &Value::Bool(true));
        assert_eq!(at(&m, "auth/password"), &s("pw"));
        assert!(parse_file(&dir.join("cycle.conf"))
            .unwrap_err()
            .msg
            .contains("include cycle"));
        let e = parse_file(&dir.join("bad.conf")).unwrap_err();
        assert_eq!(e.line, 2);
        assert!(
            e.msg.contains("broken.conf") && e.msg.contains("unterminated string"),
            "{}",
            e.msg
        );
        assert!(parse_file(&dir.join("missing.conf")).is_err());
        assert!(parse("include ./x.conf")
            .unwrap_err()
            .msg
            .contains("include"));
        assert_eq!(
            at(&p("include: 5"), "include"),
            &Value::Int(5),
            "a key when followed by ':'"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn errors_have_positions() {
        let cases = [
            ("a: 1\nb: \"open", 2, 4),
            ("a: 'open", 1, 4),
            ("a {\n b: 1\n", 1, 3),
            ("a: [1, 2", 1, 4),
            ("a: (\nno end", 1, 4),
            ("a: 1 2", 1, 6),
            ("a:", 1, 3),
            ("a: 1\n}", 2, 1),
            ("x: 1\n  = 2", 2, 3),
            ("a:\nb: 1", 1, 3),
        ];
        for (text, line, col) in cases {
            let e = parse(text).unwrap_err();
            assert_eq!((e.line, e.col), (line, col), "{text:?}: {e}");
        }
        let e = ConfError {
            line: 3,
            col: 7,
            msg: "boom".into(),
        };
        assert_eq!(e.to_string(), "Parse error on line 3, column 7: boom");
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        for open in ["[", "{a:"] {
            let text = format!("a: {}", open.repeat(100_000));
            assert!(parse(&text).unwrap_err().msg.contains("nesting"));
        }
        assert!(parse(&format!("a: {}1{}", "[".repeat(100), "]".repeat(100))).is_ok());
    }

    #[test]
    fn random_input_never_panics() {
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let alphabet = b"ab1 \t\n:=,;{}[]()\"'\\#/$-.kKmMiIbB0xu\r\xc3\xa9";
        let seed = b"a: 1\nb { c: [1, \"x\", 'y'] }\nd: $a\ne: (\nz\n)\nf: 1MB\ng: 1.5s\n";
        for round in 0..20_000 {
            let mut bytes = seed.to_vec();
            if round % 2 == 0 {
                let len = next() % 64;
                bytes = (0..len)
                    .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                    .collect();
            } else {
                for _ in 0..1 + next() % 4 {
                    let i = (next() % bytes.len() as u64) as usize;
                    bytes[i] = next() as u8;
                }
            }
            let text = String::from_utf8_lossy(&bytes);
            let _ = (parse(&text), parse_duration(&text), parse_size(&text));
        }
    }

    #[test]
    fn durations() {
        let ms = Duration::from_millis;
        let ok = [
            ("2m", ms(120_000)),
            ("1s", ms(1000)),
            ("500ms", ms(500)),
            ("1h30m", ms(5_400_000)),
            ("1.5s", ms(1500)),
            (".5m", ms(30_000)),
            ("30", ms(30_000)),
            ("0", ms(0)),
            ("10us", Duration::from_micros(10)),
            ("10\u{b5}s", Duration::from_micros(10)),
            ("7ns", Duration::from_nanos(7)),
        ];
        for (text, want) in ok {
            assert_eq!(parse_duration(text), Ok(want), "{text}");
        }
        for bad in ["", "3d", "1.5", "s", "-1s", "1..2s", "abc", "9999999999h"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sizes_from_strings_are_binary() {
        let ok = "1024=1024 1K=1024 1k=1024 64MiB=67108864 1GB=1073741824 512MB=536870912 \
                  10G=10737418240 -1=-1";
        for case in ok.split_whitespace() {
            let (text, want) = case.split_once('=').unwrap();
            assert_eq!(parse_size(text), Ok(want.parse().unwrap()), "{text}");
        }
        for bad in ["", "MB", "1.5G", "1X", "1kbb", "99999999999EB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn value_accessors() {
        assert_eq!(Value::Int(5).as_duration(), Ok(Duration::from_secs(5)));
        assert_eq!(s("2m").as_duration(), Ok(Duration::from_secs(120)));
        assert_eq!(
            Value::Float(0.5).as_duration(),
            Ok(Duration::from_millis(500))
        );
        assert!(Value::Int(-1).as_duration().is_err() && Value::Bool(true).as_duration().is_err());
        assert_eq!(
            (Value::Int(1 << 20).as_size(), s("1G").as_size()),
            (Ok(1 << 20), Ok(1 << 30))
        );
        assert!(Value::Array(vec![]).as_size().is_err());
        assert_eq!(
            (Value::Int(3).as_f64(), s("x").as_str(), s("x").as_i64()),
            (Some(3.0), Some("x"), None)
        );
    }

    #[test]
    fn reference_capture_configs() {
        let m = p("max_payload: 1024\n");
        assert_eq!(at(&m, "max_payload").as_size(), Ok(1024));
        let m = p("ping_interval: \"1s\"\nping_max: 2\n");
        assert_eq!(
            at(&m, "ping_interval").as_duration(),
            Ok(Duration::from_secs(1))
        );
        assert_eq!(at(&m, "ping_max"), &Value::Int(2));
        let m = p("lame_duck_duration: \"30s\"\nlame_duck_grace_period: \"1s\"\n");
        assert_eq!(
            at(&m, "lame_duck_duration").as_duration(),
            Ok(Duration::from_secs(30))
        );
        assert_eq!(
            at(&p("jetstream { domain: \"hub\" }"), "jetstream/domain"),
            &s("hub")
        );
        // Verbatim from captures/core/auth.json.
        let auth = r#"
authorization {
  users = [
    {user: alice, password: s3cret}
    {user: bob, password: pw, permissions: {publish: {allow: ["bob.>"]}, subscribe: {allow: ["bob.>", "_INBOX.>"]}}}
  ]
  timeout: 1
}
"#;
        let m = p(auth);
        assert_eq!(at(&m, "authorization/timeout"), &Value::Int(1));
        let users = at(&m, "authorization/users").as_array().unwrap();
        assert_eq!(users.len(), 2);
        assert_eq!(at(users[0].as_map().unwrap(), "password"), &s("s3cret"));
        let allow = at(users[1].as_map().unwrap(), "permissions/subscribe/allow");
        assert_eq!(allow, &Value::Array(vec![s("bob.>"), s("_INBOX.>")]));
    }

    #[test]
    fn realistic_config() {
        let text = r#"# keel
server_name: "n1"
listen = 127.0.0.1:4222
http_port: 8222
max_payload: 1MB
max_connections: 1000
ping_interval: "2m"
ping_max: 2
write_deadline: "10s"
jetstream {
  store_dir: "/tmp/keel"
  max_memory_store: 1GiB
  max_file_store = 10GB
  sync_interval: always
}
"#;
        let m = p(text);
        let keys: Vec<&str> = m.iter().map(|(k, _)| k).collect();
        assert_eq!(keys[..3], ["server_name", "listen", "http_port"]);
        assert_eq!(
            (at(&m, "server_name"), at(&m, "listen")),
            (&s("n1"), &s("127.0.0.1:4222"))
        );
        assert_eq!(
            (at(&m, "http_port"), at(&m, "max_connections")),
            (&Value::Int(8222), &Value::Int(1000))
        );
        assert_eq!(at(&m, "max_payload"), &Value::Int(1_048_576));
        assert_eq!(
            at(&m, "ping_interval").as_duration(),
            Ok(Duration::from_secs(120))
        );
        assert_eq!(
            at(&m, "write_deadline").as_duration(),
            Ok(Duration::from_secs(10))
        );
        assert_eq!(at(&m, "jetstream/store_dir"), &s("/tmp/keel"));
        assert_eq!(at(&m, "jetstream/max_memory_store").as_size(), Ok(1 << 30));
        assert_eq!(at(&m, "jetstream/max_file_store").as_size(), Ok(10 << 30));
        assert_eq!(at(&m, "jetstream/sync_interval"), &s("always"));
    }
}
