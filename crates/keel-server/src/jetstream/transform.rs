//! Subject transforms: a source pattern and a destination made of literal tokens, `$n` and
//! the reference's mustache functions (`{{wildcard(n)}}`, `{{partition(n,i..)}}`,
//! `{{split(i,sep)}}`, `{{splitFromLeft(i,n)}}`, `{{splitFromRight(i,n)}}`,
//! `{{sliceFromLeft(i,n)}}`, `{{sliceFromRight(i,n)}}`, `{{left(i,n)}}`, `{{right(i,n)}}`,
//! `{{random(n)}}`). Streams use them for `subject_transform` and `republish`, sources and
//! mirrors for `subject_transforms`; account imports can reuse them later.
//!
//! Construction checks what the reference checks and fails with its texts, which the API
//! puts into its errors (`stream transform: invalid mapping destination: ...`). A transform
//! is pure: [`Transform::apply`] turns a literal subject matching the source into the
//! destination subject, or None.

use std::fmt;

/// What went wrong building a transform, worded as the reference words it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransformError {
    /// A source or destination that is not a subject (`invalid subject`).
    BadSubject,
    /// A destination problem, with the token it was found in (may be empty).
    Mapping { token: String, kind: Mapping },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    InvalidSubject,
    UnknownFunction,
    IndexOutOfRange,
    NotEnoughArgs,
    InvalidArg,
    TooManyArgs,
}

impl Mapping {
    fn text(self) -> &'static str {
        match self {
            Mapping::InvalidSubject => "invalid mapping destination: invalid transform",
            Mapping::UnknownFunction => "invalid mapping destination: unknown function",
            Mapping::IndexOutOfRange => "invalid mapping destination: wildcard index out of range",
            Mapping::NotEnoughArgs => {
                "invalid mapping destination: not enough arguments passed to the function"
            }
            Mapping::InvalidArg => {
                "invalid mapping destination: function argument is invalid or in the wrong format"
            }
            Mapping::TooManyArgs => {
                "invalid mapping destination: too many arguments passed to the function"
            }
        }
    }
}

impl fmt::Display for TransformError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransformError::BadSubject => f.write_str("invalid subject"),
            TransformError::Mapping { token, kind } if token.is_empty() => f.write_str(kind.text()),
            TransformError::Mapping { token, kind } => write!(f, "{} in {token}", kind.text()),
        }
    }
}

fn err(token: &str, kind: Mapping) -> TransformError {
    TransformError::Mapping {
        token: token.to_string(),
        kind,
    }
}

/// One destination token.
#[derive(Debug, Clone, PartialEq)]
enum Func {
    Literal,
    /// Source token positions (not wildcard numbers) are stored from here on.
    Wildcard(usize),
    Partition(u32, Vec<usize>),
    SplitFromLeft(usize, i32),
    SplitFromRight(usize, i32),
    SliceFromLeft(usize, i32),
    SliceFromRight(usize, i32),
    Split(usize, String),
    Left(usize, i32),
    Right(usize, i32),
    Random(i32),
}

/// A parsed destination token before its wildcard numbers are mapped to source positions.
enum Parsed {
    Literal,
    /// A function of one source wildcard (its 1-based number), with its integer argument
    /// and, for `split`, the separator.
    Indexed(usize, i32, String, Kind),
    Partition(u32, Vec<usize>),
    Random(i32),
}

#[derive(Clone, Copy)]
enum Kind {
    Wildcard,
    SplitFromLeft,
    SplitFromRight,
    SliceFromLeft,
    SliceFromRight,
    Left,
    Right,
    Split,
}

/// A compiled transform.
#[derive(Debug, Clone, PartialEq)]
pub struct Transform {
    src: String,
    dest: String,
    stoks: Vec<String>,
    dtoks: Vec<String>,
    funcs: Vec<Func>,
    /// `>` to `>`: every subject maps to itself.
    identity: bool,
}

/// (valid, tokens, number of `*`, has `>`) as the reference's subjectInfo.
fn subject_info(subject: &str) -> Option<(Vec<&str>, usize, bool)> {
    if subject.is_empty() {
        return None;
    }
    let mut pwcs = 0;
    let mut fwc = false;
    let tokens: Vec<&str> = subject.split('.').collect();
    for t in &tokens {
        if t.is_empty() || fwc {
            return None;
        }
        match *t {
            ">" => fwc = true,
            "*" => pwcs += 1,
            _ => {}
        }
    }
    Some((tokens, pwcs, fwc))
}

/// The function names, where an uppercase letter also matches its lowercase (the
/// reference's `[wW]ildcard`, `[sS]plit[fF]rom[lL]eft`...).
const NAMES: [&str; 10] = [
    "Wildcard",
    "Partition",
    "SplitFromLeft",
    "SplitFromRight",
    "SliceFromLeft",
    "SliceFromRight",
    "Right",
    "Left",
    "Split",
    "Random",
];

fn name_matches(pattern: &str, name: &str) -> bool {
    pattern.len() == name.len()
        && pattern.chars().zip(name.chars()).all(|(p, n)| {
            if p.is_ascii_uppercase() {
                n == p || n == p.to_ascii_lowercase()
            } else {
                n == p
            }
        })
}

/// For a `{{name(args)}}` token: the function pattern it names and its arguments split on
/// `,` plus any whitespace (as the reference's regular expressions do), or None when the
/// token is not a call of a known function.
fn call(token: &str) -> Option<(&'static str, Vec<&str>)> {
    let inner = token.strip_prefix("{{")?.strip_suffix("}}")?;
    let inner = inner.trim_start().trim_end();
    let open = inner.find('(')?;
    let body = inner.strip_suffix(')')?;
    let name = inner[..open].trim_end();
    let pattern = NAMES.iter().find(|p| name_matches(p, name))?;
    let args = &body[open + 1..];
    let mut out = vec![];
    let mut rest = args;
    loop {
        match rest.find(',') {
            Some(i) => {
                out.push(&rest[..i]);
                rest = rest[i + 1..].trim_start();
            }
            None => {
                out.push(rest);
                break;
            }
        }
    }
    Some((pattern, out))
}

fn int_arg(token: &str, s: &str) -> Result<i64, TransformError> {
    s.trim_matches(' ')
        .parse::<i64>()
        .map_err(|_| err(token, Mapping::InvalidArg))
}

fn index_int(token: &str, args: &[&str], kind: Kind) -> Result<Parsed, TransformError> {
    if args.len() < 2 {
        return Err(err(token, Mapping::NotEnoughArgs));
    }
    if args.len() > 2 {
        return Err(err(token, Mapping::TooManyArgs));
    }
    let i = int_arg(token, args[0])?;
    let n = int_arg(token, args[1])?;
    if i < 0 || n < i32::MIN as i64 || n > i32::MAX as i64 {
        return Err(err(token, Mapping::InvalidArg));
    }
    Ok(Parsed::Indexed(i as usize, n as i32, String::new(), kind))
}

fn parse_token(token: &str) -> Result<Parsed, TransformError> {
    if token.len() <= 1 {
        return Ok(Parsed::Literal);
    }
    if let Some(n) = token.strip_prefix('$') {
        // `$x` that is not a number stays literal (other features use `$` tokens).
        return Ok(match n.parse::<usize>() {
            Ok(i) => Parsed::Indexed(i, 0, String::new(), Kind::Wildcard),
            Err(_) => Parsed::Literal,
        });
    }
    if !(token.len() > 4 && token.starts_with("{{") && token.ends_with("}}")) {
        return Ok(Parsed::Literal);
    }
    let Some((name, args)) = call(token) else {
        return Err(err(token, Mapping::UnknownFunction));
    };
    match name {
        "Wildcard" => {
            if args.len() == 1 && args[0].is_empty() {
                return Err(err(token, Mapping::NotEnoughArgs));
            }
            if args.len() > 1 {
                return Err(err(token, Mapping::TooManyArgs));
            }
            let i = int_arg(token, args[0])?;
            if i < 0 {
                return Err(err(token, Mapping::InvalidArg));
            }
            Ok(Parsed::Indexed(
                i as usize,
                0,
                String::new(),
                Kind::Wildcard,
            ))
        }
        "Partition" => {
            let n = int_arg(token, args[0])?;
            if !(0..=i32::MAX as i64).contains(&n) {
                return Err(err(token, Mapping::InvalidArg));
            }
            let mut idx = vec![];
            for a in &args[1..] {
                let i = int_arg(token, a)?;
                if i < 0 {
                    return Err(err(token, Mapping::InvalidArg));
                }
                idx.push(i as usize);
            }
            Ok(Parsed::Partition(n as u32, idx))
        }
        "SplitFromLeft" => index_int(token, &args, Kind::SplitFromLeft),
        "SplitFromRight" => index_int(token, &args, Kind::SplitFromRight),
        "SliceFromLeft" => index_int(token, &args, Kind::SliceFromLeft),
        "SliceFromRight" => index_int(token, &args, Kind::SliceFromRight),
        "Right" => index_int(token, &args, Kind::Right),
        "Left" => index_int(token, &args, Kind::Left),
        "Split" => {
            if args.len() < 2 {
                return Err(err(token, Mapping::NotEnoughArgs));
            }
            if args.len() > 2 {
                return Err(err(token, Mapping::TooManyArgs));
            }
            let i = int_arg(token, args[0])?;
            if i < 0 || args[1].contains(' ') || args[1].contains('.') {
                return Err(err(token, Mapping::InvalidArg));
            }
            Ok(Parsed::Indexed(
                i as usize,
                0,
                args[1].to_string(),
                Kind::Split,
            ))
        }
        "Random" => {
            if args.len() != 1 {
                return Err(err(token, Mapping::NotEnoughArgs));
            }
            let n = int_arg(token, args[0])?;
            if !(i32::MIN as i64..=i32::MAX as i64).contains(&n) {
                return Err(err(token, Mapping::InvalidArg));
            }
            Ok(Parsed::Random(n as i32))
        }
        _ => Err(err(token, Mapping::UnknownFunction)),
    }
}

impl Transform {
    /// Builds a transform from `src` (empty means `>`) to `dest`; None when `dest` is empty
    /// (no transform), as the reference.
    pub fn new(src: &str, dest: &str) -> Result<Option<Transform>, TransformError> {
        if dest.is_empty() {
            return Ok(None);
        }
        let src = if src.is_empty() { ">" } else { src };
        let (stoks, npwcs, sfwc) = subject_info(src).ok_or(TransformError::BadSubject)?;
        let (dtoks, dpwcs, dfwc) = subject_info(dest).ok_or(TransformError::BadSubject)?;
        if dpwcs > 0 || sfwc != dfwc {
            return Err(TransformError::BadSubject);
        }
        // Wildcard number n (1-based) -> its source token position.
        let positions: Vec<usize> = stoks
            .iter()
            .enumerate()
            .filter(|(_, t)| **t == "*")
            .map(|(i, _)| i)
            .collect();
        let position = |n: usize| -> usize {
            // Number 0 has no wildcard; the reference then reads token 0.
            if n == 0 {
                0
            } else {
                positions[n - 1]
            }
        };
        let mut funcs = Vec::with_capacity(dtoks.len());
        for token in &dtoks {
            let parsed = parse_token(token)?;
            let f = match parsed {
                Parsed::Literal => Func::Literal,
                Parsed::Random(n) => Func::Random(n),
                Parsed::Partition(n, idx) => {
                    if npwcs == 0 && !sfwc {
                        // Without wildcards in the source the whole subject is the key (the
                        // reference ignores token arguments there).
                        Func::Partition(n, vec![])
                    } else {
                        let mut p = vec![];
                        for i in idx {
                            if i > npwcs {
                                return Err(err(
                                    &format!("{token}: [{i}]"),
                                    Mapping::IndexOutOfRange,
                                ));
                            }
                            p.push(position(i));
                        }
                        Func::Partition(n, p)
                    }
                }
                Parsed::Indexed(i, n, sep, kind) => {
                    if npwcs == 0 && !sfwc {
                        return Err(err(token, Mapping::IndexOutOfRange));
                    }
                    if i > npwcs {
                        return Err(err(&format!("{token}: [{i}]"), Mapping::IndexOutOfRange));
                    }
                    let p = position(i);
                    match kind {
                        Kind::Wildcard => Func::Wildcard(p),
                        Kind::SplitFromLeft => Func::SplitFromLeft(p, n),
                        Kind::SplitFromRight => Func::SplitFromRight(p, n),
                        Kind::SliceFromLeft => Func::SliceFromLeft(p, n),
                        Kind::SliceFromRight => Func::SliceFromRight(p, n),
                        Kind::Left => Func::Left(p, n),
                        Kind::Right => Func::Right(p, n),
                        Kind::Split => Func::Split(p, sep),
                    }
                }
            };
            funcs.push(f);
        }
        let identity = src == ">" && dest == ">";
        Ok(Some(Transform {
            src: src.to_string(),
            dest: dest.to_string(),
            stoks: stoks.iter().map(|s| s.to_string()).collect(),
            dtoks: dtoks.iter().map(|s| s.to_string()).collect(),
            funcs,
            identity,
        }))
    }

    pub fn src(&self) -> &str {
        &self.src
    }

    pub fn dest(&self) -> &str {
        &self.dest
    }

    /// The destination for a literal subject matching the source, else None.
    pub fn apply(&self, subject: &str) -> Option<String> {
        if self.identity {
            return Some(subject.to_string());
        }
        let tokens: Vec<&str> = subject.split('.').collect();
        if tokens
            .iter()
            .any(|t| t.is_empty() || *t == "*" || *t == ">")
        {
            return None;
        }
        if self.src != ">"
            && !keel_protocol::subject::matches(self.src.as_bytes(), subject.as_bytes())
        {
            return None;
        }
        Some(self.render(&tokens))
    }

    fn render(&self, tokens: &[&str]) -> String {
        let mut b = String::with_capacity(self.dest.len() + 16);
        let last = self.funcs.len() - 1;
        for (i, f) in self.funcs.iter().enumerate() {
            match f {
                Func::Literal => {
                    if self.dtoks[i] == ">" {
                        break;
                    }
                    b.push_str(&self.dtoks[i]);
                }
                Func::Wildcard(p) => {
                    if let Some(t) = tokens.get(*p) {
                        b.push_str(t);
                    }
                }
                Func::Partition(n, idx) => {
                    let key: String = if idx.is_empty() {
                        tokens.join(".")
                    } else {
                        idx.iter().map(|p| tokens[*p]).collect()
                    };
                    b.push_str(&partition(key.as_bytes(), *n).to_string());
                }
                Func::SplitFromLeft(p, n) => {
                    let t = tokens[*p];
                    let n = *n as isize;
                    if n > 0 && (n as usize) < t.len() {
                        b.push_str(&t[..n as usize]);
                        b.push('.');
                        b.push_str(&t[n as usize..]);
                    } else {
                        b.push_str(t);
                    }
                }
                Func::SplitFromRight(p, n) => {
                    let t = tokens[*p];
                    let n = *n as isize;
                    if n > 0 && (n as usize) < t.len() {
                        let cut = t.len() - n as usize;
                        b.push_str(&t[..cut]);
                        b.push('.');
                        b.push_str(&t[cut..]);
                    } else {
                        b.push_str(t);
                    }
                }
                Func::SliceFromLeft(p, n) => {
                    let t = tokens[*p];
                    let size = *n as isize;
                    if size > 0 && (size as usize) < t.len() {
                        let size = size as usize;
                        let mut j = 0;
                        while j + size <= t.len() {
                            if j != 0 {
                                b.push('.');
                            }
                            b.push_str(&t[j..j + size]);
                            if j + size != t.len() && j + 2 * size > t.len() {
                                b.push('.');
                                b.push_str(&t[j + size..]);
                                break;
                            }
                            j += size;
                        }
                    } else {
                        b.push_str(t);
                    }
                }
                Func::SliceFromRight(p, n) => {
                    let t = tokens[*p];
                    let size = *n as isize;
                    if size > 0 && (size as usize) < t.len() {
                        let size = size as usize;
                        let rem = t.len() % size;
                        if rem > 0 {
                            b.push_str(&t[..rem]);
                            b.push('.');
                        }
                        let mut j = rem;
                        while j + size <= t.len() {
                            b.push_str(&t[j..j + size]);
                            if j + size < t.len() {
                                b.push('.');
                            }
                            j += size;
                        }
                    } else {
                        b.push_str(t);
                    }
                }
                Func::Split(p, sep) => {
                    let t = tokens[*p];
                    let parts: Vec<&str> = if sep.is_empty() {
                        // Go's strings.Split with an empty separator splits into characters.
                        t.char_indices()
                            .map(|(i, c)| &t[i..i + c.len_utf8()])
                            .collect()
                    } else {
                        t.split(sep.as_str()).collect()
                    };
                    for (j, part) in parts.iter().enumerate() {
                        b.push_str(part);
                        if j + 1 < parts.len()
                            && !parts[j + 1].is_empty()
                            && !(j == 0 && part.is_empty())
                        {
                            b.push('.');
                        }
                    }
                }
                Func::Left(p, n) => {
                    let t = tokens[*p];
                    let n = *n as isize;
                    if n > 0 && (n as usize) < t.len() {
                        b.push_str(&t[..n as usize]);
                    } else {
                        b.push_str(t);
                    }
                }
                Func::Right(p, n) => {
                    let t = tokens[*p];
                    let n = *n as isize;
                    if n > 0 && (n as usize) < t.len() {
                        b.push_str(&t[t.len() - n as usize..]);
                    } else {
                        b.push_str(t);
                    }
                }
                Func::Random(n) => {
                    let v = if *n <= 0 {
                        0
                    } else {
                        rand::random_range(0..*n)
                    };
                    b.push_str(&v.to_string());
                }
            }
            if i < last {
                b.push('.');
            }
        }
        if self.dtoks.last().is_some_and(|t| t == ">") {
            let from = self.stoks.len() - 1;
            for (k, t) in tokens.iter().enumerate().skip(from) {
                b.push_str(t);
                if k + 1 < tokens.len() {
                    b.push('.');
                }
            }
        }
        b
    }
}

/// FNV-1a (32 bit) of `key` modulo `buckets`, the reference's partition function.
fn partition(key: &[u8], buckets: u32) -> u32 {
    if buckets == 0 {
        return 0;
    }
    let mut h: u32 = 0x811c9dc5;
    for b in key {
        h ^= *b as u32;
        h = h.wrapping_mul(0x01000193);
    }
    h % buckets
}

/// The reference's `ValidateMapping`, used for stream and source transforms: every
/// destination token is non-empty and free of whitespace, a mustache token names a known
/// function, and the transform compiles.
pub fn validate_mapping(src: &str, dest: &str) -> Result<(), TransformError> {
    if dest.is_empty() {
        return Ok(());
    }
    let mut fwc = false;
    for t in dest.split('.') {
        if t.is_empty() || fwc {
            return Err(err(t, Mapping::InvalidSubject));
        }
        if t.len() > 4 && t.starts_with("{{") && t.ends_with("}}") {
            match call(t) {
                Some(_) => continue,
                None => return Err(err(t, Mapping::UnknownFunction)),
            }
        }
        if t == ">" {
            fwc = true;
        } else if t
            .chars()
            .any(|c| matches!(c, '\t' | '\n' | '\x0c' | '\r' | ' '))
        {
            return Err(err("", Mapping::InvalidSubject));
        }
    }
    Transform::new(src, dest).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tr(src: &str, dest: &str) -> Transform {
        Transform::new(src, dest).unwrap().unwrap()
    }

    #[test]
    fn wildcards_and_dollar_forms() {
        assert_eq!(
            tr("t.*.*", "x.{{wildcard(2)}}.{{wildcard(1)}}")
                .apply("t.a.b")
                .unwrap(),
            "x.b.a"
        );
        assert_eq!(tr("t.*.*", "x.$2.$1").apply("t.a.b").unwrap(), "x.b.a");
        assert_eq!(
            tr("t.*.*", "x.{{ Wildcard( 1 ) }}").apply("t.a.b").unwrap(),
            "x.a"
        );
        assert_eq!(tr("", "w.>").apply("v.q").unwrap(), "w.v.q");
        assert_eq!(tr("a.>", "b.>").apply("a.x.y").unwrap(), "b.x.y");
        assert_eq!(tr("a.*.>", "b.$1.>").apply("a.x.y.z").unwrap(), "b.x.y.z");
        assert_eq!(tr(">", ">").apply("any.thing").unwrap(), "any.thing");
        assert_eq!(tr("a.*", "fixed").apply("a.x").unwrap(), "fixed");
        // Not matching the source, or not a literal subject: no transform.
        assert_eq!(tr("a.*", "b.$1").apply("c.x"), None);
        assert_eq!(tr("a.*", "b.$1").apply("a.*"), None);
        // `$x` that is not a number stays literal.
        assert_eq!(tr("a.*", "$KV.$1").apply("a.x").unwrap(), "$KV.x");
    }

    #[test]
    fn functions() {
        // Values checked against the reference's implementation.
        assert_eq!(
            tr("u.*", "x.{{partition(3,1)}}.$1").apply("u.abc").unwrap(),
            "x.2.abc"
        );
        assert_eq!(
            tr("p", "{{partition(10)}}").apply("p").unwrap(),
            partition(b"p", 10).to_string()
        );
        assert_eq!(
            tr("a.*", "{{splitFromLeft(1,2)}}")
                .apply("a.abcdef")
                .unwrap(),
            "ab.cdef"
        );
        assert_eq!(
            tr("a.*", "{{SplitFromRight(1,2)}}")
                .apply("a.abcdef")
                .unwrap(),
            "abcd.ef"
        );
        assert_eq!(
            tr("a.*", "{{sliceFromLeft(1,2)}}")
                .apply("a.abcde")
                .unwrap(),
            "ab.cd.e"
        );
        assert_eq!(
            tr("a.*", "{{sliceFromRight(1,2)}}")
                .apply("a.abcde")
                .unwrap(),
            "a.bc.de"
        );
        assert_eq!(
            tr("a.*", "{{split(1,-)}}").apply("a.-x--y-").unwrap(),
            "x.y"
        );
        assert_eq!(tr("a.*", "{{left(1,2)}}").apply("a.abcde").unwrap(), "ab");
        assert_eq!(tr("a.*", "{{right(1,2)}}").apply("a.abcde").unwrap(), "de");
        // The reference's own test vectors.
        for (src, dest, subject, want) in [
            ("*", "{{splitfromleft(1,3)}}", "12345", "123.45"),
            ("*", "{{SplitFromRight(1,3)}}", "12345", "12.345"),
            ("*", "{{SliceFromLeft(1,3)}}", "1234567890", "123.456.789.0"),
            (
                "*",
                "{{SliceFromRight(1,3)}}",
                "1234567890",
                "1.234.567.890",
            ),
            ("*", "{{split(1,-)}}", "-abc-def--ghi-", "abc.def.ghi"),
            ("*", "{{split(1,-)}}", "abc-def--ghi-", "abc.def.ghi"),
            (
                "*.*",
                "{{split(2,-)}}.{{splitfromleft(1,2)}}",
                "foo.-abc-def--ghij-",
                "abc.def.ghij.fo.o",
            ),
        ] {
            assert_eq!(tr(src, dest).apply(subject).unwrap(), want, "{dest}");
        }
        let r = tr("a.*", "r.{{random(5)}}").apply("a.x").unwrap();
        assert!(r.strip_prefix("r.").unwrap().parse::<u32>().unwrap() < 5);
    }

    #[test]
    fn errors_in_the_reference_words() {
        let e = |s: &str, d: &str| Transform::new(s, d).unwrap_err().to_string();
        assert_eq!(
            e("u.*", "x.$2"),
            "invalid mapping destination: wildcard index out of range in $2: [2]"
        );
        assert_eq!(e("q.*", "rp.*"), "invalid subject");
        assert_eq!(e("a.>", "b.c"), "invalid subject");
        assert_eq!(e("bad..x", "w"), "invalid subject");
        assert_eq!(
            e("a.*", "{{foo(1)}}"),
            "invalid mapping destination: unknown function in {{foo(1)}}"
        );
        assert_eq!(
            e("a.*", "{{wildcard()}}"),
            "invalid mapping destination: not enough arguments passed to the function in {{wildcard()}}"
        );
        assert_eq!(
            e("a.*", "{{wildcard(1,2)}}"),
            "invalid mapping destination: too many arguments passed to the function in {{wildcard(1,2)}}"
        );
        assert_eq!(
            e("a.*", "{{splitFromLeft(x,2)}}"),
            "invalid mapping destination: function argument is invalid or in the wrong format in {{splitFromLeft(x,2)}}"
        );
        assert_eq!(
            e("a", "{{wildcard(1)}}"),
            "invalid mapping destination: wildcard index out of range in {{wildcard(1)}}"
        );
        assert_eq!(Transform::new("a", ""), Ok(None));
        // ValidateMapping's own checks (texts from nats-server 2.15.1).
        assert!(validate_mapping("a.*", "{{left(1,2)}}").is_ok());
        assert_eq!(
            validate_mapping("a.*", "x.>.a").unwrap_err().to_string(),
            "invalid mapping destination: invalid transform in a"
        );
        assert_eq!(
            validate_mapping("a.*", "x. a").unwrap_err().to_string(),
            "invalid mapping destination: invalid transform"
        );
        assert_eq!(
            validate_mapping("a.*", "a..b").unwrap_err().to_string(),
            "invalid mapping destination: invalid transform"
        );
        assert!(validate_mapping("a.*", "b.{{partition(2,1)}}").is_ok());
    }
}
