//! JetStream API plumbing: the error type with the reference's codes and texts, and helpers
//! that build responses with `type` first and `error` right after it, as the reference does.

use serde_json::{Map, Value};

/// An API error as the reference reports it: HTTP-like `code`, NATS `err_code`, text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub code: u16,
    pub err_code: u32,
    pub description: String,
}

impl ApiError {
    pub fn new(code: u16, err_code: u32, description: impl Into<String>) -> Self {
        ApiError {
            code,
            err_code,
            description: description.into(),
        }
    }

    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("code".into(), self.code.into());
        m.insert("err_code".into(), self.err_code.into());
        m.insert("description".into(), self.description.clone().into());
        Value::Object(m)
    }

    pub fn stream_not_found() -> Self {
        Self::new(404, 10059, "stream not found")
    }
    pub fn invalid_json_body(body: &[u8], e: &serde_json::Error) -> Self {
        Self::new(
            400,
            10025,
            format!("invalid JSON: {}", go_json_error(body, e, true)),
        )
    }
    pub fn stream_mismatch() -> Self {
        Self::new(400, 10056, "stream name in subject does not match request")
    }
    pub fn name_in_use() -> Self {
        Self::new(
            400,
            10058,
            "stream name already in use with a different configuration",
        )
    }
    pub fn subjects_overlap() -> Self {
        Self::new(400, 10065, "subjects overlap with an existing stream")
    }
    pub fn invalid_config(text: impl Into<String>) -> Self {
        Self::new(500, 10052, text)
    }
    pub fn update_failed(text: impl Into<String>) -> Self {
        Self::new(500, 10069, text)
    }
    pub fn no_message_found() -> Self {
        Self::new(404, 10037, "no message found")
    }
    pub fn sequence_not_found(seq: u64) -> Self {
        Self::new(400, 10043, format!("sequence {seq} not found"))
    }
    pub fn bad_request() -> Self {
        Self::new(400, 10003, "bad request")
    }
    pub fn replicas_not_supported() -> Self {
        Self::new(
            500,
            10074,
            "replicas > 1 not supported in non-clustered mode",
        )
    }
    pub fn insufficient_storage() -> Self {
        Self::new(500, 10047, "insufficient storage resources available")
    }
    pub fn insufficient_memory() -> Self {
        Self::new(500, 10028, "insufficient memory resources available")
    }
    pub fn max_streams() -> Self {
        Self::new(400, 10027, "maximum number of streams reached")
    }
    pub fn sealed() -> Self {
        Self::new(400, 10109, "invalid operation on sealed stream")
    }
    pub fn purge_failed(text: impl Into<String>) -> Self {
        Self::new(500, 10110, text)
    }
    pub fn msg_delete_failed(text: impl Into<String>) -> Self {
        Self::new(500, 10057, text)
    }
    pub fn not_supported(what: &str) -> Self {
        Self::invalid_config(format!("{what} is not supported by keel-server yet"))
    }
}

/// serde_json's error in the words of Go's encoding/json, which clients and tests match on
/// for the common syntax errors; `with_offset` appends Go's `at offset N` as the API does.
pub fn go_json_error(body: &[u8], e: &serde_json::Error, with_offset: bool) -> String {
    use serde_json::error::Category;
    let offset = if e.line() <= 1 {
        e.column()
    } else {
        // Byte offset of the error position across lines.
        let mut line = 1;
        let mut pos = 0;
        for (i, b) in body.iter().enumerate() {
            if line == e.line() {
                pos = i + e.column();
                break;
            }
            if *b == b'\n' {
                line += 1;
            }
        }
        pos
    };
    let at = body.get(offset.saturating_sub(1)).copied();
    let msg = e.to_string();
    if let Some(rest) = msg.strip_prefix("unknown variant `") {
        // Go's enum unmarshalers answer with the quoted JSON value.
        let value = rest.split('`').next().unwrap_or_default();
        return format!("can not unmarshal {:?}", format!("\"{value}\""));
    }
    if msg.starts_with("invalid type: string") && msg.contains("expected i64") {
        return "json: cannot unmarshal string into Go value of type time.Duration".into();
    }
    let text = match (e.classify(), at) {
        (Category::Eof, _) => return "unexpected end of JSON input".into(),
        (Category::Syntax, Some(c)) if msg.starts_with("key must be a string") => {
            format!(
                "invalid character '{}' looking for beginning of object key string",
                c as char
            )
        }
        (Category::Syntax, Some(c)) if msg.starts_with("expected value") => {
            format!(
                "invalid character '{}' looking for beginning of value",
                c as char
            )
        }
        _ => return msg,
    };
    if with_offset {
        format!("{text} at offset {offset}")
    } else {
        text
    }
}

/// Starts a response object with its `type`.
pub fn response(kind: &str) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert(
        "type".into(),
        format!("io.nats.jetstream.api.v1.{kind}_response").into(),
    );
    m
}

/// A complete error response: `type`, `error`, then any extra fields.
pub fn error_response(kind: &str, e: &ApiError, extra: &[(&str, Value)]) -> Vec<u8> {
    let mut m = response(kind);
    m.insert("error".into(), e.to_json());
    for (k, v) in extra {
        m.insert((*k).into(), v.clone());
    }
    to_bytes(&Value::Object(m))
}

/// Compact JSON with `<`, `>` and `&` escaped as the reference's encoder does.
pub fn to_bytes(v: &Value) -> Vec<u8> {
    let s = serde_json::to_string(v).expect("JSON values serialize");
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            c => out.push(c),
        }
    }
    out.into_bytes()
}

/// Parses a request body; an empty body is `{}`.
pub fn parse_body<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    // async-nats sends `null` where other clients send nothing.
    if body.iter().all(|b| b.is_ascii_whitespace()) || body.trim_ascii() == b"null" {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| ApiError::invalid_json_body(body, &e))
}
