//! Subject rules as the reference applies them: tokens separated by `.`, none empty; `*`
//! matches one token and `>` the rest (at least one token), and each is a wildcard only as a
//! whole token. Whitespace is never part of a subject.

/// Valid for SUB: non-empty tokens, no whitespace, `>` only as the last token.
pub fn valid_subscribe(subject: &[u8]) -> bool {
    if subject.is_empty() {
        return false;
    }
    let mut tokens = subject.split(|&b| b == b'.').peekable();
    while let Some(t) = tokens.next() {
        if t.is_empty() || t.iter().any(|b| b.is_ascii_whitespace()) {
            return false;
        }
        if t == b">" && tokens.peek().is_some() {
            return false;
        }
    }
    true
}

/// Valid for PUB in pedantic mode: a subscribe-valid subject with no wildcard token.
pub fn valid_publish(subject: &[u8]) -> bool {
    valid_subscribe(subject) && !has_wildcard(subject)
}

/// True when some whole token is `*` or `>`.
pub fn has_wildcard(subject: &[u8]) -> bool {
    subject
        .split(|&b| b == b'.')
        .any(|t| t == b"*" || t == b">")
}

/// Does the literal `subject` match `pattern` (which may hold wildcards)?
pub fn matches(pattern: &[u8], subject: &[u8]) -> bool {
    let mut p = pattern.split(|&b| b == b'.');
    let mut s = subject.split(|&b| b == b'.');
    loop {
        match (p.next(), s.next()) {
            (Some(b">"), Some(_)) => return true,
            (Some(pt), Some(st)) => {
                if pt != b"*" && pt != st {
                    return false;
                }
            }
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subscribe_rules() {
        for ok in [
            "foo",
            "foo.*",
            "foo.>",
            "*",
            ">",
            "a.*.>",
            "foo*bar",
            "$JS.API.>",
        ] {
            assert!(valid_subscribe(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "",
            "foo..bar",
            "foo.>.bar",
            ".foo",
            "foo.",
            "fo o",
            "a\tb",
            "a.\r",
        ] {
            assert!(!valid_subscribe(bad.as_bytes()), "{bad:?}");
        }
    }

    #[test]
    fn publish_rules() {
        assert!(valid_publish(b"foo.bar"));
        assert!(valid_publish(b"foo*.bar"));
        assert!(!valid_publish(b"foo.*"));
        assert!(!valid_publish(b"foo.>"));
        assert!(!valid_publish(b"foo..bar"));
    }

    #[test]
    fn matching() {
        assert!(matches(b"foo.*", b"foo.a"));
        assert!(!matches(b"foo.*", b"foo.a.b"));
        assert!(matches(b"foo.>", b"foo.a.b"));
        assert!(!matches(b"foo.>", b"foo"));
        assert!(matches(b"a.*.>", b"a.b.c"));
        assert!(!matches(b"a.*.>", b"a.b"));
        assert!(matches(b">", b"x"));
        assert!(!matches(b"foo", b"foo.bar"));
    }
}
