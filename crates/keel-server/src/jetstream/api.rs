//! JetStream API plumbing: the error type with the reference's codes and texts, and helpers
//! that build responses with `type` first and `error` right after it, as the reference does.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::schema::{Field, Schema};

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

/// Parses an API request the way the reference does: an empty body (or `null`, which
/// async-nats sends where other clients send nothing) is the zero request; otherwise the JSON
/// is brought into Go's view by [`normalize`] (nulls absent, keys case-insensitive, unknown
/// fields refused when `strict`) and then decoded.
pub fn parse_request<T: DeserializeOwned + Default>(
    body: &[u8],
    schema: &Schema,
    strict: bool,
) -> Result<T, ApiError> {
    let trimmed = body.trim_ascii();
    if trimmed.is_empty() || trimmed == b"null" {
        return Ok(T::default());
    }
    let mut v: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::invalid_json_body(body, &e))?;
    normalize(&mut v, schema, strict)
        .map_err(|text| ApiError::new(400, 10025, format!("invalid JSON: {text}")))?;
    serde_json::from_value(v).map_err(|e| ApiError::invalid_json_body(body, &e))
}

/// Like [`parse_request`] for the bodies the reference decodes leniently (pull requests,
/// direct gets): unknown fields are ignored; the error is Go's text without an offset.
pub fn parse_lenient<T: DeserializeOwned>(body: &[u8], schema: &Schema) -> Result<T, String> {
    let mut v: Value = serde_json::from_slice(body).map_err(|e| go_json_error(body, &e, false))?;
    normalize(&mut v, schema, false)?;
    serde_json::from_value(v).map_err(|e| go_json_error(body, &e, false))
}

/// Rewrites a request object into what Go's decoder would see: `null` members dropped (Go
/// leaves such a field at its zero value, which is what an absent field gets here), `null`
/// map values made empty strings, keys renamed to the field they match case-insensitively.
/// A `null` enum fails with the reference's text; with `strict`, so does an unknown field.
pub fn normalize(v: &mut Value, schema: &Schema, strict: bool) -> Result<(), String> {
    let Value::Object(m) = v else {
        return Ok(());
    };
    for (key, mut val) in std::mem::take(m) {
        let Some((name, field)) = schema.field(&key) else {
            if strict {
                return Err(format!("json: unknown field {key:?}"));
            }
            continue;
        };
        match field {
            Field::Enum(text) if val.is_null() => return Err((*text).to_string()),
            _ if val.is_null() => continue,
            Field::Map => {
                if let Value::Object(entries) = &mut val {
                    for e in entries.values_mut().filter(|e| e.is_null()) {
                        *e = Value::from("");
                    }
                }
            }
            Field::Obj(inner) => normalize(&mut val, inner, strict)?,
            Field::List(inner) => {
                if let Value::Array(items) = &mut val {
                    for item in items {
                        normalize(item, inner, strict)?;
                    }
                }
            }
            Field::Value | Field::Enum(_) => {}
        }
        m.insert((*name).to_string(), val);
    }
    Ok(())
}

/// Requests that take no body (stream delete, consumer info and delete) refuse one, as the
/// reference does; `{}` counts as empty.
pub fn expect_empty(body: &[u8]) -> Result<(), ApiError> {
    let empty = body.is_empty()
        || serde_json::from_slice::<Value>(body)
            .is_ok_and(|v| v.as_object().is_some_and(|m| m.is_empty()));
    if empty {
        Ok(())
    } else {
        Err(ApiError::new(
            400,
            10038,
            "expected an empty request payload",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jetstream::schema;

    fn norm(body: &str, strict: bool) -> Result<Value, String> {
        let mut v: Value = serde_json::from_str(body).unwrap();
        normalize(&mut v, &schema::CONSUMER_CREATE, strict).map(|_| v)
    }

    #[test]
    fn nulls_are_absent_except_enums() {
        let v = norm(
            r#"{"stream_name":"S","config":{"name":null,"max_deliver":null,"metadata":{"a":null,"b":"x"},"backoff":null}}"#,
            true,
        )
        .unwrap();
        assert_eq!(
            v,
            serde_json::json!({"stream_name":"S","config":{"metadata":{"a":"","b":"x"}}})
        );
        assert_eq!(
            norm(r#"{"config":{"ack_policy":null}}"#, true).unwrap_err(),
            "can not unmarshal \"null\""
        );
        assert_eq!(
            norm(r#"{"action":null}"#, false).unwrap_err(),
            "unknown consumer action: null"
        );
    }

    #[test]
    fn unknown_fields_and_key_case() {
        assert_eq!(
            norm(r#"{"config":{"zzz":1}}"#, true).unwrap_err(),
            "json: unknown field \"zzz\""
        );
        assert_eq!(
            norm(r#"{"config":{"zzz":1}}"#, false).unwrap(),
            serde_json::json!({"config":{}})
        );
        assert_eq!(
            norm(r#"{"Stream_Name":"S"}"#, true).unwrap(),
            serde_json::json!({"stream_name":"S"})
        );
    }

    #[test]
    fn empty_requests() {
        assert!(expect_empty(b"").is_ok());
        assert!(expect_empty(b"{}").is_ok());
        assert!(expect_empty(b" { } ").is_ok());
        assert_eq!(expect_empty(b"null").unwrap_err().err_code, 10038);
        assert_eq!(expect_empty(br#"{"a":1}"#).unwrap_err().err_code, 10038);
    }
}
